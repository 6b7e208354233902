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
    """Median milliseconds of fn() over ``repeats`` calls after two warm-up calls."""
    fn()
    fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return 1000 * statistics.median(out)


@torch.inference_mode()
def step_costs(engine, backend: str, k: int, context: int = 128, repeats: int = 30,
               max_len: int = 2048) -> dict:
    """Milliseconds per program for one backend, at a cache filled to ``context`` positions."""
    from ..engine.fast import FastDecoder

    model = engine.model
    vocab = engine.drafter.vocab if engine.drafter is not None else None
    dec = FastDecoder(model, vocab, max_len=max_len, backend=backend)
    dev = dec.device
    prompt = list(range(10, 10 + context))
    dec.prefill(prompt, k if dec.has_mtp else 0)
    at = torch.tensor([context], device=dev)
    span = dec.span(context + 2 * k + 2)
    tok = torch.tensor([[11]], device=dev)
    row = {"backend": backend}
    t0 = time.perf_counter()
    decode = dec.program("decode")
    row["decode_ms"] = _time(lambda: decode(tok, at, dec.kc, dec.vc, span), repeats)
    verify = dec.program("verify", k + 1)
    toks = torch.full((1, k + 1), 11, device=dev)
    row["verify_ms"] = _time(lambda: verify(toks, at, dec.kc, dec.vc, span), repeats)
    if dec.has_mtp:
        draft = dec.program("draft_step")
        state = torch.zeros(1, 1, model.config.hidden_size, device=dev, dtype=dec.kc[0].dtype)
        row["draft_ms"] = _time(lambda: draft(tok, state, at, dec.hk, dec.hv, span), repeats)
        rnd = dec.program("round", k + 1, k)
        row["round_ms"] = _time(
            lambda: rnd(toks, at, dec.kc, dec.vc, dec.hk, dec.hv, span), repeats)
    row["build_s"] = time.perf_counter() - t0
    return row


def steps_report(engine, backends: list[str], k: int, context: int, repeats: int) -> dict:
    """Rows per backend, ratios to that backend's decode step, and the bandwidth bound."""
    rows = [step_costs(engine, b, k, context, repeats) for b in backends]
    for r in rows:
        r["verify_over_decode"] = r["verify_ms"] / r["decode_ms"]
        if "draft_ms" in r:
            r["draft_over_decode"] = r["draft_ms"] / r["decode_ms"]
            r["round_over_decode"] = r["round_ms"] / r["decode_ms"]
    gbs = measure_bandwidth()
    wb = weight_bytes(engine.model)
    bound_ms = 1000 * wb["trunk"] / (gbs * 1e9)
    vocab = engine.drafter.vocab if engine.drafter is not None else None
    return {"k": k, "context": context, "bandwidth_gbs": gbs, "trunk_bytes": wb["trunk"],
            "decode_bound_ms": bound_ms, "rows": rows,
            "draft_vocab_rows": None if vocab is None else int(len(vocab))}
