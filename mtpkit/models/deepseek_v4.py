"""DeepSeek-V4-Flash / V4-Pro (``deepseek_v4``): hyper-connections, shared-KV attention with
sinks over a sliding window plus compressed KV entries (CSA with a Lightning Indexer, HCA),
hash-routed and top-k MoE, and the release's MTP layers (``mtp.{i}.*``).

As transformers 5.23 computes it (models/deepseek_v4), for every decoder layer:

- The residual is ``hc_mult`` streams [B, T, hc, D]. Before attention and before the MoE a
  hyper-connection (``attn_hc`` / ``ffn_hc``: ``fn``, ``base``, ``scale``) reads the flattened,
  RMS-normed streams and yields pre (collapse weights), post (expand weights) and comb (an
  hc x hc mix made doubly stochastic by Sinkhorn iterations); the block sees the collapsed
  stream and the new streams are post * out + comb^T @ streams. ``hc_head`` collapses the
  streams once more before the final norm.
- Attention: q = q_b_norm(q_b_proj(q_a_norm(q_a_proj(x)))) per head (q_b_norm unweighted),
  one KV head read as both key and value: kv_norm(kv_proj(x)); interleaved rotary on the last
  ``qk_rope_head_dim`` channels; softmax with one sink logit per head; the output's rope
  channels are rotated back by the query's position; grouped output projection
  (``o_a_proj`` per group of heads, then ``o_b_proj``). Keys: the last ``sliding_window``
  positions, plus on compressed layers one entry per ``compress_rate`` positions: a softmax
  (gate + ``position_bias``) pooled, kv-normed, rotated summary of a window (CSA: of two
  overlapping windows, and a Lightning Indexer keeps the ``index_topk`` best entries per
  query). Sliding layers rotate with ``rope_theta``; compressed layers, their compressors
  and indexers with ``compress_rope_theta`` and the config's scaling (YaRN without mscale).
- MoE with one shared expert: scores sqrtsoftplus (or sigmoid) of the router logits; the
  first ``hash_moe`` layers pick experts by ``tid2eid[token]``, the others by top-k of score
  + ``e_score_correction_bias``; weights renormalised, times ``routed_scaling_factor``.
  Experts and the shared expert clamp gate (above) and up (both sides) at ``swiglu_limit``
  before silu(gate) * up.

The compressors keep per-position projections in the layer cache and recompute a window's
entry once it is complete, so a cache returns to any earlier position (speculative rollback)
exactly; transformers' own cache cannot rewind.

MTP (``mtp.{i}.*`` in the release, ``num_nextn_predict_layers``), as vLLM's DeepSeekV4MTP
wires it: the trunk's streams BEFORE ``hc_head`` (h [B, T, hc, D]) and the next token's
embedding (zeroed at position 0) give x = h_proj(hnorm(h)) + e_proj(enorm(emb)) per stream;
one decoder block (sliding attention, top-k MoE); its output streams are chained into the
next step; logits = lm_head(norm(hc_head(streams))) with the layer's own ``hc_head_*`` and
``norm``. ``mtp.{i}.head`` / ``mtp.{i}.emb.tok_emb`` (copies of the trunk's) are not read:
vLLM loads ``mtp.{i}.head`` into the layer's shared_head.head, but its MTP proposer then puts
the trunk's lm_head in its place, so the drafts are scored by the lm_head in both. Draft step
s runs layer ``layer_for(s)`` (models/mtp.py, shared with every family).

Names: transformers' module names (``model.layers.{i}.self_attn.q_a_proj``...) and the
release's (``layers.{i}.attn.wq_a``, ``ffn.experts.{e}.w1``, ``embed``, ``head``...), with or
without ``model.`` (transformers' save_pretrained writes the release's block names below
it). The release's FP8 (e4m3, a ue8m0 scale per 128x128 block) and FP4 experts (e2m1, a
scale per 32 inputs of a row), their scales named ``.scale``, and compressed-tensors
checkpoints are dequantized to float on load (quant/formats.py reads them). Refused: other
quantization methods, scoring
functions other than sqrtsoftplus / sigmoid, MTP layers that are not sliding-window layers,
and config fields transformers ignores or computes differently (n_shared_experts != 1,
norm_topk_prob false, rope scaling other than YaRN on compressed layers).

The Lightning Indexer breaks exact score ties (every head's relu at 0) towards the earlier
window; transformers leaves them to topk, whose choice among ties is unspecified.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoint.errors import CheckpointError
from ..quant.linear import dtype_device
from .base import CausalLM, TrunkOutput
from .cache import KVCache, ModelCache, zeros
from .config import ConfigBase, ConfigError, require
from .layers import RMSNorm, Rotary
from .moe import run_experts, split_fused_experts
from .mtp import DraftLayers, MTPSpec

SLIDING, CSA, HCA = ("sliding_attention", "compressed_sparse_attention",
                     "heavily_compressed_attention")
HASH, TOPK = "hash_moe", "moe"
# The release's per-layer compress_ratios -> layer types (transformers' fixed table).
_RATIO_TYPES = {0: SLIDING, 4: CSA, 128: HCA}


@dataclass
class DeepseekV4Config(ConfigBase):
    """The config.json keys of a DeepSeek-V4 checkpoint that we use."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rot_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    layer_types: list[str]
    mlp_layer_types: list[str]
    compress_rates: dict
    mtp_layer_types: list[str] = field(default_factory=list)
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    compress_scaling: dict | None = None
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    swiglu_limit: float = 10.0
    sliding_window: int = 128
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    n_routed_experts: int = 256
    num_experts_per_tok: int = 6
    moe_intermediate_size: int = 2048
    scoring_func: str = "sqrtsoftplus"
    routed_scaling_factor: float = 1.5
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 1048576

    @property
    def num_nextn_predict_layers(self) -> int:
        """MTP layers the config declares."""
        return len(self.mtp_layer_types)

    @classmethod
    def from_hf_config(cls, d: dict) -> DeepseekV4Config:
        """transformers' spelling (layer_types, nested rope_parameters) or the release's
        (compress_ratios with the MTP layers' entries, num_hash_layers, qk_rope_head_dim)."""
        mt = d.get("model_type", "deepseek_v4")
        require(d, "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "head_dim", "q_lora_rank", "o_groups", "o_lora_rank", model_type=mt)

        def fail(msg: str):
            raise ConfigError(f"config.json ({mt}): {msg}")

        if any(k.startswith("dspark_") for k in d):
            fail("this checkpoint carries a DSpark block drafter under mtp.* (dspark_* "
                 "fields), which mtpkit does not run yet; see docs/dspark.md")
        _check_quantization(d, fail)
        n = d["num_hidden_layers"]
        m = int(d.get("num_nextn_predict_layers") or 0)
        ratios = d.get("compress_ratios")
        if ratios is not None and any(r not in _RATIO_TYPES for r in ratios):
            fail(f"compress_ratios {ratios} may only hold 0, 4 or 128")
        types = d.get("layer_types")
        if types is None and ratios is not None:
            types = [_RATIO_TYPES[r] for r in ratios]
        if types is None:  # transformers' default: 2 HCA layers, then CSA / HCA in turn
            types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
        # The release lists the MTP layers' ratios after the trunk's; else they are sliding
        # layers (as in the reference inference code, which vLLM follows).
        mtp_types = list(types[n:n + m]) if len(types) >= n + m else [SLIDING] * m
        types = list(types[:n])
        mlp = d.get("mlp_layer_types")
        if mlp is None:
            n_hash = d.get("num_hash_layers")
            n_hash = 3 if n_hash is None else n_hash
            mlp = [HASH] * min(n, n_hash) + [TOPK] * max(0, n - n_hash)
        mlp = list(mlp[:n])
        if len(types) != n or set(types) - {SLIDING, CSA, HCA}:
            fail(f"layer_types must give one of {SLIDING}, {CSA}, {HCA} for each of the {n} "
                 f"layers (got {types})")
        if len(mlp) != n or set(mlp) - {HASH, TOPK}:
            fail(f"mlp_layer_types must give {HASH} or {TOPK} for each of the {n} layers")
        if any(t != SLIDING for t in mtp_types):
            fail(f"MTP layers of type {mtp_types} are not supported (only {SLIDING}, as "
                 "released)")
        rates = {CSA: 4, HCA: 128, **(d.get("compress_rates") or {})}
        if d.get("compress_rate_csa") is not None:
            rates[CSA] = d["compress_rate_csa"]
        if d.get("compress_rate_hca") is not None:
            rates[HCA] = d["compress_rate_hca"]
        head_dim = d["head_dim"]
        factor = d.get("partial_rotary_factor")
        if factor is None:
            rope_dim = d.get("qk_rope_head_dim")
            factor = rope_dim / head_dim if rope_dim is not None else 64 / 512

        # rope_parameters nested per rope type ({"main", "compress"}, as transformers writes
        # it), or flat (rope_scaling / rope_parameters holding the compress layers' YaRN).
        rp = d.get("rope_parameters") or d.get("rope_scaling") or {}
        main_theta = float(d.get("rope_theta") or 10000.0)
        comp_theta = float(d.get("compress_rope_theta") or 160000.0)
        if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
            main, comp = dict(rp["main"]), dict(rp["compress"])
            if main.get("rope_type", "default") != "default":
                fail(f"rope_parameters.main {main} is not supported (only default rope on "
                     "sliding layers)")
            main_theta = float(main.get("rope_theta", main_theta))
            comp_theta = float(comp.get("rope_theta", comp_theta))
            for r in (main, comp):
                if r.get("partial_rotary_factor", factor) != factor:
                    fail("per-rope-type partial_rotary_factor values are not supported")
        else:
            comp = {k: v for k, v in rp.items() if k not in ("main", "compress")}
            if comp.get("rope_type", comp.get("type")) == "yarn":
                # transformers forces YaRN's attention factor to 1 on V4 (the reference does
                # not scale cos / sin) unless the config names one; a nested config says.
                comp.setdefault("attention_factor", 1.0)
        kind = comp.get("rope_type", comp.get("type", "default"))
        scaling = None
        if kind == "yarn":
            scaling = {k: v for k, v in comp.items()
                       if k not in ("rope_theta", "partial_rotary_factor")}
            scaling.setdefault("original_max_position_embeddings",
                               d.get("max_position_embeddings", 1048576))
        elif kind != "default":
            fail(f"rope scaling {comp} is not supported on compressed layers (only yarn)")

        cfg = cls(
            model_type=mt, vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            num_hidden_layers=n, num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=d.get("num_key_value_heads") or 1, head_dim=head_dim,
            rot_dim=int(head_dim * factor), q_lora_rank=d["q_lora_rank"],
            o_groups=d["o_groups"], o_lora_rank=d["o_lora_rank"], layer_types=types,
            mlp_layer_types=mlp, compress_rates=rates, mtp_layer_types=mtp_types,
            rope_theta=main_theta, compress_rope_theta=comp_theta, compress_scaling=scaling,
            hc_mult=d.get("hc_mult", 4), hc_sinkhorn_iters=d.get("hc_sinkhorn_iters", 20),
            hc_eps=float(d.get("hc_eps", 1e-6)), swiglu_limit=float(d.get("swiglu_limit", 10.0)),
            sliding_window=d.get("sliding_window", 128),
            index_n_heads=d.get("index_n_heads", 64),
            index_head_dim=d.get("index_head_dim", 128), index_topk=d.get("index_topk", 512),
            n_routed_experts=d.get("n_routed_experts", 256),
            num_experts_per_tok=d.get("num_experts_per_tok", 6),
            moe_intermediate_size=d.get("moe_intermediate_size", 2048),
            scoring_func=d.get("scoring_func", "sqrtsoftplus"),
            routed_scaling_factor=float(d.get("routed_scaling_factor", 1.5)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_position_embeddings=d.get("max_position_embeddings", 1048576),
        )
        if d.get("n_shared_experts", 1) != 1:
            cfg.fail(f"n_shared_experts={d['n_shared_experts']} is not supported (transformers "
                     "builds exactly one shared expert)")
        if d.get("norm_topk_prob", True) is False:
            cfg.fail("norm_topk_prob=false is not supported (transformers always "
                     "renormalises the chosen experts' weights)")
        if d.get("hidden_act", "silu") != "silu":
            cfg.fail(f"hidden_act={d['hidden_act']!r} is not supported (only silu)")
        if d.get("attention_bias") or d.get("mlp_bias"):
            cfg.fail("attention_bias / mlp_bias are not supported (the release has none)")
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Reject configs this family cannot run."""
        super().validate()
        if self.num_key_value_heads != 1:
            self.fail(f"num_key_value_heads={self.num_key_value_heads} is not supported "
                      "(DeepSeek-V4 attention reads one shared key/value head)")
        if self.scoring_func not in ("sqrtsoftplus", "sigmoid"):
            self.fail(f"scoring_func={self.scoring_func!r} is not supported "
                      "(only sqrtsoftplus and sigmoid)")
        if self.rot_dim % 2 or not 0 < self.rot_dim <= min(self.head_dim, self.index_head_dim):
            self.fail(f"a rotary width of {self.rot_dim} channels does not fit head_dim="
                      f"{self.head_dim} / index_head_dim={self.index_head_dim}")
        if (self.num_attention_heads * self.head_dim) % self.o_groups:
            self.fail(f"o_groups={self.o_groups} does not divide the attention output")
        if not 0 < self.num_experts_per_tok <= self.n_routed_experts:
            self.fail(f"num_experts_per_tok={self.num_experts_per_tok} must lie in "
                      f"1..n_routed_experts={self.n_routed_experts}")
        for t in (CSA, HCA):
            if t in self.layer_types and int(self.compress_rates.get(t, 0)) <= 0:
                self.fail(f"compress_rates[{t}] must be positive")
        if self.sliding_window <= 0:
            self.fail("sliding_window must be positive")


# quantization_config methods whose tensors mtpkit reads (and dequantizes) for this family:
# the release's block-scaled FP8 with FP4 experts, and compressed-tensors (mtpkit quantize).
_QUANT_METHODS = ("fp8", "deepseek_v4_fp8", "compressed-tensors")


def _check_quantization(d: dict, fail) -> None:
    """Refuse quantization configs whose tensors this family cannot read."""
    q = d.get("quantization_config")
    if d.get("expert_dtype", "fp4") not in ("fp4", "fp8"):
        fail(f"expert_dtype={d['expert_dtype']!r} is not a DeepSeek-V4 expert format (fp4 "
             "or fp8)")
    if not q:
        return
    method = str(q.get("quant_method", "")).lower()
    if method not in _QUANT_METHODS:
        fail(f"quantization_config.quant_method={method!r} is not supported for DeepSeek-V4 "
             f"(only {', '.join(_QUANT_METHODS)}); use the release's FP8 / FP4 or a BF16 "
             "checkpoint")
    if method != "compressed-tensors":
        if str(q.get("fmt", "e4m3")).lower() != "e4m3":
            fail(f"quantization_config.fmt={q['fmt']!r} is not supported (only e4m3, as "
                 "released)")
        if str(q.get("scale_fmt", "ue8m0")).lower() not in ("ue8m0", "float"):
            fail(f"quantization_config.scale_fmt={q['scale_fmt']!r} is not supported (ue8m0 "
                 "or float)")


class HalfRotary(Rotary):
    """Interleaved rotary: one angle per channel pair, tables [T, rot_dim / 2]."""

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [T, rot_dim / 2] for integer positions [T]."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        f = self.attention_factor
        return freqs.cos() * f, freqs.sin() * f


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the pairs (2j, 2j+1) of the trailing 2 * cos.shape[-1] channels of x [..., T, d];
    cos/sin [T, r/2] broadcast over the leading dims. Leading (nope) channels pass."""
    r = 2 * cos.shape[-1]
    nope, rp = x[..., :-r], x[..., -r:].float()
    x0, x1 = rp[..., 0::2], rp[..., 1::2]
    out = torch.stack([x0 * cos - x1 * sin, x1 * cos + x0 * sin], dim=-1).flatten(-2)
    return torch.cat([nope, out.to(x.dtype)], dim=-1)


def _unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS normalisation without a weight (q_b_norm, the hyper-connections' input norm)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class V4RMSNorm(RMSNorm):
    """RMSNorm multiplying in fp32 before the cast (V4 keeps its norm weights in fp32)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        return (self.weight.float() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)
                                                       + self.eps))).to(dtype)


# -- caches ---------------------------------------------------------------------------------
class _Pool:
    """One compressor's per-position projections and the entries of its complete windows."""

    def __init__(self, batch, max_len, rate, width, dim, dtype, device) -> None:
        self.rate = rate
        self.kv = zeros((batch, max_len, width), dtype, device)
        self.gate = zeros((batch, max_len, width), dtype, device)
        self.entries = zeros((batch, max_len // rate + 1, dim), dtype, device)
        self.count = 0  # entries of windows that lie before the cache's length


class V4Cache(KVCache):
    """The sliding layer's K(=V) per position, plus its compressors' pools (by name)."""

    def __init__(self, batch, max_len, head_dim, dtype, device, pools: dict) -> None:
        super().__init__(batch, 1, max_len, head_dim, dtype, device, v_head_dim=1)
        self.pools = {name: _Pool(batch, max_len, *spec, dtype, device)
                      for name, spec in pools.items()}

    def trim(self, n: int) -> None:
        """Back to n positions: entries of windows reaching past n are recomputed later."""
        super().trim(n)
        for p in self.pools.values():
            p.count = min(p.count, n // p.rate)

    def reset(self) -> None:
        """Forget every position."""
        super().reset()
        for p in self.pools.values():
            p.count = 0


# -- attention ------------------------------------------------------------------------------
class Compressor(nn.Module):
    """Pools each window of ``rate`` positions into one entry; with ``overlap`` (CSA) an entry
    also pools the previous window through the first half of the projections."""

    def __init__(self, hidden: int, dim: int, rate: int, overlap: bool, eps: float) -> None:
        super().__init__()
        self.dim, self.rate, self.overlap = dim, rate, overlap
        width = 2 * dim if overlap else dim
        self.kv_proj = nn.Linear(hidden, width, bias=False)
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(rate, width))
        self.kv_norm = V4RMSNorm(dim, eps)

    def pool_spec(self) -> tuple[int, int, int]:
        """(rate, projection width, entry width) of this compressor's cache pool."""
        return self.rate, self.kv_proj.out_features, self.dim

    def entries(self, x, start, pool: _Pool | None, cos_sin) -> torch.Tensor:
        """Project x [B, T, D] at positions start..; -> every complete window's entry [B, W, d]."""
        kv, gate = self.kv_proj(x), self.gate_proj(x)
        end = start + x.shape[1]
        if pool is None:  # one pass from position 0
            first, all_kv, all_gate = 0, kv, gate
        else:
            pool.kv[:, start:end], pool.gate[:, start:end] = kv, gate
            first, all_kv, all_gate = pool.count, pool.kv[:, :end], pool.gate[:, :end]
        done = end // self.rate
        new = self._pool(all_kv, all_gate, first, done, cos_sin)
        if pool is None:
            return new
        pool.entries[:, first:done] = new
        pool.count = done
        return pool.entries[:, :done]

    def _pool(self, kv, gate, first: int, done: int, cos_sin) -> torch.Tensor:
        b, m, d = kv.shape[0], self.rate, self.dim
        if done <= first:
            return kv.new_zeros(b, 0, d)
        lo = max(first - 1, 0) if self.overlap else first
        w_kv = kv[:, lo * m: done * m].reshape(b, done - lo, m, -1)
        w_gate = gate[:, lo * m: done * m].reshape(b, done - lo, m, -1) + self.position_bias
        if self.overlap:
            # Entry w: the previous window's first-half projections (none for window 0:
            # weight 0) beside window w's second half, softmax over 2 * rate slots.
            prev_kv, prev_gate = w_kv[..., :d], w_gate[..., :d]
            cur_kv, cur_gate = w_kv[..., d:], w_gate[..., d:]
            if first == 0:
                prev_kv = torch.cat([torch.zeros_like(prev_kv[:, :1]), prev_kv[:, :-1]], 1)
                prev_gate = torch.cat([torch.full_like(prev_gate[:, :1], float("-inf")),
                                       prev_gate[:, :-1]], 1)
            else:
                prev_kv, prev_gate = prev_kv[:, :-1], prev_gate[:, :-1]
                cur_kv, cur_gate = cur_kv[:, 1:], cur_gate[:, 1:]
            w_kv = torch.cat([prev_kv, cur_kv], dim=2)
            w_gate = torch.cat([prev_gate, cur_gate], dim=2)
        weights = w_gate.softmax(dim=2, dtype=torch.float32).to(w_kv.dtype)
        pooled = self.kv_norm((w_kv * weights).sum(dim=2))
        cos, sin = cos_sin(torch.arange(first, done, device=kv.device) * m)
        return rotate(pooled, cos, sin)


class Indexer(Compressor):
    """CSA's Lightning Indexer: its own overlapping compressor, and per-query scores
    sum_h w_h * relu(q_h . k) that keep the ``index_topk`` best complete windows."""

    def __init__(self, cfg: DeepseekV4Config, rate: int) -> None:
        super().__init__(cfg.hidden_size, cfg.index_head_dim, rate, True, cfg.rms_norm_eps)
        self.heads, self.topk = cfg.index_n_heads, cfg.index_topk
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, self.heads * self.dim, bias=False)
        self.scorer = nn.Module()
        self.scorer.weights_proj = nn.Linear(cfg.hidden_size, self.heads, bias=False)

    def select(self, x, q_residual, start, pool, cos_sin) -> torch.Tensor:
        """Bias [B, T, W] over the compressor's W entries: 0 where a query attends, -inf."""
        keys = self.entries(x, start, pool, cos_sin)
        b, t, _ = x.shape
        pos = torch.arange(start, start + t, device=x.device)
        cos, sin = cos_sin(pos)
        q = rotate(self.q_b_proj(q_residual).view(b, t, self.heads, self.dim).transpose(1, 2),
                   cos, sin).transpose(1, 2)  # [B, T, H, d]
        scores = F.relu(q.float() @ keys.float().transpose(-1, -2).unsqueeze(1)) \
            * self.dim ** -0.5  # [B, T, H, W]
        w = self.scorer.weights_proj(x).float() * self.heads ** -0.5
        score = (scores * w.unsqueeze(-1)).sum(dim=2)  # [B, T, W]
        n = keys.shape[1]
        bias = score.new_full((b, t, n), float("-inf"))
        if n == 0:
            return bias
        ready = (pos + 1) // self.rate  # windows complete at each query
        future = torch.arange(n, device=x.device)[None, None, :] >= ready[None, :, None]
        # Ties (every head's relu at 0) go to the earlier window: a stable sort decides them
        # the same way whatever the number of entries, so a chunked or speculative pass picks
        # what one pass picks (topk leaves ties to the kernel; so does transformers).
        order = torch.sort(score.masked_fill(future, float("-inf")), dim=-1, descending=True,
                           stable=True).indices
        top = order[..., : min(self.topk, n)]
        keep = top < ready[None, :, None]
        return bias.scatter(-1, top, torch.where(keep, 0.0, float("-inf")))


class V4Attention(nn.Module):
    """Shared-KV attention with sinks over a sliding window (+ compressed entries)."""

    def __init__(self, cfg: DeepseekV4Config, kind: str) -> None:
        super().__init__()
        hd, h, eps = cfg.head_dim, cfg.num_attention_heads, cfg.rms_norm_eps
        self.kind, self.heads, self.head_dim, self.eps = kind, h, hd, eps
        self.window, self.groups = cfg.sliding_window, cfg.o_groups
        self.rope = "main" if kind == SLIDING else "compress"
        self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False)
        self.q_a_norm = V4RMSNorm(cfg.q_lora_rank, eps)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, h * hd, bias=False)
        self.kv_proj = nn.Linear(cfg.hidden_size, hd, bias=False)
        self.kv_norm = V4RMSNorm(hd, eps)
        # Block-diagonal: group g maps its heads' h*hd/G channels to o_lora_rank.
        self.o_a_proj = nn.Linear(h * hd // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank,
                                  bias=False)
        self.o_b_proj = nn.Linear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size, bias=False)
        self.sinks = nn.Parameter(torch.zeros(h))
        self.compressor = None
        if kind != SLIDING:
            rate = int(cfg.compress_rates[kind])
            self.compressor = Compressor(cfg.hidden_size, hd, rate, kind == CSA, eps)
            if kind == CSA:
                self.compressor.indexer = Indexer(cfg, rate)

    def new_cache(self, batch: int, max_len: int) -> V4Cache:
        """The window's keys and, on compressed layers, the compressors' pools."""
        dtype, device = dtype_device(self.q_a_proj)
        pools = {}
        if self.compressor is not None:
            pools["compressor"] = self.compressor.pool_spec()
            if hasattr(self.compressor, "indexer"):
                pools["indexer"] = self.compressor.indexer.pool_spec()
        return V4Cache(batch, max_len, self.head_dim, dtype, device, pools)

    def forward(self, x, tables: dict, cache: V4Cache | None) -> torch.Tensor:
        """x [B, T, D] at positions cache.length.. -> [B, T, D]."""
        b, t, _ = x.shape
        hd = self.head_dim
        start = cache.length if cache is not None else 0
        pos = torch.arange(start, start + t, device=x.device)
        rope = tables[self.rope]
        cos, sin = rope.cos_sin(pos)
        q_res = self.q_a_norm(self.q_a_proj(x))
        q = _unit_rms(self.q_b_proj(q_res).view(b, t, self.heads, hd), self.eps)
        q = rotate(q.transpose(1, 2), cos, sin)  # [B, H, T, hd]
        kv = rotate(self.kv_norm(self.kv_proj(x)), cos, sin)  # [B, T, hd]

        extra, extra_bias = None, None
        if self.compressor is not None:
            comp, pools = self.compressor, (cache.pools if cache is not None else {})
            rope_c = tables["compress"].cos_sin
            extra = comp.entries(x, start, pools.get("compressor"), rope_c)
            if hasattr(comp, "indexer"):
                extra_bias = comp.indexer.select(x, q_res, start, pools.get("indexer"), rope_c)
            else:  # HCA: every complete window
                ready = (pos + 1) // comp.rate
                seen = torch.arange(extra.shape[1], device=x.device)[None, :] < ready[:, None]
                extra_bias = torch.zeros(t, extra.shape[1], device=x.device).masked_fill(
                    ~seen, float("-inf"))[None].expand(b, -1, -1)

        valid = None
        if cache is not None:
            keys = cache.update(kv[:, None], kv[:, None, :, :1])[0][:, 0]
            valid = cache.key_mask(start + t)
        else:
            keys = kv
        lo = max(start - self.window + 1, 0)  # keys older than the window are never seen
        keys = keys[:, lo:]
        k_pos = torch.arange(lo, start + t, device=x.device)
        allowed = (k_pos[None] <= pos[:, None]) & (pos[:, None] - k_pos[None] < self.window)
        if valid is not None:
            allowed = allowed & valid[lo:][None]
        bias = torch.zeros(t, keys.shape[1], device=x.device).masked_fill(
            ~allowed, float("-inf"))[None].expand(b, -1, -1)
        if extra is not None:
            keys = torch.cat([keys, extra], dim=1)
            bias = torch.cat([bias, extra_bias.to(bias.dtype)], dim=-1)
        scores = (q.float() @ keys.float().transpose(-1, -2)[:, None]) * hd ** -0.5
        scores = scores + bias[:, None]
        sink = self.sinks.float().view(1, -1, 1, 1).expand(b, -1, t, 1)
        probs = F.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        out = probs.to(keys.dtype) @ keys[:, None]  # [B, H, T, hd]
        # Keys carried their own rotation into the values; undo the query's on the output.
        out = rotate(out, cos, -sin).transpose(1, 2)  # [B, T, H, hd]
        grouped = out.reshape(b, t, self.groups, -1)
        w = self.o_a_proj.weight.view(self.groups, -1, grouped.shape[-1])
        mixed = torch.einsum("btgi,gri->btgr", grouped, w).flatten(2)
        return self.o_b_proj(mixed)


# -- hyper-connections ----------------------------------------------------------------------
class HyperConnection(nn.Module):
    """``attn_hc`` / ``ffn_hc``: pre, post and a Sinkhorn-normalised comb from the streams."""

    def __init__(self, cfg: DeepseekV4Config) -> None:
        super().__init__()
        hc = cfg.hc_mult
        self.hc, self.iters, self.hc_eps, self.eps = (hc, cfg.hc_sinkhorn_iters, cfg.hc_eps,
                                                      cfg.rms_norm_eps)
        self.fn = nn.Parameter(torch.zeros((2 + hc) * hc, hc * cfg.hidden_size))
        self.base = nn.Parameter(torch.zeros((2 + hc) * hc))
        self.scale = nn.Parameter(torch.zeros(3))

    def forward(self, streams: torch.Tensor):
        """streams [B, T, hc, D] -> (post [B, T, hc], comb [B, T, hc, hc], collapsed [B, T, D])."""
        hc = self.hc
        flat = _unit_rms(streams.flatten(2).float(), self.eps)
        mix = F.linear(flat, self.fn.float())
        pre_w, post_w, comb_w = mix.split([hc, hc, hc * hc], dim=-1)
        pre_b, post_b, comb_b = self.base.float().split([hc, hc, hc * hc])
        s = self.scale.float()
        pre = torch.sigmoid(pre_w * s[0] + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * s[1] + post_b)
        comb = torch.softmax(comb_w.unflatten(-1, (hc, hc)) * s[2] + comb_b.view(hc, hc),
                             dim=-1) + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype)
        return post, comb, collapsed

    @staticmethod
    def mix(post, comb, out, streams) -> torch.Tensor:
        """post * out expanded to every stream + comb^T @ streams."""
        dtype = streams.dtype
        return (post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2)
                + torch.matmul(comb.to(dtype).transpose(-1, -2), streams))


