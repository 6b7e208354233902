"""EAGLE-3 heads: drafting stays lossless on the eager engine, the fast path and the server,
the fast path drafts as the eager engine does, the head computes what vLLM's
Eagle3LlamaForCausalLM computes from the exported folder, calibrate trains one, and
llama.cpp's converter and llama-server run the export (when MTPKIT_LLAMA_SERVER and
MTPKIT_LLAMA_CONVERTER are given) with its output and acceptance as mtpkit's.

The trunk is a tiny 8-layer Llama, so that vLLM's default aux layer ids (2, 4, 5) apply, with
the byte-level BPE tokenizer test_llama_cpp.py builds for llama.cpp.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import tiny
import torch
from safetensors.torch import load_file
from test_families import assert_same_sampled_distribution
from test_fast import _fast
from test_llama_cpp import (
    LlamaServer,
    _bpe_tokenizer,
    _gguf,
    _gguf_contents,
    _run_converter,
    _tokens,
    needs_converter,
    needs_server,
)

from mtpkit.checkpoint.errors import CheckpointError
from mtpkit.checkpoint.tokenizer import Tokenizer
from mtpkit.engine.generate import Engine, MTPDrafter, Result
from mtpkit.engine.loader import load_model
from mtpkit.engine.sampling import SamplingParams
from mtpkit.train import eagle3
from mtpkit.train.calibrate import CalibrateConfig, distill_loss
from mtpkit.train.heads import HEAD_CONFIG, save_head

VOCAB = 512
LAYERS = 8
DRAFT_VOCAB = 384
PROMPTS = ["def f(x):\n    return", "The quick brown fox", "import os\nimport sys\n"]


def _llama8():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rope_theta=10000.0, tie_word_embeddings=False))


@pytest.fixture(scope="module")
def trunk(tmp_path_factory):
    """(folder, transformers model) of the tiny trunk, with its tokenizer."""
    out = tmp_path_factory.mktemp("eagle3") / "trunk"
    hf = tiny.write_checkpoint(tiny.Family("llama8", _llama8), out)
    _bpe_tokenizer(out)
    return out, hf.eval()


def _quiet_load(path, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_model(path, **kw)


def _train_head(trunk_dir: Path, out: Path, aux_layers=None, steps: int = 80) -> Path:
    """A head trained briefly (calibrate's loss, two chained depths) on the trunk's own
    greedy continuations, drafting from their most frequent tokens."""
    loaded = _quiet_load(trunk_dir)
    model = loaded.model
    g = torch.Generator().manual_seed(0)
    # Greedy continuations of the test prompts and of random ones: the text drafting meets.
    starts = [loaded.tokenizer.encode(p)[:4] for p in PROMPTS]
    data = torch.cat([torch.tensor(starts), torch.randint(0, VOCAB, (61, 4), generator=g)])
    with torch.no_grad():
        for _ in range(36):
            data = torch.cat([data, model.logits(model(data).hidden[:, -1:]).argmax(-1)], 1)
    counts = torch.bincount(data.flatten(), minlength=VOCAB)
    vocab = torch.argsort(counts, descending=True, stable=True)[:DRAFT_VOCAB].tolist()
    head = eagle3.new_head(model, vocab, aux_layers)
    head.train()
    params = [p for p in head.parameters() if p.is_floating_point()]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=3e-3)
    for _ in range(steps):
        loss, _, _ = distill_loss(model, data, 2)
        opt.zero_grad()
        loss.backward()
        opt.step()
    head.eval().requires_grad_(False)
    save_head(head, out, eagle3.head_config(model))
    return out


@pytest.fixture(scope="module")
def head(trunk, tmp_path_factory) -> Path:
    return _train_head(trunk[0], tmp_path_factory.mktemp("eagle3-head") / "head")


@pytest.fixture(scope="module")
def engine(trunk, head) -> Engine:
    loaded = _quiet_load(trunk[0], head=head)
    return Engine(loaded.model, loaded.tokenizer, draft_vocab=loaded.draft_vocab)


def _run(engine, ids, k, **kw):
    res = Result()
    params = SamplingParams(max_tokens=kw.pop("max_tokens", 32), **kw)
    return list(engine.generate(ids, params, k, result=res)), res


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_greedy_with_the_head_equals_greedy_without(engine, k):
    """Greedy tokens with k EAGLE-3 drafts are the tokens without drafting, and the head
    drafts tokens the trunk accepts."""
    accepted = 0
    for prompt in PROMPTS:
        ids = engine.tokenizer.encode(prompt)
        plain, _ = _run(engine, ids, 0, ignore_eos=True)
        spec, res = _run(engine, ids, k, ignore_eos=True)
        assert spec == plain
        assert res.metrics.num_draft_tokens > 0
        accepted += res.metrics.num_accepted_tokens
    assert accepted > 0


def test_sampling_distribution_unchanged_by_the_head(engine):
    """Sampling (T=0.7): token frequencies at depths 2 and 4 match with and without drafts
    (the accept rule with a draft q that is zero outside the draft vocabulary)."""
    ids = engine.tokenizer.encode(PROMPTS[1])
    assert_same_sampled_distribution(
        lambda k, seed: _run(engine, ids, k, max_tokens=4, temperature=0.7, seed=seed,
                             ignore_eos=True), 250, VOCAB)


# -- a slow reference of vLLM's Eagle3LlamaForCausalLM, reading the exported folder --------
def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, theta):
    hd = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    ang = pos[:, None].float() * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class VllmEagle3:
    """EAGLE-3 drafting as vLLM runs it, from the exported folder, written without mtpkit:
    names as vLLM's loader maps them (``midlayer.`` is layer 0, d2t the draft-to-target
    offsets), fc on the trunk's aux states only, the layer's pre-norm output chained, the
    draft logits scattered into the target vocabulary with -inf elsewhere. Every step
    recomputes attention over all positions (no cache)."""

    def __init__(self, folder: Path) -> None:
        self.cfg = json.loads((folder / "config.json").read_text())
        self.w = {k: (v.float() if v.is_floating_point() else v)
                  for k, v in load_file(folder / "model.safetensors").items()}
        self.emb_in: list[torch.Tensor] = []
        self.g_in: list[torch.Tensor] = []

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        return aux @ self.w["fc.weight"].T

    def step(self, embeds: torch.Tensor, g: torch.Tensor):
        """Append positions (embeds, g) [T, D]; -> (full logits, pre-norm state) of the last."""
        self.emb_in.append(embeds)
        self.g_in.append(g)
        e, h = torch.cat(self.emb_in), torch.cat(self.g_in)
        c, w, eps = self.cfg, self.w, self.cfg["rms_norm_eps"]
        t, hd = e.shape[0], c["head_dim"]
        x = torch.cat([_rms(e, w["midlayer.input_layernorm.weight"], eps),
                       _rms(h, w["midlayer.hidden_norm.weight"], eps)], -1)
        pos = torch.arange(t)
        q = (x @ w["midlayer.self_attn.q_proj.weight"].T).view(t, -1, hd).transpose(0, 1)
        k = (x @ w["midlayer.self_attn.k_proj.weight"].T).view(t, -1, hd).transpose(0, 1)
        v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(t, -1, hd).transpose(0, 1)
        q, k = _rope(q, pos, c["rope_theta"]), _rope(k, pos, c["rope_theta"])
        rep = q.shape[0] // k.shape[0]
        k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
        att = (q @ k.transpose(1, 2)) / hd**0.5
        att = att.masked_fill(torch.triu(torch.ones(t, t, dtype=torch.bool), 1), float("-inf"))
        o = (att.softmax(-1) @ v).transpose(0, 1).reshape(t, -1)
        residual = o @ w["midlayer.self_attn.o_proj.weight"].T + h
        y = _rms(residual, w["midlayer.post_attention_layernorm.weight"], eps)
        mlp = (torch.nn.functional.silu(y @ w["midlayer.mlp.gate_proj.weight"].T)
               * (y @ w["midlayer.mlp.up_proj.weight"].T)) @ w["midlayer.mlp.down_proj.weight"].T
        prenorm = (mlp + residual)[-1]
        draft = _rms(prenorm, w["norm.weight"], eps) @ w["lm_head.weight"].T
        full = torch.full((c["vocab_size"],), float("-inf"))
        full[torch.arange(c["draft_vocab_size"]) + w["d2t"]] = draft
        return full, prenorm


def _aux_states(hf, ids: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    """vLLM's aux states from transformers: the residual stream entering layer L (L = n: the
    last layer's output before the final norm), gathered in layer order."""
    seen = {}
    hook = hf.model.norm.register_forward_pre_hook(lambda m, a: seen.update(last=a[0]))
    try:
        with torch.no_grad():
            states = hf(ids, output_hidden_states=True).hidden_states
    finally:
        hook.remove()
    n = len(hf.model.layers)
    return torch.cat([seen["last"] if L == n else states[L] for L in sorted(layer_ids)], -1)[0]


