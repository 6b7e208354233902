"""The `mtpkit generate` command on a tiny checkpoint with a character tokenizer."""

from __future__ import annotations

import json
import statistics

import pytest

from mtpkit.cli import main


def _run(capsys, *args):
    code = main(list(args))
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def test_generate_streams_same_text_with_and_without_mtp(model_dir, capsys):
    code, plain, err0 = _run(capsys, "generate", "def f(x):", "--model", str(model_dir),
                             "--no-mtp", "--max-tokens", "24")
    assert code == 0 and "SpecDecoding" not in err0
    code, spec, err = _run(capsys, "generate", "def f(x):", "--model", str(model_dir),
                           "-k", "3", "--max-tokens", "24")
    assert code == 0
    assert spec == plain and len(plain.strip()) > 0
    assert "SpecDecoding metrics: Mean acceptance length:" in err
    assert "tok/s" in err


def test_generate_json_and_compare(model_dir, capsys):
    code, out, _ = _run(capsys, "generate", "abc", "--model", str(model_dir), "--json",
                        "--max-tokens", "16", "--compare", "--chat", "--ignore-eos")
    assert code == 0
    report = json.loads(out)
    assert report["identical_to_baseline"] is True
    m = report["metrics"]
    assert m["generated_tokens"] == 16 and m["num_drafts"] > 0
    assert m["num_draft_tokens"] >= m["num_accepted_tokens"] >= 0
    assert len(m["per_position_acceptance_rate"]) == 1  # the default k


@pytest.mark.parametrize("others,warned", [(0.0, False), (1.0, True)])
def test_generate_compare_warns_when_the_cpu_is_busy(model_dir, capsys, monkeypatch, others,
                                                     warned):
    """A speed-up measured beside other work says so: the CPU time other processes took
    while the runs were timed decides (here a clock where they take ``others`` CPUs)."""
    import json

    from mtpkit import threads

    clock = [0.0]

    def tick():
        clock[0] += 0.01
        return clock[0]

    monkeypatch.setattr(threads.time, "perf_counter", tick)
    monkeypatch.setattr(threads, "_self_busy_s", lambda: 2 * clock[0])
    monkeypatch.setattr(threads, "_system_busy_s", lambda: (2 + others) * clock[0])
    code, out, err = _run(capsys, "generate", "abc", "--model", str(model_dir), "--max-tokens",
                          "8", "--compare", "--json", "--threads", "1")
    report = json.loads(out)
    assert code == 0 and report["other_programs_cpus"] == pytest.approx(others)
    assert (report["busy_cpu_warning"] is not None) == warned
    if warned:
        assert "kept 1.0 CPUs busy" in report["busy_cpu_warning"]


def test_generate_compiled_path_matches_eager(model_dir, capsys):
    """--compile (eager programs here: CI time) gives the text of the eager engine."""
    _, want, _ = _run(capsys, "generate", "def f(x):", "--model", str(model_dir), "--json",
                      "--max-tokens", "24", "--ignore-eos", "--compile", "off")
    code, out, err = _run(capsys, "generate", "def f(x):", "--model", str(model_dir), "--json",
                          "--max-tokens", "24", "--ignore-eos", "--compile", "eager",
                          "--compare", "--draft-p-min", "0.3")
    assert code == 0 and "compiled programs:" in err
    got, ref = json.loads(out), json.loads(want)
    assert got["text"] == ref["text"] and got["identical_to_baseline"] is True
    assert got["metrics"]["generated_tokens"] == 24


def test_generate_says_when_it_runs_uncompiled(model_dir, capsys, tmp_path, monkeypatch):
    """The default (--compile auto) with no built programs decodes uncompiled, and says
    so with the command that fixes it (the same model and draft length); --compile eager
    (asked for) does not."""
    monkeypatch.setenv("MTPKIT_COMPILE_CACHE", str(tmp_path))
    code, _, err = _run(capsys, "generate", "def f(x):", "--model", str(model_dir),
                        "--max-tokens", "4")
    assert code == 0 and "uncompiled" in err
    assert f"`mtpkit warmup --model {model_dir}` compiles it" in err
    code, _, err = _run(capsys, "generate", "def f(x):", "--model", str(model_dir),
                        "--max-tokens", "4", "-k", "3")
    assert code == 0 and f"`mtpkit warmup --model {model_dir} -k 3` compiles it" in err
    code, _, err = _run(capsys, "generate", "def f(x):", "--model", str(model_dir),
                        "--max-tokens", "4", "--compile", "eager")
    assert code == 0 and "mtpkit warmup" not in err