class HyperHead(nn.Module):
    """``hc_head``: collapse the streams with sigmoid weights read from them."""

    def __init__(self, cfg: DeepseekV4Config) -> None:
        super().__init__()
        hc = cfg.hc_mult
        self.hc_eps, self.eps = cfg.hc_eps, cfg.rms_norm_eps
        self.hc_fn = nn.Parameter(torch.zeros(hc, hc * cfg.hidden_size))
        self.hc_base = nn.Parameter(torch.zeros(hc))
        self.hc_scale = nn.Parameter(torch.zeros(1))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        """streams [B, T, hc, D] -> [B, T, D]."""
        flat = _unit_rms(streams.flatten(2).float(), self.eps)
        mix = F.linear(flat, self.hc_fn.float())
        pre = torch.sigmoid(mix * self.hc_scale.float() + self.hc_base.float()) + self.hc_eps
        return (pre.unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype)


# -- MoE ------------------------------------------------------------------------------------
class ClampedMLP(nn.Module):
    """silu(min(gate, L)) * clamp(up, -L, L), then down (experts and the shared expert)."""

    def __init__(self, hidden: int, inter: int, limit: float) -> None:
        super().__init__()
        self.limit = limit
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lim = self.limit
        gate = self.gate_proj(x).clamp(max=lim)
        return self.down_proj(F.silu(gate) * self.up_proj(x).clamp(-lim, lim))


