"""CPU kernels: QuantizeLinear / DequantizeLinear (per-tensor, per-axis, blocked).

Quantized element types are numpy/ml_dtypes arrays, one element per item (int4, uint4,
int2, uint2, float8 and float4 unpacked).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
from onnx import helper

from onnx_genrt.core.op_rules import normalize_axis

from ._registry import REGISTRY

_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)
_SMALL_INTS = {
    np.dtype(t) for t in (ml_dtypes.int4, ml_dtypes.uint4, ml_dtypes.int2, ml_dtypes.uint2)
}
_SATURATING_FLOATS = {
    np.dtype(t)
    for t in (
        ml_dtypes.float8_e4m3fn,
        ml_dtypes.float8_e4m3fnuz,
        ml_dtypes.float8_e5m2,
        ml_dtypes.float8_e5m2fnuz,
    )
}


def _is_int(dt: np.dtype) -> bool:
    return dt.kind in "iu" or dt in _SMALL_INTS


def _onnx_dtype(code: int, what: str) -> np.dtype:
    try:
        return np.dtype(helper.tensor_dtype_to_np_dtype(int(code)))
    except (KeyError, ValueError, TypeError):
        raise NotImplementedError(f"{what}: element type {code} is not supported") from None


def _axis(ctx, x: np.ndarray, scale: np.ndarray) -> int:
    """The quantization axis; irrelevant (0) for per-tensor scales."""
    if scale.size == 1 and scale.ndim <= 1:
        return 0
    return normalize_axis(int(ctx.attr("axis", 1)), x.ndim, ctx.node, "quantization axis")


def _expand(p: np.ndarray, shape: tuple[int, ...], axis: int, block: int, what: str) -> np.ndarray:
    """Scale / zero point made broadcastable to ``shape`` (per-tensor, per-axis or blocked)."""
    if p.ndim == 0 or (p.size == 1 and not block):
        return p.reshape(())
    if not block:
        if p.ndim != 1 or p.shape[0] != shape[axis]:
            raise ValueError(f"{what} of shape {p.shape} does not fit axis {axis} of {shape}")
        dims = [1] * len(shape)
        dims[axis] = p.shape[0]
        return p.reshape(dims)
    if block < 0 or p.ndim != len(shape):
        raise ValueError(f"{what} of shape {p.shape} invalid for block_size {block} on {shape}")
    full = np.repeat(p, block, axis=axis)
    full = np.take(full, np.arange(shape[axis]), axis=axis)
    if full.shape != shape:
        raise ValueError(f"{what} of shape {p.shape} invalid for block_size {block} on {shape}")
    return full


def _whole_blocks(
    shape: tuple[int, ...], scale: np.ndarray, zp: np.ndarray | None, axis: int, block: int
) -> bool:
    """True when blocks tile ``axis`` exactly and scale/zero point match ``shape`` elsewhere."""
    if not shape or scale.ndim != len(shape) or (zp is not None and zp.shape != scale.shape):
        return False
    want = (*shape[:axis], shape[axis] // block, *shape[axis + 1 :])
    return shape[axis] % block == 0 and scale.shape == want


def _dequant_blocked(x: np.ndarray, scale: np.ndarray, zp, axis: int, block: int) -> np.ndarray:
    """Blocked dequantization by reshaping, without materialising repeated scales."""
    pre = int(np.prod(x.shape[:axis], dtype=np.int64))
    post = int(np.prod(x.shape[axis + 1 :], dtype=np.int64))
    nblk = x.shape[axis] // block
    xf = x.astype(_F32).reshape(pre, nblk, block, post)
    if zp is not None:
        xf -= zp.astype(_F32).reshape(pre, nblk, 1, post)
    xf *= scale.astype(_F32).reshape(pre, nblk, 1, post)
    return xf.reshape(x.shape)


@REGISTRY.register("DequantizeLinear", since=10)
def dequantize_linear_kernel(
    ctx, x: np.ndarray, scale: np.ndarray, zero_point: np.ndarray | None = None
) -> np.ndarray:
    """y = (x - zero_point) * scale; float8/float4 inputs ignore the zero point."""
    axis = _axis(ctx, x, scale)
    block = int(ctx.attr("block_size", 0))
    code = int(ctx.attr("output_dtype", 0))
    out_dtype = _onnx_dtype(code, "DequantizeLinear") if code else scale.dtype
    if not _is_int(x.dtype):
        zero_point = None
    if block and _whole_blocks(x.shape, scale, zero_point, axis, block):
        return _dequant_blocked(x, scale, zero_point, axis, block).astype(out_dtype)
    xf = x.astype(_F32)
    if zero_point is not None:
        xf -= _expand(zero_point, x.shape, axis, block, "x_zero_point").astype(_F32)
    xf *= _expand(scale, x.shape, axis, block, "x_scale").astype(_F32)
    return xf.astype(out_dtype)


def _quant_target(ctx, zero_point: np.ndarray | None) -> np.dtype:
    code = int(ctx.attr("output_dtype", 0))
    if zero_point is not None:
        if code and _onnx_dtype(code, "QuantizeLinear") != zero_point.dtype:
            raise ValueError(f"{ctx.node.describe()}: output_dtype differs from zero point type")
        return zero_point.dtype
    return _onnx_dtype(code, "QuantizeLinear") if code else np.dtype(np.uint8)


@REGISTRY.register("QuantizeLinear", since=10)
def quantize_linear_kernel(
    ctx, x: np.ndarray, scale: np.ndarray, zero_point: np.ndarray | None = None
) -> np.ndarray:
    """y = saturate(round(x / scale) + zero_point), round half to even."""
    axis = _axis(ctx, x, scale)
    block = int(ctx.attr("block_size", 0))
    target = _quant_target(ctx, zero_point)
    precision = int(ctx.attr("precision", 0))
    if precision:
        pdt = _onnx_dtype(precision, "QuantizeLinear precision")
    else:
        pdt = np.result_type(x.dtype, scale.dtype) if x.dtype == scale.dtype else _F32
        if pdt not in (np.dtype(np.float16), _F32, _F64):
            pdt = _F32
    s = _expand(scale, x.shape, axis, block, "y_scale")
    y = x.astype(pdt) / s.astype(pdt)
    if y.dtype not in (_F32, _F64):
        y = y.astype(_F32)
    zp = None
    if zero_point is not None:
        zp = _expand(zero_point, x.shape, axis, block, "y_zero_point").astype(y.dtype)
    if _is_int(target):
        info = ml_dtypes.iinfo(target)
        y = np.rint(y)
        if zp is not None:
            y += zp
        np.clip(y, info.min, info.max, out=y)
        return y.astype(target)
    if target in _SATURATING_FLOATS:
        if ctx.attr("saturate", 1):
            fmax = float(ml_dtypes.finfo(target).max)
            y = np.clip(y, -fmax, fmax)
        return y.astype(target)
    if target.kind == "V" or type(target).__module__.startswith("ml_dtypes"):
        if zp is not None:  # float4 / float6: zero point added before the cast
            y = y + zp
        return y.astype(target)
    raise NotImplementedError(f"{ctx.node.describe()}: cannot quantize to {target}")
