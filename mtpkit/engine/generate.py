"""The decode loop: prefill, then draft k tokens with the MTP head, verify k+1 in one trunk
forward, accept, roll every cache back to the accepted position. k = 0 is plain decoding
through the same loop."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from .. import threads
from ..models.base import CausalLM
from ..models.cache import ModelCache
from ..models.eagle3 import is_eagle3
from ..quant.linear import linear_rows
from .accept import accept_greedy, accept_sampled
from .metrics import SpecMetrics
from .sampling import SamplingParams, probs, sample


@dataclass
class DecodeState:
    """Where one sequence stands between two verification steps (batch of one)."""

    pos: int  # trunk cache length; the pending token sits at this position
    pending: int  # last emitted token, not yet run through the trunk
    mtp_start: int  # position of the first entry the MTP head still has to (re)compute
    mtp_ids: torch.Tensor  # [1, T] tokens t_{i+1} for MTP positions mtp_start..mtp_start+T-1
    mtp_hidden: torch.Tensor  # [1, T, D] trunk states h_i at those positions


@dataclass
class Result:
    """Filled in while a request streams; final once the iterator is exhausted."""

    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" (EOS or stop string) or "length"
    metrics: SpecMetrics = field(default_factory=SpecMetrics)


class MTPDrafter:
    """Proposes k tokens by chaining the model's MTP head; keeps the head's cache in step.

    With a draft vocabulary (the N most frequent tokens of the head's training data) the head
    scores only those N rows of its output head: a 49k-token lm_head is most of a small
    head's cost. Output stays exact: verification scores the full vocabulary, and a sampled
    draft's q is zero outside the subset, which the accept rule handles. Each draft step is
    scored by its MTP layer's output head (``model.draft_head``: the lm_head unless the layer
    has one of its own).
    """

    def __init__(self, model: CausalLM, draft_vocab: torch.Tensor | None = None) -> None:
        self.model = model
        self.spec = model.mtp.spec
        self.vocab = None
        if is_eagle3(model.mtp):
            # Its own lm_head over its own draft vocabulary, rows mapped to target ids by d2t;
            # a separately given vocabulary cannot apply.
            self.vocab = model.mtp.target_ids()
            self.sub_head = model.mtp.lm_head
            self.layer_rows = [model.mtp.lm_head]
        elif draft_vocab is not None and len(draft_vocab):
            self.vocab = draft_vocab.to(model.model.embed_tokens.weight.device)
            # Those rows as a layer of the output head's own form (int codes stay codes): the
            # lm_head's, and per MTP layer the rows of the head that scores its drafts.
            self.sub_head = linear_rows(model.lm_head, self.vocab)  # D -> N
            self.layer_rows = [
                self.sub_head if model.mtp.own_head(i) is None
                else linear_rows(model.mtp.own_head(i), self.vocab)
                for i in range(len(model.mtp.layers))]

    def head_logits(self, hidden: torch.Tensor, step: int) -> torch.Tensor:
        """Logits [1, N or V] of draft step ``step`` for head states [1, D]."""
        if self.vocab is None:
            return self.model.draft_logits(hidden, step)
        return self.layer_rows[self.model.mtp.layer_for(step)](hidden).float()

    def propose(
        self,
        st: DecodeState,
        k: int,
        cache: ModelCache,
        params: SamplingParams,
        gen: torch.Generator | None,
    ) -> tuple[list[int], torch.Tensor | None]:
        """k draft tokens and, when sampling, their distributions q [k, V]."""
        model = self.model
        # Step 0 first catches the head up on every position accepted since last time (their
        # true tokens and trunk states are known now); its last output is the first draft.
        out = model.mtp_forward(st.mtp_ids, st.mtp_hidden, 0, st.mtp_start, cache)
        pos = st.mtp_start + st.mtp_ids.shape[1]
        tokens: list[int] = []
        qs: list[torch.Tensor] = []
        for s in range(k):
            token, q = self.pick(s, self.head_logits(out.hidden[:, -1], s), params, gen)
            tokens.append(token)
            if q is not None:
                qs.append(q)
            if s + 1 < k:
                # Chain: the head's own state and its draft feed the next position.
                h = out.for_mtp(self.spec.chain_hidden)[:, -1:]
                ids = torch.tensor([[token]], device=st.mtp_ids.device)
                out = model.mtp_forward(ids, h, s + 1, pos, cache)
                pos += 1
        return tokens, (torch.stack(qs) if qs else None)

    def pick(self, s, logits, params, gen) -> tuple[int, torch.Tensor | None]:
        """Draft token s (a vocabulary id) and, when sampling, its full-vocabulary q [V]."""
        if params.greedy:
            i = int(logits[0].argmax())
            return (int(self.vocab[i]) if self.vocab is not None else i), None
        return draw_draft(logits[0], params, gen, self.vocab, self.model.config.vocab_size)


def draw_draft(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None,
               vocab: torch.Tensor | None, vocab_size: int) -> tuple[int, torch.Tensor]:
    """A sampled draft from the head's logits [N] (over ``vocab``, the draft vocabulary, or
    the whole one) and the full-vocabulary q [V] it was drawn from: the same settings as the
    target's, since the accept rule needs the q the draft really came from."""
    q = probs(logits, params)
    i = int(sample(q, gen))
    if vocab is None:
        return i, q
    full = torch.zeros(vocab_size, device=q.device)
    full[vocab] = q
    return int(vocab[i]), full


