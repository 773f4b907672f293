"""CPU kernels: Softmax and LogSoftmax (rows in the compute dtype, Numba)."""

from __future__ import annotations

import numpy as np

from onnx_genrt.core.dtypes import is_float_dtype
from onnx_genrt.core.op_rules import normalize_axis

from ._nn_common import as_compute, log_softmax_rows, rows_view, softmax_rows
from ._registry import REGISTRY

# ----------------------------------------------------------------------------- Softmax


def _softmax_like(ctx, x: np.ndarray, log: bool) -> np.ndarray:
    """Softmax/LogSoftmax: flattened to 2-D at ``axis`` before opset 13, per-axis after."""
    if not is_float_dtype(x.dtype):
        raise TypeError(f"{ctx.node.describe()}: unsupported dtype {x.dtype}")
    if ctx.opset >= 13:
        axis = normalize_axis(int(ctx.attr("axis", -1)), max(x.ndim, 1), ctx.node)
        moved = x.ndim > 0 and axis != x.ndim - 1
        xm = np.moveaxis(x, axis, -1) if moved else x
        cols = xm.shape[-1] if xm.ndim else 1
        rows = xm.size // cols if cols else 0
    else:
        axis = normalize_axis(int(ctx.attr("axis", 1)), max(x.ndim, 1), ctx.node)
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
