"""Layers shared by every family: RMSNorm (plain and zero-centred), rotary embedding, MLP."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm; ``zero_centered`` stores w-1 on disk and applies x*(1+w) (Qwen3-Next/3.5)."""

    def __init__(self, dim: int, eps: float = 1e-6, zero_centered: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.zero_centered = zero_centered
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 as the reference implementations do; low-precision variance
        # changes greedy choices on real checkpoints.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        w = self.weight.float()
        if self.zero_centered:
            return (x * (1.0 + w)).to(dtype)
        return w.to(dtype) * x.to(dtype)


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, fused: nn.ModuleDict | None = None) -> torch.Tensor:
        """``fused``: a step's own forms of the projections (swapped), gate and up as one
        stacked ``gate_up`` layer where it has one."""
        if fused is not None and "gate_up" in fused:
            gate, up = fused["gate_up"](x).chunk(2, dim=-1)
        else:
            gate = swapped(fused, "gate_proj", self.gate_proj)(x)
            up = swapped(fused, "up_proj", self.up_proj)(x)
        return swapped(fused, "down_proj", self.down_proj)(F.silu(gate) * up)


def swapped(fused: nn.ModuleDict | None, name: str, default: nn.Module) -> nn.Module:
    """The layer ``name`` in a step's own kernel form where ``fused`` holds one (the fast
    path's row-exact or stacked layers, engine/programs.Programs), else the model's own."""
    return fused[name] if fused is not None and name in fused else default


def rope_inv_freq(rot_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies of rotary embedding, with Llama-3 style scaling when configured."""
    ar = torch.arange(0, rot_dim, 2, dtype=torch.float64, device="cpu")
    inv = 1.0 / (theta ** (ar / rot_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind in (None, "default"):
        return inv.float()
    if kind == "llama3":
        factor = scaling["factor"]
        lo, hi = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        # Long wavelengths are slowed by `factor`, short ones kept, a smooth blend between.
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        scaled = torch.where(wavelen > old_ctx / lo, inv / factor, inv)
        mid = (wavelen <= old_ctx / lo) & (wavelen >= old_ctx / hi)
        blended = (1 - smooth) * inv / factor + smooth * inv
        return torch.where(mid, blended, scaled).float()
    if kind == "linear":
        return (inv / scaling["factor"]).float()
    if kind == "yarn":
        # YaRN: high-frequency channels (many rotations within the original context) keep
        # their frequency, low-frequency ones are interpolated by `factor`, a linear ramp
        # between the channels that turn beta_fast and beta_slow times.
        factor, old_ctx = scaling["factor"], scaling["original_max_position_embeddings"]
        fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

        def channel(rotations: float) -> float:
            return rot_dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        lo, hi = channel(fast), channel(slow)
        if scaling.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, rot_dim - 1)
        ar = torch.arange(rot_dim // 2, dtype=torch.float64, device="cpu")
        ramp = (ar - lo) / max(hi - lo, 1e-3)
        keep = 1 - ramp.clamp(0, 1)
        return (inv / factor * (1 - keep) + inv * keep).float()
    raise ValueError(
        f"rope scaling type {kind!r} is not supported (supported: default, linear, llama3, yarn)"
    )


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(scaling: dict | None) -> float:
    """The factor YaRN multiplies cos/sin by (1 for every other rope type)."""
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, m, m_all = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    if m and m_all:
        return yarn_mscale(factor, m) / yarn_mscale(factor, m_all)
    return yarn_mscale(factor)


class Rotary(nn.Module):
    """Rotary position embedding on the first ``rot_dim`` channels, HF half-rotation layout."""

    def __init__(self, rot_dim: int, theta: float, scaling: dict | None = None) -> None:
        super().__init__()
        self.rot_dim = rot_dim
        # A plain attribute, not a buffer: it must stay fp32 when the model is cast to bf16,
        # and survive building the model on the meta device.
        self.inv_freq = rope_inv_freq(rot_dim, theta, scaling)
        self.attention_factor = rope_attention_factor(scaling)

    def _apply(self, fn, recurse=True):
        # Device moves (model.to("cuda"), to_empty) take inv_freq along; dtype casts do not.
        # cos_sin used to move it lazily to the positions' device, which torch.compile traced:
        # the first compiled call replaced the tensor, its guard failed, and every CUDA
        # program compiled twice, the second time in the middle of a request (50 s, H100).
        probe = fn(torch.empty(0, device=self.inv_freq.device))
        if probe.device != self.inv_freq.device:
            self.inv_freq = self.inv_freq.to(probe.device)
        return super()._apply(fn, recurse)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin tables [T, rot_dim] for integer positions [T]."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        if self.attention_factor != 1.0:
            return emb.cos() * self.attention_factor, emb.sin() * self.attention_factor
        return emb.cos(), emb.sin()

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x [B, H, T, D]; channels beyond cos' width pass through (partial rotary)."""
        r = cos.shape[-1]
        xr, xp = x[..., :r], x[..., r:]
        x1, x2 = xr[..., : r // 2], xr[..., r // 2 :]
        rotated = torch.cat([-x2, x1], dim=-1)
        out = xr * cos.to(x.dtype) + rotated * sin.to(x.dtype)
        return torch.cat([out, xp], dim=-1) if xp.shape[-1] else out


class PreNormDecoderLayer(nn.Module):
    """x + self_attn(input_layernorm(x)), then + mlp(post_attention_layernorm(x)).

    Subclasses build the four modules (named as in the checkpoints); the attention module
    provides ``new_cache``.
    """

    def forward(self, x, cos, sin, cache) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_static(self, x, cos, sin, kbuf, vbuf, pos, mask, rows=None,
                       fused=None) -> torch.Tensor:
        """The same block over static cache buffers at tensor positions pos [T] (what the
        compiled programs trace; Attention.forward_static), a SwiGLU MLP."""
        x = x + self.self_attn.forward_static(self.input_layernorm(x), cos, sin, kbuf, vbuf,
                                              pos, mask, rows, fused)
        return x + self.mlp(self.post_attention_layernorm(x), fused)

    def new_cache(self, batch: int, max_len: int):
        """This layer's cache (KV or latent, as its attention keeps)."""
        return self.self_attn.new_cache(batch, max_len)


class DecoderStack(nn.Module):
    """``model.*``: embed_tokens, the decoder layers, the final norm."""

    def __init__(self, vocab_size: int, hidden_size: int, layers, norm: nn.Module) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = norm
