"""CPU kernels: quantized linear algebra of the classic opsets -- DynamicQuantizeLinear,
QLinearMatMul, ConvInteger and QLinearConv (integer sums exact in float64)."""

from __future__ import annotations

import numpy as np

from onnx_genrt.core.kernels import KernelContext

from ._registry import REGISTRY
from .conv import conv_kernel

Array = np.ndarray
_F64 = np.dtype(np.float64)


def _requantize(ctx: KernelContext, y: Array, scale: Array, zero_point: Array) -> Array:
    """saturate(round_half_even(y / scale) + zero_point) in the zero point's integer type."""
    if zero_point.dtype.kind not in "iu":
        raise ValueError(f"{ctx.node.describe()}: y_zero_point must be 8-bit integer")
    info = np.iinfo(zero_point.dtype)
    q = np.rint(y / scale.astype(_F64)) + zero_point.astype(_F64)
    return np.clip(q, info.min, info.max).astype(zero_point.dtype)


def _per_tensor(ctx: KernelContext, name: str, value: Array) -> Array:
    if value.size != 1:
        raise ValueError(
            f"{ctx.node.describe()}: {name} has {value.size} values; only one (per tensor) is "
            f"supported here"
        )
    return value.reshape(())


@REGISTRY.register("DynamicQuantizeLinear", since=11)
def dynamic_quantize_linear(ctx: KernelContext, x: Array) -> tuple[Array, Array, Array]:
    """uint8 quantization over the range [min(x, 0), max(x, 0)]: (y, y_scale, y_zero_point)."""
    xf = x.astype(_F64)
    lo = min(0.0, float(xf.min())) if xf.size else 0.0
    hi = max(0.0, float(xf.max())) if xf.size else 0.0
    scale = np.float32((hi - lo) / 255.0)
    if scale == 0:
        zero = np.uint8(0)
        return np.zeros(x.shape, np.uint8), np.asarray(scale, np.float32), np.asarray(zero)
    zero = np.uint8(np.clip(np.rint(np.float32(lo) * -1 / scale), 0, 255))
    # the op divides in float32 (the scale's type); float64 would round some ties apart
    q = np.rint(x.astype(np.float32) / scale) + np.float32(zero)
    y = np.clip(q, 0, 255).astype(np.uint8)
    return y, np.asarray(scale, np.float32), np.asarray(zero, np.uint8)


@REGISTRY.register("QLinearMatMul", since=10)
def qlinear_matmul(
    ctx: KernelContext,
    a: Array,
    a_scale: Array,
    a_zero: Array,
    b: Array,
    b_scale: Array,
    b_zero: Array,
    y_scale: Array,
    y_zero: Array,
) -> Array:
    """Quantized MatMul: dequantize A and B (per tensor; B may be per column), multiply,
    quantize with y_scale / y_zero_point."""
    ys, yz = _per_tensor(ctx, "y_scale", y_scale), _per_tensor(ctx, "y_zero_point", y_zero)
    a_real = (a.astype(_F64) - _per_tensor(ctx, "a_zero_point", a_zero)) * _per_tensor(
        ctx, "a_scale", a_scale
    ).astype(_F64)
    bz = b_zero.astype(_F64).reshape(-1) if b_zero.size > 1 else b_zero.astype(_F64).reshape(())
    bs = b_scale.astype(_F64).reshape(-1) if b_scale.size > 1 else b_scale.astype(_F64).reshape(())
    b_real = (b.astype(_F64) - bz) * bs
    return _requantize(ctx, np.matmul(a_real, b_real), ys, yz)


def _integer_conv(
    ctx: KernelContext, x: Array, x_zero: Array | None, w: Array, w_zero: Array | None
) -> Array:
    """Conv of (x - x_zero) and (w - w_zero) with exact integer sums (float64)."""
    xs = x.astype(_F64)
    if x_zero is not None:
        xs -= _per_tensor(ctx, "x_zero_point", x_zero).astype(_F64)
    ws = w.astype(_F64)
    if w_zero is not None:
        if w_zero.size not in (1, w.shape[0]):
            raise ValueError(
                f"{ctx.node.describe()}: w_zero_point has {w_zero.size} values; expected 1 or "
                f"{w.shape[0]} (one per output channel)"
            )
        ws -= w_zero.astype(_F64).reshape((-1,) + (1,) * (w.ndim - 1))
    return conv_kernel(ctx, xs, ws)


@REGISTRY.register("ConvInteger", since=10)
def conv_integer(
    ctx: KernelContext,
    x: Array,
    w: Array,
    x_zero: Array | None = None,
    w_zero: Array | None = None,
) -> Array:
    """Integer Conv: int32 sums of (x - x_zero_point) * (w - w_zero_point)."""
    return np.rint(_integer_conv(ctx, x, x_zero, w, w_zero)).astype(np.int32)


@REGISTRY.register("QLinearConv", since=10)
def qlinear_conv(
    ctx: KernelContext,
    x: Array,
    x_scale: Array,
    x_zero: Array,
    w: Array,
    w_scale: Array,
    w_zero: Array,
    y_scale: Array,
    y_zero: Array,
    bias: Array | None = None,
) -> Array:
    """Quantized Conv: integer sums (plus the int32 bias) scaled by x_scale * w_scale (per
    tensor or per output channel), then quantized with y_scale / y_zero_point."""
    acc = _integer_conv(ctx, x, x_zero, w, w_zero)
    m = w.shape[0]
    if w_scale.size not in (1, m):
        raise ValueError(
            f"{ctx.node.describe()}: w_scale has {w_scale.size} values; expected 1 or {m}"
        )
    channel = (1, -1) + (1,) * (acc.ndim - 2)
    if bias is not None:
        acc = acc + bias.astype(_F64).reshape(channel)
    scale = _per_tensor(ctx, "x_scale", x_scale).astype(_F64) * w_scale.astype(_F64).reshape(
        channel if w_scale.size > 1 else ()
    )
    ys, yz = _per_tensor(ctx, "y_scale", y_scale), _per_tensor(ctx, "y_zero_point", y_zero)
    return _requantize(ctx, acc * scale, ys, yz)
