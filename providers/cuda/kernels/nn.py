"""CUDA kernels: Softmax and ArgMax over rows (one block per row, fp32 accumulation)."""

from __future__ import annotations

import cupy
import numpy as np

from onnx_genrt.core.kernels import KernelContext

from ._common import (
    DEVICE_COMMON,
    contiguous,
    function,
    normalize_axis,
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

DEVI void arg_pick(float& v, long long& i, float v2, long long i2, int last) {
  if (i2 < 0) return;
  if (i < 0 || v2 > v || (v2 == v && (last ? i2 > i : i2 < i))) { v = v2; i = i2; }
}

template <typename S>
__global__ void argmax_rows(const S* __restrict__ x, long long* __restrict__ y, long long cols,
                            int last) {
  __shared__ float shv[32];
  __shared__ long long shi[32];
  const long long base = (long long)blockIdx.x * cols;
  float v = neg_inf();
  long long i = -1;
  for (long long j = threadIdx.x; j < cols; j += blockDim.x) arg_pick(v, i, ld(x, base + j), j, last);
  for (int o = 16; o > 0; o >>= 1)
    arg_pick(v, i, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, i, o), last);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  if (lane == 0) { shv[warp] = v; shi[warp] = i; }
  __syncthreads();
  if (warp == 0) {
    v = lane < warps ? shv[lane] : neg_inf();
    i = lane < warps ? shi[lane] : -1;
    for (int o = 16; o > 0; o >>= 1)
      arg_pick(v, i, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, i, o), last);
    if (lane == 0) y[blockIdx.x] = i < 0 ? 0 : i;
  }
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
        axis = normalize_axis(ctx, int(ctx.attr("axis", -1)), x.ndim)
        if axis != x.ndim - 1:
            return _softmax_moved(ctx, x, axis, y)
        rows, cols = rows_cols(x.shape, x.ndim - 1)
    else:
        rows, cols = rows_cols(x.shape, normalize_axis(ctx, int(ctx.attr("axis", 1)), x.ndim))
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


# ----------------------------------------------------------------------------- ArgMax


@REGISTRY.register("ArgMax", since=1)
def argmax(ctx: KernelContext, x: cupy.ndarray) -> cupy.ndarray:
    """Index (int64) of the largest element along ``axis``; first one unless select_last_index.

    The last axis runs as a RawKernel; any other axis uses CuPy eagerly. NaNs are skipped.
    """
    axis = normalize_axis(ctx, int(ctx.attr("axis", 0)), x.ndim)
    keep = bool(ctx.attr("keepdims", 1))
    last = int(bool(ctx.attr("select_last_index", 0)))
    shape = list(x.shape)
    if keep:
        shape[axis] = 1
    else:
        del shape[axis]
    y = out(ctx, 0, shape, np.int64)
    if y.size == 0:
        return y
    if axis != x.ndim - 1:
        refuse_in_capture(ctx, f"ArgMax over axis {axis} of a rank-{x.ndim} tensor")
        src = cupy.flip(x, axis) if last else x
        idx = cupy.argmax(src, axis=axis, keepdims=keep)
        if last:
            idx = x.shape[axis] - 1 - idx
        cupy.copyto(y, idx.reshape(y.shape))
        return y
    rows, cols = rows_cols(x.shape, x.ndim - 1)
    launch_rows(
        "argmax_rows", ctx, contiguous(ctx, x), rows, cols, y, np.int64(cols), np.int32(last)
    )
    return y
