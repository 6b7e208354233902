"""model_type -> family class. Families are imported when first asked for."""

from __future__ import annotations

import importlib

from .config import ConfigError

# model_type (top level or text_config) -> (module, class)
FAMILIES: dict[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("llama", "LlamaForCausalLM"),
    "qwen3": ("llama", "LlamaForCausalLM"),
    "mimo": ("llama", "LlamaForCausalLM"),
    "mimo_v2_flash": ("mimo_v2_flash", "MiMoV2FlashForCausalLM"),
    "glm4_moe": ("glm4_moe", "Glm4MoeForCausalLM"),
    "deepseek_v3": ("deepseek_v3", "DeepseekV3ForCausalLM"),
    "deepseek_v4": ("deepseek_v4", "DeepseekV4ForCausalLM"),
    "glm4_moe_lite": ("glm4_moe_lite", "Glm4MoeLiteForCausalLM"),
    "glm_moe_dsa": ("glm_moe_dsa", "GlmMoeDsaForCausalLM"),
    "kimi_k25": ("kimi_k25", "KimiK25ForCausalLM"),
    "kimi_k2": ("kimi_k25", "KimiK25ForCausalLM"),  # Kimi-K2.5's text_config says kimi_k2
    # Step-3.7-Flash wraps a step3p5 text model (its text_config's model_type); 3.5 is text only.
    "step3p5": ("step3p7", "Step3p7ForCausalLM"),
    "step3p7": ("step3p7", "Step3p7ForCausalLM"),
    "qwen3_next": ("qwen3_next", "Qwen3NextForCausalLM"),
    "qwen3_5": ("qwen3_next", "Qwen3NextForCausalLM"),
    "qwen3_5_text": ("qwen3_next", "Qwen3NextForCausalLM"),
    "qwen3_5_moe": ("qwen3_next", "Qwen3NextForCausalLM"),
    "qwen3_5_moe_text": ("qwen3_next", "Qwen3NextForCausalLM"),
}


def supported_model_types() -> list[str]:
    """Every model_type mtpkit runs."""
    return sorted(FAMILIES)


def family_for(model_type: str | None):
    """The model class for an HF model_type, or a ConfigError listing the supported ones."""
    if model_type not in FAMILIES:
        raise ConfigError(
            f"model_type {model_type!r} is not supported by mtpkit; supported: "
            f"{', '.join(supported_model_types())}"
        )
    module, cls = FAMILIES[model_type]
    return getattr(importlib.import_module(f"mtpkit.models.{module}"), cls)
