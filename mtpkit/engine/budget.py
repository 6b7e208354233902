"""How many drafts each sequence of a batched round verifies.

A drafted token costs a trunk row whether it is accepted or not. One sequence alone reads
the weights for one row or for k+1 at about the same cost, so every draft pays; several
sequences together make the pass compute-bound, where a row can cost nearly what a token
brings, and only drafts likely to be accepted pay. The server asks this module which drafts
to verify in each batched round, from the head's own probabilities and the round costs it
has measured on this machine. Verifying fewer drafts never changes the output (greedy
verification keeps whatever prefix the trunk agrees with); it changes only the speed.
"""

from __future__ import annotations

import time
from collections.abc import Callable


def _ranked(probs: list[list[float]]) -> list[tuple[float, int, int]]:
    # Every draft as (E, j, i): the chance that draft j of sequence i and the drafts before
    # it are all accepted, E_ij = prod_{l<=j} p_il; highest first. E falls along a chain, so
    # any leading part of this list holds a prefix of each sequence's drafts.
    rows = []
    for i, ps in enumerate(probs):
        e = 1.0
        for j, p in enumerate(ps):
            e *= min(max(p, 0.0), 1.0)
            rows.append((e, j, i))
    rows.sort(key=lambda r: (-r[0], r[1]))
    return rows


def _take(ranked: list[tuple[float, int, int]], n: int, m: int) -> list[int]:
    # Drafts per sequence (of n) in the first m of a _ranked list.
    take = [0] * n
    for _, _, i in ranked[:m]:
        take[i] += 1
    return take


def top_drafts(probs: list[list[float]], m: int) -> list[int]:
    """Drafts to verify per sequence when m rows of drafts are verified: the m likeliest."""
    return _take(_ranked(probs), len(probs), m)


def choose_drafts(probs: list[list[float]],
                  cost: Callable[[int], float | None]) -> list[int]:
    """Drafts to verify per sequence so that one batched round yields the most tokens per
    second, given each draft's chance of acceptance and cost(rows) of a round."""
    # A round over n sequences verifying n + m rows (the pending tokens and m drafts) yields
    # n tokens plus the expected accepted drafts, the sum of their E (_ranked). For any m
    # the best drafts are the m likeliest, so only m is to choose: the one with the most
    # (n + sum of the top m E) / cost(n + m). The cost need not be a line (a kernel that
    # takes rows four at a time costs in steps); row counts of unknown cost are skipped.
    n = len(probs)
    ranked = _ranked(probs)
    best_m, best_rate = 0, -1.0
    tokens = float(n)
    for m in range(len(ranked) + 1):
        if m:
            tokens += ranked[m - 1][0]
        seconds = cost(n + m)
        if seconds is not None and seconds > 0 and tokens / seconds > best_rate:
            best_m, best_rate = m, tokens / seconds
    return _take(ranked, n, best_m)


class RoundCosts:
    """Measured seconds of batched rounds of one batch size, by rows verified. A count not
    measured for ``max_age_s`` is forgotten: a cost taken once on a busy machine would
    otherwise stand for good whenever the choice it drove never measures it again."""

    MAX_AGE_S = 20.0

    def __init__(self, max_age_s: float = MAX_AGE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.seconds: dict[int, float] = {}  # rows -> moving average
        self.turns = 0
        self._when: dict[int, float] = {}  # rows -> when last measured
        self._max_age_s = max_age_s
        self._clock = clock

    def record(self, rows: int, seconds: float) -> None:
        """Add one round's time."""
        self._expire()
        old = self.seconds.get(rows)
        # The machine's speed moves (shared CPUs), so recent rounds weigh most.
        self.seconds[rows] = seconds if old is None else 0.7 * old + 0.3 * seconds
        self._when[rows] = self._clock()
        self.turns += 1

    def known(self, rows: int) -> bool:
        """Whether rounds of this many rows have been measured lately."""
        self._expire()
        return rows in self.seconds

    def estimate(self, rows: int) -> float | None:
        """Seconds of a round of this many rows: measured, else that of the next larger
        measured count when a smaller one is measured too (more rows never cost less),
        else None."""
        self._expire()
        if rows in self.seconds:
            return self.seconds[rows]
        above = [r for r in self.seconds if r > rows]
        if above and any(r < rows for r in self.seconds):
            return self.seconds[min(above)]
        return None

    def _expire(self) -> None:
        now = self._clock()
        for rows in [r for r, t in self._when.items() if now - t > self._max_age_s]:
            del self.seconds[rows], self._when[rows]


def drafting_pays(samples: list[list[float]], n: int, cost: Callable[[int], float | None],
                  lean_seconds: float) -> bool:
    """Whether n sequences drafting yield more tokens per second than rounds that draft
    nothing (lean_seconds each), given the head's probabilities of the drafts of recent
    sequences (``samples``, one list a sequence) and cost(rows) of a drafting round that
    verifies the likeliest drafts (choose_drafts)."""
    # Every draft seen is worth E = p_1 .. p_j (_ranked). A batch of n sequences drawn like
    # the S samples holds in expectation n / S of the drafts at each rank of them, so its m
    # likeliest drafts are worth n / S times the sum of the top m S / n values (the last
    # one in part), and the round yields n + that many tokens at cost(n + m); a lean round
    # n tokens at lean_seconds. Drafting pays when some m beats the lean rate (m = 0 never
    # does: it drafts for nothing). With one sample of mean probabilities this is every
    # sequence verifying j drafts alike, at m = n j.
    values = [e for e, _, _ in _ranked(samples)]
    if not values:
        return False
    s, lean = len(samples), n / lean_seconds
    tops = [0.0]
    for e in values:
        tops.append(tops[-1] + e)
    for m in range(1, n * max(len(ps) for ps in samples) + 1):
        q = m * s / n
        whole = min(int(q), len(values))
        top = tops[whole] + ((q - whole) * values[whole] if whole < len(values) else 0.0)
        seconds = cost(n + m)
        if seconds is not None and seconds > 0 and (n + n / s * top) / seconds > lean:
            return True
    return False
