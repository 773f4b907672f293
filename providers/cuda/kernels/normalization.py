"""CUDA kernels: RMSNormalization, SimplifiedLayerNormalization and LayerNormalization.

One block per normalized row; statistics in float32 (the default stash_type); the
output is rounded once, after the scale (and bias) are applied. RMS norms of whole 16-byte
rows in one dtype run ``rms_rows_staged``: the arithmetic of a norm fused into a GEMM
(``stage_act``), so fusing a norm never changes a row's bits.
"""

from __future__ import annotations

import cupy
import numpy as np
from onnx import TensorProto

from onnx_genrt.core.kernels import KernelContext, NodeInfo
from onnx_genrt.core.op_rules import normalize_axis

from ._common import (
    BF16,
    DEVICE_COMMON,
    F16,
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

// RMS norm rows of K values (16-byte chunks) exactly as the GEMMs that fuse a norm make them
// (stage_act, NORM = 1, one row a block): y = (x + skip) * inv * gamma and sum_out = x + skip
// (flags & 1: skip, flags & 2: sum_out), so a row's bits do not depend on whether its norm
// ran fused or here. Grid (1, rows), block (32, 8).
template <typename S>
__global__ void __launch_bounds__(256) rms_rows_staged(
    const S* __restrict__ x, const S* __restrict__ skip, const S* __restrict__ gamma,
    S* __restrict__ y, S* __restrict__ sum_out, float eps, int flags, int K) {
  GRID_WAIT();
  GRID_LAUNCH_DEPENDENTS();
  const long long at = (long long)blockIdx.y * K;
  stage_act<1, 1>(x + at, skip + at, gamma, sum_out + at, eps, flags, 1, K, y + at);
}
"""
)

#: Most rows ``rms_rows_staged`` takes (its grid's y dimension).
STAGED_MAX_ROWS = 65535


def staged_rms(
    ctx: KernelContext,
    x: cupy.ndarray,
    skip: cupy.ndarray | None,
    gamma: cupy.ndarray,
    y: cupy.ndarray,
    total: cupy.ndarray | None,
    eps: float,
) -> bool:
    """Run the RMS norm of the last axis of ``x`` (+ ``skip``, the sum into ``total``) as
    ``rms_rows_staged``, the arithmetic of a norm fused into a GEMM, when its shapes allow
    (one dtype, whole 16-byte rows, aligned, at most STAGED_MAX_ROWS rows); False (nothing
    run) otherwise."""
    cols = int(x.shape[-1]) if x.ndim else 0
    rows = int(x.size // cols) if cols else 0
    arrays = [a for a in (x, skip, gamma, y, total) if a is not None]
    if not (
        x.dtype in (F32, F16, BF16)
        and all(a.dtype == x.dtype and a.flags.c_contiguous for a in arrays)
        and all(a.data.ptr % 16 == 0 for a in arrays)
        and 0 < rows <= STAGED_MAX_ROWS
        and (cols * x.dtype.itemsize) % 16 == 0
        and gamma.size == cols
        and (skip is None or skip.size == x.size)
    ):
        return False
    flags = (skip is not None) | (2 * (total is not None))
    fn = function(_SOURCE, f"rms_rows_staged<{storage(ctx, x.dtype)}>")
    args = (x, skip if skip is not None else x, gamma, y, total if total is not None else y)
    fn((1, rows), (32, 8), (*args, np.float32(eps), np.int32(flags), np.int32(cols)))
    return True


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
        if not stats and axis == x.ndim - 1 and staged_rms(ctx, x, None, scale, y, None, eps):
            return y
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
