"""Stream a SmolLM2-shaped model's weights through one of mtpkit's GEMM kernels, against a
plain read of as many bytes, in turns.

The weights of 30 layers (q/k/v, o, gate/up and down shapes) and the 49,152 x 576 lm_head,
each its own tensor as in a model, go through the kernel one after another with ROWS rows of
activations; the same number of bytes is then summed by torch (what ``mtpkit bench``
calls the read bandwidth). Each turn prints the best of five passes of each and their ratio:
how close the kernel alone comes to the memory's read speed, apart from a step's attention
and glue. Kinds: f32 (f32_mm), a8 (W8A8, int8_a8_mm), a16 (W8A16, int8_a16_mm: the built-in
model's), a4 (W4A8 in groups of 32 with zero points, int4_a8_mm).
Usage: python scripts/gemm_stream.py {f32,a8,a16,a4} [ROWS]
"""

from __future__ import annotations

import sys
import time

import torch

from mtpkit.quant.kernels import int8_mm_available
from mtpkit.quant.linear import QuantLinear, pack_a8

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]


def main() -> None:
    """Print five turns of kernel time against sum time for the whole weight set."""
    kind = sys.argv[1] if len(sys.argv) > 1 else "f32"
    rows = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    if kind not in ("f32", "a8", "a16", "a4") or not int8_mm_available():
        sys.exit("usage: python scripts/gemm_stream.py {f32,a8,a16,a4} [ROWS] (needs "
                 "mtpkit's kernels)")
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    if kind == "f32":
        op = torch.ops.mtpkit.f32_mm
        ws = [(torch.randn(n, k, generator=g),) for n, k in SHAPES]
    elif kind in ("a8", "a16"):
        op = torch.ops.mtpkit.int8_a8_mm if kind == "a8" else torch.ops.mtpkit.int8_a16_mm
        ws = [pack_a8(torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8),
                      torch.rand(n, generator=g)) for n, k in SHAPES]
    else:
        def a4(n, k):
            layer = QuantLinear.from_int(
                torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8),
                torch.rand(n, k // 32, generator=g) * 0.05,
                torch.randint(-4, 4, (n, k // 32), generator=g, dtype=torch.int8), 4, 32)
            return (*layer._pack_a4(), 32)

        op = torch.ops.mtpkit.int4_a8_mm
        ws = [a4(n, k) for n, k in SHAPES]
    nbytes = sum(t.numel() * t.element_size() for w in ws for t in w
                 if isinstance(t, torch.Tensor))
    xs = {k: torch.randn(rows, k, generator=g) for k in (576, 1536)}
    flat = torch.ones(nbytes // 4)  # ones, not empty: the pages must be touched

    def gemms() -> float:
        t = time.perf_counter()
        for (_, k), w in zip(SHAPES, ws, strict=True):
            op(xs[k], *w)
        return time.perf_counter() - t

    def read() -> float:
        t = time.perf_counter()
        flat.sum()
        return time.perf_counter() - t

    for _ in range(3):
        gemms(), read()
    for _ in range(5):
        a, b = min(gemms() for _ in range(5)), min(read() for _ in range(5))
        print(f"{kind} rows={rows}: kernel {a * 1e3:.2f} ms ({nbytes / a / 1e9:.1f} GB/s), "
              f"sum {b * 1e3:.2f} ms ({nbytes / b / 1e9:.1f} GB/s), ratio {a / b:.2f}",
              flush=True)


if __name__ == "__main__":
    main()
