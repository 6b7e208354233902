"""`mtpkit cache`: what mtpkit keeps in the user's cache, and clearing it.

Compiled programs embed their model's weights (300-800 MB each for SmolLM2) and are keyed by
model, shapes, draft length, thread count, torch version and mtpkit's source, so every new
head, trunk or upgrade adds a set. Building one prunes the programs used least recently
beyond a cap (``MTPKIT_COMPILE_CACHE_GB``, default 10); ``clear`` removes them at will.
"""

from __future__ import annotations

import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Entry:
    """One cached item: a compiled program file or a converted model folder."""

    kind: str  # "compiled" or "model"
    path: Path
    bytes: int
    mtime: float


def _folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _programs(folder: Path) -> list[Entry]:
    found = []
    if folder.is_dir():
        for f in folder.glob("*.pt2"):
            if f.is_file():
                st = f.stat()
                found.append(Entry("compiled", f, st.st_size, st.st_mtime))
    return found


def entries() -> list[Entry]:
    """Every compiled program and converted model in the caches, least recently used first
    (a program's mtime is its last load, a model's its conversion)."""
    from .builtin import cache_dir
    from .engine.program_cache import default_cache_dir

    found = _programs(default_cache_dir())
    models = cache_dir()
    if models.is_dir():
        for d in models.iterdir():
            # Converted models are the folders with a config.json (the compiled dir has none).
            if (d / "config.json").is_file():
                found.append(Entry("model", d, _folder_bytes(d),
                                   (d / "config.json").stat().st_mtime))
    return sorted(found, key=lambda e: e.mtime)


def compiled_cap_bytes() -> int | None:
    """The size compiled programs are kept under: $MTPKIT_COMPILE_CACHE_GB (0: no cap)."""
    from .envs import get

    gb = get("MTPKIT_COMPILE_CACHE_GB")
    return None if gb <= 0 else int(gb * 1e9)


def prune_compiled(folder: Path, cap: int | None, keep: set[Path]) -> list[Entry]:
    """Remove the compiled programs in ``folder`` used least recently until the rest fit in
    ``cap`` bytes; programs in ``keep`` (those this process uses) stay whatever their size."""
    if cap is None:
        return []
    # A program's mtime is its last use: loading one touches it (FastDecoder).
    programs = sorted(_programs(folder), key=lambda e: e.mtime)
    total = sum(e.bytes for e in programs)
    keep = {p.resolve() for p in keep}
    gone = []
    for e in programs:  # oldest first
        if total <= cap:
            break
        if e.path.resolve() in keep:
            continue
        e.path.unlink(missing_ok=True)
        total -= e.bytes
        gone.append(e)
    if gone:
        print(f"note: removed {len(gone)} compiled programs unused the longest "
              f"({sum(e.bytes for e in gone) / 1e9:.1f} GB) to keep the cache under "
              f"{cap / 1e9:g} GB (set MTPKIT_COMPILE_CACHE_GB to change, 0 for no cap)",
              file=sys.stderr)
    return gone


def select(found: list[Entry], what: str, older_than_days: float | None) -> list[Entry]:
    """The entries `clear` removes: of kind ``what`` (compiled, models, all), old enough."""
    kinds = {"compiled": {"compiled"}, "models": {"model"}, "all": {"compiled", "model"}}[what]
    cutoff = None if older_than_days is None else time.time() - older_than_days * 86400
    return [e for e in found if e.kind in kinds and (cutoff is None or e.mtime < cutoff)]


def add_parser(sub) -> None:
    """Register `cache`."""
    p = sub.add_parser(
        "cache", help="list or clear compiled programs and converted models",
        description="List what mtpkit keeps in its cache (compiled programs of --compile "
                    "aoti, the converted built-in model), or clear it.")
    p.add_argument("action", nargs="?", choices=["list", "clear"], default="list")
    p.add_argument("--what", choices=["compiled", "models", "all"], default="compiled",
                   help="clear: compiled programs (default), converted models, or both")
    p.add_argument("--older-than", type=float, default=None, metavar="DAYS",
                   help="clear: only entries unused for more than DAYS days (models: "
                        "converted more than DAYS days ago)")
    p.set_defaults(func=run)


def run(a) -> int:
    """List or clear the caches."""
    if a.older_than is not None and a.older_than < 0:
        raise ValueError(f"--older-than must be >= 0 days, got {a.older_than}")
    cap = compiled_cap_bytes()  # a malformed MTPKIT_COMPILE_CACHE_GB fails before any output
    found = entries()
    if a.action == "list":
        from rich.console import Console
        from rich.table import Table

        table = Table(title="mtpkit cache")
        for col in ("kind", "path", "size", "last used"):
            table.add_column(col, overflow="fold")
        for e in found:
            table.add_row(e.kind, str(e.path), f"{e.bytes / 1e6:,.0f} MB",
                          time.strftime("%Y-%m-%d %H:%M", time.localtime(e.mtime)))
        Console().print(table)
        total = sum(e.bytes for e in found)
        print(f"{len(found)} entries, {total / 1e9:.2f} GB; compiled programs are kept under "
              + ("no cap" if cap is None else f"{cap / 1e9:g} GB")
              + " (MTPKIT_COMPILE_CACHE_GB)")
        return 0
    gone = select(found, a.what, a.older_than)
    freed = 0
    for e in gone:
        # Files go at once; folders are renamed aside first so a half-deleted model folder
        # is never mistaken for a converted one.
        if e.path.is_dir():
            aside = e.path.with_name(f".{e.path.name}.deleting")
            e.path.rename(aside)
            shutil.rmtree(aside)
        else:
            e.path.unlink(missing_ok=True)
        freed += e.bytes
    print(f"removed {len(gone)} entries, {freed / 1e9:.2f} GB")
    return 0
