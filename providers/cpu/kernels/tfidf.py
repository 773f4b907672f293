"""CPU kernel: TfIdfVectorizer (n-gram counts with skips over int or string tokens)."""

from __future__ import annotations

from collections import Counter

import numpy as np

from onnx_genrt.core.kernels import KernelContext, NodeInfo

from ._registry import REGISTRY

Array = np.ndarray
_MODES = ("TF", "IDF", "TFIDF")


def _tfidf_check(node: NodeInfo, _types: object = ()) -> str | None:
    mode = node.attr("mode")
    if mode not in _MODES:
        return f"TfIdfVectorizer mode={mode!r} is not one of TF, IDF, TFIDF"
    lo, hi = int(node.attr("min_gram_length", 0)), int(node.attr("max_gram_length", 0))
    if not 1 <= lo <= hi:
        return f"TfIdfVectorizer needs 1 <= min_gram_length ({lo}) <= max_gram_length ({hi})"
    if (node.attr("pool_int64s") is None) == (node.attr("pool_strings") is None):
        return "TfIdfVectorizer needs exactly one of pool_int64s and pool_strings"
    return None


def _pool(ctx: KernelContext) -> dict[tuple, int]:
    """Each pooled n-gram (a tuple of tokens) -> its position in the pool."""
    raw = ctx.attr("pool_int64s")
    tokens = list(raw) if raw is not None else [str(s) for s in ctx.attr("pool_strings")]
    starts = [int(c) for c in ctx.attr("ngram_counts", [])]
    indexes = [int(i) for i in ctx.attr("ngram_indexes", [])]
    table: dict[tuple, int] = {}
    for level, start in enumerate(starts):
        n = level + 1
        end = starts[level + 1] if level + 1 < len(starts) else len(tokens)
        if (end - start) % n:
            raise ValueError(f"{ctx.node.describe()}: pool section of {n}-grams is not whole")
        for at in range(start, end, n):
            table[tuple(tokens[at : at + n])] = len(table)
    if len(table) != len(indexes):
        raise ValueError(
            f"{ctx.node.describe()}: {len(indexes)} ngram_indexes for {len(table)} pooled n-grams"
        )
    return table


def _count(row: list, table: dict[tuple, int], lo: int, hi: int, skips: int) -> Counter:
    """Occurrences (by pool position) of pooled n-grams of length lo..hi with gaps of 0..skips tokens
    (unigrams once, whatever the skip)."""
    counts: Counter = Counter()
    for n in range(lo, hi + 1):
        for gap in range(skips + 1 if n > 1 else 1):
            step = gap + 1
            for start in range(len(row) - (n - 1) * step):
                gram = tuple(row[start : start + (n - 1) * step + 1 : step])
                if gram in table:
                    counts[table[gram]] += 1
    return counts


@REGISTRY.register("TfIdfVectorizer", since=9, check=_tfidf_check)
def tfidf_vectorizer(ctx: KernelContext, x: Array) -> Array:
    """Per row of tokens ([N] or [B, N]): for each pooled n-gram, its count (TF), its
    weight if present (IDF) or count * weight (TFIDF), at the n-gram's ngram_indexes slot;
    float32 [num_features] or [B, num_features]."""
    if x.ndim not in (1, 2):
        raise ValueError(f"{ctx.node.describe()}: X must be [N] or [B, N], got {list(x.shape)}")
    table = _pool(ctx)
    indexes = [int(i) for i in ctx.attr("ngram_indexes", [])]
    width = max(indexes, default=-1) + 1
    weights = ctx.attr("weights")
    w = np.ones(len(indexes)) if weights is None else np.asarray(weights, np.float64)
    if w.shape != (len(indexes),):
        raise ValueError(
            f"{ctx.node.describe()}: {w.size} weights for {len(indexes)} pooled n-grams"
        )
    lo, hi = int(ctx.attr("min_gram_length")), int(ctx.attr("max_gram_length"))
    skips = int(ctx.attr("max_skip_count", 0))
    rows = x.reshape(-1, x.shape[-1]) if x.ndim == 2 else x.reshape(1, -1)
    strings = x.dtype.kind in "OSU"
    mode = ctx.attr("mode")
    out = np.zeros((rows.shape[0], width))
    for r, row in enumerate(rows):
        tokens = [str(t) for t in row] if strings else [int(t) for t in row]
        for slot, count in _count(tokens, table, lo, hi, skips).items():
            if mode == "IDF":
                count = min(count, 1)
            out[r, indexes[slot]] = count * (w[slot] if mode != "TF" else 1.0)
    out = out.astype(np.float32)
    return out if x.ndim == 2 else out[0]
