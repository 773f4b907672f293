"""CUDA kernels: RMSNormalization, SimplifiedLayerNormalization and LayerNormalization.

One block per normalized row; statistics in float32 (the default stash_type); the
output is rounded once, after the scale (and bias) are applied.
"""

from __future__ import annotations

import cupy
import numpy as np
from onnx import TensorProto

from onnx_genrt.core.kernels import KernelContext, NodeInfo
from onnx_genrt.core.op_rules import normalize_axis

from ._common import (
    DEVICE_COMMON,
    F32,
    contiguous,
    function,
    out,
    row_threads,
    rows_cols,
    storage,
)
from ._registry import REGISTRY

_SOURCE = (
    DEVICE_COMMON
    + r"""
template <typename S, typename W>
__global__ void rms_norm_rows(const S* __restrict__ x, const W* __restrict__ scale,
                              W* __restrict__ y, float* __restrict__ inv_out, long long cols,
                              long long scale_step, float eps, int want_inv) {
  __shared__ float sh[33];
  GRID_WAIT();
  GRID_LAUNCH_DEPENDENTS();
  const long long base = (long long)blockIdx.x * cols;
  float ss = 0.f;
  for (long long j = threadIdx.x; j < cols; j += blockDim.x) { float v = ld(x, base + j); ss += v * v; }
  ss = block_sum(ss, sh);
  const float inv = rsqrtf(ss / (float)cols + eps);
  for (long long j = threadIdx.x; j < cols; j += blockDim.x)
    st(y, base + j, ld(x, base + j) * inv * ld(scale, j * scale_step));
  if (want_inv && threadIdx.x == 0) inv_out[blockIdx.x] = inv;
}

template <typename S, typename W>
__global__ void layer_norm_rows(const S* __restrict__ x, const W* __restrict__ scale,
                                const W* __restrict__ bias, W* __restrict__ y,
                                float* __restrict__ mean_out, float* __restrict__ inv_out,
                                long long cols, long long scale_step, long long bias_step,
                                int has_bias, float eps, int want_mean, int want_inv) {
  __shared__ float sh[33];
  GRID_WAIT();
  GRID_LAUNCH_DEPENDENTS();
  const long long base = (long long)blockIdx.x * cols;
  float s = 0.f;
  for (long long j = threadIdx.x; j < cols; j += blockDim.x) s += ld(x, base + j);
  const float mean = block_sum(s, sh) / (float)cols;
  float ss = 0.f;
  for (long long j = threadIdx.x; j < cols; j += blockDim.x) { float d = ld(x, base + j) - mean; ss += d * d; }
  const float inv = rsqrtf(block_sum(ss, sh) / (float)cols + eps);
  for (long long j = threadIdx.x; j < cols; j += blockDim.x) {
    float v = (ld(x, base + j) - mean) * inv * ld(scale, j * scale_step);
    if (has_bias) v += ld(bias, j * bias_step);
    st(y, base + j, v);
  }
  if (threadIdx.x == 0) {
    if (want_mean) mean_out[blockIdx.x] = mean;
    if (want_inv) inv_out[blockIdx.x] = inv;
  }
}
"""
)


def _stash_check(node: NodeInfo, input_types) -> str | None:
    """Refuses a stash_type other than float32 and, where the shapes are known, a scale or
    bias that broadcasts over more than the normalized elements (``_param_step``)."""
    stash = int(node.attr("stash_type", TensorProto.FLOAT))
    if stash != TensorProto.FLOAT:
        return f"{node.op_type} stash_type={stash} is not supported on CUDA (float32 only)"
    x = input_types[0] if input_types else None
    if x is None or x.shape is None or not all(isinstance(d, int) for d in x.shape):
        return None
    axis = int(node.attr("axis", -1))
    if not -len(x.shape) <= axis < len(x.shape):
        return None  # the kernel names the bad axis
    cols = int(np.prod(x.shape[axis:], dtype=np.int64))
    for index, what in ((1, "scale"), (2, "bias")):
        p = input_types[index] if len(input_types) > index else None
        if p is None or p.shape is None or not all(isinstance(d, int) for d in p.shape):
            continue
        size = int(np.prod(p.shape, dtype=np.int64))
        if size not in (cols, 1):
            return (
                f"{what} of shape {list(p.shape)} broadcasts over more than the {cols} "
                f"normalized elements; only per-element or scalar {what} run on CUDA"
            )
    return None