@pytest.mark.parametrize("aux_layers", [None, [0, 3, LAYERS]], ids=["default", "ends"])
def test_head_logits_equal_vllms_from_the_export(trunk, head, tmp_path, aux_layers):
    """Catch-up over a prompt and four chained steps: mtpkit's draft logits (through the
    engine's drafter) equal the reference's on the exported folder, and both draft the same
    tokens; the exported config names vLLM's architecture and keys."""
    from mtpkit.train.export_eagle3 import export_eagle3

    trunk_dir, hf = trunk
    if aux_layers is not None:
        head = _train_head(trunk_dir, tmp_path / "head", aux_layers, steps=1)
    out = export_eagle3(trunk_dir, head, tmp_path / "export", dtype="float32")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["num_hidden_layers"] == 1 and cfg["draft_vocab_size"] == DRAFT_VOCAB
    ids_used = cfg["eagle_aux_hidden_state_layer_ids"]
    assert ids_used == (aux_layers or [2, LAYERS // 2, LAYERS - 3])
    tensors = load_file(out / "model.safetensors")
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert int(tensors["t2d"].sum()) == DRAFT_VOCAB

    model = _quiet_load(trunk_dir, head=head, tokenizer=False).model
    drafter = MTPDrafter(model)
    ref = VllmEagle3(out)
    ids = torch.tensor([Tokenizer.from_hf_dir(trunk_dir).encode(PROMPTS[0])])
    with torch.no_grad():
        trunk_out = model(ids)
        nxt = int(model.logits(trunk_out.hidden[:, -1]).argmax())
        assert nxt == int(hf(ids).logits[0, -1].argmax())
        nxt_ids = torch.cat([ids[:, 1:], torch.tensor([[nxt]])], 1)
        aux = _aux_states(hf, ids, ids_used)
        torch.testing.assert_close(trunk_out.aux[0], aux, rtol=1e-4, atol=1e-4)
        theirs, g = ref.step(hf.model.embed_tokens(nxt_ids[0]), ref.combine(aux))
        cache = model.new_mtp_cache(64)
        o = model.mtp_forward(nxt_ids, trunk_out.aux, 0, 0, cache)
        pos = ids.shape[1]
        for s in range(5):
            ours = torch.full((VOCAB,), float("-inf"))
            ours[drafter.vocab] = drafter.head_logits(o.hidden[:, -1], s)[0]
            keep = theirs > float("-inf")
            assert torch.equal(ours > float("-inf"), keep)
            torch.testing.assert_close(ours[keep], theirs[keep], rtol=1e-4, atol=1e-4)
            token = int(theirs.argmax())
            assert int(drafter.vocab[drafter.head_logits(o.hidden[:, -1], s).argmax()]) == token
            if s == 4:
                break
            theirs, g = ref.step(hf.model.embed_tokens(torch.tensor([token])), g[None])
            # Chained as the drafter chains (MTPDrafter.propose).
            h = o.for_mtp(drafter.spec.chain_hidden)[:, -1:]
            o = model.mtp_forward(torch.tensor([[token]]), h, s + 1, pos, cache)
            pos += 1


def test_head_format_is_checked(trunk, head, tmp_path):
    """A head folder says its type and format version; an unknown type or a later version is
    refused with the fix (upgrade), and an EAGLE-3 head does not export as MiMo's layout."""
    import shutil

    from mtpkit.train.export import export_head

    cfg = json.loads((head / HEAD_CONFIG).read_text())
    assert cfg["head_type"] == "eagle3" and cfg["version"] == 2
    for change in ({"version": 3}, {"head_type": "medusa"}):
        bad = tmp_path / f"bad-{next(iter(change.values()))}"
        shutil.copytree(head, bad)
        (bad / HEAD_CONFIG).write_text(json.dumps({**cfg, **change}))
        with pytest.raises(CheckpointError, match="upgrade mtpkit"):
            _quiet_load(trunk[0], head=bad, tokenizer=False)
    with pytest.raises(ValueError, match="--format eagle3"):
        export_head(trunk[0], head, tmp_path / "mimo")


def test_fast_path_drafts_as_the_eager_engine(engine):
    """The fast path runs an EAGLE-3 head (its trunk steps hand the head fc over the three
    layers' states, its head steps attend over [norm(embedding), norm(state)] and score the
    head's own draft vocabulary): the eager engine's tokens and its drafted and accepted
    counts, at every depth, one sequence at a time and in the batched passes."""
    from mtpkit.engine.fast import FastDecoder
    from mtpkit.engine.programs import unsupported_reason

    assert unsupported_reason(engine.model) is None
    dec = FastDecoder(engine.model, backend="eager", max_len=128)
    assert dec.programs.eagle3 and torch.equal(dec.programs.vocab, engine.model.mtp.target_ids())
    accepted = 0
    for prompt in PROMPTS:
        ids = engine.tokenizer.encode(prompt)
        plain, _ = _run(engine, ids, 0, max_tokens=24, ignore_eos=True)
        for k in range(4):
            got, res = _fast(dec, ids, k)
            want, ref = _run(engine, ids, k, max_tokens=24, ignore_eos=True)
            assert got == want == plain, (prompt, k)
            m, r = res.metrics, ref.metrics
            assert (m.num_draft_tokens, m.num_accepted_tokens) == \
                (r.num_draft_tokens, r.num_accepted_tokens), (prompt, k)
            accepted += m.num_accepted_tokens
    assert accepted > 0
    # Batched rounds (a server's step over several sequences) against each sequence alone.
    pr = dec.programs
    items = []
    for prompt in PROMPTS:
        ids = engine.tokenizer.encode(prompt)
        d = dec.fork()
        first, drafts, _ = d.prefill(ids, 2)
        tokens = torch.cat([first.view(1), drafts]).view(1, -1)
        pos0 = torch.tensor([len(ids)])
        items.append((tokens, pos0, d.kc, d.vc, d.hk, d.hv, d.span(len(ids) + 3)))
    with torch.inference_mode():
        alone = [pr.round(*it[:7], 2) for it in items]
        together = pr.round_many(items, 2)
    for (out, ps), (out2, ps2) in zip(alone, together, strict=True):
        assert torch.equal(out, out2)
        torch.testing.assert_close(ps, ps2)


def test_fast_path_samples_the_trunks_distribution(engine):
    """Sampling (T=0.7) through the fast path with the head drafting from its own
    vocabulary: token frequencies at depths 2 and 4 match those without drafts."""
    from mtpkit.engine.fast import FastDecoder

    dec = FastDecoder(engine.model, backend="eager", max_len=128)
    ids = engine.tokenizer.encode(PROMPTS[1])

    def sample(k, seed):
        res = Result()
        params = SamplingParams(max_tokens=4, temperature=0.7, seed=seed, ignore_eos=True)
        return list(dec.generate(ids, 4, k, result=res, eos_ids=set(), params=params)), res

    assert_same_sampled_distribution(sample, 250, VOCAB)


@pytest.mark.parametrize("fast", [False, True], ids=["eager", "fast"])
def test_server_scheduler_runs_the_head_exactly(engine, fast):
    """The server's scheduler (packed trunk passes, chunked prefill; or the fast path's
    pooled programs) emits the engine's tokens with an EAGLE-3 head drafting."""
    import threading

    from mtpkit.engine.fast import FastDecoder
    from mtpkit.serve.scheduler import Request, Scheduler

    dec = FastDecoder(engine.model, backend="eager", max_len=128) if fast else None
    sched = Scheduler(engine.model, engine.tokenizer, drafter=engine.drafter,
                      num_draft_tokens=3, max_num_seqs=2, max_queue=8, max_model_len=512,
                      prefill_chunk=4, fast=dec)
    try:
        done, texts = [], {}
        cv = threading.Condition()

        def on_event(rid):
            def f(ev):
                with cv:
                    if ev[0] == "text":
                        texts[rid] = texts.get(rid, "") + ev[1]
                    else:
                        done.append((rid, ev))
                        cv.notify_all()
            return f

        prompts = {str(i): engine.tokenizer.encode(p) for i, p in enumerate(PROMPTS[:2])}
        for rid, ids in prompts.items():
            sched.submit(Request(rid, ids, SamplingParams(max_tokens=20, ignore_eos=True),
                                 on_event(rid)))
        with cv:
            assert cv.wait_for(lambda: len(done) == len(prompts), timeout=120)
        assert all(ev[0] == "done" for _, ev in done), done
        for rid, ids in prompts.items():
            want, _ = _run(engine, ids, 0, max_tokens=20, ignore_eos=True)
            assert texts[rid] == engine.tokenizer.decode(want)
    finally:
        sched.stop()


def test_calibrate_trains_and_saves_an_eagle3_head(trunk, tmp_path):
    """calibrate --head-type eagle3 writes a head folder that loads and drafts losslessly;
    --features is refused for it with the reason."""
    from mtpkit.train.calibrate import run

    data = tmp_path / "data.txt"
    data.write_text("\n".join(PROMPTS * 40))
    cfg = CalibrateConfig(model=str(trunk[0]), data=[str(data)], out=str(tmp_path / "h"),
                          head_type="eagle3", steps=3, seq_len=32, batch_size=2,
                          draft_vocab=64, draft_depth=2, heldout_fraction=0.0,
                          checkpoint_every=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run(cfg, progress="off")
    saved = json.loads((tmp_path / "h" / HEAD_CONFIG).read_text())
    assert saved["head_type"] == "eagle3" and saved["draft_vocab_size"] == 64
    assert saved["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    loaded = _quiet_load(trunk[0], head=tmp_path / "h")
    eng = Engine(loaded.model, loaded.tokenizer)
    ids = loaded.tokenizer.encode(PROMPTS[0])
    assert _run(eng, ids, 3, ignore_eos=True)[0] == _run(eng, ids, 0, ignore_eos=True)[0]
    bad = CalibrateConfig(**{**cfg.__dict__, "features": str(tmp_path / "f"),
                             "out": str(tmp_path / "h2")})
    with pytest.raises(ValueError, match="--features"):
        run(bad, progress="off")


def test_draft_vocabulary_is_set_on_the_heads_own_device(trunk):
    """set_vocab builds d2t where the head lives (calibrate on CUDA builds the head there;
    the CPU-made ids met a CUDA d2t): on the meta device nothing may touch the CPU."""
    from mtpkit.models.eagle3 import Eagle3Head

    cfg = _quiet_load(trunk[0]).model.config
    vocab = [7, 3, 300, 11]
    on_cpu = Eagle3Head(cfg, [2, 4, 5], len(vocab))
    on_cpu.set_vocab(vocab)
    assert on_cpu.target_ids().tolist() == sorted(vocab)
    on_meta = Eagle3Head(cfg, [2, 4, 5], len(vocab)).to("meta")
    on_meta.set_vocab(vocab)
    assert on_meta.d2t.device.type == "meta"


# -- llama.cpp --------------------------------------------------------------------------------
def _convert_head(export: Path, trunk_dir: Path, out: Path) -> Path:
    return _run_converter(export, out, args=("--target-model-dir", str(trunk_dir)))


@needs_converter
def test_llama_cpps_converter_reads_the_export(trunk, head, tmp_path):
    """convert_hf_to_gguf.py takes the export as an EAGLE-3 draft: architecture eagle3, the
    aux layer ids as target_layers, d2t as absolute target ids, the head's weights."""
    from mtpkit.train.export_eagle3 import export_eagle3

    export = export_eagle3(trunk[0], head, tmp_path / "export", dtype="float32")
    fields, tensors = _gguf_contents(_convert_head(export, trunk[0], tmp_path / "head.gguf"))
    assert fields["general.architecture"] == "eagle3"
    assert list(fields["eagle3.target_layers"]) == [2, 4, 5]
    assert fields["eagle3.target_hidden_size"] == 64
    model = _quiet_load(trunk[0], head=head, tokenizer=False).model
    want = model.mtp.target_ids().numpy().astype("int64").tobytes()
    assert tensors["d2t"][2] == want
    fc = model.mtp.fc.weight.detach().numpy().astype("float32").tobytes()
    assert tensors["fc.weight"][2] == fc


@needs_server
@needs_converter
@pytest.mark.parametrize("k", [1, 3])
def test_llama_server_drafts_with_the_export_as_mtpkit_does(trunk, head, tmp_path, k):
    """llama-server with the converted head (draft-eagle3, every draft kept: n-min 0, p-min
    0) emits its no-draft tokens, which are mtpkit's, and drafts and accepts exactly as many
    tokens as mtpkit's engine on each prompt."""
    from mtpkit.train.export_eagle3 import export_eagle3

    trunk_dir = trunk[0]
    export = export_eagle3(trunk_dir, head, tmp_path / "export", dtype="float32")
    head_gguf = _convert_head(export, trunk_dir, tmp_path / "head.gguf")
    trunk_gguf = _gguf(trunk_dir, "F32")
    loaded = _quiet_load(trunk_dir, head=head)
    eng = Engine(loaded.model, loaded.tokenizer)
    eos = loaded.tokenizer.eos_token_ids
    plain = LlamaServer(trunk_gguf)
    draft = LlamaServer(trunk_gguf, "-md", str(head_gguf), "--spec-type", "draft-eagle3",
                        "--spec-draft-n-max", str(k), "--spec-draft-n-min", "0",
                        "--spec-draft-p-min", "0")
    accepted = 0
    try:
        for prompt in PROMPTS:
            ids = loaded.tokenizer.encode(prompt)
            want, res = _run(eng, ids, k)
            a, b = plain.complete(ids, 32), draft.complete(ids, 32)
            assert _tokens(a, eos) == want
            assert _tokens(b, eos) == want
            t = b["timings"]
            assert t.get("draft_n", 0) > 0, t
            # Both draft the same tokens from the same states, round for round: llama.cpp's
            # catch-up writes (token[P+1], g[P]) at each verified position as mtpkit's step 0
            # does, and chains the pre-norm state.
            assert (t["draft_n"], t["draft_n_accepted"]) == (
                res.metrics.num_draft_tokens, res.metrics.num_accepted_tokens)
            accepted += t["draft_n_accepted"]
    finally:
        plain.stop()
        draft.stop()
    assert accepted > 0


def test_teacher_eval_drafts_from_the_heads_own_vocabulary(engine, tmp_path):
    """Teacher mode scores an EAGLE-3 head over its own d2t vocabulary: a draft vocabulary
    given beside it changes nothing, and its drafts are those of the drafter's greedy pick."""
    from mtpkit.train.evaluate import teacher_eval

    f = tmp_path / "text.py"
    f.write_text("\n".join(PROMPTS * 8))
    model, tok = engine.model, engine.tokenizer
    plain = teacher_eval(model, tok, [str(f)], 3, max_tokens=400, seq_len=32)
    other = torch.arange(0, VOCAB, 2)
    given = teacher_eval(model, tok, [str(f)], 3, max_tokens=400, seq_len=32, draft_vocab=other)
    assert plain.tried[0] > 0 and sum(plain.passed) > 0
    assert (given.tried, given.passed) == (plain.tried, plain.passed)
