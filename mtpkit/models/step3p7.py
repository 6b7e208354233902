"""Step-3.5-Flash (``step3p5``) and Step-3.7-Flash (``step3p7``, a vision-language wrapper whose
``text_config`` is a ``step3p5`` model): hybrid sliding-window / full GQA attention with a
per-head output gate, MoE with a shared expert, and three MTP layers.

As transformers 5.23 computes it (models/step3p7), for every decoder layer:

- ``layer_types``: sliding-window layers (query q sees keys q-W+1..q) or full ones; sliding
  layers may have more query heads (``num_sliding_attention_heads``, the release's
  ``attention_other_setting``); the KV heads and ``head_dim`` are shared.
- q and k are RMS-normed per head before rotary; scores are scaled by
  ``query_pre_attn_scalar ** -0.5``; each head's output is multiplied by
  sigmoid(``g_proj(x)``), one logit per head, before ``o_proj``.
- Rotary (half-split) on the first int(head_dim * partial_rotary_factor) channels, theta and
  factor per layer (the release lists them per layer: ``rope_theta``,
  ``partial_rotary_factors``; transformers keeps one per layer type).
- Every RMSNorm is zero-centred: x * (1 + w).
- Dense SwiGLU layers or MoE layers: sigmoid router scores, a correction bias that steers only
  the choice (``moe.router_bias``), top-k, weights renormalised and scaled by
  ``moe_router_scaling_factor``, plus an always-on ``share_expert``. ``swiglu_limits`` (routed
  experts) and ``swiglu_limits_shared`` (shared expert and dense MLP) clamp silu(gate) from
  above and up to [-L, L] in the layers that list a nonzero L.

On disk (the release, and what transformers' save_pretrained writes): ``model.layers.{i}.*``
(or ``model.language_model.layers.{i}.*``), routed experts stacked per layer as
``moe.{gate,up,down}_proj.weight`` [E, ...], ``moe.gate.weight``, ``moe.router_bias``,
``share_expert.*``; the vision tower (``vision_model.*``, ``vit_large_projector.*``) is skipped.

MTP: layer i is stored at ``model.layers.{num_hidden_layers + i}.*``: ``enorm``, ``hnorm``,
``eh_proj``, ``transformer.shared_head.{norm, output}`` and one decoder block (the release: a
sliding-window layer with a dense MLP, its type, rope and limits taken from entry N + i of the
release's per-layer lists). x = eh_proj([enorm(emb(t+1)), hnorm(h)]), logits =
lm_head(shared_head.norm(block(x))). Wiring as vLLM's Step3p5MTP (written by StepFun) and
SGLang run it: step 0 reads the trunk's state BEFORE its final norm, later steps chain the
block's output before shared_head.norm, no embedding is zeroed. transformers' MtpModel
differs: it feeds the trunk's normed state and chains shared_head.norm's output, and builds a
sliding MTP layer with ``num_attention_heads`` rather than the sliding heads (so it cannot
load the release's MTP layers when the two counts differ); given the same inputs, each layer
computes what transformers' MtpLayer computes. ``shared_head.output`` is layer i's own output
head (``mtp.heads.{i}``): vLLM's Step3p5MTP loads it as the layer's shared_head.head and its
proposer keeps it (it does not swap in the trunk's lm_head as the other MTP families' does),
so layer i's drafts are scored by it. Where it equals the lm_head (the release), or is absent,
the loader drops it and the lm_head serves; transformers always uses the lm_head.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..quant.linear import dtype_device
from .attention import PackedCaches, windowed_attention
from .base import CausalLM, TrunkOutput
from .cache import KVCache
from .config import ConfigBase, ConfigError, require
from .layers import MLP, DecoderStack, RMSNorm, Rotary
from .moe import GroupedTopKRouter, run_experts
from .mtp import MTPHead, MTPSpec, own_name

FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass
class StepLayer:
    """One decoder layer's (trunk or MTP) own settings."""

    kind: str
    heads: int
    rope_theta: float
    rot_dim: int
    rope_scaling: dict | None
    moe: bool
    limit: float | None  # routed experts' clamp
    shared_limit: float | None  # shared expert's / dense MLP's clamp

    def rope_key(self) -> str:
        """Layers with equal keys share one rotary table."""
        return json.dumps([self.rope_theta, self.rot_dim, self.rope_scaling], sort_keys=True)


