"""Native forms (``_native_calls``) of the small steps around a decode step's layers: the
attention-mask lengths (an integer row sum, a subtraction, casts and copies of shapes), the
greedy head (ArgMax, the non-finite probe), Concat, and the MTP chain's ArgMaxProb and
MTPAccept. Each does what its numpy call does, bit for bit, on the buffers that call was
bound to, and hands back to it where numpy's rule is not reproduced here (ArgMax of a row
holding NaN). The one exception is ArgMaxProb's confidence, ``1 / sum(exp(row - max))``:
its exp and sum round within a few ulp of numpy's (it gates drafting, never a token).

None of them can raise (no division, no bounds or shape checks to fail on the shapes their
makers accept), so they have no ``try``: a ``try`` costs a cfunc about 0.5 s of compilation
on the first run."""

from __future__ import annotations

import math
from collections.abc import Callable

import numba
import numpy as np

from ._intrinsics import address_as_pointer, copy_bytes, stack_float32
from ._native_calls import NativeCall, address_of, native_runner, rerun, word_view, words
from ._vector_exp import exp32

_F32 = np.dtype(np.float32)


#: Element kinds the copy and binary forms take: int64, int32, float32.
_KINDS = {np.dtype(np.int64): 0, np.dtype(np.int32): 1, np.dtype(_F32): 2}
#: Binary ufuncs with a native form, by their op word.
_BINARY = {np.add: 0, np.subtract: 1, np.multiply: 2}


@numba.njit(cache=True, nogil=True, inline="always")
def _load(kind, addr, i):
    if kind == 0:
        return numba.carray(address_as_pointer(addr, np.int64), (i + 1,))[i]
    if kind == 1:
        return np.int64(numba.carray(address_as_pointer(addr, np.int32), (i + 1,))[i])
    return np.int64(0)


def _copy_native(args, _a, _b):
    """Words: src, src kind, dst, dst kind, count. Integer kinds convert as C casts do
    (numpy's ``casting="unsafe"``); float32 copies to float32 only."""
    w = word_view(args, 5)
    n = w[4]
    if w[1] == w[3]:  # one kind: the bytes as they are
        if w[0] != w[2]:
            copy_bytes(w[2], w[0], n * (8 if w[1] == 0 else 4))
        return 0
    if w[1] == 2 or w[3] == 2:
        return 1
    if w[3] == 0:
        d64 = numba.carray(address_as_pointer(w[2], np.int64), (n,))
        for i in range(n):
            d64[i] = _load(w[1], w[0], i)
    else:
        d32 = numba.carray(address_as_pointer(w[2], np.int32), (n,))
        for i in range(n):
            d32[i] = np.int32(_load(w[1], w[0], i))
    return 0


def _binary_native(args, _a, _b):
    """Words: op (add, subtract, multiply), kind (int64 or float32), a, a's size, b, b's
    size, out, out's size; a and b have out's size or one element (broadcast)."""
    w = word_view(args, 8)
    op, n = w[0], w[7]
    sa, sb = 1 if w[3] > 1 else 0, 1 if w[5] > 1 else 0
    if w[1] == 0:
        a = numba.carray(address_as_pointer(w[2], np.int64), (w[3],))
        b = numba.carray(address_as_pointer(w[4], np.int64), (w[5],))
        o = numba.carray(address_as_pointer(w[6], np.int64), (n,))
        for i in range(n):
            x, y = a[i * sa], b[i * sb]
            o[i] = x + y if op == 0 else (x - y if op == 1 else x * y)
        return 0
    fa = numba.carray(address_as_pointer(w[2], np.float32), (w[3],))
    fb = numba.carray(address_as_pointer(w[4], np.float32), (w[5],))
    fo = numba.carray(address_as_pointer(w[6], np.float32), (n,))
    if op == 0:
        for i in range(n):
            fo[i] = fa[i * sa] + fb[i * sb]
    elif op == 1:
        for i in range(n):
            fo[i] = fa[i * sa] - fb[i * sb]
    else:
        for i in range(n):
            fo[i] = fa[i * sa] * fb[i * sb]
    return 0