class V4Router(nn.Module):
    """``mlp.gate``: expert scores; the choice by top-k of score + bias, or by token (hash)."""

    def __init__(self, cfg: DeepseekV4Config, hashed: bool) -> None:
        super().__init__()
        e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
        self.k, self.hashed, self.scale = k, hashed, cfg.routed_scaling_factor
        self.sqrt_softplus = cfg.scoring_func == "sqrtsoftplus"
        self.weight = nn.Parameter(torch.zeros(e, cfg.hidden_size))
        if hashed:
            self.tid2eid = nn.Parameter(torch.zeros(cfg.vocab_size, k, dtype=torch.long),
                                        requires_grad=False)
        else:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(e), requires_grad=False)

    def forward(self, x: torch.Tensor, ids: torch.Tensor | None):
        """x [N, D] (ids [N] for hash routing) -> (weights [N, k], expert ids [N, k])."""
        logits = F.linear(x, self.weight)
        scores = F.softplus(logits).sqrt() if self.sqrt_softplus else logits.sigmoid()
        if self.hashed:
            if ids is None:
                raise ValueError("hash-routed MoE layers need the token ids")
            top_i = self.tid2eid[ids].long()
        else:
            top_i = (scores + self.e_score_correction_bias).topk(self.k, dim=-1).indices
        top_w = scores.gather(1, top_i)
        top_w = top_w / (top_w.sum(-1, keepdim=True) + 1e-20)
        return top_w * self.scale, top_i


