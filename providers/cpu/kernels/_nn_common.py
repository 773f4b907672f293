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


def output_count(ctx) -> int:
    """Number of outputs the node declares (absent optional ones included)."""
    return max(1, len(ctx.node.output_names))


def wants_output(ctx, index: int) -> bool:
    """True when the node has output ``index`` with a non-empty name."""
    names = ctx.node.output_names
    return index < len(names) and bool(names[index])


# ----------------------------------------------------------------------------- row kernels

# Sums may be reordered (so LLVM can vectorize them); no nnan/ninf, so -inf masks and NaNs
# keep their IEEE meaning.
_FM = {"reassoc", "contract"}


@numba.njit(cache=True, nogil=True)
def _row_max(r):
    """Max of a 1-D row with 8 independent accumulators (vectorizes; NaNs are skipped)."""
    m = r.shape[0]
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = r[0]
    j = 0
    while j + 8 <= m:
        a0 = r[j] if r[j] > a0 else a0
        a1 = r[j + 1] if r[j + 1] > a1 else a1
        a2 = r[j + 2] if r[j + 2] > a2 else a2
        a3 = r[j + 3] if r[j + 3] > a3 else a3
        a4 = r[j + 4] if r[j + 4] > a4 else a4
        a5 = r[j + 5] if r[j + 5] > a5 else a5
        a6 = r[j + 6] if r[j + 6] > a6 else a6
        a7 = r[j + 7] if r[j + 7] > a7 else a7
        j += 8
    mx = max(max(max(a0, a1), max(a2, a3)), max(max(a4, a5), max(a6, a7)))
    while j < m:
        mx = r[j] if r[j] > mx else mx
        j += 1
    return mx


@numba.njit(cache=True, nogil=True, fastmath=_FM)
def _shift_rows(x, out, zero_masked):
    """out = x - rowmax(x); an all -inf row is left at -inf when ``zero_masked``."""
    n, m = x.shape
    if m == 0:
        return
    for i in range(n):
        r = x[i]
        o = out[i]
        mx = _row_max(r)
        if zero_masked and mx == -np.inf:
            for j in range(m):  # exp(-inf) = 0: the row sums to 0 and stays 0
                o[j] = r[j]
            continue
        for j in range(m):
            o[j] = r[j] - mx


@numba.njit(cache=True, nogil=True, fastmath=_FM)
def _scale_rows_to_one(out):
    """Divide every row by its sum; a row summing to 0 (fully masked) stays 0."""
    n, m = out.shape
    inv = np.empty(1, out.dtype)  # 1/sum in the row's precision
    for i in range(n):
        o = out[i]
        s = 0.0
        for j in range(m):
            s += o[j]
        inv[0] = 1.0 / s if s != 0.0 else 0.0
        f = inv[0]
        for j in range(m):
            o[j] = o[j] * f


@numba.njit(cache=True, nogil=True, fastmath=_FM)
def _row_sums(x, sums):
    n, m = x.shape
    for i in range(n):
        r = x[i]
        s = 0.0
        for j in range(m):
            s += r[j]
        sums[i] = s


def softmax_rows(x: np.ndarray, out: np.ndarray, zero_masked: bool) -> None:
    """Row softmax of 2-D C-contiguous ``x`` into ``out`` (may be ``x``).

    With ``zero_masked`` a row whose max is -inf (fully masked) becomes zeros, not NaN.
    exp runs through numpy's SIMD ufunc; the passes around it are Numba loops.
    """
    _shift_rows(x, out, zero_masked)
    np.exp(out, out=out)
    _scale_rows_to_one(out)


def log_softmax_rows(x: np.ndarray, out: np.ndarray) -> None:
    """Row log-softmax of 2-D C-contiguous ``x`` into ``out`` (may be ``x``)."""
    _shift_rows(x, out, False)
    sums = np.empty(out.shape[0], np.float64)
    _row_sums(np.exp(out), sums)
    out -= np.log(sums).astype(out.dtype).reshape(-1, 1)


@numba.njit(cache=True, fastmath=_FM)
def layer_norm_rows(x, scale, bias, eps, out, mean_out, inv_out):
    """y = (x - mean) / sqrt(var + eps) * scale + bias per row; scale/bias have cols items.

    ``bias`` may be empty (no bias). ``mean_out``/``inv_out`` receive one value per row;
    statistics accumulate in float64, the affine pass runs in the array's precision.
    """
    n, m = x.shape
    has_bias = bias.shape[0] > 0
    for i in range(n):
        r = x[i]
        o = out[i]
        s = 0.0
        for j in range(m):
            s += r[j]
        mean_out[i] = s / m
        mean = mean_out[i]
        sq = 0.0
        for j in range(m):
            d = r[j] - mean
            sq += d * d
        inv_out[i] = 1.0 / np.sqrt(sq / m + eps)
        inv = inv_out[i]
        if has_bias:
            for j in range(m):
                o[j] = (r[j] - mean) * inv * scale[j] + bias[j]
        else:
            for j in range(m):
                o[j] = (r[j] - mean) * inv * scale[j]


def writable(a: np.ndarray) -> np.ndarray:
    """``a``, or a copy where it is read-only (an initializer mapped from the file): Numba
    types a read-only array apart, so a kernel called with both compiles twice (seconds of
    first-run compilation each); the native calls' arrays are always writable."""
    return a if a.flags.writeable else a.copy()


@numba.njit(cache=True, nogil=True, fastmath=_FM)
def rms_norm_rows(x, scale, eps, out, inv_out):
    """y = x / sqrt(mean(x^2) + eps) * scale per row; scale has cols items."""
    n, m = x.shape
    for i in range(n):
        r = x[i]
        o = out[i]
        sq = 0.0
        for j in range(m):
            v = r[j]
            sq += v * v
        inv_out[i] = 1.0 / np.sqrt(sq / m + eps)
        inv = inv_out[i]
        for j in range(m):
            o[j] = r[j] * inv * scale[j]
