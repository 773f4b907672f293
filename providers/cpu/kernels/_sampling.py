"""The CPU kernel of ``onnx_genrt::SampleTokens`` (the rule: ``core.token_sampling``): per
row, the top-k floor (a partition of the row), Philox4x32-10 once per four vocabulary
entries, the Gumbel score of each entry in float32, and the first largest score."""

from __future__ import annotations

import numba
import numpy as np

from onnx_genrt.core.token_sampling import (
    MASK32,
    PHILOX_M,
    PHILOX_ROUNDS,
    PHILOX_W,
    SAMPLE_STREAM,
)

_M0, _M1 = np.uint64(PHILOX_M[0]), np.uint64(PHILOX_M[1])
_W0, _W1 = np.uint64(PHILOX_W[0]), np.uint64(PHILOX_W[1])
_MASK, _N32 = np.uint64(MASK32), np.uint64(32)
_STREAM = np.uint64(SAMPLE_STREAM)


@numba.njit(cache=True, nogil=True, inline="always")
def _philox(c0, c1, c2, c3, k0, k1):
    for r in range(PHILOX_ROUNDS):
        if r:
            k0 = (k0 + _W0) & _MASK
            k1 = (k1 + _W1) & _MASK
        p0 = _M0 * c0
        p1 = _M1 * c2
        c0, c1, c2, c3 = (p1 >> _N32) ^ c1 ^ k0, p1 & _MASK, (p0 >> _N32) ^ c3 ^ k1, p0 & _MASK
    return c0, c1, c2, c3


@numba.njit(cache=True, nogil=True)
def _score(x, word, t, hot):
    """One entry's float32 Gumbel score (or its logit when not hot)."""
    if not hot:
        return x
    u = (np.float32(word >> np.uint64(9)) * np.float32(2) + np.float32(1)) * np.float32(2.0**-24)
    return x / t - np.log(-np.log(u))


@numba.njit(cache=True, nogil=True)
def _floor(row, k):
    """The row's k-th largest value, NaN as -inf; -inf when k is off (the rule's)."""
    vocab = row.shape[0]
    if k <= 0 or k >= vocab:
        return np.float32(-np.inf)
    x = np.empty(vocab, np.float32)
    for v in range(vocab):
        x[v] = np.float32(-np.inf) if np.isnan(row[v]) else row[v]
    return np.partition(x, vocab - k)[vocab - k]


@numba.njit(cache=True, nogil=True)
def sample_rows(logits, temperature, seed, offset, top_k, tokens):
    """tokens[r] for rows of ``logits`` [rows, vocab] (float32); ``top_k`` per row."""
    rows, vocab = logits.shape
    for r in range(rows):
        t = np.float32(temperature[r])
        hot = t > np.float32(0)
        floor = _floor(logits[r], top_k[r]) if hot else np.float32(-np.inf)
        s = np.uint64(seed[r])
        o = np.uint64(offset[r])
        k0, k1 = s & _MASK, s >> _N32
        c1, c2 = o & _MASK, o >> _N32
        best = np.float32(-np.inf)
        arg = 0
        for block in range((vocab + 3) // 4):
            w0, w1, w2, w3 = _philox(np.uint64(block), c1, c2, _STREAM, k0, k1)
            for j in range(4):
                v = block * 4 + j
                if v >= vocab:
                    break
                x = logits[r, v]
                if x < floor:
                    continue
                word = w0 if j == 0 else (w1 if j == 1 else (w2 if j == 2 else w3))
                score = _score(x, word, t, hot)
                if score > best:  # NaN never wins; the first largest stays
                    best = score
                    arg = v
        tokens[r] = arg
