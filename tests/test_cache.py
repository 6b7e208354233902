"""Cache buffers: zeroed, and on the CPU resident only once written (models/cache.zeros)."""

from __future__ import annotations

import ctypes
import gc
import mmap
import os
import sys

import pytest
import torch

from mtpkit.models import cache
from mtpkit.models.cache import KVCache, zeros


def _resident_bytes(t: torch.Tensor) -> int:
    # Bytes of t's pages in memory (mincore): the buffer's own, whatever else the process
    # allocates or frees meanwhile (its total RSS moved with other threads' work in CI).
    libc = ctypes.CDLL(None, use_errno=True)
    page = os.sysconf("SC_PAGE_SIZE")
    start = t.data_ptr() - t.data_ptr() % page
    length = t.data_ptr() + t.numel() * t.element_size() - start
    vec = (ctypes.c_ubyte * ((length + page - 1) // page))()
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) == 0
    return sum(b & 1 for b in bytes(vec)) * page


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("shape", [(2, 3, 5), (4, 2, 1024, 64)], ids=["small", "large"])
def test_zeros_are_zero_writable_and_outlive_their_mapping(shape, dtype):
    """Both sizes (a cleared tensor below LAZY_MIN_BYTES, a mapping above) are zeros of the
    shape and dtype asked for, contiguous, and keep what is written after the names that
    made them are gone."""
    t = zeros(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    assert not t.any()
    t[1, ..., -1] = 3
    gc.collect()
    assert int(t[1, ..., -1].sum()) == 3 * t[1, ..., -1].numel()
    assert int(t.sum()) == 3 * t[1, ..., -1].numel()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="asks mincore(2)")
def test_large_zeros_become_resident_only_where_written():
    """A 256 MB buffer has no page in memory until written, then about what is written;
    torch.zeros (what caches were) has all of them at once, which this check sees."""
    shape = ((256 << 20) // 4,)
    t = zeros(shape, torch.float32)
    assert _resident_bytes(t) < 1 << 20
    t[: (32 << 20) // 4] = 1.0
    assert (32 << 20) <= _resident_bytes(t) < 40 << 20
    cleared = torch.zeros(shape)
    assert _resident_bytes(cleared) > 250 << 20


def test_kv_caches_take_lazy_buffers_and_keep_their_entries(monkeypatch):
    """KVCache over mapped buffers (LAZY_MIN_BYTES 0): written rows read back, the rest are
    zeros, a trim and a rewrite keep the protocol's meaning."""
    maps = []
    real = mmap.mmap
    monkeypatch.setattr(cache, "LAZY_MIN_BYTES", 0)
    monkeypatch.setattr(cache.mmap, "mmap", lambda *a, **k: maps.append(a) or real(*a, **k))
    c = KVCache(1, 2, 16, 4, torch.float32, "cpu", v_head_dim=3)
    assert len(maps) == 2 and c.v.shape == (1, 2, 16, 3)
    k, v = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 3)
    ks, vs = c.update(k, v)
    assert torch.equal(ks, k) and torch.equal(vs, v)
    assert not c.k[:, :, 5:].any() and not c.v[:, :, 5:].any()
    c.trim(2)
    k2, v2 = torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 3)
    ks, vs = c.update(k2, v2)
    assert torch.equal(ks, torch.cat([k[:, :, :2], k2], 2))
    assert torch.equal(vs, torch.cat([v[:, :, :2], v2], 2))
