"""CPU kernels: reductions (ReduceSum ... ReduceLogSumExp), ArgMax/ArgMin, TopK, CumSum/CumProd.

float16/bfloat16 reductions accumulate in float32; integer sums wrap in their own type.
CumSum/CumProd run a Numba loop (numpy accumulates slowly along non-last axes).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numba
import numpy as np

from onnx_genrt.core.kernels import KernelContext
from onnx_genrt.core.op_rules import normalize_axis

from ._native_small import argmax_native, int_sum_native
from ._registry import REGISTRY

F32 = np.dtype(np.float32)
F64 = np.dtype(np.float64)
BOOL = np.dtype(np.bool_)
_LOW_FLOATS = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))

Array = np.ndarray
Axes = tuple[int, ...]


# --------------------------------------------------------------------------- helpers


def _is_float(dt: np.dtype) -> bool:
    return dt.kind == "f" or dt in _LOW_FLOATS


def _acc_dtype(dt: np.dtype) -> np.dtype:
    """Accumulator type: float32 for 16-bit floats, else the input's own type."""
    return F32 if dt in _LOW_FLOATS else dt


def _reduce_axes(ctx: KernelContext, x: Array, axes_in: Array | None, input_since: int) -> Axes:
    """Axes to reduce: attribute before ``input_since``, optional input from it on.

    Empty/missing axes mean all axes, or none with noop_with_empty_axes=1 (then each element
    is "reduced" alone, e.g. ReduceSumSquare gives x**2).
    """
    if ctx.opset >= input_since:
        axes = None if axes_in is None else np.asarray(axes_in).reshape(-1).tolist()
        if not axes and ctx.attr("noop_with_empty_axes", 0):
            return ()
    else:
        axes = ctx.attr("axes")
    if not axes:
        return tuple(range(x.ndim))
    return tuple(sorted({normalize_axis(int(a), x.ndim, ctx.node) for a in axes}))


def _finish(ctx: KernelContext, res: Any, dtype: np.dtype, shape: tuple[int, ...]) -> Array:
    """Reduction result as an ndarray of the op's output dtype, in ctx's output buffer."""
    out = ctx.out(0, shape, dtype)
    with np.errstate(all="ignore"):
        np.copyto(out, np.asarray(res).reshape(shape), casting="unsafe")
    return out


def _out_shape(x: Array, axes: Axes, keepdims: bool) -> tuple[int, ...]:
    if keepdims:
        return tuple(1 if i in axes else d for i, d in enumerate(x.shape))
    return tuple(d for i, d in enumerate(x.shape) if i not in axes)


def _sum(x: Array, axes: Axes, kd: bool) -> Array:
    return np.add.reduce(x, axis=axes, keepdims=kd, dtype=_acc_dtype(x.dtype))


def _extreme(ufunc: np.ufunc, lowest: bool) -> Callable[[Array, Axes, bool], Array]:
    """Max/min reduction; an empty set gives -inf/+inf (int min/max, False/True for bool)."""

    def reduce(x: Array, axes: Axes, kd: bool) -> Array:
        if x.size:
            return ufunc.reduce(x, axis=axes, keepdims=kd)
        if x.dtype == BOOL:
            init: Any = not lowest
        elif x.dtype.kind in "iu":
            info = np.iinfo(x.dtype)
            init = info.min if lowest else info.max
        else:
            init = -np.inf if lowest else np.inf
        return ufunc.reduce(x, axis=axes, keepdims=kd, initial=init)

    return reduce


def _mean(x: Array, axes: Axes, kd: bool) -> Array:
    acc = _acc_dtype(x.dtype) if _is_float(x.dtype) else F64
    count = int(np.prod([x.shape[a] for a in axes], dtype=np.int64))
    return np.add.reduce(x, axis=axes, keepdims=kd, dtype=acc) / acc.type(count)


def _float_work(x: Array) -> Array:
    """x in a dtype fit for log/sqrt math: float32 for 16-bit floats, float64 for integers."""
    if x.dtype.kind in "iub":
        return x.astype(F64)
    return x.astype(F32) if x.dtype in _LOW_FLOATS else x