@dataclass
class Step3p7Config(ConfigBase):
    """The config.json keys of a Step-3.5 / 3.7 checkpoint that we use (either spelling)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layers: list[StepLayer]
    mtp: list[StepLayer] = field(default_factory=list)
    sliding_window: int | None = None
    rms_norm_eps: float = 1e-5
    attention_bias: bool = False
    query_pre_attn_scalar: float = 128.0
    gate: str | None = "per-head"  # "per-head", "elementwise" or None (no g_proj)
    max_position_embeddings: int = 262144
    tie_word_embeddings: bool = False
    n_routed_experts: int = 0
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 0
    share_expert_dim: int = 0
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True

    @property
    def num_nextn_predict_layers(self) -> int:
        """MTP layers the config declares."""
        return len(self.mtp)

    @classmethod
    def from_hf_config(cls, d: dict) -> Step3p7Config:
        """transformers' names or the release's (num_attention_groups, moe_layers_enum,
        attention_other_setting, per-layer rope_theta lists padded with the MTP layers...)."""
        mt = d.get("model_type", "step3p5")
        require(d, "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                model_type=mt)

        def fail(msg: str):
            raise ConfigError(f"config.json ({mt}): {msg}")

        n, m = d["num_hidden_layers"], int(d.get("num_nextn_predict_layers")
                                             or d.get("num_mtp_layers") or 0)
        if d.get("use_bidirectional_attention"):
            fail("use_bidirectional_attention is not supported (a decoder must be causal)")
        if d.get("att_impl_type", "GQA") != "GQA":
            fail(f"att_impl_type={d['att_impl_type']!r} is not supported (only GQA)")
        if d.get("moe_router_activation", "sigmoid") != "sigmoid":
            fail(f"moe_router_activation={d['moe_router_activation']!r} is not supported "
                 "(only sigmoid)")
        if not all(d.get("use_rope_layers") or [True]):
            fail("use_rope_layers turns rotary off in some layers; transformers 5.23 applies "
                 "it everywhere, and mtpkit does not guess which is right")
        heads, kv = d["num_attention_heads"], (d.get("num_key_value_heads")
                                               or d.get("num_attention_groups") or 1)
        head_dim = d.get("head_dim") or d["hidden_size"] // heads
        other = d.get("attention_other_setting") or {}
        if other.get("head_dim", head_dim) != head_dim or \
                other.get("num_attention_groups", kv) != kv:
            fail("attention_other_setting with its own head_dim or KV heads is not supported "
                 "(transformers 5.23 takes only its num_attention_heads)")
        sliding_heads = (d.get("num_sliding_attention_heads")
                         or other.get("num_attention_heads") or heads)

        def split(trunk_key: str, mtp_key: str, default):
            # The release pads per-layer lists with one entry per MTP layer.
            v = d.get(trunk_key)
            if isinstance(v, list) and len(v) == n + m:
                return list(v[:n]), list(v[n:])
            return (list(v) if isinstance(v, list) else default(n)), d.get(mtp_key)

        types, mtp_types = split("layer_types", "mtp_layer_types", lambda k: [FULL] * k)
        enum = d.get("moe_layers_enum")
        if d.get("mlp_layer_types") is None and enum is not None:
            items = enum.split(",") if isinstance(enum, str) else enum
            sparse = {int(i) for i in items if str(i).strip()}
            kinds = ["sparse" if i in sparse else "dense" for i in range(n + m)]
            mlp, mtp_mlp = kinds[:n], kinds[n:]
        else:  # transformers' default: MoE from layer 3 on
            mlp, mtp_mlp = split("mlp_layer_types", "mtp_mlp_layer_types",
                                 lambda k: ["sparse" if i >= 3 else "dense" for i in range(k)])
        # The release's MTP layers: sliding window, dense MLP.
        mtp_types = list(mtp_types or [SLIDING] * m)
        mtp_mlp = list(mtp_mlp or ["dense"] * m)
        if len(types) != n or set(types + mtp_types) - {FULL, SLIDING}:
            fail(f"layer_types must give {FULL} or {SLIDING} for each of the {n} layers "
                 f"(got {types}); other attention kinds are not supported")
        if len(mlp) != n or len(mtp_types) != m or len(mtp_mlp) != m:
            fail("mlp_layer_types / mtp_layer_types do not match num_hidden_layers / "
                 "num_nextn_predict_layers")

        per_layer = {int(k): v for k, v in (d.get("per_layer_config") or {}).items()}
        rope = d.get("rope_parameters") or {}
        thetas, factors = d.get("rope_theta"), d.get("partial_rotary_factors")
        scaling = d.get("rope_scaling")
        scaled_types = d.get("yarn_only_types") or [FULL]

        def rope_of(i: int, kind: str):
            r = rope.get(kind) if isinstance(rope.get(kind), dict) else None
            if r is not None:  # transformers' spelling: one set per layer type
                theta = float(r.get("rope_theta") or 10000.0)
                factor = float(r.get("partial_rotary_factor") or 1.0)
                extra = None if r.get("rope_type", "default") == "default" else dict(r)
            else:
                theta = float(thetas[i] if isinstance(thetas, list) else thetas or 10000.0)
                factor = float(factors[i]) if isinstance(factors, list) else 1.0
                extra = dict(scaling) if scaling and kind in scaled_types else None
            return theta, int(head_dim * factor), extra

        def limit(key: str, i: int):
            v = d.get(key)
            v = v[i] if isinstance(v, list) and i < len(v) else None
            return float(v) if v else None

        def layer(i: int, kind: str, mlp_kind: str, trunk: bool) -> StepLayer:
            h = sliding_heads if kind == SLIDING else heads
            if trunk and i in per_layer:
                h = per_layer[i].get("num_attention_heads", h)
            theta, rot, extra = rope_of(i, kind)
            return StepLayer(kind, h, theta, rot, extra, mlp_kind == "sparse",
                             limit("swiglu_limits", i), limit("swiglu_limits_shared", i))

        layers = [layer(i, types[i], mlp[i], True) for i in range(n)]
        mtp = [layer(n + i, mtp_types[i], mtp_mlp[i], False) for i in range(m)]
        gating = d.get("use_head_wise_attn_gate", d.get("gating", True))
        scalar = d.get("query_pre_attn_scalar")
        cfg = cls(
            model_type=mt, vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            intermediate_size=d.get("intermediate_size") or 0, num_hidden_layers=n,
            num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
            layers=layers, mtp=mtp, sliding_window=d.get("sliding_window"),
            rms_norm_eps=float(d.get("rms_norm_eps") or 1e-5),
            attention_bias=bool(d.get("attention_bias", False)),
            query_pre_attn_scalar=float(scalar if scalar else head_dim),
            gate=("per-head" if gating in (True, "per-head") else
                  "elementwise" if gating else None),
            max_position_embeddings=d.get("max_position_embeddings", 262144),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            n_routed_experts=(d.get("n_routed_experts") or d.get("moe_num_experts")
                              or d.get("num_local_experts") or 0),
            num_experts_per_tok=d.get("num_experts_per_tok") or d.get("moe_top_k") or 1,
            moe_intermediate_size=d.get("moe_intermediate_size") or 0,
            share_expert_dim=d.get("share_expert_dim") or d.get("share_expert_dims") or 0,
            routed_scaling_factor=float(d.get("moe_router_scaling_factor") or 1.0),
            norm_topk_prob=bool(d.get("norm_expert_weight", True)),
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Reject configs this family cannot run."""
        super().validate()
        everything = self.layers + self.mtp
        for s in everything:
            if s.heads % self.num_key_value_heads:
                self.fail(f"{s.heads} query heads are not a multiple of "
                          f"{self.num_key_value_heads} KV heads")
            if s.rope_scaling and s.rope_scaling.get(
                    "rope_type", s.rope_scaling.get("type")) not in ("linear", "llama3", "yarn"):
                self.fail(f"rope scaling {s.rope_scaling} is not supported "
                          "(only linear, llama3, yarn)")
        if any(s.kind == SLIDING for s in everything) and not self.sliding_window:
            self.fail("sliding_attention layers need sliding_window")
        if any(s.moe for s in everything):
            if not 0 < self.num_experts_per_tok <= self.n_routed_experts:
                self.fail(f"num_experts_per_tok={self.num_experts_per_tok} must lie in "
                          f"1..n_routed_experts={self.n_routed_experts}")
            if self.moe_intermediate_size <= 0 or self.share_expert_dim <= 0:
                self.fail("MoE layers need moe_intermediate_size and share_expert_dim")
        if any(not s.moe for s in everything) and self.intermediate_size <= 0:
            self.fail("dense layers need intermediate_size")
        if len({s.rope_key() for s in self.mtp}) > 1:
            self.fail("MTP layers with different rotary settings are not supported")