@pytest.mark.parametrize("ks,want", [("1", [1, 0]), ("2,1,2", [2, 1, 0]), ("0", [0])])
def test_warmup_builds_every_draft_length_asked_and_none(model_dir, capsys, monkeypatch, ks,
                                                         want):
    """`mtpkit warmup -k 1,2` builds the programs of every draft length given, and those of
    decoding without MTP and of batched steps (serve) once."""
    from mtpkit.engine.fast import FastDecoder

    built = []
    monkeypatch.setattr(FastDecoder, "warmup", lambda self, k: built.append(k) or 0.0)
    monkeypatch.setattr(FastDecoder, "warmup_pooled", lambda self: built.append("pool") or 0.0)
    code, _, err = _run(capsys, "warmup", "--model", str(model_dir), "-k", ks)
    assert code == 0 and "compiled programs for" in err
    assert built == [*want, "pool"]


def test_bench_steps_table(model_dir, capsys):
    """`mtpkit bench steps` times every program in turns and relates it to the decode step
    (and the decode step to the bandwidth) within each turn."""
    code, out, _ = _run(capsys, "bench", "steps", "--model", str(model_dir), "--backends",
                        "eager", "--k", "2", "--context", "20", "--repeats", "3", "--turns",
                        "3", "--json")
    assert code == 0
    rep = json.loads(out)
    (row,) = rep["rows"]
    assert row["backend"] == "eager" and rep["k"] == 2 and rep["turns"] == 3
    assert len(row["turns"]) == 3
    for key in ("decode", "verify", "draft", "round"):
        per_turn = [t[key] for t in row["turns"]]
        assert min(per_turn) > 0 and row[f"{key}_ms"] == pytest.approx(statistics.median(per_turn))
    for key in ("verify", "draft", "round"):
        ratios = sorted(t[key] / t["decode"] for t in row["turns"])
        got = row[f"{key}_over_decode"]
        assert (got["min"], got["median"], got["max"]) == pytest.approx(
            (ratios[0], ratios[1], ratios[2]))
    trunk = rep["trunk_bytes"]
    bounds = sorted(t["decode"] / (1000 * trunk / (t["bandwidth_gbs"] * 1e9))
                    for t in row["turns"])
    assert row["decode_over_bound"]["median"] == pytest.approx(bounds[1])
    assert rep["decode_bound_ms"] > 0 and rep["bandwidth_gbs"] > 0
    code, out, _ = _run(capsys, "bench", "steps", "--model", str(model_dir), "--backends",
                        "eager", "--k", "1", "--context", "8", "--repeats", "1", "--turns", "2")
    assert code == 0 and "medians over 2 turns of 1 calls" in out and "eager: v/d " in out
    code, _, err = _run(capsys, "bench", "steps", "--model", str(model_dir), "--backends",
                        "fast")
    assert code == 2 and "--backends 'fast'" in err
    code, _, err = _run(capsys, "bench", "steps", "--model", str(model_dir), "--turns", "0")
    assert code == 2 and "--turns" in err


def test_stop_string_ends_output(model_dir, capsys):
    _, full, _ = _run(capsys, "generate", "xyz", "--model", str(model_dir), "--json",
                      "--max-tokens", "24", "--no-mtp")
    text = json.loads(full)["text"]
    stop = text[6:8]
    _, out, _ = _run(capsys, "generate", "xyz", "--model", str(model_dir), "--json",
                     "--max-tokens", "24", "--stop", stop)
    got = json.loads(out)
    assert got["text"] == text[: text.index(stop)] and got["finish_reason"] == "stop"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--temperature", "-1"], "temperature must be >= 0"),
        (["--top-p", "0"], "top_p must be in (0, 1]"),
        (["--top-k", "-2"], "top_k must be >= 0"),
        (["--max-tokens", "0"], "max_tokens must be >= 1"),
        (["-k", "-1"], "--num-draft-tokens must be >= 0"),
        (["--max-tokens", "100000"], "exceeds the model's context"),
        (["--device", "cuda"], "no CUDA device"),
        (["--dtype", "int3"], "--dtype 'int3' is not one of"),
        (["--draft-p-min", "0.5", "--compile", "off"], "--draft-p-min needs the fast path"),
        (["--draft-p-min", "1.5"], "--draft-p-min must be in [0, 1)"),
        (["--compile", "eager", "--draft-p-min", "1.5"], "--draft-p-min must be in [0, 1)"),
        (["--draft-vocab-size", "8"], "--draft-vocab-size needs a head with a draft vocab"),
    ],
)
def test_bad_arguments_give_one_clear_line(model_dir, capsys, args, message):
    code, _, err = _run(capsys, "generate", "hi", "--model", str(model_dir), *args)
    assert code == 2
    assert message in err and "Traceback" not in err


