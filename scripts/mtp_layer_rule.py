"""Draft steps past a head's last MTP layer: run the last layer again (mtpkit) or cycle back
to layer 0 (vLLM)? Greedy acceptance per position and tokens per round at k = layers + 1 and
layers + 2, on the tests' tiny checkpoints with distilled multi-layer heads (layer i trained
at chained depth i + 1), 24 prompts x 48 tokens. Usage: python scripts/mtp_layer_rule.py
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys
import tempfile
import warnings

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))

import tiny  # noqa: E402

from mtpkit.engine.generate import Engine, Result  # noqa: E402
from mtpkit.engine.loader import load_model  # noqa: E402
from mtpkit.engine.sampling import SamplingParams  # noqa: E402
from mtpkit.models.mtp import MTPHead  # noqa: E402

PROMPTS = [[(7 * i + 3 * j) % 90 + 1 for i in range(6 + j % 5)] for j in range(24)]
CASES = (("llama", 2), ("mimo_v2_flash", 3), ("deepseek_v3", 2))


def build(name: str, layers: int) -> Engine:
    """A tiny checkpoint of the family with a distilled head of ``layers`` MTP layers."""
    fam = next(f for f in tiny.FAMILIES + tiny.MORE_FAMILIES if f.name == name)
    fam = dataclasses.replace(fam, mtp_layers=layers)
    out = pathlib.Path(tempfile.mkdtemp()) / name
    tiny.write_checkpoint(fam, out)
    tiny.add_mtp_head(out, fam, layers=layers)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Engine(load_model(out, tokenizer=False).model)


def measure(engine: Engine, k: int) -> tuple[list[float], float]:
    """Acceptance per draft position and tokens per round over PROMPTS."""
    acc, seen = [0] * k, [0] * k
    tokens = rounds = 0
    for prompt in PROMPTS:
        res = Result()
        list(engine.generate(prompt, SamplingParams(max_tokens=48), k, result=res,
                             eos_ids=set()))
        m = res.metrics
        for i, (a, d) in enumerate(zip(m.accepted_per_pos, m.drafts_per_pos, strict=True)):
            acc[i] += a
            seen[i] += d
        tokens += m.generated_tokens
        rounds += m.num_drafts
    return [a / max(d, 1) for a, d in zip(acc, seen, strict=True)], tokens / max(rounds, 1)


def main() -> None:
    reuse = MTPHead.layer_for
    rules = {"reuse-last": reuse, "cycle": lambda self, step: step % len(self.layers)}
    for name, layers in CASES:
        engine = build(name, layers)
        for k in (layers + 1, layers + 2):
            for label, rule in rules.items():
                MTPHead.layer_for = rule
                try:
                    per, per_round = measure(engine, k)
                finally:
                    MTPHead.layer_for = reuse
                shown = " ".join(f"{p:.2f}" for p in per)
                print(f"{name} layers={layers} k={k} {label:10s} per position {shown}  "
                      f"tokens/round {per_round:.2f}", flush=True)


if __name__ == "__main__":
    main()
