"""The CPU kernel of ``onnx_genrt::SampleTokens`` (the rule: ``core.token_sampling``): per
row, the top-k floor (a partition of the row), Philox4x32-10 once per four vocabulary
entries (none for four below the floor, or at temperature 0), the Gumbel score of each kept
entry in float32, and the first largest score."""

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


#: Largest k whose floor is found by keeping the k largest values seen in a sorted buffer
#: (few insertions on a long row); above it, a partition of a copy of the row.
SMALL_K = 256


@numba.njit(cache=True, nogil=True)
def _floor(row, k):
    """The row's k-th largest value, NaN as -inf; -inf when k is off (the rule's)."""
    vocab = row.shape[0]
    if k <= 0 or k >= vocab:
        return np.float32(-np.inf)
    if k <= SMALL_K:
        top = np.full(k, np.float32(-np.inf), np.float32)  # ascending: top[0] is the floor
        for v in range(vocab):
            x = row[v]
            if x > top[0]:  # NaN never enters: it counts as -inf
                i = 1
                while i < k and top[i] < x:
                    top[i - 1] = top[i]
                    i += 1
                top[i - 1] = x
        return top[0]
    x = np.empty(vocab, np.float32)
    for v in range(vocab):
        x[v] = np.float32(-np.inf) if np.isnan(row[v]) else row[v]
    return np.partition(x, vocab - k)[vocab - k]


@numba.njit(cache=True, nogil=True)
def _words(c1, c2, k0, k1, blocks, out):
    """The Philox words of vocabulary blocks 0 .. blocks - 1 into out (four per block): one
    branch-free loop, which LLVM vectorizes (32 x 32-bit products in 64-bit lanes)."""
    for b in range(blocks):
        w0, w1, w2, w3 = _philox(np.uint64(b), c1, c2, _STREAM, k0, k1)
        out[4 * b] = np.uint32(w0)
        out[4 * b + 1] = np.uint32(w1)
        out[4 * b + 2] = np.uint32(w2)
        out[4 * b + 3] = np.uint32(w3)


@numba.njit(cache=True, nogil=True)
def _draw_all(row, t, c1, c2, k0, k1, words):
    """The first largest Gumbel score of a whole row (no top-k floor)."""
    vocab = row.shape[0]
    _words(c1, c2, k0, k1, (vocab + 3) // 4, words)
    best = np.float32(-np.inf)
    arg = 0
    for v in range(vocab):
        score = _score(row[v], np.uint64(words[v]), t, True)
        if score > best:  # NaN never wins; the first largest stays
            best = score
            arg = v
    return arg


@numba.njit(cache=True, nogil=True)
def _draw_above(row, t, hot, floor, c1, c2, k0, k1):
    """The first largest score among the entries at or above ``floor``: noise drawn only for
    blocks of four with such an entry (none at temperature 0)."""
    vocab = row.shape[0]
    best = np.float32(-np.inf)
    arg = 0
    for block in range((vocab + 3) // 4):
        first, end = block * 4, min(block * 4 + 4, vocab)
        kept = False
        for v in range(first, end):
            kept = kept or not row[v] < floor
        if not kept:  # every entry below the top-k floor: no noise to draw
            continue
        w0 = w1 = w2 = w3 = np.uint64(0)
        if hot:
            w0, w1, w2, w3 = _philox(np.uint64(block), c1, c2, _STREAM, k0, k1)
        for v in range(first, end):
            x = row[v]
            if x < floor:
                continue
            j = v - first
            word = w0 if j == 0 else (w1 if j == 1 else (w2 if j == 2 else w3))
            score = _score(x, word, t, hot)
            if score > best:  # NaN never wins; the first largest stays
                best = score
                arg = v
    return arg


@numba.njit(cache=True, nogil=True)
def sample_rows(logits, temperature, seed, offset, top_k, tokens):
    """tokens[r] for rows of ``logits`` [rows, vocab] (float32); ``top_k`` per row."""
    rows, vocab = logits.shape
    words = np.empty(4 * ((vocab + 3) // 4), np.uint32)
    for r in range(rows):
        t = np.float32(temperature[r])
        hot = t > np.float32(0)
        floor = _floor(logits[r], top_k[r]) if hot else np.float32(-np.inf)
        s = np.uint64(seed[r])
        o = np.uint64(offset[r])
        k0, k1 = s & _MASK, s >> _N32
        c1, c2 = o & _MASK, o >> _N32
        if hot and floor == np.float32(-np.inf):
            tokens[r] = _draw_all(logits[r], t, c1, c2, k0, k1, words)
        else:
            tokens[r] = _draw_above(logits[r], t, hot, floor, c1, c2, k0, k1)
