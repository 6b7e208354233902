"""Grouped-query attention over a static KV cache (bias, q/k norm, output gate optional)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..quant.kernels import int8_mm_available
from ..quant.linear import dtype_device
from .cache import KVCache
from .layers import RMSNorm, Rotary, swapped

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
                       cache: KVCache | PackedCaches | None, scale: float,
                       window: int | None = None,
                       sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal softmax attention of q [B, H, T, d] (rotated) over new k / v [B, KV, T, d]
    appended to ``cache``: query t at position p sees keys p-window+1..p (every earlier key
    when window is None); ``sinks`` [H]: one more softmax logit per head that takes
    probability and adds nothing. -> [B, H, T, dv]. With ``PackedCaches`` the rows are
    several sequences' one after another, each attending over its own cache."""
    if isinstance(cache, PackedCaches):
        return cache.each(lambda q, k, v, c: windowed_attention(q, k, v, c, scale, window, sinks),
                          q, k, v, dim=2)
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

    packs = True  # forward takes PackedCaches (CausalLM.packable)

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
        q, k, v, gate = self.heads(*self.projections(x), cos, sin)
        if isinstance(cache, PackedCaches):
            out = cache.each(self._attend, q, k, v, dim=2)
        else:
            out = self._attend(q, k, v, cache)
        out = out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim)
        return self.output(out, gate)

    # -- the pieces every road through this layer shares ----------------------------------
    def qkv(self, x: torch.Tensor, fused: nn.ModuleDict | None = None) -> torch.Tensor:
        """The q/k/v projections of x side by side [.., Nq + 2 Nkv] (the step's stacked
        ``qkv`` layer where it has one)."""
        if fused is not None and "qkv" in fused:
            return fused["qkv"](x)
        return torch.cat(self.projections(x, fused), -1)

    def projections(self, x: torch.Tensor, fused: nn.ModuleDict | None = None):
        """q, k, v of x (the step's kernel forms where ``fused`` has them)."""
        if fused is not None and "qkv" in fused:
            return self.split_qkv(fused["qkv"](x))
        return [swapped(fused, n, getattr(self, n))(x) for n in ("q_proj", "k_proj", "v_proj")]

    def split_qkv(self, qkv: torch.Tensor) -> list[torch.Tensor]:
        """qkv [.., Nq + 2 Nkv] -> q, k, v."""
        kv = self.num_kv_heads * self.head_dim
        return qkv.split([self.q_proj.out_features, kv, kv], -1)

    def heads(self, q, k, v, cos, sin):
        """Projections [B, T, *] -> rotated queries [B, H, T, hd], rotated keys and values
        [B, Hkv, T, hd], and the output gate [B, T, H * hd] (None without one)."""
        b, t = q.shape[:2]
        nh, nkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        gate = None
        if self.output_gate:
            # Qwen3-Next doubles q_proj: per head, [query | gate].
            q, gate = q.reshape(b, t, nh, 2 * hd).chunk(2, dim=-1)
            gate = gate.reshape(b, t, nh * hd)
        q, k, v = q.reshape(b, t, nh, hd), k.reshape(b, t, nkv, hd), v.reshape(b, t, nkv, hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        return Rotary.apply(q, cos, sin), Rotary.apply(k, cos, sin), v, gate

    def output(self, out: torch.Tensor, gate: torch.Tensor | None,
               fused: nn.ModuleDict | None = None) -> torch.Tensor:
        """o_proj of the heads' output [B, T, H * hd], gated where the layer has a gate."""
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return swapped(fused, "o_proj", self.o_proj)(out)

    # -- over static cache buffers at tensor positions (what compiled programs trace) -----
    def cached_heads(self, x, cos, sin, kbuf, vbuf, pos, fused=None, qkv=None):
        """Rotated queries [1, H, T, hd] and the output gate (or None) of x [1, T, D] (or of
        a q/k/v output ``qkv``), their keys and values written to the buffers at pos [T]."""
        parts = self.projections(x, fused) if qkv is None else self.split_qkv(qkv)
        q, k, v, gate = self.heads(*parts, cos, sin)
        kbuf.index_copy_(2, pos, k.to(kbuf.dtype))
        vbuf.index_copy_(2, pos, v.to(vbuf.dtype))
        return q, gate

    def forward_static(self, x, cos, sin, kbuf, vbuf, pos, mask, rows: int | None = None,
                       fused: nn.ModuleDict | None = None, qkv: torch.Tensor | None = None,
                       project: bool = True) -> torch.Tensor:
        """Attention of x [1, T, D] at positions pos [T] over static buffers [1, Hkv, L, hd]
        (keys <= a row's position, position_mask), writing the rows' keys and values first;
        ``rows``: attend the first ``rows`` rows one query row at a time (the rest are
        padding, engine/programs.Programs); ``fused``: the step's kernel forms of the
        projections; ``qkv``: the q/k/v output [1, T, Nq + 2 Nkv] already computed (x
        unused); ``project=False``: the heads' output [1, T, H * hd] before o_proj."""
        q, gate = self.cached_heads(x, cos, sin, kbuf, vbuf, pos, fused, qkv)
        b, nh, t, hd = q.shape
        nkv = self.num_kv_heads
        # Only the first mask-width slots are read (the span, see Programs); query heads
        # sharing a KV head are stacked along the query axis, [1, kv, g*T, hd] against
        # [1, kv, span, hd], which reads each cached key once instead of expanding the buffer.
        span = mask.shape[-1]
        g = nh // nkv
        # narrow, not [:span]: a slice would clamp to the buffer and pin the span's length.
        keys, values = kbuf.narrow(2, 0, span), vbuf.narrow(2, 0, span)
        # reshape, not view, after SDPA: CUDA's kernels may return [b, t, h, d]-strided outputs.
        if rows is None:
            out = F.scaled_dot_product_attention(q.reshape(b, nkv, g * t, hd), keys, values,
                                                 attn_mask=mask).reshape(b, nh, t, hd)
        elif row_kernel_fits(q, kbuf):
            # mtpkit's kernel: each row (keys 0..pos[j], the mask's rule) the same computation
            # a one-token step makes, all rows in one call; a third of torch's SDPA time for a
            # row here. Rows past ``rows`` are padding and copy the last. Out [T, H, D].
            out = torch.ops.mtpkit.attend_rows(q[0].transpose(0, 1), keys[0], values[0], pos,
                                               rows)
            out = out.view(b, t, nh * hd)
            return self.output(out, gate, fused) if project else out
        else:
            # As above through torch's SDPA (mask rows j, j+t, .. are row j's).
            outs = [F.scaled_dot_product_attention(
                q[:, :, j : j + 1].reshape(b, nkv, g, hd), keys, values,
                attn_mask=mask[j::t]).reshape(b, nh, 1, hd) for j in range(rows)]
            out = torch.cat(outs + outs[-1:] * (t - rows), dim=2)
        out = out.transpose(1, 2).reshape(b, t, nh * hd)
        return self.output(out, gate, fused) if project else out

    def rotated_rows(self, qkv, cos, sin):
        """qkv [1, N, Nq + 2 Nkv] -> the rows' rotated queries [N, H, hd], keys and values
        [N, Hkv, hd], as the row kernels take them."""
        q, k, v, _ = self.heads(*self.split_qkv(qkv), cos, sin)
        return q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1)

    def attend_seqs(self, qkv, cos, sin, kbufs, vbufs, pos, sizes) -> torch.Tensor:
        """Attention heads [1, N, H * hd] of several sequences' rows laid end to end (qkv
        [1, N, Nq + 2 Nkv], sizes rows a sequence), each row's key and value written to its
        own sequence's caches at pos [N]: one kernel call where forward_static made a call a
        sequence, with the same bits (the rotary is elementwise; csrc/attend_rows.cpp)."""
        out = torch.ops.mtpkit.attend_seqs(*self.rotated_rows(qkv, cos, sin), kbufs, vbufs,
                                           pos, sizes)
        return out.view(1, qkv.shape[1], -1)

    def attend_pool(self, qkv, cos, sin, kpool, vpool, slots, sizes, pos) -> torch.Tensor:
        """attend_seqs with the sequences' caches slots of one pool [S, Hkv, L, hd] (slots,
        sizes int64 [B]): the same bits, and shapes that do not depend on the batch."""
        out = torch.ops.mtpkit.attend_pool(*self.rotated_rows(qkv, cos, sin), kpool, vpool,
                                           slots, sizes, pos)
        return out.view(1, qkv.shape[1], -1)

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


