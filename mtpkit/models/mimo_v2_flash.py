"""MiMo-V2-Flash (``mimo_v2_flash``): hybrid sliding-window / full GQA attention, DeepSeek-style
MoE routing without shared experts, and three MTP layers.

As transformers 5.23 computes it (models/mimo_v2_flash):

- ``layer_types`` says which layers attend over a sliding window (``sliding_attention``) and
  which over everything; a window of W lets query q see keys q-W+1..q. Sliding-window layers
  have twice the full layers' KV heads and one attention-sink logit per query head
  (``self_attn.attention_sink_bias`` on disk, ``sinks`` in transformers): an extra softmax
  column that takes probability mass and adds nothing to the output.
- q and k heads are ``head_dim`` wide, v heads ``v_head_dim``; values are multiplied by
  ``attention_value_scale`` before attention; scores by head_dim**-0.5.
- rotary (half-split layout) on the first int(head_dim * partial_rotary_factor) channels,
  with each layer type's own theta (``rope_parameters[layer_type]``).
- ``mlp_layer_types``: dense SwiGLU or MoE (sigmoid scores + correction bias, group-limited
  top-k, routed scaling: moe.GroupedMoE with no shared experts).

The release's own config names (``hybrid_layer_pattern`` 1 = sliding, ``moe_layer_freq``,
``swa_*`` head counts and theta, ``sliding_window_size`` = W - 1, ``layernorm_epsilon``,
``add_swa_attention_sink_bias`` / ``add_full_attention_sink_bias``) are read too.

MTP: transformers drops ``model.mtp.*``. The names and wiring follow vLLM's MiMo-V2 MTP loader:
layer i is ``model.mtp.layers.{i}.{enorm, hnorm, eh_proj, input_layernorm, self_attn.*,
pre_mlp_layernorm, mlp.*, final_layernorm}``, x = eh_proj([enorm(emb), hnorm(h)]), one
sliding-window attention block (the sliding layers' heads, theta, window and sinks) with a
dense MLP, then final_layernorm, whose output both gives the logits and feeds the next step.
vLLM drafts with layer 0 only; mtpkit runs layer i at draft step i (models/mtp.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from ..quant.linear import dtype_device
from .attention import PackedCaches, windowed_attention
from .base import CausalLM, TrunkOutput
from .cache import KVCache
from .config import ConfigBase, ConfigError, require
from .layers import MLP, DecoderStack, PreNormDecoderLayer, RMSNorm, Rotary
from .moe import GroupedMoE, split_fused_experts, validate_moe
from .mtp import MTPHead, MTPSpec

FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass
class AttnShape:
    """One layer type's attention: heads, head widths, rotary, window and sinks."""

    heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int
    rope_theta: float
    rot_dim: int
    window: int | None  # keys q-window+1..q (None: every earlier key)
    sinks: bool


