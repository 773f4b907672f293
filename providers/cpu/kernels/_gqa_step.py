"""Numba kernels of the CPU GroupQueryAttention step: B rows, M <= 16 new tokens each.

Each row b holds ``seqlens[b] + 1`` tokens after the step, its M new ones last. A step writes
every row's new keys (rotated) and values into its own rows of the shared cache, then attends
each (row, new token, query head) over the keys that query sees. One such item is computed
alone, in a fixed order, with no sum spanning two items: a row's result does not depend on the
batch it runs in, on the thread split, or on the step's other new tokens. A batched step gives
each row exactly what a batch-1 step of that row gives.

Passes (:func:`attend_rows`):

1. ``_prepare``: checks every row, writes the new keys and values of the rows that fit (the
   others are left untouched, for the caller to run otherwise), counts the score slots.
2. ``_items``: per item, Q·K (scaled, rotated queries), softcap, minus the row max, with one
   more slot holding ``sink - max`` (-inf without a head sink) in a scratch row of the
   thread; the exps of those slots (``_vector_exp.exp32``, which vectorizes: Numba would
   call scalar libm ``expf``), their sum (float64), and the exp-weighted sum of the values
   over it.

Pass 2 runs items on Numba's threads when there are several and the step's multiply-adds
reach ``PARALLEL_MIN_WORK``; each item is the same code either way. A smaller step is one
Numba call (``_step_serial``: both passes).
"""

from __future__ import annotations

import math
import threading

import numba
import numpy as np

from ._vector_exp import exp32

_F32 = np.float32
#: Multiply-adds of a step below which its items run on the calling thread alone (Numba's
#: parallel regions make the caller wait for every thread).
PARALLEL_MIN_WORK = 1 << 19
# Sums may be reordered so LLVM vectorizes them (as in _skinny_matmul); no nnan/ninf: the
# -inf of the sink slot keeps its meaning.
_FM = {"reassoc", "contract"}

_SCRATCH = threading.local()  # .scores: the score rows of this thread's steps


def score_scratch(rows: int, width: int) -> np.ndarray:
    """(rows, width) float32 score rows of this thread's scratch (grown, never shrunk)."""
    buf = getattr(_SCRATCH, "scores", None)
    if buf is None or buf.size < rows * width:
        buf = _SCRATCH.scores = np.empty(max(rows * width, 1 << 16), _F32)
    return buf[: rows * width].reshape(rows, width)


@numba.njit(cache=True)
def rope_row(x, cos, sin, out, rot, interleaved):
    """out = x rotated by one position's cos/sin rows (rot/2,); features past ``rot`` copied
    (half-split or ``interleaved`` pairs). RotaryEmbedding (``attention._rope``) and the
    GroupQueryAttention step both rotate with it."""
    half = rot // 2
    for k in range(half):
        if interleaved:
            i1 = 2 * k
            i2 = i1 + 1
        else:
            i1 = k
            i2 = k + half
        c = cos[k]
        s = sin[k]
        x1 = x[i1]
        x2 = x[i2]
        out[i1] = c * x1 - s * x2
        out[i2] = s * x1 + c * x2
    for d in range(rot, x.shape[0]):
        out[d] = x[d]


@numba.njit(cache=True, inline="always")
def _key_range(start, i, m, window, causal):
    """Cache rows [k0, k1) that new token ``i`` (cache row start + i) sees."""
    r = start + i
    k1 = r + 1 if causal else start + m
    k0 = max(0, r - window + 1) if window > 0 else 0
    return k0, k1


@numba.njit(cache=True, inline="always")
def _softcapped(s, softcap):
    """softcap * tanh(s / softcap) in float32 (the general path's order); s when 0."""
    if softcap > 0.0:
        return _F32(math.tanh(s * _F32(1.0 / softcap))) * _F32(softcap)
    return s


