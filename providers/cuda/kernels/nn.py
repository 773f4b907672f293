"""CUDA kernels: Softmax (one block per row, fp32 accumulation) and ArgMax over rows."""

from __future__ import annotations

import cupy
import numpy as np

from onnx_genrt.core.kernels import GENRT_DOMAIN, KernelContext
from onnx_genrt.core.op_rules import normalize_axis

from ._common import (
    DEVICE_COMMON,
    FLOAT_DTYPES,
    contiguous,
    function,
    out,
    refuse_in_capture,
    row_threads,
    rows_cols,
    scratch,
    sm_count,
    storage,
)
from ._registry import REGISTRY
from .reduce import zeroed_counters

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

// Order key of element i of value v: the value's bits made unsigned-comparable (-0 as +0,
// NaN above everything as in numpy) over the index, so that the lower index wins a tie (the
// higher with last). The largest key is the pick whatever order keys are met in; 0 is no pick.
DEVI unsigned long long arg_key(float v, long long i, int last) {
  unsigned int u = __float_as_uint(v);
  u = v != v ? 0xffffffffu : (v == 0.f ? 0x80000000u : ((u & 0x80000000u) ? ~u : (u | 0x80000000u)));
  const unsigned int low = last ? (unsigned int)i : 0xffffffffu - (unsigned int)i;
  return ((unsigned long long)u << 32) | low;
}
DEVI long long arg_index(unsigned long long k, int last) {
  if (k == 0ull) return 0;
  const unsigned int low = (unsigned int)k;
  return last ? (long long)low : (long long)(0xffffffffu - low);
}
DEVI unsigned long long kmax(unsigned long long a, unsigned long long b) { return a > b ? a : b; }

// Block-wide largest key; thread 0 gets it. sh holds 32 entries.
DEVI unsigned long long block_kmax(unsigned long long k, unsigned long long* sh) {
  for (int o = 16; o > 0; o >>= 1) k = kmax(k, __shfl_xor_sync(0xffffffffu, k, o));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  __syncthreads();
  if (lane == 0) sh[warp] = k;
  __syncthreads();
  if (warp == 0) {
    k = lane < warps ? sh[lane] : 0ull;
    for (int o = 16; o > 0; o >>= 1) k = kmax(k, __shfl_xor_sync(0xffffffffu, k, o));
  }
  return k;
}

DEVI float vec_elem(const uint4& w, int k, const float*) {
  const unsigned int u = k == 0 ? w.x : (k == 1 ? w.y : (k == 2 ? w.z : w.w));
  return __uint_as_float(u);
}
template <typename S>  // half_t or bf16_t: 8 values
DEVI float vec_elem(const uint4& w, int k, const S* tag) {
  const int q = k >> 1;
  const unsigned int u = q == 0 ? w.x : (q == 1 ? w.y : (q == 2 ? w.z : w.w));
  float a, b;
  unpack2(tag, u, a, b);
  return (k & 1) ? b : a;
}

// ArgMaxProb: per row, the first index of the largest value and its softmax probability
// 1 / sum(exp(x - max)); one block per row, two passes over the row (NaN as the largest).
template <typename S>
__global__ void argmax_prob_rows(const S* __restrict__ x, long long* __restrict__ idx,
                                 S* __restrict__ prob, long long cols) {
  __shared__ unsigned long long shk[32];
  __shared__ float sh[33];
  __shared__ float row_max;
  const S* xr = x + (long long)blockIdx.x * cols;
  unsigned long long best = 0ull;
  for (long long c = threadIdx.x; c < cols; c += blockDim.x) best = kmax(best, arg_key(ld(xr, c), c, 0));
  best = block_kmax(best, shk);
  if (threadIdx.x == 0) {
    const long long i = arg_index(best, 0);
    idx[blockIdx.x] = i;
    row_max = ld(xr, i);
  }
  __syncthreads();
  const float m = row_max;
  float s = 0.f;
  for (long long c = threadIdx.x; c < cols; c += blockDim.x) s += expf(ld(xr, c) - m);
  s = block_sum(s, sh);
  if (threadIdx.x == 0) st(prob, blockIdx.x, 1.f / s);
}

