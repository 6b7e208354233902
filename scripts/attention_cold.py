"""Time mtpkit's row attention kernel as a decode step meets it: cache rows cold.

Thirty layers' K/V buffers ([3, 2048, 64] fp32 each, SmolLM2's shape), and before every
call a 2.8 MB read (a layer's share of the weights a step streams), so the rows a call reads
come from memory as in a real step; "hot" repeats one layer with nothing between. Prints the
minimum over three turns of 600 calls, in microseconds a call (Python's call and slicing,
about 4 us, included). Usage: python scripts/attention_cold.py
"""

from __future__ import annotations

import time

import torch

from mtpkit.quant.kernels import int8_mm_available


def main() -> None:
    """Print cold and hot microseconds a call for one and two query rows at a few spans."""
    if not int8_mm_available():
        raise SystemExit("mtpkit's kernels do not build here (see the note above)")
    torch.set_num_threads(2)
    layers, max_len = 30, 2048
    kb, vb = torch.randn(layers, 3, max_len, 64), torch.randn(layers, 3, max_len, 64)
    weights = torch.randn(layers, 700_000)
    attend = torch.ops.mtpkit.attend_rows
    q = torch.randn(2, 9, 64)
    for rows in (1, 2):
        for span in (65, 257, 513):
            pos = torch.arange(span - 2, span) if rows == 2 else torch.tensor([span - 1] * 2)
            best = {}
            for _ in range(3):
                for mode in ("cold", "hot"):
                    total = 0.0
                    for _ in range(20):
                        for layer in range(layers):
                            at = layer if mode == "cold" else 0
                            if mode == "cold":
                                weights[layer].max()
                            t = time.perf_counter()
                            attend(q, kb[at, :, :span], vb[at, :, :span], pos, rows)
                            total += time.perf_counter() - t
                    us = total / (20 * layers) * 1e6
                    best[mode] = min(best.get(mode, us), us)
            print(f"rows={rows} keys={span}: cold {best['cold']:.1f} us, hot {best['hot']:.1f} us")


if __name__ == "__main__":
    main()
