"""The flash-attention prompt kernel's tiling (``providers/cuda/flash_tiling.py``: the numpy
mirror of ``kernels/_flash.py``) against ``attention_gemm.attend_rows`` in float64 on ragged
shapes, and its tile visits against the visibility of every (query, key) pair. Runs on the
CPU: only the pure-Python modules are imported (no CuPy)."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from onnx_genrt.core.op_rules import windowed_cache_length
from onnx_genrt.providers.cuda.attention_gemm import attend_rows, rotate_rows
from onnx_genrt.providers.cuda.flash_tiling import (
    BLOCK_K,
    FULL,
    SKIP,
    WARPS,
    Rotary,
    flash_attention,
)
from tests.providers.cuda.test_cuda_flash_attention import CASES as GPU_CASES
from tests.providers.cuda.test_cuda_flash_attention import _gqa_node

BF16 = np.dtype(ml_dtypes.bfloat16)


def _rotary(max_pos: int, rot: int, interleaved: bool) -> Rotary:
    inv = 1.0 / 10000.0 ** (np.arange(0, rot, 2) / rot)
    angle = np.arange(max_pos)[:, None] * inv[None, :]
    return Rotary(np.cos(angle), np.sin(angle), interleaved)


def _entry(seqlen: int, s: int, cap: int, window: int, wcache: bool) -> tuple[int, int, int]:
    """(past, cache row of query row 0, cached rows) of one entry, from the op's contract."""
    total = seqlen + 1
    past = total - min(total, s)
    base = windowed_cache_length(past, cap, window) if wcache else past
    return past, base, (base + min(total, s) if wcache else total)


def _reference(q, kc, vc, seqlens, *, scale, softcap, window, causal, wcache, rotary):
    """attend_rows on each entry's rotated, scaled rows and its cached keys (float64 in)."""
    batch, s, _, _ = q.shape
    y = np.zeros(q.shape)
    for b in range(batch):
        past, base, rows = _entry(int(seqlens[b]), s, kc.shape[2], window, wcache)
        x = q[b].astype(np.float64)  # [S, N, D]
        pos = np.clip(past + np.arange(s), 0, rotary.cos.shape[0] - 1)
        x = rotate_rows(np, x, rotary.cos[pos], rotary.sin[pos], rotary.rot, rotary.interleaved)
        x = np.ascontiguousarray((x * scale).transpose(1, 0, 2))
        keys = kc[b, :, :rows].astype(np.float64)
        values = vc[b, :, :rows].astype(np.float64)
        att = attend_rows(np, x, keys, values, base, softcap=softcap, window=window, causal=causal)
        y[b] = att.transpose(1, 0, 2)
    return y


def _inputs(rng, batch, s, heads, kv_heads, d, cap, dtype=np.float64):
    q = rng.standard_normal((batch, s, heads, d)).astype(dtype)
    kc = rng.standard_normal((batch, kv_heads, cap, d)).astype(dtype)
    vc = rng.standard_normal((batch, kv_heads, cap, d)).astype(dtype)
    return q, kc, vc


# batch, S, heads, kv heads, head size, cache rows, totals, window, softcap, causal, wcache
CASES = {
    "prompt-150": (1, 150, 14, 2, 64, 256, [150], 0, 0.0, True, False),
    "after-a-past": (1, 100, 14, 2, 64, 300, [137], 0, 0.0, True, False),
    "window-mid-tile-softcap": (1, 200, 14, 2, 128, 320, [290], 50, 30.0, True, False),
    "batch-ragged": (3, 130, 14, 2, 64, 256, [200, 130, 100], 0, 0.0, True, False),
    "group1-d128-past-a-tile": (2, 90, 4, 4, 128, 200, [154, 91], 0, 0.0, True, False),
    "window-wider-than-tile": (1, 140, 7, 1, 64, 400, [380], 100, 0.0, True, False),
    "not-causal": (1, 70, 6, 2, 64, 128, [100], 0, 0.0, False, False),
    "window-cache": (1, 80, 14, 2, 64, 160, [280], 40, 0.0, True, True),
}


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_mirror_matches_attend_rows(case, interleaved):
    batch, s, heads, kvh, d, cap, totals, window, softcap, causal, wcache = CASES[case]
    rng = np.random.default_rng(len(case) * 7 + interleaved)
    q, kc, vc = _inputs(rng, batch, s, heads, kvh, d, cap)
    seqlens = np.array(totals, np.int32) - 1
    for i, seqlen in enumerate(seqlens):  # rows past the length are never read
        rows = _entry(int(seqlen), s, cap, window, wcache)[2]
        kc[i, :, rows:] = vc[i, :, rows:] = np.nan
    rotary = _rotary(1024, d - 16, interleaved)  # rot < D: the last features pass through
    scale = 1.0 / math.sqrt(d)
    opts = dict(scale=scale, softcap=softcap, window=window, causal=causal, wcache=wcache)
    got = flash_attention(q, kc, vc, seqlens, rotary=rotary, **opts)
    want = _reference(q, kc, vc, seqlens, rotary=rotary, **opts)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _visible(row: int, key: int, keys: int, window: int, causal: bool) -> bool:
    """Whether the query at cache row ``row`` sees cache row ``key`` (the op's rule)."""
    if key >= keys:
        return False
    if not causal:
        return True
    return key <= row and (window <= 0 or key > row - window)


