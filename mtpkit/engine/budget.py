"""How many drafts each sequence of a batched round verifies.

A drafted token costs a trunk row whether it is accepted or not. One sequence alone reads
the weights for one row or for k+1 at about the same cost, so every draft pays; several
sequences together make the pass compute-bound, where a row can cost nearly what a token
brings, and only drafts likely to be accepted pay. The server asks this module
(RoundChoices, which every FastDecoder keeps) which drafts to verify in each batched round,
from the head's own probabilities and the round costs it has measured on this machine.
Verifying fewer drafts never changes the output (greedy verification keeps whatever prefix
the trunk agrees with); it changes only the speed.
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
    # The most rounds a count's average weighs as in the fit (estimate): the moving average
    # holds about this many rounds' worth.
    FIT_CAP = 6

    def __init__(self, max_age_s: float = MAX_AGE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.seconds: dict[int, float] = {}  # rows -> moving average
        self._samples: dict[int, int] = {}  # rows -> rounds in that average (FIT_CAP most)
        self._line: tuple[float, float] | None = None  # the fit (estimate), until a change
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
        self._samples[rows] = 1 if old is None else min(self._samples[rows] + 1, self.FIT_CAP)
        self._line = None
        self._when[rows] = now
        self._oldest = min(self._oldest, now)
        self.turns += 1

    def age_above(self, rows: int) -> float:
        """Seconds since a round of more than ``rows`` rows was measured (inf: none kept)."""
        self._expire()
        return self._clock() - max((t for r, t in self._when.items() if r > rows),
                                   default=-math.inf)

    def known(self, rows: int) -> bool:
        """Whether rounds of this many rows have been measured lately."""
        return rows in self.fresh()

    def fresh(self) -> dict[int, float]:
        """The costs measured lately: rows -> seconds."""
        self._expire()
        return self.seconds

    def estimate(self, rows: int) -> float | None:
        """Seconds of a round of this many rows, from the fewest to the most rows measured
        lately (else None): the line through every measured count's average, each weighed
        by the rounds behind it."""
        # A count measured once stands on one round's time, which on a shared CPU moves by
        # a third from round to round, and the choices take the best of many counts: so
        # the count with the luckiest time. Read alone, one such time (ten rows at the cost
        # of eight) made a server at eight sequences draft at a loss for a hundred rounds.
        # A round's cost grows about linearly with its rows (each is the same work), so one
        # line through all the counts stands on all their rounds.
        self._expire()
        if not self.seconds or not min(self.seconds) <= rows <= max(self.seconds):
            return None
        if self._line is None:
            w = self._samples  # the same counts as self.seconds
            total = sum(w.values())
            mr = sum(w[r] * r for r in w) / total
            ms = sum(w[r] * s for r, s in self.seconds.items()) / total
            var = sum(w[r] * (r - mr) ** 2 for r in w)
            slope = sum(w[r] * (r - mr) * (s - ms) for r, s in self.seconds.items()) / var \
                if var else 0.0
            # More rows never cost less: a falling fit is noise, and the mean stands.
            slope = max(slope, 0.0)
            self._line = ms - slope * mr, slope
        return self._line[0] + self._line[1] * rows

    def _expire(self) -> None:
        # Every estimate asks (choose_drafts asks one a row count each round): look through
        # the entries only when the oldest may have expired.
        now = self._clock()
        if now - self._oldest <= self._max_age_s:
            return
        for rows in [r for r, t in self._when.items() if now - t > self._max_age_s]:
            del self.seconds[rows], self._when[rows], self._samples[rows]
            self._line = None
        self._oldest = min(self._when.values(), default=math.inf)


# How much faster than lean rounds drafting rounds must be judged to be chosen. Near
# break-even the judgement rests on noisy averages, and drafting has costs the round model
# leaves out (the head's pass over every prompt, rounds whose drafts all turn out too
# unlikely to verify, the exploring rounds). The way not running is also measured only in
# short exploring windows, just after a switch, when rounds run slower than the same rounds
# in a row (a lean round after drafting ones by about 5% on a 2-core CPU, more over HTTP):
# while a server drafts, the lean cost reads high. With a margin of 1.05 a server at four
# sequences on such a CPU drafted for whole runs that drafting lost (to 0.93x of no MTP);
# at 1.10 it stays lean there, and at two and three sequences, where drafting wins by
# 1.1-1.3x, it still drafts. A wider margin (1.2) gave up that win.
DRAFT_MARGIN = 1.10


def drafting_pays(samples: list[list[float]], n: int, cost: Callable[[int], float | None],
                  lean_seconds: float, margin: float = DRAFT_MARGIN) -> bool:
    """Whether n sequences drafting yield ``margin`` times the tokens per second of rounds
    that draft nothing (lean_seconds each), given the head's probabilities of the drafts of
    recent sequences (``samples``, one list a sequence) and cost(rows) of a drafting round
    that verifies the likeliest drafts (choose_drafts)."""
    return _pays([e for e, _, _ in _ranked(samples)], len(samples), n, cost, lean_seconds,
                 margin)


def _pays(odds: list[float], sequences: int, n: int, cost: Callable[[int], float | None],
          lean_seconds: float, margin: float, tops: list[float] | None = None) -> bool:
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
    if tops is None:  # the sums of the top odds, tops[i] = odds[0] + .. + odds[i - 1]
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
        # The odds highest first and their running sums, as _pays reads them; remade after
        # add(). A server in lean rounds asks every round and adds nothing.
        self._ranked: tuple[list[float], list[float]] | None = None

    @property
    def sequences(self) -> int:
        """How many sequences' drafts are kept."""
        return len(self._seen)

    def add(self, probs: list[float]) -> None:
        """Keep one sequence's drafts (the head's probability of each, in order)."""
        odds = [e for e, _, _ in _ranked([probs])]
        self._ranked = None
        self._seen.append(odds)
        for e in odds:
            bisect.insort(self._neg, -e)
        if len(self._seen) > self._size:
            for e in self._seen.popleft():
                del self._neg[bisect.bisect_left(self._neg, -e)]

    def pays(self, n: int, cost: Callable[[int], float | None], lean_seconds: float,
             margin: float = DRAFT_MARGIN) -> bool:
        """drafting_pays over the sequences kept."""
        if self._ranked is None:
            odds = [-e for e in self._neg]
            self._ranked = odds, list(itertools.accumulate(odds, initial=0.0))
        odds, tops = self._ranked
        return _pays(odds, len(self._seen), n, cost, lean_seconds, margin, tops)


