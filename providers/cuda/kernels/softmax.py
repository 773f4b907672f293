"""CUDA kernels: Softmax (one block per row, fp32 accumulation)."""

from __future__ import annotations

import cupy
import numpy as np

from onnx_genrt.core.kernels import KernelContext
from onnx_genrt.core.op_rules import normalize_axis

from ._common import (
    DEVICE_COMMON,
    contiguous,
    function,
    out,
    refuse_in_capture,
    row_threads,
    rows_cols,
    storage,
)
from ._registry import REGISTRY

_SOURCE = (
    DEVICE_COMMON
    + r"""
template <typename S>
__global__ void softmax_rows(const S* __restrict__ x, S* __restrict__ y, long long cols) {
  __shared__ float sh[33];
  GRID_WAIT();
  GRID_LAUNCH_DEPENDENTS();
  const long long base = (long long)blockIdx.x * cols;
  float m = neg_inf();
  for (long long j = threadIdx.x; j < cols; j += blockDim.x) m = fmaxf(m, ld(x, base + j));
  m = block_max(m, sh);
  float s = 0.f;
  for (long long j = threadIdx.x; j < cols; j += blockDim.x) s += expf(ld(x, base + j) - m);
  s = block_sum(s, sh);
  const float inv = 1.f / s;
  for (long long j = threadIdx.x; j < cols; j += blockDim.x)
    st(y, base + j, expf(ld(x, base + j) - m) * inv);
}
"""
)


def launch_rows(
    name: str, ctx: KernelContext, x: cupy.ndarray, rows: int, cols: int, *args
) -> None:
    """One block per row of ``x`` viewed as (rows, cols)."""
    if rows == 0 or cols == 0:
        return
    fn = function(_SOURCE, f"{name}<{storage(ctx, x.dtype)}>")
    fn((rows,), (row_threads(cols),), (x, *args))


# ----------------------------------------------------------------------------- Softmax


@REGISTRY.register("Softmax", since=1)
def softmax(ctx: KernelContext, x: cupy.ndarray) -> cupy.ndarray:
    """Softmax over the last axis (opset >= 13) or the flattened tail (opset < 13)."""
    y = out(ctx, 0, x.shape, x.dtype)
    if x.ndim == 0:
        y.fill(1)
        return y
    if ctx.opset >= 13:
        axis = normalize_axis(int(ctx.attr("axis", -1)), x.ndim, ctx.node)
        if axis != x.ndim - 1:
            return _softmax_moved(ctx, x, axis, y)
        rows, cols = rows_cols(x.shape, x.ndim - 1)
    else:
        rows, cols = rows_cols(x.shape, normalize_axis(int(ctx.attr("axis", 1)), x.ndim, ctx.node))
    launch_rows("softmax_rows", ctx, contiguous(ctx, x), rows, cols, y, np.int64(cols))
    return y


def _softmax_moved(ctx: KernelContext, x: cupy.ndarray, axis: int, y: cupy.ndarray) -> cupy.ndarray:
    """Softmax over an inner axis: moved last, computed, moved back (eager only)."""
    refuse_in_capture(ctx, f"Softmax over axis {axis} of a rank-{x.ndim} tensor")
    moved = cupy.ascontiguousarray(cupy.moveaxis(x, axis, -1))
    res = cupy.empty_like(moved)
    rows, cols = rows_cols(moved.shape, moved.ndim - 1)
    launch_rows("softmax_rows", ctx, moved, rows, cols, res, np.int64(cols))
    cupy.copyto(y, cupy.moveaxis(res, -1, axis))
    return y
