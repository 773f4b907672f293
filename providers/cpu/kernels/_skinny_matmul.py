"""Skinny float32 MatMul: Y[M, N] = X[M, K] @ W[K, N] (+ bias) for a few rows (M <= 16).

Decode (M=1) and speculative verify (M=k+1) read every weight once per step, so they are
bound by memory bandwidth, and OpenBLAS is a poor fit: its M=1 GEMV reaches a fraction of the
bandwidth, and sgemm packs B on every call, so M=5 costs several times M=1 (figures in
docs/performance.md). Here a constant weight is kept in tiles of ``TILE`` (32) output
columns, ``tiles[t, k, c] = W[k, 32 t + c]`` (:func:`pack_weight`; the last tile padded with
zeros): each tile is one contiguous run of memory, read once for all M rows.

A tile's 32 sums per row of X live in two 16-lane vector registers, fed by a broadcast of
x[i, k] and the tile's row k: no horizontal sums. ``_fma_rows.fma_rows`` runs ``GROUP`` rows
at a time (8 with AVX-512), each tile row loaded once for them. Every column adds its
products in the order of k by fused multiply-adds, whatever M, the row's place among them or
the thread split: a row's outputs are the same bits alone, in a batch or in a verify step,
and a pooled call equals a serial one. The sums stay within fp32 rounding of a float64
reference (see the tests).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numba
import numpy as np

from ._fma_rows import GROUP, fma_rows
from ._intrinsics import address_as_pointer, stack_float32
from ._native_calls import NativeCall, address_of, native_runner, word_view, words
from ._nn_common import writable
from ._worker_pool import (
    ARGS,
    COPY,
    FIRST_ARG,
    MAX_CHUNKS,
    NO_POOL,
    OUT,
    chunk_count,
    chunk_runner,
    enter,
    pool_threads,
    run_job,
    set_arg,
    worker_pool,
)

_F32 = np.float32
#: Rows of X up to which a prepacked weight runs the skinny kernel; more rows use BLAS.
SKINNY_MAX_M = 16
# Multiply-adds (M * N * K) below which a call stays on the calling thread, and about the
# multiply-adds per chunk of a pooled call (docs/performance.md): a 256 x 384 GEMV (4-5 us
# alone) gains from a second thread since the caller waits for a running worker.
PARALLEL_MIN_WORK = 1 << 16
CHUNK_WORK = 1 << 16
_NO_BIAS = np.zeros(0, _F32)


def _kernel_bias(bias: np.ndarray | None) -> np.ndarray:
    """The bias as the kernels take it: writable (``writable``), so every call site
    compiles one signature."""
    return _NO_BIAS if bias is None else writable(bias)


#: Output columns per tile of a packed weight.
TILE = 32


@dataclass(frozen=True)
class TiledWeight:
    """A constant float32 MatMul weight [K, N] packed for :func:`skinny_matmul`:
    ``tiles[t, k, c] = W[k, TILE * t + c]``, zero past N."""

    tiles: np.ndarray  # (ceil(N / TILE), K, TILE) float32
    n: int

    @property
    def shape(self) -> tuple[int, int]:
        """The weight's logical shape [K, N]."""
        return (int(self.tiles.shape[1]), self.n)

    @property
    def dtype(self) -> np.dtype:
        return self.tiles.dtype

    @property
    def ndim(self) -> int:
        return 2

    def dense(self) -> np.ndarray:
        """The weight as a new C-contiguous [K, N] array (BLAS for many rows)."""
        k = self.tiles.shape[1]
        full = self.tiles.transpose(1, 0, 2).reshape(k, -1)
        return np.ascontiguousarray(full[:, : self.n])


