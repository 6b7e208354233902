"""GLM-4.7-Flash (``glm4_moe_lite``): DeepSeek-V3's trunk under GLM's name, native MTP.

The attention is DeepSeek's Multi-head Latent Attention (q LoRA, ``kv_a_proj_with_mqa``,
``kv_b_proj``, interleaved rope by default) and the MoE is DeepSeek-V3 routing with shared
experts, so this family is DeepSeek-V3's modules under another config. What differs:

- which layers have experts: transformers reads a per-layer ``mlp_layer_types`` list
  ("dense" / "sparse"), and when it is absent makes layer 0 dense and the rest sparse;
  ``first_k_dense_replace`` is not read by transformers. vLLM reads
  ``first_k_dense_replace``; the release's config says 1, where both agree.
- rotary covers the whole ``qk_rope_head_dim`` (transformers maps ``head_dim`` onto it), so a
  GLM-style ``partial_rotary_factor`` does not apply to the MLA rope part.
- defaults: ``rms_norm_eps`` 1e-5, as GLM.

The MTP layer is stored DeepSeek-style at ``model.layers.{num_hidden_layers}`` (47 in the
release; transformers ignores ``model.layers.47.*`` on load), with enorm / hnorm / eh_proj /
shared_head and a MoE block, counted by ``num_nextn_predict_layers``.
"""

from __future__ import annotations

from dataclasses import dataclass

from .deepseek_v3 import DeepseekV3Config, DeepseekV3ForCausalLM

MLP_KINDS = ("dense", "sparse")


@dataclass
class Glm4MoeLiteConfig(DeepseekV3Config):
    """DeepSeek-V3's keys plus GLM-4.7-Flash's per-layer MLP kinds."""

    rms_norm_eps: float = 1e-5
    mlp_layer_types: list[str] | None = None

    @classmethod
    def from_hf_config(cls, d: dict) -> Glm4MoeLiteConfig:
        """DeepSeek-V3's reading, then the MLP kind of every trunk layer."""
        d = {"model_type": "glm4_moe_lite", "rms_norm_eps": 1e-5, **d}
        cfg = super().from_hf_config(d)
        n = cfg.num_hidden_layers
        kinds = d.get("mlp_layer_types")
        if kinds is None:
            # transformers' default is one dense layer first; a config that only says
            # first_k_dense_replace (vLLM's key) gets what it says.
            dense = d.get("first_k_dense_replace")
            dense = 1 if dense is None else int(dense)
            kinds = ["dense"] * min(dense, n) + ["sparse"] * max(n - dense, 0)
        cfg.mlp_layer_types = list(kinds)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """DeepSeek-V3's checks, and mlp_layer_types naming one known kind per layer."""
        super().validate()
        kinds = self.mlp_layer_types
        if kinds is None:
            return
        if len(kinds) != self.num_hidden_layers or any(k not in MLP_KINDS for k in kinds):
            self.fail(f"mlp_layer_types must list 'dense' or 'sparse' for each of the "
                      f"{self.num_hidden_layers} layers; got {kinds!r}")
        if "sparse" in kinds and self.n_routed_experts <= 0:
            self.fail("mlp_layer_types has sparse layers but n_routed_experts is 0")
        if "dense" in kinds and self.intermediate_size <= 0:
            self.fail("dense layers need intermediate_size")

    def is_moe(self, i: int) -> bool:
        """Layer i's kind from mlp_layer_types; MTP layers (past the list) have experts, as
        the release stores them."""
        if self.mlp_layer_types is None or i >= len(self.mlp_layer_types):
            return self.n_routed_experts > 0
        return self.mlp_layer_types[i] == "sparse"


class Glm4MoeLiteForCausalLM(DeepseekV3ForCausalLM):
    """GLM-4.7-Flash: the DeepSeek-V3 model built from Glm4MoeLiteConfig."""

    config_class = Glm4MoeLiteConfig
