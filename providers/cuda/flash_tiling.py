"""The tiling of the CUDA flash-attention prompt kernel (``kernels/_flash.py``), mirrored in
numpy so that it is checked on any machine.

The kernel gives each block ``block_rows(D)`` query rows of one head of one batch entry, in
``WARPS`` warps of ``warp_rows(D)`` rows (one or two 16-row mma tiles). The block walks the key tiles of ``BLOCK_K`` cache
rows that its rows can see, in ascending order; a warp skips a tile none of its rows sees,
and applies the causal / window mask only on a tile that some of its rows see in part. Each
warp keeps an online softmax per row in base 2 (running max and sum, the output rescaled
when the max grows) and never holds more than one tile of scores. ``flash_attention`` runs
these same steps, in the same order, with the same bounds; the kernel's host side takes its
tile sizes from here. No CuPy: this module imports without a GPU.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from onnx_genrt.core.op_rules import windowed_cache_length

from .attention_gemm import rotate_rows

#: Keys of one shared-memory tile.
BLOCK_K = 64
#: Warps of one block.
WARPS = 4
#: Query rows of one mma.m16n8k16 tile.
MMA_ROWS = 16
#: The head sizes the kernel is instantiated for, and the 16-row tiles each warp owns: two at
#: 64 (a block of 128 rows then reads each K/V tile from L2 for twice the rows), one at 128
#: (twice its accumulators would not fit in registers).
WARP_TILES = {64: 2, 128: 1}
HEAD_SIZES = tuple(WARP_TILES)


def warp_rows(head_size: int) -> int:
    """Query rows of one warp."""
    return MMA_ROWS * WARP_TILES.get(head_size, 1)


def block_rows(head_size: int) -> int:
    """Query rows of one block."""
    return WARPS * warp_rows(head_size)


#: Scores are kept in base 2 (exp2 is one instruction): natural logits times log2(e).
LOG2E = 1.4426950408889634

#: What a warp does with a key tile (``warp_tile_work``).
SKIP, FULL, MASKED = "skip", "full", "masked"


@dataclass(frozen=True)
class EntryLengths:
    """One batch entry's lengths, as the kernel derives them from ``seqlens`` on the device."""

    total: int  # seqlens[b] + 1
    new: int  # rows of the call that are new tokens: min(max(total, 0), S)
    past: int  # total - new: the position of query row 0 (rotary)
    base: int  # the cache row of query row 0 (past, or the window-sized cache's kept rows)
    keys: int  # cache rows holding keys: min(total, cap), or base + new (window-sized)
    overflow: bool  # a length past the cache: the kernel writes NaN rows


def entry_lengths(seqlen: int, s: int, cap: int, window: int, wcache: bool) -> EntryLengths:
    """The lengths of an entry whose ``seqlens`` value is ``seqlen``, for a call of ``s`` new
    rows on a cache of ``cap`` rows (``wcache``: a window-sized cache of ``window`` keys)."""
    total = seqlen + 1
    new = min(max(total, 0), s)
    past = total - new
    base = windowed_cache_length(past, cap, window) if wcache else past
    keys = base + new if wcache else min(total, cap)
    overflow = keys > cap if wcache else total > cap
    return EntryLengths(total, new, past, base, keys, overflow)


def key_bounds(row: int, keys: int, window: int, causal: bool) -> tuple[int, int]:
    """The keys ``[lo, hi]`` (inclusive; none when hi < lo) a query at cache row ``row``
    sees among ``keys`` cached rows: up to its own row when causal, and the last ``window``
    of those when ``window`` > 0."""
    hi = min(row, keys - 1) if causal else keys - 1
    lo = max(0, row - window + 1) if causal and window > 0 else 0
    return lo, hi


