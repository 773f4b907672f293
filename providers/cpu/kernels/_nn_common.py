"""Shared pieces of the nn kernels: compute dtypes and Numba row kernels.

Row kernels work on 2-D C-contiguous float32 (or float64) arrays of shape rows x cols and
accumulate in float64, so long rows (a vocabulary softmax) stay accurate.
"""

from __future__ import annotations

import math

import ml_dtypes
import numba
import numpy as np
from onnx import TensorProto

_LOW_PRECISION = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))
_ONNX_FLOATS = {
    TensorProto.FLOAT: np.dtype(np.float32),
    TensorProto.FLOAT16: np.dtype(np.float16),
    TensorProto.BFLOAT16: np.dtype(ml_dtypes.bfloat16),
    TensorProto.DOUBLE: np.dtype(np.float64),
}


def compute_dtype(dtype: np.dtype) -> np.dtype:
    """float64 stays float64; every other float type computes in float32."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def onnx_float_dtype(code: int) -> np.dtype:
    """numpy dtype of an ONNX float element type code (stash_type, softmax_precision...)."""
    try:
        return _ONNX_FLOATS[int(code)]
    except KeyError:
        raise NotImplementedError(f"float element type {code} is not supported") from None


def as_compute(x: np.ndarray, dtype: np.dtype | None = None) -> np.ndarray:
    """``x`` as a C-contiguous array of its compute dtype (no copy when already so)."""
    dt = compute_dtype(x.dtype) if dtype is None else np.dtype(dtype)
    return np.ascontiguousarray(x, dtype=dt)


def rows_view(x: np.ndarray, axis: int) -> tuple[int, int]:
    """(rows, cols) when ``x`` is flattened to 2-D at ``axis``."""
    rows = math.prod(x.shape[:axis])
    cols = math.prod(x.shape[axis:])
    return rows, cols


def normalize_axis(axis: int, rank: int, what: str = "axis") -> int:
    """Map a possibly negative axis into [0, rank) or raise."""
    if not -rank <= axis < max(rank, 1):
        raise ValueError(f"{what} {axis} out of range for rank {rank}")
    return axis + rank if axis < 0 else axis


def output_count(ctx) -> int:
    """Number of outputs the node declares (absent optional ones included)."""
    return max(1, len(ctx.node.output_names))


def wants_output(ctx, index: int) -> bool:
    """True when the node has output ``index`` with a non-empty name."""
    names = ctx.node.output_names
    return index < len(names) and bool(names[index])


def finish(x: np.ndarray, dtype: np.dtype, ctx=None, index: int = 0) -> np.ndarray:
    """``x`` cast to ``dtype``: into the output buffer when given a ctx, else a new array."""
    if ctx is None:
        return x if x.dtype == dtype else x.astype(dtype)
    out = ctx.out(index, x.shape, dtype)
    if out is not x:
        out[...] = x
    return out


# ----------------------------------------------------------------------------- row kernels


@numba.njit(cache=True)
def softmax_rows(x, out, zero_masked):
    """Softmax of every row; a row whose max is -inf becomes zeros when ``zero_masked``."""
    n, m = x.shape
    for i in range(n):
        mx = -np.inf
        for j in range(m):
            v = x[i, j]
            if v > mx:
                mx = v
        if zero_masked and mx == -np.inf:
            for j in range(m):
                out[i, j] = 0.0
            continue
        s = 0.0
        for j in range(m):
            e = np.exp(x[i, j] - mx)
            out[i, j] = e
            s += e
        inv = 1.0 / s
        for j in range(m):
            out[i, j] = out[i, j] * inv


@numba.njit(cache=True)
def log_softmax_rows(x, out):
    """Log-softmax of every row."""
    n, m = x.shape
    for i in range(n):
        mx = -np.inf
        for j in range(m):
            v = x[i, j]
            if v > mx:
                mx = v
        s = 0.0
        for j in range(m):
            s += np.exp(x[i, j] - mx)
        shift = mx + np.log(s)
        for j in range(m):
            out[i, j] = x[i, j] - shift


@numba.njit(cache=True)
def layer_norm_rows(x, scale, bias, eps, out, mean_out, inv_out):
    """y = (x - mean) / sqrt(var + eps) * scale + bias per row; scale/bias have cols items.

    ``bias`` may be empty (no bias). ``mean_out``/``inv_out`` receive one value per row.
    """
    n, m = x.shape
    has_bias = bias.shape[0] > 0
    for i in range(n):
        s = 0.0
        for j in range(m):
            s += x[i, j]
        mean = s / m
        sq = 0.0
        for j in range(m):
            d = x[i, j] - mean
            sq += d * d
        inv = 1.0 / np.sqrt(sq / m + eps)
        mean_out[i] = mean
        inv_out[i] = inv
        if has_bias:
            for j in range(m):
                out[i, j] = (x[i, j] - mean) * inv * scale[j] + bias[j]
        else:
            for j in range(m):
                out[i, j] = (x[i, j] - mean) * inv * scale[j]


@numba.njit(cache=True)
def rms_norm_rows(x, scale, eps, out):
    """y = x / sqrt(mean(x^2) + eps) * scale per row; scale has cols items."""
    n, m = x.shape
    for i in range(n):
        sq = 0.0
        for j in range(m):
            v = x[i, j]
            sq += v * v
        inv = 1.0 / np.sqrt(sq / m + eps)
        for j in range(m):
            out[i, j] = x[i, j] * inv * scale[j]
