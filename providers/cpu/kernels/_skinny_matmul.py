"""Skinny float32 MatMul: Y[M, N] = X[M, K] @ W[K, N] (+ bias) for a few rows (M <= 16).

Decode (M=1) and speculative verify (M=k+1) read every weight once per step, so they are
bound by memory bandwidth, and OpenBLAS is a poor fit: its M=1 GEMV reaches a fraction of the
bandwidth, and sgemm packs B on every call, so M=5 costs several times M=1 (figures in
docs/performance.md). Here a constant
weight is kept transposed, ``wt[N, K]`` (:func:`pack_weight`), and each output column is a
dot product of one contiguous weight row with the rows of X, so every weight row is read
from memory once for all M rows.

Columns are taken four at a time, one from each quarter of N (columns ``c``, ``c + d``,
``c + 2d``, ``c + 3d`` with ``d = N // 4``): four sequential streams far apart in memory.
Four *adjacent* rows (2-8 KB apart) were measured slower from DRAM than one stream
(docs/performance.md), and software prefetching did not help. Rows of X go four at a time
(then two, then one) against those four columns: 16 dot products share 8 vector loads per
step, and LLVM keeps the 16 partial sums in vector registers (each ``a += u * v`` is a
reduction it vectorizes; the sums may be reordered, which stays within fp32 rounding of a
float64 reference, see the tests).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numba
import numpy as np

from onnx_genrt.core.kernels import TransposedWeight

from ._intrinsics import address_as_pointer
from ._worker_pool import (
    ARGS,
    COPY,
    FIRST_ARG,
    MAX_CHUNKS,
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
# Sums may be reordered so LLVM vectorizes them (as in _nn_common and _int4_matmul).
_FM = {"reassoc", "contract"}
#: Rows of X up to which a prepacked weight runs the skinny kernel; more rows use BLAS.
SKINNY_MAX_M = 16
# Multiply-adds (M * N * K) below which a call stays on the calling thread, and about the
# multiply-adds per chunk of a pooled call (docs/performance.md): a 256 x 384 GEMV (4-5 us
# alone) gains from a second thread since the caller waits for a running worker.
PARALLEL_MIN_WORK = 1 << 16
CHUNK_WORK = 1 << 16
_NO_BIAS = np.zeros(0, _F32)


def pack_weight(w: np.ndarray, transposed: bool = False) -> TransposedWeight:
    """``w`` [K, N] (or [N, K] when ``transposed``) as a :class:`TransposedWeight`."""
    t = w if transposed else w.T
    return TransposedWeight(np.ascontiguousarray(t, _F32))


@numba.njit(cache=True, fastmath=_FM, inline="always")
def _rows4(x, i, wt, c, d, b0, b1, b2, b3, out):
    """out[i:i+4, (c, c+d, c+2d, c+3d)]: 16 dot products over K."""
    k = x.shape[1]
    x0 = x[i]
    x1 = x[i + 1]
    x2 = x[i + 2]
    x3 = x[i + 3]
    w0 = wt[c]
    w1 = wt[c + d]
    w2 = wt[c + 2 * d]
    w3 = wt[c + 3 * d]
    a00 = a01 = a02 = a03 = _F32(0)
    a10 = a11 = a12 = a13 = _F32(0)
    a20 = a21 = a22 = a23 = _F32(0)
    a30 = a31 = a32 = a33 = _F32(0)
    for kk in range(k):
        v0 = w0[kk]
        v1 = w1[kk]
        v2 = w2[kk]
        v3 = w3[kk]
        u = x0[kk]
        a00 += u * v0
        a01 += u * v1
        a02 += u * v2
        a03 += u * v3
        u = x1[kk]
        a10 += u * v0
        a11 += u * v1
        a12 += u * v2
        a13 += u * v3
        u = x2[kk]
        a20 += u * v0
        a21 += u * v1
        a22 += u * v2
        a23 += u * v3
        u = x3[kk]
        a30 += u * v0
        a31 += u * v1
        a32 += u * v2
        a33 += u * v3
    _store4(out, i, c, d, a00 + b0, a01 + b1, a02 + b2, a03 + b3)
    _store4(out, i + 1, c, d, a10 + b0, a11 + b1, a12 + b2, a13 + b3)
    _store4(out, i + 2, c, d, a20 + b0, a21 + b1, a22 + b2, a23 + b3)
    _store4(out, i + 3, c, d, a30 + b0, a31 + b1, a32 + b2, a33 + b3)


@numba.njit(cache=True, fastmath=_FM, inline="always")
def _rows2(x, i, wt, c, d, b0, b1, b2, b3, out):
    """Like ``_rows4`` for two rows of x."""
    k = x.shape[1]
    x0 = x[i]
    x1 = x[i + 1]
    w0 = wt[c]
    w1 = wt[c + d]
    w2 = wt[c + 2 * d]
    w3 = wt[c + 3 * d]
    a00 = a01 = a02 = a03 = _F32(0)
    a10 = a11 = a12 = a13 = _F32(0)
    for kk in range(k):
        v0 = w0[kk]
        v1 = w1[kk]
        v2 = w2[kk]
        v3 = w3[kk]
        u = x0[kk]
        a00 += u * v0
        a01 += u * v1
        a02 += u * v2
        a03 += u * v3
        u = x1[kk]
        a10 += u * v0
        a11 += u * v1
        a12 += u * v2
        a13 += u * v3
    _store4(out, i, c, d, a00 + b0, a01 + b1, a02 + b2, a03 + b3)
    _store4(out, i + 1, c, d, a10 + b0, a11 + b1, a12 + b2, a13 + b3)


@numba.njit(cache=True, fastmath=_FM, inline="always")
def _rows1(x, i, wt, c, d, b0, b1, b2, b3, out):
    """Like ``_rows4`` for one row of x."""
    k = x.shape[1]
    x0 = x[i]
    w0 = wt[c]
    w1 = wt[c + d]
    w2 = wt[c + 2 * d]
    w3 = wt[c + 3 * d]
    a0 = a1 = a2 = a3 = _F32(0)
    for kk in range(k):
        u = x0[kk]
        a0 += u * w0[kk]
        a1 += u * w1[kk]
        a2 += u * w2[kk]
        a3 += u * w3[kk]
    _store4(out, i, c, d, a0 + b0, a1 + b1, a2 + b2, a3 + b3)


@numba.njit(cache=True, inline="always")
def _store4(out, i, c, d, y0, y1, y2, y3):
    out[i, c] = y0
    out[i, c + d] = y1
    out[i, c + 2 * d] = y2
    out[i, c + 3 * d] = y3


@numba.njit(cache=True, fastmath=_FM, inline="always")
def _bias_at(bias, c):
    return bias[c] if bias.shape[0] != 0 else _F32(0)


@numba.njit(cache=True, fastmath=_FM)
def _columns(x, wt, bias, out, c0, c1, tail):
    """Columns c, c+d, c+2d, c+3d of out for c in [c0, c1); with ``tail`` also the last
    N - 4d columns, one at a time."""
    m, k = x.shape
    n = wt.shape[0]
    d = n // 4
    for c in range(c0, c1):
        b0 = _bias_at(bias, c)
        b1 = _bias_at(bias, c + d)
        b2 = _bias_at(bias, c + 2 * d)
        b3 = _bias_at(bias, c + 3 * d)
        i = 0
        while i + 4 <= m:
            _rows4(x, i, wt, c, d, b0, b1, b2, b3, out)
            i += 4
        if i + 2 <= m:
            _rows2(x, i, wt, c, d, b0, b1, b2, b3, out)
            i += 2
        if i < m:
            _rows1(x, i, wt, c, d, b0, b1, b2, b3, out)
    if tail:
        for c in range(4 * d, n):
            w0 = wt[c]
            b = _bias_at(bias, c)
            for i in range(m):
                xi = x[i]
                a = _F32(0)
                for kk in range(k):
                    a += xi[kk] * w0[kk]
                out[i, c] = a + b


@numba.njit(cache=True)
def _skinny_serial(x, wt, bias, out):
    """out (M, N) = x (M, K) @ wt.T (+ bias) on the calling thread."""
    _columns(x, wt, bias, out, 0, wt.shape[0] // 4, True)


def _skinny_chunk(args, chunk, mode):
    """Chunk runner (``_worker_pool``): column groups ``[c0, c1)`` of chunk ``chunk`` (and
    the tail in the last one) into the output, into the scratch buffer, or copied across."""
    try:
        a = numba.carray(address_as_pointer(args, np.int64), (ARGS,))
        chunks = a[1]
        m, k, n = a[FIRST_ARG + 1], a[FIRST_ARG + 2], a[FIRST_ARG + 4]
        d = n // 4
        c0 = chunk * d // chunks
        c1 = (chunk + 1) * d // chunks
        tail = chunk == chunks - 1
        out = numba.carray(address_as_pointer(a[FIRST_ARG + 7], np.float32), (m, n))
        scratch = numba.carray(address_as_pointer(a[0], np.float32), (m, n))
        if mode == COPY:
            for i in range(m):
                for q in range(4):
                    out[i, q * d + c0 : q * d + c1] = scratch[i, q * d + c0 : q * d + c1]
                if tail:
                    out[i, 4 * d :] = scratch[i, 4 * d :]
            return 0
        x = numba.carray(address_as_pointer(a[FIRST_ARG], np.float32), (m, k))
        wt = numba.carray(address_as_pointer(a[FIRST_ARG + 3], np.float32), (n, k))
        bias = numba.carray(address_as_pointer(a[FIRST_ARG + 5], np.float32), (a[FIRST_ARG + 6],))
        _columns(x, wt, bias, out if mode == OUT else scratch, c0, c1, tail)
        return 0
    except Exception:  # noqa: BLE001 - a runner reports failure by its return value
        return 1


_skinny_runner = chunk_runner(_skinny_chunk)


@numba.njit(cache=True, nogil=True)
def _skinny_pooled(x, wt, bias, out, ctrl, runner, chunks):
    """``_skinny_serial`` with the pool's workers taking chunks of the column groups; on the
    calling thread alone when another thread holds the pool or an operand is not
    C-contiguous. Returns ``run_job``'s status (0: nothing left to do)."""
    contiguous = x.flags.c_contiguous and wt.flags.c_contiguous and out.flags.c_contiguous
    if not (contiguous and bias.flags.c_contiguous) or not enter(ctrl):
        _columns(x, wt, bias, out, 0, wt.shape[0] // 4, True)
        return 0
    m, k = x.shape
    n = wt.shape[0]
    set_arg(ctrl, 0, x.ctypes.data)
    set_arg(ctrl, 1, m)
    set_arg(ctrl, 2, k)
    set_arg(ctrl, 3, wt.ctypes.data)
    set_arg(ctrl, 4, n)
    set_arg(ctrl, 5, bias.ctypes.data)
    set_arg(ctrl, 6, bias.shape[0])
    set_arg(ctrl, 7, out.ctypes.data)
    return run_job(ctrl, runner, chunks)


def skinny_chunks(m: int, k: int, n: int) -> int:
    """Chunks a call of this size is split into: 1 (the calling thread alone) for small
    work or one thread, else about ``CHUNK_WORK`` multiply-adds each."""
    if pool_threads() < 2 or m * n * k < PARALLEL_MIN_WORK or n < 8:
        return 1
    return chunk_count(n // 4, m * n * k, CHUNK_WORK)


def skinny_matmul(
    x: np.ndarray,
    w: TransposedWeight,
    out: np.ndarray,
    bias: np.ndarray | None = None,
    chunks: int | None = None,
) -> np.ndarray:
    """``out`` (M, N) = ``x`` (M, K) @ W (+ ``bias`` (N,)), all float32 and C-contiguous;
    split into ``chunks`` (default ``skinny_chunks``) over the worker pool's threads."""
    m, k = x.shape
    n = w.t.shape[0]
    b = _NO_BIAS if bias is None else bias
    if m == 0 or n == 0:
        return out
    if k == 0:
        out[...] = 0 if bias is None else bias
        return out
    if chunks is None:
        chunks = skinny_chunks(m, k, n)
    if chunks == 1 or pool_threads() < 2:
        _skinny_serial(x, w.t, b, out)
        return out
    chunks = min(chunks, n // 4, MAX_CHUNKS)
    pool = worker_pool()
    pool.reserve(m * n)
    status = _skinny_pooled(x, w.t, b, out, pool.ctrl, _skinny_runner(), chunks)
    if status & 3:
        pool.settle(status, (x, w.t, b, out), "MatMul (skinny float32)")
    return out


def skinny_call(
    x: np.ndarray, w: TransposedWeight, out: np.ndarray, bias: np.ndarray | None = None
) -> Callable[[], None]:
    """``skinny_matmul(x, w, out, bias)`` prebound for graph replay: the sizes and the split
    are worked out once (again when the thread count changes), not on every call."""
    m, k = x.shape
    n = w.t.shape[0]
    if m == 0 or n == 0 or k == 0:
        return functools.partial(skinny_matmul, x, w, out, bias)
    wt = w.t
    b = _NO_BIAS if bias is None else bias
    split = [0, 1, 0]  # the thread count it was worked out for, the chunks, the runner

    def call() -> None:
        threads = pool_threads()
        if threads != split[0]:
            chunks = skinny_chunks(m, k, n)
            split[:] = threads, chunks, _skinny_runner() if chunks > 1 else 0
        if split[1] == 1:
            _skinny_serial(x, wt, b, out)
            return
        pool = worker_pool()
        pool.reserve(m * n)
        status = _skinny_pooled(x, wt, b, out, pool.ctrl, split[2], split[1])
        if status & 3:
            pool.settle(status, (x, wt, b, out), "MatMul (skinny float32)")

    return call
