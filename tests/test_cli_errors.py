"""Every command of `mtpkit --help` fed bad input: a missing path, a folder that is not a
checkpoint, text files named .gguf / .safetensors, pickle files (refused, never unpickled), an
unknown model family, and bad option values. Each must exit 2 with exactly one ``error:`` line
on stderr (no traceback), leave its inputs byte for byte as they were and write nothing."""

from __future__ import annotations

import argparse
import hashlib
import json
import pickle
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from mtpkit.cli import build_parser, main


class _Unpickled:
    """Unpickling this touches a marker file: the proof that something ran pickle.load."""

    marker: Path

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.fixture(scope="module")
def bad(tmp_path_factory) -> Path:
    """A folder of bad inputs (see the module docstring)."""
    root = tmp_path_factory.mktemp("bad-inputs")
    evil = _Unpickled()
    evil.marker = root / "UNPICKLED"
    payload = pickle.dumps(evil)
    (root / "empty").mkdir()
    (root / "notes").mkdir()
    (root / "notes" / "readme.txt").write_text("not a checkpoint\n")
    (root / "fake.gguf").write_text("a text file named .gguf\n")
    (root / "fake.safetensors").write_text("a text file named .safetensors\n")
    (root / "model.pt").write_bytes(payload)
    (root / "model.bin").write_bytes(payload)
    pickled = root / "pickled"  # an HF folder whose weights are pickle only
    pickled.mkdir()
    (pickled / "config.json").write_text(json.dumps(
        {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
         "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "vocab_size": 96}))
    (pickled / "pytorch_model.bin").write_bytes(payload)
    unknown = root / "nonesuch"
    unknown.mkdir()
    (unknown / "config.json").write_text(json.dumps({"model_type": "nonesuch",
                                                     "hidden_size": 64}))
    save_file({"model.embed_tokens.weight": torch.zeros(96, 64)},
              str(unknown / "model.safetensors"))
    (root / "data.txt").write_text("def f(x):\n    return x + 1\n" * 40)
    return root


BAD_MODELS = {
    "missing": "nope",
    "empty-folder": "empty",
    "not-a-checkpoint": "notes",
    "text-as-gguf": "fake.gguf",
    "text-as-safetensors": "fake.safetensors",
    "pickle-pt": "model.pt",
    "pickle-bin": "model.bin",
    "pickle-folder": "pickled",
    "unknown-family": "nonesuch",
}

# Command -> argv taking a model path M (OUT: an output path that must not appear).
MODEL_COMMANDS = {
    "generate": ["generate", "hi", "--model", "M", "--max-tokens", "2"],
    "warmup": ["warmup", "--model", "M"],
    "calibrate": ["calibrate", "--model", "M", "--data", "DATA", "--out", "OUT", "--steps", "1"],
    "export-head": ["export-head", "--model", "M", "--out", "OUT"],
    "distill-data": ["distill-data", "--model", "M", "--out", "OUT", "--prompts", "2",
                     "--max-tokens", "2"],
    "eval": ["eval", "--model", "M", "--data", "DATA"],
    "quantize": ["quantize", "--model", "M", "--out", "OUT"],
    "doctor": ["doctor", "M"],
    "graft": ["graft", "--from", "M", "--into", "M", "--out", "OUT"],
    "fix-config": ["fix-config", "M", "--out", "OUT"],
    "bench offline": ["bench", "offline", "--model", "M", "--out", "OUT"],
    "bench steps": ["bench", "steps", "--model", "M"],
    "bench compare": ["bench", "compare", "--model", "M", "--out", "OUT"],
    "bench contention": ["bench", "contention", "--model", "M", "--out", "OUT"],
}
# doctor and fix-config diagnose and repair the configs of families mtpkit cannot run (vLLM
# and SGLang serve more): an unknown model_type is a finding there, not a usage error.
DIAGNOSES_UNKNOWN = {"doctor", "fix-config"}

# Bad option values, on the valid tiny checkpoint MODEL (each refused before any work).
BAD_FLAGS = [
    ["distill-data", "--model", "MODEL", "--out", "OUT", "--sampled", "2"],
    ["distill-data", "--model", "MODEL", "--out", "OUT", "--prompts", "-1"],
    ["distill-data", "--model", "MODEL", "--out", "OUT", "--prompts", "0"],
    ["distill-data", "--model", "MODEL", "--out", "OUT", "--shards", "0"],
    ["distill-data", "--model", "MODEL", "--out", "OUT", "--sampled", "0.5", "--temperature",
     "0"],
    ["distill-data", "--model", "MODEL", "--out", "MODEL", "--prompts", "1"],  # not its folder
    ["generate", "hi", "--model", "MODEL", "-k", "-1"],
    ["generate", "hi", "--model", "MODEL", "-k", "two"],
    ["generate", "hi", "--model", "MODEL", "--max-tokens", "-3"],
    ["generate", "hi", "--model", "MODEL", "--threads", "0"],
    ["generate", "hi", "--model", "MODEL", "--compile", "fast"],
    ["generate", "hi", "--model", "MODEL", "--head", "BAD/model.pt"],
    ["generate", "hi", "--model", "MODEL", "--head", "BAD/fake.safetensors"],
    ["generate", "hi", "--model", "MODEL", "--head", "BAD/empty"],
    ["generate", "--model", "MODEL"],
    ["warmup", "--model", "MODEL", "-k", "-1"],
    ["calibrate", "--model", "MODEL", "--data", "DATA", "--out", "OUT", "--steps", "-1"],
    ["calibrate", "--model", "MODEL", "--data", "DATA", "--out", "OUT", "--draft-depth", "0"],
    ["calibrate", "--model", "MODEL", "--data", "DATA", "--out", "OUT", "--batch-size", "0"],
    ["calibrate", "--model", "MODEL", "--data", "DATA", "--out", "OUT", "--seq-len", "-5"],
    ["calibrate", "--model", "MODEL", "--data", "DATA", "--out", "OUT", "--lr", "-1"],
    ["calibrate", "--model", "MODEL", "--data", "BAD/nope.txt", "--out", "OUT"],
    ["calibrate", "--model", "MODEL", "--data", "DATA", "--out", "MODEL", "--steps", "1"],
    ["calibrate", "--model", "MODEL", "--data", "DATA", "--out", "OUT", "--init", "other"],
    ["export-head", "--model", "MODEL", "--out", "MODEL"],
    ["export-head", "--model", "MODEL", "--out", "OUT", "--format", "eagle"],
    ["export-head", "--model", "MODEL", "--out", "OUT", "--dtype", "int3"],
    ["eval", "--model", "MODEL", "--data", "DATA", "-k", "-1"],
    ["eval", "--model", "MODEL", "--data", "BAD/nope.txt"],
    ["eval", "--model", "MODEL", "--data", "DATA", "--mode", "fast"],
    ["quantize", "--model", "MODEL", "--out", "OUT", "--scheme", "w3a16"],
    ["quantize", "--model", "MODEL", "--out", "OUT", "--group-size", "48"],
    ["quantize", "--model", "MODEL", "--out", "OUT", "--group-size", "-1"],
    ["quantize", "--model", "MODEL", "--out", "OUT", "--scheme", "w8a8", "--smooth", "x"],
    ["quantize", "--model", "MODEL", "--out", "OUT", "--method", "gptq"],
    ["quantize", "--model", "MODEL", "--out", "MODEL"],
    ["quantize", "--model", "MODEL", "--out", "OUT.gguf", "--format", "gguf",
     "--gguf-type", "Q3"],
    ["doctor", "MODEL", "--engine", "nonesuch"],
    ["doctor", "MODEL", "--reference", "MODEL"],
    ["graft", "--into", "MODEL", "--out", "OUT"],
    ["graft", "--from", "MODEL", "--into", "MODEL", "--out", "MODEL"],
    ["fix-config", "MODEL", "--out", "MODEL"],
    ["serve", "--model", "BAD/nope"],
    ["serve", "--model", "MODEL", "-k", "-1"],
    ["serve", "--model", "MODEL", "--port", "70000"],
    ["serve", "--model", "MODEL", "--max-num-seqs", "0"],
    ["serve", "--model", "MODEL", "--compile", "fast"],
    ["bench", "offline", "--model", "MODEL", "--out", "OUT", "--k", "-1"],
    ["bench", "offline", "--model", "MODEL", "--out", "OUT", "--max-tokens", "0"],
    ["bench", "offline", "--model", "MODEL", "--out", "OUT", "--prompts", "BAD/nope.jsonl"],
    ["bench", "steps", "--model", "MODEL", "--k", "-1"],
    ["bench", "steps", "--model", "MODEL", "--backends", "fast"],
    ["bench", "serve"],
    ["bench", "serve", "--url", "http://127.0.0.1:9", "--concurrency", "-1"],
    ["bench", "serve", "--url", "http://127.0.0.1:9", "--num-prompts", "0"],
    ["bench", "serve", "--url", "http://127.0.0.1:9", "--dataset", "BAD/nope.jsonl"],
    ["bench", "compare", "--model", "MODEL", "--out", "OUT", "--k", "-1"],
    ["bench", "compare", "--model", "MODEL", "--out", "OUT", "--skip", "vllm"],
    ["bench", "compare", "--model", "MODEL", "--out", "OUT", "--gguf", "BAD/nope.gguf"],
    ["bench", "contention", "--model", "MODEL", "--out", "OUT", "--k", "-1"],
    ["bench", "contention", "--model", "MODEL", "--out", "OUT", "--compile", "fast"],
    ["bench", "contention", "--model", "MODEL", "--out", "OUT", "--rounds", "0"],
    ["bench", "nonesuch"],
    ["cache", "clear", "--older-than", "-1"],
    ["cache", "purge"],
    ["nonesuch"],
    [],
]


@pytest.fixture(scope="module")
def model(model_dir, tmp_path_factory) -> Path:
    """A copy of the tiny text checkpoint: a command that wrote over its input would break
    only this module's cases."""
    out = tmp_path_factory.mktemp("valid") / "m"
    shutil.copytree(model_dir, out)
    return out


def _digest(*roots: Path) -> dict[str, str]:
    found = {}
    for root in roots:
        for f in sorted(root.rglob("*")) if root.is_dir() else [root]:
            if f.is_file():
                found[str(f)] = hashlib.sha256(f.read_bytes()).hexdigest()
    return found


@pytest.fixture
def no_server(monkeypatch):
    """`mtpkit serve` checks its arguments, then would start a server: make that a failure."""
    import mtpkit.serve.app as app

    def refuse(cfg):
        raise AssertionError("the server would have started")

    monkeypatch.setattr(app, "run", refuse)


def _expect_one_error(capsys, argv, watched, out: Path, code: int = 2) -> str:
    before = _digest(*watched)
    got = main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert got == code and len(errors) == 1, (argv, got, err)
    assert _digest(*watched) == before, "an input changed"
    assert not out.exists() and not out.with_suffix(".gguf").exists(), "output written"
    return errors[0]


def _argv(template, model, bad, tmp_path) -> list[str]:
    subst = {"M": str(model), "MODEL": str(model), "DATA": str(bad / "data.txt"),
             "OUT": str(tmp_path / "out"), "OUT.gguf": str(tmp_path / "out.gguf")}
    return [subst.get(a, a.replace("BAD/", f"{bad}/")) for a in template]


@pytest.mark.parametrize("command", list(MODEL_COMMANDS))
@pytest.mark.parametrize("kind", list(BAD_MODELS))
def test_bad_checkpoint_is_one_error_line(bad, tmp_path, capsys, no_server, command, kind):
    model = bad / BAD_MODELS[kind]
    argv = _argv(MODEL_COMMANDS[command], model, bad, tmp_path)
    if kind == "unknown-family" and command in DIAGNOSES_UNKNOWN:
        before = _digest(bad)
        assert main([*argv, "--json"]) in (0, 1)
        cap = capsys.readouterr()
        assert "Traceback" not in cap.err and "unknown-model-type" in cap.out
        assert _digest(bad) == before
        return
    line = _expect_one_error(capsys, argv, [bad], tmp_path / "out")
    assert not (bad / "UNPICKLED").exists(), "a pickle file was unpickled"
    if kind.startswith("pickle") and command not in ("bench compare",):
        assert "pickle" in line or "not a checkpoint folder" in line, line


@pytest.mark.parametrize("template", BAD_FLAGS, ids=lambda t: " ".join(t)[:60] or "none")
def test_bad_option_value_is_one_error_line(model, bad, tmp_path, capsys, no_server, template):
    argv = _argv(template, model, bad, tmp_path)
    _expect_one_error(capsys, argv, [model, bad], tmp_path / "out")
    assert not (bad / "UNPICKLED").exists(), "a pickle file was unpickled"


def _subcommands(parser: argparse.ArgumentParser) -> dict:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices


def test_every_command_is_walked():
    """The cases above cover every command and bench subcommand `mtpkit --help` lists."""
    commands = _subcommands(build_parser())
    walked = {t[0] for t in BAD_FLAGS if t} | {c.split()[0] for c in MODEL_COMMANDS}
    assert set(commands) <= walked, set(commands) - walked
    bench = {t[1] for t in BAD_FLAGS if t[:1] == ["bench"]}
    assert set(_subcommands(commands["bench"])) <= bench


@pytest.mark.parametrize("argv, module", [
    (["bench", "compare", "--out", "OUT"], "matplotlib"),
    (["bench", "offline", "--out", "OUT"], "matplotlib"),
    (["bench", "serve", "--url", "http://127.0.0.1:9"], "aiohttp"),
])
def test_missing_bench_extra_is_refused_before_any_work(bad, tmp_path, capsys, monkeypatch,
                                                        argv, module):
    """Without the bench extra, the commands that need it say so and stop before loading a
    model or sending a request (they used to run every engine, then fail at the plot)."""
    from mtpkit.engine.session import Session

    def no_work(*a, **k):
        raise AssertionError("work started before the extra was checked")

    monkeypatch.setitem(sys.modules, module, None)  # what find_spec sees when not installed
    monkeypatch.setattr(Session, "load", no_work)
    monkeypatch.setattr("mtpkit.bench.cli.compare_report", no_work)
    monkeypatch.setattr("mtpkit.bench.serve.ServeBench.run", no_work)
    line = _expect_one_error(capsys, _argv(argv, None, bad, tmp_path), [bad], tmp_path / "out")
    assert line == (f"error: mtpkit {argv[0]} {argv[1]} needs {module}, which is not "
                    'installed: pip install "mtpkit[bench]"')


def test_whole_checkpoint_as_head_says_to_pass_it_as_model(model, tmp_path, capsys, no_server):
    """`calibrate --init head` on a checkpoint with its own head writes a whole checkpoint;
    given as --head, it is refused with the flag that takes it."""
    line = _expect_one_error(capsys, ["generate", "hi", "--model", str(model), "--head",
                                      str(model)], [model], tmp_path / "out")
    assert "is a whole checkpoint" in line and f"--model {model}" in line, line
