"""Measure a head: teacher mode (batched, no generation) or real speculative generation."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from ..engine.generate import Engine, Result
from ..engine.metrics import SpecMetrics
from ..engine.sampling import SamplingParams
from ..models.eagle3 import is_eagle3
from ..quant.linear import linear_rows
from .data import iter_chunks


@dataclass
class TeacherReport:
    """Chained greedy drafts scored against the trunk's own greedy choices over a corpus.

    Draft s at position i is accepted when drafts 1..s-1 were and it equals the trunk's
    argmax given the prefix. The trunk's argmax after a draft is known from one teacher-forced
    pass only where the corpus continues with that draft, so the rate at depth s is measured,
    conditionally on depth s-1 passing, at those positions; ``per_position`` chains them.
    """

    positions: int = 0
    passed: list[int] = field(default_factory=list)  # [k] drafts accepted at depth s
    tried: list[int] = field(default_factory=list)  # [k] drafts evaluable at depth s
    seconds: float = 0.0
    nll: float = 0.0  # the trunk's summed -log p(next corpus token), natural log
    predicted: int = 0  # tokens that sum is over

    @property
    def perplexity(self) -> float | None:
        """exp(mean negative log-likelihood) of the trunk on the corpus chunks read."""
        return math.exp(self.nll / self.predicted) if self.predicted else None

    @property
    def conditional(self) -> list[float]:
        """P(draft s accepted | drafts before it accepted)."""
        return [p / t if t else 0.0 for p, t in zip(self.passed, self.tried, strict=True)]

    @property
    def per_position(self) -> list[float]:
        """P(drafts 1..s all accepted): vLLM's per-position acceptance rate."""
        out, acc = [], 1.0
        for c in self.conditional:
            acc *= c
            out.append(acc)
        return out

    @property
    def mean_acceptance_length(self) -> float:
        """1 + expected accepted drafts per step."""
        return 1.0 + sum(self.per_position)

    def as_dict(self) -> dict:
        """Plain data for --json."""
        return {"mode": "teacher", "positions": self.positions,
                "per_position_acceptance_rate": self.per_position,
                "conditional_acceptance_rate": self.conditional,
                "mean_acceptance_length": self.mean_acceptance_length,
                "perplexity": self.perplexity, "perplexity_tokens": self.predicted,
                "seconds": self.seconds}


@torch.inference_mode()
def teacher_eval(
    model, tokenizer, files: list[str], k: int, max_tokens: int = 20000,
    seq_len: int = 256, batch_size: int = 4, draft_vocab: torch.Tensor | None = None,
) -> TeacherReport:
    """Per-position acceptance of k chained greedy drafts, batched over corpus chunks.

    With ``draft_vocab`` the drafts come from that token subset, as when decoding."""
    # The draft vocabulary's rows of each step's output head in that head's own form (int8
    # codes stay codes), as the engine drafts with them; .weight would dequantize it whole.
    sub = vocab = None
    if is_eagle3(model.mtp):
        # Its own lm_head scores its own draft vocabulary (rows -> token ids by d2t); it has
        # no full-vocabulary draft_head to take rows of.
        vocab, sub = model.mtp.target_ids(), [model.mtp.lm_head] * k
    elif draft_vocab is not None:
        vocab = draft_vocab.to(model.model.embed_tokens.weight.device)
        heads = [model.draft_head(s) for s in range(k)]
        rows = {}  # one row copy per distinct head (most steps share the lm_head)
        for h in heads:
            if id(h) not in rows:
                rows[id(h)] = linear_rows(h, vocab)
        sub = [rows[id(h)] for h in heads]
    rep = TeacherReport(passed=[0] * k, tried=[0] * k)
    spec = model.mtp.spec
    t0 = time.perf_counter()
    chunks = iter_chunks(tokenizer, files, seq_len)
    while rep.positions < max_tokens:
        batch = [c for _, c in zip(range(batch_size), chunks, strict=False)]
        if not batch:
            break
        ids = torch.tensor(batch, device=model.model.embed_tokens.weight.device)
        out = model(ids)
        logits = model.logits(out.hidden)
        greedy = logits.argmax(-1)  # [B, T]: trunk's choice after each pos
        # The trunk's perplexity on the same chunks: what a quantized trunk lost, measured
        # beside what its head accepts.
        logp = torch.log_softmax(logits[:, :-1].float(), -1)
        rep.nll -= float(logp.gather(-1, ids[:, 1:, None]).sum())
        rep.predicted += ids.shape[0] * (ids.shape[1] - 1)
        del logits, logp
        t = ids.shape[1]
        n = t - 1 - k  # positions i whose depth-k target greedy[i + k] exists
        if n <= 0:
            break
        cos, sin = (getattr(model, "mtp_rotary", None) or model.rotary).cos_sin(
            torch.arange(n, device=ids.device))
        hidden = out.for_mtp(spec.trunk_hidden)[:, :n]
        tokens = ids[:, 1 : 1 + n]  # the pending token x = t_{i+1}
        # Depth 1 is exact at every position: the trunk verifies d1 given the corpus prefix.
        alive = torch.ones_like(tokens, dtype=torch.bool)
        for s in range(1, k + 1):
            post, pre = model.mtp(model.model.embed_tokens(tokens), hidden, s - 1, cos, sin, None)
            if sub is None:
                draft = model.draft_logits(post, s - 1).argmax(-1)
            else:
                draft = vocab[sub[s - 1](post).argmax(-1)]
            ok = draft == greedy[:, s : s + n]
            rep.tried[s - 1] += int(alive.sum())
            rep.passed[s - 1] += int((alive & ok).sum())
            # Depth s+1 is evaluable where the corpus went on with this (correct) draft.
            alive = alive & ok
            if s < k:
                alive = alive & (ids[:, s + 1 : s + 1 + n] == draft)
            hidden = post if spec.chain_hidden == "post_norm" else pre
            tokens = draft
        rep.positions += ids.shape[0] * n
    rep.seconds = time.perf_counter() - t0
    return rep


def generate_eval(
    engine: Engine, tokenizer, files: list[str], k: int, prompts: int = 8,
    prompt_tokens: int = 64, max_tokens: int = 64,
) -> dict:
    """Real greedy speculative decoding on prompts cut from the data; vLLM-style metrics."""
    total = SpecMetrics()
    plain_s = spec_s = 0.0
    identical = True
    for n, chunk in enumerate(iter_chunks(tokenizer, files, prompt_tokens)):
        if n >= prompts:
            break
        params = SamplingParams(max_tokens=max_tokens)
        runs = {}
        for kk in (0, k):
            res = Result()
            t0 = time.perf_counter()
            for _ in engine.generate(chunk, params, kk, result=res):
                pass
            runs[kk] = (res, time.perf_counter() - t0)
        identical &= runs[0][0].tokens == runs[k][0].tokens
        total.add(runs[k][0].metrics)
        plain_s += runs[0][1]
        spec_s += runs[k][1]
    d = total.as_dict()
    d.update({"mode": "generate", "k": k, "identical_to_no_mtp": identical,
              "speedup": plain_s / spec_s if spec_s else None,
              "seconds_without_mtp": plain_s, "seconds_with_mtp": spec_s})
    return d
