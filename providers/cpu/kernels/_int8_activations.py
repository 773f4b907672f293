"""MatMulNBits at accuracy_level 4: activations quantized to int8, integer dot products.

onnxruntime's contract for accuracy_level 4 (MLAS's ``CompInt8``, the CPU default of
onnxruntime-genai's builder): each row of A is quantized per block of ``block_size`` columns,
symmetrically, ``scale = max|a| / 127`` and ``q = round_half_even(a * (127 / max|a|))`` (0 for
a block of zeros); each block's dot product of q with the weights minus their zero point is
an integer; ``y = sum over blocks of scale_a * scale_w * dot`` in float32. Since the scales
factor out of each block, the result is also ``(q * scale_a) @ dequant(W)^T``, which is how
calls with many rows use it (:func:`fake_quantize`, then BLAS).

Few rows (decode, speculative verify) run :func:`int4_int8_matmul` on the row tiles of
``_int4_matmul`` (128 rows per tile, ``ROWS``), or on CPUs with AVX-512 VNNI
``_int4_vnni.int4_vnni_matmul`` on tiles in the VNNI layout (``vpdpbusd``, the same bits). Per byte ``v`` of a tile (nibbles lo, hi) and
activations e = q[2t], o = q[2t+1], ``lo * e + hi * o = v * e + (v >> 4) * (o - 16 e)``: two
int16 multiplies and no nibble masking, which LLVM vectorizes as 32 lanes per AVX-512
register, two bytes of the tile per step. The products are taken modulo 2**16, and each
byte's true contribution is at most ``2 * 15 * 127 = 3810`` in magnitude, so a run of
``RUN_BYTES`` (8) bytes sums exactly in int16 (at most 30480); runs add up in int32 per
block, and the zero point z (8 by default) comes off as ``z * sum(q of the block)``, exact
in float32 (under 2**24 for blocks up to 256). The two scales apply once per block.
"""

from __future__ import annotations

import numba
import numpy as np

from ._int4_matmul import (
    Int4Tiles,
    pool_refuses,
    run_pooled,
    set_tile_args,
    tile_chunk,
    tile_parts,
)
from ._intrinsics import address_as_pointer
from ._worker_pool import (
    COPY,
    FIRST_ARG,
    MAX_CHUNKS,
    carve,
    chunk_runner,
    operand_address,
    pool_threads,
    run_job,
    set_arg,
)

_F32 = np.float32
_I8 = np.int8
_I16 = np.int16
# Sums may be reordered so LLVM vectorizes them (as in _int4_matmul); the integer sums are
# exact whatever the order.
_FM = {"reassoc", "contract"}
#: Rows per tile that ``int4_int8_matmul`` takes (LLVM unrolls the row loop to this width).
ROWS = 128
#: Bytes (two columns each) summed in int16 before widening: 8 * 3810 < 2**15.
RUN_BYTES = 8
# float32 bits (sign cleared) from which a value is an infinity or NaN
_NON_FINITE = 0x7F800000
_ROUND = _F32(1.5 * 2**23)


@numba.njit(cache=True)
def _quantize_blocks(x, block, nb):
    """(q, scales, sums) per onnxruntime's rule: q (M, nb * block) int8, zero past K;
    scales (M, nb) float32; sums (M, nb) int32, the sum of q over each block. A block holding
    NaN or an infinity gets a NaN scale (and q = 0), so the rows it reaches come out NaN
    rather than finite nonsense."""
    m = x.shape[0]
    q = np.empty((m, nb * block), _I8)
    scales = np.empty((m, nb), _F32)
    sums = np.empty((m, nb), np.int32)
    _quantize_blocks_into(x, block, q, scales, sums)
    return q, scales, sums


@numba.njit(cache=True)
def _quantize_blocks_into(x, block, q, scales, sums):
    """``_quantize_blocks`` into given q (M, nb * block) int8, scales (M, nb) float32 and
    sums (M, nb) int32."""
    m, k = x.shape
    nb = scales.shape[1]
    q[:] = 0
    top_bits = np.empty(1, np.int32)
    top_value = top_bits.view(_F32)
    for i in range(m):
        row = x[i]
        q_row = q[i]
        for b in range(nb):
            c0 = b * block
            c1 = min(c0 + block, k)
            # loops over slices from 0: with range(c0, c1) LLVM kept the conversion loop
            # scalar (3x slower), the indices possibly negative for all it knew
            seg = row[c0:c1]
            bits = seg.view(np.int32)
            # max|x| as the integer max of the bits without the sign: it vectorizes, and
            # NaN and infinities (exponent all ones) sort above every finite value
            top = np.int32(0)
            for c in range(c1 - c0):
                top = max(top, np.int32(bits[c] & 0x7FFFFFFF))
            total = 0
            if top >= _NON_FINITE:
                scales[i, b] = np.nan
            elif top == 0:
                scales[i, b] = 0
            else:
                top_bits[0] = top
                amax = top_value[0]
                scales[i, b] = amax / _F32(127)
                inv = _F32(127) / amax
                q_seg = q_row[c0:c1]
                for c in range(c1 - c0):
                    # round half to even: adding and taking away 1.5 * 2**23 leaves the
                    # nearest integer (|x * inv| <= 127), in the default rounding mode
                    v = np.int32((seg[c] * inv + _ROUND) - _ROUND)
                    q_seg[c] = _I8(v)
                    total += v
            sums[i, b] = total


