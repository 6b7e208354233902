"""The fixed-shape fast path (engine.fast) against the eager engine, and compilation counts."""

from __future__ import annotations

import os
import time

import pytest
import torch
from torch import nn

import mtpkit.engine.fast as fast_mod
import mtpkit.engine.program_cache as pcache
import mtpkit.models.cache as cache_mod
from mtpkit.engine.budget import RoundChoices
from mtpkit.engine.fast import FastDecoder, enable_fast
from mtpkit.engine.generate import Engine, Result
from mtpkit.engine.program_cache import ProgramCache, dynamo_graphs
from mtpkit.engine.programs import StepModule, unsupported_reason
from mtpkit.engine.sampling import SamplingParams
from mtpkit.quant.linear import FORM_PREFIX
from mtpkit.quant.w8a8_layer import W8A8Forms

# Attention + SwiGLU families take the fast path; the others must say why they do not.
FAST = ["llama", "llama_tied", "qwen2", "qwen3", "mimo"]
SLOW = ["qwen3_next_dense", "deepseek_v3"]
PROMPTS = [[3, 17, 42, 8], [60, 61, 62, 63, 64, 65, 66, 67, 68], [5], [90, 1, 90, 1, 90, 1, 33]]


def _eager(engine: Engine, prompt, k, max_tokens=24, eos=None):
    res = Result()
    toks = list(engine.generate(prompt, SamplingParams(max_tokens=max_tokens), k, result=res,
                                eos_ids=eos or set()))
    return toks, res


def _fast(dec: FastDecoder, prompt, k, max_tokens=24, eos=None):
    res = Result()
    toks = list(dec.generate(prompt, max_tokens, k, result=res, eos_ids=eos or set()))
    return toks, res


@pytest.mark.parametrize("name", FAST)
def test_fast_equals_eager_engine(name, engine_factory):
    """Same tokens, finish reasons and acceptance counts as the eager engine, k = 0..4."""
    engine = engine_factory(name)
    dec = FastDecoder(engine.model, backend="eager", max_len=128)
    for prompt in PROMPTS:
        want, _ = _eager(engine, prompt, 0)
        for k in range(5):
            got, res = _fast(dec, prompt, k)
            ref, ref_res = _eager(engine, prompt, k)
            assert got == want == ref, f"k={k} prompt={prompt}"
            assert res.finish_reason == ref_res.finish_reason == "length"
            m, r = res.metrics, ref_res.metrics
            assert (m.num_draft_tokens, m.num_accepted_tokens) == \
                (r.num_draft_tokens, r.num_accepted_tokens), f"k={k} prompt={prompt}"


def test_fast_stops_on_eos_inside_drafts(engine_factory):
    """An EOS among accepted drafts ends the request there, as in the eager engine."""
    engine = engine_factory("llama")
    dec = FastDecoder(engine.model, backend="eager", max_len=128)
    prompt = PROMPTS[1]
    full, _ = _eager(engine, prompt, 0, max_tokens=20)
    eos = {full[7]}
    want, wres = _eager(engine, prompt, 3, max_tokens=20, eos=eos)
    got, res = _fast(dec, prompt, 3, max_tokens=20, eos=eos)
    assert got == want == full[: full.index(full[7])]
    assert res.finish_reason == wres.finish_reason == "stop"


def test_draft_vocab_and_p_min_stay_exact(engine_factory):
    """A reduced draft vocabulary and adaptive draft length change speed, never tokens."""
    engine = engine_factory("qwen3")
    vocab = torch.arange(0, 96, 2)  # half the tokens: many drafts become impossible
    base = FastDecoder(engine.model, backend="eager", max_len=128)
    sub = FastDecoder(engine.model, draft_vocab=vocab, backend="eager", max_len=128)
    adaptive = FastDecoder(engine.model, backend="eager", max_len=128, draft_p_min=0.5)
    drafted = []
    for prompt in PROMPTS:
        want, _ = _fast(base, prompt, 0)
        full_drafts = _fast(base, prompt, 3)[1].metrics.num_draft_tokens
        assert _fast(sub, prompt, 3)[0] == want
        got, res = _fast(adaptive, prompt, 3)
        assert got == want
        drafted.append((res.metrics.num_draft_tokens, full_drafts))
    # The threshold dropped some drafts somewhere (else it tested nothing).
    assert sum(a for a, _ in drafted) < sum(b for _, b in drafted)


@pytest.mark.parametrize("name", SLOW)
def test_unsupported_models_fall_back(name, engine_factory, capsys):
    """Hybrid and MLA models keep the eager engine, with a note saying why."""
    engine = engine_factory(name)
    assert unsupported_reason(engine.model)
    assert enable_fast(engine, "eager") is None and engine.fast is None
    assert "--compile ignored" in capsys.readouterr().err


def test_engine_routes_requests_to_the_fast_path(engine_factory, monkeypatch):
    """Engine.generate uses the fast path for greedy requests and for sampled ones where
    the decoder samples (the eager engine otherwise)."""
    engine = engine_factory("llama_tied")
    want, _ = _eager(engine, PROMPTS[0], 3)
    try:
        dec = enable_fast(engine, "eager", max_len=128)
        calls = []
        orig = dec.generate
        dec.generate = lambda *a, **kw: calls.append(1) or orig(*a, **kw)
        got, _ = _eager(engine, PROMPTS[0], 3)
        assert got == want and calls == [1]
        res = Result()
        params = SamplingParams(temperature=0.8, max_tokens=8, seed=1)
        assert dec.samples
        assert len(list(engine.generate(PROMPTS[0], params, 3, result=res))) == 8
        assert calls == [1, 1]
        monkeypatch.setattr(FastDecoder, "samples", property(lambda self: False))
        assert len(list(engine.generate(PROMPTS[0], params, 3, result=Result()))) == 8
        assert calls == [1, 1]
        with pytest.raises(ValueError, match="max-model-len"):
            list(engine.generate(PROMPTS[0], SamplingParams(max_tokens=250), 3))
    finally:
        engine.fast = None


def test_short_prompts_run_through_the_pooled_programs(engine_factory, monkeypatch):
    """A prompt of at most POOL_MAX_ROWS tokens runs through trunk_pool and head_pool (the
    server's batched programs), each row attending alone, logits for its last row alone:
    cut into pieces, as a server's prefill chunks cut it, it leaves the same trunk caches
    and first token, bit for bit (the head's GEMMs may round by row count: its drafts never
    change the output). A longer prompt runs the eager trunk (SDPA)."""
    from mtpkit.engine.programs import POOL_MAX_ROWS

    engine = engine_factory("llama")
    dec = FastDecoder(engine.model, backend="eager", max_len=POOL_MAX_ROWS + 64)
    assert dec.pools_prompts
    calls: list[str] = []
    logit_rows: list[int] = []  # rows a prompt piece's trunk_pool call computes logits of
    program = dec.program

    def spy(kind, *a):
        fn = program(kind, *a)
        calls.append(kind)
        if kind != "trunk_pool":
            return fn
        return lambda *args: logit_rows.append(len(args[-1])) or fn(*args)

    monkeypatch.setattr(dec, "program", spy)

    def prefill(prompt, chunk):
        calls.clear()
        gen = dec._prefill(prompt, 2, chunk)
        while True:
            try:
                next(gen)
            except StopIteration as done:
                n = len(prompt)
                caches = [c[..., :n, :].clone() for c in [*dec.kc, *dec.vc]]
                return done.value, caches, [c[..., :n, :].clone() for c in (dec.hk, dec.hv)]

    prompt = [(7 * i) % 50 + 3 for i in range(40)]
    (first, _, ps), caches, heads = prefill(prompt, None)
    assert calls == ["trunk_pool", "head_pool"]
    (first2, _, ps2), caches2, heads2 = prefill(prompt, 7)
    assert calls == ["trunk_pool"] * 6 + ["head_pool"] * 6
    assert logit_rows == [1] * 7  # the last row's alone: the lm_head is a prompt row's dearest
    assert torch.equal(first, first2)
    assert all(torch.equal(a, b) for a, b in zip(caches, caches2, strict=True))
    torch.testing.assert_close(ps, ps2)
    for a, b in zip(heads, heads2, strict=True):
        torch.testing.assert_close(a, b)
    prefill([(7 * i) % 50 + 3 for i in range(POOL_MAX_ROWS + 1)], None)
    assert not calls


