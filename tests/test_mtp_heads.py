"""MTP layers' own output heads (the per-layer copies of the lm_head a release may carry), and
which layer runs the draft steps past the last one.

vLLM 0.33.0 scores a Step-3.5 / 3.7 layer's drafts with that layer's ``shared_head.output``
(its Step3p5MTPProposer keeps them), and every other MTP family's with the trunk's lm_head
(its MTP proposer puts the lm_head in place of each layer's ``shared_head.head``, which it
loaded from the copy). The tests give each layer a copy that differs from the lm_head, so
that the head that scores the drafts shows in the logits, and compare the drafter against
logits computed by hand from the checkpoint's tensors.
"""

from __future__ import annotations

import re
import warnings

import broken
import pytest
import torch
import torch.nn.functional as F
from tiny import VOCAB

from mtpkit.checkpoint import open_checkpoint
from mtpkit.doctor.checks import diagnose
from mtpkit.doctor.graft import graft
from mtpkit.doctor.layout import is_mtp_tensor
from mtpkit.engine.generate import DecodeState, Engine, MTPDrafter, Result
from mtpkit.engine.loader import load_model
from mtpkit.engine.sampling import SamplingParams
from mtpkit.models.mtp import DraftLayers, layer_for
from mtpkit.quant.linear import QuantLinear
from mtpkit.quant.pack import Scheme
from mtpkit.quant.quantize import quantize_checkpoint
from mtpkit.train.export import head_on_disk_names

# family -> (its MTP layers' copies of the lm_head, layer index in group 1 or 2; whether
# vLLM 0.33.0 scores that layer's drafts with the copy)
COPIES = {
    "step3p7": (r"model\.layers\.(\d+)\.transformer\.shared_head\.output\.weight$", True),
    "deepseek_v3": (r"model\.layers\.(\d+)\.shared_head\.head\.weight$", False),
    "deepseek_v4": (r"mtp\.(\d+)\.head\.weight$", False),
    "glm4_moe_lite": (r"model\.layers\.(\d+)\.shared_head\.head\.weight$", False),
    "glm_moe_dsa": (r"model\.layers\.(\d+)\.shared_head\.head\.weight$", False),
    # below the wrapper's prefix
    "kimi_k25": (r"language_model\.model\.layers\.(\d+)\.shared_head\.head\.weight$", False),
    # MiMo-V2-Flash's layers carry no copy of the lm_head (None: nothing to match)
    "mimo_v2_flash": (None, False),
}
FAMILIES = ["step3p7", "deepseek_v3", "deepseek_v4"]  # the drafting tests' families
# graft and quantize: every family with MTP layers of their own in the release's layout
GRAFTED = ["step3p7", "deepseek_v3", "glm4_moe_lite", "glm_moe_dsa", "kimi_k25",
           "mimo_v2_flash"]


