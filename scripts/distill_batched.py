"""Self-distillation data on a GPU: the trunk's own answers, many prompts at a time.

``mtpkit distill-data`` answers one prompt after another through mtpkit's engine, which suits
a CPU; on a lent GPU the same kind of data is written here in batches through transformers'
``generate`` (left-padded, KV-cached), so that an hour of CPU answers takes a minute. Three
kinds of prompts, all from distill.py's lists (none about the benchmark's topics):

- ``chat``: templated chat prompts under the chat template, answered greedily, and again by
  sampling (``--sampled-copies``), as EAGLE regenerates its data;
- ``code``: distill.py's prompts about standard-library functions, under the chat template;
- ``raw``: the start of a standard-library function (its ``def`` line and docstring, or its
  first two lines) continued by the trunk with no template, as ``mtpkit bench``'s code
  prompts are.

The shards have distill-data's JSONL format (``text``, ``prompt``, ``kind``, ``sampled``,
``finish``), so ``mtpkit calibrate --data`` reads them. ``distill.json`` records the arguments
and versions, and how many batches were done. Not resumable: ``--minutes`` stops it after
the batch in flight; ``--batches N`` stops after N batches, so a timed run can be repeated.

    python scripts/distill_batched.py --model TRUNK_HF_FOLDER --out DIR --device cuda
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from pathlib import Path

import torch

from mtpkit.checkpoint.tokenizer import Tokenizer
from mtpkit.train.distill import code_prompts, cut_end, prompts, stdlib_functions


def raw_prefixes(n: int, seed: int) -> list[str]:
    """``n`` starts of distinct standard-library functions: the signature and docstring."""
    funcs = stdlib_functions()
    rng = random.Random(seed + 2)
    out = []
    for src in rng.sample(funcs, min(n, len(funcs))):
        lines = src.splitlines()
        end = 2
        body = lines[1].strip() if len(lines) > 1 else ""
        q = body[:3]
        if q in ('"""', "'''") and body.count(q) < 2:
            # A docstring over several lines: up to the line that closes it.
            end = next((j + 1 for j in range(2, len(lines)) if q in lines[j]), 2)
        out.append("\n".join(lines[:end]) + "\n")
    return out


def items(a) -> list[dict]:
    """Every prompt of the run: kind, text, whether sampled, and its sampling copy."""
    chat = prompts(a.chat, a.seed)
    out = [{"kind": "chat", "prompt": p, "sampled": False} for p in chat]
    for c in range(a.sampled_copies):
        out += [{"kind": "chat", "prompt": p, "sampled": True, "copy": c} for p in chat]
    out += [{"kind": "code", "prompt": p, "sampled": False}
            for p in code_prompts(a.code, a.seed)]
    raw = raw_prefixes(a.raw, a.seed)
    out += [{"kind": "raw", "prompt": p, "sampled": False} for p in raw]
    out += [{"kind": "raw", "prompt": p, "sampled": True} for p in raw[: int(a.raw_sampled)]]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="the trunk as an HF folder")
    ap.add_argument("--out", required=True)
    ap.add_argument("--chat", type=int, default=6000)
    ap.add_argument("--sampled-copies", type=int, default=1)
    ap.add_argument("--code", type=int, default=2000)
    ap.add_argument("--raw", type=int, default=4000)
    ap.add_argument("--raw-sampled", type=int, default=2000)
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--shards", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--minutes", type=float, default=0.0)
    ap.add_argument("--batches", type=int, default=0,
                    help="stop after this many batches (a --minutes run, repeated exactly)")
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()

    from transformers import AutoModelForCausalLM

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=False)
    tok = Tokenizer.from_hf_dir(a.model)
    eos = sorted(tok.eos_token_ids)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    model = model.to(a.device).eval()
    todo = items(a)
    for i, it in enumerate(todo):
        if it["kind"] == "raw":
            it["ids"] = tok.encode(it["prompt"])
        else:
            it["ids"] = tok.chat_ids([{"role": "user", "content": it["prompt"]}])
        it["i"] = i
    # Batches of like length (little padding), greedy and sampled apart.
    order = sorted(todo, key=lambda it: (it["sampled"], len(it["ids"])))
    batches = [order[j : j + a.batch] for j in range(0, len(order), a.batch)]
    random.Random(a.seed).shuffle(batches)  # a run stopped early holds every kind
    files = [open(out / f"distill-{j:03d}.jsonl", "w", encoding="utf-8")
             for j in range(a.shards)]
    t0, done, answer_tokens, batches_done = time.time(), 0, 0, 0
    for b, batch in enumerate(batches):
        if a.minutes and time.time() - t0 > 60 * a.minutes or a.batches and b >= a.batches:
            print(f"stopped after {b} batches", flush=True)
            break
        width = max(len(it["ids"]) for it in batch)
        pad = tok.eos_token_id
        ids = torch.tensor([[pad] * (width - len(it["ids"])) + it["ids"] for it in batch])
        mask = torch.tensor([[0] * (width - len(it["ids"])) + [1] * len(it["ids"])
                             for it in batch])
        sampled = batch[0]["sampled"]
        torch.manual_seed(a.seed * 1_000_003 + b)
        kw = (dict(do_sample=True, temperature=a.temperature, top_p=a.top_p, top_k=0)
              if sampled else dict(do_sample=False))
        with torch.no_grad():
            gen = model.generate(input_ids=ids.to(a.device), attention_mask=mask.to(a.device),
                                 max_new_tokens=a.max_tokens, eos_token_id=eos,
                                 pad_token_id=pad, **kw)
        gen = gen[:, width:].tolist()
        for it, new in zip(batch, gen, strict=True):
            stop = next((j for j, t in enumerate(new) if t in eos), None)
            answer = new if stop is None else new[:stop]
            finish = "length" if stop is None else "stop"
            if it["kind"] == "raw":
                text = tok.decode(it["ids"] + answer)
            else:
                reply = tok.decode(answer)
                conv = [{"role": "user", "content": it["prompt"]},
                        {"role": "assistant", "content": reply}]
                text = tok.apply_chat_template(conv, add_generation_prompt=False)
                if finish == "length":
                    text = cut_end(text, reply)
            rec = {"text": text, "prompt": it["prompt"], "kind": it["kind"],
                   "sampled": it["sampled"], "finish": finish}
            files[it["i"] % a.shards].write(json.dumps(rec) + "\n")
            answer_tokens += len(answer)
        done += len(batch)
        batches_done = b + 1
        rate = answer_tokens / max(time.time() - t0, 1e-9)
        print(f"batch {b + 1}/{len(batches)}: {done}/{len(todo)} answers, {answer_tokens} "
              f"answer tokens ({rate:.0f} tok/s)", flush=True)
    for f in files:
        f.close()
    import transformers

    from mtpkit import __version__

    record = {"format": "mtpkit-distill", "version": 1, "model": str(a.model),
              "args": {k: v for k, v in vars(a).items() if k not in ("out", "model")},
              "script": "scripts/distill_batched.py",
              "versions": [{"from_prompt": 0, "mtpkit": __version__,
                            "python": platform.python_version(), "torch": torch.__version__,
                            "transformers": transformers.__version__}],
              "prompts_total": len(todo), "batches_done": batches_done, "done": done,
              "answer_tokens": answer_tokens, "seconds": round(time.time() - t0, 1),
              "finished": done == len(todo)}
    (out / "distill.json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
