"""The offline k-sweep: one process, one loaded model, every draft length on the same prompts."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..engine.generate import Engine, Result
from ..engine.metrics import SpecMetrics
from ..engine.sampling import SamplingParams
from .common import in_turn, summarize


@dataclass
class Run:
    """One generation: a prompt at one k, one repetition."""

    k: int
    prompt: int
    repeat: int
    tokens: list[int]
    metrics: SpecMetrics

    def record(self) -> dict:
        """Plain data for runs.csv / results.json."""
        m = self.metrics
        return {"k": self.k, "prompt": self.prompt, "repeat": self.repeat,
                "prompt_tokens": m.prompt_tokens, "generated_tokens": m.generated_tokens,
                "ttft_s": m.ttft_s, "elapsed_s": m.elapsed_s, "tokens_per_s": m.tokens_per_s,
                "num_drafts": m.num_drafts, "num_draft_tokens": m.num_draft_tokens,
                "num_accepted_tokens": m.num_accepted_tokens}


@dataclass
class KSummary:
    """Every run at one k, pooled."""

    k: int
    metrics: SpecMetrics
    tokens_per_s: float  # pooled decode rate: tokens after the first / decode seconds
    run_tokens_per_s: list[float]
    ttft_s: dict
    identical: bool  # every output equals the k = 0 output of the same prompt
    speedup: float | None = None
    bound_tokens_per_s: float | None = None  # bandwidth-bound limit (None: not measured)

    def as_dict(self) -> dict:
        """Plain data for results.json and summary.csv."""
        m = self.metrics
        return {
            "k": self.k, "tokens_per_s": self.tokens_per_s, "speedup": self.speedup,
            "ttft_s_mean": self.ttft_s["mean"], "ttft_s_median": self.ttft_s["median"],
            "mean_acceptance_length": m.mean_acceptance_length if self.k else None,
            "acceptance_rate": m.acceptance_rate if self.k else None,
            "per_position_acceptance_rate": m.per_position_rate,
            "num_drafts": m.num_drafts, "num_draft_tokens": m.num_draft_tokens,
            "num_accepted_tokens": m.num_accepted_tokens,
            "num_accepted_tokens_per_pos": list(m.accepted_per_pos),
            "generated_tokens": m.generated_tokens, "decode_s": m.decode_s,
            "identical_to_k0": self.identical,
            "bound_tokens_per_s": self.bound_tokens_per_s,
            "fraction_of_bound": (self.tokens_per_s / self.bound_tokens_per_s
                                  if self.bound_tokens_per_s else None),
            "run_tokens_per_s": self.run_tokens_per_s,
        }


@dataclass
class OfflineResult:
    """The sweep: per-k summaries, every run, the recommendation."""

    ks: list[int]
    summaries: dict[int, KSummary]
    runs: list[Run] = field(default_factory=list)
    recommended_k: int = 0
    note: str = ""

    @property
    def identical(self) -> bool:
        """Greedy outputs equal across every k."""
        return all(s.identical for s in self.summaries.values())


def sweep(
    engine: Engine,
    prompts: list[list[int]],
    ks: list[int],
    max_tokens: int = 64,
    repeat: int = 1,
    ignore_eos: bool = False,
    warmup: bool = True,
    drafter=None,
    on_run=None,
) -> OfflineResult:
    """Greedy generation of every prompt at every k (k = 0 added as the baseline), pooled.

    The k values take turns within each prompt and repetition, their order rotated by one
    each prompt, so that a machine whose speed drifts (other load, clocks) biases no k
    against another."""
    if not prompts:
        raise ValueError("no prompts to benchmark")
    if any(k < 0 for k in ks):
        raise ValueError("draft lengths must be >= 0")
    if any(k > 0 for k in ks) and not engine.has_mtp and drafter is None:
        raise ValueError("the model has no MTP head: only k = 0 can be measured; pass --head")
    ks = sorted(set(ks) | {0})
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
    params.validate()
    for ids in prompts:
        engine.check_length(len(ids), max_tokens)
    if warmup:
        _warm_up(engine, prompts, ks, params, drafter)
    runs: list[Run] = []
    for r in range(repeat):
        for i, ids in enumerate(prompts):
            for k in in_turn(ks, r * len(prompts) + i):
                res = Result()
                for _ in engine.generate(ids, params, k, result=res, drafter=drafter):
                    pass
                run = Run(k, i, r, list(res.tokens), res.metrics)
                runs.append(run)
                if on_run is not None:
                    on_run(run)
    base = {(x.prompt, x.repeat): x.tokens for x in runs if x.k == 0}
    summaries = {}
    for k in ks:
        mine = [x for x in runs if x.k == k]
        total = SpecMetrics()
        for x in mine:
            total.add(x.metrics)
        # Pooled, not a mean of rates: long and short outputs weigh by their tokens.
        decode_tokens = sum(max(x.metrics.generated_tokens - 1, 0) for x in mine)
        rate = decode_tokens / total.decode_s if total.decode_s > 0 else 0.0
        summaries[k] = KSummary(
            k, total, rate,
            [x.metrics.tokens_per_s for x in mine if x.metrics.generated_tokens > 1],
            summarize([x.metrics.ttft_s for x in mine]),
            all(x.tokens == base[(x.prompt, x.repeat)] for x in mine),
        )
    base_rate = summaries[0].tokens_per_s
    for s in summaries.values():
        s.speedup = s.tokens_per_s / base_rate if base_rate else None
    result = OfflineResult(ks, summaries, runs)
    result.recommended_k, result.note = recommend(summaries)
    return result


def _warm_up(engine, prompts, ks, params, drafter) -> None:
    # Every k's code path runs once, and the caches get the size the longest request needs
    # (the engine sizes them from max_tokens before the first token), so that no measured run
    # pays for first-call allocation. A few tokens suffice: the generator is closed early.
    longest = max(prompts, key=len)
    for k in ks:
        gen = engine.generate(longest, params, k, result=Result(), drafter=drafter)
        try:
            for n, _ in enumerate(gen):
                if n >= 8:
                    break
        finally:
            gen.close()


def recommend(summaries: dict[int, KSummary]) -> tuple[int, str]:
    """The fastest k whose outputs are identical to k = 0, with a sentence on the margin."""
    ok = [s for s in summaries.values() if s.identical and s.tokens_per_s > 0]
    if not ok:
        return 0, "no k produced output identical to k = 0; decode without MTP"
    best = max(ok, key=lambda s: s.tokens_per_s)
    if best.k == 0:
        return 0, "no draft length beats plain decoding on this model and machine"
    rest = [s for s in ok if s.k != best.k]
    runner = max(rest, key=lambda s: s.tokens_per_s) if rest else None
    note = f"k={best.k} is {best.speedup:.2f}x plain decoding"
    if runner is not None and runner.tokens_per_s > 0.97 * best.tokens_per_s:
        note += f"; k={runner.k} is within 3% (within run-to-run noise)"
    return best.k, note


def bound_tokens_per_s(wb: dict, k: int, mean_acceptance_length: float,
                       bandwidth_gbs: float, draft_rows: int | None) -> float:
    """Tokens/s if every step only streamed its weights at the measured bandwidth.

    A verification step reads the trunk once for k+1 positions and yields L tokens on
    average (the mean acceptance length); drafting reads the head k times, each with the
    lm_head rows it scores (the draft vocabulary, or all of it)."""
    step = wb["trunk"]
    if k:
        lm = wb["lm_head"] if draft_rows is None else draft_rows * wb["lm_head_row"]
        step += k * (wb["head"] + lm)
    tokens = mean_acceptance_length if k else 1.0
    return tokens * bandwidth_gbs * 1e9 / step