def _int_sum_native(args, _a, _b):
    """Words: x (rows, cols) int64, out (rows,) int64, rows, cols, axes, axes count, the
    recorded axes. ``RERUN`` when the axes input no longer holds the recorded axes."""
    w = word_view(args, 7)
    rows, cols, count = w[2], w[3], w[5]
    if count:
        axes = numba.carray(address_as_pointer(w[4], np.int64), (count,))
        recorded = numba.carray(address_as_pointer(w[6], np.int64), (count,))
        for i in range(count):
            if axes[i] != recorded[i]:
                return 1
    x = numba.carray(address_as_pointer(w[0], np.int64), (rows, cols))
    out = numba.carray(address_as_pointer(w[1], np.int64), (rows,))
    for i in range(rows):
        total = np.int64(0)
        for j in range(cols):
            total += x[i, j]
        out[i] = total
    return 0


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _argmax_row(row, lanes):
    """First index of the largest value of a float32 row without NaN; -1 when the row
    holds a NaN (numpy's rule for NaN is then left to numpy)."""
    n = row.shape[0]
    for j in range(16):
        lanes[j] = row[0]
    nan = False
    full = n // 16 * 16
    for j0 in range(0, full, 16):
        for j in range(16):
            v = row[j0 + j]
            nan |= v != v
            lanes[j] = v if v > lanes[j] else lanes[j]
    top = lanes[0]
    for j in range(1, 16):
        top = lanes[j] if lanes[j] > top else top
    for j in range(full, n):
        v = row[j]
        nan |= v != v
        top = v if v > top else top
    if nan:
        return -1
    for j in range(n):
        if row[j] == top:
            return j
    return -1


def _argmax_native(args, _a, _b):
    """Words: x (rows, cols) float32, out (rows,) int64, rows, cols. ``RERUN`` for a row
    holding a NaN."""
    w = word_view(args, 4)
    rows, cols = w[2], w[3]
    x = numba.carray(address_as_pointer(w[0], np.float32), (rows, cols))
    out = numba.carray(address_as_pointer(w[1], np.int64), (rows,))
    lanes = stack_float32(16)
    for i in range(rows):
        j = _argmax_row(x[i], lanes)
        if j < 0:
            return 1
        out[i] = j
    return 0


def _argmax_prob_native(args, _a, _b):
    """Words: x (rows, cols) float32, idx (rows,) int64, prob (rows,) float32, rows, cols.
    ``RERUN`` for a row holding a NaN."""
    w = word_view(args, 5)
    rows, cols = w[3], w[4]
    x = numba.carray(address_as_pointer(w[0], np.float32), (rows, cols))
    idx = numba.carray(address_as_pointer(w[1], np.int64), (rows,))
    prob = numba.carray(address_as_pointer(w[2], np.float32), (rows,))
    lanes = stack_float32(16)
    for i in range(rows):
        row = x[i]
        j = _argmax_row(row, lanes)
        if j < 0:
            return 1
        top = row[j]
        for t in range(16):
            lanes[t] = np.float32(0)
        full = cols // 16 * 16
        for j0 in range(0, full, 16):
            for t in range(16):
                lanes[t] += exp32(row[j0 + t] - top)
        total = np.float32(0)
        for t in range(16):
            total += lanes[t]
        for t in range(full, cols):
            total += exp32(row[t] - top)
        idx[i] = j
        prob[i] = np.float32(1) / total
    return 0


def _nonfinite_native(args, _a, _b):
    """Words: x float32, its size, out (1,) float32: ``sum(x - x)``, which is 0 or NaN in any
    order of the sum."""
    w = word_view(args, 3)
    n = w[1]
    x = numba.carray(address_as_pointer(w[0], np.float32), (n,))
    lanes = stack_float32(16)
    for t in range(16):
        lanes[t] = np.float32(0)
    full = n // 16 * 16
    for j0 in range(0, full, 16):
        for t in range(16):
            v = x[j0 + t]
            lanes[t] += v - v
    total = np.float32(0)
    for t in range(16):
        total += lanes[t]
    for j in range(full, n):
        total += x[j] - x[j]
    numba.carray(address_as_pointer(w[2], np.float32), (1,))[0] = total
    return 0


def _concat_native(args, _a, _b):
    """Words: out, outer, out's bytes per outer index, n, then n pairs (input, its bytes per
    outer index): each input's rows copied side by side into out's."""
    head = word_view(args, 4)
    outer, out_row, n = head[1], head[2], head[3]
    w = word_view(args, 4 + 2 * n)
    offset = 0
    for k in range(n):
        src, size = w[4 + 2 * k], w[5 + 2 * k]
        for o in range(outer):
            copy_bytes(w[0] + o * out_row + offset, src + o * size, size)
        offset += size
    return 0


