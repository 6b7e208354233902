"""Weight-only quantized linear layers: int8 / int4 codes with scales (and zero points), FP8.

Every on-disk format (compressed-tensors, GPTQ, AWQ, DeepSeek FP8) is read into one canonical
form, so there is one set of kernels and one reference dequantization:

    int:  w[n, k] = (codes[n, k] - zero[n, g(k)]) * scale[n, g(k)]     codes, zero signed ints
    fp8:  w[n, k] = float(e4m3[n, k]) * scale[n // br, k // bc]          (tensor/channel/block)

W8A8 layers (``act_quant == "int8-token"``: compressed-tensors int8 weights with dynamic
per-token int8 activations) also quantize their input, one scale per row, and multiply
integers exactly (``a8_reference`` defines it; mtpkit's CPU kernel computes the same bits).
W4A8 layers (int4 codes in groups, ``a4_layout``) quantize their input the same way; each
group's integer sum is exact and the groups add up in float (``int4_a8_mm``; elsewhere
``a4_reference``, the same sum in another order).

``g(k) = k // group_size`` in the order the codes are stored; activation-ordered checkpoints
(GPTQ ``desc_act``, compressed-tensors ``g_idx``) keep their columns permuted so that groups
are contiguous, and the input is permuted the same way (``perm``).

Which kernel runs is chosen per call from the device and the number of rows (see
``QuantLinear.forward`` and docs/quantization.md for the measurements behind it).
"""

from __future__ import annotations

import contextlib
import threading

import torch
import torch.nn.functional as F
from torch import nn

from .kernels import int8_mm_available

_FP8 = torch.float8_e4m3fn


# The non-persistent buffers that hold a QuantLinear's kernel forms of its weights (_prepare):
# state_dict leaves them out, and model_fingerprint, which keys compiled programs, skips them.
FORM_PREFIX = "_form"


