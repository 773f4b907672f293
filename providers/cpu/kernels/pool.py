"""CPU kernels: MaxPool, AveragePool and LpPool over 1-D to 3-D (any rank) windows.

Each input is padded once, viewed as strided windows (``sliding_window_view``, no copy) and
reduced over the window axes with numpy. The window geometry (pads, auto_pad, ceil_mode,
output shape) comes from :func:`onnx_genrt.core.op_rules.pool_geometry`.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from onnx_genrt.core.kernels import KernelContext
from onnx_genrt.core.op_rules import PoolGeometry, pool_attribute_problem, pool_geometry

from ._nn_common import compute_dtype, output_count
from ._registry import REGISTRY

Array = np.ndarray


def _geometry(ctx: KernelContext, x: Array) -> PoolGeometry:
    if x.ndim < 3:
        raise ValueError(
            f"{ctx.node.describe()}: input X has shape {list(x.shape)}; pooling needs "
            f"[N, C, spatial...] with at least one spatial axis"
        )
    return pool_geometry(ctx.node, x.shape[2:])


def _padded(x: Array, geom: PoolGeometry, fill: float | int) -> Array:
    """``x`` padded by the op's pads plus the ceil_mode extension, filled with ``fill``."""
    widths = [(0, 0), (0, 0)]
    widths += [(b, e + x_) for (b, e), x_ in zip(geom.pads, geom.extra_end, strict=True)]
    return np.pad(x, widths, constant_values=fill)


def _windows(xp: Array, geom: PoolGeometry) -> Array:
    """View of shape [N, C, *out, *kernel]: the (dilated, strided) windows of padded ``xp``."""
    nsp = len(geom.kernel)
    win = sliding_window_view(xp, geom.extents, axis=tuple(range(2, 2 + nsp)))
    outs = tuple(slice(0, o * s, s) for o, s in zip(geom.out_shape, geom.strides, strict=True))
    taps = tuple(slice(None, None, d) for d in geom.dilations)
    return win[(slice(None), slice(None), *outs, *taps)]


def _window_axes(geom: PoolGeometry) -> tuple[int, ...]:
    nsp = len(geom.kernel)
    return tuple(range(2 + nsp, 2 + 2 * nsp))


def _lowest(dtype: np.dtype) -> float | int:
    if dtype.kind in "iu":
        return int(np.iinfo(dtype).min)
    return -np.inf


def _max_indices(ctx: KernelContext, x: Array, win: Array, geom: PoolGeometry) -> Array:
    """MaxPool's Indices: flat positions of each maximum in X (spatial part column-major
    when storage_order=1), first maximum in window order on ties."""
    nsp = len(geom.kernel)
    n, c = x.shape[:2]
    flat = win.reshape(*win.shape[: 2 + nsp], math.prod(geom.kernel))
    tap = np.argmax(flat, axis=-1)
    taps = np.unravel_index(tap, geom.kernel)
    coords = []
    for i in range(nsp):
        o = np.arange(geom.out_shape[i]).reshape(
            (1, 1) + tuple(-1 if j == i else 1 for j in range(nsp))
        )
        coords.append(o * geom.strides[i] + taps[i] * geom.dilations[i] - geom.pads[i][0])
    order = "F" if int(ctx.attr("storage_order", 0)) else "C"
    spatial = np.ravel_multi_index(tuple(coords), x.shape[2:], order=order)
    channel = np.arange(n * c, dtype=np.int64).reshape(n, c, *(1,) * nsp)
    return (channel * math.prod(x.shape[2:]) + spatial).astype(np.int64)


@REGISTRY.register("MaxPool", since=1, check=pool_attribute_problem)
def max_pool(ctx: KernelContext, x: Array) -> Array | tuple[Array, Array]:
    """Max over each window; padding never wins. Optional second output: Indices."""
    geom = _geometry(ctx, x)
    win = _windows(_padded(x, geom, _lowest(x.dtype)), geom)
    y = np.ascontiguousarray(win.max(axis=_window_axes(geom)), dtype=x.dtype)
    if output_count(ctx) < 2 or not ctx.node.output_names[1]:
        return y
    return y, _max_indices(ctx, x, win, geom)


