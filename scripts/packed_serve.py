"""Packed against taken-in-turns serving of hybrid and MLA trunks (mtpkit serve's eager engine).

Builds a random mid-size checkpoint of a hybrid Gated-DeltaNet trunk (Qwen3.5 layout: three
linear-attention layers to one full-attention layer) or a DeepSeek-V3 MLA + MoE trunk with
transformers, gives it a briefly distilled MTP head and a character tokenizer (the test
helpers in tests/tiny.py), then runs the server's scheduler in process: C concurrent
requests of 64 tokens, greedy, with packed trunk forwards (the default) and without
(``--no-packed``: each sequence's forward alone, in turns), in turns, printing output tok/s.
Random weights: the head's acceptance means nothing here, only the trunk's cost does.
Usage: python scripts/packed_serve.py {hybrid,mla} [C=4] [K=0] [REPS=2]
"""

from __future__ import annotations

import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def build(kind: str, out: Path) -> None:
    """A random checkpoint of about 100M parameters with a one-layer MTP head."""
    import tiny

    if kind == "hybrid":
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

        cfg = Qwen3_5TextConfig(
            vocab_size=tiny.VOCAB, hidden_size=1024, intermediate_size=2816,
            num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
            max_position_embeddings=1024, linear_num_key_heads=8, linear_num_value_heads=16,
            linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4,
            tie_word_embeddings=False, partial_rotary_factor=0.25,
            layer_types=["linear_attention"] * 3 + ["full_attention"]
            + ["linear_attention"] * 3 + ["full_attention"])
        fam = tiny.Family("hybrid", lambda: Qwen3_5ForCausalLM(cfg),
                          mtp_config_key="mtp_num_hidden_layers")
    else:
        fam = tiny.Family("mla", lambda: tiny._deepseek_v3(
            True, hidden_size=1024, intermediate_size=2816, num_hidden_layers=6,
            num_attention_heads=16, num_key_value_heads=16, q_lora_rank=384,
            kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
            moe_intermediate_size=512, n_routed_experts=16, n_group=4, topk_group=2,
            max_position_embeddings=1024), mtp_layout="deepseek", adjust=tiny._soften_mla_queries)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tiny.write_checkpoint(fam, out)
        tiny.add_mtp_head(out, fam, steps=20)
    tiny.write_char_tokenizer(out)


def serve(ref, packed: bool, c: int, k: int) -> float:
    """Output tok/s of 2c requests, c at a time, through the scheduler."""
    from mtpkit.engine.sampling import SamplingParams
    from mtpkit.serve.scheduler import Request, Scheduler

    sched = Scheduler(ref.model, ref.tok, drafter=ref.engine.drafter, num_draft_tokens=k,
                      max_num_seqs=c, max_queue=64, max_model_len=1024, prefill_chunk=256,
                      stats=None, packed=packed)
    prompts = ["def main(argv):\n", "import os, sys\n", "class Tree:\n    def walk(self):",
               "for i in range(10):\n", "x = [a * b for a, b in pairs]\n", "# parse the",
               "return sorted(items, key=len)", "with open(path) as f:\n"]
    sem, lock, done = threading.Semaphore(c), threading.Lock(), threading.Event()
    n = 2 * c
    left, tokens = [n], [0]

    def on_event(req):
        def f(ev):
            if ev[0] != "text":
                with lock:
                    tokens[0] += req.completion_tokens
                    left[0] -= 1
                    if not left[0]:
                        done.set()
                sem.release()
        return f

    t0 = time.perf_counter()
    try:
        for i in range(n):
            sem.acquire()
            r = Request(f"r{i}", ref.ids(prompts[i % len(prompts)]),
                        SamplingParams(max_tokens=64, ignore_eos=True), None)
            r.on_event = on_event(r)
            sched.submit(r)
        done.wait()
    finally:
        sched.stop()
    return tokens[0] / (time.perf_counter() - t0)


def _in_own_thread(fn):
    """fn() run on a thread of its own, which then ends; its result or its exception."""
    out: list = []

    def run():
        try:
            out.append((True, fn()))
        except BaseException as e:  # noqa: BLE001 - raised again in the calling thread
            out.append((False, e))

    t = threading.Thread(target=run)
    t.start()
    t.join()
    ok, value = out[0]
    if not ok:
        raise value
    return value


def main(kind: str, c: int, k: int, reps: int) -> None:
    """Print packed and in-turns tok/s, alternating."""
    import tiny

    from mtpkit import threads

    threads.configure(torch.get_num_threads())
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / kind
        # Built and loaded in a thread that then ends, and the main thread computing alone
        # (as the server's request threads do): libgomp keeps a thread team for every
        # thread that ran parallel work while it lives, and a second team beside the
        # scheduler's makes its workers sleep between parallel regions (mtpkit/threads.py).
        ref = _in_own_thread(lambda: (build(kind, out), tiny.Reference(out))[1])
        threads.compute_alone()
        n_params = sum(p.numel() for p in ref.model.parameters()) / 1e6
        print(f"{kind}: {n_params:.0f}M parameters, c={c}, k={k}", flush=True)
        serve(ref, True, c, k)  # warm
        for _ in range(reps):
            for packed in (True, False):
                rate = serve(ref, packed, c, k)
                print(f"  {'packed' if packed else 'in turns'}: {rate:6.1f} output tok/s",
                      flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    main(args[0] if args else "hybrid", int(args[1]) if len(args) > 1 else 4,
         int(args[2]) if len(args) > 2 else 0, int(args[3]) if len(args) > 3 else 2)