@pytest.mark.parametrize("rows_per_warp", [16, 32])
@pytest.mark.parametrize("case", sorted(CASES))
def test_tiles_visited_are_those_with_a_visible_key(case, rows_per_warp):
    """Each block visits, in ascending order, exactly the key tiles where one of its rows
    sees a key; a warp skips a tile where none of its rows sees one and leaves the mask off
    only where all of its rows see all of it. Query tiles run last to first."""
    batch, s, heads, kvh, d, cap, totals, window, softcap, causal, wcache = CASES[case]
    q, kc, vc = _inputs(np.random.default_rng(0), batch, s, heads, kvh, d, cap)
    visits: list[tuple[int, ...]] = []
    seqlens = np.array(totals, np.int32) - 1
    opts = dict(scale=0.1, window=window, causal=causal, wcache=wcache, visits=visits)
    flash_attention(q, kc, vc, seqlens, rows_per_warp=rows_per_warp, **opts)
    bq = WARPS * rows_per_warp
    n_qt = math.ceil(s / bq)
    for b in range(batch):
        _, base, keys = _entry(int(seqlens[b]), s, cap, window, wcache)
        for h in range(heads):
            mine = [v[2:] for v in visits if v[:2] == (b, h)]
            assert [v[0] for v in mine] == sorted((v[0] for v in mine), reverse=True)
            for qt in range(n_qt):
                rows = range(base + qt * bq, base + min(s, (qt + 1) * bq))
                want = [
                    kt
                    for kt in range(math.ceil(cap / BLOCK_K))
                    if any(
                        _visible(r, k, keys, window, causal)
                        for r in rows
                        for k in range(kt * BLOCK_K, (kt + 1) * BLOCK_K)
                    )
                ]
                tiles = [v[1] for v in mine if v[0] == qt and v[2] == 0]
                assert tiles == want, (b, h, qt)
                for _, kt, w, work in (v for v in mine if v[0] == qt):
                    wrows = rows[w * rows_per_warp : (w + 1) * rows_per_warp]
                    seen = [
                        _visible(r, k, keys, window, causal)
                        for r in wrows
                        for k in range(kt * BLOCK_K, (kt + 1) * BLOCK_K)
                    ]
                    assert (work == SKIP) == (not any(seen)), (b, h, qt, kt, w)
                    assert (work == FULL) == all(seen), (b, h, qt, kt, w)


def test_overflow_rows_are_nan_and_rows_without_keys_zero():
    """An entry whose length passes the cache gets NaN rows (never a clamped answer); an
    entry with no key (seqlens -1) gets zeros."""
    q, kc, vc = _inputs(np.random.default_rng(1), 3, 20, 4, 2, 64, 64)
    seqlens = np.array([64 + 5 - 1, -1, 19], np.int32)
    got = flash_attention(q, kc, vc, seqlens, scale=0.125)
    assert np.isnan(got[0]).all()
    np.testing.assert_array_equal(got[1], 0.0)
    assert np.isfinite(got[2]).all() and np.abs(got[2]).max() > 0