def test_inductor_compiles_once(engine_factory):
    """torch.compile builds the programs up front; generations with any accept length,
    prompt length or cache span never compile again, and match the eager engine."""
    engine = engine_factory("llama")
    dec = FastDecoder(engine.model, backend="inductor", mode="default", max_len=192)
    dec.warmup(0)
    dec.warmup(3)
    before = dynamo_graphs()
    drafted = accepted = 0
    for prompt in PROMPTS + [list(range(1, 90))]:  # spans of two and three cache blocks
        for k in (0, 3):
            got, res = _fast(dec, prompt, k, max_tokens=40)
            assert got == _eager(engine, prompt, k, max_tokens=40)[0]
            drafted += res.metrics.num_draft_tokens
            accepted += res.metrics.num_accepted_tokens
    assert dynamo_graphs() == before
    assert 0 < accepted < drafted  # rounds both accepted and rejected drafts
    assert dec.stats.compiled >= 2


def test_bf16_compiled_programs_stay_exact(checkpoint_factory):
    """A bf16 model compiles on the CPU (the first kernel check used to sit inside the trace,
    which dynamo rejected) and its greedy output with MTP equals its own without."""
    import warnings

    from mtpkit.engine.loader import load_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = load_model(checkpoint_factory("llama"), dtype="bfloat16",
                           tokenizer=False).model
    dec = FastDecoder(model, backend="inductor", mode="default", max_len=128)
    drafted = accepted = 0
    for prompt in PROMPTS:
        want, _ = _fast(dec, prompt, 0)
        for k in (1, 3):
            got, res = _fast(dec, prompt, k)
            assert got == want, f"k={k} prompt={prompt}"
            drafted += res.metrics.num_draft_tokens
            accepted += res.metrics.num_accepted_tokens
    assert 0 < accepted < drafted


def test_rotary_tables_move_with_the_model():
    """model.to(device) moves the rotary inverse frequencies (a plain attribute, so that dtype
    casts leave them fp32). Moved lazily inside a compiled program instead, the move made
    every CUDA program compile a second time, in the middle of a request."""
    from mtpkit.models.layers import Rotary

    m = torch.nn.Sequential(Rotary(8, 1e4))
    want = m[0].inv_freq.clone()
    m.to(torch.bfloat16)
    assert m[0].inv_freq.dtype == torch.float32 and torch.equal(m[0].inv_freq, want)
    m.to("meta")  # the one other device a CPU-only machine has
    assert m[0].inv_freq.device.type == "meta"


def test_aoti_programs_are_cached(engine_factory, tmp_path, monkeypatch):
    """An exported program is built once, then loaded by a later decoder."""
    engine = engine_factory("qwen2")
    first = FastDecoder(engine.model, backend="aoti", mode="default", max_len=128,
                        cache_dir=tmp_path)
    want = [_eager(engine, p, 2)[0] for p in PROMPTS]
    assert [_fast(first, p, 2)[0] for p in PROMPTS] == want
    # the round program, and the pooled ones that run short prompts
    assert (first.stats.compiled, first.stats.loaded) == (3, 0)
    programs = sorted(tmp_path.glob("*.pt2"))
    assert len(programs) == 3
    for program in programs:
        os.utime(program, (1, 1))
    second = FastDecoder(engine.model, backend="aoti", mode="default", max_len=128,
                         cache_dir=tmp_path)
    assert [_fast(second, p, 2)[0] for p in PROMPTS] == want
    assert (second.stats.compiled, second.stats.loaded) == (0, 3)
    # loading marks them used, for the cache cap
    assert all(program.stat().st_mtime > 1 for program in programs)
    # Other weights never reuse a program built for these; with a cap too small for two,
    # building theirs removes the program used least recently (not the one just built).
    monkeypatch.setenv("MTPKIT_COMPILE_CACHE_GB", "1e-9")
    other = engine_factory("qwen3")
    third = FastDecoder(other.model, backend="aoti", mode="default", max_len=128,
                        cache_dir=tmp_path)
    third.program("round", 3, 2)
    assert third.stats.compiled == 1
    assert not any(p.exists() for p in programs) and len(list(tmp_path.glob("*.pt2"))) == 1


@pytest.fixture(scope="module")
def quantized_engines(checkpoint_factory, tmp_path_factory):
    """scheme -> Engine of the tiny Llama quantized with it (w8a16 per channel, w4a16 g32,
    w4a8 g32 with zero points; "-lm": the lm_head quantized too, which makes the trunk
    row-exact), and "fp32": the same model unquantized (row-exact through f32_mm)."""
    import warnings

    from mtpkit.engine.loader import load_model
    from mtpkit.quant.pack import Scheme
    from mtpkit.quant.quantize import quantize_checkpoint

    engines = {}
    for name, group in (("w8a16", None), ("w4a16", 32), ("w8a8-lm", None),
                        ("w8a16-lm", None), ("w4a8-lm", 32)):
        out = tmp_path_factory.mktemp(name) / "m"
        quantize_checkpoint(checkpoint_factory("llama_tied"), out,
                            Scheme(name.removesuffix("-lm"), group, name != "w4a8-lm"),
                            mtp="same",
                            lm_head="same" if name.endswith("-lm") else "keep")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engines[name] = Engine(load_model(out, tokenizer=False).model)
    engines["fp32"] = Engine(load_model(checkpoint_factory("llama_tied"), tokenizer=False).model)
    return engines


# Schemes whose every trunk GEMM and lm_head is one of mtpkit's row-exact kernels.
ROW_EXACT = ("w8a8-lm", "w8a16-lm", "w4a8-lm", "fp32")


@pytest.mark.parametrize("scheme", ["w8a16", "w4a16", "w8a8-lm", "w8a16-lm", "w4a8-lm", "fp32"])
def test_quantized_verify_rows_equal_one_token_steps(scheme, quantized_engines):
    """On int8/int4 and fp32 trunks every row of a verification equals, bit for bit, the
    one-token decode step at its position (the property that makes MTP lossless there);
    row-exact trunks (lm_head quantized too, or fp32 through f32_mm) take that step as one
    row, the others as padded two."""
    from mtpkit.quant.linear import QuantLinear

    engine = quantized_engines[scheme]
    assert any(isinstance(m, QuantLinear) for m in engine.model.modules()) == (scheme != "fp32")
    assert unsupported_reason(engine.model) is None
    dec = FastDecoder(engine.model, backend="eager", max_len=128)
    pr = dec.programs
    assert pr.rowwise and pr.row_exact == (scheme in ROW_EXACT)
    assert pr.float_rows == (scheme == "fp32")
    with torch.inference_mode():
        dec.prefill(PROMPTS[1], 0)
        saved = [b.clone() for b in dec.kc + dec.vc]
        tokens = torch.tensor([[7, 19, 3, 44]])
        at = len(PROMPTS[1])
        span = dec.span(at + 64)
        rows, _ = pr.trunk(tokens, at + torch.arange(4), dec.kc, dec.vc, span, 4)
        for b, s in zip(dec.kc + dec.vc, saved, strict=True):
            b.copy_(s)
        for j in range(4):
            tok = tokens[:, j : j + 1]
            if pr.row_exact:
                one, _ = pr.trunk(tok, torch.tensor([at + j]), dec.kc, dec.vc, span, 1)
            else:
                one, _ = pr.trunk(torch.cat([tok, tok], 1), torch.tensor([at + j, at + j + 1]),
                                  dec.kc, dec.vc, span, 1)
            assert torch.equal(one[0, 0], rows[0, j]), f"row {j}"


