"""``_vector_exp.exp32`` against numpy's float64 exp, and the kernels built on it."""

from __future__ import annotations

import numpy as np
import pytest

from onnx_genrt.providers.cpu.kernels._vector_exp import EXP32_MAX, EXP32_MIN, exp32_into
from onnx_genrt.providers.cpu.kernels.elementwise import (
    sigmoid_into,
    silu_mul_halves,
    silu_mul_rows,
)

F32 = np.float32


def _ulps(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    return np.abs(got.view(np.int32).astype(np.int64) - want.view(np.int32).astype(np.int64))


def test_exp32_is_within_one_ulp_of_the_rounded_float64_exp() -> None:
    x = np.concatenate(
        [
            np.linspace(EXP32_MIN, EXP32_MAX, 1_000_001, dtype=F32),
            np.random.default_rng(0).standard_normal(200_000).astype(F32) * 20,
        ]
    )
    got = np.empty_like(x)
    exp32_into(x, got)
    with np.errstate(over="ignore"):  # the top of the range rounds up past float32's max
        want = np.exp(x.astype(np.float64)).astype(F32)
    normal = want >= np.finfo(F32).tiny
    assert _ulps(got[normal], want[normal]).max() <= 1


def test_exp32_edges() -> None:
    x = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 89.0, -88.0, -200.0, 88.7], F32)
    got = np.empty_like(x)
    exp32_into(x, got)
    assert np.isnan(got[0])
    assert got[1] == np.inf and got[5] == np.inf
    assert got[2] == 0 and got[6] == 0 and got[7] == 0  # subnormal results flush to 0
    assert got[3] == 1 and got[4] == 1
    assert (
        np.isfinite(got[8]) and _ulps(got[8:], np.exp(x[8:].astype(np.float64)).astype(F32))[0] <= 1
    )


def test_exp32_takes_strided_views() -> None:
    x = np.linspace(-5, 5, 64, dtype=F32)
    out = np.zeros(128, F32)
    exp32_into(x[::2], out[::4])
    np.testing.assert_allclose(out[::4], np.exp(x[::2].astype(np.float64)), rtol=2e-7)
    assert not out[1::4].any()


@pytest.mark.parametrize("alpha", [1.0, 0.5, -2.0])
def test_sigmoid_matches_float64(alpha: float) -> None:
    x = np.random.default_rng(1).standard_normal((3, 5, 7)).astype(F32) * 30
    out = np.empty_like(x)
    sigmoid_into(x, out, alpha)
    want = 1 / (1 + np.exp(-alpha * x.astype(np.float64)))
    np.testing.assert_allclose(out, want, rtol=3e-7, atol=1e-37)


def test_silu_mul_of_strided_halves_matches_float64() -> None:
    gu = np.random.default_rng(2).standard_normal((4, 64)).astype(F32) * 8
    g, u = gu[:, :32], gu[:, 32:]
    out = np.empty((4, 32), F32)
    silu_mul_rows(g, u, out)
    g64 = g.astype(np.float64)
    np.testing.assert_allclose(out, g64 / (1 + np.exp(-g64)) * u, rtol=1e-6, atol=1e-30)


def test_silu_mul_of_the_halves_of_contiguous_rows_equals_the_strided_kernel() -> None:
    """The split form (a fused gate/up projection's rows): float64 within rounding, and
    bit for bit what the kernel on the strided halves gives."""
    gu = np.random.default_rng(3).standard_normal((8, 96)).astype(F32) * 6
    got = np.empty((8, 48), F32)
    silu_mul_halves(gu, 48, got)
    strided = np.empty_like(got)
    silu_mul_rows(gu[:, :48], gu[:, 48:], strided)
    np.testing.assert_array_equal(got, strided)
    g64, u64 = gu[:, :48].astype(np.float64), gu[:, 48:].astype(np.float64)
    np.testing.assert_allclose(got, g64 / (1 + np.exp(-g64)) * u64, rtol=1e-6, atol=1e-30)
