"""CPU kernels: Conv (im2col through strided windows + einsum) and global pooling."""

from __future__ import annotations

import math

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ._nn_common import compute_dtype
from ._registry import REGISTRY

_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _pads(ctx, in_sp: tuple[int, ...], ext: list[int], strides: list[int]) -> list[tuple[int, int]]:
    """(begin, end) padding per spatial axis from ``pads`` or ``auto_pad``."""
    n = len(in_sp)
    auto = str(ctx.attr("auto_pad", "NOTSET"))
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        pads = []
        for size, e, s in zip(in_sp, ext, strides, strict=True):
            total = max(0, (math.ceil(size / s) - 1) * s + e - size)
            small = total // 2
            pads.append((small, total - small) if auto == "SAME_UPPER" else (total - small, small))
        return pads
    if auto == "VALID":
        return [(0, 0)] * n
    if auto != "NOTSET":
        raise NotImplementedError(f"{ctx.node.describe()}: auto_pad {auto!r}")
    flat = list(ctx.attr("pads", [0] * (2 * n)))
    return list(zip(flat[:n], flat[n:], strict=True))


@REGISTRY.register("Conv", since=1)
def conv_kernel(ctx, x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None) -> np.ndarray:
    """N-D grouped, strided, dilated, padded convolution (cross-correlation)."""
    nsp = x.ndim - 2
    if nsp < 1 or w.ndim != x.ndim:
        raise ValueError(f"{ctx.node.describe()}: bad shapes X {x.shape}, W {w.shape}")
    group = int(ctx.attr("group", 1))
    strides = list(ctx.attr("strides", [1] * nsp))
    dils = list(ctx.attr("dilations", [1] * nsp))
    kshape = w.shape[2:]
    ext = [d * (k - 1) + 1 for k, d in zip(kshape, dils, strict=True)]
    n, c = x.shape[:2]
    m = w.shape[0]
    if c % group or m % group or w.shape[1] != c // group:
        raise ValueError(f"{ctx.node.describe()}: channels {c}/{m} do not fit group {group}")
    cdt = compute_dtype(x.dtype)
    pads = _pads(ctx, x.shape[2:], ext, strides)
    xp = np.pad(x.astype(cdt, copy=False), [(0, 0), (0, 0), *pads])
    win = sliding_window_view(xp, ext, axis=tuple(range(2, x.ndim)))
    step = (slice(None), slice(None))
    win = win[
        (*step, *(slice(None, None, s) for s in strides), *(slice(None, None, d) for d in dils))
    ]
    out_sp = win.shape[2 : 2 + nsp]
    cg, mg = c // group, m // group
    win = win.reshape(n, group, cg, *out_sp, *kshape)
    wg = w.astype(cdt, copy=False).reshape(group, mg, cg, *kshape)
    o = _LETTERS[:nsp]
    k = _LETTERS[nsp : 2 * nsp]
    eq = f"NGC{o}{k},GMC{k}->NGM{o}"
    y = np.einsum(eq, win, wg, optimize=True).reshape(n, m, *out_sp)
    if b is not None:
        y = y + b.astype(cdt).reshape((1, m) + (1,) * nsp)
    return np.ascontiguousarray(y, dtype=x.dtype)


@REGISTRY.register("GlobalAveragePool", since=1)
def global_average_pool_kernel(ctx, x: np.ndarray) -> np.ndarray:
    """Mean over all spatial axes, kept as size-1 dims."""
    axes = tuple(range(2, x.ndim))
    return x.astype(compute_dtype(x.dtype)).mean(axis=axes, keepdims=True).astype(x.dtype)


@REGISTRY.register("GlobalMaxPool", since=1)
def global_max_pool_kernel(ctx, x: np.ndarray) -> np.ndarray:
    """Max over all spatial axes, kept as size-1 dims."""
    return np.asarray(x.max(axis=tuple(range(2, x.ndim)), keepdims=True))
