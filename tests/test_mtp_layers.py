"""Heads of several MTP layers: per-layer acceptance counters, calibrate training every layer,
and every layer's cache after rollback.

Draft step s runs layer ``s % n`` (models/mtp.py, layer_for); with k above the layer count the
positions cycle back to layer 0. The families below ship several layers and tests/tiny.py
builds them: Step-3.7 and MiMo-V2-Flash (3 layers), DeepSeek-V4 (2).
"""

from __future__ import annotations

import inspect
import json
import shutil
import warnings
from dataclasses import dataclass

import broken
import pytest
import torch
from tiny import VOCAB, write_char_tokenizer

from mtpkit.engine.generate import Engine, MTPDrafter, Result
from mtpkit.engine.loader import load_model
from mtpkit.engine.metrics import SpecMetrics
from mtpkit.engine.sampling import SamplingParams
from mtpkit.models.cache import KVCache
from mtpkit.serve.prometheus import ServeStats
from mtpkit.train.calibrate import CalibrateConfig, run

MULTI = ["step3p7", "mimo_v2_flash", "deepseek_v4"]
K = 5  # above every family's layer count: positions 3 and 4 (and 2 for V4) cycle
PROMPT = [3, 17, 42, 8, 60, 61]
MAX_TOKENS = 40


