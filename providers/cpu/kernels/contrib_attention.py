"""CPU kernels: com.microsoft GroupQueryAttention and RotaryEmbedding (onnxruntime contrib ops).

GroupQueryAttention keeps its KV cache in BNSH buffers. When ``past_key`` is at least
``total_sequence_length`` long it is the shared past/present buffer: the new keys and values
are written into it in place and it is returned as ``present_key`` (the same object).
Otherwise a present buffer of ``total_sequence_length`` is filled (concat mode). Each
batch entry b holds seqlens_k[b] + 1 tokens after the step, the new ones at the end.

With ``sliding_window_cache=1`` (Gemma-2's local layers as onnxruntime-genai's builder writes
them) past/present are a window-sized cache instead: present is as long as past, and rows
[0, L) hold the L most recent tokens in onnxruntime's layout (see
``core.op_rules.windowed_cache_length``); the queries attend to those rows and the new keys,
and the rows are then compacted in place. RoPE keeps absolute positions.

A decode or verify step (B >= 1 rows of up to 16 new tokens each, every row at its own
length, float32, shared buffers) runs as a _GqaStep built once per node and buffers: the
kernel's ``bind`` (KernelDef.bind) hands it to a recorded CPU graph, and eager calls keep one
in ``ctx.state``. Its arithmetic (Numba, ``_gqa_step``) is per row and KV head, so a row gives
the same bits in any batch; it agrees with the general path to float32 rounding. Anything
else takes the general path, and a step-shaped call that does is counted
(``general_path_steps``).
"""

from __future__ import annotations

import itertools
import math
import operator
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numba
import numpy as np

from onnx_genrt.core.kernels import MS_DOMAIN, KernelContext, NodeInfo
from onnx_genrt.core.op_rules import (
    GqaShapes,
    gqa_attribute_problem,
    gqa_input_problem,
    gqa_shapes,
    rotary_layout,
    rotary_problem,
    windowed_cache_length,
)

from ._gqa_step import attend_rows, native_step, plan_problem, plan_step
from ._nn_common import softmax_rows
from ._prompt_threads import run_parts, splits
from ._registry import REGISTRY
from ._worker_pool import pool_threads
from .attention import _rope

_F32 = np.dtype(np.float32)
_SCORE_BUDGET = 1 << 23  # score elements per query chunk (32 MiB of float32)

# Optional GroupQueryAttention inputs past the ones this kernel implements.
_REFUSED_INPUTS = ("k_scale", "v_scale", "q_norm_weight", "k_norm_weight")


# ----------------------------------------------------------------------------- rotary helpers


def rotate(x4: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleaved: bool) -> np.ndarray:
    """Rotary embedding of (B, H, S, D) ``x4`` as a new float32 array.

    ``cos``/``sin`` are (B, S, rot/2); features past ``rot`` pass through unchanged.
    """
    rot = 2 * cos.shape[-1]
    if rot > x4.shape[-1]:
        raise ValueError(f"rotary dim {rot} exceeds head size {x4.shape[-1]}")
    src = x4 if x4.dtype == _F32 else x4.astype(_F32)
    out = np.empty(x4.shape, _F32)
    c = np.ascontiguousarray(cos, dtype=_F32)
    s = np.ascontiguousarray(sin, dtype=_F32)
    _rope(src, c, s, out, rot, interleaved)
    return out


def _gather_cache(cache: np.ndarray, pos: np.ndarray, what: str) -> np.ndarray:
    """cos/sin cache rows at ``pos``, bounds-checked."""
    if pos.size and (pos.min() < 0 or pos.max() >= cache.shape[0]):
        raise ValueError(f"{what}: position {int(pos.max())} outside cache of {cache.shape[0]}")
    return cache[pos]


# ----------------------------------------------------------------------------- RotaryEmbedding


def _rotary_positions(position_ids: np.ndarray, b: int, s: int) -> np.ndarray:
    """(B, S) positions from (B, S) ids or a single start offset."""
    pos = position_ids.astype(np.intp, copy=False)
    if pos.size == 1:
        return np.broadcast_to(pos.reshape(()) + np.arange(s), (b, s))
    return pos.reshape(b, s)


