"""CPU kernels: Conv (im2col through strided windows + einsum), DeformConv (bilinear taps +
einsum), ConvTranspose (one einsum per kernel tap, scattered into the output) and global
pooling."""

from __future__ import annotations

import math

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from onnx_genrt.core.kernels import KernelContext
from onnx_genrt.core.op_rules import conv_transpose_attribute_problem, conv_transpose_geometry

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


def _crop(y: np.ndarray, pads: tuple[tuple[int, int], ...]) -> np.ndarray:
    """Remove (begin, end) from each spatial axis of ``y``; negative amounts add zeros."""
    grow = [(0, 0), (0, 0), *((max(0, -b), max(0, -e)) for b, e in pads)]
    if any(g != (0, 0) for g in grow):
        y = np.pad(y, grow)
    cut = tuple(slice(max(0, b), y.shape[2 + i] - max(0, e)) for i, (b, e) in enumerate(pads))
    return y[(slice(None), slice(None), *cut)]


@REGISTRY.register("ConvTranspose", since=1, check=conv_transpose_attribute_problem)
def conv_transpose_kernel(
    ctx: KernelContext, x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None
) -> np.ndarray:
    """N-D grouped, strided, dilated transposed convolution (the gradient of Conv)."""
    nsp = x.ndim - 2
    if nsp < 1 or w.ndim != x.ndim:
        raise ValueError(f"{ctx.node.describe()}: bad shapes X {x.shape}, W {w.shape}")
    group = int(ctx.attr("group", 1))
    n, c = x.shape[:2]
    if c % group or w.shape[0] != c:
        raise ValueError(
            f"{ctx.node.describe()}: W {list(w.shape)} needs {c} input channels divisible by "
            f"group {group}"
        )
    kshape = w.shape[2:]
    cg, mg = c // group, w.shape[1]
    m = mg * group
    if b is not None and b.shape != (m,):
        raise ValueError(f"{ctx.node.describe()}: B has shape {list(b.shape)}, expected [{m}]")
    geom = conv_transpose_geometry(ctx.node, x.shape[2:], kshape)
    cdt = compute_dtype(x.dtype)
    xg = x.astype(cdt, copy=False).reshape(n, group, cg, *x.shape[2:])
    wg = w.astype(cdt, copy=False).reshape(group, cg, mg, *kshape)
    full = np.zeros((n, group, mg, *geom.full), cdt)
    o = _LETTERS[:nsp]
    eq = f"NGC{o},GCM->NGM{o}"
    for tap in np.ndindex(*kshape):
        start = [k * d for k, d in zip(tap, geom.dilations, strict=True)]
        dest = tuple(
            slice(s0, s0 + s * (size - 1) + 1, s)
            for s0, s, size in zip(start, geom.strides, x.shape[2:], strict=True)
        )
        full[(slice(None), slice(None), slice(None), *dest)] += np.einsum(
            eq, xg, wg[(slice(None), slice(None), slice(None), *tap)]
        )
    y = _crop(full.reshape(n, m, *geom.full), geom.pads)
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


def _bilinear_taps(img: np.ndarray, hs: np.ndarray, ws: np.ndarray) -> np.ndarray:
    """Bilinear samples of ``img`` [N, G, Cg, H, W] at positions hs, ws [N, G, ...]
    (zero outside the image, corner by corner) -> [N, G, Cg, ...]."""
    n, g, _, height, width = img.shape
    h0, w0 = np.floor(hs), np.floor(ws)
    out = 0.0
    lead = np.ix_(np.arange(n), np.arange(g))
    for dh in (0, 1):
        for dw in (0, 1):
            hi, wi = h0 + dh, w0 + dw
            weight = (1 - np.abs(hs - hi)) * (1 - np.abs(ws - wi))
            inside = (hi >= 0) & (hi < height) & (wi >= 0) & (wi < width)
            hc = np.clip(hi, 0, height - 1).astype(np.int64)
            wc = np.clip(wi, 0, width - 1).astype(np.int64)
            extra = (1,) * (hs.ndim - 2)
            nidx = lead[0].reshape(n, 1, *extra)
            gidx = lead[1].reshape(1, g, *extra)
            vals = img[nidx, gidx, :, hc, wc]  # [N, G, ..., Cg]
            out = out + np.moveaxis(vals, -1, 2) * np.where(inside, weight, 0.0)[:, :, None]
    return out