def _load(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_model(path, tokenizer=False)


@pytest.fixture(scope="module")
def engine(checkpoint_factory):
    """family -> an Engine over its tiny checkpoint (loaded once)."""
    made = {}

    def get(name: str) -> Engine:
        if name not in made:
            made[name] = Engine(_load(checkpoint_factory(name)).model)
        return made[name]

    return get


def _plain(engine: Engine) -> list[int]:
    params = SamplingParams(max_tokens=MAX_TOKENS)
    return list(engine.generate(PROMPT, params, 0, eos_ids=set()))


class Planted(MTPDrafter):
    """Drafts the known greedy continuation with a wrong token planted at draft index
    ``round % (K + 1)`` (K: none), so every accept length 0..K occurs. Records, from forward
    hooks on the layer modules, which MTP layer produced each draft, and calls ``check(st)``
    at the start of each round. ``cap`` drafts no further than the planted miss (a
    reference whose head never sees a rejected token)."""

    def __init__(self, model, sequence, check=None, cap: bool = False):
        super().__init__(model)
        self.sequence, self.check, self.cap = sequence, check, cap
        self.round = 0
        self.rounds: list[tuple[list[int], int]] = []  # (layer of each draft, accepted)
        self.ran: list[int] = []
        for i, layer in enumerate(model.mtp.layers):
            layer.register_forward_hook(lambda *_, i=i: self.ran.append(i))

    def propose(self, st, k, cache, params, gen):
        if self.check is not None:
            self.check(st)
        self.miss = self.round % (K + 1)
        self.round += 1
        self.st, self.ran[:] = st, []
        if self.cap:
            k = min(k, self.miss + 1)
        tokens, q = super().propose(st, k, cache, params, gen)
        # Step s's forward (one layer call) gives draft s.
        self.rounds.append((list(self.ran[:k]), min(self.miss, k)))
        return tokens, q

    def pick(self, s, logits, params, gen):
        true = self.sequence[self.st.pos + 1 + s]
        return ((true + 1) % VOCAB if s == self.miss else true), None

    def close(self) -> None:
        """Remove the hooks (the engine's model is shared by the module's tests)."""
        for layer in self.model.mtp.layers:
            layer._forward_hooks.clear()


def _planted_run(engine: Engine, check=None, cap: bool = False):
    reference = _plain(engine)
    drafter = Planted(engine.model, PROMPT + reference, check, cap)
    res = Result()
    try:
        got = list(engine.generate(PROMPT, SamplingParams(max_tokens=MAX_TOKENS), K,
                                   result=res, drafter=drafter, eos_ids=set()))
    finally:
        drafter.close()
    assert got == reference
    return drafter, res.metrics


# -- a. per-layer counters ---------------------------------------------------------------------
@pytest.mark.parametrize("name", MULTI)
def test_per_layer_counters_equal_a_hand_count(name, engine):
    """k = 5 over 2 or 3 layers: each layer's drafted / accepted counts equal the count of the
    drafts its module produced (forward hooks) and of those verification took; they are the
    per-position counts folded by position % n, and the summary line and as_dict show them."""
    eng = engine(name)
    n = len(eng.model.mtp.layers)
    assert 1 < n < K
    drafter, m = _planted_run(eng)
    drafted, accepted = [0] * n, [0] * n
    for layers, n_acc in drafter.rounds:
        for s, layer in enumerate(layers):
            drafted[layer] += 1
            accepted[layer] += int(s < n_acc)
    assert m.mtp_layers == n
    assert m.drafts_per_layer == drafted
    assert m.accepted_per_layer == accepted
    assert {a for _, a in drafter.rounds} == set(range(K + 1))  # every accept length
    assert drafted[0] > m.num_drafts  # layer 0 drafted at positions 0 and n: it cycled
    folded_d, folded_a = [0] * n, [0] * n
    for p, (d, a) in enumerate(zip(m.drafts_per_pos, m.accepted_per_pos, strict=True)):
        folded_d[p % n] += d
        folded_a[p % n] += a
    assert (folded_d, folded_a) == (drafted, accepted)
    assert sum(drafted) == m.num_draft_tokens and sum(accepted) == m.num_accepted_tokens
    d = m.as_dict()
    assert d["num_draft_tokens_per_layer"] == drafted
    assert d["num_accepted_tokens_per_layer"] == accepted
    assert d["per_layer_acceptance_rate"] == [a / x for a, x in zip(accepted, drafted, strict=True)]
    rates = ", ".join(f"{a / x:.3f}" for a, x in zip(accepted, drafted, strict=True))
    assert m.vllm_line().endswith(f"Per-MTP-layer acceptance rate: {rates}")


def test_per_layer_counters_sum_and_reach_metrics_page():
    """SpecMetrics.add sums the per-layer counters; /metrics exports each layer's drafted and
    accepted counts as turn deltas (mtpkit:spec_decode_num_*_tokens_per_layer_total); a
    one-layer head keeps vLLM's line unchanged."""
    from mtpkit.serve.scheduler import _Seen

    @dataclass
    class Req:
        completion_tokens: int = 0

    @dataclass(eq=False)
    class Worker:
        result: Result
        seen: _Seen
        req: Req
        last_emit: float | None = None

    stats = ServeStats("m")
    workers = [Worker(Result(), _Seen(), Req()) for _ in range(2)]
    for w in workers:
        w.result.metrics.mtp_layers = 3
    total = SpecMetrics()
    plan = [(0, 5, 4), (1, 5, 1), (0, 2, 2), (1, 4, 0), (0, 5, 5)]
    for i, drafted, acc in plan:
        workers[i].result.metrics.record(drafted, acc)
        stats.turn(workers[i])
    for w in workers:
        total.add(w.result.metrics)
    assert total.drafts_per_layer == [9, 8, 4] and total.accepted_per_layer == [6, 4, 2]
    page = stats.render(0, 0, 0, 0.0, True)
    for what, want in (("draft", total.drafts_per_layer),
                       ("accepted", total.accepted_per_layer)):
        for layer, v in enumerate(want):
            line = (f'mtpkit:spec_decode_num_{what}_tokens_per_layer_total{{model_name="m",'
                    f'layer="{layer}"}} {v}')
            assert line in page.splitlines(), line
    one = SpecMetrics()
    one.record(3, 2)
    assert one.drafts_per_layer == [3] and one.vllm_line().endswith("rate: 66.7%")


# -- b. calibrate trains every layer -----------------------------------------------------------
def _layer_tensors(model, i: int) -> dict[str, torch.Tensor]:
    # Layer i's own weights: its block and, where each layer carries one, its combine.
    own = {f"layers.{i}.{k}": v for k, v in model.mtp.layers[i].state_dict().items()}
    per = getattr(model.mtp, "per_layer", {})
    if str(i) in per:
        own.update({f"per_layer.{i}.{k}": v for k, v in per[str(i)].state_dict().items()})
    return own


@pytest.mark.parametrize("name", MULTI)
def test_calibrate_head_trains_every_layer(name, checkpoint_factory, tmp_path):
    """calibrate --init head, default depth: every MTP layer's weights change; the written
    checkpoint keeps its tensor names, shapes and trunk, loads back with every layer, and
    greedy output with MTP (k = 5) equals output without."""
    src = tmp_path / "src"
    shutil.copytree(checkpoint_factory(name), src)
    write_char_tokenizer(src)
    data = tmp_path / "data.txt"
    data.write_text(inspect.getsource(inspect)[:20000])
    out = tmp_path / "recal"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run(CalibrateConfig(model=str(src), data=[str(data)], out=str(out), init="head",
                            seq_len=24, batch_size=2, steps=3, heldout_fraction=0.0,
                            checkpoint_every=0), progress="off")
    before, after = _load(src).model, _load(out).model
    n = len(before.mtp.layers)
    assert n > 1 and len(after.mtp.layers) == n
    summary = json.loads((out / "mtpkit_calibration.json").read_text())
    assert summary["calibration"]["draft_depth"] == n
    for i in range(n):
        old, new = _layer_tensors(before, i), _layer_tensors(after, i)
        assert old.keys() == new.keys()
        changed = [k for k in old if not torch.equal(old[k], new[k])]
        assert changed, f"MTP layer {i} was written back untrained"
    was, now = broken.read_all(src), broken.read_all(out)
    assert was.keys() == now.keys()
    assert all(was[k].shape == now[k].shape and was[k].dtype == now[k].dtype for k in was)
    trunk = [k for k in was if torch.equal(was[k], now[k])]
    assert len(trunk) < len(was)  # the head's tensors, and only those, were rewritten
    for k, v in _load(src).model.state_dict().items():
        if not k.startswith("mtp."):
            assert torch.equal(v, after.state_dict()[k]), k
    eng = Engine(after)
    params = SamplingParams(max_tokens=24)
    plain = list(eng.generate(PROMPT, params, 0, eos_ids=set()))
    assert list(eng.generate(PROMPT, params, K, eos_ids=set())) == plain


def test_calibrate_depth_below_layer_count_names_the_untouched_layers(checkpoint_factory, tmp_path):
    """An explicit --draft-depth below the layer count of a loaded head warns, naming the
    layers written back unchanged (they are, bit for bit)."""
    src = tmp_path / "src"
    shutil.copytree(checkpoint_factory("mimo_v2_flash"), src)
    write_char_tokenizer(src)
    data = tmp_path / "data.txt"
    data.write_text(inspect.getsource(inspect)[:8000])
    out = tmp_path / "recal"
    with pytest.warns(UserWarning, match=r"layers 1, 2 of this 3-layer head are written back "
                                         r"unchanged.*drop --draft-depth"):
        run(CalibrateConfig(model=str(src), data=[str(data)], out=str(out), init="head",
                            draft_depth=1, seq_len=24, batch_size=2, steps=2,
                            heldout_fraction=0.0, checkpoint_every=0), progress="off")
    before, after = _load(src).model, _load(out).model
    assert not all(torch.equal(v, _layer_tensors(after, 0)[k])
                   for k, v in _layer_tensors(before, 0).items())
    for i in (1, 2):
        assert all(torch.equal(v, _layer_tensors(after, i)[k])
                   for k, v in _layer_tensors(before, i).items())


# -- c. every layer's cache after rollback -----------------------------------------------------
def _entries(cache, end: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Which of positions 0..end-1 hold an entry, and the entries there (keys, values)."""
    assert isinstance(cache, KVCache)
    held = torch.zeros(end, dtype=torch.bool)
    n = min(cache.length, end)
    held[:n] = True if cache.valid is None else cache.valid[:n].cpu()
    return held, [t[:, :, :end][:, :, held] for t in (cache.k, cache.v)]


@pytest.mark.parametrize("name", MULTI)
def test_every_layers_cache_after_rollback(name, engine):
    """k = 5 with a planted rejection at every draft index: at the start of each round, every
    MTP layer's cache holds what a run whose head only ever saw accepted tokens holds (the
    same rounds, each drafting no further than its rejected token), over every position that
    layer's next draft step can read; layer 0 from its catch-up point on is recomputed."""
    eng = engine(name)
    n = len(eng.model.mtp.layers)
    snaps: list[tuple[int, int, list]] = []

    def snapshot(st):
        snaps.append((st.pos, st.mtp_start, [
            (c.length, c.k.clone(), c.v.clone(), None if c.valid is None else c.valid.clone())
            for c in eng._mtp_cache.layers]))

    model = eng.model
    sequence = PROMPT + _plain(eng)
    _planted_run(eng, snapshot, cap=True)
    want = snaps
    seen = []

    def check(st):
        pos, start, layers = want[len(seen)]
        assert (st.pos, st.mtp_start) == (pos, start)
        if start:
            # Layer 0 against a catch-up from scratch over the accepted tokens: it holds
            # every position before the catch-up point.
            with torch.no_grad():
                h = model(torch.tensor([sequence[:start]])).for_mtp(model.mtp.spec.trunk_hidden)
                fresh = model.new_mtp_cache(eng._mtp_cache[0].max_len)
                model.mtp_forward(torch.tensor([sequence[1:start + 1]]), h, 0, 0, fresh)
            held, kv = _entries(eng._mtp_cache[0], start)
            assert bool(held.all()), (f"MTP layer 0 masks positions "
                                      f"{(~held).nonzero().flatten().tolist()} it holds")
            for a, b in zip(kv, _entries(fresh[0], start)[1], strict=True):
                assert torch.allclose(a, b, atol=1e-4), "MTP layer 0 differs from a catch-up"
        for i, (live, ref) in enumerate(zip(eng._mtp_cache.layers, layers, strict=True)):
            end = start if i == 0 else pos + i - 1  # layer i's next write is at pos + i - 1
            ref_cache = KVCache.__new__(KVCache)
            ref_cache.length, ref_cache.k, ref_cache.v, ref_cache.valid = ref
            held, kv = _entries(live, end)
            want_held, want_kv = _entries(ref_cache, end)
            assert torch.equal(held, want_held), (
                f"round {len(seen)}: MTP layer {i} holds entries at positions "
                f"{(held & ~want_held).nonzero().flatten().tolist()} written from rejected "
                "drafts")
            for a, b in zip(kv, want_kv, strict=True):
                assert torch.allclose(a, b, atol=1e-5), f"MTP layer {i} entries differ"
        seen.append(st.pos)

    drafter, _ = _planted_run(eng, check)
    assert len(seen) == len(want) and len(seen) > K + 1
    assert any(a < min(K, len(layers)) for layers, a in drafter.rounds)  # rejections happened
    assert n > 1
