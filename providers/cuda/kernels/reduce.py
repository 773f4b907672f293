"""CUDA kernels: ReduceSum, ReduceMean, ReduceMax and ArgMax.

Reduced axes that form one contiguous run (the usual case: the last axes, or all of them)
view the input as ``(outer, reduced, inner)``, capturable. One block sums each output when
there are enough outputs to fill the GPU; few long ones (the engine's non-finite probe sums
a whole logits tensor into a scalar) are split over many blocks in one launch, the last
block adding the partial sums in a fixed order (deterministic).
Floats accumulate in float32 (float64 for float64; float16 and bfloat16 round once on
store), integers in int64 and wrap to their own type on store. Other axis sets fall back to
CuPy eagerly. Axes come from an attribute (opset < 13) or a host-known input (constants are
host-shadowed).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from typing import Any

import cupy
import numpy as np

from onnx_genrt.core.kernels import KernelContext, NodeInfo
from onnx_genrt.core.op_rules import normalize_axis

from ._common import (
    ARG_KEYS,
    BF16,
    DEVICE_COMMON,
    F16,
    contiguous,
    function,
    host_ints,
    out,
    refuse_in_capture,
    row_threads,
    rows_cols,
    scratch,
    sm_count,
    storage,
)
from ._registry import REGISTRY

#: (C element type, accumulator type) per dtype the kernel handles.
_TYPES = {
    np.dtype(np.float32): ("float", "float"),
    F16: ("half_t", "float"),
    BF16: ("bf16_t", "float"),
    np.dtype(np.float64): ("double", "double"),
    np.dtype(np.int32): ("int", "long long"),
    np.dtype(np.int64): ("long long", "long long"),
}

_SOURCE = (
    DEVICE_COMMON
    + r"""
template <typename T, typename A> struct Acc {
  static DEVI A load(const T* p, long long i) { return (A)p[i]; }
  static DEVI void store(T* p, long long i, A v) { p[i] = (T)v; }
};
// 16-bit floats (half_t, bf16_t) through the shared conversions.
template <typename T> struct Acc16 {
  static DEVI float load(const T* p, long long i) { return ld(p, i); }
  static DEVI void store(T* p, long long i, float v) { st(p, i, v); }
};
template <> struct Acc<half_t, float> : Acc16<half_t> {};
template <> struct Acc<bf16_t, float> : Acc16<bf16_t> {};