def block_key_tiles(first: int, last: int, keys: int, window: int, causal: bool) -> range:
    """The key tiles (indices of ``BLOCK_K`` rows) a block of query rows at cache rows
    ``first..last`` visits: from the first row's lowest key to the last row's highest (the
    bounds grow with the row)."""
    lo, _ = key_bounds(first, keys, window, causal)
    _, hi = key_bounds(last, keys, window, causal)
    if hi < lo:
        return range(0)
    return range(lo // BLOCK_K, hi // BLOCK_K + 1)


def warp_tile_work(first: int, last: int, k0: int, keys: int, window: int, causal: bool) -> str:
    """What a warp whose rows sit at cache rows ``first..last`` does with the key tile from
    ``k0``: SKIP when none of its rows sees a key of it, FULL when every row sees all of
    it (no mask), else MASKED."""
    lo_first, hi_first = key_bounds(first, keys, window, causal)
    lo_last, hi_last = key_bounds(last, keys, window, causal)
    k1 = k0 + BLOCK_K - 1
    if k0 > hi_last or k1 < lo_first:
        return SKIP
    if k0 >= lo_last and k1 <= hi_first:
        return FULL
    return MASKED


@dataclass(frozen=True)
class Rotary:
    """The rotary embedding the kernel applies to the query rows as it loads them."""

    cos: np.ndarray  # [max_pos, rot / 2]
    sin: np.ndarray
    interleaved: bool

    @property
    def rot(self) -> int:
        return 2 * int(self.cos.shape[1])


@dataclass(frozen=True)
class _Call:
    """The options of one ``flash_attention`` call, as the kernel gets them."""

    scale: float
    softcap: float
    window: int
    causal: bool
    rotary: Rotary | None
    round_to: Callable[[np.ndarray], np.ndarray]
    visits: list[tuple[int, ...]] | None
    warp_rows: int


def flash_attention(
    q: np.ndarray,
    key_cache: np.ndarray,
    value_cache: np.ndarray,
    seqlens: np.ndarray,
    *,
    scale: float,
    softcap: float = 0.0,
    window: int = 0,
    causal: bool = True,
    wcache: bool = False,
    sinks: np.ndarray | None = None,
    rotary: Rotary | None = None,
    storage: Any = None,
    visits: list[tuple[int, ...]] | None = None,
    rows_per_warp: int | None = None,
) -> np.ndarray:
    """The kernel's output [B, S, N, D] (float64) for query rows ``q`` [B, S, N, D] as read
    from the input (before rotary), the KV caches [B, kvN, cap, D] with the new keys already
    appended, and ``seqlens`` [B] (total - 1 per entry). ``sinks`` [N]: a sink logit per
    head. ``storage`` (a numpy dtype such as float16): round the rotated query and the
    probabilities fed to the second product to it, as the kernel does; None keeps float64.
    ``visits`` (a list) collects (b, h, query tile, key tile, warp, work) for every warp of
    every visited tile, in the kernel's order. ``rows_per_warp``: the kernel's for the head
    size (``warp_rows``) unless given."""
    batch, s, heads, d = q.shape
    kv_heads, cap = key_cache.shape[1], key_cache.shape[2]

    def round_to(x: np.ndarray) -> np.ndarray:
        return x if storage is None else x.astype(storage).astype(np.float64)

    wr = warp_rows(d) if rows_per_warp is None else rows_per_warp
    call = _Call(scale, softcap, window, causal, rotary, round_to, visits, wr)
    bq = WARPS * wr
    y = np.zeros(q.shape)
    for b in range(batch):
        lens = entry_lengths(int(seqlens[b]), s, cap, window, wcache)
        for h in range(heads):
            keys = key_cache[b, h // (heads // kv_heads)].astype(np.float64)
            values = value_cache[b, h // (heads // kv_heads)].astype(np.float64)
            sink = None if sinks is None else float(sinks[h])
            # The grid runs the query tiles of the most keys first (causal: the last).
            for qt in reversed(range(math.ceil(s / bq))):
                rows = slice(qt * bq, min(s, (qt + 1) * bq))
                if lens.overflow:
                    y[b, rows, h] = np.nan
                    continue
                qx = _load_queries(call, q[b, rows, h], lens.past + rows.start)
                tag = (b, h, qt)
                y[b, rows, h] = _query_block(call, qx, keys, values, lens, rows.start, sink, tag)
    return y


def _load_queries(call: _Call, x: np.ndarray, position: int) -> np.ndarray:
    """A block's query rows [rows, D] rotated at positions ``position..`` (clamped to the
    cos/sin cache) and rounded to the storage type, as the kernel stages them."""
    x = x.astype(np.float64)
    if call.rotary is not None:
        rot = call.rotary
        pos = np.clip(position + np.arange(x.shape[0]), 0, rot.cos.shape[0] - 1)
        cos = rot.cos[pos].astype(np.float64)
        sin = rot.sin[pos].astype(np.float64)
        x = rotate_rows(np, x[:, None, :], cos, sin, rot.rot, rot.interleaved)[:, 0]
    return call.round_to(x)


def _query_block(
    call: _Call,
    qx: np.ndarray,
    keys: np.ndarray,
    values: np.ndarray,
    lens: EntryLengths,
    i0: int,
    sink: float | None,
    tag: tuple[int, ...],
) -> np.ndarray:
    """One block: query rows i0.. of one head against its KV head's ``keys``/``values``
    [cap, D]; returns the block's output rows."""
    rows, d = qx.shape
    first = lens.base + i0
    last = first + rows - 1
    wr = call.warp_rows
    warps = [slice(w * wr, min(rows, (w + 1) * wr)) for w in range(WARPS)]
    warps = [w for w in warps if w.start < rows]  # a warp past the rows idles
    m = [np.full(w.stop - w.start, -np.inf) for w in warps]
    lsum = [np.zeros(w.stop - w.start) for w in warps]
    o = [np.zeros((w.stop - w.start, d)) for w in warps]
    for kt in block_key_tiles(first, last, lens.keys, call.window, call.causal):
        k0 = kt * BLOCK_K
        kk, vv = _key_tile(keys, k0, lens.keys), _key_tile(values, k0, lens.keys)
        for w, sl in enumerate(warps):
            w_first, w_last = first + sl.start, first + sl.stop - 1
            work = warp_tile_work(w_first, w_last, k0, lens.keys, call.window, call.causal)
            if call.visits is not None:
                call.visits.append((*tag, kt, w, work))
            if work == SKIP:
                continue
            x = qx[sl] @ kk.T * call.scale
            if call.softcap > 0.0:
                x = call.softcap * np.tanh(x / call.softcap)
            if work == MASKED:
                x = np.where(_visible(w_first, sl.stop - sl.start, k0, lens.keys, call), x, -np.inf)
            x = x * LOG2E
            m_new = np.maximum(m[w], x.max(axis=1))
            m_use = np.where(m_new == -np.inf, 0.0, m_new)
            alpha = np.exp2(m[w] - m_use)
            p = np.exp2(x - m_use[:, None])
            lsum[w] = lsum[w] * alpha + p.sum(axis=1)
            o[w] = o[w] * alpha[:, None] + call.round_to(p) @ vv
            m[w] = m_new
    out = np.zeros((rows, d))
    for w, sl in enumerate(warps):
        out[sl] = _finish(m[w], lsum[w], o[w], sink)
    return out


def _key_tile(cache: np.ndarray, k0: int, keys: int) -> np.ndarray:
    """Cache rows k0..k0 + BLOCK_K - 1, zero past the ``keys`` cached rows (cp.async's zero
    fill: rows past the length are never read)."""
    tile = np.zeros((BLOCK_K, cache.shape[1]))
    n = max(0, min(BLOCK_K, keys - k0))
    tile[:n] = cache[k0 : k0 + n]
    return tile


def _visible(first: int, rows: int, k0: int, keys: int, call: _Call) -> np.ndarray:
    """[rows, BLOCK_K] which keys of the tile from ``k0`` the rows from cache row ``first``
    see."""
    bounds = [key_bounds(first + r, keys, call.window, call.causal) for r in range(rows)]
    lo = np.array([b[0] for b in bounds])[:, None]
    hi = np.array([b[1] for b in bounds])[:, None]
    key = k0 + np.arange(BLOCK_K)[None, :]
    return (key >= lo) & (key <= hi)


def _finish(m: np.ndarray, lsum: np.ndarray, o: np.ndarray, sink: float | None) -> np.ndarray:
    """A warp's output rows: the sums over the denominator (with the sink's share), zero for
    a row that saw no key."""
    if sink is not None:
        s2 = sink * LOG2E
        top = np.maximum(m, s2)
        with np.errstate(invalid="ignore"):  # -inf - -inf where nothing counts
            f = np.where(m == -np.inf, 0.0, np.exp2(m - top))
            lsum = lsum * f + np.where(top == -np.inf, 0.0, np.exp2(s2 - top))
        o = o * f[:, None]
    safe = np.where(lsum > 0, lsum, 1.0)
    return np.where(lsum[:, None] > 0, o / safe[:, None], 0.0)