def _l1(x: Array, axes: Axes, kd: bool) -> Array:
    return _sum(np.absolute(x), axes, kd)


def _sum_square(x: Array, axes: Axes, kd: bool) -> Array:
    w = x.astype(F32) if x.dtype in _LOW_FLOATS else x  # float16 squares overflow early
    return _sum(np.square(w), axes, kd)


def _l2(x: Array, axes: Axes, kd: bool) -> Array:
    w = _float_work(x)
    return np.sqrt(np.add.reduce(np.square(w), axis=axes, keepdims=kd))


def _log_sum(x: Array, axes: Axes, kd: bool) -> Array:
    return np.log(np.add.reduce(_float_work(x), axis=axes, keepdims=kd))


def _log_sum_exp(x: Array, axes: Axes, kd: bool) -> Array:
    """log(sum(exp(x))), shifted by the max for stability."""
    w = _float_work(x)
    if w.size == 0:
        return np.log(np.add.reduce(w, axis=axes, keepdims=kd))
    m = np.maximum.reduce(w, axis=axes, keepdims=True)
    m[~np.isfinite(m)] = 0
    s = np.add.reduce(np.exp(w - m), axis=axes, keepdims=True)
    res = np.log(s) + m
    return res if kd else res.reshape(_out_shape(w, axes, False))


_REDUCERS: dict[str, tuple[Callable[[Array, Axes, bool], Array], int]] = {
    # op: (reduction, first opset taking axes as an input)
    "ReduceSum": (_sum, 13),
    "ReduceMean": (_mean, 18),
    "ReduceMax": (_extreme(np.maximum, True), 18),
    "ReduceMin": (_extreme(np.minimum, False), 18),
    "ReduceProd": (
        lambda x, a, kd: np.multiply.reduce(x, axis=a, keepdims=kd, dtype=_acc_dtype(x.dtype)),
        18,
    ),
    "ReduceL1": (_l1, 18),
    "ReduceL2": (_l2, 18),
    "ReduceLogSum": (_log_sum, 18),
    "ReduceLogSumExp": (_log_sum_exp, 18),
    "ReduceSumSquare": (_sum_square, 18),
}


def reduce(ctx: KernelContext, x: Array, axes: Array | None = None) -> Array:
    """Reduce over axes (keepdims, noop_with_empty_axes); the output keeps x's dtype."""
    fn, input_since = _REDUCERS[ctx.node.op_type]
    ax = _reduce_axes(ctx, x, axes, input_since)
    kd = bool(ctx.attr("keepdims", 1))
    with np.errstate(all="ignore"):
        res = fn(x, ax, kd)
    return _finish(ctx, res, x.dtype, _out_shape(x, ax, kd))


_SUM_IN_PLACE = {np.dtype(t) for t in (np.float32, np.float64, np.int32, np.int64)}


def _bind_reduce(ctx: KernelContext, inputs, out) -> Callable[[], Any] | None:
    """Replay closure for ReduceSum of float32/64 or int32/64 over a non-empty set of axes:
    ``np.add.reduce`` straight into the recorded output (what ``_sum`` computes). The axes
    input is compared with the recorded one on each replay; the generic call runs if it
    changed. None for every other reduction."""
    x, axes = inputs[0], (inputs[1] if len(inputs) > 1 else None)
    if ctx.node.op_type != "ReduceSum" or x.dtype not in _SUM_IN_PLACE or not x.size:
        return None
    if not isinstance(out, np.ndarray) or out.dtype != x.dtype:
        return None
    ax = _reduce_axes(ctx, x, axes, _REDUCERS["ReduceSum"][1])
    kd = bool(ctx.attr("keepdims", 1))
    if not ax or out.shape != _out_shape(x, ax, kd):
        return None
    recorded = None if axes is None else axes.tobytes()
    fast = functools.partial(np.add.reduce, x, axis=ax, keepdims=kd, out=out)

    def run() -> None:
        if axes.tobytes() != recorded:
            np.copyto(out, reduce(ctx, x, axes))
        else:
            fast()

    call = run if recorded is not None else fast
    if tuple(sorted(ax)) == tuple(range(x.ndim - len(ax), x.ndim)):  # trailing axes
        call.native = int_sum_native(x, axes, out, call)  # type: ignore[attr-defined]
    return call


