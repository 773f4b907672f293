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
(docs/performance.md).
"""

from __future__ import annotations

from typing import NamedTuple

import numba
import numpy as np

_F32 = np.float32
_U8 = np.uint8
# Sums may be reordered so LLVM vectorizes them (as in _nn_common).
_FM = {"reassoc", "contract"}
# Multiply-adds (M * N * K) below which a call stays on one thread: waking a second one
# costs about as much as the work.
PARALLEL_MIN_WORK = 1 << 18


class Int4Tiles(NamedTuple):
    """A 4-bit MatMulNBits weight laid out for ``int4_matmul``."""

    tiles: np.ndarray  # (n_tiles, K/2 padded to whole blocks, rows) uint8
    scales: np.ndarray  # (blocks, n_tiles * rows) float32
    zeros: np.ndarray  # zero points minus 8, like scales; (0, 0) for the default 8
    n: int
    block: int


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
) -> Int4Tiles:
    """Tiles of ``rows`` rows (default ``tile_rows(n)``) from (N, blocks, blob) uint8 weights,
    (N, blocks) float32 scales and zeros."""
    zt = np.zeros((0, 0), _F32) if zeros is None else tile_params(zeros - _F32(8), n, rows)
    return Int4Tiles(tile_weight(packed, n, rows), tile_params(scales, n, rows), zt, n, block)


def tile_weight(packed: np.ndarray, n: int, rows: int | None = None) -> np.ndarray:
    """(N, blocks, blob) uint8 weights as (n_tiles, K/2, rows) tiles (the last padded)."""
    half = packed.shape[1] * packed.shape[2]
    rows = tile_rows(n) if rows is None else rows
    nt = -(-n // rows)
    w = np.zeros((nt * rows, half), _U8)
    w[:n] = packed.reshape(n, half)
    return np.ascontiguousarray(w.reshape(nt, rows, half).transpose(0, 2, 1))


def tile_params(p: np.ndarray, n: int, rows: int | None = None) -> np.ndarray:
    """(N, blocks) per-block scales or zero points as float32 (blocks, n_tiles * rows)."""
    rows = tile_rows(n) if rows is None else rows
    out = np.zeros((p.shape[1], -(-n // rows) * rows), _F32)
    out[:, :n] = p.T
    return out


def untile_weight(tiles: np.ndarray, n: int) -> np.ndarray:
    """The (N, K/2) uint8 rows that ``tile_weight`` rearranged."""
    nt, half, rows = tiles.shape
    return np.ascontiguousarray(tiles.transpose(0, 2, 1).reshape(nt * rows, half)[:n])


def dequantize_tiles(w: Int4Tiles, k: int) -> np.ndarray:
    """The float32 weight the tiles hold, ``(q - zero) * scale``, transposed: (K, N), the
    layout the tiles give without a transpose (a tile's byte ``t`` is a run of rows), and
    one BLAS reads as well as (N, K)."""
    out = np.empty((k, w.n), _F32)
    _dequant_tiles(w.tiles, w.scales, w.zeros, w.block, out)
    return out


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


@numba.njit(cache=True, fastmath=_FM)
def _tiles_gemv(tiles, t0, t1, xe, xo, xs, scales, zeros, out):
    """out[0, rows of tiles t0..t1) for one row of x (split into xe/xo, block sums xs)."""
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


@numba.njit(cache=True, fastmath=_FM)
def _tiles_gemm(tiles, t0, t1, xe, xo, xs, scales, zeros, out):
    """Like ``_tiles_gemv`` for M > 1 rows of x: each byte is unpacked once for all M."""
    _, half, rows = tiles.shape
    m = xe.shape[0]
    nb = scales.shape[0]
    blob = half // nb
    n = out.shape[1]
    acc = np.empty((m, rows), _F32)
    tot = np.empty((m, rows), _F32)
    lo = np.empty(rows, _F32)
    hi = np.empty(rows, _F32)
    for ti in range(t0, t1):
        r0 = ti * rows
        tot[:] = 0
        for b in range(nb):
            acc[:] = 0
            for t in range(b * blob, (b + 1) * blob):
                q = tiles[ti, t]
                for r in range(rows):
                    v = q[r]
                    lo[r] = _F32(_U8(v & 15)) - _F32(8)
                    hi[r] = _F32(_U8(v >> 4)) - _F32(8)
                for i in range(m):
                    e = xe[i, t]
                    o = xo[i, t]
                    ai = acc[i]
                    for r in range(rows):
                        ai[r] += lo[r] * e + hi[r] * o
            for i in range(m):
                _block_end(tot[i], acc[i], scales, zeros, b, r0, xs[i, b])
        for i in range(m):
            for r in range(min(rows, n - r0)):
                out[i, r0 + r] = tot[i, r]


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
    m, k = x.shape
    xe = np.zeros((m, half), _F32)
    xo = np.zeros((m, half), _F32)
    xs = np.zeros((m, nb), _F32)
    for i in range(m):
        for c in range(k):
            v = x[i, c]
            if c & 1:
                xo[i, c >> 1] = v
            else:
                xe[i, c >> 1] = v
            xs[i, c // block] += v
    return xe, xo, xs


@numba.njit(cache=True)
def _int4_serial(x, tiles, scales, zeros, block, out):
    """out (M, N) = x (M, K) @ dequant(W)^T on the calling thread."""
    nt, half, _ = tiles.shape
    xe, xo, xs = _split_x(x, half, scales.shape[0], block)
    if x.shape[0] == 1:
        _tiles_gemv(tiles, 0, nt, xe, xo, xs, scales, zeros, out)
    else:
        _tiles_gemm(tiles, 0, nt, xe, xo, xs, scales, zeros, out)


@numba.njit(cache=True, parallel=True)
def _int4_parallel(x, tiles, scales, zeros, block, parts, out):
    """Like ``_int4_serial``, the tiles split into ``parts`` runs, one per thread."""
    nt, half, _ = tiles.shape
    xe, xo, xs = _split_x(x, half, scales.shape[0], block)
    for p in numba.prange(parts):
        t0 = p * nt // parts
        t1 = (p + 1) * nt // parts
        if x.shape[0] == 1:
            _tiles_gemv(tiles, t0, t1, xe, xo, xs, scales, zeros, out)
        else:
            _tiles_gemm(tiles, t0, t1, xe, xo, xs, scales, zeros, out)


def tile_parts(m: int, k: int, w: Int4Tiles) -> int:
    """Threads an (M, K) @ tiles call splits its tiles over: 1 below PARALLEL_MIN_WORK."""
    if m * w.n * k < PARALLEL_MIN_WORK:
        return 1
    return min(w.tiles.shape[0], numba.get_num_threads())


def int4_matmul(x: np.ndarray, w: Int4Tiles, out: np.ndarray) -> np.ndarray:
    """``out`` (M, N) float32 = ``x`` (M, K) float32 @ dequant(W)^T, on Numba's threads."""
    parts = tile_parts(*x.shape, w)
    if parts == 1:
        _int4_serial(x, w.tiles, w.scales, w.zeros, w.block, out)
    else:
        _int4_parallel(x, w.tiles, w.scales, w.zeros, w.block, parts, out)
    return out