def test_sessions_route_fp32_steps_through_the_row_exact_kernel(model_dir):
    """Session.load runs an fp32 CPU model's Linears (trunk, lm_head, head, draft rows)
    through f32_mm, sharing their weights under the same names: the eager engine's steps get
    the kernel's speed and row-exact bits, its greedy text stays what torch's GEMMs gave
    (within fp32 rounding), and the compiled path still sees a float row-exact trunk. bf16
    models are left alone."""
    import warnings

    from torch import nn

    from mtpkit.engine.loader import load_model
    from mtpkit.engine.session import Session
    from mtpkit.quant.kernels import int8_mm_available
    from mtpkit.quant.linear import RowExactLinear, linear_rows, route_rows_through_kernel

    if not int8_mm_available():
        pytest.skip("mtpkit's CPU kernels do not build here")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = load_model(model_dir, tokenizer=False).model
        other = load_model(model_dir, tokenizer=False).model
        session = Session.load(model_dir)
        half = load_model(model_dir, tokenizer=False, dtype="bfloat16").model
    n = sum(type(m) is nn.Linear for m in plain.modules())
    before = {k: v.data_ptr() for k, v in other.state_dict().items()}
    assert n > 0 and route_rows_through_kernel(other) == n
    assert {k: v.data_ptr() for k, v in other.state_dict().items()} == before  # no copy
    model = session.engine.model
    assert sum(isinstance(m, RowExactLinear) for m in model.modules()) == n
    assert not any(type(m) is nn.Linear for m in model.modules())
    rows = torch.tensor([5, 1, 9])
    sub = linear_rows(model.lm_head, rows)  # a draft vocabulary's lm_head rows
    assert isinstance(sub, RowExactLinear)
    x = torch.randn(2, model.lm_head.in_features)
    with torch.inference_mode():
        assert torch.equal(sub(x), model.lm_head(x)[:, rows])
    assert route_rows_through_kernel(half) == 0
    assert not any(isinstance(m, RowExactLinear) for m in half.modules())
    ids = torch.tensor([PROMPTS[1]])
    with torch.inference_mode():
        got, want = (m.logits(m(ids).hidden) for m in (model, plain))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    ref, _ = _eager(Engine(plain), PROMPTS[1], 0, max_tokens=20)
    for k in (0, 2):
        assert _eager(session.engine, PROMPTS[1], k, max_tokens=20)[0] == ref, k
    pr = FastDecoder(model, backend="eager", max_len=128).programs
    assert pr.float_rows and pr.row_exact