class V4MoE(nn.Module):
    """``mlp``: router, routed experts and the always-on shared expert."""

    def __init__(self, cfg: DeepseekV4Config, hashed: bool) -> None:
        super().__init__()
        inter, lim = cfg.moe_intermediate_size, cfg.swiglu_limit
        self.gate = V4Router(cfg, hashed)
        self.experts = nn.ModuleList(ClampedMLP(cfg.hidden_size, inter, lim)
                                     for _ in range(cfg.n_routed_experts))
        self.shared_experts = ClampedMLP(cfg.hidden_size, inter, lim)

    def forward(self, x: torch.Tensor, ids: torch.Tensor | None) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        top_w, top_i = self.gate(flat, None if ids is None else ids.reshape(-1))
        routed = run_experts(flat, top_w, top_i, self.experts).reshape(shape)
        return routed + self.shared_experts(x)


class V4DecoderLayer(nn.Module):
    """Hyper-connected attention, then hyper-connected MoE, on [B, T, hc, D] streams."""

    def __init__(self, cfg: DeepseekV4Config, kind: str, mlp_kind: str) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        self.self_attn = V4Attention(cfg, kind)
        self.mlp = V4MoE(cfg, mlp_kind == HASH)
        self.input_layernorm = V4RMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = V4RMSNorm(cfg.hidden_size, eps)
        self.attn_hc = HyperConnection(cfg)
        self.ffn_hc = HyperConnection(cfg)

    def forward(self, x, tables, cache, ids) -> torch.Tensor:
        post, comb, col = self.attn_hc(x)
        x = HyperConnection.mix(post, comb,
                                self.self_attn(self.input_layernorm(col), tables, cache), x)
        post, comb, col = self.ffn_hc(x)
        return HyperConnection.mix(post, comb,
                                   self.mlp(self.post_attention_layernorm(col), ids), x)

    def new_cache(self, batch: int, max_len: int) -> V4Cache:
        """This layer's cache."""
        return self.self_attn.new_cache(batch, max_len)