def _load(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_model(path, tokenizer=False)


def copies(path, name: str) -> dict[int, torch.Tensor]:
    """MTP layer index -> that layer's copy of the lm_head, as stored."""
    pattern, _ = COPIES[name]
    if pattern is None:
        return {}
    n = 0 if name == "deepseek_v4" else broken.n_layers(broken.config(path))
    out = {}
    for k, v in broken.read_all(path).items():
        if m := re.search(pattern, k):
            out[int(m[1]) - n] = v
    return out


def _distinct(tensors: dict, name: str, layers=None) -> dict:
    # Each (chosen) layer's copy redrawn, at the scale randomize gives a Linear.
    pattern, _ = COPIES[name]
    for k, v in tensors.items():
        if pattern and (m := re.search(pattern, k)) and (layers is None or int(m[1]) in layers):
            g = torch.Generator().manual_seed(100 + int(m[1]))
            tensors[k] = (torch.randn(v.shape, generator=g) * 1.5 / v.shape[1] ** 0.5
                          ).to(v.dtype)
    return tensors


@pytest.fixture(scope="module")
def distinct(checkpoint_factory, tmp_path_factory):
    """family -> a copy of its checkpoint whose MTP layers' lm_head copies all differ from
    the lm_head and from each other."""
    made = {}

    def get(name: str):
        if name not in made:
            made[name] = broken.edit_tensors(checkpoint_factory(name),
                                             tmp_path_factory.mktemp(name) / "d",
                                             lambda t: _distinct(t, name))
        return made[name]

    return get


class _Recording(MTPDrafter):
    """The drafter, keeping the logits each draft was picked from."""

    def pick(self, s, logits, params, gen):
        """Record, then pick as the drafter does."""
        self.seen.append(logits[0].clone())
        return super().pick(s, logits, params, gen)


def _start(model, ids: list[int]) -> DecodeState:
    # The state after a prefill of ``ids``: the head catches up on every position.
    with torch.no_grad():
        out = model(torch.tensor([ids]))
        first = int(model.logits(out.hidden[:, -1]).argmax())
    return DecodeState(pos=len(ids), pending=first, mtp_start=0,
                       mtp_ids=torch.tensor([ids[1:] + [first]]),
                       mtp_hidden=out.for_mtp(model.mtp.spec.trunk_hidden))


@pytest.mark.parametrize("vocab", [None, "subset"])
@pytest.mark.parametrize("name", FAMILIES)
def test_drafts_are_scored_by_the_head_vllm_uses(name, vocab, distinct):
    """Five chained greedy drafts: each step's logits are its layer's copy (Step) or the
    lm_head (the others) applied by hand to the head's state, past the last layer layer 0's
    copy again and so on; never the other matrix's. With a draft vocabulary, those rows."""
    path = distinct(name)
    model = _load(path).model
    own = copies(path, name)
    uses_copy = COPIES[name][1]
    n = len(model.mtp.layers)
    assert sorted(own) == list(range(n))
    assert len(model.mtp.heads) == (n if uses_copy else 0)
    rows = torch.arange(0, VOCAB, 3) if vocab else None
    drafter = _Recording(model, rows)
    drafter.seen = []
    ids = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(7)).tolist()
    st = _start(model, ids)
    k = 5
    with torch.no_grad():
        tokens, _ = drafter.propose(st, k, model.new_mtp_cache(64), SamplingParams(), None)
        cache = model.new_mtp_cache(64)
        out = model.mtp_forward(st.mtp_ids, st.mtp_hidden, 0, 0, cache)
        pos = st.mtp_ids.shape[1]
        lm = model.lm_head.weight.float()
        for s in range(k):
            layer = s % n  # past the last layer, layers 0, 1... again
            used, other = (own[layer].float(), lm) if uses_copy else (lm, own[layer].float())
            h = out.hidden[:, -1].float()
            want, not_want = F.linear(h, used)[0], F.linear(h, other)[0]
            if rows is not None:
                want, not_want = want[rows], not_want[rows]
            torch.testing.assert_close(drafter.seen[s], want, rtol=0, atol=1e-5)
            assert (drafter.seen[s] - not_want).abs().max() > 1e-2
            pick = int(want.argmax())
            assert tokens[s] == (int(rows[pick]) if rows is not None else pick)
            if s + 1 < k:
                out = model.mtp_forward(torch.tensor([[tokens[s]]]),
                                        out.for_mtp(model.mtp.spec.chain_hidden)[:, -1:],
                                        s + 1, pos, cache)
                pos += 1


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_output_with_mtp_equals_without(name, distinct):
    """Lossless whatever head scores the drafts: k = 1..5 give the tokens k = 0 gives."""
    engine = Engine(_load(distinct(name)).model)
    prompt = torch.randint(0, VOCAB, (10,), generator=torch.Generator().manual_seed(3)).tolist()
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    plain = list(engine.generate(prompt, params, 0))
    for k in range(1, 6):
        res = Result()
        assert list(engine.generate(prompt, params, k, result=res)) == plain, k
        assert res.metrics.num_drafts > 0


def test_copies_equal_to_the_lm_head_allocate_nothing(checkpoint_factory, tmp_path):
    """The release's case, copies equal to the lm_head: no head of their own is kept, the
    model holds as many weights as without the copies; one differing copy keeps one head;
    no copies at all load as the lm_head too."""
    same = _load(checkpoint_factory("step3p7")).model
    assert len(same.mtp.heads) == 0
    assert same.draft_head(2) is same.lm_head
    one = broken.edit_tensors(checkpoint_factory("step3p7"), tmp_path / "one",
                              lambda t: _distinct(t, "step3p7", layers={5}))
    model = _load(one).model
    assert list(model.mtp.heads) == ["1"]
    assert model.draft_head(0) is model.lm_head and model.draft_head(1) is model.mtp.heads["1"]
    torch.testing.assert_close(model.mtp.heads["1"].weight, copies(one, "step3p7")[1],
                               rtol=0, atol=0)
    none = broken.edit_tensors(checkpoint_factory("step3p7"), tmp_path / "none", lambda t: {
        k: v for k, v in t.items() if not re.search(COPIES["step3p7"][0], k)})
    loaded = _load(none)
    assert len(loaded.model.mtp.heads) == 0 and len(loaded.model.mtp.layers) == 3
    size = sum(p.numel() for p in loaded.model.parameters())
    assert sum(p.numel() for p in same.parameters()) == size
    assert sum(p.numel() for p in model.parameters()) == size + VOCAB * model.config.hidden_size


