"""Per-step costs of the fast path: one decode step, one verification of k+1 tokens, one MTP
draft step and one whole speculative round, eager and compiled, against the bandwidth bound.

These are the numbers speculative decoding lives on: a round pays when verify(k+1) plus k
draft steps cost little more than one decode step (issue: fast decoding on CPU)."""

from __future__ import annotations

import statistics
import time

import torch

from .common import measure_bandwidth, weight_bytes


def _time(fn, repeats: int) -> float:
    """Median milliseconds of fn() over ``repeats`` calls after one warm-up call."""
    fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return 1000 * statistics.median(out)


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


@torch.inference_mode()
def step_costs(engine, backend: str, k: int, context: int = 128, repeats: int = 20,
               max_len: int = 2048, turns: int = 5, bandwidth=None) -> dict:
    """Milliseconds per program for one backend, at a cache filled to ``context`` positions.

    The programs are timed in ``turns`` turns, each timing every program ``repeats`` times
    (and ``bandwidth()``, GB/s, when given): a machine's speed can drift by a quarter within
    minutes, so a ratio of two programs timed in separate blocks measures the drift as much
    as the programs. A ratio is taken
    within each turn, and the row reports the median over turns and its range."""
    from ..engine.fast import FastDecoder

    model = engine.model
    vocab = engine.drafter.vocab if engine.drafter is not None else None
    t0 = time.perf_counter()
    dec = FastDecoder(model, vocab, max_len=max_len, backend=backend)
    dev = dec.device
    prompt = list(range(10, 10 + context))
    dec.prefill(prompt, k if dec.has_mtp else 0)
    at = torch.tensor([context], device=dev)
    span = dec.span(context + 2 * k + 2)
    tok = torch.tensor([[11]], device=dev)
    toks = torch.full((1, k + 1), 11, device=dev)
    # Every program is built (or loaded) before any is timed.
    decode, verify = dec.program("decode"), dec.program("verify", k + 1)
    calls = {"decode": lambda: decode(tok, at, *dec.kv, span),
             "verify": lambda: verify(toks, at, *dec.kv, span)}
    if dec.has_mtp:
        draft, rnd = dec.program("draft_step"), dec.program("round", k + 1, k)
        state = torch.zeros(1, 1, model.config.hidden_size, device=dev, dtype=dec.kc[0].dtype)
        calls["draft"] = lambda: draft(tok, state, at, dec.hk, dec.hv, span)
        calls["round"] = lambda: rnd(toks, at, *dec.kv, dec.hk, dec.hv, span)
    build_s = time.perf_counter() - t0
    per_turn = []
    for _ in range(turns):
        turn = {name: _time(fn, repeats) for name, fn in calls.items()}
        if bandwidth is not None:
            turn["bandwidth_gbs"] = bandwidth()
        per_turn.append(turn)
    row = {"backend": backend, "build_s": build_s, "turns": per_turn}
    for name in calls:
        row[f"{name}_ms"] = statistics.median(t[name] for t in per_turn)
        if name != "decode":
            row[f"{name}_over_decode"] = _spread([t[name] / t["decode"] for t in per_turn])
    return row


def steps_report(engine, backends: list[str], k: int, context: int, repeats: int,
                 turns: int = 5, bandwidth_mb: int = 256) -> dict:
    """Rows per backend, ratios to that backend's decode step, and the bandwidth bound
    (each decode step against the bandwidth measured in its own turn)."""
    wb = weight_bytes(engine.model)

    def bandwidth() -> float:
        return measure_bandwidth(bandwidth_mb, repeats=3)

    rows = [step_costs(engine, b, k, context, repeats, turns=turns, bandwidth=bandwidth)
            for b in backends]
    for r in rows:
        r["decode_over_bound"] = _spread(
            [t["decode"] / (1000 * wb["trunk"] / (t["bandwidth_gbs"] * 1e9))
             for t in r["turns"]])
    gbs = statistics.median(t["bandwidth_gbs"] for r in rows for t in r["turns"])
    vocab = engine.drafter.vocab if engine.drafter is not None else None
    return {"k": k, "context": context, "turns": turns, "repeats": repeats,
            "bandwidth_gbs": gbs, "trunk_bytes": wb["trunk"],
            "decode_bound_ms": 1000 * wb["trunk"] / (gbs * 1e9), "rows": rows,
            "draft_vocab_rows": None if vocab is None else int(len(vocab))}