def quantize_activations(
    x: np.ndarray, block: int, blocks: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q, scales, sums) of ``x`` (M, K) float32: q (M, blocks * block) int8, zero past K;
    scales (M, blocks) float32; sums (M, blocks) int32, the sum of q in each block."""
    return _quantize_blocks(np.ascontiguousarray(x, _F32), block, blocks)


def fake_quantize(x: np.ndarray, block: int) -> np.ndarray:
    """``x`` (M, K) as accuracy_level 4 sees it: ``q * scale`` per block, float32."""
    k = x.shape[1]
    blocks = -(-k // block)
    q, scales, _ = quantize_activations(x, block, blocks)
    m = x.shape[0]
    y = q.reshape(m, blocks, block).astype(_F32) * scales[:, :, None]
    return y.reshape(m, blocks * block)[:, :k]


@numba.njit(cache=True)
def _pairs(q):
    """e = q[:, 0::2] and f = q[:, 1::2] - 16 e, int16: the factors of a byte v and of
    v >> 4 (see the module docstring)."""
    m, k2 = q.shape
    e = np.empty((m, k2 // 2), _I16)
    f = np.empty((m, k2 // 2), _I16)
    _pairs_into(q, e, f)
    return e, f


@numba.njit(cache=True)
def _pairs_into(q, e, f):
    """``_pairs`` into given (M, K/2) int16 arrays."""
    m, k2 = q.shape
    for i in range(m):
        for t in range(k2 // 2):
            e[i, t] = q[i, 2 * t]
            f[i, t] = q[i, 2 * t + 1] - 16 * e[i, t]


@numba.njit(cache=True, fastmath=_FM)
def _q8_tiles(tiles, t0, t1, e, f, q_scales, q_sums, scales, zeros, out):
    """out[:, rows of tiles t0..t1) for int8 rows q given as ``e = q[:, 0::2]`` and ``f =
    q[:, 1::2] - 16 e`` (int16): per run of ``RUN_BYTES`` bytes, two bytes per step,
    ``run[r] += v * e + (v >> 4) * f`` (int16, modulo 2**16; see the module docstring)."""
    _, half, _ = tiles.shape
    m = e.shape[0]
    nb = scales.shape[0]
    blob = half // nb  # a multiple of RUN_BYTES: blocks are powers of 2 >= 16
    n = out.shape[1]
    run = np.empty(ROWS, _I16)
    acc = np.empty(ROWS, np.int32)
    tot = np.empty(ROWS, _F32)
    for ti in range(t0, t1):
        r0 = ti * ROWS
        tile = tiles[ti]
        for i in range(m):
            tot[:] = 0
            for b in range(nb):
                acc[:] = 0
                end = (b + 1) * blob
                for start in range(b * blob, end, RUN_BYTES):
                    run[:] = 0
                    for t in range(start, min(start + RUN_BYTES, end), 2):
                        w1 = tile[t, :ROWS]
                        w2 = tile[t + 1, :ROWS]
                        e1, f1, e2, f2 = e[i, t], f[i, t], e[i, t + 1], f[i, t + 1]
                        for r in range(ROWS):
                            v1 = _I16(w1[r])
                            v2 = _I16(w2[r])
                            run[r] = run[r] + v1 * e1 + (v1 >> 4) * f1 + v2 * e2 + (v2 >> 4) * f2
                    for r in range(ROWS):
                        acc[r] += run[r]
                # tot += scale_a * scale_w * (acc - zero point * sum(q)), written here: a
                # helper inlined by Numba made the whole kernel 1.5x slower
                s = scales[b, r0 : r0 + ROWS]
                sa = q_scales[i, b]
                qsum = _F32(q_sums[i, b])
                if zeros.shape[0] == 0:
                    for r in range(ROWS):
                        tot[r] += (sa * s[r]) * (_F32(acc[r]) - _F32(8) * qsum)
                else:
                    z = zeros[b, r0 : r0 + ROWS]  # zero point - 8
                    for r in range(ROWS):
                        tot[r] += (sa * s[r]) * (_F32(acc[r]) - (z[r] + _F32(8)) * qsum)
            for r in range(min(ROWS, n - r0)):
                out[i, r0 + r] = tot[r]


@numba.njit(cache=True)
def _q8_serial(x, block, tiles, scales, zeros, out):
    """out (M, N) = x (M, K) quantized to int8 @ dequant(W)^T on the calling thread."""
    q, q_scales, q_sums = _quantize_blocks(x, block, scales.shape[0])
    e, f = _pairs(q)
    # np.int64(0), not Literal[0]: the pool's runner reuses this compilation
    _q8_tiles(tiles, np.int64(0), tiles.shape[0], e, f, q_scales, q_sums, scales, zeros, out)


def _q8_chunk(args, chunk, mode):
    """Chunk runner (``_worker_pool``): the output columns of tiles ``[t0, t1)`` of chunk
    ``chunk`` into the output, into the scratch buffer, or copied across."""
    try:
        a, m, half, nb, t0, t1, tiles, scales, zeros, dst = tile_chunk(args, chunk, mode)
        if mode == COPY:
            return 0
        e = numba.carray(address_as_pointer(a[FIRST_ARG], _I16), (m, half))
        f = numba.carray(address_as_pointer(a[FIRST_ARG + 1], _I16), (m, half))
        q_scales = numba.carray(address_as_pointer(a[FIRST_ARG + 2], _F32), (m, nb))
        q_sums = numba.carray(address_as_pointer(a[FIRST_ARG + 3], np.int32), (m, nb))
        _q8_tiles(tiles, t0, t1, e, f, q_scales, q_sums, scales, zeros, dst)
        return 0
    except Exception:  # noqa: BLE001 - a runner reports failure by its return value
        return 1


_q8_runner = chunk_runner(_q8_chunk)


@numba.njit(cache=True, nogil=True)
def _q8_pooled(x, tiles, scales, zeros, block, out, ctrl, runner, chunks):
    """``_q8_serial`` with the pool's workers taking chunks of the tiles (the calling
    thread alone when another thread holds the pool). Returns ``run_job``'s status."""
    if pool_refuses(ctrl, x, tiles, scales, zeros, out):
        _q8_serial(x, block, tiles, scales, zeros, out)
        return 0
    half = tiles.shape[1]
    m = x.shape[0]
    nb = scales.shape[0]
    addr = operand_address(ctrl)
    q, addr = carve(addr, (m, nb * block), _I8)
    q_scales, addr = carve(addr, (m, nb), _F32)
    q_sums, addr = carve(addr, (m, nb), np.int32)
    e, addr = carve(addr, (m, half), _I16)
    f, addr = carve(addr, (m, half), _I16)
    _quantize_blocks_into(x, block, q, q_scales, q_sums)
    _pairs_into(q, e, f)
    set_arg(ctrl, 0, e.ctypes.data)
    set_arg(ctrl, 1, f.ctypes.data)
    set_arg(ctrl, 2, q_scales.ctypes.data)
    set_arg(ctrl, 3, q_sums.ctypes.data)
    set_tile_args(ctrl, m, nb, tiles, scales, zeros, out)
    return run_job(ctrl, runner, chunks)


def int4_int8_matmul(
    x: np.ndarray, w: Int4Tiles, out: np.ndarray, chunks: int | None = None
) -> np.ndarray:
    """``out`` (M, N) float32 = ``x`` (M, K) float32 @ dequant(W)^T with x quantized to int8
    per block (accuracy_level 4), split into ``chunks`` (default ``tile_parts``) over the
    worker pool's threads. ``w`` has ``ROWS`` rows per tile."""
    if w.tiles.shape[2] != ROWS:
        raise ValueError(f"int8-activation tiles need {ROWS} rows, got {w.tiles.shape[2]}")
    if chunks is None:
        chunks = tile_parts(*x.shape, w)
    chunks = min(chunks, w.tiles.shape[0], MAX_CHUNKS)
    if chunks == 1 or pool_threads() < 2:
        _q8_serial(x, w.block, w.tiles, w.scales, w.zeros, out)
        return out
    m = x.shape[0]
    nb = w.scales.shape[0]
    operands = m * nb * (w.block + 8) + 4 * m * w.tiles.shape[1] + 5 * 64
    run_pooled(_q8_pooled, _q8_runner, x, w, out, chunks, operands, "MatMulNBits (int4, int8)")
    return out
