"""GPTQ: error-compensated rounding with a small calibration set (Frantar et al., 2022).

Rounding column k of W changes the layer's output by (w_k - q_k) x_k; GPTQ spreads that error
over the columns not yet rounded, weighted by the inverse Hessian H = 2 X^T X of the layer's
inputs, which minimises ||W X - Q X||^2 one column at a time. The updates are applied in
blocks (the "lazy batch" form) so the work is a few matrix products per block.

Written here because no package mtpkit depends on implements it for a plain torch module
(llm-compressor does, but drives transformers models and would pull a training stack).
Every trunk Linear is calibrated on the float model's own inputs (not sequentially on the
partly quantized model): simpler, and within noise of the sequential form at 4 bits for
small models.
"""

from __future__ import annotations

import torch
from torch import nn

from .pack import Scheme


def collect_hessians(
    model, batches: list[torch.Tensor], modules: dict[str, nn.Linear]
) -> dict[str, torch.Tensor]:
    """H = 2 X^T X / n for each named Linear over the calibration batches (trunk forward)."""
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    alias: dict[str, str] = {}  # q/k/v (and gate/up) read the same input: one sum for all
    # id() of an input -> (first module that read it, the input itself, kept alive so that
    # its id cannot be reused by a later tensor of the same forward).
    first_reader: dict[int, tuple[str, torch.Tensor]] = {}

    def hook(name):
        def f(_mod, inputs, _out):
            x = inputs[0]
            owner = first_reader.setdefault(id(x), (name, x))[0]
            if owner != name:
                alias[name] = owner
                return
            x = x.detach().reshape(-1, x.shape[-1]).float()
            sums[name] = sums.get(name, 0) + x.T @ x
            counts[name] = counts.get(name, 0) + x.shape[0]
        return f

    handles = [m.register_forward_hook(hook(n)) for n, m in modules.items()]
    try:
        with torch.no_grad():
            for ids in batches:
                first_reader.clear()
                model(ids)
    finally:
        for h in handles:
            h.remove()
    out = {n: 2 * s / counts[n] for n, s in sums.items()}
    out.update({n: out[o] for n, o in alias.items() if o in out})
    return out


def gptq_codes(
    weight: torch.Tensor, hessian: torch.Tensor, scheme: Scheme, damp: float = 0.01,
    block: int = 128,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Integer codes [N, K], scales [N, G] and zero points (or None) for ``weight``."""
    from compressed_tensors.quantization.utils import calculate_qparams

    args = scheme.args()
    w = weight.detach().float().clone()
    n, k = w.shape
    group = scheme.group_size or k
    block = max(block, group if group < k else block)
    h = hessian.float().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h += damp * torch.diag(h).mean() * torch.eye(k)
    # Upper Cholesky factor of H^-1: row i holds how column i's error spreads to later ones.
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    lo, hi = -(1 << (scheme.bits - 1)), (1 << (scheme.bits - 1)) - 1
    codes = torch.zeros(n, k, dtype=torch.int8)
    scales = torch.zeros(n, k // group)
    zeros = torch.zeros(n, k // group, dtype=torch.int8)
    s = z = None
    for b0 in range(0, k, block):
        b1 = min(b0 + block, k)
        w1 = w[:, b0:b1].clone()
        err1 = torch.zeros_like(w1)
        u1 = u[b0:b1, b0:b1]
        for j in range(b1 - b0):
            col = b0 + j
            if col % group == 0:
                g = w1[:, j : j + group] if group <= b1 - col else w[:, col : col + group]
                s, z = calculate_qparams(g.amin(1), g.amax(1), args)
                s = s.reshape(n).to(scheme.scale_dtype(weight.dtype)).float()
                z = z.reshape(n).to(torch.int32)
                scales[:, col // group], zeros[:, col // group] = s, z.to(torch.int8)
            q = torch.clamp(torch.round(w1[:, j] / s) + z, lo, hi)
            codes[:, col] = q.to(torch.int8)
            e = (w1[:, j] - (q - z) * s) / u1[j, j]
            w1[:, j:] -= e[:, None] * u1[j, j:][None, :]
            err1[:, j] = e
        w[:, b1:] -= err1 @ u[b0:b1, b1:]
    return codes, scales, (zeros if not args.symmetric else None)


def pack_codes(codes, scales, zeros, scheme: Scheme, scale_dtype) -> dict[str, torch.Tensor]:
    """compressed-tensors tensors (pack- or int-quantized, as the scheme stores) for codes
    already chosen."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    n, k = codes.shape
    if scheme.format == "int-quantized":  # w8a8: int8 codes as they are, symmetric
        return {"weight": codes.to(torch.int8), "weight_scale": scales.to(scale_dtype)}
    out = {"weight_packed": pack_to_int32(codes, scheme.bits),
           "weight_scale": scales.to(scale_dtype),
           "weight_shape": torch.tensor([n, k])}
    if zeros is not None:
        out["weight_zero_point"] = pack_to_int32(zeros, scheme.bits, packed_dim=0)
    return out