def _param_step(ctx: KernelContext, p: cupy.ndarray, cols: int, what: str) -> int:
    """1 when ``p`` holds one value per normalized element, 0 when it is a scalar."""
    if p.size == cols:
        return 1
    if p.size == 1:
        return 0
    raise NotImplementedError(
        f"{ctx.node.describe()}: {what} of shape {list(p.shape)} broadcasts over more than the "
        f"{cols} normalized elements; only per-element or scalar {what} run on CUDA"
    )


def _outputs_wanted(ctx: KernelContext) -> int:
    names = ctx.node.output_names
    return max(1, len(names))


def _stat_shape(x: cupy.ndarray, axis: int) -> tuple[int, ...]:
    return tuple(x.shape[:axis]) + (1,) * (x.ndim - axis)


def _rms(ctx: KernelContext, x: cupy.ndarray, scale: cupy.ndarray, stats: bool):
    axis = normalize_axis(int(ctx.attr("axis", -1)), x.ndim, ctx.node)
    eps = float(ctx.attr("epsilon", 1e-5))
    rows, cols = rows_cols(x.shape, axis)
    y = out(ctx, 0, x.shape, scale.dtype)
    inv = out(ctx, 1, _stat_shape(x, axis), F32) if stats else y
    if rows and cols:
        s_x, s_w = storage(ctx, x.dtype), storage(ctx, scale.dtype)
        fn = function(_SOURCE, f"rms_norm_rows<{s_x}, {s_w}>")
        args = (contiguous(ctx, x), contiguous(ctx, scale), y, inv, np.int64(cols))
        args += (np.int64(_param_step(ctx, scale, cols, "scale")), np.float32(eps), np.int32(stats))
        fn((rows,), (row_threads(cols),), args)
    return (y, inv) if stats else y


@REGISTRY.register("RMSNormalization", since=23, check=_stash_check)
def rms_norm(ctx: KernelContext, x: cupy.ndarray, scale: cupy.ndarray) -> cupy.ndarray:
    """RMSNormalization-23: x / sqrt(mean(x^2 over axis..) + eps) * scale."""
    return _rms(ctx, x, scale, stats=False)


@REGISTRY.register("SimplifiedLayerNormalization", since=1, check=_stash_check)
def simplified_layer_norm(ctx: KernelContext, x: cupy.ndarray, scale: cupy.ndarray):
    """onnxruntime's SimplifiedLayerNormalization (RMS norm); optional inv_std_var output."""
    stats = _outputs_wanted(ctx) > 1 and bool(ctx.node.output_names[1])
    return _rms(ctx, x, scale, stats=stats)


@REGISTRY.register("LayerNormalization", since=17, check=_stash_check)
def layer_norm(ctx: KernelContext, x: cupy.ndarray, scale: cupy.ndarray, bias=None):
    """LayerNormalization-17; Mean and InvStdDev outputs (float32) when the node names them."""
    axis = normalize_axis(int(ctx.attr("axis", -1)), x.ndim, ctx.node)
    eps = float(ctx.attr("epsilon", 1e-5))
    rows, cols = rows_cols(x.shape, axis)
    names = ctx.node.output_names
    want_mean = len(names) > 1 and bool(names[1])
    want_inv = len(names) > 2 and bool(names[2])
    y = out(ctx, 0, x.shape, x.dtype)
    stat_shape = _stat_shape(x, axis)
    mean = out(ctx, 1, stat_shape, F32) if want_mean else y
    inv = out(ctx, 2, stat_shape, F32) if want_inv else y
    if rows and cols:
        s_x, s_w = storage(ctx, x.dtype), storage(ctx, scale.dtype)
        fn = function(_SOURCE, f"layer_norm_rows<{s_x}, {s_w}>")
        has_bias = bias is not None
        b = contiguous(ctx, bias) if has_bias else scale
        args = (contiguous(ctx, x), contiguous(ctx, scale), b, y, mean, inv, np.int64(cols))
        args += (
            np.int64(_param_step(ctx, scale, cols, "scale")),
            np.int64(_param_step(ctx, b, cols, "bias")),
            np.int32(has_bias),
            np.float32(eps),
            np.int32(want_mean),
            np.int32(want_inv),
        )
        fn((rows,), (row_threads(cols),), args)
    n_out = _outputs_wanted(ctx)
    if n_out == 1:
        return y
    return (y, mean, inv)[:n_out]
