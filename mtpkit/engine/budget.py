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

import bisect
import collections
import itertools
import math
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
    # A count last measured longer ago than this starts again from its new time instead of
    # averaging with it: the regime not chosen (lean or drafting) is measured only by an
    # exploring round now and then, and a cost of its from a slow moment, averaged in at
    # 0.3 a sample, held the other regime's choice for hundreds of rounds.
    RESTART_S = 1.0

    def __init__(self, max_age_s: float = MAX_AGE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.seconds: dict[int, float] = {}  # rows -> moving average
        self.turns = 0
        self._when: dict[int, float] = {}  # rows -> when last measured
        self._oldest = math.inf  # no entry was measured before this
        self._max_age_s = max_age_s
        self._clock = clock

    def record(self, rows: int, seconds: float) -> None:
        """Add one round's time."""
        self._expire()
        now = self._clock()
        old = self.seconds.get(rows)
        if old is not None and now - self._when[rows] > self.RESTART_S:
            old = None
        # The machine's speed moves (shared CPUs), so recent rounds weigh most.
        self.seconds[rows] = seconds if old is None else 0.7 * old + 0.3 * seconds
        self._when[rows] = now
        self._oldest = min(self._oldest, now)
        self.turns += 1

    def known(self, rows: int) -> bool:
        """Whether rounds of this many rows have been measured lately."""
        return rows in self.fresh()

    def fresh(self) -> dict[int, float]:
        """The costs measured lately: rows -> seconds."""
        self._expire()
        return self.seconds

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
        # Every estimate asks (choose_drafts asks one a row count each round): look through
        # the entries only when the oldest may have expired.
        now = self._clock()
        if now - self._oldest <= self._max_age_s:
            return
        for rows in [r for r, t in self._when.items() if now - t > self._max_age_s]:
            del self.seconds[rows], self._when[rows]
        self._oldest = min(self._when.values(), default=math.inf)


# How much faster than lean rounds drafting rounds must be judged to be chosen. Near
# break-even the judgement rests on noisy averages, and drafting has costs the round model
# leaves out (the head's pass over every prompt, rounds whose drafts all turn out too
# unlikely to verify, the exploring rounds), so a near tie goes to the lean rounds: on a CPU
# where a few sequences already make the pass compute-bound, drafting rounds judged barely
# better than lean ones made the server slower than no MTP. The margin stays small because
# costs are left out on the other side too: a round that yields more tokens saves the
# server's per-round work (events, bookkeeping), and a wider margin measured slower.
DRAFT_MARGIN = 1.05


def drafting_pays(samples: list[list[float]], n: int, cost: Callable[[int], float | None],
                  lean_seconds: float, margin: float = DRAFT_MARGIN) -> bool:
    """Whether n sequences drafting yield ``margin`` times the tokens per second of rounds
    that draft nothing (lean_seconds each), given the head's probabilities of the drafts of
    recent sequences (``samples``, one list a sequence) and cost(rows) of a drafting round
    that verifies the likeliest drafts (choose_drafts)."""
    return _pays([e for e, _, _ in _ranked(samples)], len(samples), n, cost, lean_seconds,
                 margin)


def _pays(odds: list[float], sequences: int, n: int, cost: Callable[[int], float | None],
          lean_seconds: float, margin: float) -> bool:
    # odds: E = p_1 .. p_j of every draft of ``sequences`` sequences, highest first
    # (_ranked). A batch of n sequences drawn like them holds in expectation n / S of the
    # drafts at each rank (S = sequences), so its m likeliest drafts are worth n / S times
    # the sum of the top m S / n values (the last one in part), and the round yields n +
    # that many tokens at cost(n + m); a lean round n tokens at lean_seconds. Drafting pays
    # when some m beats margin times the lean rate (m = 0 never does: it drafts for
    # nothing). With one sequence of mean probabilities this is every sequence verifying j
    # drafts alike, at m = n j.
    if not odds:
        return False
    lean = margin * n / lean_seconds
    tops = list(itertools.accumulate(odds, initial=0.0))
    for m in range(1, math.ceil(n * len(odds) / sequences) + 1):  # past it, no more odds
        q = m * sequences / n
        whole = min(int(q), len(odds))
        top = tops[whole] + ((q - whole) * odds[whole] if whole < len(odds) else 0.0)
        seconds = cost(n + m)
        if seconds is not None and seconds > 0 and (n + n / sequences * top) / seconds > lean:
            return True
    return False


class DraftOdds:
    """The drafts of the last ``size`` sequences, as drafting_pays weighs them, kept ranked
    as they come (a server asks every batched round; ranking them anew each time would
    cost a tenth of a millisecond and more)."""

    def __init__(self, size: int) -> None:
        self._seen: collections.deque[list[float]] = collections.deque()
        self._size = size
        self._neg: list[float] = []  # -E of every draft kept, ascending (bisect's order)

    @property
    def sequences(self) -> int:
        """How many sequences' drafts are kept."""
        return len(self._seen)

    def add(self, probs: list[float]) -> None:
        """Keep one sequence's drafts (the head's probability of each, in order)."""
        odds = [e for e, _, _ in _ranked([probs])]
        self._seen.append(odds)
        for e in odds:
            bisect.insort(self._neg, -e)
        if len(self._seen) > self._size:
            for e in self._seen.popleft():
                del self._neg[bisect.bisect_left(self._neg, -e)]

    def pays(self, n: int, cost: Callable[[int], float | None], lean_seconds: float,
             margin: float = DRAFT_MARGIN) -> bool:
        """drafting_pays over the sequences kept."""
        return _pays([-e for e in self._neg], len(self._seen), n, cost, lean_seconds, margin)
