"""The engine, the fast path, quantized trunks and calibration on a CUDA device.

Skipped where torch sees no GPU (CI has none); run on a lent GPU with
``python -m pytest tests/test_cuda.py``. Every check compares against a reference that runs
beside it: the same model on the CPU, or the same engine without speculation.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from tiny import FAMILY_IDS, VOCAB

from mtpkit.engine.fast import FastDecoder
from mtpkit.engine.generate import Engine, Result
from mtpkit.engine.loader import load_model
from mtpkit.engine.program_cache import dynamo_graphs
from mtpkit.engine.sampling import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPTS = [[3, 17, 42, 8], [60, 61, 62, 63, 64, 65, 66, 67, 68], [5], [90, 1, 90, 1, 90, 1, 33]]


def _load(path, device):
    # float32 on both sides: load_model's CUDA default is bfloat16, whose rounding alone
    # moves tiny-model logits by 0.03-2.0 and would hide a real kernel difference.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_model(path, device=device, dtype="float32", tokenizer=False).model


def _greedy(engine, prompt, k, max_tokens=24):
    res = Result()
    toks = list(engine.generate(prompt, SamplingParams(max_tokens=max_tokens), k, result=res,
                                eos_ids=set()))
    return toks, res


def _lossless(engine) -> tuple[int, int]:
    """Greedy output at k = 1..4 equals k = 0 (twice, so nothing leaks); (drafted, accepted)."""
    drafted = accepted = 0
    for prompt in PROMPTS:
        want, _ = _greedy(engine, prompt, 0)
        for k in range(1, 5):
            got, res = _greedy(engine, prompt, k)
            assert got == want, f"k={k} prompt={prompt}"
            assert _greedy(engine, prompt, k)[0] == want
            drafted += res.metrics.num_draft_tokens
            accepted += res.metrics.num_accepted_tokens
    return drafted, accepted


@pytest.mark.parametrize("name", FAMILY_IDS)
def test_cuda_matches_cpu_and_mtp_is_lossless(name, checkpoint_factory):
    """Logits on the GPU equal the CPU's within fp32 noise; greedy MTP equals no MTP there."""
    path = checkpoint_factory(name)
    cpu, gpu = _load(path, "cpu"), _load(path, "cuda")
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = cpu.logits(cpu(ids).hidden)
        got = gpu.logits(gpu(ids.cuda()).hidden).cpu()
    assert (want - got).abs().max() < 1e-3
    drafted, accepted = _lossless(Engine(gpu))
    assert drafted > 0 and accepted > 0, "speculation never happened or never succeeded"


@pytest.mark.parametrize("scheme,group", [("w8a16", None), ("w4a16", 32)])
def test_quantized_trunks_on_cuda(scheme, group, checkpoint_factory, tmp_path):
    """int8/int4 checkpoints load on the GPU with the CPU's logits and decode losslessly."""
    from mtpkit.quant.pack import Scheme
    from mtpkit.quant.quantize import quantize_checkpoint

    out = tmp_path / "m"
    quantize_checkpoint(checkpoint_factory("llama"), out, Scheme(scheme, group, True),
                        mtp="same")
    cpu, gpu = _load(out, "cpu"), _load(out, "cuda")
    # The CPU's packed int kernels take bf16 activations; CUDA multiplies by the dequantized
    # fp32 weight. The reference is the CPU on that same fp32 path (no kernel rows).
    from mtpkit.quant.linear import QuantLinear

    for m in cpu.modules():
        if isinstance(m, QuantLinear):
            m.max_kernel_rows = 0
    ids = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        want = cpu.logits(cpu(ids).hidden)
        got = gpu.logits(gpu(ids.cuda()).hidden).cpu()
    assert (want - got).abs().max() < 1e-3
    _lossless(Engine(gpu))


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_fast_path_on_cuda(backend, checkpoint_factory):
    """The fixed-shape decoder (eager and compiled) gives the eager engine's tokens on CUDA,
    and once warmed up never compiles again."""
    engine = Engine(_load(checkpoint_factory("llama"), "cuda"))
    dec = FastDecoder(engine.model, backend=backend, mode="default", max_len=128)
    for k in (0, 1, 3):
        dec.warmup(k)
    before = dynamo_graphs()
    for prompt in PROMPTS:
        want, _ = _greedy(engine, prompt, 0)
        for k in (0, 1, 3):
            got = list(dec.generate(prompt, 24, k, result=Result(), eos_ids=set()))
            assert got == want, f"k={k} prompt={prompt}"
    assert dynamo_graphs() == before, "a program compiled again during generation"


def test_bf16_compiled_programs_stay_exact_on_cuda(checkpoint_factory):
    """bf16 (the CUDA default) through inductor: greedy MTP output equals the same
    programs' output without MTP (inductor's fused kernels rounding bf16 only at their
    edges, which differ between programs, once broke this on SmolLM2)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = load_model(checkpoint_factory("llama"), device="cuda", dtype="bfloat16",
                           tokenizer=False).model
    dec = FastDecoder(model, backend="inductor", mode="max-autotune", max_len=128)
    for prompt in PROMPTS:
        want = list(dec.generate(prompt, 24, 0, result=Result(), eos_ids=set()))
        for k in (1, 3):
            got = list(dec.generate(prompt, 24, k, result=Result(), eos_ids=set()))
            assert got == want, f"k={k} prompt={prompt}"


def test_calibrate_on_cuda_follows_the_cpu(checkpoint_factory, tmp_path):
    """A few calibration steps on the GPU move the head as the same steps on the CPU do."""
    import inspect
    import json

    from safetensors.torch import load_file
    from tiny import FAMILIES, write_char_tokenizer, write_checkpoint

    from mtpkit.train.calibrate import CalibrateConfig, run

    trunk, data = tmp_path / "trunk", tmp_path / "data"
    write_checkpoint(FAMILIES[0], trunk, seed=3)
    write_char_tokenizer(trunk)
    data.mkdir()
    (data / "json.py").write_text(inspect.getsource(json))
    heads = {}
    for device in ("cpu", "cuda"):
        run(CalibrateConfig(model=str(trunk), data=[str(data)], out=str(tmp_path / device),
                            seq_len=64, batch_size=4, steps=6, lr=1e-3, warmup_steps=1,
                            heldout_fraction=0.0, checkpoint_every=0, draft_depth=2,
                            device=device), progress="off")
        heads[device] = load_file(str(tmp_path / device / "mtp_head.safetensors"))
        summary = json.loads((tmp_path / device / "head_config.json").read_text())
        assert summary["calibration"]["device"] == device
    init = _load(trunk, "cpu")
    moved = gap = 0.0
    for name, w in heads["cpu"].items():
        gap += (w - heads["cuda"][name]).abs().mean().item()
        start = _start_weight(init, name)
        if start is not None:
            moved += (w - start).abs().mean().item()
    assert moved > 0, "the CPU run did not train"
    assert gap < 0.1 * moved, f"GPU head drifted from the CPU head ({gap:.2e} vs {moved:.2e})"


def _start_weight(model, name: str):
    """The scratch head starts from the trunk's last layer: that layer's tensor for ``name``."""
    import re

    m = re.match(r"mtp\.layers\.0\.(.+)", name)
    if m is None:
        return None
    last = model.model.layers[-1]
    try:
        return last.get_parameter(m.group(1)).detach()
    except AttributeError:
        return None