@REGISTRY.register("AveragePool", since=1, check=pool_attribute_problem)
def average_pool(ctx: KernelContext, x: Array) -> Array:
    """Mean over each window. The divisor counts the pads when count_include_pad=1, never
    the ceil_mode extension past them."""
    geom = _geometry(ctx, x)
    cdt = compute_dtype(x.dtype)
    axes = _window_axes(geom)
    sums = _windows(_padded(x.astype(cdt, copy=False), geom, 0), geom).sum(axis=axes)
    include_pad = bool(ctx.attr("count_include_pad", 0))
    mask = np.zeros((1, 1, *x.shape[2:]), cdt)
    mask[...] = 1
    widths = [(0, 0), (0, 0), *geom.pads]
    mask = np.pad(mask, widths, constant_values=1 if include_pad else 0)
    mask = np.pad(mask, [(0, 0), (0, 0), *((0, e) for e in geom.extra_end)])
    counts = _windows(mask, geom).sum(axis=axes)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.ascontiguousarray(sums / counts, dtype=x.dtype)


@REGISTRY.register("LpPool", since=1, check=pool_attribute_problem)
def lp_pool(ctx: KernelContext, x: Array) -> Array:
    """(sum |x|^p)^(1/p) over each window; padding counts as zeros."""
    geom = _geometry(ctx, x)
    p = float(ctx.attr("p", 2))
    cdt = compute_dtype(x.dtype)
    powered = np.abs(x.astype(cdt, copy=False)) ** p
    sums = _windows(_padded(powered, geom, 0), geom).sum(axis=_window_axes(geom))
    return np.ascontiguousarray(sums ** (1.0 / p), dtype=x.dtype)


@REGISTRY.register("MaxUnpool", since=9)
def max_unpool(
    ctx: KernelContext, x: Array, indices: Array, output_shape: Array | None = None
) -> Array:
    """Scatter X to the positions in ``indices`` (MaxPool's Indices, flat in MaxPool's input
    shape, found from kernel, strides and pads) of a zero tensor of that shape, or of
    ``output_shape`` when given (the positions keep their coordinates)."""
    nsp = x.ndim - 2
    if indices.shape != x.shape or nsp < 1:
        raise ValueError(
            f"{ctx.node.describe()}: I {list(indices.shape)} must have X's shape "
            f"{list(x.shape)} (rank >= 3)"
        )
    kernel = [int(k) for k in ctx.attr("kernel_shape", ())]
    strides = list(ctx.attr("strides", [1] * nsp))
    pads = list(ctx.attr("pads", [0] * (2 * nsp)))
    if len(kernel) != nsp or len(strides) != nsp or len(pads) != 2 * nsp:
        raise ValueError(
            f"{ctx.node.describe()}: kernel_shape, strides and pads need {nsp} spatial axes"
        )
    spatial = [
        (size - 1) * s - pads[i] - pads[nsp + i] + k
        for i, (size, s, k) in enumerate(zip(x.shape[2:], strides, kernel, strict=True))
    ]
    shape = (*x.shape[:2], *spatial)
    flat = indices.astype(np.int64).reshape(-1)
    if flat.size and (flat.min() < 0 or flat.max() >= math.prod(shape)):
        raise ValueError(
            f"{ctx.node.describe()}: indices reach {int(flat.max())}, outside MaxPool's input "
            f"of shape {list(shape)}"
        )
    if output_shape is not None:
        wanted = tuple(int(v) for v in output_shape.reshape(-1))
        if len(wanted) != x.ndim or any(w < s for w, s in zip(wanted, shape, strict=True)):
            raise ValueError(
                f"{ctx.node.describe()}: output_shape {list(wanted)} is smaller than MaxPool's "
                f"input shape {list(shape)}"
            )
        flat = np.ravel_multi_index(np.unravel_index(flat, shape), wanted)
        shape = wanted
    y = np.zeros(math.prod(shape), x.dtype)
    y[flat] = x.reshape(-1)
    return y.reshape(shape)
