"""Kimi-K2.5 (``kimi_k25``) and Kimi-K2 (``kimi_k2``): a DeepSeek-V3 text model.

Kimi-K2.5 is a vision-language wrapper whose ``text_config`` is a DeepSeek-V3 config (its
``model_type`` says ``kimi_k2``; transformers rewrites that to ``deepseek_v3`` when it loads
or saves one). mtpkit runs the text model only: the vision tower and the projector are
skipped on load, as the Qwen3.5 VLM's vision tower is. Kimi-K2 (text only) is the same
trunk at the top level, under ``model.*``.

The text model's tensors carry the wrapper's prefix, and which one depends on who wrote
the checkpoint:

- the release: ``language_model.model.*`` and ``language_model.lm_head``;
- NVIDIA's NVFP4 export: ``language_model.layers.*`` (SGLang maps it the same way);
- transformers 5.23 in memory: ``model.language_model.*`` and ``lm_head``; its
  ``save_pretrained`` writes the release's names back, except that the vision tower's
  ``blocks`` -> ``layers`` rename is reverted on the text layers too, giving
  ``language_model.model.blocks.*`` (which it reads back itself, so such copies exist).

An MTP layer, when the text config declares ``num_nextn_predict_layers``, sits where
DeepSeek-V3 keeps it, below the same prefix: ``language_model.model.layers.{L}.*``.
"""

from __future__ import annotations

import re

from .deepseek_v3 import DeepseekV3ForCausalLM

# (pattern, replacement or None to skip), first match wins; applied before the MTP layer's
# renaming, which expects the text model's own model.layers.{L}.* names.
KIMI_PREFIXES: list[tuple[str, str | None]] = [
    (r"^(model\.)?(vision_tower|mm_projector)\.", None),
    (r"^language_model\.model\.blocks\.", "model.layers."),
    (r"^language_model\.model\.", "model."),
    (r"^language_model\.layers\.", "model.layers."),
    (r"^language_model\.lm_head\.", "lm_head."),
    (r"^model\.language_model\.", "model."),
]


def text_model_name(name: str) -> str | None:
    """A Kimi-K2.5 tensor name -> the text model's own name (None: vision, skipped)."""
    for pattern, repl in KIMI_PREFIXES:
        if re.match(pattern, name):
            return None if repl is None else re.sub(pattern, repl, name)
    return name


class KimiK25ForCausalLM(DeepseekV3ForCausalLM):
    """The DeepSeek-V3 model, reading Kimi-K2.5's wrapper prefixes."""

    def map_checkpoint_name(self, name: str) -> str | None:
        """Strip the wrapper's prefix, then map as DeepSeek-V3 (MTP layer included)."""
        inner = text_model_name(name)
        return None if inner is None else super().map_checkpoint_name(inner)
