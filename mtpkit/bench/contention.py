"""Speed on a quiet CPU against speed beside one busy thread, every path in one run.

A 2-thread decode that shares one of two cores with another thread should keep about half
its speed; thread teams that spin on a descheduled member lose far more, and multi-row
(verification) steps more than one-row steps. This bench measures that for each path and
draft length, the quiet and busy phases taken in turns so that drift biases neither.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from ..engine.generate import Result
from ..engine.sampling import SamplingParams
from .common import in_turn

PHASES = ("quiet", "busy")


@contextmanager
def busy_thread(on: bool = True) -> Iterator[subprocess.Popen | None]:
    """One other process spinning one thread (``while True: pass``) while the block runs."""
    if not on:
        yield None
        return
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.2)  # let the scheduler spread it before anything is timed
        yield proc
    finally:
        proc.kill()
        proc.wait()


@dataclass
class Cell:
    """Pooled generation of one path at one k in one phase."""

    tokens: int = 0
    seconds: float = 0.0
    outputs: dict = field(default_factory=dict)  # prompt index -> token ids

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.seconds if self.seconds else None


def _generate(engine, ids, params, k) -> tuple[list[int], float]:
    res = Result()
    t0 = time.perf_counter()
    for _ in engine.generate(ids, params, k, result=res):
        pass
    return list(res.tokens), time.perf_counter() - t0


def measure_path(engine, prompts: list[list[int]], k: int, max_tokens: int, rounds: int,
                 busy: Callable = busy_thread) -> dict:
    """Tokens/s of ``engine`` at k and at 0, quiet and beside one busy thread.

    Both draft lengths run once before timing (first-run costs land on neither), then
    ``rounds`` rounds each run both phases in turn, and within a phase both draft lengths in
    turn, prompt by prompt."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    params.validate()
    ks = [k, 0] if k else [0]
    for kk in ks:
        _generate(engine, prompts[0], params, kk)
    cells = {(ph, kk): Cell() for ph in PHASES for kk in ks}
    for r in range(rounds):
        for phase in in_turn(list(PHASES), r):
            with busy(phase == "busy"):
                for i, ids in enumerate(prompts):
                    for kk in in_turn(ks, r + i):
                        toks, dt = _generate(engine, ids, params, kk)
                        c = cells[(phase, kk)]
                        c.tokens += len(toks)
                        c.seconds += dt
                        c.outputs.setdefault(i, toks)
                        if c.outputs[i] != toks:
                            c.outputs[i] = None  # the same request gave other tokens
    ref = cells[("quiet", 0)].outputs
    identical = all(c.outputs == ref and None not in c.outputs.values()
                    for c in cells.values())
    row = {"k": k, "identical": identical, "quiet_mtp": None, "busy_mtp": None}
    for (ph, kk), c in cells.items():
        row[f"{ph}_{'mtp' if kk else 'plain'}"] = c.tokens_per_s
    return finish_row(row)


def finish_row(row: dict) -> dict:
    """Add the ratios the targets are stated in: busy over quiet, MTP over plain."""
    def ratio(a, b):
        return row.get(a) / row.get(b) if row.get(a) and row.get(b) else None

    row["kept_plain"] = ratio("busy_plain", "quiet_plain")
    row["kept_mtp"] = ratio("busy_mtp", "quiet_mtp")
    row["mtp_over_plain_quiet"] = ratio("quiet_mtp", "quiet_plain")
    row["mtp_over_plain_busy"] = ratio("busy_mtp", "busy_plain")
    return row