class ClampedMLP(MLP):
    """SwiGLU with Step's optional clamp: silu(gate) <= L and -L <= up <= L."""

    def __init__(self, hidden: int, inter: int, limit: float | None, bias: bool = False):
        super().__init__(hidden, inter, bias)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.limit is None:
            return super().forward(x)
        lim = self.limit
        gate = F.silu(self.gate_proj(x)).clamp(max=lim)
        return self.down_proj(gate * self.up_proj(x).clamp(-lim, lim))


class StepMoE(nn.Module):
    """``moe``: router (``gate``) and routed experts; the shared expert sits beside it."""

    def __init__(self, cfg: Step3p7Config, limit: float | None) -> None:
        super().__init__()
        # One group: plain top-k over the biased sigmoid scores.
        self.gate = GroupedTopKRouter(cfg.hidden_size, cfg.n_routed_experts,
                                      cfg.num_experts_per_tok, 1, 1, cfg.norm_topk_prob,
                                      cfg.routed_scaling_factor)
        self.experts = nn.ModuleList(
            ClampedMLP(cfg.hidden_size, cfg.moe_intermediate_size, limit)
            for _ in range(cfg.n_routed_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        top_w, top_i = self.gate(x)
        return run_experts(x, top_w, top_i, self.experts).reshape(shape)


class StepAttention(nn.Module):
    """GQA with per-head q/k norms, a sigmoid output gate and an optional sliding window."""

    packs = True  # forward takes PackedCaches (windowed_attention; CausalLM.packable)

    def __init__(self, cfg: Step3p7Config, s: StepLayer) -> None:
        super().__init__()
        hd, bias = cfg.head_dim, cfg.attention_bias
        self.heads, self.kv_heads, self.head_dim = s.heads, cfg.num_key_value_heads, hd
        self.scale = cfg.query_pre_attn_scalar ** -0.5
        self.window = cfg.sliding_window if s.kind == SLIDING else None
        self.q_proj = nn.Linear(cfg.hidden_size, s.heads * hd, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(s.heads * hd, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, zero_centered=True)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, zero_centered=True)
        self.per_head = cfg.gate == "per-head"
        self.g_proj = None if cfg.gate is None else nn.Linear(
            cfg.hidden_size, s.heads if self.per_head else s.heads * hd, bias=False)

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        """A static KV cache; sliding layers keep every position and mask by the window."""
        dtype, device = dtype_device(self.k_proj)
        return KVCache(batch, self.kv_heads, max_len, self.head_dim, dtype, device)

    def forward(self, x, cos, sin, cache: KVCache | PackedCaches | None) -> torch.Tensor:
        """x [B, T, D] at positions cache.length.. -> [B, T, D] (several sequences' rows with
        PackedCaches)."""
        b, t, _ = x.shape
        hd = self.head_dim
        q = self.q_norm(self.q_proj(x).view(b, t, self.heads, hd)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, t, self.kv_heads, hd)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, hd).transpose(1, 2)
        q, k = Rotary.apply(q, cos, sin), Rotary.apply(k, cos, sin)
        out = windowed_attention(q, k, v, cache, self.scale, self.window).transpose(1, 2)
        if self.g_proj is not None:
            g = torch.sigmoid(self.g_proj(x))
            out = out * (g[..., None] if self.per_head else g.view(b, t, self.heads, hd))
        return self.o_proj(out.reshape(b, t, self.heads * hd))


class Step3p7DecoderLayer(nn.Module):
    """Pre-norm attention, then a dense MLP or ``moe`` + ``share_expert``."""

    def __init__(self, cfg: Step3p7Config, s: StepLayer) -> None:
        super().__init__()
        eps, hidden = cfg.rms_norm_eps, cfg.hidden_size
        self.input_layernorm = RMSNorm(hidden, eps, zero_centered=True)
        self.self_attn = StepAttention(cfg, s)
        self.post_attention_layernorm = RMSNorm(hidden, eps, zero_centered=True)
        if s.moe:
            self.moe = StepMoE(cfg, s.limit)
            self.share_expert = ClampedMLP(hidden, cfg.share_expert_dim, s.shared_limit)
        else:
            self.mlp = ClampedMLP(hidden, cfg.intermediate_size, s.shared_limit)

    def forward(self, x, cos, sin, cache) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache)
        h = self.post_attention_layernorm(x)
        if hasattr(self, "moe"):
            return x + self.moe(h) + self.share_expert(h)
        return x + self.mlp(h)

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        """This layer's KV cache."""
        return self.self_attn.new_cache(batch, max_len)