def position_mask(pos: torch.Tensor, length: int, groups: int) -> torch.Tensor:
    """[groups*T, L]: query t sees the keys at positions 0..pos[t], nothing stale beyond."""
    keys = torch.arange(length, device=pos.device)
    return (keys[None, :] <= pos[:, None]).repeat(groups, 1)


def row_kernel_fits(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether mtpkit's attend_rows can attend q over keys k here (fp32 CPU, kernels built)."""
    return (q.device.type == "cpu" and q.dtype == k.dtype == torch.float32
            and int8_mm_available())


class PackedCaches:
    """Several sequences' caches for one layer, for a forward over their rows packed in one."""

    def __init__(self, caches: list[KVCache], lengths: list[int]) -> None:
        self.caches, self.lengths = caches, lengths

    def each(self, fn, *rows: torch.Tensor, dim: int, out_dim: int | None = None):
        """fn(its rows of each tensor in ``rows`` (split along ``dim``), its cache) a
        sequence, the outputs laid end to end again along ``out_dim`` (default ``dim``)."""
        parts = zip(*(r.split(self.lengths, dim) for r in rows), strict=True)
        outs = [fn(*p, c) for p, c in zip(parts, self.caches, strict=True)]
        return torch.cat(outs, dim if out_dim is None else out_dim)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None):
    """Scaled dot-product attention with KV heads shared by groups of query heads."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        # SDPA's enable_gqa is not taken by every backend; repeating KV heads is portable.
        b, h, s, d = k.shape
        k = k[:, :, None].expand(b, h, groups, s, d).reshape(b, h * groups, s, d)
        v = v[:, :, None].expand(b, h, groups, s, v.shape[-1]).reshape(b, h * groups, s, -1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
