"""CPU kernels: onnxruntime's MatMulNBits and GatherBlockQuantized (com.microsoft).

MatMulNBits takes one of three paths (prepared weights are kept by ``DequantCache``):

* 4-bit weights with at most ``PACKED_MAX_M`` rows of A (decode, speculative verify,
  short prompts) multiply the packed nibbles directly: the weight is rearranged into row
  tiles of the same bytes, about 1.25x the packed size. At ``accuracy_level`` 4 (with uint8
  zero points or none) A is quantized to int8 per block and the tiles are multiplied in
  integers (``_int8_activations``), as onnxruntime does; otherwise in float32
  (``_int4_matmul``).
* Otherwise (prompts, other bit widths) the call dequantizes the weight into a float32
  buffer and runs one BLAS matmul, on A quantized to int8 and back per block at
  ``accuracy_level`` 4 (the same result: the scales factor out of each block). The buffer
  takes 32/bits times the packed bytes (8x for 4-bit), so it is not kept: a 4-bit model
  stays near its packed size after a long prompt. Dequantizing whole 4-bit blocks runs at
  several GB/s, a small part of such a matmul.

The CPU provider's ``nbits_cache`` option (or ``ONNX_GENRT_NBITS_CACHE=1``) keeps the float32
copies instead, trading that memory for a little prompt time. The 4-bit row tiles
are kept either way (about the packed size; a decode step that tiled its weights on every call
would be many times slower).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import ml_dtypes
import numba
import numpy as np

from onnx_genrt.core.dtypes import is_float_dtype
from onnx_genrt.core.kernels import MS_DOMAIN, KernelContext
from onnx_genrt.core.op_rules import (
    NBITS,
    check_index_range,
    matmul_nbits_int8_activations,
    matmul_nbits_unsupported,
    normalize_axis,
)

from ._int4_matmul import Int4Tiles, int4_matmul, pack_int4
from ._int8_activations import ROWS as INT8_TILE_ROWS
from ._int8_activations import fake_quantize, int4_int8_matmul
from ._registry import REGISTRY

_F32 = np.dtype(np.float32)
_U8 = np.dtype(np.uint8)
_NBITS = NBITS
_SMALL_INTS = {np.dtype(ml_dtypes.int4), np.dtype(ml_dtypes.uint4)}
_T = TypeVar("_T")

# Rows of A up to which 4-bit weights are multiplied packed; more use the float32 copy.
PACKED_MAX_M = 16


def unpack_bits(packed: np.ndarray, bits: int) -> np.ndarray:
    """uint8 values packed low bits first along the last axis -> one uint8 per value."""
    if bits == 8:
        return packed
    shifts = np.arange(0, 8, bits, dtype=np.uint8)
    vals = (packed[..., None] >> shifts) & np.uint8((1 << bits) - 1)
    return vals.reshape(*packed.shape[:-1], packed.shape[-1] * (8 // bits))


# ----------------------------------------------------------------------------- dequant cache


class DequantCache:
    """Prepared (dequantized or tiled) weights keyed on the identity of their source arrays.

    An entry lives as long as every source array does (weak references), so a weight
    dropped with its session frees its float copy. Entries assume the sources are not
    modified in place, which holds for initializers.
    """

    def __init__(self) -> None:
        self.builds = 0
        self._entries: dict[tuple, tuple[list[weakref.ref], Any]] = {}

    def get(
        self,
        sources: tuple[np.ndarray | None, ...],
        params: tuple,
        build: Callable[[], _T],
        keep: bool = True,
    ) -> _T:
        """The cached value for ``sources``/``params``, built on a miss and kept when
        ``keep``."""
        live = [a for a in sources if a is not None]
        key = (tuple(id(a) for a in sources), params)
        hit = self._entries.get(key)
        if hit is not None and all(r() is a for r, a in zip(hit[0], live, strict=True)):
            return hit[1]
        value = build()
        self.builds += 1
        if keep:
            drop = self._dropper(key)
            self._entries[key] = ([weakref.ref(a, drop) for a in live], value)
        return value

    def _dropper(self, key: tuple) -> Callable[[weakref.ref], None]:
        entries = self._entries
        return lambda _ref: entries.pop(key, None)

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()


DEQUANT_CACHE = DequantCache()


# ----------------------------------------------------------------------------- MatMulNBits


@numba.njit(cache=True)
def _dequant_nbits(packed, scales, zeros, bits, block, k, out):
    """out[n, col] = (q - zero) * scale for packed (N, blocks, blob) uint8 weights."""
    n, nb, blob = packed.shape
    per = 8 // bits
    mask = (1 << bits) - 1
    for r in range(n):
        for bi in range(nb):
            s = scales[r, bi]
            z = zeros[r, bi]
            base = bi * block
            for byte in range(blob):
                v = packed[r, bi, byte]
                for e in range(per):
                    col = base + byte * per + e
                    if col < k:
                        out[r, col] = (np.float32((v >> (e * bits)) & mask) - z) * s


@numba.njit(cache=True)
def _dequant4_whole_blocks(packed, scales, zeros, out):
    """``_dequant_nbits`` for 4 bits and K a multiple of the block: no bounds test in the
    inner loop, two columns per byte (low nibble first), so it vectorizes."""
    n, nb, blob = packed.shape
    for r in range(n):
        for bi in range(nb):
            s = scales[r, bi]
            z = zeros[r, bi]
            base = 2 * blob * bi
            for byte in range(blob):
                v = packed[r, bi, byte]
                out[r, base + 2 * byte] = (np.float32(v & 15) - z) * s
                out[r, base + 2 * byte + 1] = (np.float32(v >> 4) - z) * s


def _nbits_zeros(zp: np.ndarray | None, n: int, nb: int, bits: int) -> np.ndarray:
    """(N, blocks) float32 zero points from packed uint8, float, or the 2^(bits-1) default."""
    if zp is None:
        return np.full((n, nb), float(1 << (bits - 1)), _F32)
    if zp.dtype == _U8:
        return unpack_bits(zp.reshape(n, -1), bits)[:, :nb].astype(_F32)
    return zp.reshape(n, nb).astype(_F32)


def dequantize_nbits(
    b: np.ndarray, scales: np.ndarray, zp: np.ndarray | None, k: int, n: int, bits: int, block: int
) -> np.ndarray:
    """The (N, K) float32 weight of a MatMulNBits node."""
    nb = -(-k // block)
    blob = block * bits // 8
    packed = np.ascontiguousarray(b, _U8).reshape(n, nb, blob)
    sc = np.ascontiguousarray(scales, _F32).reshape(n, nb)
    out = np.empty((n, k), _F32)
    zeros = _nbits_zeros(zp, n, nb, bits)
    if bits == 4 and k == nb * block:
        _dequant4_whole_blocks(packed, sc, zeros, out)
    else:
        _dequant_nbits(packed, sc, zeros, bits, block, k, out)
    return out


def int4_tiles(
    b: np.ndarray,
    scales: np.ndarray,
    zp: np.ndarray | None,
    k: int,
    n: int,
    block: int,
    rows: int | None = None,
) -> Int4Tiles:
    """The 4-bit weight of a MatMulNBits node, tiled for ``int4_matmul`` (``rows`` per
    tile; ``INT8_TILE_ROWS`` for ``int4_int8_matmul``)."""
    nb = -(-k // block)
    packed = np.ascontiguousarray(b, _U8).reshape(n, nb, block // 2)
    sc = np.ascontiguousarray(scales, _F32).reshape(n, nb)
    zeros = None if zp is None else _nbits_zeros(zp, n, nb, 4)
    return pack_int4(packed, sc, zeros, n, block, rows)


_nbits_check = matmul_nbits_unsupported


@REGISTRY.register("MatMulNBits", since=1, domain=MS_DOMAIN, check=_nbits_check)
def matmul_nbits(
    ctx: KernelContext,
    a: np.ndarray,
    b: np.ndarray,
    scales: np.ndarray,
    zero_points: np.ndarray | None = None,
    g_idx: np.ndarray | None = None,
    bias: np.ndarray | None = None,
) -> np.ndarray:
    """Y = A @ dequant(B)^T (+ bias), with A quantized to int8 per block where
    ``matmul_nbits_int8_activations`` says onnxruntime does (accuracy_level 4), in float32
    otherwise.

    4-bit weights with at most ``PACKED_MAX_M`` rows of A are multiplied packed; other
    calls dequantize the weight to float32 first (kept only with the ``nbits_cache`` option).
    """
    reason = _nbits_check(ctx.node, ())
    if reason or g_idx is not None:
        raise NotImplementedError(f"{ctx.node.describe()}: {reason or 'g_idx'}")
    k, n = int(ctx.attr("K")), int(ctx.attr("N"))
    bits, block = int(ctx.attr("bits", 4)), int(ctx.attr("block_size"))
    if a.shape[-1] != k:
        raise ValueError(f"{ctx.node.describe()}: A has {a.shape[-1]} columns, K is {k}")
    out = ctx.out(0, (*a.shape[:-1], n), a.dtype)
    out2 = out.reshape(-1, n)
    if b.size == 0:  # an omitted projection: zeros (+ bias)
        out2[...] = 0 if bias is None else bias
        return out
    a2 = a.reshape(-1, k)
    int8 = matmul_nbits_int8_activations(
        ctx.node, None if zero_points is None else zero_points.dtype
    )
    sources = (b, scales, zero_points)
    direct = a.dtype == _F32 and out2.flags.c_contiguous and bias is None
    y = out2 if direct else np.empty(out2.shape, _F32)
    if bits == 4 and a2.shape[0] <= PACKED_MAX_M:
        rows = INT8_TILE_ROWS if int8 else None
        w4 = DEQUANT_CACHE.get(
            sources,
            ("int4-tiles", k, n, block, rows),
            lambda: int4_tiles(b, scales, zero_points, k, n, block, rows),
        )
        x = np.ascontiguousarray(a2, _F32)
        (int4_int8_matmul if int8 else int4_matmul)(x, w4, y)
    else:
        params = (k, n, bits, block)
        w = DEQUANT_CACHE.get(
            sources,
            params,
            lambda: dequantize_nbits(b, scales, zero_points, *params),
            keep=ctx.option("nbits_cache", False),
        )
        x = fake_quantize(a2, block) if int8 else a2.astype(_F32, copy=False)
        np.matmul(x, w.T, out=y)
    if direct:
        return out
    if bias is not None:
        y += bias.astype(_F32, copy=False)
    out2[...] = y
    return out


# ----------------------------------------------------------------------------- GatherBlockQuantized


def _values(data: np.ndarray, bits: int, packed: bool) -> np.ndarray:
    """Quantized values as float32 (uint8 data unpacked along the last axis when packed)."""
    return (unpack_bits(data, bits) if packed else data).astype(_F32)


def _default_zero(data: np.ndarray, bits: int) -> float:
    return float(1 << (bits - 1)) if data.dtype == _U8 else 0.0


def _take_params(
    p: np.ndarray, idx: np.ndarray, axis: int, block: int, same_axis: bool
) -> np.ndarray:
    """Scales / zero points gathered like the data (size-1 axes broadcast)."""
    if same_axis:
        return np.take(p, idx // block, axis=axis)
    if p.shape[axis] == 1:
        return np.take(p, np.zeros_like(idx), axis=axis)
    return np.take(p, idx, axis=axis)


def _expand_blocks(p: np.ndarray, axis: int, block: int, length: int) -> np.ndarray:
    """Repeat per-block parameters along ``axis`` to ``length`` elements."""
    if p.shape[axis] == 1:
        return p
    reps = block if block else length
    return np.take(np.repeat(p, reps, axis=axis), np.arange(length), axis=axis)


@REGISTRY.register("GatherBlockQuantized", since=1, domain=MS_DOMAIN)
def gather_block_quantized(
    ctx: KernelContext,
    data: np.ndarray,
    indices: np.ndarray,
    scales: np.ndarray,
    zero_points: np.ndarray | None = None,
) -> np.ndarray:
    """Gather rows of block-quantized ``data`` and dequantize them; an index outside
    ``[-dim, dim)`` of the gather axis raises, naming the node and the index."""
    bits = int(ctx.attr("bits", 4))
    block = int(ctx.attr("block_size", 128))
    packed = data.dtype == _U8 and bits < 8
    is_float = is_float_dtype(data.dtype)
    if data.dtype != _U8 and data.dtype not in _SMALL_INTS and not is_float:
        raise NotImplementedError(f"{ctx.node.describe()}: data type {data.dtype}")
    if packed and bits not in _NBITS:
        raise NotImplementedError(f"{ctx.node.describe()}: bits={bits}")
    rank = data.ndim
    g = normalize_axis(int(ctx.attr("gather_axis", 0)), rank, ctx.node, "gather_axis")
    qa = normalize_axis(int(ctx.attr("quantize_axis", 1)), rank, ctx.node, "quantize_axis")
    if packed and g == rank - 1:
        raise ValueError(f"{ctx.node.describe()}: packed uint8 data cannot gather on its last axis")
    dim = data.shape[g]
    idx = indices.astype(np.int64)
    check_index_range(ctx, idx, dim, "indices value")
    safe = np.where(idx < 0, idx + dim, idx)

    # Gather first, then unpack and convert: only the rows asked for (an embedding lookup
    # must not touch the whole table's scales and zero points).
    q = _values(np.take(data, safe, axis=g), bits, packed)
    sc = _take_params(scales, safe, g, block, g == qa).astype(_F32)
    zp = None
    if zero_points is not None:
        # packed along the last axis, which is never the gather axis of packed data
        zp = _values(_take_params(zero_points, safe, g, block, g == qa), bits, packed)
        zp = zp[..., : scales.shape[-1]] if packed else zp
    out_qa = qa if qa < g else qa + indices.ndim - 1
    if g != qa:
        sc = _expand_blocks(sc, out_qa, block, q.shape[out_qa])
        if zp is not None:
            zp = _expand_blocks(zp, out_qa, block, q.shape[out_qa])
    if zp is not None:
        q -= zp
    elif not is_float and _default_zero(data, bits):
        q -= _default_zero(data, bits)
    q *= sc
    out = ctx.out(0, q.shape, scales.dtype)
    out[...] = q
    return out