@REGISTRY.register("RotaryEmbedding", since=1, domain=MS_DOMAIN, check=rotary_problem)
def rotary_embedding_ms(
    ctx: KernelContext,
    x: np.ndarray,
    position_ids: np.ndarray,
    cos_cache: np.ndarray,
    sin_cache: np.ndarray,
) -> np.ndarray:
    """com.microsoft RotaryEmbedding on (B, S, hidden) or (B, N, S, H); ``scale`` is unused."""
    lay = rotary_layout(ctx.node, x.shape, cos_cache.shape)
    b, s, d = lay.batch, lay.seq, lay.head_size
    x4 = x if lay.bnsh else x.reshape(b, s, lay.heads, d).transpose(0, 2, 1, 3)
    pos = _rotary_positions(position_ids, b, s)
    cos = _gather_cache(cos_cache, pos, ctx.node.describe())
    sin = _gather_cache(sin_cache, pos, ctx.node.describe())
    y4 = rotate(x4, cos, sin, bool(ctx.attr("interleaved", 0)))
    out = ctx.out(0, x.shape, x.dtype)
    if x.ndim == 4:
        out[...] = y4
    else:
        out.reshape(b, s, y4.shape[1], d)[...] = y4.transpose(0, 2, 1, 3)
    return out


# ----------------------------------------------------------------------------- GQA config


@dataclass(frozen=True)
class _GqaConfig:
    heads: int
    kv_heads: int
    scale: float | None
    rotary: bool
    interleaved: bool
    window: int  # keys a query sees, itself included (<= 0: unlimited)
    softcap: float
    smooth: bool
    causal: bool
    window_cache: bool  # sliding_window_cache=1: past/present hold only the recent rows

    @classmethod
    def from_ctx(cls, ctx: KernelContext) -> _GqaConfig:
        scale = ctx.attr("scale")
        return cls(
            int(ctx.attr("num_heads")),
            int(ctx.attr("kv_num_heads")),
            None if scale is None or float(scale) == 0.0 else float(scale),
            bool(ctx.attr("do_rotary", 0)),
            bool(ctx.attr("rotary_interleaved", 0)),
            int(ctx.attr("local_window_size", -1)),
            float(ctx.attr("softcap", 0.0)),
            int(ctx.attr("smooth_softmax", -1)) == 1,
            bool(ctx.attr("causal", 1)),
            bool(ctx.attr("sliding_window_cache", 0)),
        )


def _gqa_check(node: NodeInfo, _types: object) -> str | None:
    """Reason this GroupQueryAttention node is not supported, or None."""
    return gqa_input_problem(node, _REFUSED_INPUTS) or gqa_attribute_problem(node)


# ----------------------------------------------------------------------------- GQA pieces