# An MTP layer's own modules below model.layers.{N + i} -> MTPHead names.
_MTP_OWN = {"enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden", "eh_proj": "fc",
            "shared_head.norm": "norm"}
_SKIP = re.compile(r"^(model\.)?(vision_model|vit_large_projector|multi_modal_projector)\.")
_EXPERTS = re.compile(r"^(.*\.moe)\.(gate|up|down)_proj\.weight$")


class Step3p7ForCausalLM(CausalLM):
    """Step-3.5 / 3.7-Flash text model with its MTP layers."""

    config_class = Step3p7Config

    def __init__(self, cfg: Step3p7Config) -> None:
        super().__init__(cfg)
        self.model = DecoderStack(
            cfg.vocab_size, cfg.hidden_size,
            [Step3p7DecoderLayer(cfg, s) for s in cfg.layers],
            RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zero_centered=True),
        )
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        # One rotary per distinct (theta, width, scaling), named rope0, rope1...
        names: dict[str, str] = {}
        for s in cfg.layers + cfg.mtp:
            names.setdefault(s.rope_key(), f"rope{len(names)}")
        self.rotaries = nn.ModuleDict({
            names[s.rope_key()]: Rotary(s.rot_dim - s.rot_dim % 2, s.rope_theta, s.rope_scaling)
            for s in cfg.layers + cfg.mtp
        })
        self.rope_of = [names[s.rope_key()] for s in cfg.layers]
        self.mtp = None
        first = names[(cfg.mtp or cfg.layers)[0].rope_key()]
        # What callers reading model.rotary get: the MTP layers' (the trunk takes its own).
        self.rotary = self.mtp_rotary = self.rotaries[first]
        if cfg.mtp:
            spec = MTPSpec(len(cfg.mtp), emb_first=True, trunk_hidden="pre_norm",
                           chain_hidden="pre_norm", zero_centered=True, eps=cfg.rms_norm_eps,
                           own_combine=True, own_heads=True)
            self.mtp = MTPHead(cfg.hidden_size, spec,
                               lambda i: Step3p7DecoderLayer(cfg, cfg.mtp[i]), cfg.vocab_size)

    def _trunk(self, x, pos, cache_of) -> TrunkOutput:
        # Each layer rotates by its own rotary (rope_of).
        tables = {key: r.cos_sin(pos) for key, r in self.rotaries.items()}
        for i, layer in enumerate(self.model.layers):
            cos, sin = tables[self.rope_of[i]]
            x = layer(x, cos, sin, cache_of(i))
        return TrunkOutput(self.model.norm(x), x)

    def map_checkpoint_name(self, name: str) -> str | None:
        """Release / VLM names -> ours; model.layers.{N + i}.* -> mtp.*."""
        if _SKIP.match(name):
            return None
        name = re.sub(r"^model\.language_model\.", "model.", name)
        name = name.replace(".moe.router_bias", ".moe.gate.e_score_correction_bias")
        m = re.match(r"model\.layers\.(\d+)\.(.+)$", name)
        n = self.config.num_hidden_layers
        if not m or int(m[1]) < n:
            return super().map_checkpoint_name(name)
        i, rest = int(m[1]) - n, m[2]
        if i >= self.config.num_nextn_predict_layers:
            return name  # reported as unused
        rest = rest.removeprefix("transformer.")
        # vLLM reads shared_head.output as shared_head.head (GGUF's nextn.shared_head_head).
        if rest in ("shared_head.output.weight", "shared_head.head.weight"):
            return f"mtp.heads.{i}.weight"
        if rest.startswith("embed_tokens"):
            return None  # a copy of the trunk's embedding
        own, _, param = rest.rpartition(".")
        if own in _MTP_OWN:
            return own_name(i, f"{_MTP_OWN[own]}.{param}")
        return f"mtp.layers.{i}.{rest}"

    def split_checkpoint_tensor(self, name: str, tensor_fn):
        """Experts stacked per layer (moe.{gate,up,down}_proj.weight [E, ...]) -> per expert."""
        m = _EXPERTS.match(name)
        if m is None:
            return None

        def each():
            stacked = tensor_fn()
            for e in range(stacked.shape[0]):
                yield f"{m[1]}.experts.{e}.{m[2]}_proj.weight", stacked[e]

        return each()