@dataclass
class MiMoV2FlashConfig(ConfigBase):
    """The config.json keys of a MiMo-V2-Flash checkpoint that we use."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    layer_types: list[str]
    mlp_layer_types: list[str]
    full: AttnShape
    sliding: AttnShape
    rms_norm_eps: float = 1e-5
    attention_bias: bool = False
    attention_value_scale: float = 1.0
    max_position_embeddings: int = 131072
    tie_word_embeddings: bool = False
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
    def from_hf_config(cls, d: dict) -> MiMoV2FlashConfig:
        """transformers' names or the release's (swa_*, hybrid_layer_pattern...)."""
        mt = d.get("model_type", "mimo_v2_flash")
        require(d, "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                model_type=mt)
        n = d["num_hidden_layers"]
        if d.get("layer_types"):
            types = list(d["layer_types"])
        elif d.get("hybrid_layer_pattern"):
            types = [SLIDING if v == 1 else FULL for v in d["hybrid_layer_pattern"]]
        else:  # transformers' default: full at layer 0 and every sixth layer
            types = [FULL if i == 0 or not (i + 1) % 6 else SLIDING for i in range(n)]
        freq = d.get("moe_layer_freq")
        if d.get("mlp_layer_types"):
            mlp = list(d["mlp_layer_types"])
        elif isinstance(freq, list):
            mlp = ["sparse" if v else "dense" for v in freq]
        else:
            mlp = ["dense"] + ["sparse"] * (n - 1)
        heads, kv = d["num_attention_heads"], d.get("num_key_value_heads") or 1
        head_dim = d.get("head_dim") or d["hidden_size"] // heads
        v_dim = d.get("v_head_dim") or head_dim
        rope = d.get("rope_parameters") or {}
        partial = float(d.get("partial_rotary_factor") or 0.334)

        def theta_rot(kind: str, theta_key: str, default: float, dim: int):
            r = rope.get(kind) if isinstance(rope.get(kind), dict) else {}
            if r.get("rope_type", "default") != "default":
                raise ConfigError(f"config.json ({mt}): rope_type {r['rope_type']!r} for "
                                  f"{kind} layers is not supported (only default)")
            theta = float(r.get("rope_theta") or d.get(theta_key) or default)
            return theta, int(dim * float(r.get("partial_rotary_factor") or partial))

        window = d.get("sliding_window")
        if window is None and d.get("sliding_window_size") is not None:
            window = d["sliding_window_size"] + 1  # the release counts the query apart
        f_theta, f_rot = theta_rot(FULL, "rope_theta", 5_000_000.0, head_dim)
        s_dim = d.get("swa_head_dim") or head_dim
        s_theta, s_rot = theta_rot(SLIDING, "swa_rope_theta", 10_000.0, s_dim)
        full = AttnShape(heads, kv, head_dim, v_dim, f_theta, f_rot, None,
                         bool(d.get("add_full_attention_sink_bias", False)))
        # transformers doubles the KV heads of sliding layers; the release says so itself.
        sliding = AttnShape(d.get("swa_num_attention_heads") or heads,
                            d.get("swa_num_key_value_heads") or 2 * kv, s_dim,
                            d.get("swa_v_head_dim") or v_dim, s_theta, s_rot,
                            int(window) if window else None,
                            bool(d.get("add_swa_attention_sink_bias", True)))
        scale = d.get("attention_value_scale", 0.707)
        cfg = cls(
            model_type=mt, vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            intermediate_size=d.get("intermediate_size") or 0, num_hidden_layers=n,
            num_attention_heads=heads, num_key_value_heads=kv, layer_types=types,
            mlp_layer_types=mlp, full=full, sliding=sliding,
            rms_norm_eps=float(d.get("rms_norm_eps") or d.get("layernorm_epsilon") or 1e-5),
            attention_bias=bool(d.get("attention_bias", False)),
            attention_value_scale=1.0 if scale is None else float(scale),
            max_position_embeddings=d.get("max_position_embeddings", 131072),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            hidden_act=d.get("hidden_act", "silu"),
            n_routed_experts=d.get("n_routed_experts") or 0,
            num_experts_per_tok=d.get("num_experts_per_tok") or 1,
            moe_intermediate_size=d.get("moe_intermediate_size") or 0,
            n_group=d.get("n_group") or 1, topk_group=d.get("topk_group") or 1,
            routed_scaling_factor=float(d.get("routed_scaling_factor") or 1.0),
            norm_topk_prob=bool(d.get("norm_topk_prob", True)),
            num_nextn_predict_layers=int(d.get("num_nextn_predict_layers")
                                         or d.get("mtp_num_hidden_layers") or 0),
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Reject configs this family cannot run."""
        super().validate()
        validate_moe(self)
        n = self.num_hidden_layers
        if len(self.layer_types) < n or set(self.layer_types) - {FULL, SLIDING}:
            self.fail(f"layer_types must give {FULL} or {SLIDING} for each of the {n} layers")
        if len(self.mlp_layer_types) < n or set(self.mlp_layer_types) - {"dense", "sparse"}:
            self.fail(f"mlp_layer_types must give dense or sparse for each of the {n} layers")
        for shape in (self.full, self.sliding):
            if shape.heads % shape.kv_heads:
                self.fail(f"{shape.heads} query heads are not a multiple of {shape.kv_heads} "
                          "KV heads")

    def shape(self, kind: str) -> AttnShape:
        """The attention of one layer type."""
        return self.sliding if kind == SLIDING else self.full


class SinkAttention(nn.Module):
    """GQA with separate q/k and v head widths, scaled values, an optional sliding window and
    optional per-head attention sinks, over a static KV cache."""

    packs = True  # forward takes PackedCaches (windowed_attention; CausalLM.packable)

    def __init__(self, hidden: int, s: AttnShape, bias: bool, v_scale: float) -> None:
        super().__init__()
        self.s, self.v_scale = s, v_scale
        self.q_proj = nn.Linear(hidden, s.heads * s.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, s.kv_heads * s.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, s.kv_heads * s.v_head_dim, bias=bias)
        self.o_proj = nn.Linear(s.heads * s.v_head_dim, hidden, bias=False)
        self.sinks = nn.Parameter(torch.zeros(s.heads)) if s.sinks else None

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        """A static KV cache (values v_head_dim wide)."""
        dtype, device = dtype_device(self.k_proj)
        return KVCache(batch, self.s.kv_heads, max_len, self.s.head_dim, dtype, device,
                       v_head_dim=self.s.v_head_dim)

    def forward(self, x, cos, sin, cache: KVCache | PackedCaches | None) -> torch.Tensor:
        """x [B, T, D] at positions cache.length.. -> [B, T, D] (several sequences' rows with
        PackedCaches)."""
        s = self.s
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, s.heads, s.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, s.kv_heads, s.head_dim).transpose(1, 2)
        v = (self.v_proj(x) * self.v_scale).view(b, t, s.kv_heads, s.v_head_dim).transpose(1, 2)
        q, k = Rotary.apply(q, cos, sin), Rotary.apply(k, cos, sin)
        out = windowed_attention(q, k, v, cache, s.head_dim**-0.5, s.window, self.sinks)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, s.heads * s.v_head_dim))