def _mtp_accept_native(args, _a, _b):
    """Words: ids (k+1,) int64, argmax (k+1,) int64, count (1,) int64, k, accepted (1,)
    int64, token (1,) int64, hidden rows, bytes per row, the row out: ``MTPAccept``'s
    compare loop and the accepted position's row copied."""
    w = word_view(args, 9)
    k = w[3]
    ids = numba.carray(address_as_pointer(w[0], np.int64), (k + 1,))
    top = numba.carray(address_as_pointer(w[1], np.int64), (k + 1,))
    count = numba.carray(address_as_pointer(w[2], np.int64), (1,))
    limit = min(k, count[0])
    acc = 0
    while acc < limit and top[acc] == ids[acc + 1]:
        acc += 1
    numba.carray(address_as_pointer(w[4], np.int64), (1,))[0] = acc
    numba.carray(address_as_pointer(w[5], np.int64), (1,))[0] = top[acc]
    copy_bytes(w[8], w[6] + acc * w[7], w[7])
    return 0


_copy_runner = native_runner(_copy_native)
_binary_runner = native_runner(_binary_native)
_int_sum_runner = native_runner(_int_sum_native)
_argmax_runner = native_runner(_argmax_native)
_argmax_prob_runner = native_runner(_argmax_prob_native)
_concat_runner = native_runner(_concat_native)
_nonfinite_runner = native_runner(_nonfinite_native)
_mtp_accept_runner = native_runner(_mtp_accept_native)


def _flat(a: np.ndarray) -> bool:
    return isinstance(a, np.ndarray) and a.flags.c_contiguous and a.dtype in _KINDS


def copy_native(src: np.ndarray, dst: np.ndarray, run: Callable[[], None]):
    """Native form of ``np.copyto(dst, src, casting="unsafe")`` between C-contiguous arrays
    of one size, int64/int32 either way or float32 to float32; None otherwise."""
    if not (_flat(src) and _flat(dst)) or src.size != dst.size:
        return None
    if (src.dtype == _F32) != (dst.dtype == _F32):
        return None

    def make() -> NativeCall:
        w = words(address_of(src), _KINDS[src.dtype], address_of(dst), _KINDS[dst.dtype], dst.size)
        return NativeCall(_copy_runner(), w, rerun(run), (src, dst))

    return make


def binary_native(ufunc, a: np.ndarray, b: np.ndarray, out: np.ndarray, run: Callable[[], None]):
    """Native form of ``ufunc(a, b, out=out)`` for add, subtract and multiply of int64 or
    float32 (one dtype throughout), each operand of out's size or a single element; None
    otherwise."""
    op = _BINARY.get(ufunc)
    arrays = (a, b, out)
    if op is None or not all(_flat(x) for x in arrays) or out.dtype == np.int32:
        return None
    if a.dtype != out.dtype or b.dtype != out.dtype:
        return None
    if any(x.size not in (1, out.size) for x in (a, b)) or not out.size:
        return None
    if a.shape != out.shape and a.size != 1 or b.shape != out.shape and b.size != 1:
        return None

    def make() -> NativeCall:
        kind = _KINDS[out.dtype]
        w = words(op, kind, address_of(a), a.size, address_of(b), b.size, address_of(out), out.size)
        return NativeCall(_binary_runner(), w, rerun(run), arrays)

    return make


