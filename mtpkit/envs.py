"""Every environment variable mtpkit reads, declared once (name, type, default, meaning).

The rest of mtpkit reads the environment only through :func:`get` (tests/test_envs.py checks
it), so a malformed value is one clear error naming the variable and what it accepts, and
docs/environment.md lists the same variables (the test checks that too).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


class EnvError(ValueError):
    """A variable set to a value mtpkit does not accept (the CLI prints it as ``error:``)."""


@dataclass(frozen=True)
class Var:
    """One environment variable: ``kind`` is path, str, int, float or choice."""

    name: str
    kind: str
    default: object
    meaning: str
    choices: tuple[str, ...] = ()
    minimum: float | None = None


VARIABLES: dict[str, Var] = {v.name: v for v in (
    Var("MTPKIT_CACHE", "path", None,
        "folder of mtpkit's cache: the built-in model converted from its GGUF, the built "
        "CPU kernels, compiled programs (default $XDG_CACHE_HOME/mtpkit)"),
    Var("MTPKIT_COMPILE_CACHE", "path", None,
        "folder of the compiled programs `mtpkit warmup` and --compile aoti build (default "
        "$MTPKIT_CACHE/compiled)"),
    Var("MTPKIT_COMPILE_CACHE_GB", "float", 10.0,
        "size in GB the compiled programs are kept under, least recently used removed first "
        "(0: no cap)", minimum=0.0),
    Var("MTPKIT_INT8_KERNEL", "choice", "mtpkit",
        "int8/int4 matrix products: mtpkit's own C++ kernels, or library (torch's, "
        "never built)", choices=("mtpkit", "library")),
    Var("MTPKIT_KERNEL_ISA", "choice", "auto",
        "instruction set mtpkit's kernels are built for: auto (AVX-512 VNNI where the CPU "
        "has it, else AVX2) or avx2", choices=("auto", "avx2")),
    Var("XDG_CACHE_HOME", "path", None,
        "the user's cache folder, used when MTPKIT_CACHE is unset (default ~/.cache)"),
    Var("WORLD_SIZE", "int", 1,
        "processes of a distributed `mtpkit calibrate` (set by torchrun)", minimum=1),
    Var("RANK", "int", 0,
        "this process's rank in a distributed `mtpkit calibrate` (set by torchrun)",
        minimum=0),
    Var("OPENAI_API_KEY", "str", None,
        "bearer token `mtpkit bench serve` sends when --api-key is not given"),
)}


def get(name: str):
    """The typed value of a registered variable (its default when unset or empty)."""
    var = VARIABLES[name]  # a KeyError here is a bug: declare the variable above
    raw = os.environ.get(name, "").strip()
    if not raw:
        return var.default
    if var.kind == "path":
        return Path(raw).expanduser()
    if var.kind == "str":
        return raw
    if var.kind == "choice":
        value = raw.lower()
        if value not in var.choices:
            raise EnvError(f"{name} must be one of {', '.join(var.choices)} (or unset), "
                           f"got {raw!r}")
        return value
    what = "an integer" if var.kind == "int" else "a number"
    try:
        value = int(raw) if var.kind == "int" else float(raw)
    except ValueError:
        raise EnvError(f"{name} must be {what}{_at_least(var)} (or unset), "
                       f"got {raw!r}") from None
    if var.minimum is not None and value < var.minimum:
        raise EnvError(f"{name} must be {what}{_at_least(var)} (or unset), got {raw!r}")
    return value


def _at_least(var: Var) -> str:
    return "" if var.minimum is None else f" >= {var.minimum:g}"


def cache_dir() -> Path:
    """mtpkit's cache folder: $MTPKIT_CACHE, else $XDG_CACHE_HOME/mtpkit or ~/.cache/mtpkit."""
    own = get("MTPKIT_CACHE")
    if own is not None:
        return own
    return (get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mtpkit"