def test_sinks_add_their_share_to_the_denominator():
    """A sink logit per head against a dense float64 softmax with one extra zero-valued key."""
    rng = np.random.default_rng(2)
    s, heads, kvh, d, total = 75, 4, 2, 64, 140
    q, kc, vc = _inputs(rng, 1, s, heads, kvh, d, 160)
    sinks = rng.standard_normal(heads) * 3
    got = flash_attention(q, kc, vc, np.array([total - 1]), scale=0.125, sinks=sinks)
    past = total - s
    for h in range(heads):
        k, v = kc[0, h // 2, :total], vc[0, h // 2, :total]
        x = q[0, :, h] @ k.T * 0.125
        x[np.arange(total)[None, :] > past + np.arange(s)[:, None]] = -np.inf
        top = np.maximum(x.max(axis=1), sinks[h])[:, None]
        w = np.exp(x - top)
        want = (w @ v) / (w.sum(axis=1, keepdims=True) + np.exp(sinks[h] - top))
        np.testing.assert_allclose(got[0, :, h], want, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize(("dtype", "tol"), [(np.float16, 2e-3), (BF16, 2e-2)], ids=["fp16", "bf16"])
def test_storage_rounding_stays_within_the_gpu_tests_tolerance(dtype, tol):
    """Rounding the rotated queries and the probabilities to 16 bits (as the kernel feeds
    them to the tensor cores) keeps the output within the tolerance the GPU tests allow
    against the CPU provider (tests/providers/cuda/test_cuda_gqa_window.py's TOL)."""
    rng = np.random.default_rng(3)
    q, kc, vc = _inputs(rng, 2, 200, 14, 2, 64, 512, dtype)
    seqlens = np.array([450, 199], np.int32)
    rotary = _rotary(1024, 64, False)
    opts = dict(scale=0.125, softcap=0.0, window=0, causal=True, wcache=False)
    got = flash_attention(q, kc, vc, seqlens, rotary=rotary, storage=dtype, **opts)
    want = _reference(q, kc, vc, seqlens, rotary=rotary, **opts)
    np.testing.assert_allclose(got, want, rtol=tol / 2, atol=tol / 2)


@pytest.mark.parametrize("dtype", [np.dtype(np.float16), BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", sorted(GPU_CASES))
def test_mirror_matches_the_cpu_provider_on_the_gpu_tests_steps(case, dtype):
    """Each step of the GPU tests' cases (test_cuda_flash_attention.py), with the kernel's
    16-bit roundings, against the CPU provider's GroupQueryAttention within the tolerance
    those tests allow: the mirror reads the same contract (padding rows of a short entry,
    sinks, smooth softmax, not causal, partial rotary, a window-sized cache) the same way."""
    from tests.providers.cuda.test_cuda_gqa_window import TOL, _cpu, _rope

    b, h, kvh, d, cap, attrs, steps = GPU_CASES[case]
    rng = np.random.default_rng(len(case))
    rot = d - 16 if case == "interleaved-partial-rotary" else d
    cos, sin = _rope(4096, rot, dtype)
    caches = [rng.standard_normal((b, kvh, cap, d)).astype(dtype) for _ in range(2)]
    attrs = {"num_heads": h, "kv_num_heads": kvh, "do_rotary": 1, **attrs}
    info = _gqa_node(attrs)
    for s, totals in steps:
        qkv = rng.standard_normal((b, s, (h + 2 * kvh) * d)).astype(dtype)
        seqlens = np.array(totals, np.int32) - 1
        host = [qkv, None, None, *caches, seqlens, np.array(cap, np.int32), cos, sin]
        want, *caches = _cpu(info, host)
        got = flash_attention(
            qkv[:, :, : h * d].reshape(b, s, h, d),
            *caches,
            seqlens,
            scale=1.0 / math.sqrt(d),
            softcap=float(attrs.get("softcap", 0.0)),
            window=int(attrs.get("local_window_size", 0)),
            causal=bool(attrs.get("causal", 1)),
            wcache=bool(attrs.get("sliding_window_cache", 0)),
            sinks=np.zeros(h) if attrs.get("smooth_softmax") else None,
            rotary=Rotary(cos, sin, bool(attrs.get("rotary_interleaved", 0))),
            storage=dtype,
        )
        got = got.reshape(want.shape).astype(dtype).astype(np.float64)
        tol = TOL[dtype]
        np.testing.assert_allclose(got, want.astype(np.float64), rtol=tol, atol=tol)
