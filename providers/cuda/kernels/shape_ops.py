"""CUDA kernels: reshape family (views), Transpose, Concat, Slice and Gather.

Shape, axes and slice-bound inputs are read on the host (see ``_common.host_ints``); they
are constants in the models this runtime targets, so capture never waits on the device.
"""

from __future__ import annotations

import math

import cupy
import numpy as np

from onnx_genrt.core.kernels import KernelContext
from onnx_genrt.core.op_rules import (
    check_index_range,
    normalize_axes,
    normalize_axis,
    reshape_target,
    slice_index,
)

from ..launch import Kernel
from ._common import (
    GRID_DEPENDENCY,
    OPTIONS,
    capturing,
    contiguous,
    function,
    host_ints,
    out,
    refuse_in_capture,
)
from ._registry import REGISTRY


def _view(ctx: KernelContext, x: cupy.ndarray, shape: list[int]) -> cupy.ndarray:
    """``x`` reshaped without a copy (a copy of a strided input is refused in capture)."""
    if not x.flags.c_contiguous:
        refuse_in_capture(ctx, "reshaping a non-contiguous tensor")
    return x.reshape(shape)


@REGISTRY.register("Reshape", since=1)
def reshape(ctx: KernelContext, x: cupy.ndarray, shape=None) -> cupy.ndarray:
    """Reshape as a view (shape attribute before opset 5, input after)."""
    target = host_ints(ctx, ctx.attr("shape", [])) if ctx.opset < 5 else host_ints(ctx, shape)
    return _view(ctx, x, reshape_target(ctx, tuple(x.shape), target))


@REGISTRY.register("Flatten", since=1)
def flatten(ctx: KernelContext, x: cupy.ndarray) -> cupy.ndarray:
    """Flatten to 2-D around ``axis`` (a view)."""
    axis = int(ctx.attr("axis", 1))
    axis = axis + x.ndim if axis < 0 else axis
    if not 0 <= axis <= x.ndim:
        raise ValueError(f"{ctx.node.describe()}: axis {axis} out of range for rank {x.ndim}")
    return _view(ctx, x, [math.prod(x.shape[:axis]), math.prod(x.shape[axis:])])


@REGISTRY.register("Squeeze", since=1)
def squeeze(ctx: KernelContext, x: cupy.ndarray, axes=None) -> cupy.ndarray:
    """Drop size-1 dims (axes attribute before opset 13, input after; none = all 1s)."""
    if ctx.opset < 13:
        raw = ctx.attr("axes", None)
    else:
        raw = None if axes is None else host_ints(ctx, axes)
    if raw is None:
        return _view(ctx, x, [d for d in x.shape if d != 1])
    ax = normalize_axes(list(raw), x.ndim, ctx.node)
    for a in ax:
        if x.shape[a] != 1:
            raise ValueError(f"{ctx.node.describe()}: cannot squeeze axis {a} of size {x.shape[a]}")
    return _view(ctx, x, [d for i, d in enumerate(x.shape) if i not in ax])


@REGISTRY.register("Unsqueeze", since=1)
def unsqueeze(ctx: KernelContext, x: cupy.ndarray, axes=None) -> cupy.ndarray:
    """Insert size-1 dims (axes attribute before opset 13, input after)."""
    raw = host_ints(ctx, ctx.attr("axes", [])) if ctx.opset < 13 else host_ints(ctx, axes)
    ax = set(normalize_axes(raw, x.ndim + len(raw), ctx.node))
    dims = iter(x.shape)
    return _view(ctx, x, [1 if i in ax else next(dims) for i in range(x.ndim + len(ax))])


@REGISTRY.register("Transpose", since=1)
def transpose(ctx: KernelContext, x: cupy.ndarray) -> cupy.ndarray:
    """Permute axes (default: reverse) into a contiguous output."""
    perm = ctx.attr("perm", None)
    perm = (
        list(range(x.ndim))[::-1] if perm is None else normalize_axes(list(perm), x.ndim, ctx.node)
    )
    if len(perm) != x.ndim:
        raise ValueError(f"{ctx.node.describe()}: perm {perm} does not match rank {x.ndim}")
    if perm == sorted(perm):
        return x
    moved = x.transpose(perm)
    y = out(ctx, 0, moved.shape, x.dtype)
    if y.size:
        cupy.copyto(y, moved)
    return y


#: Inputs one Concat launch takes (more are joined CONCAT_MAX at a time).
CONCAT_MAX = 8

_CONCAT_SOURCE = (
    GRID_DEPENDENCY
    + r"""
// y viewed as [outer, total] elements of type T (total = sum of the parts' widths, each
// part [outer, width_i] contiguous): one thread per output element finds its part.
template <typename T>
__global__ void concat_parts(T* __restrict__ y, long long outer, long long total,
                             long long col0, long long span, int parts,
                             const T* p0, const T* p1, const T* p2, const T* p3,
                             const T* p4, const T* p5, const T* p6, const T* p7,
                             long long w0, long long w1, long long w2, long long w3,
                             long long w4, long long w5, long long w6, long long w7) {
  GRID_WAIT();
  GRID_LAUNCH_DEPENDENTS();
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= outer * span) return;
  const long long o = i / span;
  long long c = i - o * span;
  const T* src[8] = {p0, p1, p2, p3, p4, p5, p6, p7};
  const long long w[8] = {w0, w1, w2, w3, w4, w5, w6, w7};
  int s = 0;
  while (s < parts - 1 && c >= w[s]) c -= w[s++];
  y[o * total + col0 + (i - o * span)] = src[s][o * w[s] + c];
}
"""
)
_CONCAT_TYPES = {
    1: "unsigned char",
    2: "unsigned short",
    4: "unsigned int",
    8: "unsigned long long",
}


