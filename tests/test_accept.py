"""The accept rule and the sampling distribution, checked as pure functions."""

from __future__ import annotations

import torch

from mtpkit.engine.accept import accept_greedy, accept_sampled
from mtpkit.engine.metrics import SpecMetrics
from mtpkit.engine.sampling import SamplingParams, probs


def test_greedy_accepts_matching_prefix_then_corrects():
    assert accept_greedy([5, 6, 7], [5, 6, 7, 8]) == (3, 8)  # all pass: bonus token
    assert accept_greedy([5, 6, 7], [5, 9, 7, 8]) == (1, 9)  # first mismatch replaced
    assert accept_greedy([5, 6, 7], [1, 6, 7, 8]) == (0, 1)
    assert accept_greedy([], [4]) == (0, 4)  # k = 0 is plain decoding


def _emitted_distribution(p, q, n=20000, seed=0):
    """Empirical distribution of the first emitted token with one draft from q."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(p.shape[-1])
    drafts = torch.multinomial(q.expand(n, -1), 1, replacement=True, generator=g)[:, 0]
    for d in drafts.tolist():
        n_acc, nxt = accept_sampled([d], q[None], torch.stack([p, p]), g)
        counts[d if n_acc else nxt] += 1
    return counts / n


def test_sampled_rule_reproduces_target_distribution():
    """Whatever the draft distribution, emitted tokens follow the target's."""
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    drafts = (torch.tensor([0.1, 0.1, 0.1, 0.7]), torch.tensor([0.25] * 4), p.clone(),
              torch.tensor([0.0, 0.6, 0.0, 0.4]))  # the last: a draft vocabulary subset
    for q in drafts:
        got = _emitted_distribution(p, q)
        assert (got - p).abs().max() < 0.02, (q, got)


def test_sampled_rule_rejects_impossible_draft_and_resamples_from_residual():
    p = torch.tensor([0.0, 1.0, 0.0])
    q = torch.tensor([[1.0, 0.0, 0.0]])
    n_acc, nxt = accept_sampled([0], q, torch.stack([p, p]), torch.Generator().manual_seed(1))
    assert (n_acc, nxt) == (0, 1)


def test_sampled_rule_accepts_certain_drafts_and_adds_bonus():
    p = torch.tensor([0.0, 0.0, 1.0])
    q = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 1.0]])
    n_acc, nxt = accept_sampled([2, 2], q, torch.stack([p, p, p]), None)
    assert (n_acc, nxt) == (2, 2)


def test_top_k_top_p_temperature():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    assert probs(logits, SamplingParams(temperature=1.0, top_k=2))[2:].sum() == 0
    pr = probs(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert pr[0] == 1.0  # the first token alone already holds over half the mass
    full = probs(logits, SamplingParams(temperature=1.0))
    assert torch.allclose(full, torch.softmax(logits, -1))
    hot = probs(logits, SamplingParams(temperature=2.0))
    assert torch.allclose(hot, torch.softmax(logits / 2, -1))


def test_metrics_follow_vllm_definitions():
    m = SpecMetrics()
    m.record(3, 3)
    m.record(3, 1)
    m.record(3, 0)
    m.record(0, 0)  # a step without drafts is not a draft
    assert m.num_drafts == 3 and m.num_draft_tokens == 9 and m.num_accepted_tokens == 4
    assert m.accepted_per_pos == [2, 1, 1]
    assert abs(m.acceptance_rate - 4 / 9) < 1e-12
    assert abs(m.mean_acceptance_length - (1 + 4 / 3)) < 1e-12
    line = m.vllm_line()
    assert line.startswith("SpecDecoding metrics: Mean acceptance length: 2.33")
    assert "Accepted: 4 tokens, Drafted: 9 tokens" in line
    assert "Per-position acceptance rate: 0.667, 0.333, 0.333" in line
    assert line.endswith("Avg Draft acceptance rate: 44.4%")