REGISTRY.register(list(_REDUCERS), since=1, bind=_bind_reduce)(reduce)


# --------------------------------------------------------------------------- ArgMax / ArgMin


def _arg_extreme(ctx: KernelContext, x: Array, fn: Callable[..., Array]) -> Array:
    axis = normalize_axis(int(ctx.attr("axis", 0)), x.ndim, ctx.node)
    kd = bool(ctx.attr("keepdims", 1))
    if ctx.attr("select_last_index", 0):
        idx = x.shape[axis] - 1 - fn(np.flip(x, axis), axis=axis, keepdims=kd)
    else:
        idx = fn(x, axis=axis, keepdims=kd)
    return _finish(ctx, idx, np.dtype(np.int64), _out_shape(x, (axis,), kd))


def arg_max(ctx: KernelContext, x: Array) -> Array:
    """Index (int64) of the largest element along axis; first one unless select_last_index."""
    return _arg_extreme(ctx, x, np.argmax)


def arg_min(ctx: KernelContext, x: Array) -> Array:
    """Index (int64) of the smallest element along axis; first one unless select_last_index."""
    return _arg_extreme(ctx, x, np.argmin)


def _arg_binder(fn: Callable[..., Array]) -> Callable[..., Callable[[], Any] | None]:
    def bind(ctx: KernelContext, inputs, out) -> Callable[[], Any] | None:
        """Replay closure: numpy's arg-reduction straight into the recorded int64 output
        (first index, so not with select_last_index)."""
        (x,) = inputs
        if ctx.attr("select_last_index", 0) or not x.size or not isinstance(out, np.ndarray):
            return None
        axis = normalize_axis(int(ctx.attr("axis", 0)), x.ndim, ctx.node)
        kd = bool(ctx.attr("keepdims", 1))
        if out.dtype != np.int64 or out.shape != _out_shape(x, (axis,), kd):
            return None
        call = functools.partial(fn, x, axis=axis, out=out, keepdims=kd)
        if fn is np.argmax and axis == x.ndim - 1:
            call.native = argmax_native(x, out, call)  # type: ignore[attr-defined]
        return call

    return bind


REGISTRY.register("ArgMax", since=1, bind=_arg_binder(np.argmax))(arg_max)
REGISTRY.register("ArgMin", since=1, bind=_arg_binder(np.argmin))(arg_min)


# --------------------------------------------------------------------------- TopK


def _ascending_keys(rows: Array, largest: bool) -> Array:
    """Keys whose ascending order is the wanted order (descending values when ``largest``)."""
    if rows.dtype in _LOW_FLOATS:
        rows = rows.astype(F32)
    if not largest:
        return rows
    if rows.dtype.kind in "iub":
        return np.invert(rows)  # order-reversing without overflow, also for unsigned
    return np.negative(rows)


def _topk_rows(keys: Array, k: int) -> Array:
    """Per row of ``keys`` (rows, n), indices of the k smallest keys, ascending, ties by index."""
    rows, n = keys.shape
    if k == 0:
        return np.empty((rows, 0), np.int64)
    if 4 * k >= n:
        return np.argsort(keys, axis=1, kind="stable")[:, :k]
    # Select with a partition (O(n)): everything below the k-th key, then the first
    # equal-to-it elements in index order; a stable sort of the k picks finishes.
    kth = np.partition(keys, k - 1, axis=1)[:, k - 1 : k]
    less = keys < kth
    equal = keys == kth
    if keys.dtype.kind == "f" and np.isnan(kth).any():  # NaN sorts last: below it is all else
        key_nan, kth_nan = np.isnan(keys), np.isnan(kth)
        less |= ~key_nan & kth_nan
        equal |= key_nan & kth_nan
    room = k - np.count_nonzero(less, axis=1, keepdims=True)
    take = less | (equal & (np.cumsum(equal, axis=1) <= room))
    cols = np.nonzero(take)[1].reshape(rows, k)
    order = np.argsort(np.take_along_axis(keys, cols, axis=1), axis=1, kind="stable")
    return np.take_along_axis(cols, order, axis=1)