def test_missing_model_is_a_clear_error(tmp_path, capsys):
    code, _, err = _run(capsys, "generate", "hi", "--model", str(tmp_path / "nope"))
    assert code == 2 and "no such checkpoint" in err


def test_cache_lists_and_clears_only_what_it_is_asked_to(tmp_path, monkeypatch, capsys):
    """`mtpkit cache` lists programs and converted models; `clear` removes the chosen ones."""
    import os
    import time

    root, compiled = tmp_path / "cache", tmp_path / "cache" / "compiled"
    monkeypatch.setenv("MTPKIT_CACHE", str(root))
    monkeypatch.setenv("MTPKIT_COMPILE_CACHE", str(compiled))
    compiled.mkdir(parents=True)
    old, new = compiled / "round-old.pt2", compiled / "decode-new.pt2"
    old.write_bytes(b"x" * 3000)
    new.write_bytes(b"x" * 5000)
    week_ago = time.time() - 7 * 86400
    os.utime(old, (week_ago, week_ago))
    model = root / "smollm2-135m-instruct-q4_1-1"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"y" * 1000)
    keep = root / "notes.txt"  # not ours to delete
    keep.write_text("user file")

    code, out, _ = _run(capsys, "cache")
    assert code == 0 and "3 entries" in out
    code, out, _ = _run(capsys, "cache", "clear", "--older-than", "1")
    assert code == 0 and "removed 1 entries" in out
    assert not old.exists() and new.exists() and model.exists()
    code, out, _ = _run(capsys, "cache", "clear", "--what", "all")
    assert code == 0 and "removed 2 entries" in out
    assert not new.exists() and not model.exists() and keep.read_text() == "user file"
    code, _, err = _run(capsys, "cache", "clear", "--older-than", "-1")
    assert code == 2 and "--older-than must be >= 0" in err


def test_compiled_cache_cap_prunes_least_recently_used(tmp_path, monkeypatch, capsys):
    """Past MTPKIT_COMPILE_CACHE_GB the programs unused the longest go, never those in use;
    a malformed cap is a clear error."""
    import os

    from mtpkit.cachecmd import compiled_cap_bytes, prune_compiled

    compiled = tmp_path / "compiled"
    monkeypatch.setenv("MTPKIT_CACHE", str(tmp_path))
    monkeypatch.setenv("MTPKIT_COMPILE_CACHE", str(compiled))
    compiled.mkdir()
    files = []
    for i, name in enumerate(["a", "b", "c", "d"]):  # a used longest ago, d most recently
        f = compiled / f"decode-{name}.pt2"
        f.write_bytes(b"x" * 1000)
        os.utime(f, (1000 + i, 1000 + i))
        files.append(f)
    monkeypatch.setenv("MTPKIT_COMPILE_CACHE_GB", str(2500 / 1e9))
    assert compiled_cap_bytes() == 2500
    gone = prune_compiled(compiled, compiled_cap_bytes(), keep={files[0]})
    # a is in use, so b and c go; a and d (1000 + 1000 <= 2500) stay.
    assert [e.path.name for e in gone] == ["decode-b.pt2", "decode-c.pt2"]
    assert [f.exists() for f in files] == [True, False, False, True]
    assert "removed 2 compiled programs" in capsys.readouterr().err
    monkeypatch.setenv("MTPKIT_COMPILE_CACHE_GB", "0")
    assert compiled_cap_bytes() is None and prune_compiled(compiled, None, set()) == []
    monkeypatch.setenv("MTPKIT_COMPILE_CACHE_GB", "ten")
    code, _, err = _run(capsys, "cache")
    assert code == 2 and "MTPKIT_COMPILE_CACHE_GB must be a number" in err