class V4MTPLayer(nn.Module):
    """``mtp.{i}``: additive combine per stream, one decoder block, its own head collapse."""

    def __init__(self, cfg: DeepseekV4Config, kind: str) -> None:
        super().__init__()
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.enorm = V4RMSNorm(d, eps)
        self.hnorm = V4RMSNorm(d, eps)
        self.e_proj = nn.Linear(d, d, bias=False)
        self.h_proj = nn.Linear(d, d, bias=False)
        self.block = V4DecoderLayer(cfg, kind, TOPK)
        self.hc_head = HyperHead(cfg)
        self.norm = V4RMSNorm(d, eps)

    def new_cache(self, batch: int, max_len: int) -> V4Cache:
        """The block's cache."""
        return self.block.new_cache(batch, max_len)

    def forward(self, emb, streams, tables, cache, ids):
        """-> (normed collapsed state [B, T, D], the block's output streams [B, T, hc, D])."""
        x = self.h_proj(self.hnorm(streams)) + self.e_proj(self.enorm(emb)).unsqueeze(-2)
        out = self.block(x, tables, cache, ids)
        return self.norm(self.hc_head(out)), out


class V4MTP(DraftLayers, nn.Module):
    """The MTP layers; draft step s runs layer ``layer_for(s)`` (as every family)."""

    def __init__(self, cfg: DeepseekV4Config) -> None:
        super().__init__()
        # The streams before hc_head feed step 0 and chain (vLLM's DeepSeekV4MTP); they sit
        # in TrunkOutput.pre_norm.
        self.spec = MTPSpec(cfg.num_nextn_predict_layers, trunk_hidden="pre_norm",
                            chain_hidden="pre_norm", eps=cfg.rms_norm_eps,
                            zero_first_embedding=True, own_combine=True)
        self.layers = nn.ModuleList(V4MTPLayer(cfg, k) for k in cfg.mtp_layer_types)
        # No own output heads: vLLM's MTP proposer swaps every layer's shared_head.head
        # (loaded from mtp.{i}.head) for the trunk's lm_head, which scores the drafts here too.
        self.heads = nn.ModuleDict()