@pytest.mark.parametrize("name", GRAFTED)
def test_graft_keeps_the_copies(name, distinct, tmp_path):
    """A head grafted into the trunk that lost it brings its layers' copies along, bit for
    bit (every MTP tensor under its own name), and the result drafts as the source does."""
    src = distinct(name)
    trunk = broken.drop_mtp(src, tmp_path / "trunk")
    assert not copies(trunk, name)
    res = graft(src, trunk, tmp_path / "out")
    out = res.out
    assert not [f for f in res.report.findings if f.severity == "error"], res.report.to_json()
    got, want = copies(out, name), copies(src, name)
    assert sorted(got) == sorted(want)
    for i in want:
        assert torch.equal(got[i], want[i]), i
    n = broken.n_layers(broken.config(src))
    head = {k: v for k, v in broken.read_all(src).items() if is_mtp_tensor(k, n)}
    grafted = {k: v for k, v in broken.read_all(out).items() if is_mtp_tensor(k, n)}
    assert sorted(grafted) == sorted(head)
    assert all(torch.equal(grafted[k], v) for k, v in head.items())
    a, b = _load(src).model, _load(out).model
    assert list(a.mtp.heads) == list(b.mtp.heads)
    for i, h in a.mtp.heads.items():
        assert torch.equal(h.weight, b.mtp.heads[i].weight)
    prompt = list(range(5, 15))
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    plain = list(Engine(a).generate(prompt, params, 0))
    ra, rb = Result(), Result()
    assert list(Engine(b).generate(prompt, params, 3, result=rb)) == plain
    list(Engine(a).generate(prompt, params, 3, result=ra))
    assert rb.metrics.num_accepted_tokens == ra.metrics.num_accepted_tokens


@pytest.mark.parametrize("which", ["source", "distinct"])
@pytest.mark.parametrize("lm_head", ["keep", "same"])
@pytest.mark.parametrize("name", GRAFTED)
def test_quantize_keeps_the_copies(name, lm_head, which, checkpoint_factory, distinct, tmp_path):
    """``mtpkit quantize``: the copies follow --lm-head as vLLM builds them (ParallelLMHeads):
    kept float and ignored, or quantized with the lm_head, for Step; DeepSeek-style copies
    (vLLM swaps them for the lm_head) stay float. doctor finds nothing wrong for vLLM, and the
    output loads with Step's own heads where they differ (quantized ones as QuantLinear; those
    equal to the lm_head, quantized alike, are dropped) and decodes losslessly."""
    src = (checkpoint_factory if which == "source" else distinct)(name)
    out = tmp_path / "q"
    if name == "kimi_k25" and lm_head == "same":
        # quantize's --lm-head same looks for lm_head.weight only (quant/quantize.py,
        # _untied); Kimi-K2.5 stores language_model.lm_head.weight. Pinned until it does.
        with pytest.raises(ValueError, match="no lm_head.weight"):
            quantize_checkpoint(src, out, Scheme("w8a16"), lm_head=lm_head)
        pytest.xfail("quantize --lm-head same does not find Kimi-K2.5's lm_head")
    quantize_checkpoint(src, out, Scheme("w8a16"), lm_head=lm_head)
    uses_copy = COPIES[name][1] and which == "distinct"
    quantized_copies = uses_copy and lm_head == "same"
    names = broken.read_all(out)
    if COPIES[name][0] is not None:
        stored = [k for k in names
                  if re.search(COPIES[name][0].replace(r"\.weight$", r"\."), k)]
        assert stored
        assert any(k.endswith(".weight_packed") or k.endswith(".weight_scale")
                   for k in stored) == (COPIES[name][1] and lm_head == "same")
    if not quantized_copies:
        want = copies(src, name)
        for i, t in copies(out, name).items():
            assert torch.equal(t, want[i])
    rep = diagnose(out, ["vllm"])
    assert not [f for f in rep.findings if f.severity == "error"], rep.to_json()
    model = _load(out).model
    assert len(model.mtp.heads) == (len(model.mtp.layers) if uses_copy else 0)
    for head in model.mtp.heads.values():
        assert isinstance(head, QuantLinear) == quantized_copies
    engine = Engine(model)
    prompt = list(range(5, 15))
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    plain = list(engine.generate(prompt, params, 0))
    assert list(engine.generate(prompt, params, 3)) == plain


