"""Decode and verify(k+1) programs of the compiled path in one loop, alternating.

Loads MODEL (``builtin`` for the default model), builds its AOTI decode and verify(K+1)
programs (cached), prefills 128 tokens, and times REPS turns of N calls of each, one program
after the other, printing the minimum and median ms a call of both and their ratio: fewer
moving parts than ``mtpkit bench steps`` (no draft or round program, no bandwidth reads),
for comparing two builds in turns (one process each, alternating). Its long runs of one
program can read slower than that command's turns of 20 calls (session 22, W4A8 verify of
4 rows: 3.65-3.9 ms here in four runs of five, 2.84-2.85 there), so compare like with like.
Usage: python scripts/step_loop.py MODEL [K=3] [N=100] [REPS=7]
"""

from __future__ import annotations

import sys
import time
import warnings

import torch


def main(path: str, k: int, n: int, reps: int) -> None:
    """Print min and median ms a call of decode and verify(k+1), and their ratio."""
    from mtpkit.builtin import builtin_trunk
    from mtpkit.engine.fast import FastDecoder
    from mtpkit.engine.generate import Engine
    from mtpkit.engine.loader import load_model

    warnings.simplefilter("ignore")
    torch.set_num_threads(2)
    model = load_model(str(builtin_trunk()) if path == "builtin" else path,
                       tokenizer=False).model
    engine = Engine(model)
    vocab = engine.drafter.vocab if engine.drafter is not None else None
    dec = FastDecoder(model, vocab, max_len=2048, backend="aoti")
    context = 128
    dec.prefill(list(range(10, 10 + context)), k if dec.has_mtp else 0)
    at, span = torch.tensor([context]), dec.span(context + 2 * k + 2)
    tok, toks = torch.tensor([[11]]), torch.full((1, k + 1), 11)
    decode, verify = dec.program("decode"), dec.program("verify", k + 1)
    calls = {"decode": lambda: decode(tok, at, *dec.kv, span),
             "verify": lambda: verify(toks, at, *dec.kv, span)}

    def turn(fn) -> float:
        t = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t) / n * 1e3

    times: dict[str, list[float]] = {name: [] for name in calls}
    with torch.inference_mode():
        for fn in calls.values():
            for _ in range(30):
                fn()
        for _ in range(reps):
            for name, fn in calls.items():
                times[name].append(turn(fn))
    parts = []
    for name, ts in times.items():
        ts.sort()
        parts.append(f"{name} min {ts[0]:.3f} median {ts[len(ts) // 2]:.3f} ms")
    print(f"{path} k={k}: " + ", ".join(parts)
          + f"; verify/decode (min) {times['verify'][0] / times['decode'][0]:.2f}")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python scripts/step_loop.py MODEL [K=3] [N=100] [REPS=7]")
    args = [int(a) for a in sys.argv[2:5]]
    main(sys.argv[1], *(args + [3, 100, 7][len(args):]))
