"""A float32 ``exp`` that LLVM vectorizes inside Numba loops.

Numba lowers ``math.exp`` on float32 to a call of libm's scalar ``expf`` (no SVML here), so
a loop over it runs one element at a time: a 768-wide SiLU then costs more in ``expf`` calls
than the matrix product before it. :func:`exp32` is the classic Cephes range reduction
(``x = n ln2 + r``, ``|r| <= ln2 / 2``), a degree-6 polynomial for ``exp(r)`` and ``2**n``
built from its exponent bits: straight-line arithmetic that vectorizes. Its error is within 2
ulp of the float64 exp rounded to float32 (tests/providers/cpu/test_vector_exp.py); results
that would be subnormal (``x < -87.33``) are 0, ``x > 88.72`` gives inf, NaN stays NaN.
"""

from __future__ import annotations

import numba
import numpy as np

from ._intrinsics import float32_from_bits

_F32 = np.float32
_LOG2E = _F32(1.44269504088896341)
# ln 2 split in two so n * _LN2_HI is exact for |n| <= 128 (Cephes' C1, C2).
_LN2_HI = _F32(0.693359375)
_LN2_LO = _F32(-2.12194440e-4)
#: Below this exp(x) is subnormal in float32 and exp32 returns 0.
EXP32_MIN = _F32(-87.33654)
#: Above this exp(x) overflows float32 and exp32 returns inf.
EXP32_MAX = _F32(88.72283)


@numba.njit(cache=True)
def exp32(x):
    """exp(x) for a float32 ``x`` (see the module docstring for its range and error)."""
    c = min(max(x, EXP32_MIN), EXP32_MAX)
    n = np.floor(c * _LOG2E + _F32(0.5))
    r = c - n * _LN2_HI
    r = r - n * _LN2_LO
    p = _F32(1.9875691500e-4)
    p = p * r + _F32(1.3981999507e-3)
    p = p * r + _F32(8.3334519073e-3)
    p = p * r + _F32(4.1665795894e-2)
    p = p * r + _F32(1.6666665459e-1)
    p = p * r + _F32(5.0000001201e-1)
    p = p * (r * r) + r + _F32(1.0)
    # 2**n as two factors so n = 128 (x near the top) stays finite: 2**64 * 2**64.
    ni = np.int64(n)
    n1 = ni >> 1
    y = p * float32_from_bits((n1 + 127) << 23)
    y = y * float32_from_bits((ni - n1 + 127) << 23)
    if x < EXP32_MIN:
        y = _F32(0)
    if x > EXP32_MAX:
        y = _F32(np.inf)
    if x != x:
        y = x
    return y


@numba.njit(cache=True)
def exp32_into(x, out):
    """out[i] = exp32(x[i]) over two 1-D float32 arrays of one length (strides free)."""
    for i in range(x.shape[0]):
        out[i] = exp32(x[i])
