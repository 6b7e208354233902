"""MTP against no MTP in the server's scheduler, in one process, passes alternating.

Loads the built-in model (compiled programs as `mtpkit serve` loads them; run `mtpkit
warmup` first), drives the server's Scheduler directly (no HTTP, no client on the same
CPUs) with C concurrent greedy requests of 64 tokens over the 12 built-in prompts, and
switches the one scheduler between k=1 and k=0 pass by pass (MTP first, then no MTP first,
and so on), so that both meet the same drift of a shared machine. Prints each pass's output
tok/s, the ratio of the sums, how the batched rounds went (lean rounds that draft nothing,
drafting rounds by rows verified, with their mean seconds), and how well the head's
probability of a first draft predicted its acceptance (what the server's drafting choices,
engine/budget.py, rely on).
MODE: policy (the server's own drafting choices), draft (every batched round drafts), lean
(every batched round is lean), or stub (lean, with the trunk's one-token pass replaced by a
no-op, so that the times left are the scheduler's and the engine's own work; it also prints
the median time of a sequence's turn in the scheduler; its text is garbage).
Usage: python scripts/server_mtp_ab.py [C=4] [PASSES=8] [REQUESTS=32] [MODE=policy]
"""

from __future__ import annotations

import collections
import sys
import threading
import time

from mtpkit import threads
from mtpkit.bench.prompts import BUILTIN
from mtpkit.engine import fast as fast_mod
from mtpkit.engine.programs import Programs
from mtpkit.engine.sampling import SamplingParams
from mtpkit.engine.session import Session
from mtpkit.serve.scheduler import Request, Scheduler


