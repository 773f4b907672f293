"""CPU kernels: small classic ONNX ops on whole tensors (numpy): BitCast, Hardmax,
LpNormalization, Shrink, SwiGLU, Det, LRN, MeanVarianceNormalization, TensorScatter,
the spectral windows, and ai.onnx.ml Binarizer / ArrayFeatureExtractor."""

from __future__ import annotations

import math

import numpy as np

from onnx_genrt.core.dtypes import numpy_dtype_of_onnx
from onnx_genrt.core.kernels import KernelContext, NodeInfo
from onnx_genrt.core.op_rules import normalize_axis

from ._nn_common import compute_dtype
from ._registry import REGISTRY

Array = np.ndarray


def _axis(ctx: KernelContext, x: Array, default: int) -> int:
    try:
        return normalize_axis(int(ctx.attr("axis", default)), x.ndim, ctx.node)
    except ValueError as exc:
        raise ValueError(f"{ctx.node.describe()}: {exc}") from None


@REGISTRY.register("BitCast", since=26)
def bit_cast(ctx: KernelContext, x: Array) -> Array:
    """Reinterpret the bits of each element as the ``to`` type (same bit width)."""
    target = numpy_dtype_of_onnx(int(ctx.attr("to")))
    if target.itemsize != x.dtype.itemsize:
        raise ValueError(
            f"{ctx.node.describe()}: cannot reinterpret {x.dtype} ({x.dtype.itemsize * 8} bits) "
            f"as {target} ({target.itemsize * 8} bits); BitCast needs equal widths"
        )
    return np.array(x, order="C").view(target)


@REGISTRY.register("Hardmax", since=1)
def hardmax(ctx: KernelContext, x: Array) -> Array:
    """1 at the first maximum along ``axis`` (opset 13+), or of each row of the input
    flattened to 2-D at ``axis`` (before 13), 0 elsewhere."""
    if ctx.opset >= 13:
        axis = _axis(ctx, x, -1)
        rows = np.moveaxis(x, axis, -1)
    else:
        axis = _axis(ctx, x, 1)
        rows = x.reshape(math.prod(x.shape[:axis]), -1)
    hit = np.argmax(rows, axis=-1)[..., None]
    out = np.zeros(rows.shape, x.dtype)
    np.put_along_axis(out, hit, 1, axis=-1)
    if ctx.opset >= 13:
        return np.ascontiguousarray(np.moveaxis(out, -1, axis))
    return out.reshape(x.shape)


@REGISTRY.register("LpNormalization", since=1)
def lp_normalization(ctx: KernelContext, x: Array) -> Array:
    """x / ||x||_p along ``axis`` (p 1 or 2); a zero norm gives zeros."""
    p = int(ctx.attr("p", 2))
    if p not in (1, 2):
        raise ValueError(f"{ctx.node.describe()}: p={p}; LpNormalization takes p 1 or 2")
    axis = _axis(ctx, x, -1)
    xf = x.astype(np.float64)
    norm = np.linalg.norm(xf, ord=p, axis=axis, keepdims=True) if xf.size else xf
    with np.errstate(invalid="ignore", divide="ignore"):
        y = np.where(norm == 0, 0.0, xf / norm)
    return y.astype(x.dtype)


@REGISTRY.register("Shrink", since=9)
def shrink(ctx: KernelContext, x: Array) -> Array:
    """x - bias above lambd, x + bias below -lambd, 0 between."""
    lambd = float(ctx.attr("lambd", 0.5))
    bias = float(ctx.attr("bias", 0.0))
    xf = x.astype(np.float64)
    y = np.where(xf < -lambd, xf + bias, np.where(xf > lambd, xf - bias, 0.0))
    return y.astype(x.dtype)


@REGISTRY.register("SwiGLU", since=28)
def swiglu(ctx: KernelContext, a: Array, b: Array) -> Array:
    """a * sigmoid(alpha * a) * b, inputs of one shape."""
    if a.shape != b.shape:
        raise ValueError(
            f"{ctx.node.describe()}: A {list(a.shape)} and B {list(b.shape)} must have one shape"
        )
    alpha = float(ctx.attr("alpha", 1.0))
    cdt = compute_dtype(a.dtype)
    af = a.astype(cdt)
    with np.errstate(over="ignore"):
        y = af / (1.0 + np.exp(-alpha * af)) * b.astype(cdt)
    return y.astype(a.dtype)


@REGISTRY.register("Det", since=11)
def det(ctx: KernelContext, x: Array) -> Array:
    """Determinant of each trailing square matrix."""
    if x.ndim < 2 or x.shape[-1] != x.shape[-2]:
        raise ValueError(f"{ctx.node.describe()}: X {list(x.shape)} is not [..., M, M]")
    return np.asarray(np.linalg.det(x.astype(np.float64)), dtype=x.dtype)


@REGISTRY.register("LRN", since=1)
def lrn(ctx: KernelContext, x: Array) -> Array:
    """Local response normalization across channels (axis 1)."""
    size = int(ctx.attr("size"))
    alpha = float(ctx.attr("alpha", 1e-4))
    beta = float(ctx.attr("beta", 0.75))
    bias = float(ctx.attr("bias", 1.0))
    if size < 1 or x.ndim < 2:
        raise ValueError(f"{ctx.node.describe()}: needs size >= 1 and X of rank >= 2")
    xf = x.astype(np.float64)
    sq = np.square(xf)
    before, after = (size - 1) // 2, size - 1 - (size - 1) // 2
    padded = np.pad(sq, [(0, 0), (before, after)] + [(0, 0)] * (x.ndim - 2))
    csum = np.cumsum(padded, axis=1)
    csum = np.concatenate([np.zeros_like(csum[:, :1]), csum], axis=1)
    window = csum[:, size:] - csum[:, :-size]
    return (xf / (bias + alpha / size * window) ** beta).astype(x.dtype)


