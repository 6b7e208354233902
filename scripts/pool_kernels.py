"""Time the two kernels a server's batched step spends most in: int8_a16_mm (the built-in
model's W8A16 GEMMs) at 1-16 rows, and attend_pool (the pooled attention of trunk_pool) for
1-8 sequences of one row, at SmolLM2's shapes.

GEMMs: 1536 x 576 (about the q/k/v and o shapes), 576 x 1536 (down_proj) and the 49,152 x
576 lm_head, random int8 codes. Attention: 9 query heads on 3 KV heads of 64 dims, every
sequence in its own slot of one pool, its one row at position ~SPAN (default 200). Prints
the median microseconds a call (Python's call included) of each set, SETS sets in turn, so
that two builds can be compared run against run. Usage:
python scripts/pool_kernels.py [SPAN=200] [SETS=3]
"""

from __future__ import annotations

import functools
import sys

import torch

from mtpkit.bench.steps import _time as median_ms
from mtpkit.quant.kernels import int8_mm_available
from mtpkit.quant.linear import pack_a8


def _median_us(fn, calls: int) -> float:
    for _ in range(20):
        fn()
    return 1000 * median_ms(fn, calls)


def main(span: int, sets: int) -> None:
    """Print int8_a16_mm and attend_pool medians, a column per set."""
    if not int8_mm_available():
        raise SystemExit("mtpkit's kernels do not build here")
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    gemms = {}
    for n, k in ((1536, 576), (576, 1536), (49152, 576)):
        codes = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
        gemms[(n, k)] = pack_a8(codes, torch.rand(n, generator=g) / 100)
    heads, kv_heads, dim, slots = 9, 3, 64, 8
    kpool = torch.randn(slots, kv_heads, 2048, dim, generator=g)
    vpool = torch.randn(slots, kv_heads, 2048, dim, generator=g)
    results: dict[str, list[float]] = {}
    for _ in range(sets):
        for (n, k), (w, s, c) in gemms.items():
            for rows in (1, 2, 4, 8, 16):
                x = torch.randn(rows, k, generator=g)
                us = _median_us(functools.partial(torch.ops.mtpkit.int8_a16_mm, x, w, s, c),
                                100 if n > 10000 else 400)
                results.setdefault(f"int8_a16_mm {n} x {k}, {rows} rows", []).append(us)
        for b in (1, 4, 8):
            q, kv = torch.randn(b, heads, dim), torch.randn(b, kv_heads, dim)
            pos = span + torch.arange(b)
            one = torch.ones(b, dtype=torch.long)
            us = _median_us(functools.partial(torch.ops.mtpkit.attend_pool, q, kv, kv, kpool,
                                              vpool, torch.arange(b), one, pos), 400)
            results.setdefault(f"attend_pool {b} sequences, span {span}", []).append(us)
    for name, times in results.items():
        print(f"{name}: " + " ".join(f"{t:.1f}" for t in times))


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:]]
    main(*(args + [200, 3][len(args):]))
