"""CPU kernels: AffineGrid and GridSample (N-D; nearest, linear and cubic sampling with
zeros, border and reflection padding), vectorized numpy in float64."""

from __future__ import annotations

import itertools

import numpy as np

from onnx_genrt.core.kernels import KernelContext, NodeInfo

from ._registry import REGISTRY

Array = np.ndarray
#: Cubic convolution coefficient (the value PyTorch, onnxruntime and ONNX use).
CUBIC_A = -0.75
_MODES = {"bilinear": "linear", "bicubic": "cubic", "linear": "linear", "cubic": "cubic",
          "nearest": "nearest"}  # fmt: skip


def _normalized_coords(length: int, align_corners: bool) -> Array:
    """Normalized [-1, 1] positions of ``length`` samples (pixel centres or corners)."""
    if align_corners:
        return np.linspace(-1.0, 1.0, length) if length > 1 else np.zeros(length)
    return (2.0 * np.arange(length) + 1.0) / length - 1.0


@REGISTRY.register("AffineGrid", since=20)
def affine_grid(ctx: KernelContext, theta: Array, size: Array) -> Array:
    """Sampling grid [N, *spatial, nd] of theta [N, nd, nd + 1] applied to the normalized
    coordinates (x first) of an output of ``size`` [N, C, *spatial]."""
    dims = [int(v) for v in size.reshape(-1)]
    nd = len(dims) - 2
    if nd not in (2, 3) or theta.shape != (dims[0], nd, nd + 1):
        raise ValueError(
            f"{ctx.node.describe()}: theta {list(theta.shape)} must be [N, {nd}, {nd + 1}] for "
            f"size {dims} (2-D or 3-D)"
        )
    align = bool(ctx.attr("align_corners", 0))
    axes = [_normalized_coords(n, align) for n in dims[2:]]
    mesh = np.meshgrid(*axes, indexing="ij")  # spatial order (z), y, x
    base = np.stack([*reversed(mesh), np.ones_like(mesh[0])], axis=-1)
    grid = np.einsum("...k,nik->n...i", base, theta.astype(np.float64))
    return grid.astype(theta.dtype)


def _grid_sample_check(node: NodeInfo, _types: object = ()) -> str | None:
    mode = node.attr("mode", "bilinear" if node.opset < 20 else "linear")
    if mode not in _MODES:
        return f"GridSample mode={mode!r} is not one of {', '.join(_MODES)}"
    padding = node.attr("padding_mode", "zeros")
    if padding not in ("zeros", "border", "reflection"):
        return f"GridSample padding_mode={padding!r} is not zeros, border or reflection"
    return None


def _reflect(pos: Array, low2: float, high2: float) -> Array:
    """Fold ``pos`` back into [low2 / 2, high2 / 2] by mirroring at both ends."""
    if low2 == high2:
        return np.zeros_like(pos)
    lo, span = low2 / 2.0, (high2 - low2) / 2.0
    dist = np.abs(pos - lo)
    flips = np.floor(dist / span)
    extra = np.fmod(dist, span)
    return np.where(flips % 2 == 0, lo + extra, lo + span - extra)


def _pad_coordinate(pos: Array, length: int, padding: str, align: bool) -> Array:
    if padding == "border":
        return np.clip(pos, 0, length - 1)
    if padding == "reflection":
        low2, high2 = (0.0, 2.0 * (length - 1)) if align else (-1.0, 2.0 * length - 1)
        return np.clip(_reflect(pos, low2, high2), 0, length - 1)
    return pos


def _cubic_weights(t: Array) -> list[Array]:
    a = CUBIC_A

    def near(d: Array) -> Array:
        return ((a + 2) * d - (a + 3)) * d * d + 1

    def far(d: Array) -> Array:
        return ((a * d - 5 * a) * d + 8 * a) * d - 4 * a

    return [far(t + 1), near(t), near(1 - t), far(2 - t)]


def _taps(
    pos: Array, length: int, mode: str, padding: str, align: bool
) -> list[tuple[Array, Array]]:
    """(index, weight) per tap along one axis; weight 0 where a tap falls outside."""
    if mode == "cubic":  # padding applies to each tap, not to the coordinate
        base = np.floor(pos)
        taps = []
        for k, w in zip(range(-1, 3), _cubic_weights(pos - base), strict=True):
            idx = base + k
            if padding != "zeros":
                idx = _pad_coordinate(idx, length, padding, align)
            taps.append((idx, w))
    else:
        pos = _pad_coordinate(pos, length, padding, align)
        if mode == "nearest":
            taps = [(np.rint(pos), np.ones_like(pos))]
        else:
            base = np.floor(pos)
            frac = pos - base
            taps = [(base, 1.0 - frac), (base + 1, frac)]
    out = []
    for idx, w in taps:
        inside = (idx >= 0) & (idx <= length - 1)
        out.append((np.clip(idx, 0, length - 1).astype(np.int64), np.where(inside, w, 0.0)))
    return out


@REGISTRY.register("GridSample", since=16, check=_grid_sample_check)
def grid_sample(ctx: KernelContext, x: Array, grid: Array) -> Array:
    """Sample X [N, C, *in] at grid [N, *out, nd] (normalized (x, y[, z]) in [-1, 1])."""
    nd = x.ndim - 2
    if nd < 1 or grid.ndim != nd + 2 or grid.shape[-1] != nd or grid.shape[0] != x.shape[0]:
        raise ValueError(
            f"{ctx.node.describe()}: grid {list(grid.shape)} must be [N, *out, {nd}] for X "
            f"{list(x.shape)}"
        )
    mode = _MODES[ctx.attr("mode", "bilinear" if ctx.opset < 20 else "linear")]
    padding = ctx.attr("padding_mode", "zeros")
    align = bool(ctx.attr("align_corners", 0))
    g = grid.astype(np.float64)
    per_axis = []
    for d, length in enumerate(x.shape[2:]):
        norm = g[..., nd - 1 - d]
        pos = (norm + 1) / 2 * (length - 1) if align else ((norm + 1) * length - 1) / 2
        per_axis.append(_taps(pos, length, mode, padding, align))
    xt = np.moveaxis(x.astype(np.float64), 1, -1)  # [N, *in, C]
    batch = np.arange(x.shape[0]).reshape((-1,) + (1,) * nd)
    y = np.zeros((*grid.shape[:-1], x.shape[1]))
    for combo in itertools.product(*per_axis):
        weight = np.prod([w for _, w in combo], axis=0)
        y += xt[(batch, *(idx for idx, _ in combo))] * weight[..., None]
    return np.ascontiguousarray(np.moveaxis(y, -1, 1), dtype=x.dtype)
