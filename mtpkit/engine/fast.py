"""Fast decoding: the fixed-shape programs of engine/programs.py, compiled once and cached
across runs (engine/program_cache.py), driven by one decoding loop (``FastDecoder.steps``)
that `mtpkit generate`, `mtpkit serve` and `mtpkit bench` all run.

A lone sequence runs its decode or round program a step; a server's batched steps
(``run_many``) run several sequences' rows through the pooled programs in one pass, with
the drafts each verifies chosen from the head's probabilities and the round costs measured
here (engine/budget.py).

Sampled requests run the pooled programs (``trunk_pool`` / ``head_pool``, a lone decoder's
own caches a pool of one slot): the trunk's logits come back, the host accepts by the
lossless rule (engine/accept.py) with the request's own seeded stream and draws the next
drafts from the head, in the order the eager engine draws, so a seed gives the eager
engine's tokens. Decoders whose steps do not pool leave sampling to the eager engine.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import threads
from ..models.attention import row_kernel_fits
from ..models.cache import zeros
from ..quant.kernels import int8_mm_available
from ..quant.w8a8_layer import W8A8Forms
from .accept import accept_sampled
from .budget import RoundChoices
from .generate import Result, draw_draft, emit
from .program_cache import CompileStats, ProgramCache
from .programs import (
    POOL_KINDS,
    POOL_MAX_ROWS,
    SPAN_STEP,
    Programs,
    unsupported_reason,
)
from .sampling import SamplingParams, probs, sample

DEFAULT_MAX_LEN = 2048  # cache positions of a FastDecoder unless the model's context is shorter


class FastDecoder:
    """Greedy decoding, with or without MTP, through fixed-shape programs (module doc).

    ``max_len`` fixes the cache: prompt + max_tokens + 2k + 2 positions must fit.
    ``draft_p_min`` lets a round verify only the drafts before the first whose head
    probability falls below it (one program per verify length, built up front).
    ``forms`` picks how W8A8 layers run (default: the fastest; others to compare).
    """

    def __init__(
        self,
        model,
        draft_vocab: torch.Tensor | None = None,
        max_len: int = 1024,
        backend: str = "aoti",
        mode: str = "max-autotune",
        draft_p_min: float | None = None,
        cache_dir: str | Path | None = None,
        forms: W8A8Forms | None = None,
    ) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"the fast path cannot run this model: {reason}")
        self.model = model
        if model.model.embed_tokens.weight.device.type == "cpu":
            # Whether mtpkit's kernels run here is answered once, outside any trace: the
            # programs ask it (argmax_rows), and its first answer reads the CPU's
            # capability, which dynamo cannot trace (a bf16 CPU model failed to compile).
            int8_mm_available()
        self.programs = Programs(model, draft_vocab, forms).eval()
        self.draft_p_min = draft_p_min
        self._noted_depth = False
        self.device = model.model.embed_tokens.weight.device
        self.max_len = max(4, -(-max_len // SPAN_STEP)) * SPAN_STEP
        self.programs.set_positions(self.max_len + SPAN_STEP)
        self.slot: int | None = None  # this fork's slot in the pool (make_pool)
        self._pool: tuple | None = None
        self._alloc_caches()
        # The programs' callables, shared with forks (every slot runs the same programs).
        self.cache = ProgramCache(self.programs, backend, mode, cache_dir, self.max_len,
                                  self.kc[0].dtype, self._example)
        self._spans: dict[int, torch.Tensor] = {}
        self._slot_cache: dict[tuple, tuple] = {}  # forks' slots -> _slot_args
        # run_many's measurements and choices (engine/budget.py), shared by forks.
        self.choices = RoundChoices()

    @property
    def has_mtp(self) -> bool:
        """True when the model has a head to draft with."""
        return self.model.mtp is not None

    def _alloc_caches(self) -> None:
        # The decoder's own static caches (trunk and head), zeroed.
        model, cfg = self.model, self.model.config
        dtype = model.model.norm.weight.dtype
        max_len = self.max_len
        # One spare step beyond the longest span: a span as long as the buffer would make
        # the narrowed view the whole buffer, a case compilers specialize on.
        shape = (1, cfg.num_key_value_heads, max_len + SPAN_STEP, cfg.head_dim)

        def buf():
            # Normal tensors even when built in inference mode: export writes them outside it.
            with torch.inference_mode(False):
                return zeros(shape, dtype, self.device)

        # One tensor per layer, not one stacked tensor: a compiled step writes a whole
        # input tensor in place, where a view of a stacked buffer would be copied. Trunks
        # that run as one w8a8_trunk op are the exception: their steps take each cache list
        # as one tensor [layers, 1, Hkv, L, hd] that the op writes in place
        # (w8a8_trunk_kv): 2 inputs where there were 60 for SmolLM2, which halves an
        # AOTInductor call's own overhead; kc and vc are then views of those (for eager
        # calls: a compiled step given 60 views of one buffer ran far slower).
        # ``kv``: the caches as the compiled steps take them.
        # (Programs.stacked_caches: whether every compiled trunk step is that one op.)
        layers = len(model.model.layers)
        if self.programs.stacked_caches and dtype == torch.float32:
            with torch.inference_mode(False):
                kstack, vstack = (zeros((layers, *shape), dtype, self.device) for _ in range(2))
            self.kc, self.vc = list(kstack.unbind(0)), list(vstack.unbind(0))
            self.kv: tuple = (kstack, vstack)
        else:
            self.kc = [buf() for _ in range(layers)]
            self.vc = [buf() for _ in range(layers)]
            self.kv = (self.kc, self.vc)
        self.hk = self.hv = None
        if model.mtp is not None:
            self.hk, self.hv = buf(), buf()

    def fork(self, slot: int | None = None) -> FastDecoder:
        """A decoder with caches of its own that shares this one's programs (a server slot:
        sequences never share a cache, and every slot runs the same programs); ``slot``:
        its caches are that slot of the pool (make_pool), where there is one."""
        twin = copy.copy(self)
        if slot is None or self._pool is None:
            twin._alloc_caches()
            return twin
        kpools, vpools, hk, hv = self._pool
        if not 0 <= slot < kpools[0].shape[0]:
            raise ValueError(f"slot {slot} is outside the pool of {kpools[0].shape[0]}")
        twin.slot = slot
        twin.kc = [p[slot : slot + 1] for p in kpools]
        twin.vc = [p[slot : slot + 1] for p in vpools]
        twin.kv = (twin.kc, twin.vc)
        twin.hk = None if hk is None else hk[slot : slot + 1]
        twin.hv = None if hv is None else hv[slot : slot + 1]
        return twin

    @property
    def poolable(self) -> bool:
        """Whether batched steps can run on pooled caches (trunk_pool/head_pool): batchable
        programs on mtpkit's row kernels, caches one tensor a layer."""
        return (self.programs.batchable and not self.programs.stacked_caches
                and row_kernel_fits(self.kc[0], self.kc[0]))

    @property
    def pools_prompts(self) -> bool:
        """Whether prompts of at most POOL_MAX_ROWS tokens run through the pooled programs
        (_prefill): where the decoder pools, except torch.compile in process (--compile
        inductor), which does not build them; it keeps SDPA prompts, as the eager engine."""
        return self.poolable and self.cache.backend != "inductor"

    @property
    def pools_prompt_heads(self) -> bool:
        """Whether the head catches up on such prompts through head_pool too (which has no
        zeroed first embedding: heads that zero it catch up eagerly)."""
        return (self.pools_prompts and self.has_mtp
                and not self.model.mtp.spec.zero_first_embedding)

    def make_pool(self, n: int) -> bool:
        """Allocate caches for n forks as slots of one tensor a layer (fork(slot)), so
        that a batched step of any of them is one program call (run_many); False (and
        nothing allocated) where the decoder cannot pool."""
        if not self.poolable:
            return False
        self._pool = self._pools(n)
        return True

    def _pools(self, n: int) -> tuple:
        # Zeroed pools [n, Hkv, L, hd] a layer (and the head's), as _alloc_caches' buffers.
        shape = (n, *self.kc[0].shape[1:])
        dtype, dev = self.kc[0].dtype, self.device
        with torch.inference_mode(False):
            def buf():
                return zeros(shape, dtype, dev)
            layers = len(self.kc)
            kpools = [buf() for _ in range(layers)]
            vpools = [buf() for _ in range(layers)]
            hk = hv = None
            if self.hk is not None:
                hk, hv = buf(), buf()
        return kpools, vpools, hk, hv

    # -- programs --------------------------------------------------------------------------
    def span(self, need: int) -> torch.Tensor:
        """The span argument for a step that reads cache slots 0..need-1: a tensor whose
        length, need rounded up to SPAN_STEP, is all that matters."""
        # At least two steps: export gives dimensions of size 0 and 1 special meaning.
        n = min(self.max_len, max(2, -(-need // SPAN_STEP)) * SPAN_STEP)
        sp = self._spans.get(n)
        if sp is None:
            # Always an inference tensor, whoever asks first (compiled guards check this).
            with torch.inference_mode():
                sp = self._spans[n] = torch.empty(n, dtype=torch.uint8, device=self.device)
        return sp

    def _example(self, kind: str, t: int) -> tuple:
        dev = self.device
        z = torch.zeros(1, dtype=torch.long, device=dev)
        if kind in POOL_KINDS:
            # Three rows of two sequences in a pool of four: sizes distinct from one
            # another, and none 0 or 1, which export would specialize on.
            kpools, vpools, hk, hv = self._pools(4)
            rows = (z.new_zeros(1, 3), torch.arange(3, device=dev),
                    torch.tensor([3, 1], device=dev), torch.tensor([2, 1], device=dev))
            if kind == "trunk_pool":
                # Five rows (three and two) of which four give logits: every size distinct.
                return (z.new_zeros(1, 5), torch.arange(5, device=dev),
                        torch.tensor([3, 1], device=dev), torch.tensor([3, 2], device=dev),
                        kpools, vpools, torch.tensor([0, 2, 3, 4], device=dev))
            state = torch.zeros(1, 3, self.model.config.hidden_size, device=dev,
                                dtype=self.kc[0].dtype)
            return (rows[0], state, *rows[1:], hk, hv)
        # An example span strictly inside its range, or export pins the length to it.
        span = self.span(2 * SPAN_STEP)
        if kind == "decode":
            return (z.view(1, 1), z, *self.kv, span)
        if kind == "verify":
            return (z.new_zeros(1, t), z, *self.kv, span)
        if kind == "draft_step":
            state = torch.zeros(1, 1, self.model.config.hidden_size, device=dev,
                                dtype=self.kc[0].dtype)
            return (z.view(1, 1), state, z, self.hk, self.hv, span)
        return (z.new_zeros(1, t), z, *self.kv, self.hk, self.hv, span)

    def program(self, kind: str, t: int = 1, k: int = 0):
        """The callable of one program (built, loaded or traced on first use)."""
        return self.cache.get(kind, t, k)

    @property
    def stats(self) -> CompileStats:
        """What building or loading the programs cost so far."""
        return self.cache.stats

    @property
    def pending(self) -> list[Path]:
        """Program files this decoder runs uncompiled until they are built (backend auto)."""
        return self.cache.pending

    def build_pending(self) -> int:
        """Build the programs that run uncompiled until their files exist (backend auto) and
        run them compiled from then on; how many were built."""
        return self.cache.build_pending()

    def _lengths(self, k: int) -> list[int]:
        # Verify lengths a request with draft depth k may use.
        if k == 0:
            return [1]
        return list(range(1, k + 2)) if self.draft_p_min is not None else [k + 1]

    def _deepest(self) -> int | None:
        rows = self.programs.rows
        return None if rows is None or not self.has_mtp else rows - 1

    def check_draft(self, k: int) -> None:
        """Raise ValueError when this decoder cannot draft k tokens per round exactly."""
        deepest = self._deepest()
        if deepest is not None and k > deepest:
            raise ValueError(
                f"on quantized trunks the compiled path drafts at most {deepest} token(s) per "
                f"round (every step shares one {deepest + 1}-row shape, which keeps MTP "
                f"lossless); use -k {deepest} or less, drop --compile, or quantize the "
                "lm_head too (int8: `mtpkit quantize --lm-head same`), which lifts the limit")

    def served_k(self, k: int) -> int:
        """The draft depth a request asking for k gets: k, or the deepest this decoder drafts
        exactly (said once on stderr)."""
        deepest = self._deepest()
        if deepest is None or k <= deepest:
            return k
        if not self._noted_depth:
            import sys

            print(f"note: on quantized trunks the compiled path drafts {deepest} token(s) per "
                  f"round (one step shape keeps MTP lossless); -k {k} runs as -k {deepest}",
                  file=sys.stderr)
            self._noted_depth = True
        return deepest

    def warmup(self, k: int) -> float:
        """Build or load every program a request with draft depth k uses; seconds taken."""
        t0 = time.perf_counter()
        k = self.served_k(k) if self.has_mtp else 0
        for t in self._lengths(k):
            if k == 0:
                self.program("decode")
            else:
                self.program("round", t, k)
        if self.pools_prompts:  # short prompts run through them (_prefill)
            self.program("trunk_pool")
            if k and self.pools_prompt_heads:
                self.program("head_pool")
        return time.perf_counter() - t0

    def warmup_for(self, params: SamplingParams | None, k: int) -> float:
        """warmup(k) for a greedy request (params None or greedy), warmup_pooled() for a
        sampled one (its steps run the pool programs); seconds taken."""
        if params is None or params.greedy:
            return self.warmup(k)
        return self.warmup_pooled()

    def warmup_pooled(self) -> float:
        """Build or load the programs of batched steps over pooled caches (a server's);
        seconds taken (nothing where the decoder cannot pool)."""
        t0 = time.perf_counter()
        if self.poolable:
            self.program("trunk_pool")
            if self.has_mtp:
                self.program("head_pool")
        return time.perf_counter() - t0

    # -- generation ------------------------------------------------------------------------
    @staticmethod
    def _positions(prompt_len: int, max_tokens: int, k: int) -> int:
        # Cache positions a request may write: its tokens and the draft window past them.
        return prompt_len + max_tokens + 2 * k + 2

    def fits(self, prompt_len: int, max_tokens: int, k: int) -> bool:
        """Whether a request fits the static cache."""
        return self._positions(prompt_len, max_tokens, k) <= self.max_len

    def check_length(self, prompt_len: int, max_tokens: int, k: int) -> None:
        """Raise ValueError when a request does not fit the static cache."""
        if not self.fits(prompt_len, max_tokens, k):
            need = self._positions(prompt_len, max_tokens, k)
            raise ValueError(
                f"prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) and the draft "
                f"window need {need} cache positions; the compiled cache holds "
                f"{self.max_len} (raise --max-model-len)"
            )

    def _prefill(self, prompt_ids: list[int], k: int, chunk: int | None = None,
                 sampler: _Sampler | None = None, joining: int = 0):
        """Run the prompt (any length), ``chunk`` positions at a time, yielding
        between pieces; returns the first token [1] and, with k, the first drafts and
        their probabilities (greedy: of each draft [k]; ``sampler``: the distributions the
        drafts were drawn from [k, V]). ``joining``: how many other sequences this one's
        batched rounds run beside (RoundChoices.lean_prompt)."""
        pr, dev, n = self.programs, self.device, len(prompt_ids)
        ids = torch.tensor([prompt_ids], device=dev)
        pos = torch.arange(n, device=dev)
        chunk = chunk or n
        pieces = [(s, min(n, s + chunk)) for s in range(0, n, chunk)]
        spec = self.model.mtp.spec if k else None
        # A prompt of at most POOL_MAX_ROWS tokens runs through the pooled programs (the
        # server's batched steps), compiled where they are built: a short prompt's eager pass
        # spent more time dispatching ops than computing. Its rows then attend one at a time
        # (the row kernel), so its bits do not depend on how it is cut into pieces; which
        # way a prompt goes depends on its length alone, the same in every fast path (CLI
        # and server). Longer prompts keep torch's SDPA, the faster there.
        pooled = self.pools_prompts and n <= POOL_MAX_ROWS
        pools, slots = self._pools_of(self.slot, self.kc, self.vc, self.hk, self.hv)
        keep = []  # the states the head catch-up reads, piece by piece
        for i, (s, e) in enumerate(pieces):
            if i:
                yield
            if pooled:
                _, hidden, logits = self.program("trunk_pool")(
                    ids[:, s:e], pos[s:e], slots, torch.tensor([e - s], device=dev), *pools[:2],
                    torch.tensor([e - s - 1], device=dev))
                keep.append(hidden)
                continue
            # Attend over the slots in use, not the whole buffer: a short prompt against a
            # long cache would spend most of its time on masked keys.
            post, pre = pr.trunk(ids[:, s:e], pos[s:e], self.kc, self.vc, self.span(e))
            if spec is not None:
                keep.append(post if spec.trunk_hidden == "post_norm" else pre)
        last = logits if pooled else pr.model.logits(post[:, -1])
        first = last.argmax(-1) if sampler is None else sampler.pick(last[0])
        if not k:
            return first, (None if sampler is None else drafts_none(dev)), None
        if sampler is None and joining and self.choices.lean_prompt(k, joining + 1):
            # A server's lean rounds: no head pass over the prompt, and placeholder drafts
            # of probability 0 (what a lean round leaves, _lean_round).
            return first, first.expand(k).clone(), torch.zeros(k, device=dev)
        hidden = torch.cat(keep, 1)
        head_ids = torch.cat([ids[:, 1:], first[None]], 1)
        head_pooled = pooled and self.pools_prompt_heads
        for s, e in pieces:
            if len(pieces) > 1:
                yield
            if head_pooled:
                hpost, state = self.program("head_pool")(
                    head_ids[:, s:e], hidden[:, s:e], pos[s:e], slots,
                    torch.tensor([e - s], device=dev), *pools[2:])
                continue
            hpost, hpre = pr.head(head_ids[:, s:e], hidden[:, s:e], pos[s:e], self.hk, self.hv,
                                  self.span(e), zero_first=spec.zero_first_embedding and s == 0)
            state = hpost if spec.chain_hidden == "post_norm" else hpre
        at = torch.tensor([n], device=dev)
        if sampler is not None:
            if not sampler.draws(k):
                return first, drafts_none(dev), None
            drafts, qs = self._draw_chain([sampler], hpost[0, -1:], state[0, -1:], at, k,
                                          slots, pools[2:])
            return first, drafts[0], qs[0]
        drafts, ps = pr.chain(hpost[0, -1:], state[0, -1:], at, self.hk, self.hv, k,
                              self.span(n + k))
        return first, drafts, ps

    @torch.inference_mode()
    def prefill(self, prompt_ids: list[int], k: int):
        """Run the prompt in one piece; first token [1] and, with k, first drafts."""
        gen = self._prefill(prompt_ids, k)
        try:
            while True:
                next(gen)
        except StopIteration as done:
            return done.value

    def generate(self, prompt_ids: list[int], max_tokens: int, k: int = 0, result=None,
                 eos_ids: set[int] | None = None,
                 params: SamplingParams | None = None) -> Iterator[int]:
        """Tokens after ``prompt_ids``, greedy unless ``params`` samples; ``result``
        (engine.generate.Result) receives finish reason and metrics as the eager engine
        fills them."""
        steps = self.steps(prompt_ids, max_tokens, k, result, eos_ids, params=params)
        return self._drive(steps)

    def _drive(self, steps) -> Iterator[int]:
        # Run a generation's program calls one by one, yielding its tokens.
        item = next(steps, None)
        while item is not None:
            if isinstance(item, Step):
                item = steps.send(self.run(item))
                continue
            if item is not PIECE:
                yield from item
            item = next(steps, None)

    @torch.inference_mode()
    def run(self, step: Step):
        """One program call a generation asked for."""
        if step.kind == "sample":
            return self._sample_many([step], step.k)[0]
        args = step.args if step.args[0] is not None else (self._tokens(step, step.t),
                                                           *step.args[1:])
        return self.program(step.kind, step.t, step.k)(*args)

    def _tokens(self, step: Step, rows: int) -> torch.Tensor:
        # A step's first rows tokens [1, rows], made from its host ints when a pass needs
        # them: a batched decode step or lean round reads only the pending ones (ids), and a
        # tensor made for every sequence's every step cost a batched step visibly more.
        return torch.tensor([step.ids[:rows]], device=self.device)

    @torch.inference_mode()
    def run_many(self, steps: list[Step]) -> list:
        """Program calls of several generations (forks of this decoder) at once: decode
        steps together and rounds of one draft depth together, each group either one trunk
        pass (Programs.decode_many / round_many, uncompiled) or a program call each, which
        ever has been the faster here (timed as they run; every way gives the same bits)."""
        out: list = [None] * len(steps)
        groups: dict[tuple, list[int]] = {}
        for i, st in enumerate(steps):
            groups.setdefault((st.kind, st.k), []).append(i)
        pr = self.programs
        for (kind, k), idx in groups.items():
            n = len(idx)
            if kind == "sample":
                # Pooled programs whatever the batch: one call for all is never the slower.
                # Requests without a seed draft nothing where drafting does not pay (a
                # seeded one keeps the draws of its lone run, and so its text).
                # (Drafts drawn before are still verified: that is what measures how often
                # they are accepted.)
                lean = k > 0 and n > 1 and self.choices.lean(k, n, sampled=True)
                group = [steps[i] for i in idx]
                for st in group:
                    st.sampler.lean = lean and st.sampler.params.seed is None
                threads.tick()
                t0 = time.perf_counter()
                got = self._sample_many(group, k)
                seconds = time.perf_counter() - t0
                if k:
                    drew = any(len(d) for _, _, d, _ in got)
                    self.choices.record_sampled(k, n, sum(st.t for st in group), seconds, drew)
                for i, g in zip(idx, got, strict=True):
                    out[i] = g
                continue
            group = [steps[i] for i in idx]
            pooled = (self._pool is not None and all(st.slot is not None for st in group)
                      and sum(st.t for st in group) <= POOL_MAX_ROWS)
            # Pooled forks batch through compiled pool programs, which read the weights once
            # for all: never slower than a program call each, so that way is not tried (a
            # try costs several batched steps).
            if n == 1 or not pr.batchable or not (pooled or self.choices.batch_pays(kind, k, n)):
                t0 = time.perf_counter()
                for i in idx:
                    out[i] = self.run(steps[i])
                self.choices.timed((kind, k, 1), (time.perf_counter() - t0) / n)
                continue
            threads.tick()
            t0 = time.perf_counter()
            if kind == "decode":
                got = self._decode_many(group, pooled)
                self.choices.timed((kind, k, n), time.perf_counter() - t0)
            else:
                if self.choices.lean(k, n):
                    # A decode step each, in one pass: nothing drafted and nothing verified,
                    # not even drafts a drafting round before left (only at a switch). So
                    # every lean round measures the lean cost the choice weighs, which
                    # otherwise, while drafting, went unmeasured and stale; and in the lean
                    # regime a round's own work beside that pass is what MTP costs the
                    # server against no MTP.
                    got = self._lean_round(group, k, pooled)
                    take, lean = [0] * n, True
                else:
                    # The head's probabilities of the drafts, where any are real (a lean
                    # round's placeholders are not); real rounds' are kept.
                    drafted = [_drafted(st.odds) for st in group]
                    probs = None
                    if any(drafted):
                        probs = [st.odds or [] for st in group]
                        for ps, real in zip(probs, drafted, strict=True):
                            if real:
                                self.choices.note_drafts(ps)
                    take = self.choices.drafts_to_verify(k, [st.t - 1 for st in group], probs)
                    # Fewer rows verified: the pending token and the drafts chosen.
                    args = [(self._tokens(st, c + 1), *st.args[1:])
                            for st, c in zip(group, take, strict=True)]
                    passes = self._pooled_passes(group) if pooled else {}
                    got = pr.round_many(args, k, **passes)
                    lean = False
                seconds = time.perf_counter() - t0
                self.choices.timed((kind, k, n), seconds)
                self.choices.record(k, n, n + sum(take), seconds, lean)
            for i, g in zip(idx, got, strict=True):
                out[i] = g
        return out

    def _decode_pooled(self, group: list[Step], ids: torch.Tensor,
                       pos: torch.Tensor) -> torch.Tensor:
        # One-token steps of pooled forks as one trunk_pool call: their tokens ids [1, n]
        # at positions pos [n] -> the next tokens [n].
        slots, ones, every = self._slot_args(group)
        kpools, vpools, _, _ = self._pool
        targets, _, _ = self.program("trunk_pool")(ids, pos, slots, ones, kpools, vpools,
                                                   every)
        return targets

    def _slot_args(self, group: list[Step]) -> tuple:
        # Pooled passes' constant arguments for these forks: their slots [n], and for a
        # decode pass one row each [n] and every row [n]. Kept while the batch stays the
        # same (a server's batch changes only when a request joins or leaves).
        key = tuple(st.slot for st in group)
        got = self._slot_cache.get(key)
        if got is None:
            if len(self._slot_cache) > 64:
                self._slot_cache.clear()
            slots = torch.tensor(key, device=self.device)
            got = self._slot_cache[key] = (slots, torch.ones_like(slots),
                                           torch.arange(len(key), device=self.device))
        return got

    def _pooled_passes(self, group: list[Step]) -> dict:
        # round_many's trunk and head passes for pooled forks: one trunk_pool call and one
        # head_pool call a pass, whatever the batch (each sequence's caches are its slot).
        slots = self._slot_args(group)[0]
        kpools, vpools, hk, hv = self._pool
        trunk_fn, head_fn = self.program("trunk_pool"), self.program("head_pool")

        def trunk(ids, pos, seqs):
            sizes = torch.tensor([tokens.shape[1] for tokens, *_ in seqs], device=self.device)
            targets, hidden, _ = trunk_fn(ids, pos, slots, sizes, kpools, vpools,
                                          torch.arange(ids.shape[1], device=self.device))
            return targets, hidden

        def head(ids, states, pos, seqs):
            sizes = torch.tensor([t for t, *_ in seqs], device=self.device)
            return head_fn(ids, states, pos, slots, sizes, hk, hv)

        return {"trunk": trunk, "head": head}

    def _pools_of(self, slot: int | None, kc, vc, hk, hv) -> tuple:
        # The pools a generation's pooled programs take and its slot there [1]: the
        # decoder's pool where the generation has a slot in it, else its own caches
        # (kc, vc, hk, hv), a pool of one.
        if slot is not None and self._pool is not None:
            return self._pool, torch.tensor([slot], device=self.device)
        return (kc, vc, hk, hv), torch.zeros(1, dtype=torch.long, device=self.device)

    def _sample_many(self, group: list[Step], k: int) -> list:
        """Sampled rounds of several generations: one trunk_pool call verifies every
        sequence's drafts, each accepts by the lossless rule (engine/accept.py) with its own
        settings and random stream, then one head_pool call a draft step catches every head
        up and chains k new drafts -> [(emitted tokens, drafts verified, next drafts [k],
        their q [k, V])]."""
        pooled = self._pool is not None and all(st.slot is not None for st in group)
        if len(group) > 1 and not pooled:
            return [self._sample_many([st], k)[0] for st in group]
        dev = self.device
        if pooled:
            (kpools, vpools, hk, hv) = self._pool
            slots = self._slot_args(group)[0]
        else:
            (kpools, vpools, hk, hv), slots = self._pools_of(None, *group[0].args[2:])
        tokens = [st.args[0] for st in group]
        sizes = [t.shape[1] for t in tokens]
        pos0 = [st.args[1] for st in group]
        pos = torch.cat([p + torch.arange(n, device=dev) for p, n in zip(pos0, sizes, strict=True)])
        _, hidden, logits = self.program("trunk_pool")(
            torch.cat(tokens, 1), pos, slots, torch.tensor(sizes, device=dev), kpools, vpools,
            torch.arange(len(pos), device=dev))
        emitted = []
        for st, rows, tok in zip(group, logits.split(sizes), tokens, strict=True):
            sm = st.sampler
            drafts = tok[0, 1:].tolist()
            n, nxt = accept_sampled(drafts, st.probs, probs(rows, sm.params), sm.gen)
            emitted.append([*drafts[:n], nxt])
            sm.left -= n + 1
            self.choices.note_sampled(n, len(drafts))
        verified = [n - 1 for n in sizes]
        if not k:
            return [(e, v, drafts_none(dev), None) for e, v in zip(emitted, verified,
                                                                  strict=True)]
        # Head catch-up on every accepted position with its true token: the accepted drafts
        # and the token drawn after them (rows 0..n of the trunk's states). A sequence that
        # draws nothing this round (lean) keeps them for its next catch-up: its head cache
        # then misses no position once it drafts again, at the cost of one head pass then.
        drafts: list = [drafts_none(dev)] * len(group)
        qs: list = [None] * len(group)
        catch = []  # (index in group, token ids, states [1, r, D], first position)
        for b, (st, h, g, p) in enumerate(zip(group, hidden.split(sizes, 1), emitted, pos0,
                                              strict=True)):
            sm = st.sampler
            sm.behind(g, h[:, : len(g)], int(p))
            if sm.draws(k):
                catch.append((b, *sm.catch_up()))
        if not catch:
            return list(zip(emitted, verified, drafts, qs, strict=True))
        sel = torch.tensor([b for b, *_ in catch], device=dev)
        sub = slots.index_select(0, sel) if len(slots) > 1 else slots
        post, chain = self._catch_up(catch, sub, hk, hv)
        nxt = torch.tensor([f + len(ids) for _, ids, _, f in catch], device=dev)
        got, got_q = self._draw_chain([group[b].sampler for b, *_ in catch], post, chain,
                                      nxt, k, sub, (hk, hv))
        for (b, *_), d, q in zip(catch, got, got_q, strict=True):
            drafts[b], qs[b] = d, q
        return list(zip(emitted, verified, drafts, qs, strict=True))

    def _catch_up(self, catch: list[tuple], slots, hk, hv) -> tuple:
        """The head over each sequence's rows catch = [(_, token ids, states [1, r, D],
        first position)] (slots: theirs), in head_pool calls of at most POOL_MAX_ROWS rows
        (a sequence's rows in order, a piece a call) -> its state after the last row: the
        one the first draft is drawn from and the one fed on [B, D]."""
        dev = self.device
        piece = max(1, POOL_MAX_ROWS // len(catch))
        post = [None] * len(catch)
        chain = [None] * len(catch)
        start = 0
        while True:
            part = [(i, ids[start : start + piece], states[:, start : start + piece],
                     first + start) for i, (_, ids, states, first) in enumerate(catch)
                    if start < len(ids)]
            if not part:
                break
            sizes = [len(ids) for _, ids, _, _ in part]
            p, c = self.program("head_pool")(
                torch.tensor([[t for _, ids, _, _ in part for t in ids]], device=dev),
                torch.cat([st for _, _, st, _ in part], 1),
                torch.cat([torch.arange(f, f + n, device=dev)
                           for (_, _, _, f), n in zip(part, sizes, strict=True)]),
                slots.index_select(0, torch.tensor([i for i, *_ in part], device=dev)),
                torch.tensor(sizes, device=dev), hk, hv)
            last = torch.tensor(sizes, device=dev).cumsum(0) - 1
            for (i, *_), row in zip(part, last.tolist(), strict=True):
                post[i], chain[i] = p[0, row], c[0, row]
            start += piece
        return torch.stack(post), torch.stack(chain)

    def _draw_chain(self, samplers: list[_Sampler], post, state, pos, k: int, slots,
                    head_cache: tuple) -> tuple[list, list]:
        """Up to k sampled drafts a sequence (_Sampler.draws) from head states post, state
        [B, D] (the first draft's and the state fed on) at positions pos [B], each further
        draft one head_pool call for all -> (drafts [k_b] a sequence, their q [k_b, V])."""
        pr = self.programs
        vocab_size = self.model.config.vocab_size
        ones = torch.ones(len(samplers), dtype=torch.long, device=self.device)
        want = [sm.draws(k) for sm in samplers]
        drafts: list[list[int]] = [[] for _ in samplers]
        qs: list[list[torch.Tensor]] = [[] for _ in samplers]
        for step in range(max(want)):
            if step:
                # (a sequence that drafts no further rides along: its head cache's entries
                # past its drafts are overwritten before they are read)
                tok = torch.tensor([[d[-1] if d else 0 for d in drafts]], device=self.device)
                p, c = self.program("head_pool")(tok, state[None], pos, slots, ones,
                                                 *head_cache)
                post, state = p[0], c[0]
                pos = pos + 1
            logits = pr.draft_logits(post)
            for b, sm in enumerate(samplers):
                if step < want[b]:
                    token, q = draw_draft(logits[b], sm.params, sm.gen, pr.vocab, vocab_size)
                    drafts[b].append(token)
                    qs[b].append(q)
        return ([torch.tensor(d, dtype=torch.long, device=self.device) for d in drafts],
                [torch.stack(q) if q else None for q in qs])

    def _lean_round(self, group: list[Step], k: int, pooled: bool) -> list:
        # Rounds of one row each (the pending token) that draft nothing, as decode steps:
        # round_many's results for them (no drafts accepted, k placeholder drafts) as host
        # lists (what the generation reads), from one read of the targets. Tensor ops a
        # sequence made a lean round cost clearly more than the decode step it runs, and
        # the lean regime is where that matters.
        # Each row: the target, n = 0 drafts accepted, k placeholder drafts of probability
        # 0 (no drafts, _drafted).
        none = [0.0] * k
        return [([t, 0] + [t] * k, none) for t in self._decode_many(group, pooled)]

    def _decode_many(self, group: list[Step], pooled: bool) -> list[int]:
        # One-token steps of several generations (decode steps, or rounds that draft
        # nothing) as one trunk pass: their next tokens as host ints, from one read. A
        # round's caches sit where a decode step's do (args: pos, kc, vc; span last).
        if pooled:
            ids = torch.tensor([[st.ids[0] for st in group]], device=self.device)
            targets = self._decode_pooled(group, ids, torch.cat([st.args[1] for st in group]))
        else:
            targets = torch.cat(self.programs.decode_many(
                [(self._tokens(st, 1), *st.args[1:4], st.args[-1]) for st in group]))
        return targets.tolist()

    @property
    def samples(self) -> bool:
        """Whether sampled requests can take this decoder: their steps run the pooled
        programs (a lone decoder's own caches are a pool of one)."""
        return self.poolable

    def steps(self, prompt_ids: list[int], max_tokens: int, k: int = 0, result=None,
              eos_ids: set[int] | None = None, chunk: int | None = None,
              params: SamplingParams | None = None, joining: int = 0):
        """generate() a step at a time. Each next() or send() gives one of: a list of the
        tokens just emitted; PIECE, after a ``chunk``-position piece of the prompt; or a
        Step, a program call whose result the caller sends back (run, or run_many for
        several generations at once). A server interleaves other sequences between.
        ``params``: sample as they say (greedy when None or greedy). ``joining``: how many
        other sequences are running beside this one (a server's)."""
        if not prompt_ids:
            raise ValueError("the prompt is empty: give at least one token")
        sampler = None
        if params is not None and not params.greedy:
            if not self.samples:
                raise ValueError("this decoder cannot sample (its steps do not pool); "
                                 "sampled requests run on the eager engine")
            params.validate()
            sampler = _Sampler(params, self.device, max_tokens)
        k = self.served_k(k) if self.has_mtp else 0
        self.check_length(len(prompt_ids), max_tokens, k)
        self.warmup_for(params, k)
        res = result if result is not None else Result()
        return self._steps(prompt_ids, max_tokens, k, res, eos_ids or set(), chunk, sampler,
                           joining)

    def _steps(self, prompt_ids, max_tokens, k, res, eos_ids, chunk, sampler=None, joining=0):
        # Inference mode is entered per step, not around the generator: a server steps it
        # from its own thread between other work.
        with torch.inference_mode():
            m = res.metrics
            m.prompt_tokens = len(prompt_ids)
            threads.tick()
            t0 = time.perf_counter()
            prefill = self._prefill(prompt_ids, k, chunk, sampler, joining)
        while True:
            with torch.inference_mode():
                try:
                    next(prefill)
                except StopIteration as done:
                    first, drafts, probs = done.value
                    break
            yield PIECE
        m.ttft_s = time.perf_counter() - t0
        at = len(prompt_ids)  # position of the pending token
        pending = first
        emitted = [int(first)]
        host = None  # greedy rounds: [pending, drafts] as ints
        dev = self.device
        while True:
            yield list(emit(emitted, res, eos_ids, max_tokens, t0))
            if res.finish_reason is not None:
                return
            threads.tick()
            if sampler is not None:
                # A sampled round: its drafts (up to k; none at k = 0 or at the end) and
                # probs, the distributions they were drawn from [drafts, V].
                with torch.inference_mode():
                    tokens = torch.cat([pending.view(1), drafts])[None]
                    args = (tokens, torch.tensor([at], device=dev), self.kc, self.vc,
                            self.hk, self.hv)
                emitted, drafted, drafts, probs = yield Step(
                    "sample", len(drafts) + 1, k, args, probs, slot=self.slot, sampler=sampler)
                n = len(emitted) - 1
                m.record(drafted, n)
                at += n + 1
                pending = torch.tensor(emitted[-1:], device=dev)
                continue
            if k == 0:
                # Decode and round read the same span at a position (k <= 31), so a row's
                # attention call is the same whichever step computes it.
                # The token goes as a host int (tokens None: made when run), as a round's.
                with torch.inference_mode():  # compiled programs' guards check the mode
                    args = (None, torch.tensor([at], device=dev), *self.kv,
                            self.span(at + SPAN_STEP))
                nxt = yield Step("decode", 1, 0, args, slot=self.slot, ids=emitted)
                m.record(0, 0)
                emitted = [int(nxt)]
                at += 1
                continue
            # The round's tokens are built from host ints (the last round's one read): a
            # server steps many sequences a round, and slicing and joining small tensors for
            # each cost a visible share of a lean round.
            if host is None:
                host = [int(pending)] + drafts.tolist()
            ps = [] if probs is None else probs if isinstance(probs, list) else probs.tolist()
            kk = k
            if self.draft_p_min is not None:
                ok = [p >= self.draft_p_min for p in ps]
                kk = ok.index(False) if False in ok else k
            t = kk + 1
            with torch.inference_mode():
                args = (None, torch.tensor([at], device=dev), *self.kv, self.hk, self.hv,
                        self.span(at + max(SPAN_STEP, 2 * k + 2)))
            # A lean batched round's placeholders (probability 0, run_many) are no drafts:
            # a round that verifies them anyway (a lone round program verifies all k)
            # does not count them.
            odds = ps[:kk]
            drafting = _drafted(odds)
            out, probs = yield Step("round", t, k, args, slot=self.slot, odds=odds, ids=host)
            # The one host read per round (a lean batched round answers with host lists).
            vals = out if isinstance(out, list) else out.tolist()
            # A batched round may have verified fewer of the drafts (run_many).
            t = len(vals) - 1 - k
            n = vals[t]
            # Counted as the eager engine does: no more drafts than tokens still allowed.
            drafted = min(t - 1, max_tokens - m.generated_tokens - 1) if drafting else 0
            m.record(drafted, min(n, drafted))
            host = [vals[n]] + vals[t + 1:]  # the pending token and the next drafts
            at += n + 1
            emitted = vals[: n + 1]


PIECE = "piece"  # what FastDecoder.steps gives after a piece of the prompt


def drafts_none(device: torch.device) -> torch.Tensor:
    """No drafts: an empty token tensor."""
    return torch.zeros(0, dtype=torch.long, device=device)


@dataclass
class Step:
    """A program call a generation asks for (FastDecoder.steps)."""

    kind: str  # "decode" or "round"
    t: int  # rows verified (round)
    k: int  # draft depth (round)
    # The program's arguments: tokens (None: made from ids when run), position, the
    # generation's caches, span.
    args: tuple
    probs: torch.Tensor | None = None  # sample: the distributions the drafts were drawn from [k, V]
    slot: int | None = None  # the generation's slot in its decoder's pool (make_pool)
    # round: the head's probabilities of its drafts [t - 1], read once on the host
    odds: list[float] | None = None
    # its tokens on the host, the pending one first (a round verifies the first t)
    ids: list[int] | None = None
    sampler: _Sampler | None = None  # sample: the request's settings and random stream


class _Sampler:
    """A sampled request's settings and its own random stream, seeded as the eager
    engine seeds it."""

    def __init__(self, params: SamplingParams, device: torch.device, max_tokens: int) -> None:
        self.params = params
        self.gen = torch.Generator(device=device)
        self.gen.manual_seed(params.seed if params.seed is not None else torch.seed())
        self.left = max_tokens  # tokens the request may still emit
        self.lean = False  # draft nothing for the next round (FastDecoder.run_many)
        # Positions the head has not caught up on (behind): tokens, states, the first.
        self._ids: list[int] = []
        self._states: list[torch.Tensor] = []
        self._first = 0

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        """The first token [1], drawn from the target's logits [V]."""
        self.left -= 1
        return sample(probs(logits, self.params), self.gen).view(1)

    def behind(self, tokens: list[int], states: torch.Tensor, first: int) -> None:
        """Note this round's accepted tokens and their trunk states [1, r, D] from position
        first, which the head has yet to catch up on."""
        if not self._ids:
            self._first = first
        self._ids += tokens
        self._states.append(states)

    def catch_up(self) -> tuple[list[int], torch.Tensor, int]:
        """Every position noted since the last catch-up: (tokens, states [1, r, D], first
        position), for the head to run over now."""
        out = (self._ids, torch.cat(self._states, 1), self._first)
        self._ids, self._states = [], []
        return out

    def draws(self, k: int) -> int:
        """Drafts to draw for the next round: k, or fewer where the tokens still allowed
        would not take them all (as the eager engine drafts, so that both draw the same
        numbers from a seed)."""
        return 0 if self.lean else max(0, min(k, self.left - 1))


def _drafted(odds: list[float] | None) -> bool:
    """Whether a round's drafts are the head's (a lean round's placeholders have
    probability 0, FastDecoder.run_many)."""
    return bool(odds) and odds[0] > 0.0




def enable_fast(engine, backend: str = "auto", draft_p_min: float | None = None,
                max_len: int | None = None, mode: str = "max-autotune") -> FastDecoder | None:
    """Give ``engine`` a FastDecoder for its greedy requests; None (with a note on stderr)
    when the model cannot take the fast path, which leaves the eager engine serving."""
    import sys

    reason = unsupported_reason(engine.model)
    if reason is not None:
        if backend != "auto":  # the default says nothing: the eager engine is its fallback
            print(f"note: --compile ignored, {reason}; decoding eagerly", file=sys.stderr)
        return None
    if draft_p_min is not None and not 0.0 <= draft_p_min < 1.0:
        raise ValueError(f"--draft-p-min must be in [0, 1), got {draft_p_min}")
    # A fixed cache length keeps the compiled programs' key stable across requests and runs;
    # attention reads only the slots in use, so a long cache costs memory, not time.
    max_len = max_len or min(engine.max_model_len, DEFAULT_MAX_LEN)
    vocab = engine.drafter.vocab if engine.drafter is not None else None
    engine.fast = FastDecoder(engine.model, vocab, max_len=max_len, backend=backend, mode=mode,
                              draft_p_min=draft_p_min)
    return engine.fast