template <typename A> DEVI A shfl_sum(A v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <typename A> DEVI A block_sum_a(A v, A* sh) {  // every thread gets the sum
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  v = shfl_sum(v);
  __syncthreads();
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  if (warp == 0) {
    A w = lane < warps ? sh[lane] : (A)0;
    w = shfl_sum(w);
    if (lane == 0) sh[32] = w;
  }
  __syncthreads();
  return sh[32];
}

// Output (o, i) of x viewed as (outer, red, inner), split over `blocks` blocks of `chunk`
// reduced elements: grid (outputs, blocks). VEC > 1 (inner == 1, 16-byte aligned rows):
// 16-byte loads, four in flight per thread. With one block the sum is stored directly;
// otherwise each block stores its partial sum, and the last block to finish (a counter per
// output, set back to zero by that block) adds the partials in block order, so the result
// does not depend on which block finishes last.
template <typename T, typename A, int VEC>
__global__ void reduce_sum_split(const T* __restrict__ x, T* __restrict__ y,
                                 A* __restrict__ part, int* __restrict__ counters,
                                 long long red, long long inner, long long chunk, int blocks) {
  __shared__ A sh[33];
  __shared__ int is_last;
  GRID_WAIT();
  GRID_LAUNCH_DEPENDENTS();
  const long long out = blockIdx.x;
  const int blk = blockIdx.y;
  const long long o = out / inner, i = out % inner;
  const T* base = x + o * red * inner + i;
  const long long r0 = (long long)blk * chunk, r1 = min(r0 + chunk, red);
  A s = (A)0;
  long long r = r0;
  if (VEC > 1) {
    union V { uint4 u; T e[VEC]; };
    const long long stride = (long long)blockDim.x * VEC;
    const long long vend = r0 + (r1 - r0) / VEC * VEC;
    for (long long j = r0 + (long long)threadIdx.x * VEC; j < vend; j += 4 * stride) {
      V w[4];
#pragma unroll
      for (int u = 0; u < 4; ++u)
        if (j + u * stride < vend) w[u].u = *reinterpret_cast<const uint4*>(base + j + u * stride);
#pragma unroll
      for (int u = 0; u < 4; ++u)
        if (j + u * stride < vend)
#pragma unroll
          for (int k = 0; k < VEC; ++k) s += Acc<T, A>::load(w[u].e, k);
    }
    r = vend;
  }
  for (r += threadIdx.x; r < r1; r += blockDim.x) s += Acc<T, A>::load(base, r * inner);
  s = block_sum_a(s, sh);
  if (blocks == 1) {
    if (threadIdx.x == 0) Acc<T, A>::store(y, out, s);
    return;
  }
  A* P = part + out * blocks;
  if (threadIdx.x == 0) {
    P[blk] = s;
    __threadfence();
    const int last = atomicAdd(counters + out, 1) == blocks - 1;
    if (last) counters[out] = 0;  // every block has counted: ready for the next launch
    is_last = last;
  }
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  A t = (A)0;
  for (int k = threadIdx.x; k < blocks; k += blockDim.x) t += __ldcg(P + k);
  t = block_sum_a(t, sh);
  if (threadIdx.x == 0) Acc<T, A>::store(y, out, t);
}
"""
)


def _threads(red: int) -> int:
    t = 32
    while t < 256 and t < red:
        t *= 2
    return t


#: Zeroed int32 counter arrays per provider, newest first (older ones stay alive for the
#: graphs captured with them).
_COUNTERS: weakref.WeakKeyDictionary[Any, list[cupy.ndarray]] = weakref.WeakKeyDictionary()
_COUNTERS_NO_PROVIDER: dict[int, list[cupy.ndarray]] = {}
_COUNTERS_MIN = 4096


def zeroed_counters(ctx: KernelContext, n: int) -> cupy.ndarray:
    """At least ``n`` int32 counters that are zero whenever a kernel starts.

    For last-block-done reductions: a kernel that counts on them sets each one it used back
    to zero before it ends (the last block does), so no memset is needed per launch or per
    replay. One array per provider, whose stream orders the kernels using it; it is zeroed
    when allocated, only outside a capture (run the step eagerly first, as for scratch).
    """
    provider = ctx.provider
    if provider is None:
        held = _COUNTERS_NO_PROVIDER.setdefault(cupy.cuda.runtime.getDevice(), [])
    else:
        held = _COUNTERS.get(provider)
        if held is None:
            held = _COUNTERS[provider] = []
    if not held or held[0].size < n:
        refuse_in_capture(ctx, f"allocating {n} zeroed counters")
        size = max(int(n), _COUNTERS_MIN, 2 * held[0].size if held else 0)
        held.insert(0, cupy.zeros(size, np.int32))
    return held[0]


#: Elements one block of reduce_sum_split takes at least before the work is split.
_MIN_BLOCK_ELEMS = 4096
#: Blocks per SM a split ReduceSum aims at (all outputs together).
WAVES = 2


def _split(red: int, outputs: int, sms: int, step: int) -> tuple[int, int]:
    """(chunk, blocks) of each output's ``red`` elements: about WAVES blocks per SM over the
    GPU, each block at least ``_MIN_BLOCK_ELEMS`` elements; ``chunk`` a multiple of ``step``."""
    want = max(1, (WAVES * sms) // max(outputs, 1))
    if want == 1 or red <= _MIN_BLOCK_ELEMS:
        return red, 1
    chunk = max(-(-red // want), _MIN_BLOCK_ELEMS)
    chunk = -(-chunk // step) * step
    blocks = -(-red // chunk)
    return (red, 1) if blocks == 1 else (chunk, blocks)


def _axes(ctx: KernelContext, x, axes_in, input_from: int = 13) -> list[int] | None:
    """Sorted axes to reduce; None means "no reduction" (noop_with_empty_axes).

    ``input_from`` is the opset from which axes come as an input (13 for ReduceSum, 18 for
    the other reductions)."""
    if ctx.opset >= input_from:
        raw = host_ints(ctx, axes_in) if axes_in is not None else []
    else:
        raw = list(ctx.attr("axes", []) or [])
    if not raw:
        if ctx.attr("noop_with_empty_axes", 0):
            return None
        return list(range(x.ndim))
    axes = sorted({normalize_axis(int(a), x.ndim, ctx.node) for a in raw})
    return axes


@REGISTRY.register("ReduceSum", since=1)
def reduce_sum(ctx: KernelContext, x, axes=None, _input_from: int = 13):
    """Sum over ``axes`` (keepdims default 1); contiguous axis runs are capturable."""
    keep = bool(ctx.attr("keepdims", 1))
    ax = _axes(ctx, x, axes, _input_from)
    if ax is None:
        y = out(ctx, 0, x.shape, x.dtype)
        if y.size:
            cupy.copyto(y, x)
        return y
    shape = (
        [1 if i in ax else d for i, d in enumerate(x.shape)]
        if keep
        else [d for i, d in enumerate(x.shape) if i not in ax]
    )
    y = out(ctx, 0, shape, x.dtype)
    if y.size == 0:
        return y
    contiguous_run = not ax or ax == list(range(ax[0], ax[-1] + 1))
    types = _TYPES.get(np.dtype(x.dtype))
    if types is not None and contiguous_run:
        lo, hi = (ax[0], ax[-1] + 1) if ax else (0, 0)
        red = math.prod(x.shape[lo:hi])
        inner = math.prod(x.shape[hi:])
        if red == 0:
            y.fill(0)
            return y
        xc = contiguous(ctx, x)
        item = np.dtype(x.dtype).itemsize
        vec = 16 // item if inner == 1 and (red * item) % 16 == 0 and xc.data.ptr % 16 == 0 else 1
        outputs = int(y.size)
        chunk, blocks = _split(red, outputs, sm_count(), vec)
        part = counts = y  # placeholders: one block per output stores the sum itself
        if blocks > 1:
            part = scratch(ctx, outputs * blocks * 8)
            counts = zeroed_counters(ctx, outputs)
        fn = function(_SOURCE, f"reduce_sum_split<{types[0]}, {types[1]}, {vec}>")
        fn(
            (outputs, blocks),
            (_threads(min(red, chunk)),),
            (
                xc,
                y,
                part,
                counts,
                np.int64(red),
                np.int64(inner),
                np.int64(chunk),
                np.int32(blocks),
            ),
        )
        return y
    refuse_in_capture(ctx, f"ReduceSum of {x.dtype} over axes {ax}")
    acc = np.float32 if x.dtype in (F16, BF16) else None
    res = cupy.sum(x, axis=tuple(ax), keepdims=keep, dtype=acc)
    cupy.copyto(y, res.reshape(y.shape), casting="unsafe")
    return y


@REGISTRY.register("ReduceMean", since=1)
def reduce_mean(ctx: KernelContext, x, axes=None):
    """Mean = the sum kernel, then one in-place scale (capturable like ReduceSum)."""
    if np.dtype(x.dtype).kind != "f" and x.dtype != BF16:
        raise NotImplementedError(
            f"{ctx.node.describe()}: ReduceMean of {x.dtype} is not supported"
        )
    ax = _axes(ctx, x, axes, 18)
    y = reduce_sum(ctx, x, axes, 18)
    if ax is not None and y.size:
        count = math.prod(x.shape[a] for a in ax)
        y *= y.dtype.type(1.0 / count) if count else y.dtype.type(np.nan)
    return y


def _not_empty(node: NodeInfo, input_types: Sequence[Any]) -> str | None:
    """An input known to be empty at placement is left to another provider."""
    first = input_types[0] if input_types else None
    shape = first.shape if first is not None else None
    if shape is not None and 0 in shape:
        return f"{node.op_type} of an empty tensor is not supported on CUDA"
    return None


@REGISTRY.register("ReduceMax", since=1, check=_not_empty)
def reduce_extreme(ctx: KernelContext, x, axes=None):
    """Max over ``axes`` through CuPy's reduction kernel, written into the output.

    ReduceMin through ``cupy.amin`` failed its GPU test in the last lane run (cause not yet
    found), so it is not claimed; ReduceMax passed in fp32 and fp16, captured."""
    keep = bool(ctx.attr("keepdims", 1))
    ax = _axes(ctx, x, axes, 18)
    if ax is None:
        y = out(ctx, 0, x.shape, x.dtype)
        cupy.copyto(y, x)
        return y
    shape = (
        [1 if i in ax else d for i, d in enumerate(x.shape)]
        if keep
        else [d for i, d in enumerate(x.shape) if i not in ax]
    )
    y = out(ctx, 0, shape, x.dtype)
    if x.size == 0:
        raise ValueError(f"{ctx.node.describe()}: {ctx.node.op_type} of an empty tensor")
    cupy.amax(x, axis=tuple(ax), keepdims=keep, out=y)
    return y


_ARGMAX_SOURCE = (
    DEVICE_COMMON
    + ARG_KEYS
    + r"""
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

// exp(x[c] - m) summed over columns [c0, c1) of row xr by the block's threads (16-byte loads
// where VEC > 1); each thread's share, to be summed by block_sum.
template <typename S, int VEC>
DEVI float chunk_exp_sum(const S* xr, long long c0, long long c1, float m) {
  float s = 0.f;
  long long c = c0;
  if (VEC > 1) {
    const long long stride = (long long)blockDim.x * VEC;
    const long long vend = c0 + (c1 - c0) / VEC * VEC;
    for (long long j = c0 + (long long)threadIdx.x * VEC; j < vend; j += stride) {
      const uint4 w = *reinterpret_cast<const uint4*>(xr + j);
#pragma unroll
      for (int k = 0; k < VEC; ++k) s += expf(vec_elem(w, k, xr) - m);
    }
    c = vend;
  }
  for (c += threadIdx.x; c < c1; c += blockDim.x) s += expf(ld(xr, c) - m);
  return s;
}

// ArgMax of each row of x (rows, cols < 2^32 - 1), a row split over `blocks` blocks of `chunk`
// columns: grid (rows, blocks). VEC > 1 (16-byte aligned rows): 16-byte loads, four in flight
// per thread. With one block the index is stored directly; otherwise each block stores its
// largest key, and the last block to finish (a counter per row, set back to zero by that
// block) takes the largest of them: the same pick whichever block finishes last.
// PROB (ArgMaxProb): also prob[row] = 1 / sum(exp(x - max)), the largest softmax probability.
// Each block sums exp(x - its own max) over its chunk (a second pass, from cache) into
// sums[row][blk] = (its max, its sum); the last block rescales them to the row's max and adds
// them in block order (the same bits whichever block finishes last). A block whose chunk is
// all -inf adds nothing unless the row is (then NaN, as softmax of such a row).
template <typename S, int VEC, bool PROB>
__global__ void argmax_split(const S* __restrict__ x, long long* __restrict__ y,
                             S* __restrict__ prob, unsigned long long* __restrict__ part,
                             float2* __restrict__ sums, int* __restrict__ counters,
                             long long cols, long long chunk, int blocks, int last) {
  __shared__ unsigned long long sh[32];
  __shared__ float fsh[33];
  __shared__ float max_sh;
  __shared__ int is_last;
  GRID_WAIT();
  GRID_LAUNCH_DEPENDENTS();
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
  float s = 0.f;  // PROB: the block's sum of exp(x - m), m its chunk's largest value
  if constexpr (PROB) {
    if (threadIdx.x == 0) max_sh = ld(xr, arg_index(best, last));
    __syncthreads();
    s = block_sum(chunk_exp_sum<S, VEC>(xr, c0, c1, max_sh), fsh);
  }
  if (blocks == 1) {
    if (threadIdx.x == 0) {
      y[row] = arg_index(best, last);
      if constexpr (PROB) st(prob, row, 1.f / s);
    }
    return;
  }
  unsigned long long* P = part + row * blocks;
  if (threadIdx.x == 0) {
    P[blk] = best;
    if constexpr (PROB) sums[row * blocks + blk] = make_float2(max_sh, s);
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
  if constexpr (PROB) {
    if (threadIdx.x == 0) max_sh = ld(xr, arg_index(best, last));
    __syncthreads();
    const float m = max_sh;
    float t = 0.f;
    for (int k = threadIdx.x; k < blocks; k += blockDim.x) {
      const float2 p = __ldcg(sums + row * blocks + k);
      if (!(p.x == neg_inf() && m != neg_inf())) t += p.y * expf(p.x - m);
    }
    s = block_sum(t, fsh);
  }
  if (threadIdx.x == 0) {
    y[row] = arg_index(best, last);
    if constexpr (PROB) st(prob, row, 1.f / s);
  }
}
"""
)


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
    argmax_rows(ctx, x, y, last=last)
    return y


def argmax_rows(
    ctx: KernelContext,
    x: cupy.ndarray,
    y: cupy.ndarray,
    *,
    last: int = 0,
    prob: cupy.ndarray | None = None,
) -> None:
    """Launch ``argmax_split`` over the last axis of ``x`` into ``y`` (int64, one per row):
    long rows split over many blocks in one launch. With ``prob`` (ArgMaxProb), also each
    row's largest softmax probability, ``1 / sum(exp(x - max))``, in x's type."""
    rows, cols = rows_cols(x.shape, x.ndim - 1)
    if rows == 0 or cols == 0:
        return
    if cols >= 0xFFFFFFFF:
        raise NotImplementedError(
            f"{ctx.node.describe()}: {ctx.node.op_type} over {cols} >= 2^32 - 1 columns"
        )
    xc = contiguous(ctx, x)
    item = np.dtype(x.dtype).itemsize
    vec = 16 // item if (cols * item) % 16 == 0 and xc.data.ptr % 16 == 0 else 1
    chunk, blocks = _arg_split(cols, rows, sm_count(), vec)
    with_prob = prob is not None
    part = sums = counts = y  # placeholders: one block per row stores its results itself
    if blocks > 1:  # keys [rows, blocks] (8 bytes), then (max, sum) float pairs [rows, blocks]
        part = scratch(ctx, rows * blocks * (16 if with_prob else 8))
        sums = part[rows * blocks * 8 :] if with_prob else y
        counts = zeroed_counters(ctx, rows)
    fn = function(
        _ARGMAX_SOURCE,
        f"argmax_split<{storage(ctx, x.dtype)}, {vec}, {'true' if with_prob else 'false'}>",
    )
    fn(
        (rows, blocks),
        (256 if min(cols, chunk) > 1024 else row_threads(min(cols, chunk)),),
        (
            xc,
            y,
            prob if with_prob else y,
            part,
            sums,
            counts,
            np.int64(cols),
            np.int64(chunk),
            np.int32(blocks),
            np.int32(last),
        ),
    )


#: Columns one block of argmax_split takes at least before a row is split.
_ARG_MIN_BLOCK = 2048


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