def main(c: int = 4, passes: int = 8, requests: int = 32, mode: str = "policy") -> None:
    """Run the passes and print what they measured."""
    if mode not in ("policy", "draft", "lean", "stub"):
        sys.exit(f"unknown MODE {mode!r}: policy, draft, lean or stub")
    if mode != "policy":
        from mtpkit.engine import budget
        budget.RoundChoices.lean = lambda self, k, n, sampled=False: mode != "draft" and n > 1
    if mode == "stub":
        fast_mod.FastDecoder._decode_pooled = lambda self, group, ids, pos: ids[0] + 1
    loaded = []

    def load():
        session = Session.load("builtin")
        fast = session.engine.fast
        fast.warmup(1)
        fast.warmup(0)
        fast.warmup_pooled()
        loaded.append(session)
        loaded.append(Scheduler(
            session.engine.model, session.tokenizer, drafter=session.engine.drafter,
            num_draft_tokens=1, max_num_seqs=c, max_queue=4 * requests, max_model_len=2048,
            prefill_chunk=256, stats=None, packed=True, fast=fast))

    # Loaded, and the scheduler made, in a thread that then ends, as the server does:
    # libgomp keeps a thread team for every thread that ran parallel work while that thread
    # lives, and with a second team beside the scheduler's its workers sleep between
    # parallel regions (mtpkit/threads.py), which slows every step. The main thread submits
    # requests, computing alone as the server's request threads do.
    t = threading.Thread(target=load)
    t.start()
    t.join()
    session, sched = loaded
    threads.compute_alone()
    rounds: dict[tuple, list] = collections.defaultdict(lambda: [0, 0.0])  # key -> n, s
    calib = [[0, 0] for _ in range(10)]  # first drafts by probability tenth: n, accepted
    seen: dict = {}
    run_many, lean_round = fast_mod.FastDecoder.run_many, fast_mod.FastDecoder._lean_round
    round_many = Programs.round_many

    def lean_round_timed(self, *args):
        seen["lean"] = True
        return lean_round(self, *args)

    def round_many_timed(self, items, k, **kw):
        seen["rows"] = sum(it[0].shape[1] for it in items)
        return round_many(self, items, k, **kw)

    def run_many_timed(self, steps):
        seen.clear()
        t0 = time.perf_counter()
        out = run_many(self, steps)
        dt = time.perf_counter() - t0
        n = len(steps)
        kind = ("lean round" if "lean" in seen else "drafting round" if "rows" in seen
                else "/".join(sorted({st.kind for st in steps})))
        rows = n if "lean" in seen else seen.get("rows", sum(st.t for st in steps))
        entry = rounds[(sched.num_draft_tokens, kind, n, rows)]
        entry[0] += 1
        entry[1] += dt
        for st, o in zip(steps, out, strict=True):
            if n > 1 and st.kind == "round" and st.odds:
                vals = o[0] if isinstance(o[0], list) else o[0].tolist()
                t = len(vals) - 1 - st.k  # rows verified: the pending token and t - 1 drafts
                if t >= 2:
                    b = min(int(st.odds[0] * 10), 9)
                    calib[b][0] += 1
                    calib[b][1] += vals[t] >= 1
        return out

    turns: dict[int, list[float]] = collections.defaultdict(list)  # k -> a turn's seconds
    if mode == "stub":
        from mtpkit.serve import scheduler as sched_mod

        worker_turn = sched_mod._FastWorker.turn

        def turn_timed(self):
            t0 = time.perf_counter()
            out = worker_turn(self)
            if self.step is not None and self.step.kind in ("decode", "round"):
                turns[sched.num_draft_tokens].append(time.perf_counter() - t0)
            return out

        sched_mod._FastWorker.turn = turn_timed

    fast_mod.FastDecoder.run_many = run_many_timed
    fast_mod.FastDecoder._lean_round = lean_round_timed
    Programs.round_many = round_many_timed
    prompts = [session.tokenizer.encode(p.text) for p in BUILTIN]

    def run(n: int) -> float:
        done = threading.Semaphore(0)

        def on_event(e):
            if e[0] in ("done", "error", "aborted"):
                done.release()

        reqs = [Request(id=str(i), prompt_ids=prompts[i % len(prompts)],
                        params=SamplingParams(max_tokens=64, ignore_eos=True),
                        on_event=on_event) for i in range(n)]
        t0 = time.perf_counter()
        for r in reqs:
            sched.submit(r)
        for _ in reqs:
            done.acquire()
        return sum(r.completion_tokens for r in reqs) / (time.perf_counter() - t0)

    try:
        for k in (1, 0):  # each way once before measuring
            sched.num_draft_tokens = k
            run(c)
        rounds.clear()
        turns.clear()
        calib[:] = [[0, 0] for _ in range(10)]
        rates: dict[int, list[float]] = {1: [], 0: []}
        for p in range(passes):
            for k in (1, 0) if p % 2 == 0 else (0, 1):
                sched.num_draft_tokens = k
                rates[k].append(run(requests))
                print(f"pass {p} k={k}: {rates[k][-1]:.1f} output tok/s", flush=True)
    finally:
        sched.stop()
    print(f"c={c}: k=1 {[round(x, 1) for x in rates[1]]}, k=0 {[round(x, 1) for x in rates[0]]}"
          f"; MTP / no MTP (sums): {sum(rates[1]) / sum(rates[0]):.3f}")
    print("batched calls (k, kind, sequences, rows): count, mean ms")
    for key in sorted(rounds, key=str):
        n, s = rounds[key]
        print(f"  {key}: {n}, {1000 * s / n:.3f}")
    for k, ts in sorted(turns.items()):
        # The median: a turn that runs a piece of a prompt takes far longer.
        print(f"k={k}: a sequence's turn in the scheduler, median "
              f"{1e6 * sorted(ts)[len(ts) // 2]:.1f} us ({len(ts)} turns)")
    print("first drafts verified, by the head's probability: count, accepted")
    for b, (n, a) in enumerate(calib):
        if n:
            print(f"  p {b / 10:.1f}-{(b + 1) / 10:.1f}: {n}, {a / n:.2f}")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:4]), *sys.argv[4:5])