class QuantLinear(nn.Module):
    """A Linear whose weight is stored quantized; ``dequantize()`` is the reference."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        kind: str,  # "int" or "fp8"
        bits: int = 8,
        group_size: int | None = None,  # None: one group per row (per channel)
        bias: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.kind, self.bits, self.group_size = kind, bits, group_size
        self.block: tuple[int, int] | None = None  # fp8: scale tile (rows, cols)
        self.register_buffer("bias", bias)
        self.dtype = torch.float32  # the compute dtype the rest of the model was cast to
        self.act_quant: str | None = None  # "int8-token": W8A8, activations quantized per row
        self.act_note: str | None = None  # why the checkpoint's activation scheme is not run
        self._packed: dict = {}  # kernel-specific forms, built on first use per device
        self._a16: bool | None = None  # whether fp32 rows take int8_a16_mm (_takes_a16)

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def from_int(
        cls,
        codes: torch.Tensor,
        scale: torch.Tensor,
        zero: torch.Tensor | None,
        bits: int,
        group_size: int | None,
        perm: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
    ) -> QuantLinear:
        """From signed integer codes [N, K], scales [N, G] and optional zero points [N, G]."""
        n, k = codes.shape
        lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
        if codes.numel() and (int(codes.min()) < lo or int(codes.max()) > hi):
            raise ValueError(f"{bits}-bit codes outside [{lo}, {hi}]")
        groups = 1 if group_size is None else -(-k // group_size)
        if scale.dim() == 1:
            scale = scale[:, None]
        if tuple(scale.shape) != (n, groups):
            raise ValueError(f"scale shape {tuple(scale.shape)} != {(n, groups)}")
        m = cls(k, n, "int", bits, group_size, bias)
        m.register_buffer("codes", codes.to(torch.int8).contiguous())
        m.register_buffer("scale", scale.float().contiguous())
        m.register_buffer(
            "zero", None if zero is None else zero.reshape(n, groups).to(torch.int8).contiguous()
        )
        m.register_buffer("perm", None if perm is None else perm.long())
        return m

    @classmethod
    def from_fp8(
        cls,
        weight: torch.Tensor,
        scale: torch.Tensor,
        block: tuple[int, int] | None = None,
        bias: torch.Tensor | None = None,
    ) -> QuantLinear:
        """From e4m3 weights [N, K] and a scale per tensor (1,), row (N, 1) or block tile."""
        n, k = weight.shape
        scale = scale.float()
        if block is None:
            if scale.numel() == 1:
                block = (n, k)
            elif scale.numel() == n:
                block = (1, k)
            else:
                raise ValueError(f"FP8 scale shape {tuple(scale.shape)} fits neither a tensor, "
                                 f"a channel nor a block scale of a {n}x{k} weight")
        br, bc = block
        grid = (-(-n // br), -(-k // bc))
        if scale.numel() != grid[0] * grid[1]:
            raise ValueError(f"FP8 scale shape {tuple(scale.shape)} does not tile {n}x{k} in "
                             f"{br}x{bc} blocks")
        m = cls(k, n, "fp8", 8, None, bias)
        m.block = (br, bc)
        # Stored as raw bytes: Module.to(dtype) would otherwise "cast" e4m3 weights to fp32.
        m.register_buffer("fp8", weight.to(_FP8).view(torch.uint8).contiguous())
        m.register_buffer("scale", scale.reshape(grid).contiguous())
        return m

    @property
    def row_exact(self) -> bool:
        """Whether a row's output is the same bits whatever rows are computed with it:
        true of mtpkit's int8 and W4A8 kernels (and of W8A8 everywhere: exact integer sums)."""
        on_kernel = self.scale.device.type == "cpu" and int8_mm_available()
        if self.act_quant is not None and self.bits == 4:
            return on_kernel
        if self.kind != "int" or self.bits != 8 or self.group_size is not None \
                or self.zero is not None or self.perm is not None:
            return False
        return self.act_quant is not None or on_kernel

    def _apply(self, fn, recurse=True):
        # Moves between devices apply; dtype casts do not: codes, zero points and scales keep
        # their precision whatever dtype the rest of the model is cast to. The target device
        # and dtype are read off a probe, since ``fn`` is opaque.
        probe = fn(torch.empty(0, dtype=self.dtype, device=self.scale.device))
        self.dtype = probe.dtype
        for k in [k for k in self._buffers if k.startswith(FORM_PREFIX)]:
            del self._buffers[k]
        for k, b in self._buffers.items():
            if b is not None:
                self._buffers[k] = fn(b) if k == "bias" else b.to(probe.device)
        self._packed = {}
        self._a16 = None
        return self

    # -- reference ------------------------------------------------------------------------
    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [N, K] in the checkpoint's column order, as the format defines it."""
        n, k = self.out_features, self.in_features
        if self.kind == "fp8":
            br, bc = self.block
            s = self.scale.repeat_interleave(br, 0)[:n].repeat_interleave(bc, 1)[:, :k]
            return (self.fp8.view(_FP8).float() * s).to(dtype)
        q = self.codes.float()
        if self.zero is not None:
            q = q - self._expand(self.zero.float())
        w = q * self._expand(self.scale)
        if self.perm is not None:
            w = torch.empty_like(w).index_copy_(1, self.perm, w)
        return w.to(dtype)

    def _expand(self, per_group: torch.Tensor) -> torch.Tensor:
        if self.group_size is None:
            return per_group  # [N, 1] broadcasts
        return per_group.repeat_interleave(self.group_size, 1)[:, : self.in_features]

    @property
    def weight(self) -> torch.Tensor:
        """A float copy of the weight, kept, for code that needs the matrix itself (MLA's
        absorbed attention); ordinary forwards never build it."""
        return self._prepare(("weight", self.dtype), lambda: self.dequantize(self.dtype))

    @property
    def weight_bytes(self) -> int:
        """Bytes of weight data a forward pass reads (packed codes and scales)."""
        if self.kind == "fp8":
            return self.fp8.numel() + 4 * self.scale.numel()
        if self.act_quant is not None and self.bits == 4 and self.scale.device.type == "cpu":
            return sum(t.numel() * t.element_size() for t in self._prepare("a4", self._pack_a4))
        zero = 0 if self.zero is None else self.zero.numel()
        return self.codes.numel() * self.bits // 8 + 4 * self.scale.numel() + zero

    # -- forward --------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N] in x's dtype."""
        shape = x.shape
        if (self._takes_a16() and x.dtype == torch.float32 and x.numel() <= self._a16_numel
                and int8_mm_available()):
            # The path below for its commonest case, without its checks and no-op
            # conversions: an uncompiled step (a server's batched pass) makes ~200 of these
            # calls, where they cost more than the kernel. Same op, same operands, same bits.
            out = torch.ops.mtpkit.int8_a16_mm(x.reshape(-1, shape[-1]), *self.a8_operands())
            if out.shape[1] != self.out_features:
                out = out[:, : self.out_features]
            if self.bias is not None:
                out = out + self.bias.to(out.dtype)
            return out.reshape(*shape[:-1], self.out_features)
        x2 = x.reshape(-1, shape[-1])
        if self.kind == "int" and self.perm is not None:
            x2 = x2.index_select(1, self.perm)
        out = None
        if self.act_quant is not None:
            out = self._a8(x2)
        elif x2.device.type == "cpu" and self.kind == "int":
            out = self._cpu_int(x2)
        elif x2.device.type == "cpu":
            # Decoding e4m3 on every call would cost far more than the GEMM itself, so FP8
            # weights are decoded once and kept in the compute dtype: exact, but
            # without FP8's memory saving on CPU.
            w = self._prepare(("fp8", x2.dtype), lambda: self.dequantize(x2.dtype))
            out = F.linear(x2, w)
        if out is None:
            out = F.linear(x2, self._float_weight(x2.dtype))
        else:
            out = out.to(x.dtype)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.reshape(*shape[:-1], self.out_features)

    def _float_weight(self, dtype: torch.dtype) -> torch.Tensor:
        # Dequantize per call (the codes stay the only copy); columns stay in stored order
        # because the input was permuted to match.
        if self.kind == "fp8":
            return self.dequantize(dtype)
        q = self.codes.to(dtype)
        if self.zero is not None:
            q = q - self._expand(self.zero.to(dtype))
        return q * self._expand(self.scale.to(dtype))

    def _cpu_int(self, x: torch.Tensor) -> torch.Tensor | None:
        # torch's packed CPU kernels take bf16 activations (their fp32 forms are far
        # slower). Their cost grows linearly with rows; past ~256 rows (a long
        # prefill) dequantizing once and running an fp32 GEMM is cheaper. Per-channel int8
        # takes mtpkit's own kernel where it builds (quant/kernels.py): fp32 activations,
        # and faster than torch's at decoding row counts.
        if x.shape[0] > self.max_kernel_rows:
            return None
        if self.bits == 8 and self.group_size is None:
            w = self._prepare("int8", self._pack_int8)
            if int8_mm_available():
                # Exact integer dot products (a16_reference): they leave the codes' widening
                # to float out, so several rows cost far less than float FMAs over widened
                # codes, which cost per row.
                a, s, colsum = self.a8_operands()
                out = torch.ops.mtpkit.int8_a16_mm(x.float().contiguous(), a, s, colsum)
                if a.shape[0] != self.out_features:
                    out = out[:, : self.out_features]
            else:
                out = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), w, self._s_bf16)
            if self.zero is not None:
                # (q - z) * s: the zero-point term is a rank-one correction.
                out = out.float() - x.float().sum(-1, keepdim=True) * self._zs[None, :]
            return out
        if self.bits == 4 and self.group_size in (32, 64, 128, 256):
            packed = self._prepare("int4", self._pack_int4)
            if packed is False:
                return None
            w, sz = packed
            return torch.ops.aten._weight_int4pack_mm_for_cpu(
                x.to(torch.bfloat16), w, self.group_size, sz
            )
        return None

    max_kernel_rows = 256

    @property
    def _a16_numel(self) -> int:
        return self.max_kernel_rows * self.in_features

    def _a8(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu" and int8_mm_available():
            if self.bits == 4:
                w, s, z = self._prepare("a4", self._pack_a4)
                out = torch.ops.mtpkit.int4_a8_mm(x.float().contiguous(), w, s, z,
                                                  self.group_size or self.in_features)
            else:
                w, s, colsum = self.a8_operands()
                out = torch.ops.mtpkit.int8_a8_mm(x.float().contiguous(), w, s, colsum)
            # Columns padded to a multiple of 16 (a draft vocabulary of any size).
            return out if w.shape[0] == self.out_features else out[:, : self.out_features]
        if self.bits == 4:
            return a4_reference(x, self._prepare("a4-float", lambda: self._float_weight(
                torch.float32)))
        return a8_reference(x, self.codes, self.scale[:, 0])

    def _takes_a16(self) -> bool:
        # Whether _cpu_int takes int8_a16_mm for fp32 rows (per-channel int8 weights on a
        # CPU, no activation quantization, permutation or zero points); decided once a
        # device (_apply forgets it).
        if self._a16 is None:
            self._a16 = (self.kind == "int" and self.bits == 8 and self.group_size is None
                         and self.act_quant is None and self.perm is None
                         and self.zero is None and self.codes.device.type == "cpu")
        return self._a16

    def a8_operands(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """W8A8's packed weights, scales and column sums (pack_a8), built once."""
        return self._prepare("a8", lambda: pack_a8(self.codes, self.scale[:, 0]))

    def _prepare(self, key, build):
        # A form of the weights for one kernel, built on first use (per device: _apply
        # forgets them). Its tensors are non-persistent buffers (FORM_PREFIX), read back
        # from _buffers on every call: a program traced through this module then names
        # them by the module's path, as it names parameters, and a compiled package takes
        # them from the model when it is loaded instead of holding a copy of its own
        # (engine/programs.py). Held in a dict, they were anonymous constants it had to copy.
        got = self._packed.get(key)
        if got is None:
            value = build()
            if isinstance(value, torch.Tensor):
                got = ("one", self._keep(value))
            elif isinstance(value, tuple) and all(isinstance(t, torch.Tensor) for t in value):
                got = ("many", tuple(self._keep(t) for t in value))
            else:
                got = ("value", value)
            self._packed[key] = got
        how, what = got
        if how == "one":
            return self._buffers[what]
        if how == "many":
            b = self._buffers
            return tuple(b[n] for n in what)
        return what

    def _keep(self, t: torch.Tensor) -> str:
        name = f"{FORM_PREFIX}{sum(k.startswith(FORM_PREFIX) for k in self._buffers)}"
        self.register_buffer(name, t, persistent=False)
        return name

    def _pack_a4(self):
        # int4_a8_mm's layout (csrc/int4_a8_mm.cpp): u = code + 8; columns in blocks of 16
        # (padded with zero scales), each block's codes in chunks of 32 inputs, a chunk as
        # 4 x 64 bytes whose byte 4c + j holds column c's u[8p + j] (low nibble) and
        # u[8p + 4 + j] (high); scales and zero points as [N / 16, G, 16]. Scales are float16
        # where that is exact (what mtpkit quantize writes: 2 bytes a group instead of 4).
        n, k = self.codes.shape
        n16, g = -(-n // 16) * 16, k // (self.group_size or k)
        u = (self.codes.to(torch.int16) + 8).to(torch.uint8)
        scale, zero = self.scale, self.zero
        if n16 > n:
            u = torch.cat([u, u.new_zeros(n16 - n, k)])
            scale = torch.cat([scale, scale.new_zeros(n16 - n, g)])
            zero = None if zero is None else torch.cat([zero, zero.new_zeros(n16 - n, g)])
        v = u.view(n16 // 16, 16, k // 32, 4, 2, 4).permute(0, 2, 3, 4, 1, 5)
        packed = (v[:, :, :, 0] | (v[:, :, :, 1] << 4)).reshape(n16, k // 2).contiguous()

        def blocks(t):
            return t.view(n16 // 16, 16, g).transpose(1, 2).contiguous()

        half = scale.half()
        scale = blocks(half if torch.equal(half.float(), scale) else scale)
        zero = torch.empty(0, dtype=torch.int8) if zero is None else blocks(zero)
        return packed, scale, zero

    def _pack_int8(self) -> torch.Tensor:
        s = self.scale[:, 0]
        self._s_bf16, self._s_f32 = s.to(torch.bfloat16), s.contiguous()
        if self.zero is not None:
            self._zs = (self.zero[:, 0].float() * s).float()
        return self.codes

    def _pack_int4(self):
        n, k = self.codes.shape
        if k % self.group_size or n % 16 or k % 32:
            return False  # the packed layout's tiling does not fit this shape
        # The kernel computes (u - 8) * scale + offset on unsigned nibbles u = q + 8, so the
        # zero point folds into the offset: (q - z) * s = (u - 8) * s + (-z * s).
        u = (self.codes.to(torch.int32) + 8).to(torch.uint8)
        w = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u.to(torch.int32), 1)
        s = self.scale
        off = torch.zeros_like(s) if self.zero is None else -self.zero.float() * s
        sz = torch.stack([s, off], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
        return w, sz

    def extra_repr(self) -> str:
        """Shape and scheme, shown when printing the model."""
        scheme = "fp8" if self.kind == "fp8" else f"int{self.bits}"
        group = f", group={self.group_size}" if self.group_size else ""
        act = ", activations int8 per token" if self.act_quant else ""
        return f"{self.in_features} -> {self.out_features}, {scheme}{group}{act}"


def quantize_rows(x: torch.Tensor, levels: int = 127) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-row int8 (or int16 for ``levels`` past 127): codes [M, K] in [-levels,
    levels] and scales [M] (max |x| / levels)."""
    x = x.float()
    xs = x.abs().amax(-1) / levels
    safe = torch.where(xs > 0, xs, torch.ones_like(xs))
    q = torch.round(x / safe[:, None]).clamp(-levels, levels)
    # An all-zero row (xs == 0) divides by 1 and rounds to zeros.
    return q.to(torch.int8 if levels <= 127 else torch.int16), xs


def a16_form() -> str:
    """How int8_a16_mm splits an activation row on this host: ``int16`` (one int16 row, 32767
    levels: AVX2 kernels) or ``int8x2`` (two int8 rows: the AVX-512 VNNI and AMX kernels)."""
    from .kernels import kernel_isa

    return "int8x2" if kernel_isa() == "avx512" else "int16"


def a16_reference(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                  form: str | None = None) -> torch.Tensor:
    """What int8_a16_mm computes, in torch, in this host's ``a16_form``. ``int16``: each row
    of x quantized to int16 codes q (scale xs = max |x| / 32767) and y = (q . codes) * xs *
    scale, 16 bits of every activation. ``int8x2``: each row split into its int8
    quantization q1 (scale xs1) and that of the remainder r = x - q1 * xs1 (q2, xs2), and
    y = (q1 . codes) * xs1 * scale + (q2 . codes) * xs2 * scale, about 15 bits. Every dot
    product is an exact integer, so a row's bits depend on nothing else."""
    x = x.float()
    s = scale.reshape(-1).float()
    if (form or a16_form()) == "int16":
        q, xs = quantize_rows(x, 32767)
        return ((q.to(torch.int64) @ codes.to(torch.int64).t()).float() * xs[:, None]) * s
    q1, xs1 = quantize_rows(x)
    # One rounding of x - q1 * xs1 (the kernel's fma): exact in float64, then rounded.
    r = (x.double() - q1.double() * xs1.double()[:, None]).float()
    q2, xs2 = quantize_rows(r)
    c = codes.to(torch.int64).t()
    return ((q1.to(torch.int64) @ c).float() * xs1[:, None]) * s \
        + ((q2.to(torch.int64) @ c).float() * xs2[:, None]) * s


def pack_a8(codes: torch.Tensor, scale: torch.Tensor):
    """int8_a8_mm's operands for int8 codes [N, K] and per-column scales [N]: the codes in
    blocks of 16 columns (N padded to 16, K to 4 with zeros), 64 bytes holding 4 inputs of
    all 16 columns (csrc/int8_a8_mm.cpp), the scales padded alike, and each column's code
    sum."""
    n, k = codes.shape
    n16, k4 = -(-n // 16) * 16, -(-k // 4) * 4
    padded = torch.zeros(n16, k4, dtype=torch.int8)
    padded[:n, :k] = codes
    packed = padded.view(n16 // 16, 16, k4 // 4, 4).transpose(1, 2).reshape(n16, k4)
    s = torch.zeros(n16, dtype=torch.float32)
    s[:n] = scale.float()
    return packed.contiguous(), s, padded.sum(1, dtype=torch.int32)


def a4_layout(q: QuantLinear) -> bool:
    """Whether int4 codes can run as W4A8 (int4_a8_mm): groups of a multiple of 32 columns
    (per channel: one group of all), no activation-order permutation."""
    group = q.group_size or q.in_features
    return (q.kind == "int" and q.bits == 4 and q.perm is None and group % 32 == 0
            and q.in_features % group == 0)


def a4_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """W4A8 int4 linear off mtpkit's CPU kernel (CUDA, no AVX2): y = (q @ weight.T) * xs
    with the weight dequantized to float32, a float GEMM whose rounding depends on the
    library and the row count (such layers are not row-exact)."""
    q, xs = quantize_rows(x)
    return (q.float() @ weight.t()) * xs[:, None]


def a8_reference(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """W8A8 int8 linear: y = (float(q @ codes.T) * xs) * scale, the integer sum exact."""
    q, xs = quantize_rows(x)
    m = q.shape[0]
    if q.device.type == "cuda" and m <= 16:
        # torch._int_mm on CUDA wants more than 16 rows; zero rows are independent.
        q = torch.cat([q, q.new_zeros(17 - m, q.shape[1])])
    acc = torch._int_mm(q, codes.t())[:m]
    return (acc.float() * xs[:, None]) * scale[None, :]


def linear_rows(linear: nn.Module, rows: torch.Tensor) -> nn.Module:
    """A linear layer computing only these output rows of ``linear`` (a draft vocabulary's
    lm_head rows), kept in the same form: int codes stay codes, float weights stay float."""
    if isinstance(linear, QuantLinear) and linear.kind == "int":
        rows = rows.to(linear.scale.device, torch.long)
        zero, bias = (None if t is None else t[rows] for t in (linear.zero, linear.bias))
        sub = QuantLinear.from_int(linear.codes[rows], linear.scale[rows], zero, linear.bits,
                                   linear.group_size, linear.perm, bias)
        sub.dtype, sub.act_quant, sub.act_note = linear.dtype, linear.act_quant, linear.act_note
        return sub
    dtype, device = dtype_device(linear)
    w = linear.weight.detach()[rows.to(device, torch.long)].contiguous()
    sub = nn.Linear(w.shape[1], w.shape[0], bias=False, device=device, dtype=dtype)
    sub.weight = nn.Parameter(w, requires_grad=False)
    return RowExactLinear(sub) if isinstance(linear, RowExactLinear) else sub


_every_row = threading.local()


@contextlib.contextmanager
def every_row_exact():
    """Within it (in this thread), RowExactLinear takes its kernel whatever the row count:
    the rows of a server's batched step, however many, must each get their lone step's
    bits, where a prompt's many rows may take torch's faster GEMM."""
    before = getattr(_every_row, "on", False)
    _every_row.on = True
    try:
        yield
    finally:
        _every_row.on = before


class RowExactLinear(nn.Module):
    """An fp32 Linear through mtpkit's ``f32_mm`` kernel: each output row the same bits
    whatever rows are computed with it, which the compiled fp32 path needs for exact
    speculative rounds (engine/programs.py). Shares the wrapped layer's weight (no copy), or
    with ``weight_dtype`` (float16, bfloat16) holds it in that precision: the kernel widens
    it exactly and sums in float32, reading half the bytes a step."""

    row_exact = True
    # More rows (a prompt) take torch's GEMM, whose blocking reuses each weight across rows:
    # f32_mm streams the weight once per four rows. Steps never have this many.
    max_kernel_rows = 16

    def __init__(self, linear: nn.Linear, weight_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        if weight_dtype is not None and weight_dtype != linear.weight.dtype:
            self.weight = nn.Parameter(linear.weight.detach().to(weight_dtype),
                                       requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N]."""
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        # The flag first: a traced row count compared with the limit becomes a guard.
        if not getattr(_every_row, "on", False) and x2.shape[0] > self.max_kernel_rows:
            return F.linear(x, self.weight.to(x.dtype), self.bias)
        out = torch.ops.mtpkit.f32_mm(x2.contiguous(), self.weight)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*shape[:-1], self.out_features)

    @classmethod
    def of(cls, linear: nn.Module) -> RowExactLinear:
        """``linear`` through the kernel: itself where it already is (Session.load routes
        fp32 models' layers), else a RowExactLinear over its weight."""
        return linear if isinstance(linear, cls) else cls(linear)

    @staticmethod
    def fits(linear: nn.Module) -> bool:
        """Whether ``linear`` is an fp32 CPU nn.Linear the kernel can run (built here), or
        already runs through it."""
        if isinstance(linear, RowExactLinear):
            return True
        return (type(linear) is nn.Linear and linear.weight.dtype == torch.float32
                and linear.weight.device.type == "cpu" and int8_mm_available())


def route_rows_through_kernel(model: nn.Module, weight_dtype: torch.dtype | None = None) -> int:
    """Make every fp32 CPU nn.Linear under ``model`` a RowExactLinear (same weight, no copy;
    or held in ``weight_dtype``, float16 or bfloat16); returns how many. For inference: the
    kernel has no backward.

    torch's fp32 GEMM is slower than f32_mm at the row counts of decoding (up to about 16
    rows; f32_mm streams the weight once per four rows, torch's blocking pays off only on
    more), and it rounds a row differently with other rows beside it, so a verified row
    can differ from the one-token step."""
    n = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and RowExactLinear.fits(child):
                setattr(parent, name, RowExactLinear(child, weight_dtype))
                n += 1
    return n


def stack_outputs(linears: list[nn.Module]) -> QuantLinear | None:
    """One row-exact int8 or W4A8 layer computing the outputs of ``linears`` side by side
    (q/k/v, gate/up): the same bits as each alone, in one kernel call; None where they
    differ in scheme, input or bias, or are not row-exact."""
    first = linears[0]
    if not all(isinstance(m, QuantLinear) and m.row_exact for m in linears):
        return None
    if any(m.in_features != first.in_features or m.act_quant != first.act_quant
           or m.dtype != first.dtype or (m.bias is None) != (first.bias is None)
           or m.bits != first.bits or m.group_size != first.group_size
           for m in linears):
        return None
    bias = None if first.bias is None else torch.cat([m.bias for m in linears])
    zero = None
    if any(m.zero is not None for m in linears):
        # A symmetric layer's zero point is 0: the same weights, so the same bits.
        zero = torch.cat([torch.zeros_like(m.scale, dtype=torch.int8) if m.zero is None
                          else m.zero for m in linears])
    out = QuantLinear.from_int(torch.cat([m.codes for m in linears]),
                               torch.cat([m.scale for m in linears]), zero, first.bits,
                               first.group_size, bias=bias)
    out.dtype, out.act_quant = first.dtype, first.act_quant
    return out


def dtype_device(linear: nn.Module) -> tuple[torch.dtype, torch.device]:
    """Compute dtype and device of a Linear or QuantLinear, without dequantizing anything."""
    if isinstance(linear, QuantLinear):
        return linear.dtype, linear.scale.device
    if isinstance(linear, RowExactLinear):  # 16-bit weights or not, it computes in float32
        return torch.float32, linear.weight.device
    return linear.weight.dtype, linear.weight.device
