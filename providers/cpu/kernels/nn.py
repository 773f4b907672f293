"""CPU kernels: nn (MatMul, Gemm, Einsum, Softmax); imports the other nn modules to register them."""

from __future__ import annotations

import functools

import numpy as np

from onnx_genrt.core.op_rules import matmul_shape

from . import attention, conv, normalization, quant  # noqa: F401  (register on import)
from ._nn_common import (
    as_compute,
    compute_dtype,
    log_softmax_rows,
    normalize_axis,
    rows_view,
    softmax_rows,
)
from ._registry import REGISTRY

_F64 = np.dtype(np.float64)


# ----------------------------------------------------------------------------- MatMul / Gemm


def _matmul_into(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> np.ndarray:
    """np.matmul(a, b) written into ``out``; a stack of rows times a 2-D weight is one GEMM."""
    if (
        b.ndim == 2
        and a.ndim > 2
        and a.flags.c_contiguous
        and out.flags.c_contiguous
        and a.dtype == out.dtype
    ):
        np.matmul(a.reshape(-1, a.shape[-1]), b, out=out.reshape(-1, out.shape[-1]))
        return out
    np.matmul(a, b, out=out)
    return out


def _bind_matmul(ctx, inputs, out: np.ndarray):
    """Replay closure for the float32 path: one BLAS call on prebuilt views."""
    a, b = inputs
    if not (a.dtype == b.dtype == out.dtype == np.float32):
        return functools.partial(_replay_kernel, matmul_kernel, ctx, a, b, out)
    if b.ndim == 2 and a.ndim > 2 and a.flags.c_contiguous and out.flags.c_contiguous:
        return functools.partial(
            np.matmul, a.reshape(-1, a.shape[-1]), b, out=out.reshape(-1, out.shape[-1])
        )
    return functools.partial(np.matmul, a, b, out=out)


def _replay_kernel(fn, ctx, a, b, out) -> None:
    result = fn(ctx, a, b)
    if result is not out:
        np.copyto(out, result, casting="unsafe")


def matmul(ctx, a: np.ndarray, b: np.ndarray, index: int = 0) -> np.ndarray:
    """MatMul with float32 BLAS for every float type; integers through numpy."""
    if a.dtype != b.dtype:
        raise TypeError(
            f"{ctx.node.describe()}: MatMul operand dtypes differ: {a.dtype}, {b.dtype}"
        )
    shape = matmul_shape(ctx, a.shape, b.shape)
    out = ctx.out(index, shape, a.dtype)
    if a.dtype.kind != "f" and not _is_ml_float(a.dtype):
        out[...] = np.matmul(a, b)
        return out
    cdt = compute_dtype(a.dtype)
    if a.dtype == cdt:
        return _matmul_into(a, b, out)
    res = np.empty(shape, cdt)
    _matmul_into(a.astype(cdt), b.astype(cdt), res)
    out[...] = res
    return out


def _is_ml_float(dt: np.dtype) -> bool:
    return dt.kind == "V" or type(dt).__module__.startswith("ml_dtypes")


@REGISTRY.register("MatMul", since=1)
def matmul_kernel(ctx, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """ONNX MatMul (numpy matmul semantics, batched broadcasting, 1-D operands)."""
    return matmul(ctx, a, b)


matmul_kernel.bind = _bind_matmul  # type: ignore[attr-defined]


@REGISTRY.register("Gemm", since=1)
def gemm_kernel(ctx, a: np.ndarray, b: np.ndarray, c: np.ndarray | None = None) -> np.ndarray:
    """Y = alpha * A' @ B' + beta * C, with C broadcast to (M, N)."""
    alpha = float(ctx.attr("alpha", 1.0))
    beta = float(ctx.attr("beta", 1.0))
    if ctx.attr("transA", 0):
        a = a.T
    if ctx.attr("transB", 0):
        b = b.T
    if a.ndim != 2 or b.ndim != 2:
        raise ValueError(
            f"{ctx.node.describe()}: Gemm needs 2-D operands, got {a.shape}, {b.shape}"
        )
    dtype = a.dtype
    is_float = dtype.kind == "f" or _is_ml_float(dtype)
    cdt = compute_dtype(dtype) if is_float else dtype
    shape = (a.shape[0], b.shape[1])
    out = ctx.out(0, shape, dtype)
    y = out if cdt == dtype else np.empty(shape, cdt)
    if cdt == dtype:
        np.matmul(a, b, out=y)
    else:
        np.matmul(a.astype(cdt), b.astype(cdt), out=y)
    if alpha != 1.0:
        if is_float:
            y *= cdt.type(alpha)
        else:
            y[...] = (y * alpha).astype(cdt)
    if c is not None and beta != 0.0:
        cc = c.astype(cdt) if c.dtype != cdt else c
        if beta == 1.0:
            y += cc
        elif is_float:
            y += cdt.type(beta) * cc
        else:
            y[...] = (y + beta * cc).astype(cdt)
    if y is not out:
        out[...] = y
    return out


def _zero_point(zp: np.ndarray | None, axis_len: int, axis: int, what: str) -> np.ndarray:
    """A MatMulInteger zero point as float64 broadcastable to its 2-D operand."""
    if zp is None:
        return np.zeros((), _F64)
    z = zp.astype(_F64)
    if z.size == 1:
        return z.reshape(())
    if z.ndim == 1 and z.shape[0] == axis_len:
        return z.reshape((-1, 1)) if axis == 0 else z
    raise NotImplementedError(f"MatMulInteger {what} zero point of shape {zp.shape} not supported")


@REGISTRY.register("MatMulInteger", since=10)
def matmul_integer_kernel(
    ctx,
    a: np.ndarray,
    b: np.ndarray,
    a_zero_point: np.ndarray | None = None,
    b_zero_point: np.ndarray | None = None,
) -> np.ndarray:
    """(A - a_zp) @ (B - b_zp) in int32; float64 BLAS is exact for these ranges."""
    m_axis_len = a.shape[-2] if a.ndim >= 2 else 1
    af = a.astype(_F64)
    bf = b.astype(_F64)
    if a_zero_point is not None:
        af -= _zero_point(a_zero_point, m_axis_len, 0 if a.ndim >= 2 else 1, "a")
    if b_zero_point is not None:
        bf -= _zero_point(b_zero_point, b.shape[-1], 1, "b")
    res = np.matmul(af, bf)
    out = ctx.out(0, res.shape, np.int32)
    np.rint(res, out=res)
    out[...] = res
    return out


# ----------------------------------------------------------------------------- Einsum


@REGISTRY.register("Einsum", since=12)
def einsum_kernel(ctx, *inputs: np.ndarray) -> np.ndarray:
    """np.einsum with path optimisation; low-precision floats computed in float32."""
    equation = str(ctx.attr("equation")).replace(" ", "")
    dtype = inputs[0].dtype
    if dtype.kind == "f" or _is_ml_float(dtype):
        cdt = compute_dtype(dtype)
        ops = [x.astype(cdt) if x.dtype != cdt else x for x in inputs]
    else:
        ops = list(inputs)
    res = np.asarray(np.einsum(equation, *ops, optimize=len(ops) > 1))
    return res if res.dtype == dtype else res.astype(dtype)


# ----------------------------------------------------------------------------- Softmax


def _softmax_like(ctx, x: np.ndarray, log: bool) -> np.ndarray:
    """Softmax/LogSoftmax: flattened to 2-D at ``axis`` before opset 13, per-axis after."""
    if x.dtype.kind != "f" and not _is_ml_float(x.dtype):
        raise TypeError(f"{ctx.node.describe()}: unsupported dtype {x.dtype}")
    if ctx.opset >= 13:
        axis = normalize_axis(int(ctx.attr("axis", -1)), max(x.ndim, 1))
        moved = x.ndim > 0 and axis != x.ndim - 1
        xm = np.moveaxis(x, axis, -1) if moved else x
        cols = xm.shape[-1] if xm.ndim else 1
        rows = xm.size // cols if cols else 0
    else:
        axis = normalize_axis(int(ctx.attr("axis", 1)), max(x.ndim, 1))
        moved = False
        xm = x
        rows, cols = rows_view(x, axis)
    src = as_compute(xm).reshape(rows, cols)
    direct = x.dtype == src.dtype and not moved
    out = ctx.out(0, x.shape, x.dtype)
    direct = direct and out.flags.c_contiguous
    dst = out.reshape(rows, cols) if direct else np.empty_like(src)
    if x.size:
        if log:
            log_softmax_rows(src, dst)
        else:
            softmax_rows(src, dst, False)
    if direct:
        return out
    res = dst.reshape(xm.shape)
    if moved:
        res = np.moveaxis(res, -1, axis)
    out[...] = res
    return out


@REGISTRY.register("Softmax", since=1)
def softmax_kernel(ctx, x: np.ndarray) -> np.ndarray:
    """ONNX Softmax (all opsets)."""
    return _softmax_like(ctx, x, log=False)


@REGISTRY.register("LogSoftmax", since=1)
def log_softmax_kernel(ctx, x: np.ndarray) -> np.ndarray:
    """ONNX LogSoftmax (all opsets)."""
    return _softmax_like(ctx, x, log=True)