class MiMoV2FlashDecoderLayer(PreNormDecoderLayer):
    """Pre-norm sliding-window or full attention + dense or MoE MLP."""

    def __init__(self, cfg: MiMoV2FlashConfig, kind: str, moe: bool) -> None:
        super().__init__()
        self.kind = kind
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = SinkAttention(cfg.hidden_size, cfg.shape(kind), cfg.attention_bias,
                                       cfg.attention_value_scale)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if moe:
            self.mlp = GroupedMoE(cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok,
                                  cfg.moe_intermediate_size, 0, cfg.n_group, cfg.topk_group,
                                  cfg.norm_topk_prob, cfg.routed_scaling_factor)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)


# MTP layer names below model.mtp.layers.{i} -> MTPHead names (layer 0's own modules under
# mtp.*, layer i's under mtp.per_layer.{i}.*; the block's under mtp.layers.{i}).
_MTP_OWN = {"enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden",
            "eh_proj": "fc", "final_layernorm": "norm"}


class MiMoV2FlashForCausalLM(CausalLM):
    """MiMo-V2-Flash trunk with its MTP layers."""

    config_class = MiMoV2FlashConfig

    def __init__(self, cfg: MiMoV2FlashConfig) -> None:
        super().__init__(cfg)
        self.model = DecoderStack(
            cfg.vocab_size, cfg.hidden_size,
            [MiMoV2FlashDecoderLayer(cfg, cfg.layer_types[i], cfg.mlp_layer_types[i] == "sparse")
             for i in range(cfg.num_hidden_layers)],
            RMSNorm(cfg.hidden_size, cfg.rms_norm_eps),
        )
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.rotaries = nn.ModuleDict({
            kind: Rotary(s.rot_dim - s.rot_dim % 2, s.rope_theta)
            for kind, s in ((FULL, cfg.full), (SLIDING, cfg.sliding))
        })
        # What a caller reading model.rotary gets (the trunk forward takes each layer's own).
        self.rotary = self.rotaries[FULL]
        self.mtp_rotary = self.rotaries[SLIDING]
        self.mtp = None
        if cfg.num_nextn_predict_layers:
            # vLLM feeds the trunk's normed output and chains final_layernorm's output; no
            # embedding is zeroed; each layer has its own norms and eh_proj.
            spec = MTPSpec(cfg.num_nextn_predict_layers, emb_first=True,
                           trunk_hidden="post_norm", chain_hidden="post_norm",
                           eps=cfg.rms_norm_eps, own_combine=True)
            self.mtp = MTPHead(cfg.hidden_size, spec,
                               lambda i: MiMoV2FlashDecoderLayer(cfg, SLIDING, moe=False))

    def _trunk(self, x, pos, cache_of) -> TrunkOutput:
        # Each layer rotates by its own kind's rotary.
        tables = {kind: r.cos_sin(pos) for kind, r in self.rotaries.items()}
        for i, layer in enumerate(self.model.layers):
            cos, sin = tables[layer.kind]
            x = layer(x, cos, sin, cache_of(i))
        return TrunkOutput(self.model.norm(x), x)

    def map_checkpoint_name(self, name: str) -> str | None:
        """model.mtp.layers.{i}.* -> mtp.*; attention_sink_bias -> sinks."""
        name = name.replace(".self_attn.attention_sink_bias", ".self_attn.sinks")
        m = re.match(r"model\.mtp\.layers\.(\d+)\.(.+)$", name)
        if not m:
            return super().map_checkpoint_name(name)
        i, rest = int(m[1]), m[2]
        own, _, param = rest.rpartition(".")
        if own in _MTP_OWN:
            return (f"mtp.{_MTP_OWN[own]}.{param}" if i == 0
                    else f"mtp.per_layer.{i}.{_MTP_OWN[own]}.{param}")
        return f"mtp.layers.{i}.{rest.replace('pre_mlp_layernorm', 'post_attention_layernorm')}"

    def split_checkpoint_tensor(self, name: str, tensor_fn):
        """Experts stored stacked (as transformers holds them) -> per-expert MLPs."""
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            return split_fused_experts(name, tensor_fn)
        return None
