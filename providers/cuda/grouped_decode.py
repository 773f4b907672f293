"""The splits and merges of the CUDA grouped decode attention kernel (``kernels/_gqa_decode.py``,
``gqa_decode``), mirrored in numpy so that they are checked on any machine.

Decode and verify steps (up to ``FUSE_MAX_NEW`` new rows) over a long KV cache. One block
takes one (split, KV head, query row) and scores all ``G = heads / kv_heads`` query heads of
the group against each key it loads, so each key and value element is read from global memory
once per split instead of once per query head. The block's ``DECODE_WARPS`` warps walk tiles
of ``tile_keys`` keys (``DecodeShape``): warp ``w`` takes the tiles at ``k_begin + (w + n W)
tile_keys``. In a tile, each key is scored by ``lanes_per_key`` lanes (16-byte loads of its
row, the query heads read from shared memory); the warp keeps one online softmax per head
(running max over the warp, rescaled sums), then adds the value rows, loaded 16 bytes a lane.

The split count is fixed when the launch is sized (``decode_splits``: enough blocks to fill
the GPU, from the SM count and the cache's capacity, so that a captured graph serves every
length); each split takes ``max(ceil(visible / splits), min_chunk)`` keys of the row, from the
length in device memory. The partials merge in a fixed order (deterministic): the block's
warps first; then, with more than one split, the splits in groups of ``MERGE_GROUP`` (the
last block of a group to finish merges it, counted by a per-group counter), then the groups
(the last group merger to finish). A lone split or a lone group writes the output itself.
Each merge takes the largest of the maxima, weighs each partial by ``exp(max_i - max)`` and
adds the denominators; the final one adds the head's sink logit (``head_sink``, or 0 with
``smooth_softmax``).

``grouped_decode`` runs these steps in the same order with the same bounds (each key range,
tile and merge), in float64 or float32; the kernel's host side takes its constants and the
split count from here. Only the rounding the kernel does to the cache's type is done: the new
keys (rotated) and values as the cache holds them, and the output. No CuPy: this module
imports without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .attention_gemm import rotate_rows
from .flash_tiling import Rotary, entry_lengths, key_bounds

#: Warps of one block.
DECODE_WARPS = 4
#: Splits whose partials one block merges at the first level (and so at most 32 groups).
MERGE_GROUP = 16
#: Most splits of one (KV head, row): the groups' merge reads one group per lane of a warp.
MAX_DECODE_SPLITS = 32 * MERGE_GROUP
#: Splits of the cluster launch (``gqa_decode_cluster``, sm_90+: decode / verify on a short
#: cache): one thread-block cluster per (KV head, query row), merged by its first block through
#: distributed shared memory. The arithmetic of ``decode_splits`` = CLUSTER_SPLITS (one merge
#: group), and the count does not depend on the batch, so a row's bits do not either.
CLUSTER_SPLITS = 8
#: Most query heads per KV head (each lane keeps G x (16 bytes of values) sums).
MAX_GROUP = 8
#: Blocks per SM that the kernel's launch bounds ask for (128 threads: up to 255 registers a
#: thread, which the G = 7 and 8 instances take without spilling), and that ``decode_splits``
#: fills.
DECODE_BLOCKS_PER_SM = 2
#: Lanes of a warp.
LANES = 32
#: Warp groups sharing a block's query heads where a launch has fewer blocks than SMs (one
#: row's): ``head_groups``. Two make blocks of 256 threads, which keep the registers of up to
#: 255 a thread that the largest groups take (four would cap them at 128 and spill).
SPREAD_GROUPS = 2
#: Most warp groups ``attention_decode_head_groups`` may force: four make blocks of 512
#: threads (128 registers a thread: the 7-head fp16 instance spills 12 bytes) and give each
#: warp two of a 7- or 8-head group (to be measured over a long cache: NOTES.md).
MAX_HEAD_GROUPS = 4
#: Default of the CUDA provider's ``attention_decode_head_groups``: 0, ``head_groups``' rule
#: (two sets of warps gave the bits of one on the H200, and one row's grouped cluster launch
#: went from 9-11% slower than the per-head cluster kernel to 1.6% faster: docs/performance.md).
DECODE_HEAD_GROUPS = 0


@dataclass(frozen=True)
class DecodeShape:
    """How a warp lays out one tile for a head size and cache element size (the kernel's
    ``DecodeShape<S, D>``). Scores: ``lanes_per_key`` lanes per key, each ``key_loads``
    16-byte loads of its key's row; values: ``feature_lanes`` lanes per value row (``vec``
    elements each), ``value_rows`` rows per warp load, ``value_loads`` loads per tile."""

    head_size: int
    itemsize: int

    @property
    def vec(self) -> int:
        """Elements of one 16-byte load."""
        return 16 // self.itemsize

    @property
    def lanes_per_key(self) -> int:
        """Lanes scoring one key: each holds at most 128 bytes of the row."""
        return max(1, self.head_size * self.itemsize // 128)

    @property
    def tile_keys(self) -> int:
        return LANES // self.lanes_per_key

    @property
    def key_loads(self) -> int:
        return self.head_size // self.lanes_per_key // self.vec

    @property
    def feature_lanes(self) -> int:
        return self.head_size // self.vec

    @property
    def value_rows(self) -> int:
        return LANES // self.feature_lanes

    @property
    def value_loads(self) -> int:
        return self.tile_keys // self.value_rows

    @property
    def min_chunk(self) -> int:
        """Fewest keys of a split: one tile for each warp."""
        return DECODE_WARPS * self.tile_keys


def decode_problem(head_size: int, itemsize: int, group: int) -> str | None:
    """Why ``gqa_decode`` has no instance for the call (the many-split kernel then takes it),
    or None: 16-byte rows that a warp's lanes split evenly, at most MAX_GROUP heads a group."""
    if not 1 <= group <= MAX_GROUP:
        return f"grouped decode takes 1 to {MAX_GROUP} query heads per KV head, not {group}"
    row = head_size * itemsize
    lanes = row // 16
    if row % 16 or lanes & (lanes - 1) or not 1 <= lanes <= LANES:
        return (
            f"grouped decode needs rows of 16 x 2^k bytes, at most {LANES * 16} (head size "
            f"{head_size} of {itemsize}-byte elements)"
        )
    return None