@REGISTRY.register("TopK", since=1)
def top_k(ctx: KernelContext, x: Array, k_in: Array | None = None) -> tuple[Array, Array]:
    """k largest (or smallest) along axis, sorted; equal values keep the lower index first."""
    k = int(ctx.attr("k")) if ctx.opset < 10 else int(np.asarray(k_in).reshape(-1)[0])
    axis = normalize_axis(int(ctx.attr("axis", -1)), x.ndim, ctx.node)
    largest = bool(ctx.attr("largest", 1))
    n = x.shape[axis]
    if not 0 <= k <= n:
        raise ValueError(f"{ctx.node.describe()}: k={k} out of range for axis of size {n}")
    moved = np.moveaxis(x, axis, -1)
    lead = moved.shape[:-1]
    rows = moved.reshape(-1, n)
    idx = _topk_rows(_ascending_keys(rows, largest), k)
    values = np.take_along_axis(rows, idx, axis=1)
    out_shape = (*lead, k)
    values = np.moveaxis(values.reshape(out_shape), -1, axis)
    indices = np.moveaxis(idx.astype(np.int64, copy=False).reshape(out_shape), -1, axis)
    v_out = ctx.out(0, values.shape, x.dtype)
    i_out = ctx.out(1, indices.shape, np.int64)
    np.copyto(v_out, values)
    np.copyto(i_out, indices)
    return v_out, i_out


# --------------------------------------------------------------------------- CumSum / CumProd


@numba.njit(cache=True)
def _scan_loop(x: Array, out: Array, reverse: bool, exclusive: bool, prod: bool) -> None:
    """Running sum/product over axis 1 of (outer, n, inner) arrays; inner loop is contiguous."""
    outer, n, inner = x.shape
    for o in range(outer):
        for s in range(n):
            j = n - 1 - s if reverse else s
            if s == 0:
                if exclusive:
                    out[o, j, :] = 1 if prod else 0
                else:
                    out[o, j, :] = x[o, j, :]
                continue
            p = j + 1 if reverse else j - 1
            src = p if exclusive else j
            if prod:
                for i in range(inner):
                    out[o, j, i] = out[o, p, i] * x[o, src, i]
            else:
                for i in range(inner):
                    out[o, j, i] = out[o, p, i] + x[o, src, i]


def _scan(ctx: KernelContext, x: Array, axis_in: Array, prod: bool) -> Array:
    """Inclusive/exclusive, forward/reverse running sum or product along the axis input."""
    axis = normalize_axis(int(np.asarray(axis_in).reshape(-1)[0]), x.ndim, ctx.node)
    exclusive, reverse = bool(ctx.attr("exclusive", 0)), bool(ctx.attr("reverse", 0))
    out = ctx.out(0, x.shape, x.dtype)
    if x.size == 0:
        return out
    acc = _acc_dtype(x.dtype)
    shape3 = (math.prod(x.shape[:axis]), x.shape[axis], math.prod(x.shape[axis + 1 :]))
    src = np.ascontiguousarray(x, dtype=acc).reshape(shape3)
    direct = acc == x.dtype and out.flags.c_contiguous
    dst = out.reshape(shape3) if direct else np.empty(shape3, acc)
    _scan_loop(src, dst, reverse, exclusive, prod)
    if not direct:
        np.copyto(out, dst.reshape(x.shape), casting="unsafe")
    return out


@REGISTRY.register("CumSum", since=11)
def cum_sum(ctx: KernelContext, x: Array, axis: Array) -> Array:
    """Running sum along an axis (attributes exclusive, reverse)."""
    return _scan(ctx, x, axis, prod=False)


@REGISTRY.register("CumProd", since=26)
def cum_prod(ctx: KernelContext, x: Array, axis: Array) -> Array:
    """Running product along an axis (attributes exclusive, reverse)."""
    return _scan(ctx, x, axis, prod=True)
