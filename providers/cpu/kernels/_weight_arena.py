"""Prepacked weights held in 2 MB-aligned blocks, so that they sit in transparent huge pages.

A decode step streams every weight once from DRAM. With 4 KB pages the CPU's stream
prefetchers stop at each page boundary and each page costs a TLB walk; with 2 MB pages a
weight streams through. numpy asks the kernel for huge pages (``madvise``) only on its own
allocations of 4 MB or more, and only the 2 MB-aligned part of each: a 3.9 MB projection got
none and a 5.5 MB one about half. Weights copied into these blocks read at 32-35 GB/s from
DRAM against 25-28 in numpy's own allocations and 18-22 with no huge pages at all (a 768 x
3072 and a 1792 x 768 float32 GEMV, one thread; docs/performance.md).

Each :class:`WeightArena` (one per CPU provider, so per session) makes the prepacks' output
arrays (``zeros``, which the tiling functions take) by carving them from blocks
of ``BLOCK_BYTES`` (a larger weight gets a block of its own), each a numpy allocation whose
usable part starts on a 2 MB boundary. An array keeps its block alive; a block is freed when
the session's weights are. Pages of a block that no weight uses are never touched, so they
take no memory. Where the system has no transparent huge pages this only aligns the weights.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np

HUGE_PAGE = 2 << 20
#: Bytes of one block (a weight larger than this gets a block of its own size).
BLOCK_BYTES = 32 << 20
#: Arrays smaller than this stay where they are (norm weights, biases, small scales).
MIN_BYTES = 64 << 10
#: Alignment of each array within a block.
ALIGN = 4096


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class WeightArena:
    """Prepacked weights' arrays carved from 2 MB-aligned blocks (see the module docstring)."""

    def __init__(self, block_bytes: int = BLOCK_BYTES) -> None:
        self._block_bytes = block_bytes
        self._block: np.ndarray | None = None
        self._used = 0
        self._lock = threading.Lock()

    def _carve(self, nbytes: int) -> np.ndarray:
        size = _round_up(nbytes, ALIGN)
        with self._lock:
            if self._block is None or self._used + size > self._block.size:
                capacity = max(self._block_bytes, _round_up(size, HUGE_PAGE))
                raw = np.zeros(capacity + HUGE_PAGE, np.uint8)
                start = (-raw.ctypes.data) % HUGE_PAGE
                self._block, self._used = raw[start : start + capacity], 0
            view = self._block[self._used : self._used + nbytes]
            self._used += size
        return view

    def zeros(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """A zeroed C-contiguous array, in a block unless small."""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if nbytes < MIN_BYTES:
            return np.zeros(shape, dtype)
        return self._carve(nbytes).view(dtype).reshape(shape)  # blocks start zeroed


def arena_zeros(provider: object) -> Callable[..., np.ndarray]:
    """``provider``'s weight arena's ``zeros``, or numpy's for a provider without one."""
    arena = getattr(provider, "weight_arena", None)
    return arena.zeros if isinstance(arena, WeightArena) else np.zeros
