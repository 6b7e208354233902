"""GLM-5 (``glm_moe_dsa``): GLM-4.7-Flash's MLA + MoE trunk with DeepSeek Sparse Attention.

The trunk is DeepSeek-V3's modules under GLM's config (see glm4_moe_lite.py); what GLM-5
adds is an indexer per attention layer that picks, for every query, the ``index_topk``
keys it may attend (DeepSeek Sparse Attention, DSA). The indexer, as transformers 5.23's
``GlmMoeDsaIndexer`` computes it, under ``self_attn.indexer``:

- queries ``wq_b(q_latent)`` with ``index_n_heads`` heads of ``index_head_dim``, where
  q_latent is the attention's own ``q_a_layernorm(q_a_proj(x))``;
- one key per position ``k_norm(wk(x))`` (a LayerNorm with bias), cached like the latent;
- interleaved rope on the first ``qk_rope_head_dim`` channels of both;
- score(key) = sum_h w_h relu(q_h . k / sqrt(index_head_dim)), with
  w = ``weights_proj(x)`` / sqrt(index_n_heads) (weights_proj kept in float32, as
  transformers keeps it); the ``index_topk`` best causal keys are attended, the rest masked.

``indexer_types`` says per layer whether it runs its own indexer ("full") or reuses the
previous layer's selection ("shared", no indexer tensors); absent, transformers derives it
from ``index_topk_pattern`` ("F"/"S") or ``index_topk_freq`` / ``index_skip_topk_offset``.
With a context of at most ``index_topk`` keys every key is selected, so the mask is skipped.

The MTP layer sits at ``model.layers.{num_hidden_layers}`` and always has its own indexer
(vLLM builds one for it whatever the schedule says; the release stores one). It runs its
indexer at every draft step; vLLM's ``index_share_for_mtp_iteration`` instead reuses the
first draft step's selection for the later ones, so past ``index_topk`` tokens of context
mtpkit's chained drafts can differ from vLLM's (the drafts only, never the output).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .base import CausalLM, TrunkOutput
from .cache import CacheFullError, zeros
from .config import ConfigError
from .deepseek_v3 import LatentCache, MLAttention
from .glm4_moe_lite import Glm4MoeLiteConfig
from .layers import DecoderStack, PreNormDecoderLayer, RMSNorm, Rotary
from .moe import make_grouped_mlp
from .mtp import DeepSeekStyleMTP

INDEXER_KINDS = ("full", "shared")


@dataclass
class GlmMoeDsaConfig(Glm4MoeLiteConfig):
    """GLM-4.7-Flash's keys plus the sparse-attention indexer's."""

    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 32
    indexer_types: list[str] | None = None

    @classmethod
    def from_hf_config(cls, d: dict) -> GlmMoeDsaConfig:
        """GLM-4.7-Flash's reading (three dense layers by default), then the indexer's keys."""
        d = {"model_type": "glm_moe_dsa", "first_k_dense_replace": 3, **d}
        mt = d["model_type"]
        for key in ("rope_interleave", "indexer_rope_interleave"):
            # transformers' GLM-5 interleaves both ropes whatever the config says; vLLM
            # would follow a false here, so there is no one right answer to run.
            if d.get(key, True) is not True:
                raise ConfigError(f"config.json ({mt}): {key}={d[key]!r} is not supported; "
                                  "GLM-5 releases set it true (interleaved rope)")
        if d.get("q_lora_rank") is None:
            raise ConfigError(f"config.json ({mt}): q_lora_rank is required (the indexer "
                              "reads the query latent; GLM-5 has 2048)")
        cfg = super().from_hf_config(d)
        cfg.index_topk = int(d.get("index_topk", 2048))
        cfg.index_head_dim = int(d.get("index_head_dim", 128))
        cfg.index_n_heads = int(d.get("index_n_heads", 32))
        cfg.indexer_types = indexer_schedule(d, cfg.num_hidden_layers)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """GLM-4.7-Flash's checks, the indexer's sizes and a schedule that starts "full"."""
        super().validate()
        kinds = self.indexer_types
        if kinds is None:
            return  # from_hf_config validates again once the indexer's keys are read
        for name in ("index_topk", "index_head_dim", "index_n_heads"):
            if getattr(self, name) <= 0:
                self.fail(f"{name}={getattr(self, name)} must be positive")
        if self.index_head_dim < self.qk_rope_head_dim:
            self.fail(f"index_head_dim={self.index_head_dim} is smaller than "
                      f"qk_rope_head_dim={self.qk_rope_head_dim}, which the indexer rotates")
        if len(kinds) != self.num_hidden_layers or any(k not in INDEXER_KINDS for k in kinds):
            self.fail(f"indexer_types must list 'full' or 'shared' for each of the "
                      f"{self.num_hidden_layers} layers; got {kinds!r}")
        if kinds and kinds[0] != "full":
            self.fail("indexer_types[0] must be 'full': a shared layer reuses the selection "
                      "of the layer before it, and layer 0 has none")

    def has_indexer(self, i: int) -> bool:
        """Whether layer i runs its own indexer (MTP layers, past the list, always do)."""
        kinds = self.indexer_types
        return kinds is None or i >= len(kinds) or kinds[i] == "full"


def indexer_schedule(d: dict, n: int) -> list[str]:
    """Per-layer "full" / "shared" as transformers' GlmMoeDsaConfig derives it."""
    if d.get("indexer_types") is not None:
        return list(d["indexer_types"])
    pattern = d.get("index_topk_pattern")
    if pattern is not None:
        if isinstance(pattern, str):
            bad = set(pattern) - {"F", "S"}
            if bad:
                raise ConfigError(f"config.json (glm_moe_dsa): index_topk_pattern has "
                                  f"{''.join(sorted(bad))!r}; only 'F' and 'S' are known")
            return [{"F": "full", "S": "shared"}[c] for c in pattern]
        return list(pattern)
    freq = max(int(d.get("index_topk_freq", 1)), 1)
    offset = int(d.get("index_skip_topk_offset", 2))
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]


