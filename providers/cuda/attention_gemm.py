"""Prompt attention as matrix products: the long-prefill path of CUDA GroupQueryAttention.

A query block's scores against its visible keys are one batched GEMM per chunk of query rows
(cuBLAS on the device; eager only, as CuPy refuses cuBLAS inside a stream capture), then
the causal / window mask, softcap and a float32 softmax, then a second GEMM with the values.
Chunks keep the score matrix within ``SCORE_BUDGET`` floats. The code is written against an
array module ``xp`` (CuPy on the device, numpy in the CPU tests), so the same lines run in
both.
"""

from __future__ import annotations

from typing import Any

#: Floats of scores one chunk holds at most (256 MB in float32).
SCORE_BUDGET = 64 << 20


def rotate_rows(xp: Any, x: Any, cos: Any, sin: Any, rot: int, interleaved: bool) -> Any:
    """Rotary embedding of float32 ``x`` [..., S, H, D] with ``cos``/``sin`` [S, rot/2]
    (the rows' positions gathered): the first ``rot`` features turned, the rest kept."""
    if rot == 0:
        return x
    half = rot // 2
    c, s = cos[:, None, :], sin[:, None, :]
    y = x.copy()
    if interleaved:
        a, b = x[..., 0:rot:2], x[..., 1:rot:2]
        y[..., 0:rot:2] = a * c - b * s
        y[..., 1:rot:2] = b * c + a * s
    else:
        a, b = x[..., :half], x[..., half:rot]
        y[..., :half] = a * c - b * s
        y[..., half:rot] = b * c + a * s
    return y


def attend_rows(
    xp: Any,
    q: Any,
    keys: Any,
    values: Any,
    past: int,
    *,
    softcap: float = 0.0,
    window: int = 0,
    causal: bool = True,
    budget: int = SCORE_BUDGET,
) -> Any:
    """Attention of one batch entry: float32 ``q`` [N, S, D] (rotated and scaled) at
    positions past..past+S-1 against float32 ``keys``/``values`` [kvN, T, D] (query head
    ``n`` reads key head ``n // (N // kvN)``); returns [N, S, D] float32. A query at position
    p sees keys at positions <= p (``causal``) and > p - ``window`` (``window`` > 0)."""
    n, s, d = q.shape
    kvn, t = keys.shape[0], keys.shape[1]
    groups = n // kvn
    q5 = q.reshape(kvn, groups, s, d)
    y = xp.zeros((kvn, groups, s, d), xp.float32)
    step = max(1, min(s, budget // max(1, n * max(t, 1))))
    for i0 in range(0, s, step):
        i1 = min(s, i0 + step)
        k1 = min(t, past + i1) if causal else t
        k0 = max(0, past + i0 - window + 1) if window > 0 and causal else 0
        k0 = min(k0, k1)
        if k1 == k0:
            continue  # no visible key: zeros
        rows = i1 - i0
        qc = q5[:, :, i0:i1].reshape(kvn, groups * rows, d)
        scores = xp.matmul(qc, keys[:, k0:k1].transpose(0, 2, 1))
        if softcap > 0.0:
            scores = xp.tanh(scores * xp.float32(1.0 / softcap)) * xp.float32(softcap)
        pos = past + xp.arange(i0, i1)[:, None]
        key = xp.arange(k0, k1)[None, :]
        visible = xp.ones((rows, k1 - k0), bool)
        if causal:
            visible &= key <= pos
            if window > 0:
                visible &= key > pos - window
        scores = scores.reshape(kvn, groups, rows, k1 - k0)
        scores = xp.where(visible, scores, xp.float32(-xp.inf))
        top = scores.max(axis=-1, keepdims=True)
        top = xp.where(xp.isfinite(top), top, xp.float32(0.0))
        weights = xp.exp(scores - top)
        total = weights.sum(axis=-1, keepdims=True)
        weights /= xp.where(total > 0, total, xp.float32(1.0))
        out = xp.matmul(weights.reshape(kvn, groups * rows, k1 - k0), values[:, k0:k1])
        y[:, :, i0:i1] = out.reshape(kvn, groups, rows, d)
    return y.reshape(n, s, d)