class Engine:
    """A loaded model ready to serve requests one at a time; nothing leaks between them."""

    def __init__(
        self,
        model: CausalLM,
        tokenizer=None,
        max_model_len: int | None = None,
        draft_vocab: torch.Tensor | None = None,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.device = model.model.embed_tokens.weight.device
        self.max_model_len = max_model_len or model.config.max_position_embeddings
        self._cache: ModelCache | None = None
        self._mtp_cache: ModelCache | None = None
        self._cache_len = 0
        self.drafter = MTPDrafter(model, draft_vocab) if model.mtp is not None else None
        # Greedy requests run through fixed-shape compiled programs when set (engine.fast).
        self.fast = None

    @property
    def has_mtp(self) -> bool:
        """True when the model has a usable MTP head."""
        return self.drafter is not None

    def _caches(self, need: int) -> tuple[ModelCache, ModelCache | None]:
        # Reuse the buffers across requests (reset, not reallocated) unless too small.
        if self._cache is None or self._cache_len < need:
            size = min(max(need, 256), self.max_model_len + 16)
            size = max(size, need)
            self._cache = self.model.new_cache(size)
            self._mtp_cache = self.model.new_mtp_cache(size)
            self._cache_len = size
        self._cache.reset()
        if self._mtp_cache is not None:
            self._mtp_cache.reset()
        return self._cache, self._mtp_cache

    def fast_takes(self, params: SamplingParams) -> bool:
        """Whether requests with these settings run on the fast path (engine.fast)."""
        return self.fast is not None and (params.greedy or self.fast.samples)

    def check_length(self, prompt_len: int, max_tokens: int) -> None:
        """Raise ValueError when prompt plus max_tokens exceeds the context."""
        if prompt_len + max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) exceeds the "
                f"model's context of {self.max_model_len} tokens; shorten the prompt or "
                "lower max_tokens"
            )

    @torch.inference_mode()
    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        num_draft_tokens: int = 0,
        result: Result | None = None,
        drafter: MTPDrafter | None = None,
        eos_ids: set[int] | None = None,
    ) -> Iterator[int]:
        """Yield generated token ids; ``result`` receives finish reason and metrics."""
        params.validate()
        if not prompt_ids:
            raise ValueError("the prompt is empty: give at least one token")
        self.check_length(len(prompt_ids), params.max_tokens)
        res = result if result is not None else Result()
        m = res.metrics
        m.prompt_tokens = len(prompt_ids)
        drafter = drafter or self.drafter
        k = num_draft_tokens if drafter is not None else 0
        if drafter is not None:  # the metrics count each MTP layer's drafts too
            m.mtp_layers = len(drafter.model.mtp.layers)
        if eos_ids is None:
            eos_ids = set(self.tokenizer.eos_token_ids) if self.tokenizer is not None else set()
        if params.ignore_eos:
            eos_ids = set()
        if self.fast_takes(params) and drafter is self.drafter:
            yield from self.fast.generate(prompt_ids, params.max_tokens, k, res, eos_ids,
                                          params=params)
            return
        gen = None
        if not params.greedy:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(params.seed if params.seed is not None else torch.seed())
        threads.tick()
        t0 = time.perf_counter()
        cache, mtp_cache = self._caches(len(prompt_ids) + params.max_tokens + k + 2)
        model = self.model
        ids = torch.tensor([prompt_ids], device=self.device)
        out = model(ids, cache)
        first = self._choose(model.logits(out.hidden[:, -1]), params, gen)
        spec = model.mtp.spec if model.mtp is not None else None
        st = DecodeState(
            pos=len(prompt_ids),
            pending=first,
            mtp_start=0,
            mtp_ids=torch.tensor([prompt_ids[1:] + [first]], device=self.device),
            mtp_hidden=out.for_mtp(spec.trunk_hidden) if spec else out.hidden[:, :0],
        )
        m.ttft_s = time.perf_counter() - t0
        yield from emit([first], res, eos_ids, params.max_tokens, t0)
        while res.finish_reason is None:
            threads.tick()
            # Draft no more than the tokens still allowed: a verification emits up to k+1.
            k_step = min(k, params.max_tokens - m.generated_tokens - 1)
            drafts, q = [], None
            if k_step > 0:
                drafts, q = drafter.propose(st, k_step, mtp_cache, params, gen)
            verify = torch.tensor([[st.pending, *drafts]], device=self.device)
            out = model(verify, cache)
            logits = model.logits(out.hidden)[0]  # [k+1, V]
            if params.greedy:
                n_acc, nxt = accept_greedy(drafts, logits.argmax(-1).tolist())
            else:
                n_acc, nxt = accept_sampled(drafts, q, probs(logits, params), gen)
            m.record(len(drafts), n_acc)
            # Keep the pending token and the accepted drafts; every cache returns there.
            cache.trim(st.pos + n_acc + 1)
            if mtp_cache is not None and drafts:
                rollback_mtp(mtp_cache, st.pos, st.pos + n_acc)
            if spec is not None:
                st.mtp_start = st.pos
                st.mtp_ids = torch.tensor([[*drafts[:n_acc], nxt]], device=self.device)
                st.mtp_hidden = out.for_mtp(spec.trunk_hidden)[:, : n_acc + 1]
            st.pos += n_acc + 1
            st.pending = nxt
            yield from emit([*drafts[:n_acc], nxt], res, eos_ids, params.max_tokens, t0)

    def _choose(self, logits: torch.Tensor, params: SamplingParams, gen) -> int:
        if params.greedy:
            return int(logits[0].argmax())
        return int(sample(probs(logits[0], params), gen))


def rollback_mtp(cache: ModelCache, start: int, end: int) -> None:
    """Return every MTP layer's cache to what the verified tokens allow, after a round.

    Layer 0 recomputes everything from ``start`` (the round's pending position, the next
    catch-up's first) on. A layer i >= 1 is not caught up: it keeps its entries of the
    accepted drafts, those before ``end`` (an entry at position p reads token p + 1), and
    drops the later ones, made from rejected or unverified drafts, which its next draft step
    would otherwise attend to.
    """
    for i, layer in enumerate(cache.layers):
        keep = start if i == 0 else end
        if layer.length > keep:
            layer.trim(keep)


def emit(tokens, res: Result, eos_ids, max_tokens: int, t0: float) -> Iterator[int]:
    """Yield ``tokens`` until an EOS id (not emitted) or ``max_tokens``; both set the finish
    reason in ``res``, whose metrics count what was emitted."""
    m = res.metrics
    for t in tokens:
        if t in eos_ids:
            res.finish_reason = "stop"
            break
        m.generated_tokens += 1
        res.tokens.append(t)
        m.elapsed_s = time.perf_counter() - t0
        yield t
        if m.generated_tokens >= max_tokens:
            res.finish_reason = "length"
            break