@numba.njit(cache=True)
def _prepare(q, k, v, kc, vc, cos, sin, seqlens, total_len, starts, active, derive, rot,
             interleaved, window, causal):  # fmt: skip
    """Check the rows, write the new keys/values of those that fit; returns (score slots
    the stepping items use, rows that step).

    A row fits when it has at least M tokens and its positions are in the cos/sin cache;
    with ``derive``, also when its cache holds it and ``total_len``: its new rows then start
    at seqlens[b] + 1 - M. Without ``derive`` (a window-sized cache placed by the caller)
    ``starts`` holds each row's first new cache row and ``active`` is False for the rows the
    caller could not place. ``active`` gets which rows step.
    """
    bsz, m, n, h = q.shape
    kvn, cap = kc.shape[1], kc.shape[2]
    used = 0
    stepped = 0
    for b in range(bsz):
        t = seqlens[b] + 1
        fits = t >= m and (rot == 0 or t <= cos.shape[0])
        if derive:
            fits = fits and t <= cap and total_len[0] <= cap
            starts[b] = t - m
        else:
            fits = fits and active[b]
        active[b] = fits
        if not fits:
            continue
        stepped += 1
        start = starts[b]
        pos0 = t - m
        for i in range(m):
            k0, k1 = _key_range(start, i, m, window, causal)
            used += n * (k1 - k0 + 1)
            row = start + i
            for kh in range(kvn):
                if rot > 0:
                    rope_row(k[b, i, kh], cos[pos0 + i], sin[pos0 + i], kc[b, kh, row], rot,
                             interleaved)  # fmt: skip
                else:
                    for d in range(h):
                        kc[b, kh, row, d] = k[b, i, kh, d]
                for d in range(h):
                    vc[b, kh, row, d] = v[b, i, kh, d]
    return used, stepped