@pytest.mark.parametrize("which", ["source", "distinct"])
def test_export_writes_the_copies_back(which, checkpoint_factory, distinct):
    """A recalibrated head is written back (train/export.py) with its layers' copies: the
    graft it goes through replaces every MTP tensor, and vLLM's Step layers draft with them."""
    path = (checkpoint_factory if which == "source" else distinct)("step3p7")
    tensors = head_on_disk_names(_load(path).model, open_checkpoint(path))
    pattern = COPIES["step3p7"][0]
    written = {k: v for k, v in tensors.items() if re.search(pattern, k)}
    stored = {k: v for k, v in broken.read_all(path).items() if re.search(pattern, k)}
    assert written.keys() == stored.keys()
    for k, v in stored.items():
        assert torch.equal(written[k], v), k


def test_training_scores_each_depth_with_its_layers_head(distinct):
    """calibrate's distillation loss scores depth d with layer (d - 1) % n's own head (the
    formula by hand, depths past the last layer included)."""
    from mtpkit.train.calibrate import distill_loss

    path = distinct("step3p7")
    model = _load(path).model
    own = copies(path, "step3p7")
    n, depth = len(model.mtp.layers), 4
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        got = distill_loss(model, ids, depth)[0]
        out = model(ids)
        teacher = torch.log_softmax(model.logits(out.hidden), -1)
        h, t, want = out.for_mtp(model.mtp.spec.trunk_hidden), ids.shape[1], 0.0
        for d in range(1, depth + 1):
            m = t - 1 - d
            cos, sin = model.mtp_rotary.cos_sin(torch.arange(m))
            post, pre = model.mtp(model.model.embed_tokens(ids[:, d:d + m]), h[:, :m], d - 1,
                                  cos, sin, None)
            logp = torch.log_softmax(F.linear(post, own[(d - 1) % n].float()), -1)
            want += float(-(teacher[:, d:d + m].exp() * logp).sum(-1).mean())
            h = pre
    assert abs(float(got) - want) < 1e-4


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_layer_rule(n):
    """Draft step s runs layer s, past the last layer cycling as vLLM does (s % n)."""
    for s in range(12):
        assert layer_for(s, n) == (s if s < n else layer_for(s - n, n))
        assert layer_for(s, n) < n


@pytest.mark.parametrize("name", ["step3p7", "mimo_v2_flash", "deepseek_v4"])
def test_steps_past_the_last_layer_cycle(name, distinct, checkpoint_factory):
    """Every multi-layer family (DeepSeek-V4's own MTP module included) runs steps 0, n and
    2n through layer 0, step n + 1 through layer 1, and scores them with that layer's head;
    step n - 1 (the last layer) differs."""
    path = distinct(name) if name in COPIES else checkpoint_factory(name)
    model = _load(path).model
    n = len(model.mtp.layers)
    assert n > 1
    assert type(model.mtp).layer_for is DraftLayers.layer_for  # one rule for every family
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, VOCAB, (1, 9), generator=g)
    with torch.no_grad():
        h = model(ids).for_mtp(model.mtp.spec.trunk_hidden)[:, :-1]
        steps = (0, 1, n - 1, n, n + 1, 2 * n)
        outs = {s: model.mtp_forward(ids[:, 1:], h, s, 0, None) for s in steps}
        logits = {s: model.draft_logits(o.hidden, s) for s, o in outs.items()}
    for s, same in ((n, 0), (2 * n, 0), (n + 1, 1)):
        assert torch.equal(outs[s].hidden, outs[same].hidden)
        assert torch.equal(logits[s], logits[same])
        assert model.mtp.layer_for(s) == same
    assert (outs[n].hidden - outs[n - 1].hidden).abs().max() > 1e-3


def test_fast_path_refuses_own_heads(checkpoint_factory):
    """The compiled path scores drafts with the lm_head: it does not take a model whose MTP
    layer has an output head of its own."""
    from mtpkit.engine.programs import unsupported_reason

    model = _load(checkpoint_factory("llama")).model
    assert unsupported_reason(model) is None
    model.mtp.heads["0"] = torch.nn.Linear(model.config.hidden_size, VOCAB, bias=False)
    assert "output heads of their own" in unsupported_reason(model)
