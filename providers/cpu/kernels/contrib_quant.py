"""CPU kernels: onnxruntime's MatMulNBits and GatherBlockQuantized (com.microsoft).

MatMulNBits takes one of two paths:

* 4-bit weights with at most ``PACKED_MAX_M`` rows of A (``INT8_PACKED_MAX_M`` at
  accuracy_level 4; any number with VNNI, ``VNNI_PACKED_MAX_M`` a call: decode, speculative
  verify, short prompts, and every prompt with VNNI) multiply the packed nibbles directly
  (``_int4_matmul``): the weight is rearranged into row tiles of the same bytes, about
  1.25x the packed size. Constant weights, scales and zero points are prepacked so once,
  when the session is built (``prepack_int4``), and the session then releases the
  originals: the weight is held once, as tiles. Weights that are not constants are tiled on first use (``DequantCache``).
  At ``accuracy_level`` 4 (with uint8 zero points or none) A is quantized to int8 per
  block and the tiles are multiplied in integers, as onnxruntime does: with ``vpdpbusd`` on
  tiles in the VNNI layout where the CPU has AVX-512 VNNI (``_int4_vnni``; the provider's
  ``int4_vnni`` option, ``ONNX_GENRT_INT4_VNNI=0`` turns it off), else with int16
  multiplies (``_int8_activations``); otherwise in float32 (``_int4_matmul``).
* Otherwise (prompts, other bit widths) the call dequantizes the weight (from the tiles,
  for a prepacked one) into a float32 buffer and runs one BLAS matmul, on A quantized to
  int8 and back per block at ``accuracy_level`` 4 (the same result: the scales factor out
  of each block). The buffer takes 32/bits times the packed bytes (8x for 4-bit), so it is
  not kept: a 4-bit model stays near its packed size after a long prompt. Dequantizing
  runs at several GB/s, a small part of such a matmul.

The CPU provider's ``nbits_cache`` option (or ``ONNX_GENRT_NBITS_CACHE=1``) keeps the float32
copies instead, trading that memory for a little prompt time. The 4-bit row tiles
are kept either way (about the packed size; a decode step that tiled its weights on every call
would be many times slower).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import ml_dtypes
import numba
import numpy as np

from onnx_genrt.core.dtypes import is_float_dtype
from onnx_genrt.core.kernels import MS_DOMAIN, KernelContext
from onnx_genrt.core.op_rules import (
    NBITS,
    check_index_range,
    matmul_nbits_dims,
    matmul_nbits_int8_activations,
    matmul_nbits_unsupported,
    normalize_axis,
)

from ._int4_matmul import (
    Int4Tiles,
    dequantize_tiles,
    int4_matmul,
    no_zeros,
    pack_int4,
    tile_params,
    tile_weight,
    untile_params,
    untile_weight,
)
from ._int4_vnni import PANEL as VNNI_TILE_ROWS
from ._int4_vnni import int4_vnni_matmul, vnni_enabled, vnni_native
from ._int8_activations import ROWS as INT8_TILE_ROWS
from ._int8_activations import fake_quantize, int4_int8_matmul
from ._prompt_threads import split_matmul
from ._registry import REGISTRY
from ._weight_arena import arena_zeros

_F32 = np.dtype(np.float32)
_U8 = np.dtype(np.uint8)
_NBITS = NBITS
_SMALL_INTS = {np.dtype(ml_dtypes.int4), np.dtype(ml_dtypes.uint4)}
_T = TypeVar("_T")

# Rows of A up to which 4-bit weights are multiplied packed in one call; more use the float32
# copy, except on VNNI tiles. The integer kernel of accuracy_level 4 and the float one stay
# ahead of dequantizing + BLAS (split over the threads) to about 32 rows at one thread, the
# float one to 64 at two (docs/performance.md); the VNNI kernel is 2-3x ahead at 512 rows, so
# it takes any number of rows, 512 a call (its quantized copy of A stays small).
PACKED_MAX_M = 32
INT8_PACKED_MAX_M = 32
VNNI_PACKED_MAX_M = 512


def packed_max_m(int8: bool, vnni: bool = False) -> int:
    """Rows of A up to which a 4-bit weight is multiplied packed (int8 activations or not,
    on VNNI tiles or not)."""
    if not int8:
        return PACKED_MAX_M
    return VNNI_PACKED_MAX_M if vnni else INT8_PACKED_MAX_M


def packs_rows(m: int, int8: bool, vnni: bool = False) -> bool:
    """Whether ``m`` rows of A are multiplied packed (in calls of at most ``packed_max_m``
    rows): up to ``packed_max_m``, and any number on VNNI tiles at accuracy_level 4."""
    return m <= packed_max_m(int8, vnni) or (int8 and vnni)


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


@dataclass(frozen=True)
class TileLayout:
    """How a 4-bit weight's tiles are laid out for a kernel: ``rows`` per tile (None: the
    float kernel's default, ``tile_rows``) and whether in the VNNI layout."""

    rows: int | None = None
    vnni: bool = False

    def fits(self, tiles: np.ndarray) -> bool:
        """Whether prepacked ``tiles`` are in this layout (any width when ``rows`` is None)."""
        return (tiles.ndim == 4) == self.vnni and self.rows in (None, tiles.shape[2])