class Float32Linear(nn.Linear):
    """A Linear that stays float32 when the model is cast and reads its input as float32."""

    def _apply(self, fn, recurse=True):
        # As the router's correction bias (moe.py): casts keep the fp32 values, moves move them.
        weight = self.weight.data
        out = super()._apply(fn, recurse)
        if (self.weight.dtype != torch.float32 and weight.dtype == torch.float32
                and self.weight.device.type != "meta"):
            self.weight.data = weight.to(self.weight.device)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias)


class DsaCache(LatentCache):
    """The latent cache plus the indexer's key per position (``ik`` [B, max_len, head_dim])."""

    def __init__(self, batch, max_len, r, dr, index_dim, dtype, device) -> None:
        super().__init__(batch, 1, max_len, r, dtype, device, v_head_dim=dr)
        self.ik = zeros((batch, max_len, index_dim), dtype, device)

    def index_keys(self, k: torch.Tensor) -> torch.Tensor:
        """Write indexer keys [B, T, d] at the current position (the latent's update moves
        it on); return every key so far."""
        start = self.length
        end = start + k.shape[1]
        if end > self.max_len:
            raise CacheFullError(f"KV cache holds {self.max_len} positions; {end} needed. "
                                 "Raise --max-model-len or lower --max-tokens.")
        self.ik[:, start:end] = k
        return self.ik[:, :end]


class Indexer(nn.Module):
    """DSA's lightning indexer; names as in GLM-5 checkpoints (``self_attn.indexer.*``)."""

    def __init__(self, cfg: GlmMoeDsaConfig) -> None:
        super().__init__()
        self.n, self.d, self.dr = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
        self.topk = cfg.index_topk
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.n * self.d, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, self.d, bias=False)
        self.k_norm = nn.LayerNorm(self.d, eps=1e-6)
        self.weights_proj = Float32Linear(cfg.hidden_size, self.n, bias=False)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # Interleaved pairs over the first dr channels, as MLAttention._rope; the rest pass.
        r = x[..., : self.dr]
        x = torch.cat([r[..., 0::2], r[..., 1::2], x[..., self.dr :]], dim=-1)
        return Rotary.apply(x, cos, sin)

    def forward(self, x, q_lat, cos, sin, cache: DsaCache | None) -> torch.Tensor | None:
        """x [B, T, D] -> keys each query keeps [B, T, S] (bool); None: every key."""
        b, t, _ = x.shape
        q = self._rope(self.wq_b(q_lat).view(b, t, self.n, self.d).transpose(1, 2), cos, sin)
        k = self._rope(self.k_norm(self.wk(x))[:, None], cos, sin)[:, 0]  # [B, T, d]
        start, valid = 0, None
        if cache is not None:
            start = cache.length
            k = cache.index_keys(k)
            valid = cache.key_mask(start + t)
        s = k.shape[1]
        if s <= self.topk:
            return None  # top-k of at most topk keys is all of them
        # The order of operations is transformers': near-equal scores then rank the same.
        q = q.transpose(1, 2).contiguous().float()  # [B, T, H, d]
        scores = F.relu(torch.matmul(q, k.float().transpose(-1, -2)[:, None]) * self.d**-0.5)
        w = self.weights_proj(x).float() * self.n**-0.5  # [B, T, H]
        index = torch.matmul(w[..., None, :], scores)[..., 0, :]  # [B, T, S]
        allowed = torch.arange(s, device=x.device)[None, :] <= \
            torch.arange(start, start + t, device=x.device)[:, None]
        if valid is not None:
            allowed = allowed & valid[None, :]
        index = index.masked_fill(~allowed, float("-inf"))
        picked = index.topk(self.topk, dim=-1).indices
        keep = torch.zeros_like(index, dtype=torch.bool).scatter_(-1, picked, True)
        return keep & allowed