@REGISTRY.register("Concat", since=1)
def concat(ctx: KernelContext, *inputs: cupy.ndarray) -> cupy.ndarray:
    """Join inputs along ``axis``: one launch per CONCAT_MAX contiguous inputs (the parts'
    element size picks the copy type), else one copy per input into its slice."""
    parts = [t for t in inputs if t is not None]
    rank = parts[0].ndim
    axis = normalize_axis(int(ctx.attr("axis", 1 if ctx.opset < 4 else 0)), rank, ctx.node)
    shape = list(parts[0].shape)
    shape[axis] = sum(int(t.shape[axis]) for t in parts)
    y = out(ctx, 0, shape, parts[0].dtype)
    if y.size == 0:
        return y
    itemsize = y.dtype.itemsize
    if itemsize in _CONCAT_TYPES and all(t.flags.c_contiguous for t in parts):
        _concat_launch(y, [t for t in parts if t.size], axis)
        return y
    index: list[slice] = [slice(None)] * rank
    offset = 0
    for t in parts:
        width = int(t.shape[axis])
        if width and t.size:
            index[axis] = slice(offset, offset + width)
            cupy.copyto(y[tuple(index)], t)
        offset += width
    return y


def _concat_launch(y: cupy.ndarray, parts: list[cupy.ndarray], axis: int) -> None:
    outer = math.prod(y.shape[:axis])
    total = y.size // outer
    fn = _concat_kernel(y.dtype.itemsize)
    col = 0
    for g in range(0, len(parts), CONCAT_MAX):
        group = parts[g : g + CONCAT_MAX]
        widths = [t.size // outer for t in group]
        span = sum(widths)
        ptrs = group + [group[0]] * (CONCAT_MAX - len(group))
        ws = [np.int64(w) for w in widths] + [np.int64(0)] * (CONCAT_MAX - len(group))
        n = outer * span
        args = (y, np.int64(outer), np.int64(total), np.int64(col), np.int64(span))
        fn(((n + 255) // 256,), (256,), (*args, np.int32(len(group)), *ptrs, *ws))
        col += span


def _concat_kernel(itemsize: int) -> Kernel:
    return function(_CONCAT_SOURCE, f"concat_parts<{_CONCAT_TYPES[itemsize]}>")


@REGISTRY.register("Slice", since=1)
def slice_(ctx: KernelContext, x: cupy.ndarray, starts=None, ends=None, axes=None, steps=None):
    """Strided slice into a contiguous output; bounds are host constants (clamped like ONNX)."""
    bounds = (None if v is None else host_ints(ctx, v) for v in (starts, ends, axes, steps))
    view = x[slice_index(ctx.node, x.ndim, *bounds)]
    y = out(ctx, 0, view.shape, x.dtype)
    if y.size:
        cupy.copyto(y, view)
    return y


_GATHER = cupy.ElementwiseKernel(
    "raw T data, raw I idx, int64 dim, int64 nidx, int64 inner, bool poison",
    "T y",
    """
    const long long q = i / inner, r = i - q * inner;
    const long long o = q / nidx, j = q - o * nidx;
    long long k = (long long)idx[j];
    if (k < 0) k += dim;
    if (k < 0 || k >= dim) {  // out of range: never read outside the table
      if (poison) { y = (T)(__int_as_float(0x7fc00000)); return; }  // NaN (float tables)
      k = k < 0 ? 0 : dim - 1;  // integer tables: clamp
    }
    y = data[(o * dim + k) * inner + r];
    """,
    "genrt_gather",
    options=OPTIONS,
)


@REGISTRY.register("Gather", since=1)
def gather(ctx: KernelContext, x: cupy.ndarray, indices: cupy.ndarray) -> cupy.ndarray:
    """Take along ``axis`` with device indices; negatives count from the end.

    Indices outside ``[-dim, dim)`` raise (IndexError naming the node and the index)
    where they can be checked: always for host indices, and for device indices on eager
    runs (one min/max read-back). Inside a CUDA graph capture no read-back is possible:
    a replayed step writes NaN for such an index into a float16/32/64 output (a decoder's
    non-finite probe then raises) and clamps it for an integer or bfloat16 one.
    """
    axis = normalize_axis(int(ctx.attr("axis", 0)), x.ndim, ctx.node)
    if not isinstance(indices, cupy.ndarray):
        check_index_range(ctx, np.asarray(indices), int(x.shape[axis]))
        refuse_in_capture(ctx, "uploading host indices")
        indices = cupy.asarray(indices)
    elif indices.size and not capturing(ctx):
        ends = cupy.stack([indices.min(), indices.max()]).get()
        check_index_range(ctx, ends, int(x.shape[axis]))
    shape = tuple(x.shape[:axis]) + tuple(indices.shape) + tuple(x.shape[axis + 1 :])
    y = out(ctx, 0, shape, x.dtype)
    if y.size == 0:
        return y
    data = contiguous(ctx, x).reshape(-1)
    idx = contiguous(ctx, indices).reshape(-1)
    dim = int(x.shape[axis])
    inner = math.prod(x.shape[axis + 1 :])
    poison = x.dtype.kind == "f"  # float16/32/64; bfloat16 and integer tables clamp
    _GATHER(data, idx, np.int64(dim), np.int64(idx.size), np.int64(inner), poison, y)
    return y