def pack_weight(
    w: np.ndarray, transposed: bool = False, zeros: Callable[..., np.ndarray] = np.zeros
) -> TiledWeight:
    """``w`` [K, N] (or [N, K] when ``transposed``) as a :class:`TiledWeight`, its tiles
    made by ``zeros(shape, dtype)`` (a weight arena's, say)."""
    kn = np.asarray(w, _F32).T if transposed else np.asarray(w, _F32)
    k, n = kn.shape
    full = n // TILE
    tiles = zeros((-(-n // TILE), k, TILE), _F32)
    if full:
        tiles[:full] = kn[:, : full * TILE].reshape(k, full, TILE).transpose(1, 0, 2)
    if n > full * TILE:
        tiles[full, :, : n - full * TILE] = kn[:, full * TILE :]
    return TiledWeight(tiles, n)


@numba.njit(cache=True, inline="always")
def _store(out, i, c0, width, bias, sums, a0):
    """out[i, c0:c0+width] = sums[a0:a0+width] (+ bias[c0:c0+width])."""
    o = out[i]
    if bias.shape[0] != 0:
        for j in range(width):
            o[c0 + j] = sums[a0 + j] + bias[c0 + j]
    else:
        for j in range(width):
            o[c0 + j] = sums[a0 + j]


@numba.njit(cache=True)
def _tiles(x, tiles, bias, out, t0, t1):
    """Output columns of tiles [t0, t1) for every row of x, ``GROUP`` rows at a time."""
    m = x.shape[0]
    n = out.shape[1]
    sums = stack_float32(256)  # TILE * the largest GROUP
    for t in range(t0, t1):
        w = tiles[t]
        c0 = t * 32
        width = min(32, n - c0)
        i = 0
        while i < m:
            rows = min(GROUP, m - i)
            fma_rows(x, i, rows, w, sums)
            for r in range(rows):
                _store(out, i + r, c0, width, bias, sums, 32 * r)
            i += rows


@numba.njit(cache=True)
def _skinny_serial(x, tiles, bias, out):
    """out (M, N) = x (M, K) @ the tiled weight (+ bias) on the calling thread."""
    _tiles(x, tiles, bias, out, np.int64(0), tiles.shape[0])  # not Literal[0]: compiled once


def _skinny_chunk(args, chunk, mode):
    """Chunk runner (``_worker_pool``): the tiles of chunk ``chunk`` into the output, into
    the scratch buffer, or copied across. It has no ``try`` (one costs a cfunc about 0.5 s
    of first-run compilation): nothing in it raises once ``chunks`` is positive."""
    a = numba.carray(address_as_pointer(args, np.int64), (ARGS,))
    chunks = a[1]
    if chunks < 1:
        return 1
    m, k, count, n = a[FIRST_ARG + 1], a[FIRST_ARG + 2], a[FIRST_ARG + 3], a[FIRST_ARG + 5]
    t0 = chunk * count // chunks
    t1 = (chunk + 1) * count // chunks
    out = numba.carray(address_as_pointer(a[FIRST_ARG + 8], np.float32), (m, n))
    scratch = numba.carray(address_as_pointer(a[0], np.float32), (m, n))
    if mode == COPY:
        for i in range(m):
            for c in range(t0 * 32, min(n, t1 * 32)):
                out[i, c] = scratch[i, c]
        return 0
    x = numba.carray(address_as_pointer(a[FIRST_ARG], np.float32), (m, k))
    tiles = numba.carray(address_as_pointer(a[FIRST_ARG + 4], np.float32), (count, k, 32))
    bias = numba.carray(address_as_pointer(a[FIRST_ARG + 6], np.float32), (a[FIRST_ARG + 7],))
    _tiles(x, tiles, bias, out if mode == OUT else scratch, t0, t1)
    return 0


_skinny_runner = chunk_runner(_skinny_chunk)


@numba.njit(cache=True, nogil=True)
def _skinny_pooled(x, tiles, bias, out, ctrl, runner, chunks):
    """``_skinny_serial`` with the pool's workers taking chunks of the tiles; on the calling
    thread alone when another thread holds the pool or an operand is not C-contiguous.
    Returns ``run_job``'s status (0: nothing left to do)."""
    contiguous = x.flags.c_contiguous and tiles.flags.c_contiguous and out.flags.c_contiguous
    if not (contiguous and bias.flags.c_contiguous) or not enter(ctrl):
        _tiles(x, tiles, bias, out, np.int64(0), tiles.shape[0])  # not Literal[0]: compiled once
        return 0
    m, k = x.shape
    set_arg(ctrl, 0, x.ctypes.data)
    set_arg(ctrl, 1, m)
    set_arg(ctrl, 2, k)
    set_arg(ctrl, 3, tiles.shape[0])
    set_arg(ctrl, 4, tiles.ctypes.data)
    set_arg(ctrl, 5, out.shape[1])
    set_arg(ctrl, 6, bias.ctypes.data)
    set_arg(ctrl, 7, bias.shape[0])
    set_arg(ctrl, 8, out.ctypes.data)
    return run_job(ctrl, runner, chunks)


def skinny_chunks(m: int, k: int, n: int) -> int:
    """Chunks a call of this size is split into: 1 (the calling thread alone) for small
    work, one thread or a single tile, else about ``CHUNK_WORK`` multiply-adds each (whole
    tiles)."""
    tiles = -(-n // TILE)
    if pool_threads() < 2 or m * n * k < PARALLEL_MIN_WORK or tiles < 2:
        return 1
    return min(chunk_count(tiles, m * n * k, CHUNK_WORK), tiles, MAX_CHUNKS)


def skinny_matmul(
    x: np.ndarray,
    w: TiledWeight,
    out: np.ndarray,
    bias: np.ndarray | None = None,
    chunks: int | None = None,
) -> np.ndarray:
    """``out`` (M, N) = ``x`` (M, K) @ W (+ ``bias`` (N,)), all float32 and C-contiguous;
    split into ``chunks`` (default ``skinny_chunks``) over the worker pool's threads."""
    m, k = x.shape
    n = w.n
    b = _kernel_bias(bias)
    if m == 0 or n == 0:
        return out
    if k == 0:
        out[...] = 0 if bias is None else bias
        return out
    if chunks is None:
        chunks = skinny_chunks(m, k, n)
    chunks = min(chunks, w.tiles.shape[0], MAX_CHUNKS)
    if chunks == 1 or pool_threads() < 2:
        _skinny_serial(x, w.tiles, b, out)
        return out
    pool = worker_pool()
    pool.reserve(m * n)
    status = _skinny_pooled(x, w.tiles, b, out, pool.ctrl, _skinny_runner(), chunks)
    if status & 3:
        pool.settle(status, (x, w.tiles, b, out), "MatMul (skinny float32)")
    return out


def skinny_call(
    x: np.ndarray, w: TiledWeight, out: np.ndarray, bias: np.ndarray | None = None
) -> Callable[[], None]:
    """``skinny_matmul(x, w, out, bias)`` prebound for graph replay: the sizes and the split
    are worked out once (again when the thread count changes), not on every call."""
    m, k = x.shape
    n = w.n
    if m == 0 or n == 0 or k == 0:
        return functools.partial(skinny_matmul, x, w, out, bias)
    tiles = w.tiles
    b = _kernel_bias(bias)
    split = [0, 1, 0]  # the thread count it was worked out for, the chunks, the runner

    def call() -> None:
        threads = pool_threads()
        if threads != split[0]:
            chunks = skinny_chunks(m, k, n)
            split[:] = threads, chunks, _skinny_runner() if chunks > 1 else 0
        if split[1] == 1:
            _skinny_serial(x, tiles, b, out)
            return
        pool = worker_pool()
        pool.reserve(m * n)
        status = _skinny_pooled(x, tiles, b, out, pool.ctrl, split[2], split[1])
        if status & 3:
            pool.settle(status, (x, tiles, b, out), "MatMul (skinny float32)")

    def native() -> NativeCall:
        chunks = skinny_chunks(m, k, n)
        ctrl, runner = NO_POOL, 0
        if chunks > 1:
            pool = worker_pool()
            pool.reserve(m * n)
            ctrl, runner = pool.ctrl, _skinny_runner()
        w = words(
            address_of(x), m, k, address_of(tiles), tiles.shape[0], n, address_of(b),
            b.shape[0], address_of(out), address_of(ctrl), ctrl.shape[0], runner, chunks, 0,
        )  # fmt: skip

        def on_code(code: int) -> None:
            if code == _SETTLE:
                worker_pool().settle(int(w[_STATUS]), (x, tiles, b, out), "MatMul (skinny float32)")
            else:
                call()

        return NativeCall(_skinny_native_runner(), w, on_code, (x, tiles, b, out, ctrl), _STATUS)

    call.native = native  # type: ignore[attr-defined]
    return call


#: Native codes: a late worker may still read the arrays (the pool keeps them), or rerun
#: the Python call (it raises the kernel's own error).
_SETTLE, _RERUN = 1, 2
_STATUS = 13  # the word the native form leaves run_job's status in


def _skinny_native(args, _a, _b):
    """Native form of ``skinny_call``'s call (``_native_calls``): words x, m, k, tiles,
    tile count, n, bias, bias length, out, the pool's ctrl and its length, the chunk
    runner, chunks, and the status word."""
    try:
        w = word_view(args, 14)
        m, k, count, n = w[1], w[2], w[4], w[5]
        x = numba.carray(address_as_pointer(w[0], np.float32), (m, k))
        tiles = numba.carray(address_as_pointer(w[3], np.float32), (count, k, 32))
        bias = numba.carray(address_as_pointer(w[6], np.float32), (w[7],))
        out = numba.carray(address_as_pointer(w[8], np.float32), (m, n))
        if w[12] <= 1:
            _tiles(x, tiles, bias, out, np.int64(0), count)
            return 0
        ctrl = numba.carray(address_as_pointer(w[9], np.int64), (w[10],))
        status = _skinny_pooled(x, tiles, bias, out, ctrl, w[11], w[12])
        if status & 3:
            w[13] = status
            return 1
        return 0
    except Exception:  # noqa: BLE001 - a native call reports failure by its code
        return 2


_skinny_native_runner = native_runner(_skinny_native)
