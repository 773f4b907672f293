"""Native forms (``_native_calls``) of the small row kernels a decode step replays: the RMS
norm, the skip RMS norm, SiluMul of a row's halves and a Gather of rows (the token
embedding, an element of a shape). SiluMul (numpy's error model) and the row copies cannot
raise, so they have no ``try`` (a ``try`` costs a cfunc about 0.5 s of compilation). Each runs the same Numba code as its Python replay closure, on the buffers that
closure was bound to.
"""

from __future__ import annotations

from collections.abc import Callable

import numba
import numpy as np

from ._intrinsics import address_as_pointer
from ._native_calls import NativeCall, address_of, native_runner, rerun, word_view, words
from ._nn_common import rms_norm_rows
from .elementwise import silu_mul_halves

_F32 = np.float32
#: The code a native form returns when its Python closure must run instead (it raises the
#: kernel's own error).
RERUN = 1


@numba.njit(cache=True, nogil=True, inline="always")
def _f32(addr, rows, cols):
    """The (rows, cols) float32 array at ``addr``."""
    return numba.carray(address_as_pointer(addr, np.float32), (rows, cols))


def _norm_native(args, _a, _b):
    """Words: x, skip (0: none), sum (with a skip), y, gamma, inv, rows, cols, params (eps
    as float32): ``rms_norm_rows`` of x, or of ``sum = x + skip``."""
    try:
        w = word_view(args, 9)
        rows, cols = w[6], w[7]
        eps = numba.carray(address_as_pointer(w[8], np.float32), (1,))[0]
        x = _f32(w[0], rows, cols)
        if w[1] != 0:
            skip, total = _f32(w[1], rows, cols), _f32(w[2], rows, cols)
            for i in range(rows):
                for j in range(cols):
                    total[i, j] = x[i, j] + skip[i, j]
            x = total
        gamma = numba.carray(address_as_pointer(w[4], np.float32), (cols,))
        inv = numba.carray(address_as_pointer(w[5], np.float32), (rows,))
        rms_norm_rows(x, gamma, eps, _f32(w[3], rows, cols), inv)
        return 0
    except Exception:  # noqa: BLE001 - a native call reports failure by its code
        return 1


def _silu_halves_native(args, _a, _b):
    """Words: gu (rows, 2 half), out (rows, half), rows, half."""
    w = word_view(args, 4)
    rows, half = w[2], w[3]
    silu_mul_halves(_f32(w[0], rows, 2 * half), half, _f32(w[1], rows, half))
    return 0


@numba.njit(cache=True, nogil=True, inline="always")
def _take_rows(table, idx, out):
    """out[i] = table[idx[i]] (negative indices from the end); False for an index outside
    [-dim, dim)."""
    dim = table.shape[0]
    for i in range(idx.shape[0]):
        r = idx[i]
        if r < -dim or r >= dim:
            return False
        if r < 0:
            r += dim
        for j in range(table.shape[1]):
            out[i, j] = table[r, j]
    return True


def _gather_rows_native(args, _a, _b):
    """Words: table (dim, cols), indices (count,) int64, out (count, cols), dim, cols,
    count, element bytes (4 or 8: the rows are copied as bits). Returns ``RERUN`` for an
    index outside [-dim, dim) (the closure raises)."""
    w = word_view(args, 7)
    dim, cols, count = w[3], w[4], w[5]
    idx = numba.carray(address_as_pointer(w[1], np.int64), (count,))
    if w[6] == 8:
        t8 = numba.carray(address_as_pointer(w[0], np.int64), (dim, cols))
        o8 = numba.carray(address_as_pointer(w[2], np.int64), (count, cols))
        return 0 if _take_rows(t8, idx, o8) else 1
    t4 = numba.carray(address_as_pointer(w[0], np.int32), (dim, cols))
    o4 = numba.carray(address_as_pointer(w[2], np.int32), (count, cols))
    return 0 if _take_rows(t4, idx, o4) else 1


_norm_runner = native_runner(_norm_native)
_silu_halves_runner = native_runner(_silu_halves_native)
_gather_rows_runner = native_runner(_gather_rows_native)


def _eps(eps: np.float32) -> np.ndarray:
    return np.array([eps], _F32)


def rms_native(x2, gamma, eps, y2, inv, run: Callable[[], None]) -> Callable[[], NativeCall]:
    """Native form of ``rms_norm_rows(x2, gamma, eps, y2, inv)`` (``run`` is the closure)."""
    return skip_rms_native(x2, None, None, gamma, eps, y2, inv, run)


def skip_rms_native(
    x2, s2, h, gamma, eps, y2, inv, run: Callable[[], None]
) -> Callable[[], NativeCall]:
    """Native form of ``h = x2 + s2; rms_norm_rows(h, gamma, eps, y2, inv)`` (the norm of
    x2 itself when ``s2`` is None)."""

    def make() -> NativeCall:
        params = _eps(eps)
        rows, cols = x2.shape
        arrays = (x2, s2, h, y2, gamma, inv)
        w = words(*map(address_of, arrays), rows, cols, address_of(params))
        return NativeCall(_norm_runner(), w, rerun(run), (*arrays, params))

    return make


def silu_halves_native(gu, half: int, y2, run: Callable[[], None]) -> Callable[[], NativeCall]:
    """Native form of ``silu_mul_halves(gu, half, y2)``."""

    def make() -> NativeCall:
        w = words(address_of(gu), address_of(y2), gu.shape[0], half)
        return NativeCall(_silu_halves_runner(), w, rerun(run), (gu, y2))

    return make


def gather_rows_native(
    table: np.ndarray, idx: np.ndarray, out: np.ndarray, run: Callable[[], None]
) -> Callable[[], NativeCall] | None:
    """Native form of ``np.take(table, idx, axis=0, out=out)`` with its range check, for a
    C-contiguous table and output of one 4- or 8-byte element type and int64 indices; None
    otherwise."""
    if table.dtype != out.dtype or table.dtype.itemsize not in (4, 8) or table.ndim < 1:
        return None
    if idx.dtype != np.int64 or table.dtype.kind not in "fiu":
        return None
    if not (table.flags.c_contiguous and out.flags.c_contiguous and idx.flags.c_contiguous):
        return None
    dim = table.shape[0]
    cols = table.size // dim if dim else 0
    if out.size != idx.size * cols or cols == 0:
        return None
    t2, o2 = table.reshape(dim, cols), out.reshape(idx.size, cols)
    size = table.dtype.itemsize

    def make() -> NativeCall:
        w = words(address_of(t2), address_of(idx), address_of(o2), dim, cols, idx.size, size)
        return NativeCall(_gather_rows_runner(), w, rerun(run), (t2, idx, o2))

    return make
