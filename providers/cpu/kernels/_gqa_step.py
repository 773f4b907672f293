"""Numba kernels of the CPU GroupQueryAttention step: B rows, M <= 16 new tokens each.

Each row b holds ``seqlens[b] + 1`` tokens after the step, its M new ones last. A step writes
every row's new keys (rotated) and values into its own rows of the shared cache, then attends
each (row, new token, KV head) group: the query heads that share that KV head, over the keys
that token sees. One group is computed alone, in a fixed order, with no sum spanning two
groups: a row's result does not depend on the batch it runs in, on the thread split, or on
the step's other new tokens. A batched step gives each row exactly what a batch-1 step of
that row gives.

A step is planned once (:func:`plan_step`, by ``_GqaStep.build``): the arrays' addresses,
strides, sizes and attributes go into a descriptor of int64 words that every kernel reads,
so a call passes two arrays to Numba, and the worker pool's chunk runner (a ``cfunc``) reads
the same words. Passes (:func:`attend_rows`):

1. ``_prepare``: checks every row, writes the new keys and values of the rows that fit (the
   others are left untouched, for the caller to run otherwise), counts the score slots.
2. ``_groups``: per group, blocks of four query heads (``_heads4``; a last one, two or three
   heads one at a time, ``_head1``): the rotated, scaled queries, then per key one pass over
   its features for the four heads' scores (each key row is loaded once for them), softcap,
   and the running max; the exps of the scores minus the max (``_vector_exp.exp32``, which
   vectorizes: Numba would call scalar libm ``expf``) with one more slot holding
   ``sink - max`` (-inf without a head sink) and their sum (float64); then the exp-weighted
   sum of the value rows for the four heads at once (accumulators of 32 features in
   registers, ``stack_float32``), over the sum of the exps. Hot loops index raw pointers:
   Numba's negative-index wraparound on a computed index would make LLVM gather.

Pass 2 runs on the calling thread alone below ``PARALLEL_MIN_WORK`` multiply-adds (Q·K and
the weighted values), at one thread, or while another Python thread holds the worker pool;
else its groups split into chunks (runs of consecutive groups, about ``CHUNK_WORK``
multiply-adds each, at least two per thread) that the caller and the pool's workers take
(``_worker_pool``: the bounded wait for a late worker). A group's output heads are one run
of the output, so a chunk is one run too. Scratch: each thread computing groups needs the
rotated queries and the score rows of four heads. A worker's is in its own scratch region,
after the chunk outputs it writes there (a region holds the whole output's layout, then the
work scratch). The caller's is the step's own array (``work``, made by ``plan_step``: four
score rows of the cache's length, little beside the cache's 2 x kvN rows of H values; a step
runs on one thread at a time), never a worker's: a chunk the caller computes again while a
late worker still runs it shares nothing with that worker. A late worker may read a later
step's lengths (or other data: seqlens_k is an intermediate of the recorded graph, whose
memory later nodes reuse): a group whose lengths fall outside the cache or the cos/sin
tables is skipped, so it reads and writes only within its arrays (its result is never
copied).

Every group, pooled or not, runs in the chunk runner (``_step_chunk``): one compiled copy of
the arithmetic. Numba links a callee into each caller compiled in one process and optimizes
it anew there (a caller loaded from the cache calls the callee's own copy), and with
``reassoc``/``contract`` two copies may round differently: a step's serial and pooled
callers did, by an ulp. So a pooled step equals a serial one bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import numba
import numpy as np

from onnx_genrt.core.errors import KernelError

from ._intrinsics import address_as_pointer, call_address, float32_from_bits, stack_float32
from ._native_calls import NativeCall, native_runner, word_view, words
from ._vector_exp import exp32
from ._worker_pool import (
    ARGS,
    COPY,
    FIRST_ARG,
    MAX_CHUNKS,
    NO_POOL,
    OUT,
    chunk_runner,
    enter,
    pool_threads,
    run_job,
    set_arg,
    worker_pool,
)

_F32 = np.float32
#: Multiply-adds of a step (Q·K and the weighted values, all heads) below which its groups
#: run on the calling thread alone, and about the multiply-adds per chunk of a pooled step.
#: In the embedded model's decode and verify steps at two threads (docs/performance.md) the
#: pool paid from about 64K (8 rows from context ~16, one row from ~128; below, one row was
#: within the noise), and chunks of 16K and 32K did alike.
PARALLEL_MIN_WORK = 1 << 16
CHUNK_WORK = 1 << 15
# Sums may be reordered so LLVM vectorizes them (as in _skinny_matmul); no nnan/ninf: the
# -inf of the sink slot keeps its meaning.
_FM = {"reassoc", "contract"}
_ALIGN = 16  # float32 values: scratch rows start on 64-byte boundaries

# Descriptor words (int64): sizes and attributes, then addresses (bytes) and element strides.
_B, _M, _N, _H, _KVN, _CAP, _POSITIONS = 0, 1, 2, 3, 4, 5, 6
_ROT, _INTERLEAVED, _WINDOW, _CAUSAL, _DERIVE = 7, 8, 9, 10, 11
_SCALE, _SOFTCAP, _INV_SOFTCAP, _SINKS = 12, 13, 14, 15  # float32 bits; sinks: 0 or N
_Q, _QB, _QI, _QN = 16, 17, 18, 19  # q/k/v: address, strides of row, token and head
_K, _KB, _KI, _KN = 20, 21, 22, 23
_V, _VB, _VI, _VN = 24, 25, 26, 27
_KC, _VC, _COS, _SIN, _SEQLENS, _TOTAL, _STARTS, _ACTIVE, _SINK_VALUES, _OUT = range(28, 38)
_SCORES_AT, _SCORE_STRIDE, _OUT_VALUES = 38, 39, 40  # work scratch layout; output size
_WORDS = 41


@numba.njit(cache=True)
def rope_row(x, cos, sin, out, rot, interleaved):
    """out = x rotated by one position's cos/sin rows (rot/2,); features past ``rot`` copied
    (half-split or ``interleaved`` pairs). RotaryEmbedding (``attention._rope``) and the
    GroupQueryAttention step both rotate keys with it."""
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
def _fp(addr):
    """The float32 at byte address ``addr`` as a pointer (indexed without wraparound)."""
    return address_as_pointer(addr, _F32)


@numba.njit(cache=True, inline="always")
def _row(addr, n):
    """The ``n`` float32 values at byte address ``addr`` as a 1-D array."""
    return numba.carray(address_as_pointer(addr, _F32), (n,))


@numba.njit(cache=True)
def _prepare(d):
    """Check the rows, write the new keys/values of those that fit; returns (score slots
    the stepping groups use, rows that step).

    A row fits when it has at least M tokens and its positions are in the cos/sin cache;
    with ``derive``, also when its cache holds it and ``total_len``: its new rows then start
    at seqlens[b] + 1 - M. Without ``derive`` (a window-sized cache placed by the caller)
    ``starts`` holds each row's first new cache row and ``active`` is False for the rows the
    caller could not place. ``active`` gets which rows step.
    """
    bsz, m, n, h, kvn, cap = d[_B], d[_M], d[_N], d[_H], d[_KVN], d[_CAP]
    rot, interleaved, window, causal = d[_ROT], d[_INTERLEAVED] != 0, d[_WINDOW], d[_CAUSAL] != 0
    half = rot // 2
    seqlens = address_as_pointer(d[_SEQLENS], np.int32)
    total_len = address_as_pointer(d[_TOTAL], np.int32)
    starts = address_as_pointer(d[_STARTS], np.int64)
    active = address_as_pointer(d[_ACTIVE], np.uint8)
    used = 0
    stepped = 0
    for b in range(bsz):
        t = np.int64(seqlens[b]) + 1
        fits = t >= m and (rot == 0 or t <= d[_POSITIONS])
        if d[_DERIVE]:
            fits = fits and t <= cap and total_len[0] <= cap
            starts[b] = t - m
        else:
            fits = fits and active[b] != 0
        active[b] = 1 if fits else 0
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
                at = 4 * (((b * kvn + kh) * cap + row) * h)
                key = _row(d[_K] + 4 * (b * d[_KB] + i * d[_KI] + kh * d[_KN]), h)
                value = _fp(d[_V] + 4 * (b * d[_VB] + i * d[_VI] + kh * d[_VN]))
                kc = _row(d[_KC] + at, h)
                vc = _fp(d[_VC] + at)
                if rot > 0:
                    p = 4 * (pos0 + i) * half
                    rope_row(key, _row(d[_COS] + p, half), _row(d[_SIN] + p, half), kc, rot,
                             interleaved)  # fmt: skip
                else:
                    for e in range(h):
                        kc[e] = key[e]
                for e in range(h):
                    vc[e] = value[e]
    return used, stepped


@numba.njit(cache=True, fastmath=_FM, inline="always")
def _load_query(d, src, pos, dst):
    """dst[:H] = the query at address ``src`` rotated to position ``pos``, times the scale."""
    h, rot = d[_H], d[_ROT]
    scale = float32_from_bits(d[_SCALE])
    x = _fp(src)
    y = _fp(dst)
    if rot > 0:
        half = rot // 2
        c = _fp(d[_COS] + 4 * pos * half)
        s = _fp(d[_SIN] + 4 * pos * half)
        if d[_INTERLEAVED]:
            for k in range(half):
                x1 = x[2 * k]
                x2 = x[2 * k + 1]
                y[2 * k] = (c[k] * x1 - s[k] * x2) * scale
                y[2 * k + 1] = (s[k] * x1 + c[k] * x2) * scale
        else:
            for k in range(half):
                x1 = x[k]
                x2 = x[k + half]
                y[k] = (c[k] * x1 - s[k] * x2) * scale
                y[k + half] = (s[k] * x1 + c[k] * x2) * scale
        for e in range(rot, h):
            y[e] = x[e] * scale
    else:
        for e in range(h):
            y[e] = x[e] * scale


@numba.njit(cache=True, inline="always")
def _softcapped(s, d):
    """softcap * tanh(s / softcap) in float32 (the general path's order); s when 0."""
    cap = float32_from_bits(d[_SOFTCAP])
    if cap > 0:
        return _F32(math.tanh(s * float32_from_bits(d[_INV_SOFTCAP]))) * cap
    return s


@numba.njit(cache=True, inline="always")
def _sink(d, hq):
    """Head ``hq``'s sink logit, -inf without sinks."""
    if d[_SINKS] > 0:
        return _fp(d[_SINK_VALUES])[hq]
    return _F32(-np.inf)


@numba.njit(cache=True, fastmath=_FM, inline="always")
def _exps(d, sc, w, mx, hq):
    """sc[:w] = exp(scores - max), sc[w] = exp(sink - max) (0 without sinks); returns one
    over their sum (float64)."""
    for j in range(w):
        sc[j] = exp32(sc[j] - mx)
    sc[w] = exp32(_sink(d, hq) - mx) if d[_SINKS] > 0 else _F32(0)
    total = 0.0
    for j in range(w + 1):
        total += sc[j]
    return _F32(1.0 / total)


@numba.njit(cache=True, fastmath=_FM)
def _heads4(d, q, hq, pos, keys, values, w, out, work):
    """Query heads hq..hq+3 (queries from address ``q`` on, one KV head): their outputs to
    address ``out`` on. ``keys``/``values``: the first cache row they see, ``w`` rows."""
    h, ss = d[_H], d[_SCORE_STRIDE]
    for t in range(4):
        _load_query(d, q + 4 * (hq + t) * d[_QN], pos, work + 4 * t * h)
    qp = _fp(work)
    sa = work + 4 * d[_SCORES_AT]
    sp = _fp(sa)
    kp = _fp(keys)
    m0, m1, m2, m3 = _sink(d, hq), _sink(d, hq + 1), _sink(d, hq + 2), _sink(d, hq + 3)
    for j in range(w):  # four heads' scores per key row
        kr = j * h
        a0 = a1 = a2 = a3 = _F32(0)
        for e in range(h):
            kv = kp[kr + e]
            a0 += qp[e] * kv
            a1 += qp[h + e] * kv
            a2 += qp[2 * h + e] * kv
            a3 += qp[3 * h + e] * kv
        a0 = _softcapped(a0, d)
        a1 = _softcapped(a1, d)
        a2 = _softcapped(a2, d)
        a3 = _softcapped(a3, d)
        sp[j] = a0
        sp[ss + j] = a1
        sp[2 * ss + j] = a2
        sp[3 * ss + j] = a3
        m0 = max(m0, a0)
        m1 = max(m1, a1)
        m2 = max(m2, a2)
        m3 = max(m3, a3)
    inv0 = _exps(d, _fp(sa), w, m0, hq)
    inv1 = _exps(d, _fp(sa + 4 * ss), w, m1, hq + 1)
    inv2 = _exps(d, _fp(sa + 8 * ss), w, m2, hq + 2)
    inv3 = _exps(d, _fp(sa + 12 * ss), w, m3, hq + 3)
    vp = _fp(values)
    op = _fp(out)
    acc = stack_float32(128)  # 32 features of four heads, in registers
    for c in range(0, h - 31, 32):
        for x in range(128):
            acc[x] = 0
        for j in range(w):
            vr = j * h + c
            e0 = sp[j]
            e1 = sp[ss + j]
            e2 = sp[2 * ss + j]
            e3 = sp[3 * ss + j]
            for x in range(32):
                vv = vp[vr + x]
                acc[x] += e0 * vv
                acc[32 + x] += e1 * vv
                acc[64 + x] += e2 * vv
                acc[96 + x] += e3 * vv
        for x in range(32):
            op[c + x] = acc[x] * inv0
            op[h + c + x] = acc[32 + x] * inv1
            op[2 * h + c + x] = acc[64 + x] * inv2
            op[3 * h + c + x] = acc[96 + x] * inv3
    for e in range(h - h % 32, h):
        s0 = s1 = s2 = s3 = _F32(0)
        for j in range(w):
            vv = vp[j * h + e]
            s0 += sp[j] * vv
            s1 += sp[ss + j] * vv
            s2 += sp[2 * ss + j] * vv
            s3 += sp[3 * ss + j] * vv
        op[e] = s0 * inv0
        op[h + e] = s1 * inv1
        op[2 * h + e] = s2 * inv2
        op[3 * h + e] = s3 * inv3


@numba.njit(cache=True, fastmath=_FM)
def _head1(d, q, hq, pos, keys, values, w, out, work):
    """Query head ``hq`` alone (``_heads4`` for one head)."""
    h = d[_H]
    _load_query(d, q + 4 * hq * d[_QN], pos, work)
    qp = _fp(work)
    sa = work + 4 * d[_SCORES_AT]
    sp = _fp(sa)
    kp = _fp(keys)
    mx = _sink(d, hq)
    j = 0
    while j + 4 <= w:  # four keys per pass over the query
        kr = j * h
        a0 = a1 = a2 = a3 = _F32(0)
        for e in range(h):
            x = qp[e]
            a0 += x * kp[kr + e]
            a1 += x * kp[kr + h + e]
            a2 += x * kp[kr + 2 * h + e]
            a3 += x * kp[kr + 3 * h + e]
        a0 = _softcapped(a0, d)
        a1 = _softcapped(a1, d)
        a2 = _softcapped(a2, d)
        a3 = _softcapped(a3, d)
        sp[j] = a0
        sp[j + 1] = a1
        sp[j + 2] = a2
        sp[j + 3] = a3
        mx = max(mx, max(max(a0, a1), max(a2, a3)))
        j += 4
    while j < w:
        kr = j * h
        a = _F32(0)
        for e in range(h):
            a += qp[e] * kp[kr + e]
        a = _softcapped(a, d)
        sp[j] = a
        mx = max(mx, a)
        j += 1
    inv = _exps(d, sp, w, mx, hq)
    vp = _fp(values)
    op = _fp(out)
    acc = stack_float32(32)
    for c in range(0, h - 31, 32):
        for x in range(32):
            acc[x] = 0
        for j in range(w):
            vr = j * h + c
            e0 = sp[j]
            for x in range(32):
                acc[x] += e0 * vp[vr + x]
        for x in range(32):
            op[c + x] = acc[x] * inv
    for e in range(h - h % 32, h):
        s = _F32(0)
        for j in range(w):
            s += sp[j] * vp[j * h + e]
        op[e] = s * inv


@numba.njit(cache=True)
def _groups(d, g0, g1, out, work):
    """Groups [g0, g1) (group = (row, new token, KV head)), their query heads' outputs into
    the output laid out at address ``out``; ``work``: the thread's scratch address. A group
    of a row not stepping, or whose lengths fall outside the cache or the cos/sin tables (a
    late worker reading a later step's), is skipped."""
    m, n, h, kvn, cap = d[_M], d[_N], d[_H], d[_KVN], d[_CAP]
    seqlens = address_as_pointer(d[_SEQLENS], np.int32)
    starts = address_as_pointer(d[_STARTS], np.int64)
    active = address_as_pointer(d[_ACTIVE], np.uint8)
    per = n // kvn
    for grp in range(g0, g1):
        kvh = grp % kvn
        i = (grp // kvn) % m
        b = grp // (kvn * m)
        if active[b] == 0:
            continue
        start = starts[b]
        pos = np.int64(seqlens[b]) + 1 - m + i
        k0, k1 = _key_range(start, i, m, d[_WINDOW], d[_CAUSAL] != 0)
        if k0 < 0 or k1 > cap or k1 <= k0 or (d[_ROT] > 0 and not 0 <= pos < d[_POSITIONS]):
            continue
        at = 4 * (((b * kvn + kvh) * cap + k0) * h)
        q = d[_Q] + 4 * (b * d[_QB] + i * d[_QI])
        o = out + 4 * ((b * m + i) * n) * h
        t = kvh * per
        while t + 4 <= (kvh + 1) * per:
            _heads4(d, q, t, pos, d[_KC] + at, d[_VC] + at, k1 - k0, o + 4 * t * h, work)
            t += 4
        while t < (kvh + 1) * per:
            _head1(d, q, t, pos, d[_KC] + at, d[_VC] + at, k1 - k0, o + 4 * t * h, work)
            t += 1


@numba.njit(cache=True)
def _copy_groups(d, g0, g1, src):
    """The outputs of groups [g0, g1) of stepping rows from the output laid out at address
    ``src`` (a worker's scratch region) into the step's output."""
    m, kvn = d[_M], d[_KVN]
    run = d[_N] // kvn * d[_H]  # a group's output values, consecutive
    active = address_as_pointer(d[_ACTIVE], np.uint8)
    s = _fp(src)
    o = _fp(d[_OUT])
    for grp in range(g0, g1):
        if active[grp // (kvn * m)] != 0:
            for x in range(grp * run, (grp + 1) * run):
                o[x] = s[x]


@numba.njit(cache=True, inline="always")
def step_chunks(d, used, threads, min_work, chunk_work):
    """Chunks a step's groups split into: 1 (the calling thread alone) at one thread or
    below ``min_work`` multiply-adds, else about ``chunk_work`` multiply-adds each, at least
    two per thread, at most one per group."""
    groups = d[_B] * d[_M] * d[_KVN]
    work = 2 * used * d[_H]
    if threads < 2 or work < min_work:
        return 1
    return max(1, min(groups, MAX_CHUNKS, max(2 * threads, work // chunk_work)))


@numba.njit(cache=True, nogil=True)
def _step(d, args, ctrl, runner, threads, min_work, chunk_work, chunks):
    """``_prepare``, then the groups: in chunks over the worker pool (``step_chunks``), or
    as one chunk on this thread (one chunk, or another thread holds the pool). Either way
    the groups run in the chunk runner ``runner`` (one compiled copy of the arithmetic, see
    the module docstring). Returns (rows that stepped, ``run_job``'s status;
    0 when nothing is left to do, 3 when this thread's chunk failed). ``chunks`` > 0 sets
    the split (at most one chunk per group)."""
    used, stepped = _prepare(d)
    if stepped == 0:
        return stepped, 0
    if chunks > 0:
        chunks = min(chunks, d[_B] * d[_M] * d[_KVN], MAX_CHUNKS)
    else:
        chunks = step_chunks(d, used, threads, min_work, chunk_work)
    if chunks < 2 or not enter(ctrl):
        return stepped, 3 if call_address(runner, args.ctypes.data, 0, OUT) != 0 else 0
    set_arg(ctrl, 0, args[FIRST_ARG])
    set_arg(ctrl, 1, args[FIRST_ARG + 1])
    return stepped, run_job(ctrl, runner, chunks)


def _step_chunk(args, chunk, mode):
    """Chunk runner (``_worker_pool``): the groups of chunk ``chunk`` into the output (the
    caller, with its own scratch), into the worker's scratch region (the output's layout,
    then its work scratch), or copied from that region. No ``try`` (one costs a cfunc about
    0.5 s of first-run compilation): nothing raises once the chunk and KV head counts are
    positive."""
    a = numba.carray(address_as_pointer(args, np.int64), (ARGS,))
    d = numba.carray(address_as_pointer(a[FIRST_ARG], np.int64), (_WORDS,))
    if a[1] < 1 or d[_KVN] < 1 or d[_M] < 1:
        return 1
    groups = d[_B] * d[_M] * d[_KVN]
    g0 = chunk * groups // a[1]
    g1 = (chunk + 1) * groups // a[1]
    if mode == COPY:
        _copy_groups(d, g0, g1, a[0])
    elif mode == OUT:
        _groups(d, g0, g1, d[_OUT], a[FIRST_ARG + 1])
    else:
        _groups(d, g0, g1, a[0], a[0] + 4 * d[_OUT_VALUES])
    return 0


_step_runner = chunk_runner(_step_chunk)


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class StepPlan(NamedTuple):
    """A planned step: the descriptor, the calling thread's scratch, the arrays the
    descriptor points to (kept alive for a late worker) and the float32 values a worker's
    scratch region needs."""

    desc: np.ndarray  # (_WORDS,) int64
    args: np.ndarray  # a one-chunk job's argument words (ARGS int64), for this thread alone
    work: np.ndarray  # the calling thread's scratch, float32
    keep: tuple[np.ndarray, ...]
    region_values: int


def _f32_bits(x: float) -> int:
    return int(np.float32(x).view(np.int32))


def _strides(x: np.ndarray) -> tuple[int, int, int]:
    """Element strides of a (B, M, heads, H) float32 view's first three axes."""
    return tuple(s // 4 for s in x.strides[:3])  # type: ignore[return-value]


def plan_problem(q, k, v, kc, vc, cos, sin, seqlens, total_len, out) -> str | None:
    """Why these arrays cannot be planned (None when they can): the kernels read raw
    addresses, so each head's features, the caches, the cos/sin tables and the output must
    be contiguous, and the lengths int32."""
    for name, x in (("query", q), ("key", k), ("value", v)):
        if x.dtype != _F32 or x.strides[3] != 4 or any(s % 4 for s in x.strides):
            return f"{name} heads not contiguous float32"
    for name, x in (("past_key/past_value", kc), ("past_key/past_value", vc), ("output", out),
                    ("cos/sin caches", cos), ("cos/sin caches", sin)):  # fmt: skip
        if not x.flags.c_contiguous:
            return f"{name} not C-contiguous"
    if seqlens.dtype != np.int32 or total_len.dtype != np.int32:
        return "seqlens_k / total_sequence_length not int32"
    return None


def plan_step(
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
    sinks: np.ndarray,
    out: np.ndarray,
    scale: float,
    rot: int,
    interleaved: bool,
    window: int,
    softcap: float,
    causal: bool,
    derive: bool,
) -> StepPlan:
    """The step on these arrays (``plan_problem`` must be None for them).

    q (B, M, N, H), k/v (B, M, kvN, H) float32 views (heads contiguous); kc/vc (B, kvN, cap,
    H) the caches; cos/sin (positions, rot/2) (unused when ``rot`` is 0); seqlens (B,) and
    total_len (1,) int32, the node's inputs; starts (B,) int64 each row's first new cache
    row and active (B,) bool (both given when not ``derive``); sinks (N,) float32 or empty;
    out (B, M, N, H) float32, C-contiguous.
    """
    b, m, n, h = q.shape
    kvn, cap = kc.shape[1], kc.shape[2]
    stride = _aligned(cap + 1)
    scores_at = _aligned(4 * h)
    work = np.zeros(scores_at + 4 * stride, _F32)
    out_values = _aligned(out.size)
    d = np.zeros(_WORDS, np.int64)
    d[[_B, _M, _N, _H, _KVN, _CAP, _POSITIONS]] = b, m, n, h, kvn, cap, cos.shape[0]
    d[[_ROT, _INTERLEAVED, _WINDOW, _CAUSAL, _DERIVE]] = rot, interleaved, window, causal, derive
    d[_SCALE] = _f32_bits(scale)
    d[_SOFTCAP] = _f32_bits(softcap) if softcap > 0 else 0
    d[_INV_SOFTCAP] = _f32_bits(1.0 / softcap) if softcap > 0 else 0
    d[_SINKS] = sinks.shape[0]
    for at, x in ((_Q, q), (_K, k), (_V, v)):
        d[at] = x.ctypes.data
        d[at + 1 : at + 4] = _strides(x)
    arrays = (kc, vc, cos, sin, seqlens, total_len, starts, active, sinks, out)
    for at, x in zip(range(_KC, _OUT + 1), arrays, strict=True):
        d[at] = x.ctypes.data
    d[[_SCORES_AT, _SCORE_STRIDE, _OUT_VALUES]] = scores_at, stride, out_values
    args = np.zeros(ARGS, np.int64)
    args[1] = 1
    args[FIRST_ARG : FIRST_ARG + 2] = d.ctypes.data, work.ctypes.data
    keep = (d, args, work, q, k, v, *arrays)
    return StepPlan(d, args, work, keep, out_values + work.size)


def attend_rows(plan: StepPlan, chunks: int = 0) -> int:
    """One step of the rows that fit (see ``_prepare``); returns how many stepped. The rows
    left (``active`` False) are untouched: cache and output. ``chunks`` > 0 splits the
    groups into that many chunks over the worker pool (default ``step_chunks``), whatever
    the work, when the pool has two threads or more."""
    threads = pool_threads()
    if threads < 2:
        stepped, status = _step(plan.desc, plan.args, NO_POOL, _step_runner(), 1, 0, 1, 1)
        if status:
            raise KernelError("GroupQueryAttention step: the chunk kernel failed")
        return stepped
    pool = worker_pool()
    pool.reserve(plan.region_values)
    stepped, status = _step(plan.desc, plan.args, pool.ctrl, _step_runner(), threads,
                            PARALLEL_MIN_WORK, CHUNK_WORK, chunks)  # fmt: skip
    if status & 3:
        pool.settle(status, plan.keep, "GroupQueryAttention step")
    return stepped


# -- native form (``_native_calls``) ------------------------------------------------------------

#: Words of the native form: plan's descriptor and argument block, the pool's ctrl and its
#: length (a one-word stand-in at one thread), the chunk runner, threads, then the results:
#: rows that stepped and ``run_job``'s status.
_N_WORDS = 9
_N_STEPPED, _N_STATUS = 7, 8


def _step_native(args, _a, _b):
    """``attend_rows`` as a native call: 0 when every row stepped and no worker is late;
    1 otherwise, the rows that stepped and the pool's status left in the words."""
    try:
        w = word_view(args, _N_WORDS)
        d = numba.carray(address_as_pointer(w[0], np.int64), (_WORDS,))
        plan_args = numba.carray(address_as_pointer(w[1], np.int64), (ARGS,))
        ctrl = numba.carray(address_as_pointer(w[2], np.int64), (w[3],))
        threads = w[5]
        one, zero = np.int64(1), np.int64(0)  # not literals: _step compiles once
        if threads < 2:
            stepped, status = _step(d, plan_args, ctrl, w[4], one, zero, one, one)
        else:
            stepped, status = _step(d, plan_args, ctrl, w[4], threads,
                                    np.int64(PARALLEL_MIN_WORK), np.int64(CHUNK_WORK), zero)  # fmt: skip
        w[_N_STEPPED] = stepped
        w[_N_STATUS] = status
        return 0 if stepped == d[_B] and (status & 3) == 0 else 1
    except Exception:  # noqa: BLE001 - a native call reports failure by its code
        w = word_view(args, _N_WORDS)
        w[_N_STEPPED] = -1
        return 1


_step_native_runner = native_runner(_step_native)


def native_step(plan: StepPlan, finish: Callable[[int], None]) -> Callable[[], NativeCall]:
    """The native form of ``attend_rows(plan)``: ``finish(stepped)`` runs in Python when not
    every row stepped (after the pool kept a late worker's arrays, or raised for a failed
    chunk); ``stepped`` is -1 when the native call failed before stepping."""

    def make() -> NativeCall:
        threads = pool_threads()
        ctrl = NO_POOL
        if threads >= 2:
            pool = worker_pool()
            pool.reserve(plan.region_values)
            ctrl = pool.ctrl
        w = words(plan.desc.ctypes.data, plan.args.ctypes.data, ctrl.ctypes.data, ctrl.size,
                  _step_runner(), threads, 0, 0, 0)  # fmt: skip

        def on_code(_code: int) -> None:
            status = int(w[_N_STATUS])
            if status & 3:
                worker_pool().settle(status, plan.keep, "GroupQueryAttention step")
            finish(int(w[_N_STEPPED]))

        return NativeCall(_step_native_runner(), w, on_code, (*plan.keep, ctrl), _N_STATUS)

    return make
