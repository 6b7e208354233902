"""Sampled MTP decoding keeps the target's distribution, measured with the power to notice
when it does not.

The first verification step's token t2 is where the accept rule acts: the draft is taken
with probability min(1, p/q), else t2 comes from the residual max(0, p - q). The joint
frequencies of (t1, t2) over many seeded generations are compared with the exact target
probabilities p(t1) p(t2 | t1), computed from the model. The same check runs against three
plausible bugs and must catch each: the residual drawn from p, acceptance with sqrt(p/q),
and a drafter that samples from one temperature and reports q at another; on the eager
engine and on the fast path (FastDecoder), which draw and accept in code of their own.
"""

from __future__ import annotations

import pytest
import torch
from test_families import SharpDrafter

from mtpkit.engine import fast as fast_mod
from mtpkit.engine import generate as gen_mod
from mtpkit.engine.accept import accept_sampled
from mtpkit.engine.fast import FastDecoder
from mtpkit.engine.generate import MTPDrafter, Result, draw_draft
from mtpkit.engine.sampling import SamplingParams, probs, sample

PROMPT = [60, 61, 62, 63, 64, 65, 66, 67, 68]
PARAMS = dict(temperature=0.8, top_k=8, top_p=0.95)
SAMPLES = 4000


def _exact_joint(engine, prompt, params) -> torch.Tensor:
    """p(t1) p(t2 | t1) [V, V] of the target after ``prompt``."""
    model = engine.model

    def next_probs(ids):
        cache, _ = engine._caches(len(ids) + 4)
        with torch.inference_mode():
            out = model(torch.tensor([ids]), cache)
            return probs(model.logits(out.hidden[:, -1])[0], params)

    p1 = next_probs(prompt)
    joint = torch.zeros(p1.shape[0], p1.shape[0], dtype=torch.float64)
    for t1 in torch.nonzero(p1).flatten().tolist():
        joint[t1] = p1[t1].double() * next_probs(prompt + [t1]).double()
    return joint


def _chi2_fit(counts: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    """Chi-square of counts against expected counts (cells under 5 pooled), 99.9% limit;
    infinite when a token outside the target's support was emitted."""
    if counts[expected == 0].sum() > 0:
        return float("inf"), 0.0
    keep = expected >= 5
    c = torch.cat([counts[keep], counts[~keep].sum()[None]])
    e = torch.cat([expected[keep], expected[~keep].sum()[None]])
    nz = e > 0
    chi2 = float(((c[nz] - e[nz]) ** 2 / e[nz]).sum())
    dof = max(int(nz.sum()) - 1, 1)
    limit = dof * (1 - 2 / (9 * dof) + 3.09 * (2 / (9 * dof)) ** 0.5) ** 3
    return chi2, limit


def _residual_from_p(draft, q, p, generator):
    k = len(draft)
    for j in range(k):
        if torch.rand(1, generator=generator).item() >= float(p[j, draft[j]] / q[j, draft[j]]):
            return j, int(sample(p[j], generator))  # bug: p, not max(0, p - q)
    return k, int(sample(p[k], generator))


def _sqrt_ratio(draft, q, p, generator):
    k = len(draft)
    for j in range(k):
        ratio = float((p[j, draft[j]] / q[j, draft[j]]).sqrt())  # bug: sqrt(p/q)
        if torch.rand(1, generator=generator).item() >= ratio:
            residual = (p[j] - q[j]).clamp_min(0)
            return j, int(sample(residual / residual.sum(), generator))
    return k, int(sample(p[k], generator))


class OtherTemperatureDrafter(SharpDrafter):
    """Bug: samples from the sharp q, reports q at the request's temperature."""

    def pick(self, s, logits, params, gen):
        token, _ = super().pick(s, logits, params, gen)
        return token, probs(logits[0], params)


def _sharp_draft(logits, params, gen, vocab, vocab_size):
    # The fast path's draft drawing as SharpDrafter draws (no draft vocabulary here).
    q = probs(logits, SamplingParams(temperature=params.temperature * 0.3))
    return int(sample(q, gen)), q


def _draft_at_other_temperature(logits, params, gen, vocab, vocab_size):
    # Bug: draws from the sharp q, reports q at the request's temperature.
    token, _ = _sharp_draft(logits, params, gen, vocab, vocab_size)
    return token, probs(logits, params)


CASES = {  # name: (accept rule, drafter class, the check must pass)
    "head": (accept_sampled, MTPDrafter, True),
    "sharp": (accept_sampled, SharpDrafter, True),
    "residual-from-p": (_residual_from_p, SharpDrafter, False),
    "sqrt-ratio": (_sqrt_ratio, SharpDrafter, False),
    "q-at-other-temperature": (accept_sampled, OtherTemperatureDrafter, False),
}
# The fast path (FastDecoder: pooled programs, run uncompiled here) draws its drafts through
# fast.draw_draft: (accept rule, draft drawing, the check must pass).
FAST_CASES = {
    "fast-head": (accept_sampled, draw_draft, True),
    "fast-sharp": (accept_sampled, _sharp_draft, True),
    "fast-residual-from-p": (_residual_from_p, _sharp_draft, False),
    "fast-q-at-other-temperature": (accept_sampled, _draft_at_other_temperature, False),
}


@pytest.mark.parametrize("case", list(CASES) + list(FAST_CASES))
def test_sampled_tokens_follow_the_target(case, engine_factory, monkeypatch):
    engine = engine_factory("llama")
    params = SamplingParams(max_tokens=3, **PARAMS)
    expected = _exact_joint(engine, PROMPT, params) * SAMPLES
    if case in FAST_CASES:
        rule, draw, lossless = FAST_CASES[case]
        monkeypatch.setattr(fast_mod, "accept_sampled", rule)
        monkeypatch.setattr(fast_mod, "draw_draft", draw)
        dec = FastDecoder(engine.model, backend="eager", max_len=64)
        assert dec.samples

        def run(p, res):
            return dec.generate(PROMPT, 3, 1, result=res, eos_ids=set(), params=p)
    else:
        rule, drafter_cls, lossless = CASES[case]
        monkeypatch.setattr(gen_mod, "accept_sampled", rule)
        drafter = drafter_cls(engine.model)

        def run(p, res):
            return engine.generate(PROMPT, p, 1, result=res, drafter=drafter, eos_ids=set())
    counts = torch.zeros_like(expected)
    drafted = accepted = 0
    for seed in range(SAMPLES):
        res = Result()
        t = list(run(SamplingParams(max_tokens=3, seed=seed, **PARAMS), res))
        counts[t[0], t[1]] += 1
        drafted += res.metrics.num_draft_tokens
        accepted += res.metrics.num_accepted_tokens
    # Both branches of the rule ran often: drafts taken and drafts replaced.
    assert drafted >= SAMPLES and 0.1 * drafted < accepted < 0.9 * drafted
    chi2, limit = _chi2_fit(counts.flatten(), expected.flatten())
    if lossless:
        assert chi2 < limit, f"chi2={chi2:.1f} > {limit:.1f}: not the target's distribution"
    else:
        assert chi2 > limit, f"chi2={chi2:.1f} <= {limit:.1f}: the check missed {case}"
