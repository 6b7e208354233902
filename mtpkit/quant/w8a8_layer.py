"""mtpkit's fused W8A8 layer ops as the fast path's steps call them: a trunk layer whose
GEMMs are all W8A8 on mtpkit's row-exact kernels runs as one or two ops (norms, q/k/v,
rotary, cache writes, row attention, o_proj, MLP and residuals in one OpenMP region), and a
trunk of such layers as one op. Chosen by capability (w8a8_block_fits), not by switches;
every form gives the bits of the layer's own forward (models/attention.py), which tests check.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..models.attention import row_kernel_fits
from ..models.layers import MLP, RMSNorm
from .kernels import int8_mm_available
from .linear import QuantLinear


@dataclass(frozen=True)
class W8A8Forms:
    """How W8A8 layers on mtpkit's kernels run. Every form gives the same bits; the
    defaults are the fastest, and the others exist so that tests and benchmarks can set
    them side by side (programs are keyed on them)."""

    block: bool = True  # fused ops (w8a8_block) rather than an op per GEMM
    attn: bool = True  # attention inside a fused op (w8a8_layer or w8a8_attn_post)
    layer: bool = True  # a whole layer as one op (w8a8_layer)
    trunk: bool = True  # a trunk of whole-layer ops as one op (w8a8_trunk)

    def key(self) -> str:
        """The forms as a build-key part."""
        return "|".join(str(v) for v in (self.block, self.attn, self.layer, self.trunk))


def w8a8_block_fits(layer, fused: nn.ModuleDict | None) -> bool:
    """Whether a trunk layer can run as mtpkit's fused W8A8 ops (w8a8_block): every GEMM
    W8A8 without bias on the CPU kernels, plain fp32 RMSNorms, ungated attention, SwiGLU."""
    if fused is None or not {"qkv", "gate_up"} <= set(fused) or not int8_mm_available():
        return False
    attn, mlp = layer.self_attn, layer.mlp
    gemms = (fused["qkv"], attn.o_proj, fused["gate_up"], mlp.down_proj)
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    # row_exact at 8 bits: int codes per channel, symmetric, in stored order.
    return (all(isinstance(m, QuantLinear) and m.bits == 8 and m.act_quant is not None
                and m.row_exact and m.bias is None and m.scale.device.type == "cpu"
                for m in gemms)
            and all(isinstance(n, RMSNorm) and not n.zero_centered
                    and n.weight.dtype == torch.float32 for n in norms)
            and not attn.output_gate and type(mlp) is MLP)


def w8a8_block(layer, x, cos, sin, kbuf, vbuf, pos, mask, rows, fused,
               forms: W8A8Forms) -> torch.Tensor:
    # The layer as one of mtpkit's ops, one OpenMP region (csrc/w8a8_block.cpp; a region
    # per GEMM let the weight stream idle between them): input norm, q/k/v, rotary, cache
    # writes, row attention, o_proj, residual, norm, gate/up, SiLU, down, residual. Layers
    # with q/k norms (and the one-layer form off) run two: w8a8_pre, then the rotary and cache
    # writes here, then the rest in w8a8_attn_post. Each form gives the bits of the ops apart
    # with PyTorch's rotary (tests).
    b, t, d = x.shape
    attn, mlp, qkv = layer.self_attn, layer.mlp, fused["qkv"]
    ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
    x2 = x.reshape(t, d)
    mlp_ops = (ln2.weight, ln2.eps, *fused["gate_up"].a8_operands(),
               *mlp.down_proj.a8_operands(), mlp.down_proj.in_features)
    if w8a8_whole(layer, x, kbuf, rows, forms):
        # The whole layer in one region: norm, q/k/v, rotary, cache writes, attention, MLP.
        out = torch.ops.mtpkit.w8a8_layer(
            x2, ln1.weight, ln1.eps, *qkv.a8_operands(), cos, sin, kbuf, vbuf, pos,
            mask.shape[-1], rows, attn.num_heads, *attn.o_proj.a8_operands(), *mlp_ops)
        return out.view(b, t, d)
    proj = torch.ops.mtpkit.w8a8_pre(x2, ln1.weight, ln1.eps, *qkv.a8_operands())
    qkv_out = proj[:, : qkv.out_features].view(b, t, -1)
    if rows is not None and forms.attn and row_kernel_fits(qkv_out, kbuf):
        # The attention inside the same region as the MLP (csrc/attend.h: attend_rows'
        # passes, the same bits): one fork a layer fewer, and no op between.
        q, _ = attn.cached_heads(None, cos, sin, kbuf, vbuf, pos, qkv=qkv_out)
        span = mask.shape[-1]
        out = torch.ops.mtpkit.w8a8_attn_post(
            q[0].transpose(0, 1), kbuf.narrow(2, 0, span)[0], vbuf.narrow(2, 0, span)[0],
            pos, rows, x2, *attn.o_proj.a8_operands(), *mlp_ops)
        return out.view(b, t, d)
    heads = attn.forward_static(None, cos, sin, kbuf, vbuf, pos, mask, rows, qkv=qkv_out,
                                 project=False)
    out = torch.ops.mtpkit.w8a8_post(heads.reshape(t, -1), x2, *attn.o_proj.a8_operands(),
                                     *mlp_ops)
    return out.view(b, t, d)


def w8a8_whole(layer, x, kbuf, rows, forms: W8A8Forms) -> bool:
    # Whether w8a8_block runs the layer as one w8a8_layer op.
    return (rows is not None and forms.attn and forms.layer and row_kernel_fits(x, kbuf)
            and layer.self_attn.q_norm is None)


def w8a8_trunk(layers, fused, x, cos, sin, kc, vc, pos, mask, rows) -> torch.Tensor:
    # Every layer as w8a8_layer computes it, all in one op and one OpenMP region: a barrier
    # between layers where an op a layer forked and joined the team and set its call up
    # with the other thread idle: the per-layer fork, join and call setup go.
    b, t, d = x.shape
    ops = [[] for _ in range(14)]
    for layer, f in zip(layers, fused, strict=True):
        attn, mlp = layer.self_attn, layer.mlp
        row = (layer.input_layernorm.weight, *f["qkv"].a8_operands(), *attn.o_proj.a8_operands(),
               layer.post_attention_layernorm.weight, *f["gate_up"].a8_operands(),
               *mlp.down_proj.a8_operands())
        for acc, v in zip(ops, row, strict=True):
            acc.append(v)
    ln1, qw, qs, qc, ow, os_, oc, ln2, guw, gus, guc, dw, ds, dc = ops
    first = layers[0]
    # Stacked caches (FastDecoder.kv) go in whole, lists a tensor a layer.
    op, caches = ((torch.ops.mtpkit.w8a8_trunk_kv, (kc, vc)) if isinstance(kc, torch.Tensor)
                  else (torch.ops.mtpkit.w8a8_trunk, (list(kc), list(vc))))
    out = op(
        x.reshape(t, d), ln1, first.input_layernorm.eps, qw, qs, qc, cos, sin, *caches,
        pos, mask.shape[-1], rows, first.self_attn.num_heads, ow, os_, oc, ln2,
        first.post_attention_layernorm.eps, guw, gus, guc, dw, ds, dc,
        first.mlp.down_proj.in_features)
    return out.view(b, t, d)
