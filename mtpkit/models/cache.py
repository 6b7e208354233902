"""Per-layer caches behind one protocol: ``length``, ``trim(n)``, ``reset()``.

Speculative decoding appends k+1 tokens per verification and then keeps only the accepted
prefix. Every layer kind must therefore be able to return to any position inside the span of
its last forward pass:

- attention layers keep a static, preallocated KV buffer indexed by position, so returning
  to position n is only ``length = n`` (what lies beyond is overwritten by the next write);
- recurrent layers (Gated DeltaNet) cannot un-apply an update, so during a short forward they
  record their state after every position and ``trim`` restores one of those snapshots.
"""

from __future__ import annotations

import math
import mmap
from typing import Protocol

import torch

LAZY_MIN_BYTES = 1 << 20  # smaller buffers are cleared the usual way


def zeros(shape: tuple[int, ...], dtype: torch.dtype,
          device: torch.device | str = "cpu") -> torch.Tensor:
    """A zeroed buffer; on the CPU, one whose pages the OS zero-fills as they are first used."""
    nbytes = math.prod(shape) * dtype.itemsize
    if (torch.device(device).type != "cpu" or nbytes < LAZY_MIN_BYTES
            or not hasattr(mmap, "MAP_PRIVATE")):
        return torch.zeros(shape, dtype=dtype, device=device)
    # torch.zeros writes every byte, and caches are sized for a whole context: a server's
    # pool of 8 slots of 8192 positions (3 GB for SmolLM2) took seconds to clear and was
    # resident from the start. Private anonymous memory comes from the kernel zeroed, a
    # page at a time as it is first written; the tensor keeps the mapping alive.
    return torch.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE),
                            dtype=dtype).view(shape)


class LayerCache(Protocol):
    """What every per-layer cache offers the engine."""

    length: int

    def trim(self, n: int) -> None:
        """Forget everything after the first ``n`` tokens."""

    def reset(self) -> None:
        """Return to the empty state (a new request)."""


class KVCache:
    """Static KV buffer of shape [B, n_kv_heads, max_len, head_dim] for keys and values."""

    def __init__(
        self,
        batch: int,
        n_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        v_head_dim: int | None = None,
    ) -> None:
        self.k = zeros((batch, n_kv_heads, max_len, head_dim), dtype, device)
        self.v = zeros((batch, n_kv_heads, max_len, v_head_dim or head_dim), dtype, device)
        self.max_len = max_len
        self.length = 0
        # Positions skipped without a write (only an MTP layer used at some draft steps
        # leaves gaps); None while the cache is gap-free, which is the common case.
        self.valid: torch.Tensor | None = None

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write keys/values [B, H, T, D] at the current position; return all keys/values so far."""
        t = k.shape[2]
        end = self.length + t
        if end > self.max_len:
            raise CacheFullError(
                f"KV cache holds {self.max_len} positions; {end} needed. "
                "Raise --max-model-len or lower --max-tokens."
            )
        self.k[:, :, self.length : end] = k
        self.v[:, :, self.length : end] = v
        if self.valid is not None:
            # A slot skipped once (skip_to) and written now, after a trim back over it, holds
            # a real entry again.
            self.valid[self.length : end] = True
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]

    def trim(self, n: int) -> None:
        """Keep the first ``n`` positions; later slots are simply overwritten next time."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot trim a KV cache of length {self.length} to {n}")
        self.length = n

    def skip_to(self, n: int) -> None:
        """Advance to position ``n`` leaving the skipped slots masked out of attention."""
        if n <= self.length:
            return
        if self.valid is None:
            self.valid = torch.ones(self.max_len, dtype=torch.bool, device=self.k.device)
        self.valid[self.length : n] = False
        self.valid[n:] = True
        self.length = n

    def key_mask(self, end: int) -> torch.Tensor | None:
        """Which of the first ``end`` slots hold real entries (None: all of them)."""
        if self.valid is None or bool(self.valid[:end].all()):
            return None
        return self.valid[:end]

    def reset(self) -> None:
        """Forget every position (buffers are reused, not cleared: length guards them)."""
        self.length = 0
        self.valid = None


class CacheFullError(RuntimeError):
    """The sequence would exceed the preallocated cache."""


class ModelCache:
    """The caches of all layers of one model (trunk or MTP head), kept at one length."""

    def __init__(self, layers: list[LayerCache]) -> None:
        self.layers = layers

    @property
    def length(self) -> int:
        """Tokens processed so far (every layer agrees)."""
        return self.layers[0].length

    def trim(self, n: int) -> None:
        """Return every layer to position ``n``."""
        for layer in self.layers:
            layer.trim(n)

    def reset(self) -> None:
        """Empty every layer."""
        for layer in self.layers:
            layer.reset()

    def __getitem__(self, i: int) -> LayerCache:
        return self.layers[i]

    def __len__(self) -> int:
        return len(self.layers)