def int_sum_native(x: np.ndarray, axes: np.ndarray | None, out: np.ndarray, run):
    """Native form of an int64 ReduceSum over x's trailing axes into ``out`` (the rows that
    stay); ``axes`` (the input, or None) must keep the values it has now. None otherwise."""
    if x.dtype != np.int64 or out.dtype != np.int64 or not (_flat(x) and _flat(out)):
        return None
    if not out.size or x.size % out.size:
        return None
    recorded = np.zeros(0, np.int64) if axes is None else np.array(axes, np.int64).reshape(-1)
    live = recorded if axes is None else axes
    if axes is not None and not (_flat(axes) and axes.dtype == np.int64):
        return None
    x2 = x.reshape(out.size, x.size // out.size)

    def make() -> NativeCall:
        w = words(
            address_of(x2), address_of(out), *x2.shape, address_of(live), recorded.size,
            address_of(recorded),
        )  # fmt: skip
        return NativeCall(_int_sum_runner(), w, rerun(run), (x2, out, live, recorded))

    return make


def argmax_native(x: np.ndarray, out: np.ndarray, run: Callable[[], None]):
    """Native form of ArgMax over the last axis of a C-contiguous float32 ``x`` (first index;
    numpy's own call for a row with NaN) into int64 ``out``; None otherwise."""
    if x.dtype != _F32 or out.dtype != np.int64 or not (_flat(x) and _flat(out)) or not x.size:
        return None
    cols = x.shape[-1] if x.ndim else 1
    if out.size * cols != x.size:
        return None
    x2 = x.reshape(out.size, cols)

    def make() -> NativeCall:
        w = words(address_of(x2), address_of(out), out.size, cols)
        return NativeCall(_argmax_runner(), w, rerun(run), (x2, out))

    return make


def argmax_prob_native(x: np.ndarray, idx: np.ndarray, prob: np.ndarray, run: Callable[[], None]):
    """Native form of ArgMaxProb over the last axis of a C-contiguous float32 ``x`` into int64
    ``idx`` and float32 ``prob`` (numpy's own call for a row with NaN); None otherwise."""
    if x.dtype != _F32 or idx.dtype != np.int64 or prob.dtype != _F32 or not x.size:
        return None
    if not (_flat(x) and _flat(idx) and _flat(prob)) or x.ndim == 0:
        return None
    cols = x.shape[-1]
    rows = x.size // cols
    if idx.size != rows or prob.size != rows:
        return None
    x2 = x.reshape(rows, cols)

    def make() -> NativeCall:
        w = words(address_of(x2), address_of(idx), address_of(prob), rows, cols)
        return NativeCall(_argmax_prob_runner(), w, rerun(run), (x2, idx, prob))

    return make


def concat_native(inputs: tuple[np.ndarray, ...], axis: int, out: np.ndarray, run):
    """Native form of ``np.concatenate(inputs, axis, out=out)`` for C-contiguous arrays of
    out's dtype (a copy: any dtype); None otherwise."""
    arrays = (*inputs, out)
    if not inputs or not all(isinstance(a, np.ndarray) and a.flags.c_contiguous for a in arrays):
        return None
    if any(a.dtype != out.dtype or a.ndim != out.ndim for a in inputs) or not out.size:
        return None
    lead, tail = out.shape[:axis], out.shape[axis + 1 :]
    if any(a.shape[:axis] != lead or a.shape[axis + 1 :] != tail for a in inputs):
        return None
    if sum(a.shape[axis] for a in inputs) != out.shape[axis]:
        return None
    outer = math.prod(lead)
    rows = [a.nbytes // outer for a in inputs]

    def make() -> NativeCall:
        pairs = [v for a, b in zip(inputs, rows, strict=True) for v in (address_of(a), b)]
        w = words(address_of(out), outer, out.nbytes // outer, len(inputs), *pairs)
        return NativeCall(_concat_runner(), w, rerun(run), arrays)

    return make


def mtp_accept_native(ids, argmax, count, k: int, accepted, token, rows, row, run):
    """Native form of the MTPAccept replay closure: int64 ids, argmax, count, accepted and
    token, ``rows`` (k + 1, H) and ``row`` (H,) of one dtype, all C-contiguous; None
    otherwise."""
    ints = (ids, argmax, count, accepted, token)
    if not all(_flat(a) and a.dtype == np.int64 for a in ints):
        return None
    if ids.size < k + 1 or argmax.size < k + 1 or not count.size:
        return None
    if rows.dtype != row.dtype or not (rows.flags.c_contiguous and row.flags.c_contiguous):
        return None
    if rows.ndim != 2 or rows.shape[0] < k + 1 or rows.shape[1] != row.size:
        return None

    def make() -> NativeCall:
        w = words(
            address_of(ids), address_of(argmax), address_of(count), k, address_of(accepted),
            address_of(token), address_of(rows), row.nbytes, address_of(row),
        )  # fmt: skip
        return NativeCall(_mtp_accept_runner(), w, rerun(run), (*ints, rows, row))

    return make


def nonfinite_native(x: np.ndarray, out: np.ndarray, run: Callable[[], None]):
    """Native form of NonFinite on a C-contiguous float32 ``x`` into a float32 ``out`` of one
    element; None otherwise."""
    if x.dtype != _F32 or out.dtype != _F32 or not (_flat(x) and _flat(out)) or out.size != 1:
        return None

    def make() -> NativeCall:
        w = words(address_of(x), x.size, address_of(out))
        return NativeCall(_nonfinite_runner(), w, rerun(run), (x, out))

    return make