@REGISTRY.register("MeanVarianceNormalization", since=9)
def mean_variance_normalization(ctx: KernelContext, x: Array) -> Array:
    """(x - mean) / (std + 1e-9) over ``axes`` (default [0, 2, 3]), as the op's function."""
    axes = tuple(normalize_axis(int(a), x.ndim, ctx.node) for a in ctx.attr("axes", [0, 2, 3]))
    xf = x.astype(np.float64)
    mean = xf.mean(axis=axes, keepdims=True)
    std = np.sqrt(np.maximum((xf * xf).mean(axis=axes, keepdims=True) - mean * mean, 0.0))
    return ((xf - mean) / (std + 1e-9)).astype(x.dtype)


def _tensor_scatter_check(node: NodeInfo, _types: object = ()) -> str | None:
    mode = node.attr("mode", "linear")
    if mode not in ("linear", "circular"):
        return f"TensorScatter mode={mode!r} is not 'linear' or 'circular'"
    return None


@REGISTRY.register("TensorScatter", since=24, check=_tensor_scatter_check)
def tensor_scatter(
    ctx: KernelContext, cache: Array, update: Array, write_indices: Array | None = None
) -> Array:
    """A copy of ``cache`` with ``update`` written along ``axis`` from each batch row's
    write index (wrapping around when mode='circular')."""
    axis = _axis(ctx, cache, -2)
    if axis == 0:
        raise ValueError(f"{ctx.node.describe()}: axis must not be the batch axis 0")
    shape_ok = update.ndim == cache.ndim and all(
        u == c for i, (u, c) in enumerate(zip(update.shape, cache.shape, strict=True)) if i != axis
    )
    max_len, length = cache.shape[axis], update.shape[axis] if update.ndim > axis else 0
    if not shape_ok or length > max_len:
        raise ValueError(
            f"{ctx.node.describe()}: update {list(update.shape)} must match past_cache "
            f"{list(cache.shape)} except along axis {axis}, and be no longer there"
        )
    batch = cache.shape[0]
    starts = np.zeros(batch, np.int64) if write_indices is None else write_indices.astype(np.int64)
    if starts.shape != (batch,):
        raise ValueError(f"{ctx.node.describe()}: write_indices must have shape [{batch}]")
    circular = ctx.attr("mode", "linear") == "circular"
    out = cache.copy()
    for b in range(batch):
        start = int(starts[b])
        if start < 0 or (not circular and start + length > max_len):
            raise ValueError(
                f"{ctx.node.describe()}: write index {start} of batch row {b} with "
                f"{length} new positions does not fit {max_len} (use mode='circular' to wrap)"
            )
        dest = (start + np.arange(length)) % max_len
        np.moveaxis(out[b], axis - 1, 0)[dest] = np.moveaxis(update[b], axis - 1, 0)
    return out


# -- spectral windows ------------------------------------------------------------------------


def _window(ctx: KernelContext, size: Array, terms: tuple[float, ...]) -> Array:
    """Generalized cosine window sum_k (-1)^k terms[k] cos(2 pi k n / N)."""
    n = int(np.asarray(size).reshape(-1)[0])
    if n < 0:
        raise ValueError(f"{ctx.node.describe()}: size {n} must be >= 0")
    periodic = bool(ctx.attr("periodic", 1))
    denom = n if periodic else n - 1
    k = np.arange(n, dtype=np.float64)
    phase = 2.0 * np.pi * k / denom if denom > 0 else np.zeros(n)
    y = sum((-1) ** i * t * np.cos(i * phase) for i, t in enumerate(terms))
    dtype = numpy_dtype_of_onnx(int(ctx.attr("output_datatype", 1)))
    return np.asarray(y, dtype=np.float64).astype(dtype)


@REGISTRY.register("HannWindow", since=17)
def hann_window(ctx: KernelContext, size: Array) -> Array:
    return _window(ctx, size, (0.5, 0.5))


@REGISTRY.register("HammingWindow", since=17)
def hamming_window(ctx: KernelContext, size: Array) -> Array:
    return _window(ctx, size, (25.0 / 46.0, 21.0 / 46.0))


@REGISTRY.register("BlackmanWindow", since=17)
def blackman_window(ctx: KernelContext, size: Array) -> Array:
    return _window(ctx, size, (0.42, 0.5, 0.08))


# -- ai.onnx.ml ------------------------------------------------------------------------------


@REGISTRY.register("Binarizer", since=1, domain="ai.onnx.ml")
def binarizer(ctx: KernelContext, x: Array) -> Array:
    """1 where x > threshold, else 0, in x's type."""
    return (x > float(ctx.attr("threshold", 0.0))).astype(x.dtype)


@REGISTRY.register("ArrayFeatureExtractor", since=1, domain="ai.onnx.ml")
def array_feature_extractor(ctx: KernelContext, x: Array, indices: Array) -> Array:
    """The elements at ``indices`` along the last axis."""
    idx = indices.astype(np.int64).reshape(-1)
    width = x.shape[-1] if x.ndim else 0
    if idx.size and (idx.min() < 0 or idx.max() >= width):
        raise ValueError(
            f"{ctx.node.describe()}: indices {idx.tolist()} outside [0, {width}) of X's last axis"
        )
    y = np.take(x, idx, axis=-1)
    return y.reshape(1, -1) if x.ndim == 1 else y
