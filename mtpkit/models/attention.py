"""Grouped-query attention over a static KV cache (bias, q/k norm, output gate optional)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..quant.kernels import int8_mm_available
from ..quant.linear import dtype_device
from .cache import KVCache
from .layers import RMSNorm, Rotary

# Forward passes of up to this many tokens over a cache are verification steps.
VERIFY_ROWS = 16


def causal_mask(start: int, t: int, device: torch.device) -> torch.Tensor | None:
    """Boolean mask [t, start+t] letting query i see keys 0..start+i; None when t == 1."""
    if t == 1:
        return None
    q_pos = torch.arange(start, start + t, device=device)[:, None]
    k_pos = torch.arange(start + t, device=device)[None, :]
    return k_pos <= q_pos


def windowed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       cache: KVCache | None, scale: float, window: int | None = None,
                       sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal softmax attention of q [B, H, T, d] (rotated) over new k / v [B, KV, T, d]
    appended to ``cache``: query t at position p sees keys p-window+1..p (every earlier key
    when window is None); ``sinks`` [H]: one more softmax logit per head that takes
    probability and adds nothing. -> [B, H, T, dv]."""
    b, _, t, _ = q.shape
    start, valid = 0, None
    if cache is not None:
        start = cache.length
        k, v = cache.update(k, v)
        valid = cache.key_mask(start + t)
    q_pos = torch.arange(start, start + t, device=q.device)[:, None]
    k_pos = torch.arange(k.shape[2], device=q.device)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed = allowed & (q_pos - k_pos < window)
    if valid is not None:
        allowed = allowed & valid[None, :]
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        # The sink is one more softmax column per head, dropped after normalising.
        sink = sinks.float().view(1, -1, 1, 1).expand(b, -1, t, 1)
        probs = F.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = F.softmax(scores, dim=-1)
    return probs.to(v.dtype) @ v


class Attention(nn.Module):
    """GQA attention; names as in Llama/Qwen checkpoints (q_proj, k_proj, v_proj, o_proj)."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        bias: bool = False,
        o_bias: bool | None = None,
        qk_norm: bool = False,
        output_gate: bool = False,
        rms_norm_eps: float = 1e-6,
        zero_centered_norm: bool = False,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        # Qwen3-Next doubles q_proj: per head, [query | gate], the gate scaling the output.
        self.output_gate = output_gate
        q_out = num_heads * head_dim * (2 if output_gate else 1)
        self.q_proj = nn.Linear(hidden_size, q_out, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        o_bias = bias if o_bias is None else o_bias
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=o_bias)
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, rms_norm_eps, zero_centered_norm)
            self.k_norm = RMSNorm(head_dim, rms_norm_eps, zero_centered_norm)
        else:
            self.q_norm = self.k_norm = None

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        """A static KV cache for this layer, on its weights' device and dtype."""
        dtype, device = dtype_device(self.k_proj)
        return KVCache(batch, self.num_kv_heads, max_len, self.head_dim, dtype, device)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache | PackedCaches | None,
    ) -> torch.Tensor:
        """x [B, T, D] at positions cache.length.. -> [B, T, D].

        With ``PackedCaches``, x [1, sum T_i, D] holds several sequences one after another:
        the projections run once over all their rows (the weights are read once per step,
        which is what batching buys on a bandwidth-bound machine) and each sequence attends
        over its own cache.
        """
        b, t, _ = x.shape
        q = self.q_proj(x)
        gate = None
        if self.output_gate:
            q, gate = q.view(b, t, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
            gate = gate.reshape(b, t, self.num_heads * self.head_dim)
        q = q.reshape(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = Rotary.apply(q, cos, sin), Rotary.apply(k, cos, sin)
        if isinstance(cache, PackedCaches):
            outs, s = [], 0
            for c, n in zip(cache.caches, cache.lengths, strict=True):
                outs.append(self._attend(q[:, :, s : s + n], k[:, :, s : s + n],
                                         v[:, :, s : s + n], c))
                s += n
            out = torch.cat(outs, dim=2)
        else:
            out = self._attend(q, k, v, cache)
        out = out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out)

    @staticmethod
    def _attend(q, k, v, cache: KVCache | None) -> torch.Tensor:
        """Rotated q, k, v [B, H, T, hd] of one sequence -> attention output [B, H, T, hd]."""
        t = q.shape[2]
        start, mask = 0, None
        if cache is not None:
            start = cache.length
            k, v = cache.update(k, v)
            mask = cache.key_mask(start + t)
        causal = causal_mask(start, t, q.device)
        if mask is not None:
            causal = mask[None, :] if causal is None else causal & mask[None, :]
        if cache is not None and t <= VERIFY_ROWS and mask is None:
            # attend_rows takes one sequence, query heads grouped on KV heads, v as wide as q.
            if (q.shape[0] == 1 and v.shape[-1] == q.shape[-1] and q.shape[1] % k.shape[1] == 0
                    and row_kernel_fits(q, k)):
                # mtpkit's row attention: a row's bits depend on nothing but its own query
                # and keys, neither on the other rows nor on the thread count, which the
                # engine lowers while other programs compete for the CPU (torch's CPU SDPA
                # splits a one-row step's keys by thread: other bits, other int8 codes on a
                # quantized trunk, other text beside a busy program).
                pos = torch.arange(start, start + t, device=q.device)
                out = torch.ops.mtpkit.attend_rows(q[0].transpose(0, 1), k[0], v[0], pos, t)
                return out.transpose(0, 1)[None]
            if t > 1:
                # A verification pass: each query row attends exactly as the one-token
                # decode step at its position would (same kernel, same key span, no mask),
                # so the accepted tokens' states match plain decoding bit for bit wherever
                # the projections are row-independent (the packed int kernels are); one
                # batched masked call rounds differently and, through bf16 activations, can
                # flip a near-tie between the two runs.
                return torch.cat([sdpa(q[:, :, j : j + 1], k[:, :, : start + j + 1],
                                       v[:, :, : start + j + 1], None) for j in range(t)],
                                 dim=2)
        return sdpa(q, k, v, causal)


def row_kernel_fits(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether mtpkit's attend_rows can attend q over keys k here (fp32 CPU, kernels built)."""
    return (q.device.type == "cpu" and q.dtype == k.dtype == torch.float32
            and int8_mm_available())


class PackedCaches:
    """Several sequences' caches for one layer, for a forward over their rows packed in one."""

    def __init__(self, caches: list[KVCache], lengths: list[int]) -> None:
        self.caches, self.lengths = caches, lengths


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None):
    """Scaled dot-product attention with KV heads shared by groups of query heads."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        # SDPA's enable_gqa is not taken by every backend; repeating KV heads is portable.
        b, h, s, d = k.shape
        k = k[:, :, None].expand(b, h, groups, s, d).reshape(b, h * groups, s, d)
        v = v[:, :, None].expand(b, h, groups, s, v.shape[-1]).reshape(b, h * groups, s, -1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