@pytest.mark.parametrize("half", ["bfloat16", "float16"])
def test_sessions_keep_16_bit_weights_and_their_bits(model_dir, tmp_path, half):
    """A checkpoint stored in bf16/fp16 runs with its Linears held in that precision (half the
    bytes a step reads) and computes in float32: exactly what the same weights upcast to
    float32 give, logits bit for bit and tokens with MTP equal to tokens without; and the
    fast path takes it (a float row-exact trunk)."""
    import shutil
    import warnings

    from safetensors.torch import load_file, save_file

    from mtpkit.engine.loader import load_model
    from mtpkit.engine.session import Session
    from mtpkit.quant.kernels import int8_mm_available
    from mtpkit.quant.linear import RowExactLinear, route_rows_through_kernel

    if not int8_mm_available():
        pytest.skip("mtpkit's CPU kernels do not build here")
    src = tmp_path / half
    shutil.copytree(model_dir, src)
    for f in src.glob("*.safetensors"):
        tensors = load_file(f)
        save_file({k: v.to(getattr(torch, half)) if v.dim() == 2 else v
                   for k, v in tensors.items()}, f, metadata={"format": "pt"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        session = Session.load(src, compile="off")
        upcast = load_model(src, tokenizer=False).model
    route_rows_through_kernel(upcast)  # the same values as float32 weights
    model = session.engine.model
    linears = [m for m in model.modules() if isinstance(m, RowExactLinear)]
    assert linears and all(m.weight.dtype == getattr(torch, half) for m in linears)
    assert model.model.embed_tokens.weight.dtype == torch.float32  # gathered, not read whole
    ids = torch.tensor([PROMPTS[1]])
    with torch.inference_mode():
        got = model.logits(model(ids[:, :4]).hidden)  # 4 rows: the kernel's path
        want = upcast.logits(upcast(ids[:, :4]).hidden)
    assert torch.equal(got, want)
    ref, _ = _eager(Engine(upcast), PROMPTS[1], 0, max_tokens=20)
    for k in (0, 2):
        assert _eager(session.engine, PROMPTS[1], k, max_tokens=20)[0] == ref, k
    pr = FastDecoder(model, backend="eager", max_len=128).programs
    assert pr.float_rows and pr.row_exact


@pytest.mark.parametrize("scheme", ["w8a8-lm", "w8a16-lm", "w4a8-lm"])
def test_row_exact_trunks_stack_qkv_and_gate_up_exactly(scheme, quantized_engines):
    """Row-exact trunks run q/k/v and gate/up as one int8 layer each; the trunk's states and
    cache entries are the same bits as with the layers apart (W8A8's fused layer ops off,
    which compute norms and SiLU their own way: test_w8a8_block_ops_match_per_gemm_layers)."""
    engine = quantized_engines[scheme]
    dec = FastDecoder(engine.model, backend="eager", max_len=128)
    pr = dec.programs
    assert pr.fused is not None and all(set(f) == {"qkv", "gate_up"} for f in pr.fused)
    assert all(pr.w8a8_blocks) == (scheme == "w8a8-lm")
    pr.w8a8_blocks = [False] * len(pr.w8a8_blocks)
    tokens = torch.tensor([[7, 19, 3, 44]])
    outs, stacked = [], pr.fused
    with torch.inference_mode():
        for fused in (stacked, None):
            for b in dec.kc + dec.vc:
                b.zero_()
            pr.fused = fused
            post, pre = pr.trunk(tokens, torch.arange(4), dec.kc, dec.vc, dec.span(8), 4)
            outs.append((post, pre, [b.clone() for b in dec.kc + dec.vc]))
    pr.fused = stacked
    (a, b, ca), (c, d, cb) = outs
    assert torch.equal(a, c) and torch.equal(b, d)
    assert all(torch.equal(x, y) for x, y in zip(ca, cb, strict=True))


def test_w8a8_layer_ops_change_no_bit(quantized_engines):
    """Fused W8A8 layers run all in one op (w8a8_trunk), as one op each (w8a8_layer: norm,
    q/k/v, rotary, cache writes, attention, MLP) or attend inside the MLP's op
    (w8a8_attn_post): trunk states and cache entries are the bits of w8a8_pre, the rotary,
    attend_rows and w8a8_post apart, over several rows, padding rows included."""
    dec = FastDecoder(quantized_engines["w8a8-lm"].model, backend="eager", max_len=128)
    pr = dec.programs
    assert all(pr.w8a8_blocks) and pr.w8a8_trunk
    tokens = torch.tensor([[7, 19, 3, 44, 5]])
    outs = []
    with torch.inference_mode():
        for attn, layer, trunk in ((True, True, True), (True, True, False),
                                   (True, False, False), (False, False, False)):
            pr.forms = W8A8Forms(attn=attn, layer=layer, trunk=trunk)
            pr.w8a8_trunk = trunk
            for b in dec.kc + dec.vc:
                b.zero_()
            post, pre = pr.trunk(tokens, torch.arange(5), dec.kc, dec.vc, dec.span(8), 4)
            outs.append((post, pre, [b.clone() for b in dec.kc + dec.vc]))
    a, b, ca = outs[-1]
    for c, d, cb in outs[:-1]:
        assert torch.equal(a, c) and torch.equal(b, d)
        assert all(torch.equal(x, y) for x, y in zip(ca, cb, strict=True))


def test_w8a8_trunks_take_stacked_caches_only_as_one_op(quantized_engines):
    """A W8A8 trunk whose compiled steps run as one w8a8_trunk op keeps its caches stacked
    (FastDecoder.kv, kc/vc its views); with the one-layer-op form switched off (to compare)
    its caches stay a tensor a layer, and a compiled step never gets stacked ones it would
    have to copy."""
    model = quantized_engines["w8a8-lm"].model
    dec = FastDecoder(model, backend="eager", max_len=128)
    kstack, vstack = dec.kv
    assert kstack.dim() == 5 and kstack.shape[0] == len(dec.kc)
    assert all(k.data_ptr() == kstack[i].data_ptr() for i, k in enumerate(dec.kc))
    other = FastDecoder(model, backend="eager", max_len=128, forms=W8A8Forms(layer=False))
    assert not other.programs.stacked_caches
    assert other.kv[0] is other.kc and other.kv[1] is other.vc
    assert len({k.data_ptr() for k in other.kc}) == len(other.kc)


def test_w8a8_block_ops_match_per_gemm_layers(quantized_engines):
    """W8A8 layers run as mtpkit's two fused ops (norm + q/k/v; o_proj to the MLP's
    residual): the trunk's states and cache entries agree with the op-per-GEMM form to
    float32 rounding, over several rows at once."""
    dec = FastDecoder(quantized_engines["w8a8-lm"].model, backend="eager", max_len=128)
    pr = dec.programs
    tokens = torch.tensor([[7, 19, 3, 44, 5]])
    outs = []
    with torch.inference_mode():
        for blocks in (pr.w8a8_blocks, [False] * len(pr.w8a8_blocks)):
            for b in dec.kc + dec.vc:
                b.zero_()
            pr.w8a8_blocks = blocks
            post, pre = pr.trunk(tokens, torch.arange(5), dec.kc, dec.vc, dec.span(8), 5)
            outs.append((post, pre, [b.clone() for b in dec.kc + dec.vc]))
    (a, b, ca), (c, d, cb) = outs
    assert not torch.equal(a, c)  # the fused ops did run (their own rounding)
    torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(b, d, rtol=1e-4, atol=1e-4)
    for x, y in zip(ca, cb, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("scheme", ["w8a16", "w4a16", "w8a8-lm", "w8a16-lm", "w4a8-lm"])
def test_quantized_models_take_the_fast_path_exactly(scheme, quantized_engines):
    """int8/int4 trunks decode through the fast path with the eager engine's tokens, at every
    draft depth the path serves on them (any depth on row-exact trunks)."""
    from mtpkit.engine.programs import QUANT_ROWS

    engine = quantized_engines[scheme]
    dec = FastDecoder(engine.model, backend="eager", max_len=128)
    exact = dec.programs.row_exact
    assert exact == scheme.endswith("-lm") and (dec.programs.rows is None) == exact
    for prompt in PROMPTS:
        want, _ = _eager(engine, prompt, 0)
        for k in range(4 if exact else QUANT_ROWS + 1):  # the deepest may run shallower
            got, res = _fast(dec, prompt, k)
            assert got == want, f"k={k} prompt={prompt}"
            if exact and res.metrics.num_drafts:
                # drafted as asked (the last round may draft fewer: no tokens left)
                assert res.metrics.num_draft_tokens > (k - 1) * res.metrics.num_drafts


def test_quantized_compiled_programs_stay_exact(quantized_engines, capsys):
    """Compiled int8 programs (one row count for every step, CPU GEMM templates, row-wise
    attention) keep MTP lossless: every k they serve gives the compiled k = 0 tokens, and
    a deeper k runs at the deepest exact one, with a note (the sweep tool refuses it)."""
    from mtpkit.engine.programs import QUANT_ROWS

    engine = quantized_engines["w8a16"]
    dec = FastDecoder(engine.model, backend="inductor", mode="max-autotune", max_len=128)
    for prompt in PROMPTS:
        want, _ = _fast(dec, prompt, 0)
        for k in range(1, QUANT_ROWS + 1):
            assert _fast(dec, prompt, k)[0] == want, f"k={k} prompt={prompt}"
    deeper, res = _fast(dec, PROMPTS[0], QUANT_ROWS + 2)
    assert res.metrics.num_drafts and (res.metrics.num_draft_tokens
                                       == (QUANT_ROWS - 1) * res.metrics.num_drafts)
    assert f"runs as -k {QUANT_ROWS - 1}" in capsys.readouterr().err
    with pytest.raises(ValueError, match=f"at most {QUANT_ROWS - 1} token"):
        dec.check_draft(QUANT_ROWS)


@pytest.mark.parametrize("scheme", ["w8a8-lm", "w4a8-lm", "fp32"])
def test_row_exact_compiled_programs_stay_exact_at_any_depth(quantized_engines, scheme):
    """Compiled programs of a row-exact trunk (W8A8 or W4A8 with its lm_head quantized, or
    fp32: every GEMM one of mtpkit's kernels) decode one row per step and verify k+1 rows
    per round with the compiled k = 0 tokens at every k, which the same programs
    uncompiled give too, and draft as deep as asked."""
    engine = quantized_engines[scheme]
    dec = FastDecoder(engine.model, backend="inductor", mode="max-autotune", max_len=128)
    uncompiled = FastDecoder(engine.model, backend="eager", max_len=128)
    assert dec.programs.row_exact and dec.programs.rows is None
    dec.check_draft(3)  # no depth limit
    for prompt in PROMPTS:
        want, _ = _fast(dec, prompt, 0)
        # One checkpoint, one output: the programs compiled or not (what --compile auto
        # switches between once `mtpkit warmup` has built them).
        assert _fast(uncompiled, prompt, 0)[0] == want, prompt
        for k in (1, 3):
            got, res = _fast(dec, prompt, k)
            assert got == want, f"k={k} prompt={prompt}"
    assert res.metrics.num_draft_tokens > 2 * res.metrics.num_drafts


@pytest.mark.parametrize("scheme, gemm", [("w4a8-lm", "int4_a8_mm"), ("fp32", "f32_mm"),
                                          ("w8a8-lm", "w8a8_trunk_kv")])
def test_aoti_programs_call_mtpkit_kernels_directly(quantized_engines, tmp_path, scheme, gemm):
    """Ahead-of-time programs of a W4A8 or fp32 trunk call mtpkit's kernels through their C
    entry points (no boxed dispatch per call) and decode, with and without MTP, the eager
    engine's tokens; a W8A8 trunk runs as one op taking its caches stacked (two inputs)."""
    import zipfile

    engine = quantized_engines[scheme]
    dec = FastDecoder(engine.model, backend="aoti", mode="default", max_len=128,
                      cache_dir=tmp_path)
    for prompt in PROMPTS[:2]:
        want, _ = _eager(engine, prompt, 0)
        assert _fast(dec, prompt, 0)[0] == want
        assert _fast(dec, prompt, 1)[0] == want
    packages = sorted(tmp_path.glob("*.pt2"))
    # decode, round at k = 1, and where the trunk pools, the pooled programs that run
    # short prompts (trunk_pool, head_pool)
    steps = [p for p in packages if p.name.startswith(("decode-", "round-"))]
    assert len(steps) == 2 and len(packages) == (2 if gemm == "w8a8_trunk_kv" else 4)
    for package in steps:
        with zipfile.ZipFile(package) as z:
            wrapper = "".join(z.read(n).decode() for n in z.namelist()
                              if n.endswith(".wrapper.cpp"))
        # W8A8 trunks run as one op, attention included; the others call attend_rows.
        ops = (gemm, "argmax_rows") + (() if gemm == "w8a8_trunk_kv" else ("attend_rows",))
        for op in ops:  # called, not only declared
            assert f"AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_cpu_{op}(" in wrapper, (package, op)
        assert "call_function(" not in wrapper  # the proxy executor's boxed calls
        if gemm == "w8a8_trunk_kv":  # it writes the caches in place: no copy of them
            assert "aoti_torch_clone" not in wrapper and "aoti_torch_copy_" not in wrapper
            assert dec.kv[0].dim() == 5 and dec.kc[0].data_ptr() == dec.kv[0].data_ptr()
    # Built without the weights, the programs run on the model's own tensors, the packed
    # forms of quantized layers included: the final norm's weight negated in place turns
    # every step's logits around and changes what they decode as it does the eager
    # engine's, and undoing it restores the tokens.
    decode = dec.program("decode", 1, 0)
    assert decode.compiled.get_metadata()[pcache.CONSTANTS_KEY] == "model"
    held = list(decode.held.values())
    forms = [n for n in decode.held if n.rsplit(".", 1)[-1].startswith(FORM_PREFIX)]
    assert bool(forms) == (scheme != "fp32")
    norm = engine.model.model.norm.weight
    assert any(t is norm for t in held)
    want, _ = _eager(engine, PROMPTS[0], 0)
    with torch.no_grad():
        norm.neg_()
        changed = _eager(engine, PROMPTS[0], 0)[0]
        got = _fast(dec, PROMPTS[0], 0)[0]
        norm.neg_()
    assert changed != want and got == changed
    assert _fast(dec, PROMPTS[0], 0)[0] == want


def test_programs_hold_weights_only_where_a_gemm_of_inductor_takes_them():
    """A program is built without its weights (_runs_on_model_tensors) only when every
    tensor it holds is the model's under the same name and no aten GEMM takes one (those
    want freezing's prepacked copies); a tensor held in a dict is an anonymous constant."""

    class Inner(nn.Module):
        def __init__(self, how):
            super().__init__()
            self.how = how
            self.w = nn.Parameter(torch.randn(8, 8))
            self.register_buffer("b", torch.randn(8), persistent=False)
            self.kept = {"t": torch.randn(8)}

        def forward(self, x):
            if self.how == "pointwise":
                return x * self.w[0] + self._buffers["b"]
            if self.how == "gemm":
                return torch.nn.functional.linear(x, self.w.t()) + self.b
            return x * self.kept["t"]

    class Outer(nn.Module):
        def __init__(self, how):
            super().__init__()
            self.programs = Inner(how)

        def forward(self, x):
            return self.programs(x)

    got = {}
    for how in ("pointwise", "gemm", "dict"):
        outer = Outer(how)
        ep = torch.export.export(outer, (torch.randn(2, 8),), strict=False)
        got[how] = pcache._runs_on_model_tensors(ep, outer.programs)
    assert got == {"pointwise": True, "gemm": False, "dict": False}


def test_program_keys_tell_w8a8_from_w8a16(quantized_engines):
    """W8A8 and W8A16 copies of one model hold the same int8 codes and scales; their
    compiled programs differ (activations quantized or not) and must not share a key."""
    from mtpkit.engine.program_cache import model_fingerprint
    from mtpkit.engine.programs import Programs

    a8, w8 = quantized_engines["w8a8-lm"].model, quantized_engines["w8a16-lm"].model
    assert torch.equal(a8.lm_head.codes, w8.lm_head.codes)
    assert model_fingerprint(Programs(a8, None)) != model_fingerprint(Programs(w8, None))


def test_program_keys_do_not_depend_on_which_kernel_forms_exist(quantized_engines):
    """A layer's kernel forms are buffers built on first use (QuantLinear._prepare): the
    key of a program must be the same whether a process has built them yet or not, else a
    later process would never find the programs an earlier one built."""
    from mtpkit.engine.program_cache import model_fingerprint
    from mtpkit.engine.programs import Programs
    from mtpkit.quant.linear import FORM_PREFIX, QuantLinear

    model = quantized_engines["w8a16"].model
    programs = Programs(model, None)
    built = model_fingerprint(programs)
    layers = [m for m in programs.modules() if isinstance(m, QuantLinear)]
    for m in layers:
        m.to("cpu")  # forgets its forms
    assert not any(n.rsplit(".", 1)[-1].startswith(FORM_PREFIX)
                   for n, _ in programs.named_buffers())
    assert model_fingerprint(programs) == built
    _eager(quantized_engines["w8a16"], PROMPTS[0], 1)
    assert any(n.rsplit(".", 1)[-1].startswith(FORM_PREFIX) for n, _ in programs.named_buffers())
    assert model_fingerprint(programs) == built


def _lockstep(dec: FastDecoder, gens: dict) -> tuple[dict, dict]:
    """Advance several generations (FastDecoder.steps) together, as the server does: each to
    its next program call, then all calls in one FastDecoder.run_many."""
    from mtpkit.engine.fast import PIECE, Step

    got = {key: [] for key in gens}
    pieces = dict.fromkeys(gens, 0)
    results: dict = {}
    live = dict(gens)
    while live:
        calls = {}
        for key in list(live):
            item = live[key].send(results.pop(key)) if key in results else next(live[key], None)
            while item is not None and not isinstance(item, Step) and item is not PIECE:
                got[key] += item
                item = next(live[key], None)
            if item is None:
                del live[key]
            elif item is PIECE:
                pieces[key] += 1
            else:
                calls[key] = item
        if calls:
            for key, out in zip(calls, dec.run_many(list(calls.values())), strict=True):
                results[key] = out
    return got, pieces


SCHEMES_BATCHED = ["llama", "qwen3", "w8a8-lm", "fp32"]


@pytest.mark.parametrize("pooled", [False, True], ids=["own-caches", "pooled"])
@pytest.mark.parametrize("name", SCHEMES_BATCHED)
def test_forks_stepped_together_keep_each_sequences_tokens(name, pooled, engine_factory,
                                                           quantized_engines, monkeypatch):
    """Forks (server slots) share the programs but not the caches. Three generations
    advanced together, their decode steps and rounds run as one trunk pass
    (FastDecoder.run_many), each give the tokens of a lone run, a prompt run in pieces
    included; and a row's bits do not depend on the rows beside it, so the tokens equal
    the eager engine's too (fp32) or the lone fast path's (W8A8). Pooled: the forks'
    caches are slots of one pool (make_pool), the batched passes the trunk_pool and
    head_pool programs."""
    engine = quantized_engines[name] if name in quantized_engines else engine_factory(name)
    maps = []
    if pooled:
        # Every cache a mapping whose pages come as written (models/cache.zeros), as a
        # server's full-size pools are.
        real = cache_mod.mmap.mmap
        monkeypatch.setattr(cache_mod, "LAZY_MIN_BYTES", 0)
        monkeypatch.setattr(cache_mod.mmap, "mmap",
                            lambda *a, **kw: maps.append(a) or real(*a, **kw))
    dec = FastDecoder(engine.model, backend="eager", max_len=128)
    assert dec.programs.batchable
    # Every batched round drafts (the rounds that do not: test_lean_rounds_...).
    monkeypatch.setattr(RoundChoices, "lean", lambda self, k, n: False)
    if pooled and dec.programs.stacked_caches:
        # W8A8 trunks run as one op over caches stacked a decoder: they do not pool.
        assert not dec.make_pool(3) and dec.fork(0).slot is None
        return
    if pooled:
        before = len(maps)
        assert dec.make_pool(3)
        assert len(maps) - before == 2 * len(dec.kc) + 2  # every layer's pools and the head's
        forks = [dec.fork(i) for i in (2, 0, 1)]
        # A slot's caches are views of the pool; the pool programs run the batched steps.
        assert forks[0].kc[0].data_ptr() == dec._pool[0][0][2].data_ptr()
        assert forks[1].hk.data_ptr() == dec._pool[2][0].data_ptr()
        with pytest.raises(ValueError, match="outside the pool"):
            dec.fork(3)
    else:
        forks = [dec.fork() for _ in range(3)]
    assert forks[0].programs is dec.programs and forks[0].cache is dec.cache
    assert forks[0].kv[0] is not forks[1].kv[0] and forks[0].hk is not dec.hk
    long_prompt = [(7 * i) % 90 + 1 for i in range(23)]
    prompts = [PROMPTS[1], long_prompt, PROMPTS[0]]
    for k in (0, 1, 3):
        lone = [_fast(dec, p, k) for p in prompts]
        want = [toks for toks, _ in lone]
        results = [Result() for _ in prompts]
        gens = {i: f.steps(p, 24, k, result=r, eos_ids=set(), chunk=5)
                for i, (f, p, r) in enumerate(zip(forks, prompts, results, strict=True))}
        got, pieces = _lockstep(dec, gens)
        assert [got[i] for i in range(3)] == want, f"k={k}"
        # The head drafts in batched rounds too (its attention takes the row kernel there,
        # so a draft can differ from the lone round's; the tokens cannot). Batched rounds
        # verify only the drafts that pay (engine/budget.py; the second round of a batch
        # size verifies none, to measure it), so fewer are drafted, as well accepted.
        def rate(ms):
            return (sum(m.num_accepted_tokens for m in ms)
                    / max(1, sum(m.num_draft_tokens for m in ms)))
        if k:
            batched = [r.metrics for r in results]
            alone = [res.metrics for _, res in lone]
            assert rate(batched) >= 0.5 * rate(alone)
            assert (sum(m.num_draft_tokens for m in batched)
                    < sum(m.num_draft_tokens for m in alone))
        # The 23-token prompt: 5 trunk pieces (and 5 of head catch-up with k), a step each.
        assert pieces[1] == (9 if k else 4)
    if name in ("llama", "qwen3"):
        assert want == [_eager(engine, p, 3)[0] for p in prompts]
    if pooled:
        assert {key[0] for key in dec.cache.fns} >= {"trunk_pool", "head_pool"}


def test_many_forks_past_the_kernels_row_limit_keep_each_sequences_tokens(quantized_engines,
                                                                         monkeypatch):
    """Six sequences drafting 3 tokens verify 24 rows in one batched round, more than a
    prompt's threshold for torch's GEMM (RowExactLinear.max_kernel_rows): every row must
    still take the row-exact kernel (torch's GEMM is made to fail here), or a sequence's
    tokens would depend on its company."""
    import torch.nn.functional as F

    import mtpkit.quant.linear as linear_mod

    engine = quantized_engines["fp32"]
    dec = FastDecoder(engine.model, backend="eager", max_len=128)
    prompts = [PROMPTS[i % len(PROMPTS)][: 3 + i] + [i + 1] for i in range(6)]
    want = [_fast(dec, p, 3)[0] for p in prompts]
    forks = [dec.fork() for _ in prompts]
    dec.choices.batch_pays = lambda *a: True
    dec.choices.drafts_to_verify = lambda k, full, probs: full
    gens = {i: f.steps(p, 24, 3, result=Result(), eos_ids=set())
            for i, (f, p) in enumerate(zip(forks, prompts, strict=True))}

    class NoGemm:
        # torch.nn.functional as RowExactLinear sees it, its GEMM refused.
        def __getattr__(self, name):
            return getattr(F, name)

        @staticmethod
        def linear(*args, **kwargs):
            raise AssertionError("a batched step's rows went through torch's GEMM")

    monkeypatch.setattr(linear_mod, "F", NoGemm())
    got, _ = _lockstep(dec, gens)
    assert [got[i] for i in range(len(prompts))] == want


def test_head_rows_attend_each_sequences_own_cache(engine_factory):
    """The batched head pass (Programs.head_rows) gives each sequence what the head alone
    gives it over its own cache (up to the row kernel's rounding against SDPA's)."""
    engine = engine_factory("llama")
    dec = FastDecoder(engine.model, backend="eager", max_len=128)
    prompts = [PROMPTS[1], [(7 * i) % 90 + 1 for i in range(23)]]
    forks = [dec.fork() for _ in prompts]
    for f, p in zip(forks, prompts, strict=True):
        f.prefill(p, 1)  # fills the head caches up to len(p)
    g = torch.Generator().manual_seed(0)
    dim = engine.model.config.hidden_size
    rows = [(torch.tensor([[5 + i]]), torch.randn(1, 1, dim, generator=g),
             torch.tensor([len(p)]), f.hk, f.hv, f.span(len(p) + 1))
            for i, (f, p) in enumerate(zip(forks, prompts, strict=True))]
    with torch.inference_mode():
        batched = dec.programs.head_rows(rows)
        for (post, _), args in zip(batched, rows, strict=True):
            alone, _ = dec.programs.head(*args)
            torch.testing.assert_close(post, alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", SCHEMES_BATCHED)
def test_trunk_rows_give_each_row_its_lone_bits(name, engine_factory, quantized_engines,
                                                monkeypatch):
    """The batched trunk pass (one attention call a layer for every sequence's rows,
    csrc/attend_rows.cpp: attend_seqs) gives each row the bits its sequence's own pass
    gives, and writes the same cache entries."""
    engine = quantized_engines[name] if name in quantized_engines else engine_factory(name)
    dec = FastDecoder(engine.model, backend="eager", max_len=128)
    pr = dec.programs
    prompts = [PROMPTS[1], [(7 * i) % 90 + 1 for i in range(23)], PROMPTS[0]]
    batched_forks, lone_forks = ([dec.fork() for _ in prompts] for _ in range(2))
    for f, g, p in zip(batched_forks, lone_forks, prompts, strict=True):
        f.prefill(p, 0)
        g.prefill(p, 0)
    seqs, lone = [], []
    # 6, 7 and 8 rows: 21 in all, past the row count where a prompt takes torch's GEMM
    # (RowExactLinear.max_kernel_rows), which a batched pass must never do.
    for i, (f, g, p) in enumerate(zip(batched_forks, lone_forks, prompts, strict=True)):
        ids = torch.tensor([[(11 * i + j) % 90 + 1 for j in range(i + 6)]])
        pos = len(p) + torch.arange(i + 6)
        seqs.append((ids, pos, f.kc, f.vc, f.span(len(p) + 9)))
        lone.append((ids, pos, g.kc, g.vc, g.span(len(p) + 9)))
    with torch.inference_mode():
        got = pr.trunk_rows(seqs)
        for (post, pre), (ids, pos, kc, vc, span), f in zip(got, lone, batched_forks,
                                                            strict=True):
            if name == "w8a8-lm":
                # Its lone pass runs the fused W8A8 trunk op: the reference here is the
                # per-sequence attention the batched pass made before (_attention).
                with monkeypatch.context() as m:
                    m.setattr("mtpkit.engine.programs._seqs_kernel_fits", lambda x, buf: False)
                    ((want, want_pre),) = pr.trunk_rows([(ids, pos, kc, vc, span)])
            else:
                want, want_pre = pr.trunk(ids, pos, kc, vc, span, ids.shape[1])
            assert torch.equal(post, want) and torch.equal(pre, want_pre)
            for a, b in zip(f.kc + f.vc, list(kc) + list(vc), strict=True):
                assert torch.equal(a.index_select(2, pos), b.index_select(2, pos))


def test_auto_backend_runs_uncompiled_until_programs_exist(engine_factory, tmp_path):
    """backend="auto" never builds: with nothing in the cache it runs the programs
    uncompiled (the eager engine's tokens); it would load a built one by its key."""
    engine = engine_factory("llama")
    dec = FastDecoder(engine.model, backend="auto", max_len=128, cache_dir=tmp_path)
    for k in (0, 2):
        assert _fast(dec, PROMPTS[0], k)[0] == _eager(engine, PROMPTS[0], k)[0]
    assert dec.stats.compiled == dec.stats.loaded == 0 and not list(tmp_path.iterdir())
    path = dec.cache.path("round", 3, 2)
    assert path.parent == tmp_path and path.name.startswith("round-")


def test_auto_backend_adopts_programs_built_meanwhile(engine_factory, tmp_path, monkeypatch):
    """A program running uncompiled because its file was missing is swapped for the built
    one once the file appears (a server's background `mtpkit warmup`), by every fork, and
    only after ADOPT_EVERY_S since the last look; a file that fails to load leaves the
    uncompiled program running and is not retried."""
    engine = engine_factory("llama")
    dec = FastDecoder(engine.model, backend="auto", max_len=128, cache_dir=tmp_path)
    twin = dec.fork()
    uncompiled = dec.program("decode")
    path = dec.cache.path("decode", 1, 0)
    assert dec.pending == [path] and twin.pending == [path]
    built = object()
    monkeypatch.setattr(ProgramCache, "_load", lambda self, p: built if p == path else 1 / 0)
    path.write_bytes(b"built")
    dec.cache._looked = time.monotonic()
    assert dec.program("decode") is uncompiled  # looked too recently
    monkeypatch.setattr(pcache, "ADOPT_EVERY_S", 0.0)
    assert twin.program("decode") is built and dec.program("decode") is built
    assert dec.pending == []
    # A broken file: logged, dropped from the pending list, the uncompiled program kept.
    step = dec.program("round", 2, 1)
    broken = dec.cache.path("round", 2, 1)
    broken.write_bytes(b"not a program")
    assert dec.program("round", 2, 1) is step and dec.pending == []


def test_build_pending_compiles_what_runs_uncompiled(engine_factory, tmp_path):
    """build_pending (what `mtpkit bench offline` runs before timing) builds every program
    that backend="auto" runs uncompiled for want of its file, into the file `mtpkit
    warmup` would write, and runs it compiled from then on with the same tokens; a second
    call has nothing left to build."""
    engine = engine_factory("llama")
    dec = FastDecoder(engine.model, backend="auto", max_len=128, cache_dir=tmp_path)
    want = _fast(dec, PROMPTS[0], 0)[0]
    path = dec.cache.path("decode", 1, 0)
    pending = dec.pending  # the decode step's, and the pool programs' of its prompt
    assert path in pending and not any(p.exists() for p in pending)
    assert dec.build_pending() == len(pending) == dec.stats.compiled
    assert dec.pending == [] and all(p.exists() for p in pending)
    assert not isinstance(dec.program("decode"), StepModule)
    assert _fast(dec, PROMPTS[0], 0)[0] == want
    assert dec.build_pending() == 0


def test_compiled_pool_programs_batch_any_sequences_exactly(quantized_engines, tmp_path,
                                                            monkeypatch):
    """The pool programs, compiled ahead of time once (rows, sequences and pool slots
    dynamic), step 2 and then 3 pooled forks together (every batch through them) with
    each sequence's lone tokens, greedy and sampled; they call attend_pool through its C
    entry point and write the pools in place (no copy of them)."""
    import zipfile

    engine = quantized_engines["w8a16-lm"]
    dec = FastDecoder(engine.model, backend="aoti", mode="default", max_len=128,
                      cache_dir=tmp_path)
    assert dec.make_pool(4)
    monkeypatch.setattr(RoundChoices, "batch_pays", lambda self, kind, k, n: True)
    prompts = [PROMPTS[0], PROMPTS[1], [(5 * i) % 90 + 1 for i in range(11)]]
    for k in (0, 1):
        want = [_eager(engine, p, k, max_tokens=16)[0] for p in prompts]
        for n in (2, 3):
            forks = [dec.fork(slot) for slot in (3, 0, 2)[:n]]
            gens = {i: f.steps(p, 16, k, result=Result(), eos_ids=set())
                    for i, (f, p) in enumerate(zip(forks, prompts, strict=False))}
            got, _ = _lockstep(dec, gens)
            assert [got[i] for i in range(n)] == want[:n], (k, n)
    # Sampled requests run the same two programs: a lone one (its own caches a pool of
    # one slot, one row a step at k = 0) and three together draw what the uncompiled
    # programs draw.
    uncompiled = FastDecoder(engine.model, backend="eager", max_len=128)
    for k in (0, 1):
        settings = [SamplingParams(max_tokens=16, seed=s, **SAMPLED) for s in range(3)]
        want = [list(uncompiled.generate(p, 16, k, eos_ids=set(), params=s))
                for p, s in zip(prompts, settings, strict=True)]
        assert list(dec.generate(prompts[0], 16, k, eos_ids=set(),
                                 params=settings[0])) == want[0], k
        forks = [dec.fork(slot) for slot in (3, 0, 2)]
        gens = {i: f.steps(p, 16, k, result=Result(), eos_ids=set(), params=s)
                for i, (f, p, s) in enumerate(zip(forks, prompts, settings, strict=True))}
        got, _ = _lockstep(dec, gens)
        assert [got[i] for i in range(3)] == want, k
    packages = {p.name.split("-")[0]: p for p in tmp_path.glob("*_pool-*.pt2")}
    assert set(packages) == {"trunk_pool", "head_pool"}
    for package in packages.values():
        with zipfile.ZipFile(package) as z:
            wrapper = "".join(z.read(n).decode() for n in z.namelist()
                              if n.endswith(".wrapper.cpp"))
        assert "AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_cpu_attend_pool(" in wrapper
        assert "aoti_torch_clone" not in wrapper and "aoti_torch_copy_" not in wrapper


SAMPLED = dict(temperature=0.8, top_k=20, top_p=0.9)


@pytest.mark.parametrize("name", FAST)
def test_sampled_requests_on_the_fast_path_draw_as_the_eager_engine(name, engine_factory):
    """A sampled request on the fast path draws from its random stream in the eager
    engine's order (the first token, k drafts, then a round's accept draws and its k new
    drafts, fewer where max_tokens leaves no room) from the same probabilities: one seed,
    the same tokens and draft counts."""
    engine = engine_factory(name)
    dec = FastDecoder(engine.model, backend="eager", max_len=128)
    assert dec.samples
    for k in (0, 1, 3):
        for seed, prompt in enumerate(PROMPTS):
            p = SamplingParams(max_tokens=24 - seed, seed=seed, **SAMPLED)
            ref_res, res = Result(), Result()
            ref = list(engine.generate(prompt, p, k, result=ref_res, eos_ids=set()))
            got = list(dec.generate(prompt, p.max_tokens, k, result=res, eos_ids=set(),
                                    params=p))
            assert got == ref, (k, seed)
            m, r = res.metrics, ref_res.metrics
            assert (m.num_draft_tokens, m.num_accepted_tokens) == \
                (r.num_draft_tokens, r.num_accepted_tokens), (k, seed)
            assert (m.num_draft_tokens > 0) == (k > 0)
        if name == "llama_tied":
            continue  # its tied lm_head repeats the last token with probability 1 (~e^-50)
        # A seed fixes the draws, not the prompt alone: the same prompts, other seeds.
        runs = {tuple(dec.generate(prompt, 24, k, eos_ids=set(), params=SamplingParams(
            max_tokens=24, seed=s, temperature=2.0))) for s in range(4) for prompt in PROMPTS}
        assert len(runs) > len(PROMPTS)


@pytest.mark.parametrize("name", ["llama", "w8a16-lm"])
def test_pooled_forks_mixing_sampled_and_greedy_requests_keep_each_sequences_tokens(
        name, engine_factory, quantized_engines):
    """A server's slots stepped together, sampled requests (each its settings and seed)
    beside greedy ones: every sequence gets the tokens of its lone run, k = 0..2."""
    engine = quantized_engines[name] if name in quantized_engines else engine_factory(name)
    dec = FastDecoder(engine.model, backend="eager", max_len=128)
    assert dec.make_pool(4)
    forks = [dec.fork(i) for i in (1, 3, 0, 2)]
    prompts = [PROMPTS[1], PROMPTS[0], [(7 * i) % 90 + 1 for i in range(17)], PROMPTS[3]]
    settings = [SamplingParams(max_tokens=20, seed=1, **SAMPLED), None,
                SamplingParams(max_tokens=20, seed=2, temperature=1.0),
                SamplingParams(max_tokens=20, seed=3, temperature=0.7, top_k=5)]
    for k in (0, 1, 2):
        lone = [list(dec.generate(p, 20, k, eos_ids=set(), params=s))
                for p, s in zip(prompts, settings, strict=True)]
        gens = {i: f.steps(p, 20, k, result=Result(), eos_ids=set(), chunk=6, params=s)
                for i, (f, p, s) in enumerate(zip(forks, prompts, settings, strict=True))}
        got, _ = _lockstep(dec, gens)
        assert [got[i] for i in range(4)] == lone, f"k={k}"
        if name == "llama":  # (the tied model's tokens are certain at any temperature)
            assert lone[0] != _fast(dec, prompts[0], k, max_tokens=20)[0]


def test_lean_sampled_rounds_spare_seeded_requests(engine_factory, monkeypatch):
    """Where drafting does not pay, a batch's sampled requests without a seed draw no
    drafts (plain sampled steps); a seeded one beside them keeps drafting, and the tokens
    of its lone run."""
    engine = engine_factory("llama")
    dec = FastDecoder(engine.model, backend="eager", max_len=128)
    assert dec.make_pool(3)
    asked = []
    monkeypatch.setattr(RoundChoices, "lean",
                        lambda self, k, n, sampled=False: asked.append(sampled) or sampled)
    seeded = SamplingParams(max_tokens=20, seed=5, **SAMPLED)
    settings = [seeded, SamplingParams(max_tokens=20, **SAMPLED),
                SamplingParams(max_tokens=20, temperature=1.0)]
    prompts = [PROMPTS[1], PROMPTS[0], PROMPTS[3]]
    want = list(dec.generate(prompts[0], 20, 2, eos_ids=set(), params=seeded))
    results = [Result() for _ in prompts]
    gens = {i: dec.fork(i).steps(p, 20, 2, result=r, eos_ids=set(), params=s)
            for i, (p, s, r) in enumerate(zip(prompts, settings, results, strict=True))}
    got, _ = _lockstep(dec, gens)
    assert got[0] == want and asked and all(asked)
    assert all(len(got[i]) == 20 for i in (1, 2))
    drafted = [r.metrics.num_draft_tokens for r in results]
    # The unseeded ones verify only the drafts drawn after their prompt.
    assert drafted[0] > 10 and drafted[1] <= 2 and drafted[2] <= 2


def test_sampled_rounds_that_draw_nothing_leave_the_head_caught_up(engine_factory,
                                                                   monkeypatch):
    """Rounds that draw no drafts (lean) defer the head's catch-up to the next round that
    draws; that catch-up (in pieces of at most POOL_MAX_ROWS rows) leaves the head's cache
    as a run that drafted every round leaves it. Sampling with top_k=1 makes every token
    certain, so both runs emit the same tokens."""
    engine = engine_factory("llama")
    params = SamplingParams(max_tokens=40, temperature=1.0, top_k=1)
    ref = FastDecoder(engine.model, backend="eager", max_len=128)
    want = list(ref.generate(PROMPTS[1], 40, 2, eos_ids=set(), params=params))
    dec = FastDecoder(engine.model, backend="eager", max_len=128)
    monkeypatch.setattr(fast_mod, "POOL_MAX_ROWS", 3)
    rounds = iter(range(10_000))
    draws = fast_mod._Sampler.draws
    # Calls 4..15 (a few rounds, each asked once or more) draw nothing.
    monkeypatch.setattr(fast_mod._Sampler, "draws", lambda self, k: 0 if 4 <= next(rounds) < 16
                        else draws(self, k))
    res = Result()
    assert list(dec.generate(PROMPTS[1], 40, 2, result=res, eos_ids=set(),
                             params=params)) == want
    assert res.metrics.num_draft_tokens < 2 * res.metrics.num_drafts + 2
    # Positions the head has caught up on in both runs: the same keys and values, up to
    # the rounding of the fp32 head's GEMMs over other row counts (entries it never caught
    # up on would be those of drafts, or zeros).
    end = len(PROMPTS[1]) + 40 - 3
    torch.testing.assert_close(dec.hk[:, :, :end], ref.hk[:, :, :end], rtol=0, atol=1e-4)
    torch.testing.assert_close(dec.hv[:, :, :end], ref.hv[:, :, :end], rtol=0, atol=1e-4)


@pytest.mark.parametrize("pooled", [False, True], ids=["own-caches", "pooled"])
def test_lean_rounds_keep_each_sequences_tokens(pooled, engine_factory, monkeypatch):
    """Batched rounds that draft nothing (where drafting does not pay: FastDecoder._lean)
    interleaved with drafting ones, and placeholder drafts verified now and then: every
    sequence's tokens stay those of its lone run, and no placeholder is counted as a
    draft unless verified. A lean round verifies nothing, not even the real drafts a
    drafting round left, so that it always measures the lean cost the choice weighs."""
    engine = engine_factory("llama")
    dec = FastDecoder(engine.model, backend="eager", max_len=128)
    if pooled:
        assert dec.make_pool(3)
    forks = [dec.fork(i if pooled else None) for i in range(3)]
    turns = iter(range(10_000))
    monkeypatch.setattr(RoundChoices, "lean", lambda self, k, n: next(turns) % 3 != 0)
    monkeypatch.setattr(RoundChoices, "batch_pays", lambda self, kind, k, n: True)
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[3]]
    for k in (1, 3):
        want = [_fast(dec, p, k)[0] for p in prompts]
        results = [Result() for _ in prompts]
        gens = {i: f.steps(p, 24, k, result=r, eos_ids=set())
                for i, (f, p, r) in enumerate(zip(forks, prompts, results, strict=True))}
        got, _ = _lockstep(dec, gens)
        assert [got[i] for i in range(3)] == want, k
        for r in results:
            assert r.metrics.num_accepted_tokens <= r.metrics.num_draft_tokens
    assert dec.choices.lean_costs and dec.choices.draft_seen.sequences
    for (_, n), costs in dec.choices.lean_costs.items():
        assert set(costs.seconds) == {n}


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "drafting"])
def test_a_prompt_joining_lean_rounds_skips_the_heads_pass(lean, engine_factory, monkeypatch):
    """A greedy prompt that joins other running sequences whose batched rounds are lean
    (RoundChoices.lean_prompt) runs without the head's pass over it: the head's cache slot
    stays untouched and the first drafts are placeholders of probability 0; its tokens
    stay those of its lone run. Where the rounds draft, or where it runs alone, the head
    catches up on it."""
    engine = engine_factory("llama")
    dec = FastDecoder(engine.model, backend="eager", max_len=128)
    assert dec.make_pool(3)
    fork = dec.fork(2)
    monkeypatch.setattr(RoundChoices, "lean", lambda self, k, n: lean)
    k, prompt = 2, PROMPTS[3]
    hk = dec._pool[2]
    want, _ = _fast(dec, prompt, k)
    for joining in (0, 2):
        hk[2].zero_()
        res = Result()
        gen = fork.steps(prompt, 24, k, result=res, eos_ids=set(), joining=joining)
        with torch.inference_mode():
            first = next(gen)  # the prompt's pass done, no program call yet
        skipped = lean and joining > 0
        assert (not hk[2].any()) == skipped, joining
        step = next(gen)
        if skipped:
            assert step.ids == first * (k + 1) and step.odds == [0.0] * k
        else:
            assert all(p > 0 for p in step.odds)
        out = fork.run(step)
        got = [first[0]]
        gen_live = True
        while gen_live:
            item = gen.send(out)
            while item is not None and not isinstance(item, fast_mod.Step):
                got += item
                item = next(gen, None)
            if item is None:
                gen_live = False
            else:
                out = fork.run(item)
        assert got == want, joining
        assert res.metrics.num_accepted_tokens <= res.metrics.num_draft_tokens


def test_programs_are_keyed_by_their_own_family_sources_only(engine_factory):
    """A program's key covers the code it is traced from: this family's file and the
    shared model modules, not the other families' files (editing those must not make
    every user rebuild), and never leaves out a file its classes come from."""
    from mtpkit.engine.program_cache import traced_sources
    from mtpkit.models.registry import FAMILIES

    engine = engine_factory("llama")
    names = {f.name for f in traced_sources(engine.model)}
    assert {"programs.py", "linear.py", "w8a8_layer.py", "llama.py", "layers.py", "attention.py",
            "mtp.py", "base.py", "cache.py", "config.py"} <= names
    others = {f"{module}.py" for module, _ in FAMILIES.values()} - {"llama.py"}
    assert not names & others
    for cls in (type(engine.model), type(engine.model.config)):
        for c in cls.__mro__:
            if c.__module__.startswith("mtpkit."):
                assert c.__module__.rsplit(".", 1)[-1] + ".py" in names, c


def test_program_keys_ignore_comments_not_code(engine_factory, tmp_path, monkeypatch):
    """Editing a comment or the layout of a traced file keeps the programs' key (a rebuild
    costs every user minutes); editing code, or a string, changes it."""
    from mtpkit.engine import program_cache as fast

    engine = engine_factory("llama")
    files = []
    for f in fast.traced_sources(engine.model):
        files.append(tmp_path / f.name)
        files[-1].write_text(f.read_text())
    monkeypatch.setattr(fast, "traced_sources", lambda model: files)

    def key():
        return fast._source_digest(engine.model)

    def edit(old, new):
        text = files[0].read_text()
        assert old in text
        files[0].write_text(text.replace(old, new, 1))

    base = key()
    edit("\nimport ", "\n# a new comment\n\n\nimport ")
    edit("import torch\n", "import torch  # and a trailing one\n")
    assert key() == base
    edit("SPAN_STEP = ", "SPAN_STEP = 1 + ")
    changed = key()
    assert changed != base
    edit("\"\"\"", "\"\"\"A docstring edit. ")
    assert key() != changed


def test_placeholder_drafts_are_not_counted_as_drafts(engine_factory):
    """A lean round leaves placeholder drafts (probability 0); the lone round program after
    it verifies them anyway, and they must not count as drafts in the metrics (the
    acceptance users see), while the tokens stay the lone run's."""
    from mtpkit.engine.fast import PIECE, Step, _drafted

    engine = engine_factory("llama")
    dec = FastDecoder(engine.model, backend="eager", max_len=128)
    want = _fast(dec, PROMPTS[1], 1)[0]
    res = Result()
    gen = dec.steps(PROMPTS[1], 24, 1, result=res, eos_ids=set())
    got, real, lean_done, out = [], 0, False, None
    item = next(gen)
    while item is not None:
        if isinstance(item, Step):
            if item.kind == "round" and not lean_done:
                # This round as a lean batched round answers it: one row, no drafting.
                (out,) = dec._lean_round([item], 1, pooled=False)
                lean_done = True
            else:
                real += _drafted(item.odds)
                out = dec.run(item)
            item = gen.send(out)
            continue
        if item is not PIECE:
            got += item
        item = next(gen, None)
    assert got == want and lean_done
    assert res.metrics.num_drafts == real