// ArgMax of each row of x (rows, cols < 2^32 - 1), a row split over `blocks` blocks of `chunk`
// columns: grid (rows, blocks). VEC > 1 (16-byte aligned rows): 16-byte loads, four in flight
// per thread. With one block the index is stored directly; otherwise each block stores its
// largest key, and the last block to finish (a counter per row, set back to zero by that
// block) takes the largest of them: the same pick whichever block finishes last.
template <typename S, int VEC>
__global__ void argmax_split(const S* __restrict__ x, long long* __restrict__ y,
                             unsigned long long* __restrict__ part, int* __restrict__ counters,
                             long long cols, long long chunk, int blocks, int last) {
  __shared__ unsigned long long sh[32];
  __shared__ int is_last;
  const long long row = blockIdx.x;
  const int blk = blockIdx.y;
  const S* xr = x + row * cols;
  const long long c0 = (long long)blk * chunk, c1 = min(c0 + chunk, cols);
  unsigned long long best = 0ull;
  long long c = c0;
  if (VEC > 1) {
    const long long stride = (long long)blockDim.x * VEC;
    const long long vend = c0 + (c1 - c0) / VEC * VEC;
    for (long long j = c0 + (long long)threadIdx.x * VEC; j < vend; j += 4 * stride) {
      uint4 w[4];
#pragma unroll
      for (int u = 0; u < 4; ++u)
        if (j + u * stride < vend) w[u] = *reinterpret_cast<const uint4*>(xr + j + u * stride);
#pragma unroll
      for (int u = 0; u < 4; ++u)
        if (j + u * stride < vend)
#pragma unroll
          for (int k = 0; k < VEC; ++k)
            best = kmax(best, arg_key(vec_elem(w[u], k, xr), j + u * stride + k, last));
    }
    c = vend;
  }
  for (c += threadIdx.x; c < c1; c += blockDim.x) best = kmax(best, arg_key(ld(xr, c), c, last));
  best = block_kmax(best, sh);
  if (blocks == 1) {
    if (threadIdx.x == 0) y[row] = arg_index(best, last);
    return;
  }
  unsigned long long* P = part + row * blocks;
  if (threadIdx.x == 0) {
    P[blk] = best;
    __threadfence();
    const int done = atomicAdd(counters + row, 1) == blocks - 1;
    if (done) counters[row] = 0;  // every block has counted: ready for the next launch
    is_last = done;
  }
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  best = 0ull;
  for (int k = threadIdx.x; k < blocks; k += blockDim.x) best = kmax(best, __ldcg(P + k));
  best = block_kmax(best, sh);
  if (threadIdx.x == 0) y[row] = arg_index(best, last);
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


# ----------------------------------------------------------------------------- ArgMax


@REGISTRY.register("ArgMax", since=1)
def argmax(ctx: KernelContext, x: cupy.ndarray) -> cupy.ndarray:
    """Index (int64) of the largest element along ``axis``; first one unless select_last_index.

    The last axis runs as a RawKernel (capturable): long rows (a vocabulary) are split over
    many blocks in one launch, the last block of a row picking among the blocks' picks. As
    numpy (the CPU provider), a NaN counts as the largest value. Any other axis uses CuPy
    eagerly.
    """
    axis = normalize_axis(int(ctx.attr("axis", 0)), x.ndim, ctx.node)
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
    if rows == 0 or cols == 0:
        return y
    if cols >= 0xFFFFFFFF:
        raise NotImplementedError(f"{ctx.node.describe()}: ArgMax over {cols} >= 2^32 - 1 columns")
    xc = contiguous(ctx, x)
    item = np.dtype(x.dtype).itemsize
    vec = 16 // item if (cols * item) % 16 == 0 and xc.data.ptr % 16 == 0 else 1
    chunk, blocks = _arg_split(cols, rows, sm_count(), vec)
    part = counts = y  # placeholders: one block per row stores the index itself
    if blocks > 1:
        part = scratch(ctx, rows * blocks * 8)
        counts = zeroed_counters(ctx, rows)
    fn = function(_SOURCE, f"argmax_split<{storage(ctx, x.dtype)}, {vec}>")
    fn(
        (rows, blocks),
        (256 if min(cols, chunk) > 1024 else row_threads(min(cols, chunk)),),
        (xc, y, part, counts, np.int64(cols), np.int64(chunk), np.int32(blocks), np.int32(last)),
    )
    return y


@REGISTRY.register("ArgMaxProb", since=1, domain=GENRT_DOMAIN)
def argmax_prob(ctx: KernelContext, x: cupy.ndarray) -> tuple[cupy.ndarray, cupy.ndarray]:
    """(ArgMax, max of Softmax) over the last axis, keepdims=0: a draft and its probability
    in one launch (see ``session.fusion.fuse_argmax_prob``)."""
    if x.ndim == 0 or x.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{ctx.node.describe()}: needs a float32/float16/bfloat16 tensor of rank >= 1, "
            f"got {x.dtype}"
        )
    rows, cols = rows_cols(x.shape, x.ndim - 1)
    idx = out(ctx, 0, x.shape[:-1], np.int64)
    prob = out(ctx, 1, x.shape[:-1], x.dtype)
    if rows and cols:
        fn = function(_SOURCE, f"argmax_prob_rows<{storage(ctx, x.dtype)}>")
        fn((rows,), (row_threads(cols),), (contiguous(ctx, x), idx, prob, np.int64(cols)))
    return idx, prob


#: Columns one block of argmax_split takes at least before a row is split.
_ARG_MIN_BLOCK = 2048
#: Blocks per SM a split ArgMax aims at (all rows together).
WAVES = 2


def _arg_split(cols: int, rows: int, sms: int, step: int) -> tuple[int, int]:
    """(chunk, blocks) of each row: about WAVES blocks per SM over the GPU, each block at
    least ``_ARG_MIN_BLOCK`` columns; ``chunk`` a multiple of ``step``."""
    want = max(1, (WAVES * sms) // max(rows, 1))
    if want == 1 or cols <= _ARG_MIN_BLOCK:
        return cols, 1
    chunk = max(-(-cols // want), _ARG_MIN_BLOCK)
    chunk = -(-chunk // step) * step
    blocks = -(-cols // chunk)
    return (cols, 1) if blocks == 1 else (chunk, blocks)
