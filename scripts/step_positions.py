"""Decode and k=1 round programs of the compiled path, timed as generation calls them.

Loads MODEL (a checkpoint with an MTP head), builds its AOTI programs (cached), and times 200
calls each of the decode and the k=1 round program at one fixed position (60, as
``bench steps`` does at its context), at positions advancing two a call (60 to 460), and a
real k=1 loop (the round program fed its own drafts, as ``FastDecoder`` runs it) on a
60-token prompt; three repeats. Usage: python scripts/step_positions.py MODEL
"""

from __future__ import annotations

import gc
import sys
import time
import warnings

import torch


def main(path: str) -> None:
    """Print ms a call for decode and round, fixed and advancing, and the real loop."""
    from mtpkit.engine.fast import FastDecoder
    from mtpkit.engine.generate import Engine
    from mtpkit.engine.loader import load_model
    from mtpkit.engine.programs import SPAN_STEP

    warnings.simplefilter("ignore")
    torch.set_num_threads(2)
    engine = Engine(load_model(path, tokenizer=False).model)
    if engine.drafter is None:
        raise SystemExit(f"{path} has no MTP head")
    dec = FastDecoder(engine.model, engine.drafter.vocab, max_len=2048, backend="aoti")
    dec.warmup(1)
    decode, round_ = dec.program("decode"), dec.program("round", 2, 1)
    prompt, n = list(range(100, 160)), 200
    gc.collect()
    gc.freeze()  # a full collection (0.2 s here) inside a timed loop would swamp it
    one, two = torch.tensor([[11]]), torch.tensor([[11, 12]])
    with torch.inference_mode():
        for _ in range(3):
            line = []
            for mode in ("fixed", "advancing"):
                times = []
                for prog, tokens, bufs in ((decode, one, dec.kv),
                                           (round_, two, (*dec.kv, dec.hk, dec.hv))):
                    dec.prefill(prompt, 1)
                    start = time.perf_counter()
                    for i in range(n):
                        at = len(prompt) + (0 if mode == "fixed" else 2 * i)
                        prog(tokens, torch.tensor([at]), *bufs, dec.span(at + max(SPAN_STEP, 4)))
                    times.append((time.perf_counter() - start) / n * 1e3)
                line.append(f"{mode}: decode {times[0]:.2f} round {times[1]:.2f} ms")
            first, drafts, _ = dec.prefill(prompt, 1)
            at, pending, made = len(prompt), first, 0
            start = time.perf_counter()
            for _ in range(n):
                tokens = torch.cat([pending.view(1), drafts[:1]])[None]
                out, _ = round_(tokens, torch.tensor([at]), *dec.kv, dec.hk, dec.hv,
                                dec.span(at + max(SPAN_STEP, 4)))
                accepted = out.tolist()[2]
                drafts, pending = out[3:], out[accepted : accepted + 1]
                at, made = at + accepted + 1, made + accepted + 1
            ms = (time.perf_counter() - start) / n * 1e3
            line.append(f"real k=1 loop: round {ms:.2f} ms, {made / n:.2f} tokens a round")
            print(" | ".join(line), flush=True)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python scripts/step_positions.py MODEL")
    main(sys.argv[1])
