"""`mtpkit calibrate` and `mtpkit eval` on a tiny trunk with a character tokenizer."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
from safetensors.torch import load_file
from tiny import FAMILIES, write_char_tokenizer, write_checkpoint

from mtpkit.cli import main
from mtpkit.engine.generate import Engine, Result
from mtpkit.engine.loader import load_model
from mtpkit.engine.sampling import SamplingParams
from mtpkit.train.calibrate import CalibrateConfig, init_scratch_head, run
from mtpkit.train.evaluate import teacher_eval


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    trunk = root / "trunk"
    write_checkpoint(FAMILIES[0], trunk, seed=3)
    write_char_tokenizer(trunk)
    data = root / "data"
    data.mkdir()
    # Real text: a few standard-library modules' source.
    import csv
    import json as json_mod
    import textwrap
    for mod in (csv, json_mod, textwrap, inspect, warnings):
        (data / f"{mod.__name__}.py").write_text(inspect.getsource(mod))
    return root, trunk, data


def _cfg(root, trunk, data, name, **kw):
    base = dict(model=str(trunk), data=[str(data)], out=str(root / name), seq_len=64,
                batch_size=4, steps=40, lr=3e-3, warmup_steps=5, heldout_fraction=0.2,
                checkpoint_every=0)
    base.update(kw)
    return CalibrateConfig(**base)


def _quiet_load(*a, **k):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_model(*a, **k)


@pytest.fixture(scope="module")
def trained(setup):
    root, trunk, data = setup
    run(_cfg(root, trunk, data, "head"), progress="off")
    return root / "head"


def test_calibrate_writes_head_with_split_and_improves_acceptance(setup, trained):
    root, trunk, data = setup
    conf = json.loads((trained / "head_config.json").read_text())
    train, held = conf["data"]["train"], conf["data"]["heldout"]
    assert held and train and not set(train) & set(held)
    assert conf["calibration"]["steps_done"] == 40
    assert set(load_file(trained / "mtp_head.safetensors")) >= {"mtp.fc.weight", "mtp.norm.weight"}
    after = _quiet_load(trunk, head=trained)
    before = _quiet_load(trunk, new_head_layers=1)
    init_scratch_head(before.model)
    rep_after = teacher_eval(after.model, after.tokenizer, held, 2, max_tokens=2000, seq_len=64)
    rep_before = teacher_eval(before.model, before.tokenizer, held, 2, max_tokens=2000,
                              seq_len=64)
    assert rep_after.positions > 500
    assert rep_after.per_position[0] > rep_before.per_position[0] + 0.1


def test_trunk_plus_head_is_lossless(setup, trained):
    _, trunk, _ = setup
    loaded = _quiet_load(trunk, head=trained)
    engine = Engine(loaded.model, loaded.tokenizer)
    prompt = loaded.tokenizer.encode("def load(fp):")
    want = list(engine.generate(prompt, SamplingParams(max_tokens=40, ignore_eos=True), 0))
    res = Result()
    got = list(engine.generate(prompt, SamplingParams(max_tokens=40, ignore_eos=True), 3,
                               result=res))
    assert got == want
    assert res.metrics.num_accepted_tokens > 0


def test_resume_continues_exactly(setup):
    root, trunk, data = setup
    run(_cfg(root, trunk, data, "straight", steps=12), progress="off")
    # Interrupted after 6 of 12 steps (token budget), then resumed from its saved state.
    run(_cfg(root, trunk, data, "resumed", steps=12, tokens=6 * 4 * 64, checkpoint_every=3),
        progress="off")
    run(_cfg(root, trunk, data, "resumed", steps=12, resume=True, checkpoint_every=3),
        progress="off")
    a = load_file(root / "straight" / "mtp_head.safetensors")
    b = load_file(root / "resumed" / "mtp_head.safetensors")
    assert json.loads((root / "resumed" / "head_config.json").read_text())[
        "calibration"]["steps_done"] == 12
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-5), k


def test_eval_cli_teacher_and_generate(setup, trained, capsys):
    _, trunk, data = setup
    held = json.loads((trained / "head_config.json").read_text())["data"]["heldout"]
    code = main(["eval", "--model", str(trunk), "--head", str(trained), "--data", *held,
                 "-k", "2", "--json", "--max-tokens", "1000"])
    teacher = json.loads(capsys.readouterr().out)
    assert code == 0 and len(teacher["per_position_acceptance_rate"]) == 2
    assert teacher["per_position_acceptance_rate"][0] > 0
    code = main(["eval", "--model", str(trunk), "--head", str(trained), "--data", *held,
                 "-k", "2", "--json", "--mode", "generate", "--prompts", "2",
                 "--max-tokens", "24"])
    gen = json.loads(capsys.readouterr().out)
    assert code == 0 and gen["identical_to_no_mtp"] is True and gen["num_drafts"] > 0


def test_eval_without_head_is_a_clear_error(setup, capsys):
    _, trunk, data = setup
    assert main(["eval", "--model", str(trunk), "--data", str(data)]) == 2
    assert "has no MTP head" in capsys.readouterr().err


def test_data_parallel_ranks_agree(setup):
    """Two CPU processes under torchrun (gloo) end with identical weights."""
    root, trunk, data = setup
    out = root / "ddp"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           "--master_port=29517", "-m", "mtpkit.cli", "calibrate", "--model", str(trunk),
           "--data", str(data), "--out", str(out), "--steps", "4", "--seq-len", "64",
           "--batch-size", "2", "--checkpoint-every", "0"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cal = json.loads((out / "head_config.json").read_text())["calibration"]
    assert cal["world_size"] == 2
    assert cal["max_weight_diff_between_ranks"] == 0.0
    assert cal["tokens_done"] == 4 * 2 * 2 * 64


def test_draft_vocab_subset_is_lossless(setup, trained):
    """Drafting from a frequent-token subset keeps greedy and seeded sampled output exact."""
    _, trunk, _ = setup
    vocab = json.loads((trained / "draft_vocab.json").read_text())["token_ids"]
    assert len(vocab) > 60
    subset = vocab[:-20]  # a strict subset: the 20 rarest training tokens are left out
    loaded = _quiet_load(trunk, head=trained)
    full = Engine(loaded.model, loaded.tokenizer)
    sub = Engine(loaded.model, loaded.tokenizer, draft_vocab=torch.tensor(subset))
    prompt = loaded.tokenizer.encode("class JSONDecoder(object):")
    greedy = SamplingParams(max_tokens=40, ignore_eos=True)
    want = list(full.generate(prompt, greedy, 0))
    res = Result()
    assert list(sub.generate(prompt, greedy, 3, result=res)) == want
    assert res.metrics.num_accepted_tokens > 0
    # Every drafted token came from the subset.
    drafts = []
    orig = sub.drafter.pick

    def spy(*a):
        token, q = orig(*a)
        drafts.append(token)
        if q is not None:
            assert float(q.sum()) == pytest.approx(1.0, abs=1e-5)
            assert float(q[[t for t in range(q.numel()) if t not in subset]].sum()) == 0
        return token, q

    sub.drafter.pick = spy
    sampled = SamplingParams(max_tokens=30, temperature=0.9, seed=3, ignore_eos=True)
    list(sub.generate(prompt, sampled, 3))
    assert drafts and set(drafts) <= set(subset)


@pytest.mark.parametrize("quantize", [None, "w4a16"])
def test_recalibrating_a_native_head_keeps_the_checkpoint_layout(checkpoint_factory, tmp_path,
                                                                quantize):
    """--init head on a checkpoint with its own head (Qwen3.5 VLM layout, optionally W4A16
    with the head in BF16) writes that checkpoint back with the new head: same tensor names
    and format, a doctor-healthy result, and a head that differs from the old one."""
    import shutil

    from safetensors import safe_open

    from mtpkit.doctor.checks import diagnose

    src = tmp_path / "src"
    shutil.copytree(checkpoint_factory("qwen3_5_vlm"), src)
    write_char_tokenizer(src)
    if quantize:
        assert main(["quantize", "--model", str(src), "--out", str(tmp_path / "q"),
                     "--scheme", quantize, "--group-size", "32"]) == 0
        src = tmp_path / "q"
    data = tmp_path / "data.txt"
    data.write_text(inspect.getsource(inspect) * 2)
    out = tmp_path / "recal"
    run(CalibrateConfig(model=str(src), data=[str(data)], out=str(out), init="head",
                        seq_len=32, batch_size=2, steps=3, heldout_fraction=0.0,
                        checkpoint_every=0), progress="off")

    def names(folder):
        got = {}
        for f in folder.glob("*.safetensors"):
            with safe_open(str(f), framework="pt") as h:
                got.update({k: h.get_tensor(k) for k in h.keys()})
        return got

    before, after = names(src), names(out)
    assert set(before) == set(after)
    mtp = [k for k in after if k.startswith("mtp.")]
    assert mtp and any(not torch.equal(before[k], after[k]) for k in mtp)
    assert all(torch.equal(before[k], after[k]) for k in after if not k.startswith("mtp."))
    cfg_in = json.loads((src / "config.json").read_text())
    cfg_out = json.loads((out / "config.json").read_text())
    assert cfg_out.get("quantization_config", {}).get("format") == cfg_in.get(
        "quantization_config", {}).get("format")
    assert diagnose(out).exit_code == 0
    loaded = _quiet_load(out, tokenizer=False)
    assert loaded.model.mtp is not None