EXPLORE = 16  # a batched round in this many measures all drafts or none (drafts_to_verify)
DRAFT_SEEN = 256  # sequences' draft probabilities whether drafting pays is judged on (lean)


class RoundChoices:
    """What a decoder has measured of its batched steps, and the choices it makes from it:
    one pass for a batch or a program call each (batch_pays), whether a round drafts (lean)
    and which drafts it verifies (drafts_to_verify). A decoder and its forks share one."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock  # the round costs' (RoundCosts)
        self._times: dict[tuple, float] = {}  # (kind, k, sequences; 1 = a call each) -> s
        self._counts: dict[tuple, int] = {}
        self.round_costs: dict[tuple, RoundCosts] = {}  # (k, sequences) -> round costs
        self.lean_costs: dict[tuple, RoundCosts] = {}  # the same, of rounds drafting nothing
        # The head's probabilities of the drafts of recent sequences in real rounds.
        self.draft_seen = DraftOdds(DRAFT_SEEN)
        # The same for sampled rounds: their costs, and how often a draft at each position
        # is accepted once those before it are.
        self.sample_costs: dict[tuple, RoundCosts] = {}
        self.sample_lean_costs: dict[tuple, RoundCosts] = {}
        self.sample_accept: list[list[float]] = []  # [hits, seen] a draft position

    def timed(self, key: tuple, seconds: float) -> None:
        """Note what a call took (key: kind, k, sequences; 1 = one program), as a moving
        average."""
        old = self._times.get(key)
        self._times[key] = seconds if old is None else 0.8 * old + 0.2 * seconds
        self._counts[key] = self._counts.get(key, 0) + 1

    def batch_pays(self, kind: str, k: int, n: int) -> bool:
        """Whether n sequences' steps run as one pass rather than a program call each."""
        # Batched passes run uncompiled, so where compiled programs are loaded a call each
        # can be the faster. Each way is tried a few times before the averages decide, and
        # the slower one again now and then, since the machine's speed moves.
        single, batch = (kind, k, 1), (kind, k, n)
        for key in (batch, single):
            if self._counts.get(key, 0) < 3:
                return key == batch
        turn = self._counts[single] + self._counts[batch]
        prefer = self._times[batch] <= n * self._times[single]
        return prefer if turn % 50 else not prefer

    def note_drafts(self, probs: list[float]) -> None:
        """Keep the head's probabilities of one sequence's drafts in a real round."""
        self.draft_seen.add(probs)

    def record(self, k: int, n: int, rows: int, seconds: float, lean: bool) -> None:
        """Note a greedy batched round of n sequences verifying rows rows."""
        self._costs(self.lean_costs if lean else self.round_costs, k, n).record(rows, seconds)

    def record_sampled(self, k: int, n: int, rows: int, seconds: float, drew: bool) -> None:
        """Note a sampled batched round: drafting rounds draw; lean ones neither draw nor
        verify (a trunk pass); a round that only verifies what an exploring round drew is
        neither, and is not kept."""
        costs = (self.sample_costs if drew
                 else self.sample_lean_costs if rows == n else None)
        if costs is not None:
            self._costs(costs, k, n).record(rows, seconds)

    def _costs(self, table: dict[tuple, RoundCosts], k: int, n: int) -> RoundCosts:
        # The batch's entry of a cost table, made on first use (not one made and dropped
        # every round, as setdefault would).
        costs = table.get((k, n))
        if costs is None:
            costs = table[k, n] = RoundCosts(clock=self._clock)
        return costs

    def note_sampled(self, accepted: int, drafts: int) -> None:
        """Note a sampled round's outcome: of its drafts, the first ``accepted`` accepted."""
        # Each position's acceptance given the ones before it (observed up to the first
        # rejection), counted with a decay that keeps about the last hundred.
        chance = self.sample_accept
        for j in range(min(accepted + 1, drafts)):
            if j == len(chance):
                chance.append([0.0, 0.0])
            hits, seen = chance[j]
            chance[j] = [0.99 * hits + (j < accepted), 0.99 * seen + 1]

    def lean(self, k: int, n: int, sampled: bool = False) -> bool:
        """Whether this batched round of n sequences drafts nothing (drafting_pays)."""
        # At a batch size where the head's drafts cost more than their accepted tokens
        # bring, MTP would make the server slower than no MTP: its rounds then run the
        # trunk only. Drafting rounds that verify drafts are measured first, then a lean
        # one; then the measured costs decide, except two rounds in every 4 EXPLORE, which
        # take the other way to keep both costs current (the first of two drafting rounds
        # verifies no drafts, the second does; and the head's probabilities known). A
        # cost not measured lately is forgotten (RoundCosts) and measured again the same
        # way. ``sampled``: of sampled rounds, whose costs are kept apart and whose chance
        # of acceptance is the counted one (with one hit and one miss of prior), not the
        # head's probabilities.
        if sampled:
            full, lean = self.sample_costs.get((k, n)), self.sample_lean_costs.get((k, n))
            chance = [(h + 1) / (s + 2) for h, s in self.sample_accept][:k]
            have_odds = bool(chance)

            def pays_at(cost, lean_seconds):
                return drafting_pays([chance], n, cost, lean_seconds)
        else:
            full, lean = self.round_costs.get((k, n)), self.lean_costs.get((k, n))
            have_odds = self.draft_seen.sequences > 0

            def pays_at(cost, lean_seconds):
                return self.draft_seen.pays(n, cost, lean_seconds)
        if (full is None or not have_odds
                or not any(n < r <= n * (k + 1) for r in full.fresh())):
            return False
        lean_seconds = None if lean is None else lean.estimate(n)
        if lean_seconds is None:
            return True
        pays = pays_at(full.estimate, lean_seconds)
        if pays and not sampled and full.age_above(n) > RoundCosts.RESTART_S:
            # Lean rounds measure their cost every round, and a slow moment of the machine
            # raises it at once, while drafting rounds that verify drafts were last timed
            # at another moment: against those, each such moment judged drafting faster,
            # and a server at eight sequences drafted in bursts at a loss, a quarter of
            # its rounds. So drafting is taken up again only on costs of drafting rounds
            # timed lately: the exploring rounds' (two in a row, the second verifying
            # drafts), or those of a new cost table (after the old one was forgotten).
            pays = False
        explore = (full.turns + lean.turns) % (4 * EXPLORE) < 2
        return pays if explore else not pays

    def lean_prompt(self, k: int, n: int) -> bool:
        """Whether a greedy prompt that joins batched rounds of n sequences (itself
        included) skips the head's catch-up: rounds of that batch are lean (lean())."""
        # The head's pass over a prompt costs a few percent of the prompt's trunk pass, for
        # drafts that lean rounds never make; its cache then keeps no entries for the
        # prompt, as lean rounds leave none for theirs (any draft is still verified). A
        # prompt that runs alone always gets it: its lone rounds draft.
        return n > 1 and self.lean(k, n)

    def drafts_to_verify(self, k: int, full: list[int],
                         probs: list[list[float]] | None) -> list[int]:
        """How many of its drafts each sequence of a batched round verifies, of ``full``
        drafted, given the head's probabilities of them (None: a lean round's placeholders
        or no drafts, nothing to gain)."""
        # All of them, then none, until both costs are measured at this batch size; then
        # what the costs and the head's probabilities say pays, except every EXPLORE-th
        # round, which measures one row count again in turn (the machine's speed moves,
        # and counts never chosen would stay unknown).
        n, most = len(full), sum(full)
        if probs is None:
            return [0] * n
        costs = self._costs(self.round_costs, k, n)
        if not costs.known(n + most):
            return full
        if not costs.known(n):
            return [0] * n
        if costs.turns % EXPLORE == 0:
            return top_drafts(probs, costs.turns // EXPLORE % (most + 1))
        return choose_drafts(probs, costs.estimate)
