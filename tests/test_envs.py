"""One registry of environment variables (mtpkit/envs.py): nothing else reads the environment,
every variable is documented, and a malformed value is one clear error."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mtpkit import envs
from mtpkit.cli import main

ROOT = Path(__file__).resolve().parent.parent
_READS = re.compile(r"\bos\.environ\b|\bgetenv\b|\benviron\s*\[|\bputenv\b|"
                    r"from\s+os\s+import\s+[^\n]*\benviron\b")


def test_only_envs_reads_the_environment():
    offenders = []
    for f in sorted((ROOT / "mtpkit").rglob("*.py")):
        if f.name == "envs.py" and f.parent.name == "mtpkit":
            continue
        for i, line in enumerate(f.read_text().splitlines(), 1):
            if _READS.search(line):
                offenders.append(f"{f.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not offenders, "read the environment through mtpkit.envs.get:\n" + "\n".join(
        offenders)


def test_every_variable_is_documented():
    text = (ROOT / "docs" / "environment.md").read_text()
    rows = set(re.findall(r"^\| `([A-Z_][A-Z0-9_]*)` \|", text, re.M))
    assert rows == set(envs.VARIABLES), (rows ^ set(envs.VARIABLES))
    for name in ("MTPKIT_CACHE", "MTPKIT_COMPILE_CACHE"):  # explained beyond the table
        assert text.count(name) >= 3, name


def test_defaults_and_typed_values(monkeypatch, tmp_path):
    for name in envs.VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert envs.get("MTPKIT_COMPILE_CACHE_GB") == 10.0
    assert envs.get("WORLD_SIZE") == 1 and envs.get("RANK") == 0
    assert envs.get("MTPKIT_KERNEL_ISA") == "auto" and envs.get("OPENAI_API_KEY") is None
    assert envs.cache_dir() == Path.home() / ".cache" / "mtpkit"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert envs.cache_dir() == tmp_path / "mtpkit"
    monkeypatch.setenv("MTPKIT_CACHE", str(tmp_path / "own"))
    assert envs.cache_dir() == tmp_path / "own"
    monkeypatch.setenv("MTPKIT_COMPILE_CACHE_GB", " 2.5 ")
    monkeypatch.setenv("MTPKIT_INT8_KERNEL", "Library")
    monkeypatch.setenv("WORLD_SIZE", "")  # empty counts as unset
    assert envs.get("MTPKIT_COMPILE_CACHE_GB") == 2.5
    assert envs.get("MTPKIT_INT8_KERNEL") == "library" and envs.get("WORLD_SIZE") == 1


@pytest.mark.parametrize("name,value,accepted", [
    ("MTPKIT_KERNEL_ISA", "sse", "one of auto, avx2"),
    ("MTPKIT_INT8_KERNEL", "fast", "one of mtpkit, library"),
    ("MTPKIT_COMPILE_CACHE_GB", "ten", "a number >= 0"),
    ("MTPKIT_COMPILE_CACHE_GB", "-1", "a number >= 0"),
    ("WORLD_SIZE", "two", "an integer >= 1"),
    ("RANK", "-1", "an integer >= 0"),
])
def test_a_bad_value_names_the_variable_and_what_it_accepts(monkeypatch, name, value,
                                                            accepted):
    monkeypatch.setenv(name, value)
    with pytest.raises(envs.EnvError) as e:
        envs.get(name)
    assert str(e.value) == f"{name} must be {accepted} (or unset), got {value!r}"


def test_a_bad_value_is_one_error_line_from_the_cli(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("MTPKIT_CACHE", str(tmp_path))
    monkeypatch.setenv("MTPKIT_COMPILE_CACHE_GB", "lots")
    assert main(["cache"]) == 2
    cap = capsys.readouterr()
    assert cap.out == ""
    assert cap.err.splitlines() == [
        "error: MTPKIT_COMPILE_CACHE_GB must be a number >= 0 (or unset), got 'lots'"]