def _split_qkv(
    geom: GqaShapes, query: np.ndarray, key: np.ndarray | None, value: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(B, S, heads, H) views of Q, K, V from separate or packed inputs (checked shapes)."""
    b, s, n, kvn, h = geom.batch, geom.seq, geom.heads, geom.kv_heads, geom.head_size
    if geom.packed:
        qkv = query.reshape(b, s, n + 2 * kvn, h)
        return qkv[:, :, :n], qkv[:, :, n : n + kvn], qkv[:, :, n + kvn :]
    return query.reshape(b, s, n, h), key.reshape(b, s, kvn, h), value.reshape(b, s, kvn, h)


@dataclass(frozen=True)
class _Lengths:
    total: np.ndarray  # keys per batch entry after this step (seqlens_k + 1)
    new: np.ndarray  # valid new tokens per batch entry
    past: np.ndarray  # tokens cached before this step
    first_prompt: bool


def _lengths(
    seqlens_k: np.ndarray, total_len: int, s: int, query_seqlens: np.ndarray | None
) -> _Lengths:
    """Per-batch total / new / past lengths from seqlens_k (and query_seqlens)."""
    total = seqlens_k.astype(np.int64).reshape(-1) + 1
    if total.size and total.min() < 1:
        raise ValueError(f"seqlens_k must be >= 0, got {seqlens_k}")
    if query_seqlens is None:
        new = np.minimum(total, s)
    else:
        new = query_seqlens.astype(np.int64).reshape(-1)
        if new.shape != total.shape or (new < 0).any() or (new > np.minimum(total, s)).any():
            raise ValueError(f"query_seqlens {query_seqlens} invalid for seqlens_k {seqlens_k}")
    first = query_seqlens is None and s == total_len
    return _Lengths(total, new, total - new, first)


def _present(
    ctx: KernelContext,
    index: int,
    past: np.ndarray | None,
    shape: tuple[int, int, int],
    dtype: np.dtype,
    lens: _Lengths,
    total_len: int,
) -> np.ndarray:
    """The present KV buffer: ``past`` itself when it can hold ``total_len`` tokens, else new.

    A new buffer (concat mode, or a read-only past) is max(past, total) long; it gets each
    entry's cached tokens copied and the rest zeroed. The caller writes the new tokens.
    """
    b, kvn, h = shape
    cap = 0
    if past is not None:  # its shape is checked (gqa_shapes)
        if past.dtype != dtype:
            raise NotImplementedError(f"past dtype {past.dtype} differs from query {dtype}")
        cap = past.shape[2]
    length = max(cap, total_len)
    if lens.total.size and lens.total.max() > length:
        raise ValueError(f"seqlens_k needs {lens.total.max()} slots, present has {length}")
    if past is not None and cap >= total_len and past.flags.writeable:
        return past
    if lens.past.size and lens.past.max() > cap:
        raise ValueError(f"seqlens_k implies {lens.past.max()} cached tokens, past has {cap}")
    out = ctx.out(index, (b, kvn, length, h), dtype)
    for i in range(b):
        p, t = int(lens.past[i]), int(lens.total[i])
        if p:
            out[i, :, :p] = past[i, :, :p]
        out[i, :, t:] = 0
    return out


def _positions(
    lens: _Lengths, s: int, position_ids: np.ndarray | None, cache_len: int
) -> np.ndarray:
    """(B, S) rotary positions; padding rows are clamped into the cache."""
    b = lens.total.shape[0]
    rows = np.arange(s)
    if position_ids is None:
        pos = lens.past.reshape(-1, 1) + rows
    elif lens.first_prompt:  # onnxruntime: a first prompt only reads the first id
        pos = np.broadcast_to(int(position_ids.reshape(-1)[0]) + rows, (b, s))
    else:
        pos = position_ids.astype(np.int64).reshape(b, s)
    valid = rows < lens.new.reshape(-1, 1)
    bad = valid & ((pos < 0) | (pos >= cache_len))
    if bad.any():
        raise ValueError(f"rotary position {int(pos[bad].max())} outside cos/sin cache")
    return np.clip(pos, 0, cache_len - 1).astype(np.intp)


# ----------------------------------------------------------------------------- GQA scores


@numba.njit(cache=True, nogil=True)
def _mask_scores(scores, rows, row0, past, total, k0, window, causal):
    """Set scores outside each query's key range to -inf.

    Row r is query row0 + r % rows at absolute position past + that; it sees keys
    [pos - window + 1, pos] (clipped to [0, total)), or all of [0, total) when not causal.
    Column j is key k0 + j.
    """
    n, m = scores.shape
    for r in range(n):
        pos = past + row0 + r % rows
        hi = min(pos, total - 1) if causal else total - 1
        lo = max(0, pos - window + 1) if window > 0 else 0
        a = min(max(lo - k0, 0), m)
        e = min(max(hi - k0 + 1, a), m)
        for j in range(a):
            scores[r, j] = -np.inf
        for j in range(e, m):
            scores[r, j] = -np.inf


@numba.njit(cache=True, nogil=True)
def _softmax_sink_rows(scores, sinks):
    """Row softmax with an extra logit ``sinks[r]`` in each row's denominator (in place)."""
    n, m = scores.shape
    for r in range(n):
        row = scores[r]
        mx = sinks[r]
        for j in range(m):
            mx = max(mx, row[j])
        total = math.exp(sinks[r] - mx)
        for j in range(m):
            v = math.exp(row[j] - mx)
            row[j] = v
            total += v
        inv = 1.0 / total
        for j in range(m):
            row[j] *= inv


@dataclass
class _BatchAttn:
    """Attention of one batch entry: its keys, values and the rules for its scores."""

    cfg: _GqaConfig
    keys: np.ndarray  # (kvN, T, H) float32
    values: np.ndarray
    past: int
    bias: np.ndarray | None  # (N or 1, S, total_len)
    sinks: np.ndarray | None  # (N,)

    def key_range(self, i0: int, i1: int) -> tuple[int, int]:
        """Keys [k0, k1) that queries [i0, i1) may see."""
        t = self.keys.shape[1]
        k1 = min(t, self.past + i1) if self.cfg.causal else t
        w = self.cfg.window
        k0 = max(0, self.past + i0 - w + 1) if w > 0 and self.cfg.causal else 0
        return min(k0, k1), k1

    def chunk(self, qc: np.ndarray, i0: int, i1: int) -> np.ndarray:
        """Attention output (kvN, G*rows, H) for query rows [i0, i1) given as (kvN, G*rows, H)."""
        cfg = self.cfg
        k0, k1 = self.key_range(i0, i1)
        scores = np.matmul(qc, self.keys[:, k0:k1].swapaxes(1, 2))
        if cfg.softcap > 0.0:
            scores *= np.float32(1.0 / cfg.softcap)
            np.tanh(scores, out=scores)
            scores *= np.float32(cfg.softcap)
        rows = i1 - i0
        if self.bias is not None:
            groups = cfg.heads // cfg.kv_heads
            bias = self.bias[:, i0:i1, k0:k1]
            if bias.shape[0] == cfg.heads:
                bias = bias.reshape(cfg.kv_heads, groups, rows, k1 - k0)
            scores.reshape(cfg.kv_heads, groups, rows, k1 - k0)[...] += bias
        flat = scores.reshape(-1, k1 - k0)
        t = self.keys.shape[1]
        _mask_scores(flat, rows, i0, self.past, t, k0, cfg.window, cfg.causal)
        if self.sinks is None:
            softmax_rows(flat, flat, True)
        else:
            _softmax_sink_rows(flat, np.repeat(self.sinks, rows))
        return np.matmul(scores, self.values[:, k0:k1])


def _attend(attn: _BatchAttn, q: np.ndarray) -> np.ndarray:
    """(N, S, H) float32 output of one batch entry from scaled (N, S, H) float32 queries."""
    cfg = attn.cfg
    n, s, h = q.shape
    kvn, groups = cfg.kv_heads, cfg.heads // cfg.kv_heads
    q5 = q.reshape(kvn, groups, s, h)
    y = np.empty((kvn, groups, s, h), _F32)
    t = max(1, attn.keys.shape[1])
    threads = pool_threads()
    split = splits(s, 2 * h, n * t)  # the two matmuls' multiply-adds
    budget = _SCORE_BUDGET // threads if split else _SCORE_BUDGET
    step = max(1, min(s, budget // (n * t)))
    if split:  # several chunks a thread: under a causal mask later rows see more keys
        step = min(step, -(-s // (4 * threads)))
    starts = range(0, s, step)

    def rows(i0: int) -> None:
        i1 = min(s, i0 + step)
        qc = q5[:, :, i0:i1].reshape(kvn, groups * (i1 - i0), h)
        y[:, :, i0:i1] = attn.chunk(qc, i0, i1).reshape(kvn, groups, i1 - i0, h)

    if not split:
        for i0 in starts:
            rows(i0)
        return y.reshape(n, s, h)
    taken = itertools.count()  # next() is atomic under the GIL: each chunk is taken once

    def part() -> None:
        while (i := next(taken)) < len(starts):
            rows(starts[i])

    run_parts([part] * threads)
    return y.reshape(n, s, h)


def _as_f32(x: np.ndarray) -> np.ndarray:
    return x if x.dtype == _F32 else x.astype(_F32)


# ----------------------------------------------------------------------------- window-sized cache


def _window_present(
    ctx: KernelContext,
    past: np.ndarray | None,
    dtype: np.dtype,
    window: int,
) -> np.ndarray:
    """The present buffer of a sliding_window_cache=1 node: ``past`` itself (written in place)
    when writeable, else a copy; either way as long as ``past`` (its capacity)."""
    if past is None:  # gqa_attribute_problem refuses this; a direct call is told why
        raise ValueError("sliding_window_cache=1 needs past_key and past_value")
    if past.dtype != dtype:
        raise NotImplementedError(f"past dtype {past.dtype} differs from query {dtype}")
    windowed_cache_length(0, past.shape[2], window)  # raises when the capacity is too small
    return past if past.flags.writeable else past.copy()


def _attend_windowed(
    cfg: _GqaConfig,
    cache_k: np.ndarray,
    cache_v: np.ndarray,
    k4: np.ndarray,
    v4: np.ndarray,
    qs: np.ndarray,
    lens: _Lengths,
    i: int,
    sinks: np.ndarray | None,
) -> np.ndarray:
    """(S, N, H) output of batch entry ``i`` on a window-sized cache (kvN, C, H), updated.

    Rows [0, L(past)) of the cache hold the most recent cached tokens (see
    op_rules.windowed_cache_length). The queries attend to those rows followed by the new
    keys (masks depend only on distances, so cache-relative rows give the same scores); then
    the cache keeps the L(total) most recent of them, again from row 0.
    """
    cap = cache_k.shape[1]
    past, total, n_new = int(lens.past[i]), int(lens.total[i]), int(lens.new[i])
    resident = windowed_cache_length(past, cap, cfg.window)
    keep = windowed_cache_length(total, cap, cfg.window)
    keys = np.concatenate([cache_k[:, :resident], k4[:, :n_new].astype(cache_k.dtype)], axis=1)
    values = np.concatenate([cache_v[:, :resident], v4[:, :n_new].astype(cache_v.dtype)], axis=1)
    attn = _BatchAttn(cfg, _as_f32(keys), _as_f32(values), resident, None, sinks)
    y = _attend(attn, qs).transpose(1, 0, 2)
    cache_k[:, :keep] = keys[:, keys.shape[1] - keep :]
    cache_v[:, :keep] = values[:, values.shape[1] - keep :]
    return y


# ----------------------------------------------------------------------------- GQA decode step

_STEP_KEY = "gqa_step"  # ctx.state entry: the eager call's prebuilt _GqaStep
_STEP_MAX_ROWS = 16  # new tokens per row the prebuilt step takes (decode and verify widths)
_NO_ROPE = np.zeros((1, 1), _F32)
_NO_SINKS = np.zeros(0, _F32)

#: Step-shaped calls (past cache given, at most _STEP_MAX_ROWS new tokens per row) that ran
#: the general path instead of the prebuilt step, by reason; process-wide.
_GENERAL_STEPS: Counter[str] = Counter()


def general_path_steps() -> dict[str, int]:
    """How many step-shaped GroupQueryAttention calls ran the general path, by reason (the
    step refused the node's inputs, or a call's lengths fell outside it)."""
    return dict(_GENERAL_STEPS)


def _step_shaped(args: Sequence[np.ndarray | None]) -> bool:
    """A decode/verify-sized call on a past cache: what the prebuilt step is for."""
    query = args[0]
    return (
        isinstance(query, np.ndarray)
        and query.ndim == 3
        and 1 <= query.shape[1] <= _STEP_MAX_ROWS
        and len(args) > 4
        and args[3] is not None
        and args[4] is not None
    )


class _GqaStep:
    """One GroupQueryAttention node prebuilt on fixed buffers: B >= 1 rows of M <= 16 new
    tokens each (every row at its own length), float32, past_key/past_value the shared
    present buffers (written in place).

    What follows from shapes and attributes (config, head views of q/k/v, cos/sin, sinks,
    the output view, scratch) is planned once (``_gqa_step.plan_step``: the kernels read
    the buffers' addresses, so they must be contiguous where ``plan_problem`` says); a call
    is one ``_gqa_step.attend_rows`` (which reads seqlens_k and total_sequence_length). A row whose lengths fall outside what the
    step handles (the cache would have to grow, fewer valid tokens than M, a rotary position
    past the cos/sin cache, a window-sized cache that would drop rows a new query still
    sees) runs the general kernel alone, as it would at batch 1; when no row can step,
    ``run()`` returns False having changed nothing, and the caller runs the general kernel.
    Each row's result is what a batch-1 step of that row gives, bit for bit.
    """

    __slots__ = ("ctx", "args", "y", "results", "seqlens", "m", "cap", "cfg", "caches",
                 "rope_len", "starts", "active", "plan", "fallback", "native")  # fmt: skip

    @classmethod
    def build(
        cls,
        ctx: KernelContext,
        args: tuple[np.ndarray | None, ...],
        out: np.ndarray | None,
        present: Sequence[np.ndarray] | None = None,
    ) -> _GqaStep | str:
        """The step for these inputs (``out``: output 0, None = ctx.out), or why not.

        ``present``: the buffers the caller expects present_key/present_value in; they
        must be past_key/past_value themselves.
        """
        a = list(args[:17]) + [None] * (17 - len(args))
        query, key, value, past_key, past_value, seqlens_k, total_len = a[:7]
        cos_cache, sin_cache, position_ids, attention_bias, head_sink = a[7:12]
        if not _step_shaped(a):
            return "not a step: a past cache and at most 16 new tokens per row"
        if any(x is not None for x in (position_ids, attention_bias, *a[12:])):
            return "position_ids, attention_bias or query_seqlens given"
        if query.dtype != _F32:
            return f"{query.dtype} query (the step is float32)"
        b = query.shape[0]
        if seqlens_k is None or seqlens_k.size != b or total_len is None or np.size(total_len) != 1:
            return "seqlens_k / total_sequence_length missing or misshapen"
        if _gqa_check(ctx.node, ()) is not None:
            return "unsupported node"  # the general path raises the error
        cfg = _GqaConfig.from_ctx(ctx)
        try:
            geom = gqa_shapes(ctx.node, query, key, value, past_key, past_value, seqlens_k,
                              cos_cache, sin_cache, head_sink)  # fmt: skip
        except ValueError:
            return "inconsistent shapes"  # the general path raises the error
        q, k, v = _split_qkv(geom, query, key, value)
        _, m, n, h = q.shape
        for past in (past_key, past_value):
            if not isinstance(past, np.ndarray) or past.dtype != _F32 or not past.flags.writeable:
                return "past_key/past_value not writeable float32 arrays"
        if present is not None and not (
            len(present) == 2
            and all(
                p is want or _same_buffer(p, want)
                for p, want in zip(present, (past_key, past_value), strict=True)
            )
        ):
            return "present_key/present_value are not the past buffers"
        if out is None:
            out = ctx.out(0, (b, m, n * h), _F32)
        if out.shape != (b, m, n * h) or out.dtype != _F32 or not out.flags.c_contiguous:
            return "output 0 is not a C-contiguous float32 buffer"
        rot, cos, sin = 0, _NO_ROPE, _NO_ROPE
        if cfg.rotary:
            if cos_cache is None or sin_cache is None or geom.rotary_dim == 0:
                return "do_rotary without cos/sin caches"
            if cos_cache.dtype != _F32 or sin_cache.dtype != _F32:
                return "cos/sin caches not float32"
            rot, cos, sin = 2 * cos_cache.shape[1], cos_cache, sin_cache
        if head_sink is not None and head_sink.dtype != _F32:
            return "head_sink not float32"
        if head_sink is not None:
            sinks = head_sink.reshape(-1)
        else:
            sinks = np.zeros(n, _F32) if cfg.smooth else _NO_SINKS
        scale = cfg.scale if cfg.scale is not None else 1.0 / math.sqrt(h)
        seqlens, total = seqlens_k.reshape(-1), np.asarray(total_len).reshape(-1)
        out4 = out.reshape(b, m, n, h)
        problem = plan_problem(q, k, v, past_key, past_value, cos, sin, seqlens, total, out4)
        if problem is not None:
            return problem
        step = cls()
        step.ctx = ctx
        step.args = tuple(args)
        step.y = out
        step.results = (out, past_key, past_value)
        step.seqlens = seqlens
        step.m, step.cap, step.cfg = m, past_key.shape[2], cfg
        step.caches = (past_key, past_value)
        step.rope_len = len(cos) if cfg.rotary else 1 << 62
        step.starts = np.zeros(b, np.int64)
        step.active = np.zeros(b, np.bool_)
        step.plan = plan_step(q, k, v, past_key, past_value, cos, sin, seqlens, total,
                              step.starts, step.active, sinks, out4, scale, rot,
                              cfg.interleaved, cfg.window, cfg.softcap, cfg.causal,
                              not cfg.window_cache)  # fmt: skip
        step.fallback = None
        step.native = None
        return step

    def serves(self, ctx: KernelContext, args: tuple[np.ndarray | None, ...]) -> bool:
        """True when ``args`` are the very arrays this step was built on."""
        return (
            len(args) == len(self.args)
            and all(map(operator.is_, args, self.args))
            and bool(ctx.planned)
            and ctx.planned[0] is self.y
        )

    def _place_window_rows(self) -> None:
        """A window-sized cache (sliding_window_cache=1): each row's first new cache row into
        ``starts`` after dropping the rows its cache must drop, or ``active`` False (nothing
        changed) for a row that cannot step."""
        m, cap, window = self.m, self.cap, self.cfg.window
        rope_len, starts, active = self.rope_len, self.starts, self.active
        for b, t in enumerate(int(s) + 1 for s in self.seqlens):
            active[b] = False
            if t < m or t > rope_len:
                continue
            resident = windowed_cache_length(t - m, cap, window)
            drop = resident + m - windowed_cache_length(t, cap, window)
            if drop > max(0, resident - window + 1):  # the first new query still sees them
                continue
            if drop:
                for cache in self.caches:
                    cache[b, :, : resident - drop] = cache[b, :, drop:resident]
            starts[b] = resident - drop
            active[b] = True

    def run(self) -> bool:
        """Run the step for the current seqlens_k; False (nothing done) when no row can."""
        if self.cfg.window_cache:
            self._place_window_rows()
        stepped = attend_rows(self.plan)
        if stepped == 0:
            return False
        if stepped < len(self.seqlens):
            self._rows_alone()
        return True

    def _rows_alone(self) -> None:
        """The general kernel on each row the step left, alone (as at batch 1), counted."""
        for b in np.flatnonzero(~self.active):
            _GENERAL_STEPS["a row's lengths outside the prebuilt step"] += 1
            args = [
                x[b : b + 1] if i in (0, 1, 2, 3, 4, 5) and x is not None else x
                for i, x in enumerate(self.args)
            ]
            targets = (self.y[b : b + 1], *(cache[b : b + 1] for cache in self.caches))
            ctx = KernelContext(self.ctx.node, self.ctx.provider, planned=targets)
            _replay_general(ctx, tuple(args), targets)

    def replay(self) -> None:
        """A recorded graph's call: the step, or the general kernel when it cannot run."""
        if not self.run():
            _GENERAL_STEPS["lengths outside the prebuilt step"] += 1
            self.fallback()

    __call__ = replay

    def _after_native(self, stepped: int) -> None:
        """What the native form (``_gqa_step.native_step``) leaves to Python: the rows it
        could not step, or everything when it failed before stepping (-1)."""
        if stepped < 0:
            self.replay()
        elif stepped == 0:
            _GENERAL_STEPS["lengths outside the prebuilt step"] += 1
            self.fallback()
        elif stepped < len(self.seqlens):
            self._rows_alone()


def _same_buffer(a: np.ndarray, b: np.ndarray) -> bool:
    return (
        isinstance(a, np.ndarray)
        and isinstance(b, np.ndarray)
        and a.shape == b.shape
        and a.dtype == b.dtype
        and a.strides == b.strides
        and a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
    )


def _replay_general(
    ctx: KernelContext, args: tuple[np.ndarray | None, ...], targets: tuple[np.ndarray, ...]
) -> None:
    """The general kernel with its results landing in the recorded output buffers."""
    results = _gqa_general(ctx, *args)
    for got, want in zip(results, targets, strict=True):
        if got is not want and not _same_buffer(got, want):
            np.copyto(want, got, casting="unsafe")


def _bind_gqa(
    ctx: KernelContext, inputs: Sequence[np.ndarray | None], outs: object
) -> Callable[[], None] | None:
    """Prebound replay of a decode/verify step (see _GqaStep); None keeps the general call.

    A step-shaped call the step refuses replays the general kernel, counted under the
    refusal's reason (general_path_steps)."""
    if not isinstance(outs, tuple | list) or len(outs) != 3:
        return None
    args = tuple(inputs)
    step = _GqaStep.build(ctx, args, outs[0], outs[1:])
    targets = tuple(outs)
    if isinstance(step, str):
        if not _step_shaped(args):
            return None
        reason = step

        def general() -> None:
            _GENERAL_STEPS[reason] += 1
            _replay_general(ctx, args, targets)

        return general
    step.fallback = lambda: _replay_general(ctx, args, targets)
    if not step.cfg.window_cache:  # a window-sized cache is placed from Python first
        step.native = native_step(step.plan, step._after_native)
    return step


# ----------------------------------------------------------------------------- GQA kernel


def group_query_attention(
    ctx: KernelContext,
    query: np.ndarray,
    key: np.ndarray | None = None,
    value: np.ndarray | None = None,
    past_key: np.ndarray | None = None,
    past_value: np.ndarray | None = None,
    seqlens_k: np.ndarray | None = None,
    total_sequence_length: np.ndarray | None = None,
    cos_cache: np.ndarray | None = None,
    sin_cache: np.ndarray | None = None,
    position_ids: np.ndarray | None = None,
    attention_bias: np.ndarray | None = None,
    head_sink: np.ndarray | None = None,
    *rest: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """onnxruntime GroupQueryAttention: GQA with rotary, KV cache, window, softcap, sinks.

    ``rest`` holds k_scale, v_scale, q_norm_weight, k_norm_weight (all refused) and
    query_seqlens (right-padded chunks). A decode/verify step on the shared KV buffers runs
    as a prebuilt _GqaStep (kept in ctx.state for the next call on the same buffers).
    """
    args = (query, key, value, past_key, past_value, seqlens_k, total_sequence_length,
            cos_cache, sin_cache, position_ids, attention_bias, head_sink, *rest)  # fmt: skip
    step = ctx.state.get(_STEP_KEY)
    if step is None or not step.serves(ctx, args):
        step = _GqaStep.build(ctx, args, None)
        if isinstance(step, str):
            if _step_shaped(args):
                _GENERAL_STEPS[step] += 1
            return _gqa_general(ctx, *args)
        if ctx.planned and ctx.planned[0] is step.y:
            ctx.state[_STEP_KEY] = step
    if step.run():
        return step.results
    _GENERAL_STEPS["lengths outside the prebuilt step"] += 1
    return _gqa_general(ctx, *args)


REGISTRY.register(
    "GroupQueryAttention", since=1, domain=MS_DOMAIN, check=_gqa_check, bind=_bind_gqa
)(group_query_attention)


def _gqa_general(
    ctx: KernelContext,
    query: np.ndarray,
    key: np.ndarray | None = None,
    value: np.ndarray | None = None,
    past_key: np.ndarray | None = None,
    past_value: np.ndarray | None = None,
    seqlens_k: np.ndarray | None = None,
    total_sequence_length: np.ndarray | None = None,
    cos_cache: np.ndarray | None = None,
    sin_cache: np.ndarray | None = None,
    position_ids: np.ndarray | None = None,
    attention_bias: np.ndarray | None = None,
    head_sink: np.ndarray | None = None,
    *rest: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """GroupQueryAttention for every supported case (the kernel's general path)."""
    reason = _gqa_check(ctx.node, ())
    if reason or any(r is not None for r in rest[:4]):
        raise NotImplementedError(f"{ctx.node.describe()}: {reason or 'quantized KV / QK norm'}")
    if total_sequence_length is None:
        raise ValueError(f"{ctx.node.describe()}: total_sequence_length is required")
    geom = gqa_shapes(ctx.node, query, key, value, past_key, past_value, seqlens_k,
                      cos_cache, sin_cache, head_sink)  # fmt: skip
    cfg = _GqaConfig.from_ctx(ctx)
    q, k, v = _split_qkv(geom, query, key, value)
    b, s, _, h = q.shape
    total_len = int(np.asarray(total_sequence_length).reshape(-1)[0])
    lens = _lengths(seqlens_k, total_len, s, rest[4] if len(rest) > 4 else None)
    dtype = query.dtype
    t_max = int(lens.total.max()) if b else 0
    if cfg.window_cache:
        present_k = _window_present(ctx, past_key, dtype, cfg.window)
        present_v = _window_present(ctx, past_value, dtype, cfg.window)
    else:
        present_k = _present(ctx, 1, past_key, (b, cfg.kv_heads, h), dtype, lens, total_len)
        present_v = _present(ctx, 2, past_value, (b, cfg.kv_heads, h), dtype, lens, total_len)

    q4, k4, v4 = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    if cfg.rotary:
        pos = _positions(lens, s, position_ids, cos_cache.shape[0])
        cos, sin = cos_cache[pos], sin_cache[pos]
        q4 = rotate(q4, cos, sin, cfg.interleaved)
        k4 = rotate(k4, cos, sin, cfg.interleaved)
    scale = cfg.scale if cfg.scale is not None else 1.0 / math.sqrt(h)
    qs = np.multiply(q4, np.float32(scale), dtype=_F32, order="C")  # (B, N, S, H)

    sinks = None
    if attention_bias is not None and (
        attention_bias.ndim != 4 or attention_bias.shape[2] != s or attention_bias.shape[3] < t_max
    ):
        raise ValueError(f"{ctx.node.describe()}: attention_bias shape {attention_bias.shape}")
    if head_sink is not None:
        sinks = _as_f32(head_sink).reshape(-1)
    elif cfg.smooth:
        sinks = np.zeros(cfg.heads, _F32)
    out = ctx.out(0, (b, s, cfg.heads * h), dtype)
    out4 = out.reshape(b, s, cfg.heads, h)
    if cfg.window_cache:
        for i in range(b):
            out4[i] = _attend_windowed(cfg, present_k[i], present_v[i], k4[i], v4[i], qs[i],
                                       lens, i, sinks)  # fmt: skip
        return out, present_k, present_v
    for i in range(b):
        p, t, n_new = int(lens.past[i]), int(lens.total[i]), int(lens.new[i])
        present_k[i, :, p:t] = k4[i, :, :n_new]
        present_v[i, :, p:t] = v4[i, :, :n_new]
        bias = None
        if attention_bias is not None:
            bias = _as_f32(attention_bias[i if attention_bias.shape[0] > 1 else 0])
        keys, values = _as_f32(present_k[i, :, :t]), _as_f32(present_v[i, :, :t])
        attn = _BatchAttn(cfg, keys, values, p, bias, sinks)
        out4[i] = _attend(attn, qs[i]).transpose(1, 0, 2)
    return out, present_k, present_v
