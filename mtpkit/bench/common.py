"""Shared pieces: list parsing, summary statistics, atomic writes, memory bandwidth."""

from __future__ import annotations

import csv
import io
import json
import os
import tempfile
import time
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path

from ..outputs import publish_modes


def busy_cpu(load_average: list[float] | None, cpu_count: int | None) -> str | None:
    """A warning when the 1-minute load says other work competed for the CPU, else None."""
    # Oversubscribed thread pools slow every step, and multi-row verification far more than
    # one-row decoding.
    if load_average and cpu_count and load_average[0] > 0.75 * cpu_count:
        return (f"load average {load_average[0]:.1f} on {cpu_count} cores: other work "
                "competes for the CPU, so these speeds are not representative")
    return None


def compare_in_turns(run, k: int, turns: int = 2) -> tuple[list, list]:
    """Runs at draft length k and at 0, for a ratio a single try can trust.

    ``run(k, watched, warm)`` generates once and returns its result (``watched``: the run
    the user sees; ``warm``: a short untimed one). Both lengths warm up first, so that
    first-run costs (lazy loads, page faults on the weights, allocator growth) land on
    neither (a first --compare on a fresh machine said 0.54x, later ones 1.2-1.3x); then
    ``turns`` pairs in ABBA order (k, 0, 0, k, ...), so that drift in the machine's speed
    favours neither. Returns
    (runs at k, runs at 0), warm-ups left out."""
    run(k, False, True)
    run(0, False, True)
    at_k, at_0 = [], []
    for i in range(turns):
        for kk in ((k, 0) if i % 2 == 0 else (0, k)):
            (at_k if kk else at_0).append(run(kk, bool(kk) and not at_k, False))
    return at_k, at_0


def parse_int_list(text: str, option: str, minimum: int = 0, maximum: int = 64) -> list[int]:
    """'0,1,2' -> [0, 1, 2]; ValueError naming the option for anything else."""
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    if not parts:
        raise ValueError(f"{option} needs a comma-separated list of integers, got {text!r}")
    out: list[int] = []
    for p in parts:
        try:
            v = int(p)
        except ValueError:
            raise ValueError(
                f"{option}: {p!r} is not an integer (expected e.g. {option} 0,1,2,3)"
            ) from None
        if not minimum <= v <= maximum:
            raise ValueError(f"{option}: {v} is outside {minimum}..{maximum}")
        if v not in out:
            out.append(v)
    return out


def in_turn(items: Sequence, turn: int) -> list:
    """``items`` in the order of turn ``turn``: rotated left by ``turn`` places.

    The benches run their engines or draft lengths in turns, prompt by prompt, rotating the
    order each time: in a fixed order the last would always run latest in the machine's
    drift."""
    shift = turn % len(items) if items else 0
    return list(items[shift:]) + list(items[:shift])


def summarize(values: Sequence[float]) -> dict:
    """mean, median, p90, p99 (linear interpolation, as numpy), min, max and count."""
    import numpy as np

    if not len(values):
        return {"n": 0, "mean": None, "median": None, "p90": None, "p99": None,
                "min": None, "max": None}
    a = np.asarray(values, dtype=float)
    return {"n": int(a.size), "mean": float(a.mean()), "median": float(np.median(a)),
            "p90": float(np.percentile(a, 90)), "p99": float(np.percentile(a, 99)),
            "min": float(a.min()), "max": float(a.max())}


def default_out_dir(kind: str) -> Path:
    """A fresh results folder under the current directory, named by kind and time."""
    return Path("mtpkit-bench") / f"{kind}-{datetime.now():%Y%m%d-%H%M%S}"


def _atomic_bytes(path: Path, data: bytes) -> None:
    # Readers (and a crash) see the old file or the whole new one, never a torn write.
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        publish_modes(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text(path: Path, text: str) -> None:
    """Write a text file atomically (temp file in the same folder, then rename)."""
    _atomic_bytes(path, text.encode("utf-8"))


def write_json(path: Path, data) -> None:
    """Write JSON atomically."""
    write_text(path, json.dumps(data, indent=2) + "\n")


def write_csv(path: Path, rows: Iterable[dict], fields: Sequence[str]) -> None:
    """Write dict rows as CSV atomically; lists are joined with ';'."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(fields), extrasaction="ignore")
    w.writeheader()
    for row in rows:
        w.writerow({k: ";".join(f"{x:.4g}" if isinstance(x, float) else str(x) for x in v)
                    if isinstance(v, list | tuple) else v for k, v in row.items()})
    write_text(path, buf.getvalue())


def save_figure(fig, path: Path) -> None:
    """Save a matplotlib Figure as PNG atomically."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    _atomic_bytes(path, buf.getvalue())


def measure_bandwidth(megabytes: int = 256, repeats: int = 5) -> float:
    """Memory read bandwidth in GB/s, best of ``repeats``.

    A torch sum over a buffer far larger than the caches, with the threads torch uses for
    decoding: a decode step only reads its weights. (A copy, which this measured before,
    also writes, and its write-allocate traffic goes uncounted, so it read well below what a
    sum reads, which made every bound look lower than the memory allows.)"""
    import torch

    n = megabytes * (1 << 20) // 4
    src = torch.ones(n, dtype=torch.float32)  # ones, not empty: the pages must be touched
    src.sum()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        src.sum()
        best = min(best, time.perf_counter() - t0)
    return src.numel() * src.element_size() / best / 1e9


def weight_bytes(model) -> dict:
    """Bytes of weights one decode step streams: the trunk's, and one MTP draft step's.

    The embedding table is gathered (one row a token), so it counts only when the lm_head
    reads it as its own weight (tied embeddings). The head's own modules count per draft
    step; its logits read the full lm_head, or only the draft-vocabulary rows (added by the
    caller, who knows the drafter)."""
    from ..quant.linear import QuantLinear

    embed = model.model.embed_tokens.weight
    # A quantized lm_head's ``weight`` would build a float copy; it is never the embedding.
    lm_w = None if isinstance(model.lm_head, QuantLinear) else model.lm_head.weight
    head_ids = {id(p) for p in model.mtp.parameters()} if model.mtp is not None else set()
    seen: set[int] = set()
    trunk = head = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        size = p.numel() * p.element_size()
        if p is embed and p is not lm_w:
            continue
        if id(p) in head_ids:
            if p is not embed and p is not lm_w:
                head += size
        else:
            trunk += size
    # Quantized linears: the bytes their kernels read (W4A8's packed nibbles, not the
    # one-byte codes kept beside them).
    def quant_bytes(mod) -> int:
        return mod.weight_bytes

    for name, mod in model.named_modules():
        if isinstance(mod, QuantLinear):
            if name.startswith("mtp."):
                head += quant_bytes(mod)
            else:
                trunk += quant_bytes(mod)
    lm = model.lm_head
    if isinstance(lm, QuantLinear):
        lm_bytes = quant_bytes(lm)
        return {"trunk": trunk, "head": head, "lm_head": lm_bytes,
                "lm_head_row": lm_bytes // lm.out_features}
    return {"trunk": trunk, "head": head, "lm_head": lm.weight.numel() * lm.weight.element_size(),
            "lm_head_row": lm.weight.shape[1] * lm.weight.element_size()}
