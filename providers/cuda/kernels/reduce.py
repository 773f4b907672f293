"""CUDA kernels: ReduceSum.

Reduced axes that form one contiguous run (the usual case: the last axes, or all of them)
view the input as ``(outer, reduced, inner)``; one block sums each output, capturable.
Floats accumulate in float32 (float64 for float64), integers in int64 and wrap to their
own type on store. Other axis sets fall back to CuPy eagerly. Axes come from an attribute
(opset < 13) or a host-known input (constants are host-shadowed).
"""

from __future__ import annotations

import math

import cupy
import numpy as np

from onnx_genrt.core.kernels import KernelContext

from ._common import (
    DEVICE_COMMON,
    contiguous,
    function,
    host_ints,
    normalize_axis,
    out,
    refuse_in_capture,
)
from ._registry import REGISTRY

#: (C element type, accumulator type) per dtype the kernel handles.
_TYPES = {
    np.dtype(np.float32): ("float", "float"),
    np.dtype(np.float16): ("half_t", "float"),
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
template <> struct Acc<half_t, float> {
  static DEVI float load(const half_t* p, long long i) { return h2f(p[i]); }
  static DEVI void store(half_t* p, long long i, float v) { p[i] = f2h(v); }
};

template <typename A> DEVI A shfl_sum(A v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// One block per output (o, i) of x viewed as (outer, red, inner).
template <typename T, typename A>
__global__ void reduce_sum_mid(const T* __restrict__ x, T* __restrict__ y, long long red,
                               long long inner) {
  __shared__ A sh[32];
  const long long o = blockIdx.x / inner, i = blockIdx.x % inner;
  const T* base = x + o * red * inner + i;
  A s = (A)0;
  for (long long r = threadIdx.x; r < red; r += blockDim.x) s += Acc<T, A>::load(base, r * inner);
  s = shfl_sum(s);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  if (lane == 0) sh[warp] = s;
  __syncthreads();
  if (warp == 0) {
    s = lane < warps ? sh[lane] : (A)0;
    s = shfl_sum(s);
    if (lane == 0) Acc<T, A>::store(y, blockIdx.x, s);
  }
}
"""
)


def _threads(red: int) -> int:
    t = 32
    while t < 1024 and t < red:
        t *= 2
    return t


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
    axes = sorted({normalize_axis(ctx, int(a), x.ndim) for a in raw})
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
        fn = function(_SOURCE, f"reduce_sum_mid<{types[0]}, {types[1]}>")
        fn(
            (int(y.size),),
            (_threads(red),),
            (contiguous(ctx, x), y, np.int64(red), np.int64(inner)),
        )
        return y
    refuse_in_capture(ctx, f"ReduceSum of {x.dtype} over axes {ax}")
    acc = np.float32 if x.dtype == np.float16 else None
    res = cupy.sum(x, axis=tuple(ax), keepdims=keep, dtype=acc)
    cupy.copyto(y, res.reshape(y.shape), casting="unsafe")
    return y


@REGISTRY.register("ReduceMean", since=1)
def reduce_mean(ctx: KernelContext, x, axes=None):
    """Mean = the sum kernel, then one in-place scale (capturable like ReduceSum)."""
    if np.dtype(x.dtype).kind != "f":
        raise NotImplementedError(
            f"{ctx.node.describe()}: ReduceMean of {x.dtype} is not supported"
        )
    ax = _axes(ctx, x, axes, 18)
    y = reduce_sum(ctx, x, axes, 18)
    if ax is not None and y.size:
        count = math.prod(x.shape[a] for a in ax)
        y *= y.dtype.type(1.0 / count) if count else y.dtype.type(np.nan)
    return y


@REGISTRY.register("ReduceMax", since=1)
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