@REGISTRY.register("DeformConv", since=19)
def deform_conv_kernel(
    ctx: KernelContext,
    x: np.ndarray,
    w: np.ndarray,
    offset: np.ndarray,
    b: np.ndarray | None = None,
    mask: np.ndarray | None = None,
) -> np.ndarray:
    """2-D deformable convolution: each kernel tap samples X (bilinearly) at its regular
    position plus a learned offset, optionally scaled by a mask, then a grouped Conv sum."""
    if x.ndim != 4 or w.ndim != 4:
        raise ValueError(f"{ctx.node.describe()}: DeformConv takes 2-D images X [N, C, H, W]")
    n, c, height, width = x.shape
    m, cg, kh, kw = w.shape
    group, off_groups = int(ctx.attr("group", 1)), int(ctx.attr("offset_group", 1))
    if c % group or m % group or cg != c // group or c % off_groups:
        raise ValueError(
            f"{ctx.node.describe()}: channels {c}/{m} do not fit group {group} and "
            f"offset_group {off_groups}"
        )
    sh, sw = list(ctx.attr("strides", [1, 1]))
    dh, dw = list(ctx.attr("dilations", [1, 1]))
    pt, pl, pb, pr = list(ctx.attr("pads", [0, 0, 0, 0]))
    out_h = (height + pt + pb - (dh * (kh - 1) + 1)) // sh + 1
    out_w = (width + pl + pr - (dw * (kw - 1) + 1)) // sw + 1
    taps = kh * kw
    if offset.shape != (n, off_groups * 2 * taps, out_h, out_w):
        raise ValueError(
            f"{ctx.node.describe()}: offset {list(offset.shape)} must be "
            f"[{n}, {off_groups * 2 * taps}, {out_h}, {out_w}]"
        )
    if mask is not None and mask.shape != (n, off_groups * taps, out_h, out_w):
        raise ValueError(
            f"{ctx.node.describe()}: mask {list(mask.shape)} must be "
            f"[{n}, {off_groups * taps}, {out_h}, {out_w}]"
        )
    cdt = compute_dtype(x.dtype)
    off = offset.astype(cdt).reshape(n, off_groups, taps, 2, out_h, out_w)
    ki, kj = np.divmod(np.arange(taps), kw)
    base_h = (np.arange(out_h) * sh - pt)[None, :, None] + (ki * dh)[:, None, None]
    base_w = (np.arange(out_w) * sw - pl)[None, None, :] + (kj * dw)[:, None, None]
    hs = base_h[None, None] + off[:, :, :, 0]  # [N, Go, K, oH, oW]
    ws = base_w[None, None] + off[:, :, :, 1]
    img = x.astype(cdt).reshape(n, off_groups, c // off_groups, height, width)
    cols = _bilinear_taps(img, hs, ws)  # [N, Go, C/Go, K, oH, oW]
    if mask is not None:
        cols = cols * mask.astype(cdt).reshape(n, off_groups, 1, taps, out_h, out_w)
    cols = cols.reshape(n, group, cg, taps, out_h, out_w)
    wg = w.astype(cdt).reshape(group, m // group, cg, taps)
    y = np.einsum("ngckhw,gmck->ngmhw", cols, wg, optimize=True).reshape(n, m, out_h, out_w)
    if b is not None:
        y = y + b.astype(cdt).reshape(1, m, 1, 1)
    return np.ascontiguousarray(y, dtype=x.dtype)