class DsaAttention(MLAttention):
    """MLA whose keys are narrowed by an indexer's selection (its own, or one passed in)."""

    def __init__(self, cfg: GlmMoeDsaConfig, own_indexer: bool) -> None:
        super().__init__(cfg)
        self.index_dim = cfg.index_head_dim
        self.indexer = Indexer(cfg) if own_indexer else None

    def new_cache(self, batch: int, max_len: int) -> LatentCache:
        """A latent cache, with the indexer's keys when this layer has an indexer."""
        if self.indexer is None:
            return super().new_cache(batch, max_len)
        w = self.kv_a_proj_with_mqa.weight
        return DsaCache(batch, max_len, self.r, self.dr, self.index_dim, w.dtype, w.device)

    def run(self, x, cos, sin, cache, shared: torch.Tensor | None):
        """-> (output [B, T, D], the selection used: this layer's or ``shared``)."""
        q_lat, q_nope, q_rot, c, k_rot = self.project(x, cos, sin)
        keep = shared
        if self.indexer is not None:
            # Before attend: the indexer writes its keys at the cache's current position.
            keep = self.indexer(x, q_lat, cos, sin, cache)
        return self.attend(q_nope, q_rot, c, k_rot, cache, keep), keep


class GlmMoeDsaDecoderLayer(PreNormDecoderLayer):
    """Pre-norm DSA attention + dense or MoE MLP."""

    def __init__(self, cfg: GlmMoeDsaConfig, moe: bool, own_indexer: bool) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DsaAttention(cfg, own_indexer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = make_grouped_mlp(cfg, moe)

    def run(self, x, cos, sin, cache, shared: torch.Tensor | None = None):
        """-> (output, the key selection a following shared layer reuses)."""
        h, keep = self.self_attn.run(self.input_layernorm(x), cos, sin, cache, shared)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), keep

    def forward(self, x, cos, sin, cache) -> torch.Tensor:
        """The layer alone (the MTP block): only a layer with its own indexer can."""
        if self.self_attn.indexer is None:
            raise RuntimeError("a shared-indexer layer needs the previous layer's selection")
        return self.run(x, cos, sin, cache)[0]


class GlmMoeDsaForCausalLM(DeepSeekStyleMTP, CausalLM):
    """GLM-5: DeepSeek-V3's model with DSA layers, built from GlmMoeDsaConfig."""

    config_class = GlmMoeDsaConfig

    def __init__(self, cfg: GlmMoeDsaConfig) -> None:
        super().__init__(cfg)

        def layer(i: int) -> GlmMoeDsaDecoderLayer:
            return GlmMoeDsaDecoderLayer(cfg, cfg.is_moe(i), cfg.has_indexer(i))

        n = cfg.num_hidden_layers
        self.model = DecoderStack(cfg.vocab_size, cfg.hidden_size, [layer(i) for i in range(n)],
                                  RMSNorm(cfg.hidden_size, cfg.rms_norm_eps))
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.rotary = Rotary(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.mtp = self.build_mtp(cfg, lambda i: layer(n + i))

    def forward(self, input_ids: torch.Tensor, cache=None) -> TrunkOutput:
        """CausalLM.forward, handing each layer's key selection on to the next."""
        start = cache.length if cache is not None else 0
        cos, sin = self.rotary.cos_sin(self._positions(start, input_ids.shape[1]))
        x = self.model.embed_tokens(input_ids)
        keep = None
        for i, layer in enumerate(self.model.layers):
            x, keep = layer.run(x, cos, sin, cache[i] if cache is not None else None, keep)
        return TrunkOutput(self.model.norm(x), x)

