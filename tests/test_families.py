"""Every family through the same checks: against transformers, and MTP against no MTP."""

from __future__ import annotations

import warnings

import pytest
import torch
from tiny import FAMILIES, MORE_FAMILIES, VOCAB, write_checkpoint

from mtpkit.engine.generate import Engine, MTPDrafter, Result
from mtpkit.engine.loader import load_model
from mtpkit.engine.sampling import SamplingParams, probs, sample
from mtpkit.models.cache import KVCache

PROMPTS = [[3, 17, 42, 8], [60, 61, 62, 63, 64, 65, 66, 67, 68], [5], [90, 1, 90, 1, 90, 1, 33]]

# The shared table, and text-only Step-3.5-Flash (model_type step3p5 at the top level): its
# logits are compared with transformers' Step-3.7 model built from the same weights, as
# transformers 5.23 has no step3p5 model class (only its config, Step3p7TextConfig).
FAMILIES = FAMILIES + [f for f in MORE_FAMILIES if f.name == "step3p5"]
FAMILY_IDS = [f.name for f in FAMILIES]


@pytest.mark.parametrize("fam", FAMILIES, ids=FAMILY_IDS)
def test_logits_match_transformers(fam, tmp_path):
    """Prefill and step-by-step cached decoding agree with transformers within 1e-4."""
    ref = write_checkpoint(fam, tmp_path, seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = load_model(tmp_path, tokenizer=False).model
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ref(ids).logits
        got = model.logits(model(ids).hidden)
        cache = model.new_cache(64)
        steps = [model.logits(model(ids[:, :23], cache).hidden)]
        for t in range(23, 40):
            steps.append(model.logits(model(ids[:, t : t + 1], cache).hidden))
    assert (want - got).abs().max() < 1e-4
    assert (want - torch.cat(steps, 1)).abs().max() < 1e-4
    assert cache.length == 40


def _run(engine, prompt, k, **kw):
    res = Result()
    params = SamplingParams(max_tokens=kw.pop("max_tokens", 32), **kw)
    tokens = list(engine.generate(prompt, params, k, result=res, eos_ids=set()))
    return tokens, res


@pytest.mark.parametrize("name", FAMILY_IDS)
def test_greedy_mtp_equals_no_mtp(name, engine_factory):
    """Token-for-token equality for k = 1..5, over several prompts on one loaded engine."""
    engine = engine_factory(name)
    assert engine.has_mtp
    accepted = drafted = 0
    for prompt in PROMPTS:
        want, res0 = _run(engine, prompt, 0)
        assert res0.metrics.num_draft_tokens == 0
        for k in range(1, 6):
            got, res = _run(engine, prompt, k)
            assert got == want, f"k={k} prompt={prompt}"
            assert res.finish_reason == "length"
            drafted += res.metrics.num_draft_tokens
            accepted += res.metrics.num_accepted_tokens
            # The same request again on the same engine: nothing may leak between requests.
            assert _run(engine, prompt, k)[0] == want
    assert drafted > 0 and accepted > 0, "speculation never happened or never succeeded"
    assert accepted / drafted > 0.1


class ScriptedDrafter(MTPDrafter):
    """Proposes the known greedy continuation with a mistake planted at a chosen draft index,
    and, at the start of every round, checks every cache against a run without speculation."""

    def __init__(self, model, sequence, k, check):
        super().__init__(model)
        self.sequence, self.k, self.check = sequence, k, check
        self.round = 0
        self.planned: list[int] = []

    def propose(self, st, k, cache, params, gen):
        self.check(st)
        self.miss = self.round % (self.k + 1)  # index of the wrong draft (k: none)
        self.round += 1
        self.st = st
        tokens, q = super().propose(st, k, cache, params, gen)
        self.planned.append(min(self.miss, k))
        return tokens, q

    def pick(self, s, logits, params, gen):
        true = self.sequence[self.st.pos + 1 + s]
        return ((true + 1) % VOCAB if s == self.miss else true), None


def _kv_of(layer_cache):
    if isinstance(layer_cache, KVCache):
        n = layer_cache.length
        return [layer_cache.k[:, :, :n], layer_cache.v[:, :, :n]]
    return [layer_cache.conv_state, layer_cache.state]


@pytest.mark.parametrize("name", FAMILY_IDS)
@pytest.mark.parametrize("k", [1, 3, 4])
def test_scripted_drafts_every_accept_length_and_rollback(name, k, engine_factory):
    """Accept lengths 0..k all occur; after each step trunk and MTP caches equal a no-spec run."""
    engine = engine_factory(name)
    model = engine.model
    prompt = PROMPTS[0]
    reference, _ = _run(engine, prompt, 0, max_tokens=30)
    sequence = prompt + reference
    checks = []

    def check(st):
        # Trunk: a fresh run over the accepted tokens without speculation.
        ref_cache = model.new_cache(64)
        with torch.no_grad():
            model(torch.tensor([sequence[: st.pos]]), ref_cache)
        live = engine._cache
        assert live.length == st.pos
        for a, b in zip(live.layers, ref_cache.layers, strict=True):
            assert a.length == b.length == st.pos
            for x, y in zip(_kv_of(a), _kv_of(b), strict=True):
                assert torch.allclose(x, y, atol=1e-4), "trunk cache differs after rollback"
        # MTP head: entries (h_i, t_{i+1}) for every position before mtp_start.
        n = st.mtp_start
        if n:
            with torch.no_grad():
                out = model(torch.tensor([sequence[:n]]))
                ref_mtp = model.new_mtp_cache(64)
                h = out.for_mtp(model.mtp.spec.trunk_hidden)
                model.mtp_forward(torch.tensor([sequence[1 : n + 1]]), h, 0, 0, ref_mtp)
            live_mtp = engine._mtp_cache[0]
            assert live_mtp.length >= n
            assert torch.allclose(live_mtp.k[:, :, :n], ref_mtp[0].k[:, :, :n], atol=1e-4)
            assert torch.allclose(live_mtp.v[:, :, :n], ref_mtp[0].v[:, :, :n], atol=1e-4)
        checks.append(st.pos)

    drafter = ScriptedDrafter(model, sequence, k, check)
    res = Result()
    got = list(
        engine.generate(prompt, SamplingParams(max_tokens=30), k, result=res, drafter=drafter,
                        eos_ids=set())
    )
    assert got == reference
    assert len(checks) >= k + 1
    # Every planned accept length happened, and the metrics counted exactly those.
    m = res.metrics
    assert set(range(k + 1)) <= set(drafter.planned)
    assert m.num_accepted_tokens == sum(drafter.planned)


class SharpDrafter(MTPDrafter):
    """Samples drafts from a deliberately over-confident q (a few times p on its favourites):
    the accept rule must still give the target's distribution, and any error in the
    acceptance probability shows up strongly in the emitted frequencies."""

    def pick(self, s, logits, params, gen):
        q = probs(logits[0], SamplingParams(temperature=params.temperature * 0.3))
        return int(sample(q, gen)), q


def _chi2_homogeneous(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """Chi-square statistic of two count vectors and its 99.9% critical value."""
    keep = (a + b) >= 10  # sparse cells are pooled into one
    a = torch.cat([a[keep], a[~keep].sum()[None]])
    b = torch.cat([b[keep], b[~keep].sum()[None]])
    total = a + b
    nz = total > 0
    ea, eb = total[nz] * a.sum() / total.sum(), total[nz] * b.sum() / total.sum()
    chi2 = float(((a[nz] - ea) ** 2 / ea + (b[nz] - eb) ** 2 / eb).sum())
    dof = max(int(nz.sum()) - 1, 1)
    # 99.9% quantile, Wilson-Hilferty approximation.
    limit = dof * (1 - 2 / (9 * dof) + 3.09 * (2 / (9 * dof)) ** 0.5) ** 3
    return chi2, limit


def assert_same_sampled_distribution(sample, n: int, vocab_size: int = VOCAB) -> None:
    """Tokens at depths 2 and 4 of ``n`` seeded samples ``sample(k, seed) -> (tokens,
    result)`` are distributed alike without drafts (k=0) and with k=3, drafts made."""
    counts = {k: torch.zeros(2, vocab_size) for k in (0, 3)}
    drafted = 0
    for k in counts:
        for seed in range(n):
            tokens, res = sample(k, seed)
            counts[k][0, tokens[1]] += 1
            counts[k][1, tokens[3]] += 1
            drafted += res.metrics.num_draft_tokens
    assert drafted > 0
    for depth in (0, 1):
        chi2, limit = _chi2_homogeneous(counts[0][depth], counts[3][depth])
        assert chi2 < limit, f"depth {2 * depth + 2}: chi2={chi2:.1f} > {limit:.1f}"


@pytest.mark.parametrize("name", ["llama", "qwen3_next_dense"])
@pytest.mark.parametrize("drafter_cls", [MTPDrafter, SharpDrafter], ids=["head", "sharp"])
def test_sampling_distribution_unchanged_by_mtp(name, drafter_cls, engine_factory):
    """Sampling (T=0.5): token frequencies at depths 2 and 4 match with and without MTP."""
    engine = engine_factory(name)
    drafter = drafter_cls(engine.model)

    def sample(k: int, seed: int) -> tuple[list[int], Result]:
        res = Result()
        params = SamplingParams(max_tokens=4, temperature=0.5, seed=seed)
        return list(engine.generate(PROMPTS[1], params, k, result=res, drafter=drafter,
                                    eos_ids=set())), res

    assert_same_sampled_distribution(sample, 250)


def test_sampling_reproducible_with_seed(engine_factory):
    """The same seed gives the same sampled text, with MTP too."""
    engine = engine_factory("llama")
    a = _run(engine, PROMPTS[0], 3, temperature=0.8, top_p=0.9, top_k=20, seed=7)[0]
    b = _run(engine, PROMPTS[0], 3, temperature=0.8, top_p=0.9, top_k=20, seed=7)[0]
    assert a == b


def test_eos_inside_accepted_draft_stops(engine_factory):
    """A stop token inside an accepted draft ends the output there, as without MTP."""
    engine = engine_factory("llama")
    want, _ = _run(engine, PROMPTS[0], 0)
    eos = want[5]
    cut = want[: want.index(eos)]
    for k in (0, 2, 4):
        res = Result()
        got = list(engine.generate(PROMPTS[0], SamplingParams(max_tokens=32), k, result=res,
                                   eos_ids={eos}))
        assert got == cut and res.finish_reason == "stop"


def test_model_without_head_decodes_plainly(tmp_path):
    """A checkpoint without MTP tensors runs with k > 0 as plain decoding."""
    write_checkpoint(FAMILIES[0], tmp_path)
    model = load_model(tmp_path, tokenizer=False).model
    engine = Engine(model)
    assert not engine.has_mtp
    tokens, res = _run(engine, PROMPTS[0], 3)
    assert len(tokens) == 32 and res.metrics.num_draft_tokens == 0


# Trunks whose every layer attends in a way packed steps take: GQA, MLA (DeepSeek-V3 and
# its kin), hybrid Gated-DeltaNet (Qwen3-Next / 3.5), sliding windows and sinks (MiMo-V2,
# Step); not GLM-5's sparse attention (its indexers).
PACKABLE = {"llama", "llama_tied", "qwen2", "qwen3", "mimo", "glm4_moe", "qwen3_next_dense",
            "qwen3_next_moe", "qwen3_5_vlm", "deepseek_v3", "deepseek_v3_plain_q",
            "glm4_moe_lite", "kimi_k25", "mimo_v2_flash", "step3p7", "step3p5"}


def _layer_state(cache) -> list[torch.Tensor]:
    # What a layer's cache holds up to its length: keys and values (or latents), or a
    # recurrent layer's state and conv window.
    if hasattr(cache, "state"):
        return [cache.state, cache.conv_state]
    return [cache.k[:, :, : cache.length], cache.v[:, :, : cache.length]]


@pytest.mark.parametrize("name", FAMILY_IDS)
def test_packed_forward_equals_separate_forwards(name, engine_factory):
    """Several sequences in one trunk forward (serving's batched step) = each one alone,
    caches included; and after one sequence rolls back rejected drafts (a recurrent
    layer's per-position snapshot, a KV cache's length), the next packed step still
    equals the lone ones."""
    model = engine_factory(name).model
    assert model.packable() == (name in PACKABLE)
    if not model.packable():
        return
    g = torch.Generator().manual_seed(5)
    prefix = [torch.randint(0, VOCAB, (1, n), generator=g) for n in (7, 1, 12)]
    # A verification (4), a decode step (1) and a prefill chunk (9) in one forward; then
    # the first keeps 2 of its 4 rows and all three step again.
    steps = [[torch.randint(0, VOCAB, (1, n), generator=g) for n in sizes]
             for sizes in ((4, 1, 9), (3, 1, 2))]
    with torch.no_grad():
        solo, packed = [model.new_cache(64) for _ in prefix], [model.new_cache(64) for _ in prefix]
        for ids, a, b in zip(prefix, solo, packed, strict=True):
            model(ids, a)
            model(ids, b)
        for i, step in enumerate(steps):
            if i:
                for caches in (solo, packed):
                    caches[0].trim(prefix[0].shape[1] + 2)
            want = [model(ids, c) for ids, c in zip(step, solo, strict=True)]
            got = model.forward_packed(list(zip(step, packed, strict=True)))
            for w, o, a, b in zip(want, got, solo, packed, strict=True):
                assert o.hidden.shape == w.hidden.shape
                assert (model.logits(o.hidden) - model.logits(w.hidden)).abs().max() < 1e-4
                assert (o.pre_norm - w.pre_norm).abs().max() < 1e-4
                assert b.length == a.length
                for la, lb in zip(a, b, strict=True):
                    for x, y in zip(_layer_state(la), _layer_state(lb), strict=True):
                        assert (x - y).abs().max() < 1e-5
