"""The batched rounds' draft budget (engine/budget.py) against an exhaustive search."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from mtpkit.engine.budget import (
    DRAFT_MARGIN,
    EXPLORE,
    DraftOdds,
    RoundChoices,
    RoundCosts,
    choose_drafts,
    drafting_pays,
    top_drafts,
)


def _rate(probs, take, cost):
    # Expected tokens per second of a round verifying take[i] drafts of sequence i.
    tokens, rows = float(len(probs)), len(probs)
    for ps, c in zip(probs, take, strict=True):
        e = 1.0
        for p in ps[:c]:
            e *= p
            tokens += e
        rows += c
    return tokens / cost(rows)


def _costs(rng):
    # A line, or steps of four rows (a kernel that streams the weights once a 4 rows).
    a, b = rng.uniform(0.0, 20.0), rng.uniform(0.1, 5.0)
    if rng.random() < 0.5:
        return lambda rows: a + b * rows
    return lambda rows: a + 4 * b * math.ceil(rows / 4)


@pytest.mark.parametrize("seed", range(60))
def test_choose_drafts_is_the_best_choice_of_prefixes(seed):
    """Over every way to verify a prefix of each sequence's drafts, none yields more
    expected tokens per second than the choice made (the slow reference: all of them)."""
    rng = random.Random(seed)
    n, k = rng.randint(1, 4), rng.randint(1, 3)
    probs = [[rng.choice([rng.random(), rng.uniform(0.9, 1.0), 0.0]) for _ in range(k)]
             for _ in range(n)]
    cost = _costs(rng)
    take = choose_drafts(probs, cost)
    assert all(0 <= c <= k for c in take)
    best = max(_rate(probs, list(t), cost)
               for t in itertools.product(range(k + 1), repeat=n))
    assert _rate(probs, take, cost) == pytest.approx(best, rel=1e-12)


def test_choose_drafts_follows_the_cost_of_a_row():
    """Cheap rows (a weight-streaming pass): likely drafts pay; rows that cost what a token
    brings (a compute-bound pass): only near-certain ones; unknown costs are never chosen."""
    probs = [[0.95, 0.9], [0.6, 0.5], [0.2, 0.1]]
    assert choose_drafts(probs, lambda r: 10.0 + 0.05 * r) == [2, 2, 1]
    assert choose_drafts(probs, lambda r: 0.5 + r) == [1, 0, 0]
    assert choose_drafts(probs, lambda r: float(r)) == [0, 0, 0]
    assert choose_drafts(probs, lambda r: None if r < 9 else 1.0) == [2, 2, 2]
    assert choose_drafts([[1.5, -1.0]], lambda r: 1.0 + 0.1 * r) == [1]  # clipped
    assert top_drafts(probs, 3) == [2, 1, 0]


def test_round_costs_estimate_from_measured_rows():
    """Two measured counts give their averages and the line between them; outside them,
    nothing."""
    costs = RoundCosts()
    costs.record(4, 0.030)
    costs.record(8, 0.050)
    costs.record(8, 0.060)
    assert costs.estimate(4) == pytest.approx(0.030)
    assert costs.estimate(8) == pytest.approx(0.053)
    assert costs.estimate(6) == pytest.approx(0.0415)
    assert costs.estimate(3) is None and costs.estimate(9) is None
    assert costs.turns == 3


def test_round_costs_one_lucky_round_does_not_stand_alone():
    """A count measured once is read off the line through every count, weighed by rounds:
    one fast round at 10 rows does not make 10 rows cost what 8 do (the choice would take
    that count, drafting at a loss). A fit that falls with more rows is noise: the mean
    stands for every count."""
    costs = RoundCosts()
    for _ in range(6):
        costs.record(8, 0.0100)
        costs.record(16, 0.0180)
    costs.record(10, 0.0090)
    assert costs.seconds[10] == 0.0090
    assert 0.0115 < costs.estimate(10) < 0.0125
    assert costs.estimate(8) < costs.estimate(10) < costs.estimate(12) < costs.estimate(16)
    falling = RoundCosts()
    falling.record(4, 0.020)
    falling.record(8, 0.010)
    assert falling.estimate(4) == falling.estimate(8) == pytest.approx(0.015)


@pytest.mark.parametrize("seed", range(20))
def test_drafting_pays_against_brute_force(seed):
    """drafting_pays says yes exactly when some number of drafts a sequence, all sequences
    alike, yields more tokens per second than rounds without drafts (a slow reference:
    every j tried, E_j as the product of the mean probabilities)."""
    rng = random.Random(seed)
    n, k = rng.randint(1, 8), rng.randint(1, 4)
    probs = [rng.random() for _ in range(k)]
    per_row = rng.uniform(0.5, 2.0)
    fixed = rng.uniform(0.0, 10.0)  # the drafting round's own cost (the head)

    def cost(rows):
        return fixed + per_row * rows

    lean = per_row * n * rng.uniform(0.7, 1.3)
    margin = rng.choice([1.0, DRAFT_MARGIN, 1.2])
    best = 0.0
    for j in range(1, k + 1):
        tokens = n * (1 + sum(math.prod(probs[: i + 1]) for i in range(j)))
        best = max(best, tokens / cost(n + n * j))
    assert drafting_pays([probs], n, cost, lean, margin) == (best > margin * n / lean)


def test_drafting_pays_only_for_drafts_worth_their_rows():
    """Sure drafts on rows cheaper than a token pay (but not on rows that cost a token
    each); drafts never accepted never do; a drafting round whose head costs as much as
    the trunk pays only with good drafts."""
    assert drafting_pays([[1.0]], 4, lambda rows: 2 + rows / 2, 4.0)
    assert not drafting_pays([[1.0]], 4, lambda rows: rows, 4.0)
    assert not drafting_pays([[0.0, 0.0]], 4, lambda rows: rows, 4.0)
    assert not drafting_pays([[0.5]], 8, lambda rows: 8 + rows, 8.0)
    assert drafting_pays([[0.95, 0.9]], 8, lambda rows: 8 + rows, 40.0)
    assert not drafting_pays([], 8, lambda rows: 1.0, 40.0)


@pytest.mark.parametrize("seed", range(40))
def test_drafting_pays_against_the_best_choice_of_drafts(seed):
    """With a batch of as many sequences as samples, drafting pays exactly when the best
    way to verify some of that batch's drafts (the slow reference: every way) beats the
    lean rate: the samples' ranks stand for the batch's own."""
    rng = random.Random(seed)
    n, k = rng.randint(1, 6), rng.randint(1, 3)
    samples = [[rng.choice([rng.random(), rng.uniform(0.9, 1.0), 0.0]) for _ in range(k)]
               for _ in range(n)]
    cost = _costs(rng)
    lean = cost(n) * rng.uniform(0.5, 1.2)
    margin = rng.choice([1.0, DRAFT_MARGIN])
    best = max(_rate(samples, list(t), cost)
               for t in itertools.product(range(k + 1), repeat=n) if any(t))
    if abs(best - margin * n / lean) < 1e-9 * best:
        return  # a tie either way
    assert drafting_pays(samples, n, cost, lean, margin) == (best > margin * n / lean)


def test_a_near_tie_goes_to_the_lean_rounds():
    """Drafting judged barely faster than lean rounds (within DRAFT_MARGIN) is not chosen
    by default, and is with no margin; judged clearly faster (past it), it is."""
    def cost(rows):
        return 4.0 + rows  # 8 sequences, one sure draft each: 16 tokens in 20 s

    # Lean rates a little and well below the drafting rate.
    near, clear = 16 / 20 / (1 + (DRAFT_MARGIN - 1) / 2), 16 / 20 / (DRAFT_MARGIN + 0.05)
    assert not drafting_pays([[1.0]], 8, cost, 8 / near)
    assert drafting_pays([[1.0]], 8, cost, 8 / near, margin=1.0)
    assert drafting_pays([[1.0]], 8, cost, 8 / clear)
    odds = DraftOdds(4)
    odds.add([1.0])
    assert not odds.pays(8, cost, 8 / near) and odds.pays(8, cost, 8 / clear)


def test_drafting_pays_for_the_sure_drafts_alone():
    """Half the sequences' drafts sure, half hopeless: their mean (0.5) never pays on rows
    that cost nearly a token each, but verifying the sure ones alone does; and a larger
    batch of the same mix counts the sure ones in proportion."""
    samples = [[1.0], [0.0]]

    def cost(rows):
        return 4.0 + rows

    lean = cost(8)
    assert not drafting_pays([[0.5]], 8, cost, lean)
    assert drafting_pays(samples, 8, cost, lean)
    assert drafting_pays(samples * 8, 8, cost, lean)
    # One sure draft in ten sequences: 0.8 of one a batch of 8, not worth a row's cost.
    assert not drafting_pays([[1.0]] + [[0.0]] * 9, 8, lambda rows: 4.0 + 3.0 * rows, 28.0)


@pytest.mark.parametrize("seed", range(10))
def test_draft_odds_judge_the_last_sequences_as_drafting_pays_does(seed):
    """DraftOdds, kept ranked as sequences come and go, decides as drafting_pays does over
    the same last sequences (drafts of varying depth, batch sizes and costs)."""
    rng = random.Random(seed)
    size = rng.randint(1, 12)
    odds, seen = DraftOdds(size), []
    for step in range(40):
        probs = [rng.choice([rng.random(), 1.0, 0.0]) for _ in range(rng.randint(1, 3))]
        odds.add(probs)
        seen.append(probs)
        assert odds.sequences == min(len(seen), size)
        n, cost = rng.randint(1, 8), _costs(rng)
        lean = cost(n) * rng.uniform(0.6, 1.3)
        assert odds.pays(n, cost, lean) == drafting_pays(seen[-size:], n, cost, lean), step


def test_round_costs_forget_what_was_not_measured_lately():
    """A row count not measured for max_age_s is unknown again (and so measured again),
    while one measured since stays; a count measured anew starts from its new time."""
    now = [0.0]
    costs = RoundCosts(max_age_s=10.0, clock=lambda: now[0])
    costs.record(8, 0.050)
    now[0] = 6.0
    costs.record(16, 0.400)  # a busy moment
    assert costs.known(8) and costs.estimate(16) == 0.400
    now[0] = 12.0
    assert not costs.known(8) and costs.known(16)
    assert costs.estimate(12) is None  # nothing measured below 12 any more
    now[0] = 17.0
    assert not costs.known(16) and not costs.seconds
    costs.record(16, 0.030)
    assert costs.estimate(16) == 0.030  # not averaged with the forgotten 0.400
    assert costs.turns == 3


def test_round_costs_average_recent_rounds_and_restart_after_a_gap():
    """Rounds measured close together are averaged (0.7 old, 0.3 new); a count measured
    again after more than RESTART_S takes the new time alone (an exploring round's fresh
    cost replaces one from another moment), and the other counts keep theirs."""
    now = [0.0]
    costs = RoundCosts(max_age_s=10.0, clock=lambda: now[0])
    costs.record(4, 0.020)
    costs.record(6, 0.030)
    now[0] = 0.5
    costs.record(4, 0.010)
    assert costs.seconds[4] == pytest.approx(0.017)
    now[0] = 0.5 + RoundCosts.RESTART_S + 0.1
    costs.record(4, 0.012)
    assert costs.seconds == {4: 0.012, 6: 0.030}


def test_round_choices_measure_both_ways_then_verify_what_pays():
    """A batch's first round verifies every draft and its second none (both costs measured);
    then the costs and the head's probabilities choose, here the likely draft alone; a
    round with no real drafts verifies none."""
    rc = RoundChoices()
    probs = [[0.9], [0.1]]
    assert rc.drafts_to_verify(1, [1, 1], probs) == [1, 1]
    rc.record(1, 2, 4, 0.010, lean=False)
    assert rc.drafts_to_verify(1, [1, 1], probs) == [0, 0]
    rc.record(1, 2, 2, 0.006, lean=False)
    rc.record(1, 2, 3, 0.0065, lean=False)
    # 2 tokens in 6 ms lean, 2.9 in 6.5 ms with the likely draft, 3.0 in 10 ms with both.
    assert rc.drafts_to_verify(1, [1, 1], probs) == [1, 0]
    assert rc.drafts_to_verify(1, [1, 1], None) == [0, 0]


def test_drafting_is_taken_up_again_only_on_drafting_costs_timed_lately():
    """A lean batch turns to drafting only where the drafting rounds whose costs say it
    pays were timed within RESTART_S: a lean cost measured in a slow moment against
    drafting costs from another one does not count. Costs timed lately do, and the
    exploring rounds (two in a row every 4 EXPLORE) time them."""
    now = [0.0]
    rc = RoundChoices(clock=lambda: now[0])
    rc.note_drafts([1.0])
    rc.record(1, 8, 16, 0.012, lean=False)  # 16 sure tokens in 12 ms
    rc.record(1, 8, 8, 0.0095, lean=False)
    rc.record(1, 8, 8, 0.010, lean=True)  # 8 tokens in 10 ms
    assert not rc.lean(1, 8)  # drafting pays, on costs timed just now
    now[0] = RoundCosts.RESTART_S + 0.5
    rc.record(1, 8, 8, 0.0105, lean=True)
    assert rc.lean(1, 8)  # the same judgement, on a 16-row cost from another moment
    rc.record(1, 8, 16, 0.012, lean=False)
    assert not rc.lean(1, 8)
    # The exploring rounds: turns 64 and 65 of the batch's rounds take the other way.
    while (rc.round_costs[1, 8].turns + rc.lean_costs[1, 8].turns) % (4 * EXPLORE):
        rc.record(1, 8, 16, 0.012, lean=False)
    assert rc.lean(1, 8)
    rc.record(1, 8, 8, 0.010, lean=True)
    assert rc.lean(1, 8)
    rc.record(1, 8, 8, 0.010, lean=True)
    assert not rc.lean(1, 8)
