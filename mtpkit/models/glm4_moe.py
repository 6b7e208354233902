"""GLM-4.5 / 4.6 / 4.7 and GLM-4.5-Air (``glm4_moe``): GQA + DeepSeek-style MoE, native MTP.

Attention is grouped-query with q/k/v biases (``attention_bias``; o_proj never has one), an
optional per-head q/k RMSNorm (``use_qk_norm``) and rotary embedding on the first
``partial_rotary_factor`` of each head in the half-split (NeoX) layout, as transformers and
vLLM apply it. The first ``first_k_dense_replace`` layers have a dense MLP, the rest
DeepSeek-V3 routing (see ``moe.GroupedMoE``). The MTP head is stored DeepSeek-style as
``model.layers.{num_hidden_layers + i}.*`` (92 for GLM-4.5, 46 for Air) and renamed onto
``mtp.*`` on load.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .attention import Attention
from .base import CausalLM
from .config import ConfigBase, require, rope_settings
from .layers import DecoderStack, PreNormDecoderLayer, RMSNorm, Rotary
from .moe import make_grouped_mlp, moe_fields, validate_moe
from .mtp import DeepSeekStyleMTP


@dataclass
class Glm4MoeConfig(ConfigBase):
    """The config.json keys of a GLM-4.5-family checkpoint that we use."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    partial_rotary_factor: float = 0.5
    max_position_embeddings: int = 131072
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    use_qk_norm: bool = False
    hidden_act: str = "silu"
    n_routed_experts: int = 0
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 0
    n_shared_experts: int = 0
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    first_k_dense_replace: int = 0
    num_nextn_predict_layers: int = 0

    @classmethod
    def from_hf_config(cls, d: dict) -> Glm4MoeConfig:
        """Keep the known keys (top level or rope_parameters), fill defaults, validate."""
        mt = d.get("model_type", "glm4_moe")
        require(d, "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                model_type=mt)
        heads = d["num_attention_heads"]
        theta, scaling, rope = rope_settings(d)
        # transformers fills 0.5 when a GLM config omits it (the released configs say 0.5).
        partial = d.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 0.5
        cfg = cls(
            model_type=mt,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d.get("intermediate_size") or 0,
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-5),
            rope_theta=theta,
            rope_scaling=scaling,
            partial_rotary_factor=float(partial),
            max_position_embeddings=d.get("max_position_embeddings", 131072),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", False)),
            use_qk_norm=bool(d.get("use_qk_norm", False)),
            hidden_act=d.get("hidden_act", "silu"),
            **moe_fields(d),
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Reject configs this family cannot run."""
        super().validate()
        validate_moe(self)

    def is_moe(self, i: int) -> bool:
        """Whether layer i (MTP layers count on from num_hidden_layers) has experts."""
        return self.n_routed_experts > 0 and i >= self.first_k_dense_replace


class Glm4MoeDecoderLayer(PreNormDecoderLayer):
    """Pre-norm GQA + dense or MoE MLP."""

    def __init__(self, cfg: Glm4MoeConfig, moe: bool) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(
            cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
            bias=cfg.attention_bias, o_bias=False, qk_norm=cfg.use_qk_norm,
            rms_norm_eps=cfg.rms_norm_eps,
        )
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = make_grouped_mlp(cfg, moe)


class Glm4MoeForCausalLM(DeepSeekStyleMTP, CausalLM):
    """GLM-4.5-family trunk with its native MTP layer."""

    config_class = Glm4MoeConfig

    def __init__(self, cfg: Glm4MoeConfig) -> None:
        super().__init__(cfg)
        self.model = DecoderStack(
            cfg.vocab_size, cfg.hidden_size,
            [Glm4MoeDecoderLayer(cfg, cfg.is_moe(i)) for i in range(cfg.num_hidden_layers)],
            RMSNorm(cfg.hidden_size, cfg.rms_norm_eps),
        )
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        rot = int(cfg.head_dim * cfg.partial_rotary_factor)
        self.rotary = Rotary(rot - rot % 2, cfg.rope_theta, cfg.rope_scaling)
        n = cfg.num_hidden_layers
        self.mtp = self.build_mtp(cfg, lambda i: Glm4MoeDecoderLayer(cfg, cfg.is_moe(n + i)))