# Release names below layers.{i}. / mtp.{i}. -> transformers' names, applied in order
# (transformers' conversion_mapping for deepseek_v4 reads the release the same way).
_NATIVE = [
    (r"\.attn\.", ".self_attn."), (r"\.ffn\.", ".mlp."),
    (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"\.attn_norm\.", ".input_layernorm."), (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_attn_(fn|base|scale)$", r".attn_hc.\1"), (r"\.hc_ffn_(fn|base|scale)$", r".ffn_hc.\1"),
    (r"\.attn_sink$", ".sinks"),
    (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."),
    (r"\.norm\.", ".kv_norm."), (r"\.ape$", ".position_bias"), (r"\.wq_a\.", ".q_a_proj."),
    (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."), (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."), (r"\.wo_a\.", ".o_a_proj."), (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."), (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.(shared_experts|experts\.\d+)\.w1\.", r".\1.gate_proj."),
    (r"\.(shared_experts|experts\.\d+)\.w2\.", r".\1.down_proj."),
    (r"\.(shared_experts|experts\.\d+)\.w3\.", r".\1.up_proj."),
]
_NATIVE_TOP = {"embed.weight": "model.embed_tokens.weight", "head.weight": "lm_head.weight",
               "norm.weight": "model.norm.weight", "hc_head_fn": "model.hc_head.hc_fn",
               "hc_head_base": "model.hc_head.hc_base", "hc_head_scale": "model.hc_head.hc_scale"}
_MTP_OWN = {"enorm.weight", "hnorm.weight", "e_proj.weight", "h_proj.weight", "norm.weight"}
_MTP_HEAD = {"hc_head_fn": "hc_head.hc_fn", "hc_head_base": "hc_head.hc_base",
             "hc_head_scale": "hc_head.hc_scale"}


def native_block_name(rest: str) -> str:
    """A decoder block's release name (``attn.wq_a.weight``...) -> transformers' name."""
    name = "." + rest
    for pattern, repl in _NATIVE:
        name = re.sub(pattern, repl, name)
    return name[1:]


class DeepseekV4ForCausalLM(CausalLM):
    """DeepSeek-V4 text model with its MTP layers."""

    config_class = DeepseekV4Config

    def __init__(self, cfg: DeepseekV4Config) -> None:
        super().__init__(cfg)
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.model.layers = nn.ModuleList(
            V4DecoderLayer(cfg, kind, mlp)
            for kind, mlp in zip(cfg.layer_types, cfg.mlp_layer_types, strict=True))
        self.model.hc_head = HyperHead(cfg)
        self.model.norm = V4RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.rotaries = nn.ModuleDict({
            "main": HalfRotary(cfg.rot_dim, cfg.rope_theta),
            "compress": HalfRotary(cfg.rot_dim, cfg.compress_rope_theta, cfg.compress_scaling),
        })
        # What callers reading model.rotary get: the (sliding) MTP layers' rotary.
        self.rotary = self.rotaries["main"]
        self.mtp = V4MTP(cfg) if cfg.num_nextn_predict_layers else None

    def packable(self) -> bool:
        """Not a plain-GQA trunk."""
        return False

    def forward(self, input_ids: torch.Tensor, cache: ModelCache | None = None) -> TrunkOutput:
        """Tokens [B, T] at positions cache.length.. -> (normed state, streams before
        hc_head [B, T, hc, D] in pre_norm: what the MTP layers read)."""
        x = self.model.embed_tokens(input_ids)
        x = x.unsqueeze(2).expand(-1, -1, self.config.hc_mult, -1).contiguous()
        for i, layer in enumerate(self.model.layers):
            x = layer(x, self.rotaries, cache[i] if cache is not None else None, input_ids)
        return TrunkOutput(self.model.norm(self.model.hc_head(x)), x)

    def mtp_forward(self, next_ids, hidden, step, start, cache) -> TrunkOutput:
        """One draft step: tokens t_{i+1} [B, T], streams h_i [B, T, hc, D] at start.."""
        i = self.mtp.layer_for(step)
        layer_cache = None
        if cache is not None:
            layer_cache = cache[i]
            if layer_cache.length > start:
                layer_cache.trim(start)
            layer_cache.skip_to(start)
        emb = self.model.embed_tokens(next_ids)
        if start == 0:  # no state precedes the first token: its embedding is masked
            emb = torch.cat([torch.zeros_like(emb[:, :1]), emb[:, 1:]], dim=1)
        post, streams = self.mtp.layers[i](emb, hidden, self.rotaries, layer_cache, next_ids)
        return TrunkOutput(post, streams)

    def map_checkpoint_name(self, name: str) -> str | None:
        """Release names (``layers.{i}.attn.*``, ``mtp.{i}.*``...) -> ours."""
        # The release's FP8 / FP4 scales end in ".scale" (transformers' hc scales do too);
        # the quantized-module scan takes them when the config says quant_method fp8, so
        # one that gets here has no such config and its weight would load unscaled.
        if name.endswith(".scale") and not name.endswith(("attn_hc.scale", "ffn_hc.scale")):
            raise CheckpointError(
                f"{name}: a DeepSeek-V4 FP8 / FP4 block scale, but config.json has no "
                "quantization_config with quant_method fp8; restore the release's "
                "quantization_config (quant_method fp8, fmt e4m3, scale_fmt ue8m0, "
                "weight_block_size [128, 128])")
        if name in _NATIVE_TOP:
            return _NATIVE_TOP[name]
        # transformers' save_pretrained writes the release's block names below model.;
        # transformers' own names pass native_block_name unchanged.
        m = re.match(r"(?:model\.)?layers\.(\d+)\.(.+)$", name)
        if m:
            return f"model.layers.{m[1]}.{native_block_name(m[2])}"
        m = re.match(r"mtp\.(\d+)\.(.+)$", name)
        if m:
            i, rest = int(m[1]), m[2]
            if i >= self.config.num_nextn_predict_layers:
                return name  # reported as unused
            if rest.startswith(("head.", "emb.")):
                return None  # copies of the trunk's lm_head / embedding
            if rest in _MTP_OWN:
                return f"mtp.layers.{i}.{rest}"
            if rest in _MTP_HEAD:
                return f"mtp.layers.{i}.{_MTP_HEAD[rest]}"
            return f"mtp.layers.{i}.block.{native_block_name(rest)}"
        return super().map_checkpoint_name(name)

    def _install_quantized(self, plan, ckpt, report) -> dict[str, str]:
        """Nothing: every module stored quantized is dequantized into its float Linear (the
        release's FP8 / FP4 and compressed-tensors alike), through load_checkpoint's
        _read_float."""
        # The family's compressors, hyper-connections and MoE run in float here, and
        # mtpkit's quantized kernels serve the plain-GQA families' fast path only.
        return {}

    def _warn_unquantized(self, plan, by_module, report, overlaid=()) -> None:
        # Only what vLLM builds quantized can be the config's to cover: the release stores
        # the compressors, the indexer's weights_proj and the heads in float, and vLLM builds
        # them without a quantization config (heads: unless a target names them).
        from ..checkpoint.runtime_names import describe

        cfg = {"num_hidden_layers": self.config.num_hidden_layers}

        def built_quantized(ckpt_name: str) -> bool:
            rt = describe(ckpt_name.rpartition(".")[0], "deepseek_v4", config=cfg)
            return rt.quantizable and not rt.by_name_only

        kept = {m: c for m, c in by_module.items()
                if m.endswith(".weight") and built_quantized(c)}
        super()._warn_unquantized(plan, kept, report, overlaid)

    def split_checkpoint_tensor(self, name: str, tensor_fn):
        """transformers' stacked experts (gate_up_proj [E, 2I, D], down_proj) -> per expert."""
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            return split_fused_experts(name, tensor_fn)
        return None