def most_keys(cap: int, new: int, window: int, causal: bool, wcache: bool) -> int:
    """The most keys one query row can see: the cache (with a window-sized cache, the new
    rows the attention reads from the inputs as well), at most the window."""
    keys = cap + new if wcache else cap
    if causal and window > 0:
        keys = min(keys, window)
    return keys


def decode_splits(
    rows: int, keys: int, sms: int, min_chunk: int, blocks_per_sm: int = DECODE_BLOCKS_PER_SM
) -> int:
    """Splits of each (KV head, row)'s keys: with ``rows`` such pairs, enough blocks to give
    each SM ``blocks_per_sm``, but no more than ``keys`` (the most a row sees) in chunks of
    ``min_chunk``, and at most MAX_DECODE_SPLITS."""
    want = -(-(blocks_per_sm * sms) // max(1, rows))
    return max(1, min(MAX_DECODE_SPLITS, want, -(-keys // min_chunk)))


def head_groups(group: int, blocks: int, sms: int, forced: int = 0) -> int:
    """Warp groups that share a block's ``group`` query heads (the kernel's ``HG``: each
    takes ``ceil(group / HG)`` heads over the tiles one group of ``DECODE_WARPS`` warps would
    walk, so a head's bits do not depend on it): ``forced`` when positive; else one for a
    launch of at least ``sms`` blocks, and SPREAD_GROUPS for a smaller one, whose blocks'
    serial work is the step's latency. At most ``group``, and SPREAD_GROUPS (MAX_HEAD_GROUPS
    when forced)."""
    if forced > 0:
        return max(1, min(forced, group, MAX_HEAD_GROUPS))
    return max(1, min(1 if blocks >= sms else SPREAD_GROUPS, group))


def split_chunk(visible: int, splits: int, min_chunk: int) -> tuple[int, int]:
    """(keys per split, splits with keys) for a row that sees ``visible`` keys."""
    chunk = max(-(-visible // splits), min_chunk)
    return chunk, -(-visible // chunk)


def same_cut_splits(keys: int, splits: int, min_chunk: int) -> int:
    """The fewest splits that cut every length up to ``keys`` as ``splits`` do
    (``split_chunk``): ``splits`` itself where a split of the longest length takes more than
    ``min_chunk`` keys, else the splits of ``min_chunk`` keys that the longest length needs.
    The same chunks, so the same tiles and merge order: the same bits."""
    if -(-keys // splits) > min_chunk:
        return splits
    return max(1, min(splits, -(-keys // min_chunk)))


def merge_groups(active: int) -> list[range]:
    """The first-level merge groups of ``active`` splits (MERGE_GROUP splits each, the last
    one shorter): one group merges straight into the output."""
    return [range(s, min(s + MERGE_GROUP, active)) for s in range(0, active, MERGE_GROUP)]


@dataclass
class Partial:
    """Sums of one piece of a row's keys for the group's G heads: ``o`` [G, D] relative to the
    running max ``m`` [G], and the denominator ``l`` [G]."""

    o: np.ndarray
    m: np.ndarray
    l: np.ndarray  # noqa: E741


def merge(parts: list[Partial], sink: np.ndarray | None, final: bool) -> Any:
    """Partials merged in their order (the kernel's ``decode_merge``): a Partial, or when
    ``final`` the output rows [G, D] (with the sink logits [G] where given; zero for a head
    that saw no key)."""
    dt = parts[0].o.dtype
    m = np.stack([p.m for p in parts])  # [n, G]
    top = m.max(axis=0)
    if final and sink is not None:
        top = np.maximum(top, sink.astype(dt))
    with np.errstate(invalid="ignore"):  # -inf - -inf where nothing counts
        w = np.where(m == -np.inf, 0.0, np.exp(m - top)).astype(dt)
    den = np.zeros_like(top)
    o = np.zeros_like(parts[0].o)
    for p, wi in zip(parts, w, strict=True):  # in order
        den = den + wi * p.l
        o = o + wi[:, None] * p.o
    if not final:
        return Partial(o, top, den)
    if sink is not None:
        den = den + np.where(top == -np.inf, 0.0, np.exp(sink.astype(dt) - top))
    safe = np.where(den > 0, den, 1.0)
    return np.where(den[:, None] > 0, o / safe[:, None], 0.0)


@dataclass(frozen=True)
class _Row:
    """What one block knows of its query row."""

    lo: int  # first visible key (cache row)
    hi: int  # last visible key
    base: int  # cache row of the first new key (keys from here on come from the inputs)
    q: np.ndarray  # [G, D] rotated, scaled query heads
    keys: np.ndarray  # [keys, D] the row's keys by cache row (new ones rounded)
    values: np.ndarray


def grouped_decode(
    q: np.ndarray,
    k_new: np.ndarray,
    v_new: np.ndarray,
    key_cache: np.ndarray,
    value_cache: np.ndarray,
    seqlens: np.ndarray,
    *,
    splits: int,
    scale: float,
    softcap: float = 0.0,
    window: int = 0,
    causal: bool = True,
    wcache: bool = False,
    sinks: np.ndarray | None = None,
    rotary: Rotary | None = None,
    itemsize: int | None = None,
    acc: Any = np.float64,
    round_output: bool = True,
    visits: list[tuple[int, ...]] | None = None,
    merges: list[tuple[int, ...]] | None = None,
) -> np.ndarray:
    """The kernel's output [B, S, N, D] (float64) for query rows ``q`` [B, S, N, D] and new
    keys / values ``k_new`` / ``v_new`` [B, S, kvN, D] as read from the inputs (before rotary),
    the caches [B, kvN, cap, D] and ``seqlens`` [B] (total - 1 per entry), over ``splits``
    splits. The new rows are rotated and rounded to the caches' dtype (a float64 cache: no
    rounding); unless ``wcache`` they are written into the caches at their positions (as the
    kernel does). The output is rounded to the caches' dtype too (unless not
    ``round_output``). ``sinks`` [N]: a sink logit
    per head. ``itemsize``: the element size of the kernel instance, which sets the tiling
    (default the caches'). ``acc``: the float type of the arithmetic (the kernel's is
    float32). ``visits`` collects (b, row, kv head, split, warp, first key, end key) per
    tile in the kernel's order; ``merges`` (b, row, kv head, level, first, count) per merge
    of partials (level 0: a block's warps, 1: a group of splits, 2: the groups)."""
    batch, s, heads, d = q.shape
    kv_heads, cap = key_cache.shape[1], key_cache.shape[2]
    group = heads // kv_heads
    shape = DecodeShape(d, itemsize or key_cache.dtype.itemsize)
    y = np.zeros(q.shape)
    for b in range(batch):
        lens = entry_lengths(int(seqlens[b]), s, cap, window, wcache)
        pos = lens.past + np.arange(s)
        kn, vn = _new_rows(k_new[b], v_new[b], pos, rotary, key_cache.dtype)
        if not wcache:  # the kernel's split-0 blocks write their rows (never past the cache)
            for j in range(lens.new):
                if 0 <= pos[j] < cap:
                    key_cache[b, :, pos[j]] = kn[j]
                    value_cache[b, :, pos[j]] = vn[j]
        for i in range(s):
            if not wcache and lens.total > cap:
                y[b, i] = np.nan  # a length past the cache
                continue
            qx = _query_heads(q[b, i], int(pos[i]), rotary) * scale
            lo, hi = key_bounds(lens.base + i, lens.keys, window, causal)
            for g in range(kv_heads):
                old = key_cache[b, g, : lens.base], value_cache[b, g, : lens.base]
                row = _Row(
                    lo,
                    hi,
                    lens.base,
                    qx[g * group : (g + 1) * group].astype(acc),
                    np.concatenate([old[0], kn[: lens.new, g]]).astype(acc),
                    np.concatenate([old[1], vn[: lens.new, g]]).astype(acc),
                )
                sink = None if sinks is None else sinks[g * group : (g + 1) * group]
                sink = None if sink is None else sink.astype(np.float64)
                tag = (b, i, g)
                out = _row(row, shape, splits, softcap, sink, tag, visits, merges)
                y[b, i, g * group : (g + 1) * group] = out
    return y.astype(key_cache.dtype).astype(np.float64) if round_output else y


def _new_rows(k, v, pos, rotary: Rotary | None, dtype) -> tuple[np.ndarray, np.ndarray]:
    """The new keys (rotated at ``pos``) and values [S, kvN, D] as the cache holds them."""
    k = k.astype(np.float64)
    if rotary is not None:
        p = np.clip(pos, 0, rotary.cos.shape[0] - 1)
        cos = rotary.cos[p].astype(np.float64)
        sin = rotary.sin[p].astype(np.float64)
        k = rotate_rows(np, k, cos, sin, rotary.rot, rotary.interleaved)
    return k.astype(dtype), v.astype(dtype)


def _query_heads(x: np.ndarray, pos: int, rotary: Rotary | None) -> np.ndarray:
    """One row's query heads [N, D] rotated at ``pos`` (clamped), not rounded (the kernel
    keeps them in float32 shared memory)."""
    x = x.astype(np.float64)
    if rotary is None:
        return x
    p = min(max(pos, 0), rotary.cos.shape[0] - 1)
    cos = rotary.cos[p : p + 1].astype(np.float64)
    sin = rotary.sin[p : p + 1].astype(np.float64)
    return rotate_rows(np, x[None], cos, sin, rotary.rot, rotary.interleaved)[0]


def _row(row: _Row, shape: DecodeShape, splits: int, softcap: float, sink, tag, visits, merges):
    """One (row, KV head): its splits' blocks, then the merges; the output heads [G, D]."""
    visible = max(row.hi - row.lo + 1, 0)
    chunk, active = split_chunk(visible, splits, shape.min_chunk)
    if active == 0:
        return np.zeros(row.q.shape)  # no visible key (a bad length)
    parts = []
    for split in range(active):
        k_begin = row.lo + split * chunk
        k_end = min(k_begin + chunk, row.hi + 1)
        warps = [
            _warp(row, shape, w, k_begin, k_end, softcap, tag, split, visits)
            for w in range(DECODE_WARPS)
        ]
        if merges is not None:
            merges.append((*tag, 0, split, DECODE_WARPS))
        if active == 1:
            return merge(warps, sink, final=True)
        parts.append(merge(warps, None, final=False))
    groups = merge_groups(active)
    level2 = []
    for grp in groups:
        if merges is not None:
            merges.append((*tag, 1, grp.start, len(grp)))
        level2.append(merge([parts[s] for s in grp], sink, final=len(groups) == 1))
    if len(groups) == 1:
        return level2[0]
    if merges is not None:
        merges.append((*tag, 2, 0, len(groups)))
    return merge(level2, sink, final=True)


def _warp(
    row: _Row, shape: DecodeShape, w: int, k_begin: int, k_end: int, softcap, tag, split, visits
):
    """One warp's online softmax over its tiles of keys [k_begin, k_end): a Partial."""
    dt = row.q.dtype
    g, d = row.q.shape
    m = np.full(g, -np.inf, dt)
    lsum = np.zeros(g, dt)
    o = np.zeros((g, d), dt)
    step = DECODE_WARPS * shape.tile_keys
    for k0 in range(k_begin + w * shape.tile_keys, k_end, step):
        k1 = min(k0 + shape.tile_keys, k_end)
        if visits is not None:
            visits.append((*tag, split, w, k0, k1))
        x = row.q @ row.keys[k0:k1].T  # [G, keys]
        if softcap > 0.0:
            x = (softcap * np.tanh(x / dt.type(softcap))).astype(dt)
        m_new = np.maximum(m, x.max(axis=1))
        with np.errstate(invalid="ignore"):
            alpha = np.where(m == -np.inf, 0.0, np.exp(m - m_new)).astype(dt)
        p = np.exp(x - m_new[:, None])
        lsum = lsum * alpha + p.sum(axis=1)
        o = o * alpha[:, None] + p @ row.values[k0:k1]
        m = m_new
    return Partial(o, m, lsum)