#: The layouts of the three packed kernels: float activations (``int4_matmul``), int8
#: activations with int16 multiplies (``int4_int8_matmul``), with VNNI (``int4_vnni_matmul``).
FLOAT_TILES = TileLayout()
INT8_TILES = TileLayout(INT8_TILE_ROWS)
VNNI_TILES = TileLayout(VNNI_TILE_ROWS, vnni=True)


def tile_layout(int8: bool, vnni_option: bool | None = None) -> TileLayout:
    """The tile layout of a node's packed kernel: int8 activations (accuracy_level 4) take
    the VNNI layout where ``vnni_enabled(vnni_option)``."""
    if not int8:
        return FLOAT_TILES
    return VNNI_TILES if vnni_enabled(vnni_option) else INT8_TILES


def _provider_vnni(provider: Any) -> bool | None:
    """The provider's ``int4_vnni`` option; None without a provider or such an option."""
    options = getattr(provider, "OPTIONS", ())
    return provider.option("int4_vnni") if any(o.name == "int4_vnni" for o in options) else None


def int4_tiles(
    b: np.ndarray,
    scales: np.ndarray,
    zp: np.ndarray | None,
    k: int,
    n: int,
    block: int,
    layout: TileLayout = FLOAT_TILES,
) -> Int4Tiles:
    """The 4-bit weight of a MatMulNBits node, tiled in ``layout``."""
    nb = -(-k // block)
    packed = np.ascontiguousarray(b, _U8).reshape(n, nb, block // 2)
    sc = np.ascontiguousarray(scales, _F32).reshape(n, nb)
    zeros = None if zp is None else _nbits_zeros(zp, n, nb, 4)
    return pack_int4(packed, sc, zeros, n, block, layout.rows, layout.vnni)


_nbits_check = matmul_nbits_unsupported

#: MatMulNBits inputs a 4-bit node's prepack rearranges: B, scales, zero points.
_INT4_ROLES = {1: "weight", 2: "scales", 3: "zero_points"}


@dataclass(frozen=True, eq=False)
class Int4Input:
    """A constant input of a 4-bit MatMulNBits in the layout its packed kernel reads: B as
    tiles (row tiles, or the VNNI layout at accuracy_level 4 on a VNNI CPU), scales or zero
    points (minus 8) as float32 (blocks, rows), or (n_tiles, blocks, rows) beside VNNI tiles;
    with the shape and dtype the input had, which placement and fusions still ask."""

    role: str
    packed: np.ndarray
    shape: tuple[int, ...]
    dtype: np.dtype
    n: int

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def plain(self) -> np.ndarray:
        """The input in its own layout again (zero points as float32 values)."""
        if self.role == "weight":
            return untile_weight(self.packed, self.n).reshape(self.shape)
        values = untile_params(self.packed, self.n)
        return values.astype(self.dtype) if self.role == "scales" else values + np.float32(8)


def prepack_int4(provider, node, index: int, host: np.ndarray) -> Int4Input | None:
    """B, scales and zero points of a 4-bit node in the tiles' layout, held in the provider's
    weight arena (huge pages); None for other inputs and bit widths, a ``g_idx``, or shapes
    that do not fit K, N and the block (the kernel then reports them)."""
    role = _INT4_ROLES.get(index)
    g_idx = len(node.input_names) > 4 and node.input_names[4]
    if role is None or g_idx or _nbits_check(node, ()) or int(node.attr("bits", 4)) != 4:
        return None
    host = np.asarray(host)
    k, n, block = int(node.attr("K")), int(node.attr("N")), int(node.attr("block_size"))
    nb = -(-k // block)
    if host.size == 0 or n <= 0:
        return None
    layout = _prepack_layout(provider, node)
    rows, vnni, zeros = layout.rows, layout.vnni, arena_zeros(provider)
    try:
        if role == "weight":
            w = np.ascontiguousarray(host, _U8).reshape(n, nb, block // 2)
            packed = tile_weight(w, n, rows, vnni, zeros)
        elif role == "scales":
            values = np.ascontiguousarray(host, _F32).reshape(n, nb)
            packed = tile_params(values, n, rows, vnni, zeros)
        else:
            values = _nbits_zeros(host, n, nb, 4) - np.float32(8)
            packed = tile_params(values, n, rows, vnni, zeros)
    except ValueError:  # sizes that do not fit
        return None
    return Int4Input(role, packed, tuple(host.shape), host.dtype, n)


def _prepack_layout(provider: Any, node: Any) -> TileLayout:
    """The tile layout of a node's prepacked inputs: the int8-activation kernel's at
    accuracy_level 4 (uint8 zero points assumed: float ones take the float kernel, which
    retiles a VNNI weight once), else the float kernel's."""
    int8 = matmul_nbits_int8_activations(node, np.dtype(_U8))
    return tile_layout(int8, _provider_vnni(provider))


def _plain(value: Any) -> Any:
    return value.plain() if isinstance(value, Int4Input) else value


def _all_packed(b: Any, scales: Any, zp: Any) -> bool:
    """Whether the weight's inputs all arrived prepacked (the usual case: all constants)."""
    return all(isinstance(v, Int4Input) for v in (b, scales, zp) if v is not None)


def _prepacked(
    b: Int4Input, scales: Int4Input, zp: Int4Input | None, n: int, block: int
) -> Int4Tiles:
    """The tiles of a weight whose inputs all arrived prepacked, as they are."""
    zeros = no_zeros(b.packed.ndim == 4) if zp is None else zp.packed
    return Int4Tiles(b.packed, scales.packed, zeros, n, block)


def _int4_weight(
    b: Any, scales: Any, zp: Any, k: int, n: int, block: int, layout: TileLayout = FLOAT_TILES
) -> Int4Tiles:
    """The tiles of a 4-bit weight in ``layout``: its prepacked inputs as they are when
    they are in it, else tiled once per set of source arrays (``DequantCache``)."""
    if _all_packed(b, scales, zp) and layout.fits(b.packed):
        return _prepacked(b, scales, zp, n, block)
    return DEQUANT_CACHE.get(
        (b, scales, zp),
        ("int4-tiles", k, n, block, layout),
        lambda: int4_tiles(_plain(b), _plain(scales), _plain(zp), k, n, block, layout),
    )


def _int8_kernel(w4: Int4Tiles) -> Callable[..., np.ndarray]:
    """The int8-activation kernel for the tiles' layout."""
    return int4_vnni_matmul if w4.vnni else int4_int8_matmul


def _float_weight(
    ctx: KernelContext, b: Any, scales: Any, zp: Any, params: tuple[int, int, int, int]
) -> np.ndarray:
    """The float32 weight as (K, N) (a transposed view of the (N, K) dequantized from the
    packed bytes; made so from the tiles of a prepacked one); kept only with the
    ``nbits_cache`` option."""
    k, n, bits, block = params

    def build() -> np.ndarray:
        if _all_packed(b, scales, zp):
            return dequantize_tiles(_prepacked(b, scales, zp, n, block), k)
        return dequantize_nbits(_plain(b), _plain(scales), _plain(zp), k, n, bits, block).T

    return DEQUANT_CACHE.get((b, scales, zp), params, build, keep=ctx.option("nbits_cache", False))


def _bind_matmul_nbits(ctx: KernelContext, inputs: Any, out: Any) -> Callable[[], Any] | None:
    """Replay closure for the decode-sized case (prepacked 4-bit weight, at most
    ``packed_max_m`` contiguous float32 rows, no bias): the packed kernel on prebuilt views,
    without the node's checks and dispatch on every replay; None for the other cases."""
    a, b, scales, zero_points, g_idx, bias = (*inputs, None, None, None, None)[:6]
    if bias is not None or g_idx is not None or not isinstance(out, np.ndarray):
        return None
    if not _all_packed(b, scales, zero_points) or not isinstance(b, Int4Input):
        return None
    dims = matmul_nbits_dims(ctx.node, a.shape[-1], False)
    k, n = dims.k, dims.n
    if dims.bits != 4 or a.dtype != _F32 or out.dtype != _F32 or b.size == 0 or not k:
        return None
    if not (a.flags.c_contiguous and out.flags.c_contiguous) or out.size != a.size // k * n:
        return None
    m = a.size // k
    zp_dtype = None if zero_points is None else zero_points.dtype
    int8 = matmul_nbits_int8_activations(ctx.node, zp_dtype)
    layout = tile_layout(int8, ctx.option("int4_vnni"))
    if not 0 < m <= packed_max_m(int8, layout.vnni):
        return None
    w4 = _int4_weight(b, scales, zero_points, k, n, dims.block, layout)
    kernel = _int8_kernel(w4) if int8 else int4_matmul
    x2, y2 = a.reshape(m, k), out.reshape(m, n)
    call = functools.partial(kernel, x2, w4, y2)
    if kernel is int4_vnni_matmul:
        call.native = vnni_native(x2, w4, y2, call)  # type: ignore[attr-defined]
    return call


@REGISTRY.register(
    "MatMulNBits",
    since=1,
    domain=MS_DOMAIN,
    check=_nbits_check,
    prepack=prepack_int4,
    bind=_bind_matmul_nbits,
)
def matmul_nbits(
    ctx: KernelContext,
    a: np.ndarray,
    b: np.ndarray | Int4Input,
    scales: np.ndarray | Int4Input,
    zero_points: np.ndarray | Int4Input | None = None,
    g_idx: np.ndarray | None = None,
    bias: np.ndarray | None = None,
) -> np.ndarray:
    """Y = A @ dequant(B)^T (+ bias), with A quantized to int8 per block where
    ``matmul_nbits_int8_activations`` says onnxruntime does (accuracy_level 4), in float32
    otherwise.

    4-bit weights with rows of A that ``packs_rows`` takes are multiplied packed; other
    calls dequantize the weight to float32 first (kept only with the ``nbits_cache`` option).
    """
    dims = matmul_nbits_dims(ctx.node, a.shape[-1], g_idx is not None)
    k, n, bits, block = dims.k, dims.n, dims.bits, dims.block
    out = ctx.out(0, (*a.shape[:-1], n), a.dtype)
    out2 = out.reshape(-1, n)
    if b.size == 0:  # an omitted projection: zeros (+ bias)
        out2[...] = 0 if bias is None else bias
        return out
    a2 = a.reshape(-1, k)
    zp_dtype = None if zero_points is None else zero_points.dtype
    int8 = matmul_nbits_int8_activations(ctx.node, zp_dtype)
    layout = tile_layout(int8, ctx.option("int4_vnni"))
    direct = a.dtype == _F32 and out2.flags.c_contiguous and bias is None
    y = out2 if direct else np.empty(out2.shape, _F32)
    if bits == 4 and packs_rows(a2.shape[0], int8, layout.vnni):
        w4 = _int4_weight(b, scales, zero_points, k, n, block, layout)
        x = np.ascontiguousarray(a2, _F32)
        kernel = _int8_kernel(w4) if int8 else int4_matmul
        rows = packed_max_m(int8, layout.vnni)
        for r0 in range(0, x.shape[0], rows):
            kernel(x[r0 : r0 + rows], w4, y[r0 : r0 + rows])
    else:
        w = _float_weight(ctx, b, scales, zero_points, (k, n, bits, block))
        x = fake_quantize(a2, block) if int8 else a2.astype(_F32, copy=False)
        split_matmul(x, w, y)
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
