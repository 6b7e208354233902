"""Which MTP layer drafts past the last one: reuse the last layer (mtpkit) or cycle (vLLM)?

A tiny Llama-style trunk learns CPython's standard library (bytes as tokens) for a few
hundred steps; a DeepSeek-style head of two MTP layers (each with its own norms, eh_proj
and final norm) is then trained with mtpkit's chained self-distillation at depths 1..2 only,
layer i at depth i + 1, as releases train theirs. On held-out standard-library files,
teacher mode (``mtpkit.train.evaluate.teacher_eval``) scores k chained greedy drafts against
the trunk's own greedy choices, once with each rule for the layer of draft step s:

    reuse-last: min(s, n - 1)      cycle: s % n

Run from the repository root (CPU only; nothing is written but the optional JSON):

    python scripts/mtp_layer_rule.py [--trunk-steps 600] [--head-steps 300] [--k 5]
                                        [--json results.json]

Seeded and counted in steps, not seconds, so a rerun on a loaded machine gives the same
model (up to the CPU's floating-point reduction order).
"""

from __future__ import annotations

import argparse
import json
import random
import sysconfig
import time
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F

from mtpkit.models.llama import LlamaConfig, LlamaDecoderLayer, LlamaForCausalLM
from mtpkit.models.mtp import MTPHead, deepseek_mtp_spec
from mtpkit.train.calibrate import distill_loss, init_scratch_head
from mtpkit.train.data import iter_chunks
from mtpkit.train.evaluate import teacher_eval

EOS = 256


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255, id 256 between files (what iter_chunks reads)."""

    eos_token_ids = [EOS]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """The text's UTF-8 bytes."""
        return list(text.encode("utf-8", errors="replace"))


def stdlib_split(seed: int) -> tuple[list[str], list[str]]:
    """The standard library's top-level .py files, one in eight held out (by a seeded draw)."""
    files = sorted(str(p) for p in Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    rng = random.Random(seed)
    held = {f for f in files if rng.random() < 0.125}
    return [f for f in files if f not in held], sorted(held)


def batches(tok, files: list[str], seq_len: int, batch: int, seed: int):
    """Endless shuffled batches [batch, seq_len] of the files' token chunks."""
    chunks = list(iter_chunks(tok, files, seq_len))
    rng = random.Random(seed)
    while True:
        rng.shuffle(chunks)
        for i in range(0, len(chunks) - batch + 1, batch):
            yield torch.tensor(chunks[i:i + batch])


def build(d: int, layers: int, seed: int) -> LlamaForCausalLM:
    """A Llama trunk with a DeepSeek-style two-layer MTP head (layers of the trunk's kind)."""
    cfg = LlamaConfig.from_hf_config(dict(
        model_type="llama", vocab_size=EOS + 8, hidden_size=d, intermediate_size=3 * d,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=1024, tie_word_embeddings=False))
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    model.mtp = MTPHead(d, deepseek_mtp_spec(2, cfg.rms_norm_eps),
                        lambda i: LlamaDecoderLayer(cfg))
    return model


def train_trunk(model, data, steps: int, lr: float) -> float:
    """Next-token cross-entropy for ``steps`` steps; the last smoothed loss."""
    params = [p for n, p in model.named_parameters() if not n.startswith("mtp.")]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    model.train()
    smooth = None
    for step in range(1, steps + 1):
        ids = next(data)
        out = model(ids)
        loss = F.cross_entropy(model.logits(out.hidden[:, :-1]).flatten(0, 1),
                               ids[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        v = float(loss.detach())
        smooth = v if smooth is None else 0.95 * smooth + 0.05 * v
        if step % 50 == 0:
            print(f"trunk step {step} loss {smooth:.3f}", flush=True)
    model.eval().requires_grad_(False)
    return smooth


def init_head(model, sample: torch.Tensor) -> None:
    """calibrate's scratch start for layer 0 (the trunk's last layer, fc passing h on), and
    the same start for layer 1."""
    init_scratch_head(model, sample)
    head = model.mtp
    with torch.no_grad():
        head.layers[1].load_state_dict(head.layers[0].state_dict())
        own = head.parts(1)
        for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc", "norm"):
            getattr(own, name).load_state_dict(getattr(head, name).state_dict())


def train_head(model, data, steps: int, lr: float) -> float:
    """mtpkit's chained distillation at depths 1..2 (layer i at depth i + 1), ``steps``
    steps; the last smoothed loss."""
    head = model.mtp
    head.train().requires_grad_(True)
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.0)
    smooth = None
    for step in range(1, steps + 1):
        loss, _, _ = distill_loss(model, next(data), 2, head)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        v = float(loss.detach())
        smooth = v if smooth is None else 0.95 * smooth + 0.05 * v
        if step % 50 == 0:
            print(f"head step {step} loss {smooth:.3f}", flush=True)
    head.eval().requires_grad_(False)
    return smooth


RULES = {
    "reuse-last": lambda self, step: min(step, len(self.layers) - 1),
    "cycle": lambda self, step: step % len(self.layers),
}


def main() -> None:
    """Train, measure both rules, print (and optionally write) the per-position rates."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trunk-steps", type=int, default=600)
    ap.add_argument("--head-steps", type=int, default=300)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--eval-tokens", type=int, default=60000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tok = ByteTokenizer()
    train, held = stdlib_split(args.seed)
    model = build(args.hidden, args.layers, args.seed)
    data = batches(tok, train, args.seq_len, args.batch, args.seed)
    t0 = time.perf_counter()
    trunk_loss = train_trunk(model, data, args.trunk_steps, 2e-3)
    init_head(model, next(data)[:1])
    head_loss = train_head(model, data, args.head_steps, 1e-3)
    results = {"trunk": {"steps": args.trunk_steps, "loss": trunk_loss,
                         "hidden": args.hidden, "layers": args.layers},
               "head": {"steps": args.head_steps, "loss": head_loss},
               "train_seconds": round(time.perf_counter() - t0),
               "train_files": len(train), "heldout_files": len(held), "k": args.k}
    for name, rule in RULES.items():
        with mock.patch.object(MTPHead, "layer_for", rule):
            rep = teacher_eval(model, tok, held, args.k, max_tokens=args.eval_tokens,
                               seq_len=args.seq_len, batch_size=8)
        results[name] = rep.as_dict()
        rates = " ".join(f"{r:.3f}" for r in rep.per_position)
        print(f"{name:10s} per-position {rates}  mean acceptance length "
              f"{rep.mean_acceptance_length:.3f}  ({rep.positions} positions, "
              f"perplexity {rep.perplexity:.2f})", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