@numba.njit(cache=True, fastmath=_FM)
def _item(item, q, kc, vc, cos, sin, seqlens, starts, active, qs, sc, sinks, out, scale, rot,
          interleaved, window, softcap, causal):  # fmt: skip
    """One (row, token, head) item: scores (scaled rotated query · keys, softcapped, minus
    their max; the slot after them sink - max, -inf without sinks) into the scratch row
    ``sc``, their exps, and the exp-weighted sum of the values over the sum of the exps."""
    _, m, n, h = q.shape
    hq = item % n
    i = (item // n) % m
    b = item // (n * m)
    if not active[b]:
        return
    kvh = hq // (n // kc.shape[1])
    start = starts[b]
    pos = seqlens[b] + 1 - m + i
    if rot > 0:
        rope_row(q[b, i, hq], cos[pos], sin[pos], qs, rot, interleaved)
    else:
        for d in range(h):
            qs[d] = q[b, i, hq, d]
    for d in range(h):
        qs[d] = qs[d] * scale
    k0, k1 = _key_range(start, i, m, window, causal)
    w = k1 - k0
    keys = kc[b, kvh]
    has_sink = sinks.shape[0] > 0
    mx = sinks[hq] if has_sink else _F32(-np.inf)
    j = 0
    while j + 4 <= w:  # four keys per pass over the query
        ka = keys[k0 + j]
        kb = keys[k0 + j + 1]
        kc_ = keys[k0 + j + 2]
        kd = keys[k0 + j + 3]
        sa = sb = sc_ = sd = _F32(0)
        for d in range(h):
            x = qs[d]
            sa += x * ka[d]
            sb += x * kb[d]
            sc_ += x * kc_[d]
            sd += x * kd[d]
        sa = _softcapped(sa, softcap)
        sb = _softcapped(sb, softcap)
        sc_ = _softcapped(sc_, softcap)
        sd = _softcapped(sd, softcap)
        sc[j] = sa
        sc[j + 1] = sb
        sc[j + 2] = sc_
        sc[j + 3] = sd
        mx = max(mx, max(max(sa, sb), max(sc_, sd)))
        j += 4
    while j < w:
        kx = keys[k0 + j]
        s = _F32(0)
        for d in range(h):
            s += qs[d] * kx[d]
        s = _softcapped(s, softcap)
        sc[j] = s
        mx = max(mx, s)
        j += 1
    for j in range(w):
        sc[j] = exp32(sc[j] - mx)
    sc[w] = exp32(sinks[hq] - mx) if has_sink else _F32(0)
    total = 0.0
    for j in range(w + 1):
        total += sc[j]
    inv = _F32(1.0 / total)
    vals = vc[b, kvh]
    o = out[b, i, hq]
    for d in range(h):
        o[d] = 0
    j = 0
    while j + 4 <= w:
        ea = sc[j]
        eb = sc[j + 1]
        ec = sc[j + 2]
        ed = sc[j + 3]
        va = vals[k0 + j]
        vb = vals[k0 + j + 1]
        vc_ = vals[k0 + j + 2]
        vd = vals[k0 + j + 3]
        for d in range(h):
            o[d] += ea * va[d] + eb * vb[d] + ec * vc_[d] + ed * vd[d]
        j += 4
    while j < w:
        ea = sc[j]
        va = vals[k0 + j]
        for d in range(h):
            o[d] += ea * va[d]
        j += 1
    for d in range(h):
        o[d] = o[d] * inv


@numba.njit(cache=True)
def _items_serial(q, kc, vc, cos, sin, seqlens, starts, active, qs, scores, sinks, out, scale,
                  rot, interleaved, window, softcap, causal):  # fmt: skip
    bsz, m, n, _ = q.shape
    for item in range(bsz * m * n):
        _item(item, q, kc, vc, cos, sin, seqlens, starts, active, qs[0], scores[0], sinks, out,
              scale, rot, interleaved, window, softcap, causal)  # fmt: skip


@numba.njit(cache=True, parallel=True)
def _items_parallel(q, kc, vc, cos, sin, seqlens, starts, active, qs, scores, sinks, out, scale,
                    rot, interleaved, window, softcap, causal, parts):  # fmt: skip
    bsz, m, n, _ = q.shape
    items = bsz * m * n
    for p in numba.prange(parts):
        for item in range(p * items // parts, (p + 1) * items // parts):
            _item(item, q, kc, vc, cos, sin, seqlens, starts, active, qs[p], scores[p], sinks,
                  out, scale, rot, interleaved, window, softcap, causal)  # fmt: skip


@numba.njit(cache=True)
def _step_serial(q, k, v, kc, vc, cos, sin, seqlens, total_len, starts, active, qs, scores,
                 sinks, out, scale, rot, interleaved, window, softcap, causal, derive,
                 serial_below):  # fmt: skip
    """``_prepare`` and, when the items' multiply-adds are below ``serial_below``, the items
    on this thread: one call for a small step. Returns (rows that step, score slots, whether
    the items ran)."""
    used, stepped = _prepare(q, k, v, kc, vc, cos, sin, seqlens, total_len, starts, active,
                             derive, rot, interleaved, window, causal)  # fmt: skip
    if stepped == 0 or 2 * used * q.shape[3] >= serial_below:
        return stepped, used, False
    _items_serial(q, kc, vc, cos, sin, seqlens, starts, active, qs, scores, sinks, out, scale,
                  rot, interleaved, window, softcap, causal)  # fmt: skip
    return stepped, used, True


def step_parts(items: int, slots: int, head_size: int) -> int:
    """Threads a step runs its items on: 1 below PARALLEL_MIN_WORK multiply-adds (Q·K and
    the weighted values), else Numba's thread count (at most one per item)."""
    if 2 * slots * head_size < PARALLEL_MIN_WORK:
        return 1
    return max(1, min(numba.get_num_threads(), items))


def attend_rows(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    kc: np.ndarray,
    vc: np.ndarray,
    cos: np.ndarray,
    sin: np.ndarray,
    seqlens: np.ndarray,
    total_len: np.ndarray,
    starts: np.ndarray,
    active: np.ndarray,
    qs: np.ndarray,
    sinks: np.ndarray,
    out: np.ndarray,
    scale: np.float32,
    rot: int,
    interleaved: bool,
    window: int,
    softcap: float,
    causal: bool,
    derive: bool,
) -> int:
    """One step of the rows that fit (see ``_prepare``); returns how many stepped. The rows
    left (``active`` False) are untouched: cache and output.

    q (B, M, N, H), k/v (B, M, kvN, H) float32 views; kc/vc (B, kvN, cap, H) the caches;
    cos/sin (positions, rot/2) (unused when ``rot`` is 0); seqlens (B,) and total_len (1,)
    the node's inputs; starts (B,) int64 each row's first new cache row and active (B,) bool
    (both given when not ``derive``); qs (threads, H) float32 scratch; sinks (N,) float32 or empty; out (B, M, N, H) float32.
    """
    width = kc.shape[2] + 1
    threaded = len(qs) > 1 and numba.get_num_threads() > 1
    serial_below = PARALLEL_MIN_WORK if threaded else 1 << 62
    stepped, used, done = _step_serial(q, k, v, kc, vc, cos, sin, seqlens, total_len, starts,
                                       active, qs, score_scratch(1, width), sinks, out, scale,
                                       rot, interleaved, window, softcap, causal, derive,
                                       serial_below)  # fmt: skip
    if stepped == 0 or done:
        return stepped
    items = q.shape[0] * q.shape[1] * q.shape[2]
    parts = min(step_parts(items, used, q.shape[3]), len(qs))
    scores = score_scratch(parts, width)
    if parts == 1:
        _items_serial(q, kc, vc, cos, sin, seqlens, starts, active, qs, scores, sinks, out,
                      scale, rot, interleaved, window, softcap, causal)  # fmt: skip
    else:
        _items_parallel(q, kc, vc, cos, sin, seqlens, starts, active, qs, scores, sinks, out,
                        scale, rot, interleaved, window, softcap, causal, parts)  # fmt: skip
    return stepped
