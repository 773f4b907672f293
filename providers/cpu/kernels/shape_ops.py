"""CPU kernels: shape manipulation, indexing and data movement (numpy only)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from onnx import helper

from onnx_genrt.core.kernels import KernelContext, NodeInfo
from onnx_genrt.core.op_rules import (
    check_index_range,
    normalize_axes,
    normalize_axis,
    reshape_target,
    slice_index,
)

from ._native_rows import gather_rows_native
from ._native_small import concat_native
from ._registry import REGISTRY

Array = np.ndarray


# ----------------------------------------------------------------------------- helpers


def _ints(values: Array | Sequence[int] | None) -> list[int]:
    """A 1-D int tensor (or list) as Python ints; None gives []."""
    if values is None:
        return []
    return [int(v) for v in np.asarray(values).reshape(-1)]


def _contig(a: Array) -> Array:
    """``a`` itself when C-contiguous, else a contiguous copy (keeps 0-d arrays 0-d)."""
    return a if a.flags.c_contiguous else np.ascontiguousarray(a)


def _materialize(ctx: KernelContext, view: Array, index: int = 0) -> Array:
    """Copy ``view`` into output buffer ``index``."""
    out = ctx.out(index, view.shape, view.dtype)
    np.copyto(out, view)
    return out


def _copy_reshaped(ctx: KernelContext, view: Array, shape: tuple[int, ...]) -> Array:
    """Copy ``view`` (e.g. a transposed reshape) into output 0 of final ``shape``."""
    out = ctx.out(0, shape, view.dtype)
    np.copyto(out.reshape(view.shape), view)
    return out


def _scalar(a: Array | None, default: float | int | None = None) -> float | int | None:
    """The single element of ``a`` as a Python number (``default`` when absent or empty)."""
    if a is None or np.asarray(a).size == 0:
        return default
    return np.asarray(a).reshape(-1)[0].item()


def _normalized_indices(ctx: KernelContext, idx: Array, dim: int) -> Array:
    """Bounds-check indices and map negatives to positives (as intp)."""
    idx = np.asarray(idx)
    check_index_range(ctx, idx, dim)
    idx = idx.astype(np.intp, copy=False)
    if idx.size and idx.min() < 0:
        idx = np.where(idx < 0, idx + dim, idx)
    return idx


def _np_dtype(code: int) -> np.dtype:
    """numpy dtype for an ONNX element type code."""
    from onnx_genrt.core.dtypes import DType

    try:
        return DType.from_onnx(code).numpy
    except TypeError:
        return np.dtype(helper.tensor_dtype_to_np_dtype(code))


def _outputs(parts: Sequence[Array]) -> Array | tuple[Array, ...]:
    return parts[0] if len(parts) == 1 else tuple(parts)


# ----------------------------------------------------------------------------- reshape family


@REGISTRY.register("Reshape", since=1)
def reshape(ctx: KernelContext, x: Array, shape: Array | None = None) -> Array:
    """Reshape (shape attribute before opset 5, input after)."""
    target = _ints(ctx.attr("shape", [])) if ctx.opset < 5 else _ints(shape)
    return x.reshape(reshape_target(ctx, x.shape, target))


@REGISTRY.register("Flatten", since=1)
def flatten(ctx: KernelContext, x: Array) -> Array:
    """Flatten to 2-D around ``axis``."""
    axis = int(ctx.attr("axis", 1))
    axis = axis + x.ndim if axis < 0 else axis
    if not 0 <= axis <= x.ndim:
        raise ValueError(f"{ctx.node.describe()}: axis {axis} out of range for rank {x.ndim}")
    return x.reshape(math.prod(x.shape[:axis]), math.prod(x.shape[axis:]))


@REGISTRY.register("Squeeze", since=1)
def squeeze(ctx: KernelContext, x: Array, axes: Array | None = None) -> Array:
    """Remove size-1 dims (axes attribute before opset 13, input after; none = all 1s)."""
    raw = ctx.attr("axes", None) if ctx.opset < 13 else (None if axes is None else _ints(axes))
    if raw is None:
        return x.reshape([d for d in x.shape if d != 1])
    ax = normalize_axes(raw, x.ndim, ctx.node)
    for a in ax:
        if x.shape[a] != 1:
            raise ValueError(f"{ctx.node.describe()}: cannot squeeze axis {a} of size {x.shape[a]}")
    return x.reshape([d for i, d in enumerate(x.shape) if i not in ax])


@REGISTRY.register("Unsqueeze", since=1)
def unsqueeze(ctx: KernelContext, x: Array, axes: Array | None = None) -> Array:
    """Insert size-1 dims (axes attribute before opset 13, input after)."""
    raw = _ints(ctx.attr("axes", [])) if ctx.opset < 13 else _ints(axes)
    ax = set(normalize_axes(raw, x.ndim + len(raw), ctx.node))
    dims = iter(x.shape)
    return x.reshape([1 if i in ax else next(dims) for i in range(x.ndim + len(ax))])


@REGISTRY.register("Transpose", since=1)
def transpose(ctx: KernelContext, x: Array) -> Array:
    """Permute axes (default: reverse) into a contiguous output."""
    perm = ctx.attr("perm", None)
    perm = list(range(x.ndim))[::-1] if perm is None else normalize_axes(perm, x.ndim, ctx.node)
    if len(perm) != x.ndim:
        raise ValueError(f"{ctx.node.describe()}: perm {perm} does not match rank {x.ndim}")
    if perm == sorted(perm):
        return x
    return _materialize(ctx, x.transpose(perm))


# ----------------------------------------------------------------------------- shape queries


@REGISTRY.register("ConstantOfShape", since=9)
def constant_of_shape(ctx: KernelContext, shape: Array) -> Array:
    """A tensor of ``shape`` filled with the ``value`` attribute (default float32 0)."""
    value = ctx.attr("value", None)
    value = np.zeros(1, np.float32) if value is None else np.asarray(value).reshape(-1)
    dims = _ints(shape)
    if any(d < 0 for d in dims):
        raise ValueError(f"{ctx.node.describe()}: negative dimension in shape {dims}")
    out = ctx.out(0, dims, value.dtype)
    out.fill(value[0])
    return out


@REGISTRY.register("Range", since=11)
def range_(ctx: KernelContext, start: Array, limit: Array, delta: Array) -> Array:
    """``start + i * delta`` for ``i < max(ceil((limit - start) / delta), 0)``."""
    dtype = np.asarray(start).dtype
    s, lim, d = (np.asarray(v).item() for v in (start, limit, delta))
    if d == 0:
        raise ValueError(f"{ctx.node.describe()}: delta must not be zero")
    n = max(int(math.ceil((lim - s) / d)), 0)
    if dtype.kind in "iu":
        return (s + d * np.arange(n, dtype=np.int64)).astype(dtype)
    return (np.asarray(s, dtype) + np.arange(n, dtype=dtype) * np.asarray(d, dtype)).astype(dtype)


@REGISTRY.register("EyeLike", since=9)
def eye_like(ctx: KernelContext, x: Array) -> Array:
    """2-D identity-like matrix with ones on diagonal ``k``."""
    if x.ndim != 2:
        raise ValueError(f"{ctx.node.describe()}: input must be 2-D, got shape {x.shape}")
    code = ctx.attr("dtype", None)
    dtype = x.dtype if code is None else _np_dtype(int(code))
    out = ctx.out(0, x.shape, dtype)
    out.fill(0)
    k = int(ctx.attr("k", 0))
    rows = np.arange(max(0, -k), min(x.shape[0], x.shape[1] - k))
    out[rows, rows + k] = 1
    return out


# ----------------------------------------------------------------------------- join / split / slice


def concat(ctx: KernelContext, *inputs: Array) -> Array:
    """Join inputs along ``axis``."""
    rank = inputs[0].ndim
    axis = normalize_axis(int(ctx.attr("axis", 1 if ctx.opset < 4 else 0)), rank, ctx.node)
    shape = list(inputs[0].shape)
    shape[axis] = sum(t.shape[axis] for t in inputs)
    out = ctx.out(0, shape, inputs[0].dtype)
    return np.concatenate(inputs, axis=axis, out=out)


def _bind_concat(
    ctx: KernelContext, inputs: Sequence[Array], out: Array
) -> Callable[[], Any] | None:
    """Replay closure: ``np.concatenate`` into the recorded output, inputs of its dtype."""
    if not isinstance(out, np.ndarray) or any(t.dtype != out.dtype for t in inputs):
        return None
    axis = normalize_axis(int(ctx.attr("axis", 1 if ctx.opset < 4 else 0)), out.ndim, ctx.node)
    call = functools.partial(np.concatenate, tuple(inputs), axis=axis, out=out)
    call.native = concat_native(tuple(inputs), axis, out, call)  # type: ignore[attr-defined]
    return call


REGISTRY.register("Concat", since=1, bind=_bind_concat)(concat)


def _split_sizes(ctx: KernelContext, dim: int, split: Array | None, n_out: int) -> list[int]:
    """Chunk lengths for Split across its opset versions."""
    sizes = _ints(ctx.attr("split", None)) if ctx.opset < 13 else _ints(split)
    if sizes:
        if len(sizes) != n_out or sum(sizes) != dim or min(sizes) < 0:
            raise ValueError(
                f"{ctx.node.describe()}: split {sizes} does not fit {n_out} outputs of dim {dim}"
            )
        return sizes
    if ctx.opset >= 18 and ctx.attr("num_outputs", None) is not None:
        n = int(ctx.attr("num_outputs"))
        chunk = -(-dim // n)  # ceil: the last chunk may be smaller
        return [min(chunk, max(dim - i * chunk, 0)) for i in range(n)]
    if dim % n_out:
        raise ValueError(f"{ctx.node.describe()}: dim {dim} not divisible into {n_out} parts")
    return [dim // n_out] * n_out


@REGISTRY.register("Split", since=1)
def split(ctx: KernelContext, x: Array, split: Array | None = None) -> Array | tuple[Array, ...]:
    """Split along ``axis`` by sizes (attribute < 13, input >= 13) or into equal parts."""
    axis = normalize_axis(int(ctx.attr("axis", 0)), x.ndim, ctx.node)
    n_out = len(ctx.node.output_names) or 1
    sizes = _split_sizes(ctx, x.shape[axis], split, n_out)
    bounds = np.cumsum([0, *sizes])
    index: list[slice] = [slice(None)] * x.ndim
    parts = []
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        index[axis] = slice(int(lo), int(hi))
        parts.append(_contig(x[tuple(index)]))
    return _outputs(parts)


@REGISTRY.register("Slice", since=1)
def slice_(
    ctx: KernelContext,
    x: Array,
    starts: Array | None = None,
    ends: Array | None = None,
    axes: Array | None = None,
    steps: Array | None = None,
) -> Array:
    """Strided slice; attributes before opset 10, inputs after (negative steps clamp)."""
    bounds = (None if v is None else _ints(v) for v in (starts, ends, axes, steps))
    index = slice_index(ctx.node, x.ndim, *bounds)
    return _contig(x[index])


# ----------------------------------------------------------------------------- expand / tile / pad


@REGISTRY.register("Expand", since=8)
def expand(ctx: KernelContext, x: Array, shape: Array) -> Array:
    """Broadcast ``x`` against ``shape`` (bidirectionally) into a new array."""
    try:
        target = np.broadcast_shapes(x.shape, tuple(_ints(shape)))
    except ValueError as err:
        raise ValueError(f"{ctx.node.describe()}: {err}") from None
    return _materialize(ctx, np.broadcast_to(x, target))


@REGISTRY.register("Tile", since=6)
def tile(ctx: KernelContext, x: Array, repeats: Array) -> Array:
    """Repeat ``x`` ``repeats[i]`` times along each axis."""
    reps = _ints(repeats)
    if len(reps) != x.ndim or any(r < 0 for r in reps):
        raise ValueError(f"{ctx.node.describe()}: bad repeats {reps} for rank {x.ndim}")
    return np.tile(x, reps) if x.ndim else x.copy()


@REGISTRY.register("Tile", since=1)
def tile_opset1(ctx: KernelContext, x: Array, tiles: Array, axis: Array) -> Array:
    """Tile before opset 6: ``tiles`` copies of ``x`` along the one axis ``axis`` (inputs)."""
    count, ax = _ints(tiles), _ints(axis)
    if len(count) != 1 or len(ax) != 1 or count[0] < 0 or not -x.ndim <= ax[0] < x.ndim:
        raise ValueError(
            f"{ctx.node.describe()}: tiles {count} and axis {ax} must be one count >= 0 and "
            f"one axis of the rank-{x.ndim} input"
        )
    reps = [1] * x.ndim
    reps[ax[0]] = count[0]
    return np.tile(x, reps)


_PAD_MODES = {"constant", "reflect", "edge", "wrap"}


def _pad_check(node: NodeInfo, input_types: Sequence[object]) -> str | None:
    mode = node.attr("mode", "constant")
    if mode not in _PAD_MODES:
        return f"Pad mode {mode!r} is not supported"
    return None


@REGISTRY.register("Pad", since=1, check=_pad_check)
def pad(
    ctx: KernelContext,
    x: Array,
    pads: Array | None = None,
    constant_value: Array | None = None,
    axes: Array | None = None,
) -> Array:
    """Pad (negative pads crop); attributes before opset 11, inputs after, axes from 18."""
    mode = ctx.attr("mode", "constant")
    if mode not in _PAD_MODES:
        raise NotImplementedError(f"{ctx.node.describe()}: pad mode {mode!r}")
    if ctx.opset < 11:
        raw = _ints(ctx.attr("pads" if ctx.opset >= 2 else "paddings", []))
        value = ctx.attr("value", 0.0)
    else:
        raw = _ints(pads)
        value = _scalar(constant_value, 0)
    ax = normalize_axes(_ints(axes), x.ndim, ctx.node) if axes is not None else list(range(x.ndim))
    if len(raw) != 2 * len(ax):
        raise ValueError(f"{ctx.node.describe()}: {len(raw)} pads for {len(ax)} axes")
    before, after = [0] * x.ndim, [0] * x.ndim
    for i, a in enumerate(ax):
        before[a], after[a] = raw[i], raw[i + len(ax)]
    # Crop first for negative pads, then pad with what is left.
    crop = tuple(
        slice(-min(b, 0), d + min(e, 0)) for b, e, d in zip(before, after, x.shape, strict=True)
    )
    x = x[crop]
    width = [(max(b, 0), max(e, 0)) for b, e in zip(before, after, strict=True)]
    if mode != "constant":
        if x.size == 0 and any(w != (0, 0) for w in width):
            raise ValueError(f"{ctx.node.describe()}: cannot {mode}-pad an empty tensor")
        return np.pad(x, width, mode=mode)
    shape = [d + b + e for d, (b, e) in zip(x.shape, width, strict=True)]
    out = ctx.out(0, shape, x.dtype)
    out.fill(value)
    out[tuple(slice(b, b + d) for d, (b, _) in zip(x.shape, width, strict=True))] = x
    return out


@REGISTRY.register("CenterCropPad", since=18)
def center_crop_pad(ctx: KernelContext, x: Array, shape: Array) -> Array:
    """Center-crop or zero-pad each of ``axes`` to ``shape``."""
    sizes = _ints(shape)
    ax = normalize_axes(ctx.attr("axes", list(range(x.ndim))), x.ndim, ctx.node)
    if len(sizes) != len(ax):
        raise ValueError(f"{ctx.node.describe()}: shape {sizes} does not match axes {ax}")
    out_shape = list(x.shape)
    src: list[slice] = [slice(None)] * x.ndim
    dst: list[slice] = [slice(None)] * x.ndim
    for a, n in zip(ax, sizes, strict=True):
        d = x.shape[a]
        out_shape[a] = n
        if n < d:
            off = (d - n) // 2
            src[a] = slice(off, off + n)
        elif n > d:
            off = (n - d) // 2
            dst[a] = slice(off, off + d)
    out = ctx.out(0, out_shape, x.dtype)
    out.fill(0)
    out[tuple(dst)] = x[tuple(src)]
    return out


# ----------------------------------------------------------------------------- gather / scatter


def gather(ctx: KernelContext, x: Array, indices: Array) -> Array:
    """``np.take`` along ``axis``; negative indices count from the end."""
    axis = normalize_axis(int(ctx.attr("axis", 0)), x.ndim, ctx.node)
    idx = np.asarray(indices)
    check_index_range(ctx, idx, x.shape[axis])
    shape = x.shape[:axis] + idx.shape + x.shape[axis + 1 :]
    out = ctx.out(0, shape, x.dtype)
    if idx.size == 0 or x.size == 0:
        return out
    # Indices are in range, so 'wrap' only maps negatives, without numpy's buffering.
    return np.take(x, idx.astype(np.intp, copy=False), axis=axis, out=out, mode="wrap")


def _bind_gather(
    ctx: KernelContext, inputs: Sequence[Array], out: Array
) -> Callable[[], Any] | None:
    """Replay closure for intp indices: the range check and ``np.take`` into the recorded
    output, on arrays resolved once."""
    x, indices = inputs
    idx = np.asarray(indices)
    if not isinstance(out, np.ndarray) or out.dtype != x.dtype or idx.dtype != np.intp:
        return None
    if idx.size == 0 or x.size == 0 or not out.flags.c_contiguous:
        return None
    axis = normalize_axis(int(ctx.attr("axis", 0)), x.ndim, ctx.node)
    dim = x.shape[axis]

    def run() -> None:
        if idx.size == 1:  # one id (a decode step's token): no reductions for the check
            if not -dim <= idx.item() < dim:
                check_index_range(ctx, idx, dim)
        else:
            check_index_range(ctx, idx, dim)
        np.take(x, idx, axis=axis, out=out, mode="wrap")

    if axis == 0:
        run.native = gather_rows_native(x, idx, out, run)  # type: ignore[attr-defined]
    return run


REGISTRY.register("Gather", since=1, bind=_bind_gather)(gather)


@REGISTRY.register("GatherElements", since=11)
def gather_elements(ctx: KernelContext, x: Array, indices: Array) -> Array:
    """``np.take_along_axis`` with negative-index support."""
    axis = normalize_axis(int(ctx.attr("axis", 0)), x.ndim, ctx.node)
    idx = _normalized_indices(ctx, indices, x.shape[axis])
    return np.take_along_axis(x, idx, axis=axis)


def _nd_positions(ctx: KernelContext, data: Array, indices: Array, batch_dims: int) -> Array:
    """Bounds-checked flat positions of GatherND/ScatterND index tuples."""
    k = indices.shape[-1]
    dims = data.shape[batch_dims : batch_dims + k]
    if k > data.ndim - batch_dims:
        raise ValueError(f"{ctx.node.describe()}: index tuples of length {k} exceed data rank")
    idx = indices.reshape(-1, k).astype(np.int64, copy=False)
    for j, d in enumerate(dims):
        check_index_range(ctx, idx[:, j], d)
    idx = np.where(idx < 0, idx + np.array(dims, np.int64), idx) if idx.size else idx
    if k == 0:
        return np.zeros(idx.shape[0], np.intp)
    return np.ravel_multi_index(tuple(idx.T), dims).astype(np.intp)


@REGISTRY.register("GatherND", since=11)
def gather_nd(ctx: KernelContext, data: Array, indices: Array) -> Array:
    """Gather slices addressed by the last axis of ``indices`` (with ``batch_dims``)."""
    b = int(ctx.attr("batch_dims", 0)) if ctx.opset >= 12 else 0
    k = indices.shape[-1]
    batch = math.prod(data.shape[:b])
    rest = data.shape[b + k :]
    flat = data.reshape(batch, math.prod(data.shape[b : b + k]), *rest)
    pos = _nd_positions(ctx, data, indices, b).reshape(batch, math.prod(indices.shape[b:-1]))
    out = flat[np.arange(batch)[:, None], pos]
    return out.reshape(indices.shape[:-1] + rest)


_REDUCE_UFUNCS: dict[str, np.ufunc] = {
    "add": np.add,
    "mul": np.multiply,
    "max": np.maximum,
    "min": np.minimum,
}


def _scatter_check(node: NodeInfo, input_types: Sequence[object]) -> str | None:
    red = node.attr("reduction", "none")
    if red != "none" and red not in _REDUCE_UFUNCS:
        return f"{node.op_type} reduction {red!r} is not supported"
    return None


def _scatter_into(ctx: KernelContext, out: Array, where: tuple[Array, ...], updates: Array) -> None:
    """``out[where] = updates`` or its ``reduction`` (duplicates accumulate)."""
    red = ctx.attr("reduction", "none") if ctx.node.op_type != "Scatter" else "none"
    if red == "none":
        out[where] = updates
    elif red in _REDUCE_UFUNCS:
        _REDUCE_UFUNCS[red].at(out, where, updates)
    else:
        raise NotImplementedError(f"{ctx.node.describe()}: reduction {red!r}")


@REGISTRY.register("ScatterND", since=11, check=_scatter_check)
def scatter_nd(ctx: KernelContext, data: Array, indices: Array, updates: Array) -> Array:
    """Copy of ``data`` with slices at ``indices`` replaced or reduced with ``updates``."""
    k = indices.shape[-1]
    pos = _nd_positions(ctx, data, indices, 0)
    out = _materialize(ctx, data)
    view = out.reshape(math.prod(data.shape[:k]), *data.shape[k:])
    _scatter_into(ctx, view, (pos,), updates.reshape(pos.shape[0], *data.shape[k:]))
    return out


@REGISTRY.register(["ScatterElements", "Scatter"], since=9, check=_scatter_check)
def scatter_elements(ctx: KernelContext, data: Array, indices: Array, updates: Array) -> Array:
    """Copy of ``data`` with ``updates`` written at ``indices`` along ``axis``."""
    axis = normalize_axis(int(ctx.attr("axis", 0)), data.ndim, ctx.node)
    idx = _normalized_indices(ctx, indices, data.shape[axis])
    where = list(np.indices(idx.shape, sparse=True))
    where[axis] = idx
    out = _materialize(ctx, data)
    _scatter_into(ctx, out, tuple(where), updates)
    return out


# ----------------------------------------------------------------------------- masks / selection


@REGISTRY.register("Trilu", since=14)
def trilu(ctx: KernelContext, x: Array, k: Array | None = None) -> Array:
    """Keep the upper (or lower) triangle of the last two dims, offset by ``k``."""
    kk = int(_scalar(k, 0))
    n, m = x.shape[-2:]
    kk = max(min(kk, m + 1), -n - 1)  # huge |k| saturates
    rows = np.arange(n)[:, None]
    cols = np.arange(m)[None, :]
    keep = cols - rows >= kk if ctx.attr("upper", 1) else cols - rows <= kk
    out = ctx.out(0, x.shape, x.dtype)
    out.fill(0)
    np.copyto(out, x, where=keep)
    return out


@REGISTRY.register("OneHot", since=9)
def one_hot(ctx: KernelContext, indices: Array, depth: Array, values: Array) -> Array:
    """One-hot encode along ``axis`` with ``values = [off, on]``."""
    d = int(_scalar(depth))
    if d < 1:
        raise ValueError(f"{ctx.node.describe()}: depth must be positive, got {d}")
    axis = normalize_axis(int(ctx.attr("axis", -1)), indices.ndim + 1, ctx.node)
    idx = np.asarray(indices).astype(np.int64)
    idx = np.where(idx < 0, idx + d, idx)
    hot = idx[..., None] == np.arange(d)
    off, on = np.asarray(values).reshape(-1)[:2]
    out = np.where(hot, on, off).astype(values.dtype, copy=False)
    return _contig(np.moveaxis(out, -1, axis))


@REGISTRY.register("NonZero", since=9)
def nonzero(ctx: KernelContext, x: Array) -> Array:
    """Indices of non-zero elements, shape (rank, count), int64 (a scalar gives (0, count))."""
    if x.ndim == 0:
        return np.zeros((0, int(bool(x))), np.int64)
    return np.array(np.nonzero(x), dtype=np.int64).reshape(x.ndim, -1)


@REGISTRY.register("Compress", since=9)
def compress(ctx: KernelContext, x: Array, condition: Array) -> Array:
    """Select slices where ``condition`` is true (flattened input without ``axis``)."""
    cond = np.asarray(condition).astype(bool).reshape(-1)
    axis = ctx.attr("axis", None)
    if axis is None:
        return np.compress(cond, x.reshape(-1))
    axis = normalize_axis(int(axis), x.ndim, ctx.node)
    if cond.size > x.shape[axis]:
        raise ValueError(f"{ctx.node.describe()}: condition longer than axis {axis}")
    return np.compress(cond, x, axis=axis)


@REGISTRY.register("Unique", since=11)
def unique(ctx: KernelContext, x: Array) -> Array | tuple[Array, ...]:
    """Unique values or slices: (y, first indices, inverse indices, counts)."""
    axis = ctx.attr("axis", None)
    ax = None if axis is None else normalize_axis(int(axis), x.ndim, ctx.node)
    y, first, inverse, counts = np.unique(
        x, return_index=True, return_inverse=True, return_counts=True, axis=ax
    )
    inverse = inverse.reshape(-1)
    if not ctx.attr("sorted", 1):
        order = np.argsort(first, kind="stable")
        rank = np.empty_like(order)
        rank[order] = np.arange(order.size)
        first, counts, inverse = first[order], counts[order], rank[inverse]
        y = np.take(x.reshape(-1) if ax is None else x, first, axis=0 if ax is None else ax)
    parts = [
        y,
        first.astype(np.int64),
        inverse.astype(np.int64),
        counts.astype(np.int64),
    ]
    n_out = len(ctx.node.output_names) or 1
    return _outputs(parts[:n_out])


@REGISTRY.register("ReverseSequence", since=10)
def reverse_sequence(ctx: KernelContext, x: Array, sequence_lens: Array) -> Array:
    """Reverse the first ``sequence_lens[b]`` steps along ``time_axis`` for each batch."""
    b_ax = normalize_axis(int(ctx.attr("batch_axis", 1)), x.ndim, ctx.node)
    t_ax = normalize_axis(int(ctx.attr("time_axis", 0)), x.ndim, ctx.node)
    lens = np.asarray(sequence_lens).astype(np.int64).reshape(-1)
    n_t = x.shape[t_ax]
    if lens.size != x.shape[b_ax] or (lens.size and (lens.min() < 0 or lens.max() > n_t)):
        raise ValueError(f"{ctx.node.describe()}: bad sequence_lens {lens.tolist()}")
    t = np.arange(n_t)[None, :]
    src = np.where(t < lens[:, None], lens[:, None] - 1 - t, t)  # (batch, time)
    if b_ax > t_ax:
        src = src.T
    shape = [1] * x.ndim
    shape[b_ax], shape[t_ax] = x.shape[b_ax], n_t
    src = np.broadcast_to(src.reshape(shape), x.shape)
    return np.take_along_axis(x, src, axis=t_ax)


# ----------------------------------------------------------------------------- space / depth


@REGISTRY.register("DepthToSpace", since=1)
def depth_to_space(ctx: KernelContext, x: Array) -> Array:
    """Rearrange depth into blocks of space (modes DCR and CRD)."""
    bs = int(ctx.attr("blocksize"))
    n, c, h, w = x.shape
    if c % (bs * bs):
        raise ValueError(f"{ctx.node.describe()}: channels {c} not divisible by blocksize^2")
    cc = c // (bs * bs)
    if ctx.attr("mode", "DCR") == "DCR":
        t = x.reshape(n, bs, bs, cc, h, w).transpose(0, 3, 4, 1, 5, 2)
    else:
        t = x.reshape(n, cc, bs, bs, h, w).transpose(0, 1, 4, 2, 5, 3)
    return _copy_reshaped(ctx, t, (n, cc, h * bs, w * bs))


@REGISTRY.register("SpaceToDepth", since=1)
def space_to_depth(ctx: KernelContext, x: Array) -> Array:
    """Rearrange blocks of space into depth (modes DCR and CRD)."""
    bs = int(ctx.attr("blocksize"))
    n, c, h, w = x.shape
    if h % bs or w % bs:
        raise ValueError(f"{ctx.node.describe()}: spatial dims not divisible by blocksize")
    t = x.reshape(n, c, h // bs, bs, w // bs, bs)
    if ctx.attr("mode", "DCR") == "DCR":
        t = t.transpose(0, 3, 5, 1, 2, 4)
    else:
        t = t.transpose(0, 1, 3, 5, 2, 4)
    return _copy_reshaped(ctx, t, (n, c * bs * bs, h // bs, w // bs))


@REGISTRY.register("Col2Im", since=18)
def col2im(ctx: KernelContext, x: Array, image_shape: Array, block_shape: Array) -> Array:
    """Sum sliding blocks (N, C*prod(block), L) back into images (N, C, *image_shape)."""
    image, block = _ints(image_shape), _ints(block_shape)
    nd = len(image)
    dil = _ints(ctx.attr("dilations", [1] * nd))
    strides = _ints(ctx.attr("strides", [1] * nd))
    pads = _ints(ctx.attr("pads", [0] * (2 * nd)))
    padded = [image[i] + pads[i] + pads[i + nd] for i in range(nd)]
    counts = [(padded[i] - dil[i] * (block[i] - 1) - 1) // strides[i] + 1 for i in range(nd)]
    n, cb, L = x.shape
    if cb % math.prod(block) or math.prod(counts) != L:
        raise ValueError(f"{ctx.node.describe()}: input shape {x.shape} does not match blocks")
    c = cb // math.prod(block)
    cols = x.reshape(n, c, *block, *counts)
    acc_dtype = np.float32 if x.dtype.itemsize < 4 and x.dtype.kind not in "iub" else x.dtype
    acc = np.zeros((n, c, *padded), acc_dtype)
    for offset in np.ndindex(*block):
        dst = tuple(
            slice(o * d, o * d + s * (k - 1) + 1, s)
            for o, d, s, k in zip(offset, dil, strides, counts, strict=True)
        )
        acc[(slice(None), slice(None), *dst)] += cols[(slice(None), slice(None), *offset)]
    crop = tuple(slice(pads[i], pads[i] + image[i]) for i in range(nd))
    return _contig(acc[(slice(None), slice(None), *crop)].astype(x.dtype, copy=False))


# ----------------------------------------------------------------------------- Resize


def _nearest_taps(mode: str) -> Callable[[Array], Array]:
    """Weights on taps (base, base + 1) for a nearest mode; ratio in (0, 1]."""

    def fn(r: Array) -> Array:
        exact = r == 1.0
        if mode == "round_prefer_floor":
            hi = r > 0.5
        elif mode == "round_prefer_ceil":
            hi = r >= 0.5
        elif mode == "floor":
            hi = np.zeros_like(r, dtype=bool)
        else:  # ceil
            hi = np.ones_like(r, dtype=bool)
        hi = hi | exact
        return np.stack([~hi, hi], axis=-1).astype(np.float64)

    return fn


def _cubic(x: Array, a: float) -> Array:
    """Keys cubic convolution kernel."""
    x = np.abs(x)
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return np.where(x <= 1, near, np.where(x < 2, far, 0.0))


def _resize_filter(
    ctx: KernelContext, mode: str, scale: float
) -> tuple[int, int, Callable[[Array], Array]]:
    """(first tap offset, tap count, weights(ratio) -> (n, taps)) for one axis."""
    if mode == "nearest":
        return 0, 2, _nearest_taps(ctx.attr("nearest_mode", "round_prefer_floor"))
    antialias = ctx.opset >= 18 and bool(ctx.attr("antialias", 0))
    s = min(scale, 1.0) if antialias else 1.0
    if mode == "linear":
        start = int(math.floor(-1 / s) + 1)

        def kern(d: Array) -> Array:
            return np.clip(1 - np.abs(d), 0, 1)

    elif mode == "cubic":
        a = float(ctx.attr("cubic_coeff_a", -0.75))
        start = int(math.floor(-2 / s) + 1)

        def kern(d: Array) -> Array:
            return _cubic(d, a)

    else:
        raise NotImplementedError(f"{ctx.node.describe()}: resize mode {mode!r}")
    n = 2 - 2 * start
    offs = np.arange(start, start + n, dtype=np.float64)

    def weights(r: Array) -> Array:
        w = kern((offs[None, :] - r[:, None]) * s)
        return w / w.sum(axis=1, keepdims=True) if antialias else w

    return start, n, weights


def _source_coords(
    ctx: KernelContext, n_in: int, n_out: int, scale: float, roi: tuple[float, float]
) -> Array:
    """Source coordinate of each output position along one axis."""
    mode = ctx.attr("coordinate_transformation_mode", "half_pixel")
    if ctx.opset < 11:
        mode = "asymmetric"
    y = np.arange(n_out, dtype=np.float64)
    length = scale * n_in
    if mode == "half_pixel":
        return (y + 0.5) / scale - 0.5
    if mode == "pytorch_half_pixel":
        return (y + 0.5) / scale - 0.5 if length > 1 else np.full(n_out, -0.5)
    if mode == "half_pixel_symmetric":
        offset = n_in / 2 * (1 - n_out / length)
        return offset + (y + 0.5) / scale - 0.5
    if mode == "align_corners":
        return y * (n_in - 1) / (length - 1) if length != 1 else np.zeros(n_out)
    if mode == "asymmetric":
        return y / scale
    if mode == "tf_crop_and_resize":
        lo, hi = roi
        if length == 1:
            return np.full(n_out, (hi - lo) * (n_in - 1) / 2 + lo * (n_in - 1))
        return y * (hi - lo) * (n_in - 1) / (length - 1) + lo * (n_in - 1)
    raise NotImplementedError(f"{ctx.node.describe()}: coordinate_transformation_mode {mode!r}")


def _resize_axis(
    ctx: KernelContext, x: Array, axis: int, n_out: int, scale: float, roi: tuple[float, float]
) -> Array:
    """Resample ``x`` along one axis (separable Resize)."""
    n_in = x.shape[axis]
    mode = ctx.attr("mode", "nearest")
    coords = _source_coords(ctx, n_in, n_out, scale, roi)
    base = np.ceil(coords) - 1  # ratio in (0, 1]: exact integers lean to the left tap
    ratio = coords - base
    start, n_taps, weights = _resize_filter(ctx, mode, scale)
    taps = base.astype(np.int64)[:, None] + np.arange(start, start + n_taps)[None, :]
    w = weights(ratio)
    if ctx.attr("exclude_outside", 0) and mode != "nearest":
        w = np.where((taps < 0) | (taps >= n_in), 0.0, w)
        total = w.sum(axis=1, keepdims=True)
        w = w / np.where(total == 0, 1.0, total)
    taps = np.clip(taps, 0, n_in - 1).astype(np.intp)
    if mode == "nearest":
        out = np.take(x, taps[np.arange(n_out), np.argmax(w, axis=1)], axis=axis)
    else:
        bshape = [1] * x.ndim
        bshape[axis] = n_out
        out = np.zeros(x.shape[:axis] + (n_out,) + x.shape[axis + 1 :], x.dtype)
        for j in range(n_taps):
            out += np.take(x, taps[:, j], axis=axis) * w[:, j].astype(x.dtype).reshape(bshape)
    if ctx.attr("coordinate_transformation_mode", "") == "tf_crop_and_resize":
        outside = (coords < 0) | (coords > n_in - 1)
        if outside.any():
            mshape = [1] * x.ndim
            mshape[axis] = n_out
            extra = float(ctx.attr("extrapolation_value", 0.0))
            out = np.where(outside.reshape(mshape), np.asarray(extra, out.dtype), out)
    return out


def _resize_plan(
    ctx: KernelContext,
    x: Array,
    roi: Array | None,
    scales: Array | None,
    sizes: Array | None,
) -> tuple[list[int], list[int], list[float], list[tuple[float, float]]]:
    """Per resized axis: (axes, output sizes, scales, roi ranges)."""
    r = x.ndim
    axes = (
        normalize_axes(ctx.attr("axes", list(range(r))), r, ctx.node)
        if ctx.opset >= 18
        else list(range(r))
    )
    if sizes is not None and np.asarray(sizes).size:
        out = _ints(sizes)
        scl = [o / x.shape[a] for o, a in zip(out, axes, strict=True)]
        policy = ctx.attr("keep_aspect_ratio_policy", "stretch") if ctx.opset >= 18 else "stretch"
        if policy != "stretch":
            s = min(scl) if policy == "not_larger" else max(scl)
            scl = [s] * len(axes)
            out = [int(s * x.shape[a] + 0.5) for a in axes]
    elif scales is not None and np.asarray(scales).size:
        scl = [float(v) for v in np.asarray(scales).reshape(-1)]
        out = [int(math.floor(s * x.shape[a])) for s, a in zip(scl, axes, strict=True)]
    else:
        raise ValueError(f"{ctx.node.describe()}: needs either scales or sizes")
    if len(out) != len(axes):
        raise ValueError(f"{ctx.node.describe()}: {len(out)} sizes/scales for {len(axes)} axes")
    box = [0.0, 1.0] * len(axes)
    if roi is not None and np.asarray(roi).size:
        vals = [float(v) for v in np.asarray(roi).reshape(-1)]
        if len(vals) == 2 * r and len(axes) != r:
            vals = [vals[a] for a in axes] + [vals[r + a] for a in axes]
        box = vals
    rois = [(box[i], box[i + len(axes)]) for i in range(len(axes))]
    return axes, out, scl, rois


def _resize_check(node: NodeInfo, input_types: Sequence[object]) -> str | None:
    if node.attr("mode", "nearest") not in ("nearest", "linear", "cubic"):
        return f"Resize mode {node.attr('mode')!r} is not supported"
    return None


@REGISTRY.register("Resize", since=10, check=_resize_check)
def resize(
    ctx: KernelContext,
    x: Array,
    roi: Array | None = None,
    scales: Array | None = None,
    sizes: Array | None = None,
) -> Array:
    """Nearest / linear / cubic resize, axis by axis (roi, scales and sizes per opset)."""
    if ctx.opset < 11:  # Resize-10: (X, scales)
        roi, scales, sizes = None, roi, None
    axes, out_sizes, scl, rois = _resize_plan(ctx, x, roi, scales, sizes)
    mode = ctx.attr("mode", "nearest")
    float_dtype = x.dtype if x.dtype in (np.float32, np.float64) else np.dtype(np.float32)
    y = x if mode == "nearest" else x.astype(float_dtype, copy=False)
    tf_crop = ctx.attr("coordinate_transformation_mode", "") == "tf_crop_and_resize"
    for a, n, s, box in zip(axes, out_sizes, scl, rois, strict=True):
        if n == y.shape[a] and s == 1.0 and not tf_crop:
            continue
        y = _resize_axis(ctx, y, a, n, s, box)
    if y.dtype != x.dtype:
        if x.dtype.kind in "iu":
            info = np.iinfo(x.dtype)
            y = np.clip(np.rint(y), info.min, info.max)
        y = y.astype(x.dtype)
    return _contig(y)


def _upsample_check(node: NodeInfo, input_types: Sequence[object]) -> str | None:
    mode = node.attr("mode", "nearest")
    if mode not in ("nearest", "linear"):
        return f"Upsample mode={mode!r} is not 'nearest' or 'linear'"
    return None


@REGISTRY.register("Upsample", since=7, check=_upsample_check)
def upsample(ctx: KernelContext, x: Array, scales: Array | None = None) -> Array:
    """Upsample (opsets 7-9): Resize-10 with the same mode, scales as an attribute before
    opset 9 and an input from 9."""
    if ctx.opset < 9:
        scales = np.asarray(ctx.attr("scales", []), np.float32)
    if scales is None or scales.size != x.ndim or np.any(scales < 1):
        raise ValueError(
            f"{ctx.node.describe()}: scales must give one factor >= 1 per axis of X (rank {x.ndim})"
        )
    node = ctx.node
    attrs = {
        "mode": node.attr("mode", "nearest"),
        "coordinate_transformation_mode": "asymmetric",
        "nearest_mode": "floor",
    }
    as_resize = NodeInfo("Resize", node.name, node.domain, 13, attrs)
    return resize(KernelContext(as_resize, ctx.provider), x, None, scales.astype(np.float32))
