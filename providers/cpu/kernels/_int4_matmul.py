"""Small-M MatMulNBits for 4-bit weights, computed from the packed nibbles.

The packed weight (N, blocks, blob) is rearranged once into tiles of ``rows`` output
features, ``tiles[i, t, r]`` being byte ``t`` of row ``i * rows + r``: one vector load then
holds byte ``t`` of many rows, so a tile accumulates all its rows at once with no
horizontal sums. Nibbles are centred on 8 (the default zero point) so that block sums do
not cancel: per byte ``t``, ``acc[r] += (lo(w[t, r]) - 8) * x[2t] + (hi(w[t, r]) - 8) *
x[2t+1]``, and at each block end ``y[r] += s[r] * (acc[r] - (z[r] - 8) * sum(x of the
block))``.

The tiles hold the packed bytes themselves (plus the padding rows of the last tile), with
the per-block scales (and zero points, when given) transposed to (blocks, rows): about
1.25x the packed bytes for 32-wide blocks, against 8x for a float32 copy of the weight.
Row-major nibbles cannot be summed this way: Numba (LLVM) vectorizes the per-block dot
of a single row only with a horizontal sum per block, which measured slower
(docs/performance.md). The float kernel (accuracy levels 0-3) takes 32 columns of a tile
and up to ``GROUP`` rows of x a call, in 16-lane vectors (``_nibble_rows``), with the same
arithmetic at every row count: a row's outputs are the same bits alone or batched.

At accuracy_level 4 on a CPU with AVX-512 VNNI the tiles take the VNNI layout instead
(``tile_weight(..., vnni=True)``, read by ``_int4_vnni``): ``tiles[i, s, r, j]`` holds the
weights of columns ``8s + j`` (low nibble) and ``8s + 4 + j`` (high nibble) of row ``i *
rows + r``, the same bytes rearranged; the scales and zero points are then tile by tile,
(n_tiles, blocks, rows), so that a tile reads its own as one run (from memory, scales a
whole row of tiles apart per block cost the kernel a third of its time).
``untile_weight``, ``untile_params`` and ``dequantize_tiles`` read both layouts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numba
import numpy as np

from ._fma_rows import GROUP, TILE
from ._intrinsics import address_as_pointer
from ._nibble_rows import nibble_rows
from ._worker_pool import (
    ARGS,
    COPY,
    FIRST_ARG,
    MAX_CHUNKS,
    OUT,
    carve,
    chunk_count,
    chunk_runner,
    enter,
    operand_address,
    pool_threads,
    run_job,
    set_arg,
    worker_pool,
)

_F32 = np.float32
_U8 = np.uint8
# Sums may be reordered so LLVM vectorizes them (as in _nn_common).
_FM = {"reassoc", "contract"}
# Multiply-adds (M * N * K) below which a call stays on the calling thread, and about the
# multiply-adds per chunk of a pooled call (docs/performance.md).
PARALLEL_MIN_WORK = 1 << 19
CHUNK_WORK = 1 << 17


class Int4Tiles(NamedTuple):
    """A 4-bit MatMulNBits weight laid out for ``int4_matmul`` and ``int4_int8_matmul``
    (row tiles), or for ``int4_vnni_matmul`` (the VNNI layout: 4-D tiles)."""

    tiles: np.ndarray  # (n_tiles, K/2, rows) or VNNI (n_tiles, K/8, rows, 4) uint8; K padded
    scales: np.ndarray  # (blocks, n_tiles * rows), VNNI (n_tiles, blocks, rows) float32
    zeros: np.ndarray  # zero points minus 8, like scales; size 0 for the default 8
    n: int
    block: int

    @property
    def vnni(self) -> bool:
        """Whether the tiles are in the VNNI layout."""
        return self.tiles.ndim == 4

    @property
    def rows(self) -> int:
        """Output rows per tile."""
        return int(self.tiles.shape[2])


def tile_rows(n: int) -> int:
    """Rows per tile: wide tiles for long outputs, narrower ones to share small N."""
    return 128 if n >= 1024 else 64


def pack_int4(
    packed: np.ndarray,
    scales: np.ndarray,
    zeros: np.ndarray | None,
    n: int,
    block: int,
    rows: int | None = None,
    vnni: bool = False,
) -> Int4Tiles:
    """Tiles of ``rows`` rows (default ``tile_rows(n)``) from (N, blocks, blob) uint8 weights,
    (N, blocks) float32 scales and zeros; in the VNNI layout when ``vnni``."""
    zt = no_zeros(vnni) if zeros is None else tile_params(zeros - _F32(8), n, rows, vnni)
    tiles = tile_weight(packed, n, rows, vnni)
    return Int4Tiles(tiles, tile_params(scales, n, rows, vnni), zt, n, block)


def no_zeros(vnni: bool = False) -> np.ndarray:
    """The zero points of a weight that has none (the default 8), in either layout."""
    return np.zeros((0, 0, 0) if vnni else (0, 0), _F32)


def tile_weight(
    packed: np.ndarray,
    n: int,
    rows: int | None = None,
    vnni: bool = False,
    zeros: Callable[..., np.ndarray] = np.zeros,
) -> np.ndarray:
    """(N, blocks, blob) uint8 weights as (n_tiles, K/2, rows) tiles (the last padded), or
    in the VNNI layout (n_tiles, K/8, rows, 4) when ``vnni``; the result is made by
    ``zeros(shape, dtype)`` (a weight arena's, say)."""
    half = packed.shape[1] * packed.shape[2]
    rows = tile_rows(n) if rows is None else rows
    nt = -(-n // rows)
    if vnni and half % 4:
        raise ValueError(f"the VNNI layout needs K a multiple of 8, got {2 * half}")
    flat = packed.reshape(n, half)
    out = zeros((nt, half // 4, rows, 4) if vnni else (nt, half, rows), _U8)
    group = max(1, (1 << 20) // max(1, rows * half))  # tiles a pass: temporaries about 1 MB
    for t0 in range(0, nt, group):
        t1 = min(nt, t0 + group)
        w = np.zeros(((t1 - t0) * rows, half), _U8)
        real = flat[t0 * rows : t1 * rows]
        w[: real.shape[0]] = real
        if vnni:
            # byte j of step s: column 8s + j (byte 4s + j // 2 of the row) low, 8s + 4 + j high
            steps = w.reshape(-1, half // 4, 4)
            nib = np.stack((steps & 15, steps >> 4), axis=-1).reshape(-1, half // 4, 2, 4)
            w = nib[:, :, 0] | (nib[:, :, 1] << 4)
            out[t0:t1] = w.reshape(t1 - t0, rows, half // 4, 4).transpose(0, 2, 1, 3)
        else:
            out[t0:t1] = w.reshape(t1 - t0, rows, half).transpose(0, 2, 1)
    return out


def _into(zeros: Callable[..., np.ndarray], view: np.ndarray) -> np.ndarray:
    """A C-contiguous copy of ``view`` in an array made by ``zeros``."""
    out = zeros(view.shape, view.dtype)
    out[...] = view
    return out


def tile_params(
    p: np.ndarray,
    n: int,
    rows: int | None = None,
    vnni: bool = False,
    zeros: Callable[..., np.ndarray] = np.zeros,
) -> np.ndarray:
    """(N, blocks) per-block scales or zero points as float32 (blocks, n_tiles * rows), or
    (n_tiles, blocks, rows) for VNNI tiles; the result is made by ``zeros(shape, dtype)``."""
    rows = tile_rows(n) if rows is None else rows
    nt = -(-n // rows)
    values = np.zeros((p.shape[1], nt * rows), _F32)
    values[:, :n] = p.T
    return _into(zeros, values.reshape(p.shape[1], nt, rows).transpose(1, 0, 2) if vnni else values)


def untile_params(packed: np.ndarray, n: int) -> np.ndarray:
    """The (N, blocks) float32 values that ``tile_params`` rearranged (either layout)."""
    if packed.ndim == 3:
        nt, blocks, rows = packed.shape
        return np.ascontiguousarray(packed.transpose(0, 2, 1).reshape(nt * rows, blocks)[:n])
    return np.ascontiguousarray(packed[:, :n].T)


def untile_weight(tiles: np.ndarray, n: int) -> np.ndarray:
    """The (N, K/2) uint8 rows that ``tile_weight`` rearranged (either layout)."""
    if tiles.ndim == 4:
        nt, steps, rows, _ = tiles.shape
        v = tiles[:, :, :, :, None] >> np.array([0, 4], _U8)  # (nt, steps, rows, j, lo/hi)
        cols = (v & 15).transpose(0, 2, 1, 4, 3).reshape(nt * rows, 4 * steps, 2)[:n]
        return np.ascontiguousarray(cols[:, :, 0] | (cols[:, :, 1] << 4))
    nt, half, rows = tiles.shape
    return np.ascontiguousarray(tiles.transpose(0, 2, 1).reshape(nt * rows, half)[:n])


def dequantize_tiles(w: Int4Tiles, k: int) -> np.ndarray:
    """The float32 weight the tiles hold, ``(q - zero) * scale``, transposed: (K, N), the
    layout the tiles give without a transpose (a tile's byte ``t`` is a run of rows), and
    one BLAS reads as well as (N, K)."""
    out = np.empty((k, w.n), _F32)
    if w.vnni:
        _dequant_vnni_tiles(w.tiles, w.scales, w.zeros, w.block, out)
    else:
        _dequant_tiles(w.tiles, w.scales, w.zeros, w.block, out)
    return out


@numba.njit(cache=True)
def _dequant_vnni_tiles(tiles, scales, zeros, block, out):
    """``_dequant_tiles`` for the VNNI layout: a row's 4 bytes at step ``s``, read as one
    uint32 word, hold column ``8s + j`` at bit ``8 (j % 4) + 4 (j // 4)``."""
    _, steps, rows, _ = tiles.shape
    k, n = out.shape
    for ti in range(tiles.shape[0]):
        r0 = ti * rows
        live = min(rows, n - r0)
        for s in range(min(steps, (k + 7) // 8)):
            b = 8 * s // block
            sc = scales[ti, b, :live]
            z = zeros[ti, b, :live] if zeros.size else sc[:0]
            words = tiles[ti, s].reshape(4 * rows).view(np.uint32)
            for j in range(min(8, k - 8 * s)):
                shift = 8 * (j % 4) + 4 * (j // 4)
                col = out[8 * s + j, r0 : r0 + live]
                if zeros.size:
                    for r in range(live):
                        v = _F32((words[r] >> shift) & 15)
                        col[r] = (v - (_F32(8) + z[r])) * sc[r]
                else:
                    for r in range(live):
                        col[r] = (_F32((words[r] >> shift) & 15) - _F32(8)) * sc[r]


@numba.njit(cache=True)
def _dequant_tiles(tiles, scales, zeros, block, out):
    """out[c, row] = (nibble c of the row - 8 - zeros[b, row]) * scales[b, row]: byte ``t``
    of a tile gives columns 2t and 2t+1 of all its rows, contiguous in both."""
    _, half, rows = tiles.shape
    k, n = out.shape
    blob = block // 2
    for ti in range(tiles.shape[0]):
        r0 = ti * rows
        live = min(rows, n - r0)
        for t in range(min(half, (k + 1) // 2)):
            b = t // blob
            q = tiles[ti, t]
            s = scales[b, r0 : r0 + live]
            lo = out[2 * t, r0 : r0 + live]
            if zeros.shape[0]:
                z = zeros[b, r0 : r0 + live]
                for r in range(live):
                    lo[r] = (_F32(q[r] & 15) - (_F32(8) + z[r])) * s[r]
                if 2 * t + 1 < k:
                    hi = out[2 * t + 1, r0 : r0 + live]
                    for r in range(live):
                        hi[r] = (_F32(q[r] >> 4) - (_F32(8) + z[r])) * s[r]
            else:
                for r in range(live):
                    lo[r] = (_F32(q[r] & 15) - _F32(8)) * s[r]
                if 2 * t + 1 < k:
                    hi = out[2 * t + 1, r0 : r0 + live]
                    for r in range(live):
                        hi[r] = (_F32(q[r] >> 4) - _F32(8)) * s[r]


@numba.njit(cache=True)
def _tiles_rows(tiles, t0, t1, xe, xo, xs, scales, zeros, out):
    """out[:, rows of tiles t0..t1) for every row of x (split into xe/xo, block sums xs):
    ``GROUP`` rows of x against 32 of a tile's output rows at a time
    (``_nibble_rows.nibble_rows``, 16-lane vectors), so a row's outputs are the same bits at
    every row count. Operands that are not C-contiguous are copied first; tiles of a width
    that is no multiple of 32 take ``_tiles_gemv_any`` row by row."""
    _, half, rows = tiles.shape
    m, n = out.shape
    if rows % TILE:
        for i in range(m):
            _tiles_gemv_any(
                tiles, t0, t1, xe[i : i + 1], xo[i : i + 1], xs[i : i + 1], scales, zeros,
                out[i : i + 1],
            )  # fmt: skip
        return
    _tiles_rows_c(
        np.ascontiguousarray(tiles), t0, t1, xe, xo, xs, np.ascontiguousarray(scales),
        np.ascontiguousarray(zeros), out,
    )  # fmt: skip


@numba.njit(cache=True)
def _tiles_rows_c(tiles, t0, t1, xe, xo, xs, scales, zeros, out):
    """``_tiles_rows`` on C-contiguous operands, tiles a multiple of 32 wide."""
    _, half, rows = tiles.shape
    m, n = out.shape
    sums = np.empty(TILE * GROUP, _F32)
    for ti in range(t0, t1):
        tile = tiles[ti]
        for c0 in range(0, rows, TILE):
            col = ti * rows + c0
            if col >= n:
                break
            width = min(TILE, n - col)
            for i in range(0, m, GROUP):
                count = min(GROUP, m - i)
                nibble_rows(xe, xo, xs, i, count, tile, c0, scales, zeros, col, sums)
                for r in range(count):
                    o = out[i + r]
                    for j in range(width):
                        o[col + j] = sums[TILE * r + j]


@numba.njit(cache=True, fastmath=_FM)
def _tiles_gemv_any(tiles, t0, t1, xe, xo, xs, scales, zeros, out):
    """Row 0 of x against tiles of any width (the sums in heap arrays)."""
    _, half, rows = tiles.shape
    nb = scales.shape[0]
    blob = half // nb
    n = out.shape[1]
    acc = np.empty(rows, _F32)
    tot = np.empty(rows, _F32)
    for ti in range(t0, t1):
        r0 = ti * rows
        tot[:] = 0
        for b in range(nb):
            acc[:] = 0
            for t in range(b * blob, (b + 1) * blob):
                q = tiles[ti, t]
                e = xe[0, t]
                o = xo[0, t]
                for r in range(rows):
                    v = q[r]
                    acc[r] += (_F32(_U8(v & 15)) - _F32(8)) * e + (_F32(_U8(v >> 4)) - _F32(8)) * o
            _block_end(tot, acc, scales, zeros, b, r0, xs[0, b])
        for r in range(min(rows, n - r0)):
            out[0, r0 + r] = tot[r]


@numba.njit(cache=True, fastmath=_FM, inline="always")
def _block_end(tot, acc, scales, zeros, b, r0, xsum):
    """tot += scale * (acc - (zero - 8) * xsum) for block ``b`` of the tile's rows."""
    rows = tot.shape[0]
    s = scales[b, r0 : r0 + rows]
    if zeros.shape[0] == 0:
        for r in range(rows):
            tot[r] += s[r] * acc[r]
    else:
        z = zeros[b, r0 : r0 + rows]
        for r in range(rows):
            tot[r] += s[r] * (acc[r] - z[r] * xsum)


@numba.njit(cache=True, fastmath=_FM)
def _split_x(x, half, nb, block):
    """x's even columns (they meet the low nibbles), odd columns, and block sums."""
    m = x.shape[0]
    xe = np.empty((m, half), _F32)
    xo = np.empty((m, half), _F32)
    xs = np.empty((m, nb), _F32)
    _split_x_into(x, block, xe, xo, xs)
    return xe, xo, xs


@numba.njit(cache=True, fastmath=_FM)
def _split_x_into(x, block, xe, xo, xs):
    """``_split_x`` into given float32 arrays of (rows, half), (rows, half) and (rows,
    blocks), rows >= M: the rows past M are zero."""
    m, k = x.shape
    xe[:] = 0
    xo[:] = 0
    xs[:] = 0
    for i in range(m):
        for c in range(k):
            v = x[i, c]
            if c & 1:
                xo[i, c >> 1] = v
            else:
                xe[i, c >> 1] = v
            xs[i, c // block] += v


@numba.njit(cache=True)
def _int4_serial(x, tiles, scales, zeros, block, out):
    """out (M, N) = x (M, K) @ dequant(W)^T on the calling thread."""
    nt, half, _ = tiles.shape
    xe, xo, xs = _split_x(x, half, scales.shape[0], block)
    # np.int64(0), not Literal[0]: the pool's chunk runner reuses this compilation
    _tiles_rows(tiles, np.int64(0), nt, xe, xo, xs, scales, zeros, out)


# A tile job's argument words (``set_arg`` indices): a kernel's own operands in 0-3, then the
# sizes and the weight's and output's addresses, the same for every tile kernel.
_T_M, _T_HALF, _T_NB, _T_TILES, _T_NT, _T_ROWS = 4, 5, 6, 7, 8, 9
_T_SCALES, _T_ZEROS, _T_ZROWS, _T_OUT, _T_N = 10, 11, 12, 13, 14


@numba.njit(cache=True, nogil=True, inline="always")
def set_tile_args(ctrl, m, nb, tiles, scales, zeros, out):
    """The shared words of a tile job: sizes, the tiles, scales, zero points and output."""
    nt, rows = tiles.shape[0], tiles.shape[2]
    half = tiles.size // (nt * rows)  # bytes per row, either layout
    set_arg(ctrl, _T_M, m)
    set_arg(ctrl, _T_HALF, half)
    set_arg(ctrl, _T_NB, nb)
    set_arg(ctrl, _T_TILES, tiles.ctypes.data)
    set_arg(ctrl, _T_NT, nt)
    set_arg(ctrl, _T_ROWS, rows)
    set_arg(ctrl, _T_SCALES, scales.ctypes.data)
    set_arg(ctrl, _T_ZEROS, zeros.ctypes.data)
    set_arg(ctrl, _T_ZROWS, zeros.shape[0])
    set_arg(ctrl, _T_OUT, out.ctypes.data)
    set_arg(ctrl, _T_N, out.shape[1])


@numba.njit(cache=True, nogil=True, inline="always")
def tile_chunk(args, chunk, mode):
    """A tile job's chunk, read from its argument words: ``(a, m, half, nb, t0, t1, tiles,
    scales, zeros, dst)`` with ``dst`` the output (mode OUT) or the scratch region. In mode
    COPY the chunk's columns are copied from scratch into the output here: the runner only
    returns."""
    a = numba.carray(address_as_pointer(args, np.int64), (ARGS,))
    m, half, nb = a[FIRST_ARG + _T_M], a[FIRST_ARG + _T_HALF], a[FIRST_ARG + _T_NB]
    nt, rows, n = a[FIRST_ARG + _T_NT], a[FIRST_ARG + _T_ROWS], a[FIRST_ARG + _T_N]
    t0 = chunk * nt // a[1]
    t1 = (chunk + 1) * nt // a[1]
    out = numba.carray(address_as_pointer(a[FIRST_ARG + _T_OUT], _F32), (m, n))
    scratch = numba.carray(address_as_pointer(a[0], _F32), (m, n))
    tiles = numba.carray(address_as_pointer(a[FIRST_ARG + _T_TILES], _U8), (nt, half, rows))
    scales = numba.carray(address_as_pointer(a[FIRST_ARG + _T_SCALES], _F32), (nb, nt * rows))
    zr = a[FIRST_ARG + _T_ZROWS]
    zeros = numba.carray(
        address_as_pointer(a[FIRST_ARG + _T_ZEROS], _F32), (zr, nt * rows * (zr > 0))
    )
    if mode == COPY:
        c0, c1 = t0 * rows, min(t1 * rows, n)
        for i in range(m):
            out[i, c0:c1] = scratch[i, c0:c1]
    dst = out if mode == OUT else scratch
    return a, m, half, nb, t0, t1, tiles, scales, zeros, dst


def _int4_chunk(args, chunk, mode):
    """Chunk runner (``_worker_pool``): the output columns of tiles ``[t0, t1)`` of chunk
    ``chunk`` into the output, into the scratch buffer, or copied across."""
    try:
        a, m, half, nb, t0, t1, tiles, scales, zeros, dst = tile_chunk(args, chunk, mode)
        if mode == COPY:
            return 0
        xe = numba.carray(address_as_pointer(a[FIRST_ARG], _F32), (m, half))
        xo = numba.carray(address_as_pointer(a[FIRST_ARG + 1], _F32), (m, half))
        xs = numba.carray(address_as_pointer(a[FIRST_ARG + 2], _F32), (m, nb))
        _tiles_rows(tiles, t0, t1, xe, xo, xs, scales, zeros, dst)
        return 0
    except Exception:  # noqa: BLE001 - a runner reports failure by its return value
        return 1


_int4_runner = chunk_runner(_int4_chunk)


@numba.njit(cache=True, nogil=True, inline="always")
def pool_refuses(ctrl, x, tiles, scales, zeros, out):
    """Whether a tile kernel runs on the calling thread alone: a non-contiguous operand, or
    the pool held by another thread (else the pool is now held for this job)."""
    contiguous = x.flags.c_contiguous and out.flags.c_contiguous and tiles.flags.c_contiguous
    if not (contiguous and scales.flags.c_contiguous and zeros.flags.c_contiguous):
        return True
    return not enter(ctrl)


@numba.njit(cache=True, nogil=True)
def _int4_pooled(x, tiles, scales, zeros, block, out, ctrl, runner, chunks):
    """``_int4_serial`` with the pool's workers taking chunks of the tiles (the calling
    thread alone when another thread holds the pool). Returns ``run_job``'s status."""
    if pool_refuses(ctrl, x, tiles, scales, zeros, out):
        _int4_serial(x, tiles, scales, zeros, block, out)
        return 0
    half = tiles.shape[1]
    m = x.shape[0]
    nb = scales.shape[0]
    addr = operand_address(ctrl)
    xe, addr = carve(addr, (m, half), _F32)
    xo, addr = carve(addr, (m, half), _F32)
    xs, addr = carve(addr, (m, nb), _F32)
    _split_x_into(x, block, xe, xo, xs)
    set_arg(ctrl, 0, xe.ctypes.data)
    set_arg(ctrl, 1, xo.ctypes.data)
    set_arg(ctrl, 2, xs.ctypes.data)
    set_tile_args(ctrl, m, nb, tiles, scales, zeros, out)
    return run_job(ctrl, runner, chunks)


def tile_parts(m: int, k: int, w: Int4Tiles) -> int:
    """Chunks an (M, K) @ tiles call splits its tiles into: 1 (the calling thread alone)
    below ``PARALLEL_MIN_WORK`` or at one thread, else about ``CHUNK_WORK`` multiply-adds
    each (the int4 and int8-activation kernels share this split)."""
    if pool_threads() < 2 or m * w.n * k < PARALLEL_MIN_WORK:
        return 1
    return chunk_count(w.tiles.shape[0], m * w.n * k, CHUNK_WORK)


def run_pooled(
    entry: Callable,
    runner: Callable[[], int],
    x: np.ndarray,
    w: Int4Tiles,
    out: np.ndarray,
    chunks: int,
    operand_bytes: int,
    what: str,
) -> None:
    """Call a pooled tile kernel ``entry(x, tiles, scales, zeros, block, out, ctrl, runner
    address, chunks)`` and settle its status."""
    pool = worker_pool()
    pool.reserve(x.shape[0] * out.shape[1], operand_bytes)
    status = entry(x, w.tiles, w.scales, w.zeros, w.block, out, pool.ctrl, runner(), chunks)
    if status & 3:
        pool.settle(status, (x, w.tiles, w.scales, w.zeros, out), what)


def int4_matmul(
    x: np.ndarray, w: Int4Tiles, out: np.ndarray, chunks: int | None = None
) -> np.ndarray:
    """``out`` (M, N) float32 = ``x`` (M, K) float32 @ dequant(W)^T, split into ``chunks``
    (default ``tile_parts``) over the worker pool's threads."""
    if chunks is None:
        chunks = tile_parts(*x.shape, w)
    chunks = min(chunks, w.tiles.shape[0], MAX_CHUNKS)
    if chunks == 1 or pool_threads() < 2:
        _int4_serial(x, w.tiles, w.scales, w.zeros, w.block, out)
        return out
    m = x.shape[0]
    half = w.tiles.shape[1]
    nb = w.scales.shape[0]
    operands = 4 * m * (2 * half + nb) + 3 * 64
    run_pooled(_int4_pooled, _int4_runner, x, w, out, chunks, operands, "MatMulNBits (int4)")
    return out
