"""Qwen3-Next and Qwen3.5 / 3.6 (dense and MoE): hybrid Gated DeltaNet + gated attention.

Layers alternate linear attention (Gated DeltaNet, recurrent state) and full attention (GQA
with an output gate, q/k norm and partial rotary); the MLP is dense or MoE with a shared
expert; every RMSNorm except the delta net's gated norm is zero-centred, x * (1 + w). The
native MTP head lives under ``mtp.*`` and has one full-attention layer of the trunk's kind.
Qwen3.5 releases are vision-language checkpoints: the text model sits under
``model.language_model.*`` and its config under ``text_config``; the vision tower is skipped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..quant.linear import dtype_device
from .attention import Attention
from .base import CausalLM
from .config import ConfigBase, require
from .gated_delta import GatedDeltaNet
from .layers import MLP, DecoderStack, RMSNorm, Rotary
from .moe import SparseMoE, split_fused_experts
from .mtp import MTPHead, MTPSpec


@dataclass
class Qwen3NextConfig(ConfigBase):
    """The config.json keys this family uses (Qwen3-Next, or Qwen3.5's text_config)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_types: list[str] = field(default_factory=list)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    num_experts: int = 0
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    norm_topk_prob: bool = True
    num_mtp_layers: int = 0

    @classmethod
    def from_hf_config(cls, d: dict) -> Qwen3NextConfig:
        """Keep the known keys (top-level or rope_parameters), validate."""
        mt = d.get("model_type", "qwen3_next")
        require(d, "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                model_type=mt)
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        n = d["num_hidden_layers"]
        types = d.get("layer_types")
        if not types:
            interval = d.get("full_attention_interval", 4)
            types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                     for i in range(n)]
        heads = d["num_attention_heads"]
        # Qwen3-Next says num_nextn_predict_layers (vLLM assumes 1 when absent); Qwen3.5
        # says mtp_num_hidden_layers in its text_config.
        mtp = d.get("mtp_num_hidden_layers", d.get("num_nextn_predict_layers"))
        cfg = cls(
            model_type=mt,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d.get("intermediate_size") or 0,
            num_hidden_layers=n,
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            layer_types=list(types),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(d.get("rope_theta") or rope.get("rope_theta") or 10000.0),
            partial_rotary_factor=float(
                d.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 0.25
            ),
            max_position_embeddings=d.get("max_position_embeddings", 32768),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", False)),
            linear_num_key_heads=d.get("linear_num_key_heads", 16),
            linear_num_value_heads=d.get("linear_num_value_heads", 32),
            linear_key_head_dim=d.get("linear_key_head_dim", 128),
            linear_value_head_dim=d.get("linear_value_head_dim", 128),
            linear_conv_kernel_dim=d.get("linear_conv_kernel_dim", 4),
            num_experts=d.get("num_experts") or 0,
            num_experts_per_tok=d.get("num_experts_per_tok") or 1,
            moe_intermediate_size=d.get("moe_intermediate_size") or 0,
            shared_expert_intermediate_size=d.get("shared_expert_intermediate_size") or 0,
            decoder_sparse_step=d.get("decoder_sparse_step") or 1,
            mlp_only_layers=list(d.get("mlp_only_layers") or []),
            norm_topk_prob=bool(d.get("norm_topk_prob", True)),
            num_mtp_layers=int(mtp or 0),
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Reject inconsistent hybrid configs."""
        super().validate()
        if len(self.layer_types) != self.num_hidden_layers:
            self.fail(f"layer_types has {len(self.layer_types)} entries for "
                      f"num_hidden_layers={self.num_hidden_layers}")
        unknown = set(self.layer_types) - {"full_attention", "linear_attention"}
        if unknown:
            self.fail(f"unknown layer_types {sorted(unknown)}")
        if self.num_experts == 0 and self.intermediate_size <= 0:
            self.fail("a dense model needs intermediate_size")

    def is_moe(self, i: int) -> bool:
        """Whether layer i (MTP layers count from num_hidden_layers) uses experts."""
        return (self.num_experts > 0 and i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0)


class Qwen3NextDecoderLayer(nn.Module):
    """Token mixer (linear_attn or self_attn) + dense or MoE MLP, zero-centred norms."""

    def __init__(self, cfg: Qwen3NextConfig, kind: str, moe: bool) -> None:
        super().__init__()
        self.cfg, self.kind = cfg, kind
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, zero_centered=True)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, zero_centered=True)
        if kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(
                cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim,
                eps, layout="qwen3_next" if cfg.model_type == "qwen3_next" else "qwen3_5",
            )
        else:
            self.self_attn = Attention(
                cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                bias=cfg.attention_bias, qk_norm=True, output_gate=True, rms_norm_eps=eps,
                zero_centered_norm=True,
            )
        if moe:
            self.mlp = SparseMoE(
                cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok,
                cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size,
                cfg.norm_topk_prob,
            )
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, cos, sin, cache) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.kind == "linear_attention":
            h = self.linear_attn(h, cache)
        else:
            h = self.self_attn(h, cos, sin, cache)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))

    def new_cache(self, batch: int, max_len: int):
        """KV cache for attention layers, recurrent state for delta-net layers."""
        if self.kind == "linear_attention":
            return self.linear_attn.new_cache(batch, dtype_device(self.linear_attn.out_proj)[1])
        return self.self_attn.new_cache(batch, max_len)


class Qwen3NextForCausalLM(CausalLM):
    """Qwen3-Next / Qwen3.5 trunk with its native ``mtp.*`` head."""

    config_class = Qwen3NextConfig
    checkpoint_renames = [
        (r"^model\.visual\.", None),  # the vision tower of Qwen3.5 VLM releases
        (r"^model\.language_model\.", "model."),
    ]

    def __init__(self, cfg: Qwen3NextConfig) -> None:
        super().__init__(cfg)
        self.model = DecoderStack(
            cfg.vocab_size, cfg.hidden_size,
            [Qwen3NextDecoderLayer(cfg, kind, cfg.is_moe(i))
             for i, kind in enumerate(cfg.layer_types)],
            RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zero_centered=True),
        )
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        rot = int(cfg.head_dim * cfg.partial_rotary_factor)
        self.rotary = Rotary(rot - rot % 2, cfg.rope_theta)
        self.mtp = None
        if cfg.num_mtp_layers:
            # vLLM feeds the head the trunk's normed output and chains the head's normed
            # output; embeddings come first in the concatenation.
            spec = MTPSpec(cfg.num_mtp_layers, emb_first=True, zero_centered=True,
                           eps=cfg.rms_norm_eps)
            n = cfg.num_hidden_layers
            self.mtp = MTPHead(
                cfg.hidden_size, spec,
                lambda i: Qwen3NextDecoderLayer(cfg, "full_attention", cfg.is_moe(n + i)),
            )

    def split_checkpoint_tensor(self, name: str, tensor_fn):
        """Qwen3.5-MoE stores experts stacked; split them into per-expert modules."""
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            return split_fused_experts(name, tensor_fn)
        return None
