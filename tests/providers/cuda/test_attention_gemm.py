"""The CUDA provider's long-prefill attention (``providers/cuda/attention_gemm.py``)
run with numpy as its array module, against a float64 loop over every query and key."""

from __future__ import annotations

import math

import numpy as np
import pytest

from onnx_genrt.providers.cuda.attention_gemm import attend_rows, rotate_rows


def _reference(q, keys, values, past, softcap, window, causal):
    n, s, d = q.shape
    kvn, t, _ = keys.shape
    y = np.zeros((n, s, d))
    for h in range(n):
        g = h // (n // kvn)
        for i in range(s):
            p = past + i
            seen = [
                j
                for j in range(t)
                if (not causal or j <= p) and (not (causal and window > 0) or j > p - window)
            ]
            if not seen:
                continue
            sc = np.array([float(np.dot(q[h, i], keys[g, j])) for j in seen])
            if softcap > 0:
                sc = softcap * np.tanh(sc / softcap)
            w = np.exp(sc - sc.max())
            w /= w.sum()
            y[h, i] = w @ values[g, seen]
    return y


@pytest.mark.parametrize(
    "past,s,t,softcap,window,causal,budget",
    [
        (0, 33, 33, 0.0, 0, True, 1 << 20),  # a prompt, one chunk
        (20, 37, 57, 0.0, 0, True, 8 * 57 * 5),  # after a past, chunks of 5 rows
        (20, 37, 57, 30.0, 0, True, 8 * 57 * 4),  # softcap
        (5, 40, 45, 0.0, 16, True, 8 * 45 * 7),  # a local window
        (0, 12, 30, 0.0, 0, False, 8 * 30 * 3),  # not causal
    ],
)
def test_attend_rows_matches_a_float64_loop(past, s, t, softcap, window, causal, budget):
    rng = np.random.default_rng(s + t)
    n, kvn, d = 8, 2, 16
    q = rng.standard_normal((n, s, d)).astype(np.float32)
    keys = rng.standard_normal((kvn, t, d)).astype(np.float32)
    values = rng.standard_normal((kvn, t, d)).astype(np.float32)
    got = attend_rows(
        np, q, keys, values, past, softcap=softcap, window=window, causal=causal, budget=budget
    )
    want = _reference(q.astype(np.float64), keys, values, past, softcap, window, causal)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotate_rows_turns_pairs_by_their_angle(interleaved):
    rng = np.random.default_rng(3)
    s, h, d, rot = 6, 3, 12, 8
    x = rng.standard_normal((s, h, d)).astype(np.float32)
    angle = rng.uniform(0, 2 * math.pi, (s, rot // 2))
    got = rotate_rows(np, x, np.cos(angle), np.sin(angle), rot, interleaved)
    want = x.astype(np.float64).copy()
    for i in range(s):
        for f in range(rot // 2):
            a, b = (2 * f, 2 * f + 1) if interleaved else (f, f + rot // 2)
            c, sn = math.cos(angle[i, f]), math.sin(angle[i, f])
            want[i, :, a] = x[i, :, a] * c - x[i, :, b] * sn
            want[i, :, b] = x[i, :, b] * c + x[i, :, a] * sn
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got[..., rot:], x[..., rot:])
