"""DeepSeek-V3 / R1 (``deepseek_v3``): Multi-head Latent Attention, DeepSeek MoE, native MTP.

MLA compresses keys and values into one latent per position: ``kv_a_proj_with_mqa`` gives
the latent c (``kv_lora_rank`` wide, then ``kv_a_layernorm``) and one rotary key shared by
all heads (``qk_rope_head_dim``); ``kv_b_proj`` expands c into per-head no-rope keys and
values. The cache keeps only c and the rotated rope key (``LatentCache``), 576 numbers per
position for V3 instead of 128 heads x (192 + 128). Prefill expands the cache into keys and
values; short passes (decoding, verification, drafting) use the absorbed form, where the
query is projected into latent space instead, which gives the same attention without
expanding every cached position. Queries come from ``q_proj`` or, when ``q_lora_rank`` is
set, ``q_b_proj(q_a_layernorm(q_a_proj(x)))``. Rotary embedding uses DeepSeek's interleaved
pairs (``rope_interleave``, the default) with optional YaRN scaling, whose mscale also
enlarges the softmax scale. The MTP layer is stored at ``model.layers.{num_hidden_layers}``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..quant.linear import dtype_device
from .attention import PackedCaches, causal_mask
from .base import CausalLM
from .cache import KVCache
from .config import ConfigBase, require, rope_settings
from .layers import DecoderStack, PreNormDecoderLayer, RMSNorm, Rotary, yarn_mscale
from .moe import make_grouped_mlp, moe_fields, validate_moe
from .mtp import DeepSeekStyleMTP

# Passes of at most this many tokens attend in latent space (absorbed weights).
ABSORB_MAX_TOKENS = 16


@dataclass
class DeepseekV3Config(ConfigBase):
    """The config.json keys of a DeepSeek-V3-family checkpoint that we use."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rope_interleave: bool = True
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
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
    def from_hf_config(cls, d: dict) -> DeepseekV3Config:
        """Keep the known keys (rope_scaling or rope_parameters), fill defaults, validate."""
        mt = d.get("model_type", "deepseek_v3")
        require(d, "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                model_type=mt)
        theta, scaling, _ = rope_settings(d)
        heads = d["num_attention_heads"]
        cfg = cls(
            model_type=mt,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d.get("intermediate_size") or 0,
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            # MLA has no KV heads to share; the field is the head count in every release.
            num_key_value_heads=heads,
            kv_lora_rank=d["kv_lora_rank"],
            qk_nope_head_dim=d["qk_nope_head_dim"],
            qk_rope_head_dim=d["qk_rope_head_dim"],
            v_head_dim=d["v_head_dim"],
            q_lora_rank=d.get("q_lora_rank"),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            rope_interleave=bool(d.get("rope_interleave", True)),
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", False)),
            hidden_act=d.get("hidden_act", "silu"),
            **moe_fields(d),
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Reject configs this family cannot run."""
        super().validate()
        validate_moe(self)
        if self.qk_rope_head_dim % 2:
            self.fail(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even")

    def is_moe(self, i: int) -> bool:
        """Whether layer i (MTP layers count on from num_hidden_layers) has experts."""
        return self.n_routed_experts > 0 and i >= self.first_k_dense_replace

    def softmax_scale(self) -> float:
        """1/sqrt(qk head dim), times YaRN's mscale(mscale_all_dim) squared when scaled."""
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        m_all = (self.rope_scaling or {}).get("mscale_all_dim")
        if self.rope_scaling and m_all:
            scale *= yarn_mscale(self.rope_scaling["factor"], m_all) ** 2
        return scale


class LatentCache(KVCache):
    """MLA cache: ``k`` holds the normed latent c [B, 1, T, kv_lora_rank], ``v`` the rotated
    rope key [B, 1, T, qk_rope_head_dim]; trimming and masking are KVCache's."""


class MLAttention(nn.Module):
    """Multi-head Latent Attention; module names as in DeepSeek-V3 checkpoints."""

    packs = True  # forward takes PackedCaches (CausalLM.packable)

    def __init__(self, cfg: DeepseekV3Config) -> None:
        super().__init__()
        self.h, self.r = cfg.num_attention_heads, cfg.kv_lora_rank
        self.dn, self.dr, self.dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.interleave, self.scale = cfg.rope_interleave, cfg.softmax_scale()
        d, qk = cfg.hidden_size, self.h * (self.dn + self.dr)
        bias = cfg.attention_bias
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(d, qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, cfg.q_lora_rank, bias=bias)
            # The latent norms use DeepSeek's fixed eps, not rms_norm_eps (as transformers).
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, self.r + self.dr, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.r, 1e-6)
        self.kv_b_proj = nn.Linear(self.r, self.h * (self.dn + self.dv), bias=False)
        self.o_proj = nn.Linear(self.h * self.dv, d, bias=bias)
        self.absorb: bool | None = None  # None: by pass length; True/False forces (tests)

    def new_cache(self, batch: int, max_len: int) -> LatentCache:
        """A cache of latents and rope keys for this layer."""
        dtype, device = dtype_device(self.kv_a_proj_with_mqa)
        return LatentCache(batch, 1, max_len, self.r, dtype, device, v_head_dim=self.dr)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.interleave:
            # Pairs (x0, x1), (x2, x3)... rotate together: de-interleave them into the
            # half-split layout. Queries and keys get the same permutation, so scores are
            # unchanged, and this is exactly the order transformers produces.
            x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
        return Rotary.apply(x, cos, sin)

    def forward(self, x, cos, sin, cache: LatentCache | PackedCaches | None) -> torch.Tensor:
        """x [B, T, D] at positions cache.length.. -> [B, T, D]. With ``PackedCaches``, x
        [1, sum T_i, D] holds several sequences one after another: the projections run once
        over all their rows and each sequence attends over its own latent cache."""
        _, q_nope, q_rot, c, k_rot = self.project(x, cos, sin)
        if isinstance(cache, PackedCaches):
            return self.o_proj(cache.each(
                lambda qn, qr, cn, kr, lc: self.attend(qn, qr, cn, kr, lc, project=False),
                q_nope, q_rot, c, k_rot, dim=2, out_dim=1))
        return self.attend(q_nope, q_rot, c, k_rot, cache)

    def project(self, x, cos, sin):
        """x [B, T, D] -> (query latent or None, q_nope, rotated q_rot [B, H, T, *],
        normed latent c [B, 1, T, r], rotated rope key [B, 1, T, dr])."""
        b, t, _ = x.shape
        q_lat = None
        if hasattr(self, "q_proj"):
            q = self.q_proj(x)
        else:
            q_lat = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(q_lat)
        q = q.view(b, t, self.h, self.dn + self.dr).transpose(1, 2)
        q_nope, q_rot = q.split([self.dn, self.dr], dim=-1)
        c, k_rot = self.kv_a_proj_with_mqa(x).split([self.r, self.dr], dim=-1)
        c = self.kv_a_layernorm(c)[:, None]  # [B, 1, T, r]
        q_rot, k_rot = self._rope(q_rot, cos, sin), self._rope(k_rot[:, None], cos, sin)
        return q_lat, q_nope, q_rot, c, k_rot

    def attend(self, q_nope, q_rot, c, k_rot, cache: LatentCache | None,
               keep: torch.Tensor | None = None, project: bool = True) -> torch.Tensor:
        """Write c / k_rot to the cache and attend -> [B, T, D]; ``keep`` [B, T, S] (bool),
        when given, narrows the keys each query sees further (sparse attention);
        ``project=False``: the heads' output [B, T, H * dv] before o_proj."""
        b, _, t, _ = q_nope.shape
        start, keys = 0, None
        if cache is not None:
            start = cache.length
            c, k_rot = cache.update(c, k_rot)
            keys = cache.key_mask(start + t)
        mask = causal_mask(start, t, q_nope.device)
        if keys is not None:
            mask = keys[None, :] if mask is None else mask & keys[None, :]
        if keep is not None:
            mask = keep[:, None] if mask is None else mask & keep[:, None]
        absorb = self.absorb if self.absorb is not None else t <= ABSORB_MAX_TOKENS
        w = self.kv_b_proj.weight.view(self.h, self.dn + self.dv, self.r)
        if absorb:
            # scores = q_nope . (W_k c) + q_rot . k_rot = (W_k^T q_nope) . c + q_rot . k_rot,
            # and out = W_v (softmax . c): attention runs on the latent itself.
            q_lat = torch.einsum("bhtd,hdr->bhtr", q_nope, w[:, : self.dn])
            s = c.shape[2]
            key = torch.cat([c, k_rot], dim=-1).expand(b, self.h, s, self.r + self.dr)
            o = F.scaled_dot_product_attention(
                torch.cat([q_lat, q_rot], dim=-1), key, c.expand(b, self.h, s, self.r),
                attn_mask=mask, scale=self.scale,
            )
            out = torch.einsum("bhtr,hvr->bthv", o, w[:, self.dn :])
        else:
            kv = self.kv_b_proj(c[:, 0]).view(b, -1, self.h, self.dn + self.dv).transpose(1, 2)
            k_nope, v = kv.split([self.dn, self.dv], dim=-1)
            k = torch.cat([k_nope, k_rot.expand(-1, self.h, -1, -1)], dim=-1)
            q = torch.cat([q_nope, q_rot], dim=-1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
            out = out.transpose(1, 2)
        out = out.reshape(b, t, self.h * self.dv)
        return self.o_proj(out) if project else out


class DeepseekV3DecoderLayer(PreNormDecoderLayer):
    """Pre-norm MLA + dense or MoE MLP."""

    def __init__(self, cfg: DeepseekV3Config, moe: bool) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = make_grouped_mlp(cfg, moe)


class DeepseekV3ForCausalLM(DeepSeekStyleMTP, CausalLM):
    """DeepSeek-V3-family trunk with its native MTP layer."""

    config_class = DeepseekV3Config

    def __init__(self, cfg: DeepseekV3Config) -> None:
        super().__init__(cfg)
        self.model = DecoderStack(
            cfg.vocab_size, cfg.hidden_size,
            [DeepseekV3DecoderLayer(cfg, cfg.is_moe(i)) for i in range(cfg.num_hidden_layers)],
            RMSNorm(cfg.hidden_size, cfg.rms_norm_eps),
        )
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.rotary = Rotary(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling)
        n = cfg.num_hidden_layers
        self.mtp = self.build_mtp(cfg, lambda i: DeepseekV3DecoderLayer(cfg, cfg.is_moe(n + i)))
