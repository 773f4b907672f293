"""``core.token_sampling``: the rule of ``onnx_genrt::SampleTokens``. Philox4x32-10 against
Random123's known-answer vectors; the uniforms' form; the samples' distribution against
``softmax(logits / temperature)`` (a chi-square test on fixed seeds); greedy at temperature
0; NaN and -inf rows; the CPU kernel against the numpy statement."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from onnx_genrt.core.token_sampling import (
    check_sample_shapes,
    gumbel_scores,
    philox4x32,
    sample_tokens,
    top_k_floor,
    uniforms,
)
from onnx_genrt.providers.cpu.kernels._sampling import SMALL_K, _floor, sample_rows

#: Random123 tests/kat_vectors, the three "philox4x32 10" lines: counter, key, result.
KAT = [
    ([0, 0, 0, 0], [0, 0], [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]),
    ([0xFFFFFFFF] * 4, [0xFFFFFFFF] * 2, [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]),
    (
        [0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344],
        [0xA4093822, 0x299F31D0],
        [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1],
    ),
]


@pytest.mark.parametrize("counter,key,want", KAT)
def test_philox_gives_the_known_answers(counter, key, want):
    np.testing.assert_array_equal(philox4x32(np.array(counter), np.array(key)), want)


def test_uniforms_are_odd_multiples_of_two_to_the_minus_24_inside_zero_one():
    u = uniforms(np.array([3, -5]), np.array([0, 2**40 + 7]), 1001)
    assert u.dtype == np.float32 and u.shape == (2, 1001)
    k = u.astype(np.float64) * 2.0**24
    np.testing.assert_array_equal(k, np.round(k))
    assert (k % 2 == 1).all() and (u > 0).all() and (u < 1).all()
    assert not np.array_equal(u[0], u[1])


def _tie_free(logits, temperature, seed, offset, got, want) -> None:
    """``got`` equals ``want`` except on rows whose two best scores are within float32
    rounding of each other (another implementation of log may order them otherwise)."""
    scores = np.sort(gumbel_scores(logits, temperature, seed, offset), axis=-1)
    if scores.shape[-1] < 2:
        np.testing.assert_array_equal(got, want)
        return
    near = np.abs(scores[..., -1] - scores[..., -2]) <= 1e-5 * np.abs(scores[..., -1])
    assert ((got == want) | near).all(), np.argwhere((got != want) & ~near)[:5]


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_samples_follow_softmax_of_logits_over_temperature(temperature):
    """40000 draws (offsets 0 .. 39999 of one seed) over 12 tokens: a chi-square test
    against the float64 softmax does not reject (fixed seeds: the verdict never changes)."""
    logits = np.linspace(-2.0, 1.5, 12).astype(np.float32)
    n = 40000
    rows = np.broadcast_to(logits, (n, 12))
    tokens = sample_tokens(
        rows, np.full(n, temperature, np.float32), np.full(n, 1234), np.arange(n)
    )
    counts = np.bincount(tokens, minlength=12)
    p = np.exp(logits.astype(np.float64) / temperature)
    p /= p.sum()
    assert stats.chisquare(counts, p * n).pvalue > 1e-4
    other = sample_tokens(rows[:2000], np.full(2000, temperature, np.float32),
                          np.full(2000, 99), np.arange(2000))  # fmt: skip
    assert not np.array_equal(other, tokens[:2000])  # another seed, other draws


def test_temperature_zero_is_the_argmax_and_bad_scores_never_win():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((4, 50)).astype(np.float32)
    logits[1, 7] = np.nan
    logits[2] = -np.inf
    logits[3, :] = np.nan
    temperature = np.array([0.0, 1.0, 1.0, 1.0], np.float32)
    tokens = sample_tokens(logits, temperature, np.arange(4), np.zeros(4, np.int64))
    assert tokens[0] == np.argmax(logits[0])
    assert tokens[1] != 7
    assert tokens[2] == 0 and tokens[3] == 0


def test_a_row_draws_the_same_alone_and_in_any_batch():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((6, 1, 300)).astype(np.float32)
    temperature = np.full((6, 1), 0.8, np.float32)
    seed, offset = rng.integers(0, 2**62, (6, 1)), rng.integers(0, 1000, (6, 1))
    batch = sample_tokens(logits, temperature, seed, offset)
    for r in range(6):
        alone = sample_tokens(logits[r : r + 1], temperature[r : r + 1], seed[r : r + 1],
                              offset[r : r + 1])  # fmt: skip
        assert alone[0, 0] == batch[r, 0]


def test_top_k_draws_from_the_renormalised_top_k():
    """With top_k 4 of 12 tokens: every draw is among the 4 largest logits, and the draws
    follow their softmax renormalised (chi-square); top_k 0 or 12 changes nothing."""
    logits = np.linspace(-2.0, 1.5, 12).astype(np.float32)[::-1].copy()
    n = 20000
    rows = np.broadcast_to(logits, (n, 12))
    args = (np.full(n, 1.0, np.float32), np.full(n, 77), np.arange(n))
    tokens = sample_tokens(rows, *args, np.full(n, 4))
    assert tokens.max() < 4
    p = np.exp(logits[:4].astype(np.float64))
    assert stats.chisquare(np.bincount(tokens, minlength=4), p / p.sum() * n).pvalue > 1e-4
    plain = sample_tokens(rows, *args)
    for off in (0, 12, -3):
        np.testing.assert_array_equal(sample_tokens(rows, *args, np.full(n, off)), plain)


def test_the_top_k_floor_keeps_ties_and_counts_nan_as_minus_infinity():
    x = np.array([[3.0, 1.0, 3.0, 2.0, np.nan], [np.nan, np.nan, 0.5, -1.0, 2.0]], np.float32)
    np.testing.assert_array_equal(top_k_floor(x, np.array([2, 3])), [3.0, -1.0])
    np.testing.assert_array_equal(top_k_floor(x, np.array([0, 5])), [-np.inf, -np.inf])
    tokens = sample_tokens(x, np.ones(2, np.float32), np.arange(2), np.zeros(2, np.int64),
                           np.array([2, 3]))  # fmt: skip
    assert tokens[0] in (0, 2) and tokens[1] in (2, 3, 4)


@pytest.mark.parametrize("vocab", [1, 3, 4, 5003])
def test_the_cpu_kernel_is_the_rule(vocab):
    rng = np.random.default_rng(vocab)
    rows = 64
    logits = (3 * rng.standard_normal((rows, vocab))).astype(np.float32)
    logits[5, : min(vocab, 3)] = np.nan
    temperature = rng.uniform(0.2, 2.0, rows).astype(np.float32)
    temperature[:3] = [0.0, -1.0, 1e-3]
    seed = rng.integers(-(2**63), 2**63 - 1, rows)
    offset = rng.integers(0, 2**45, rows)
    top_k = rng.integers(-1, vocab + 2, rows)
    got = np.empty(rows, np.int64)
    sample_rows(logits, temperature, seed, offset, top_k, got)
    want = sample_tokens(logits, temperature, seed, offset, top_k)
    _tie_free(logits, temperature, seed, offset, got, want)
    assert (got == want).mean() > 0.95


def test_shapes_that_do_not_fit_are_named():
    with pytest.raises(ValueError, match=r"node: seed \[3\] must have the logits' leading"):
        check_sample_shapes("node", (2, 1, 10), ("temperature", (2, 1)), ("seed", (3,)))
    with pytest.raises(ValueError, match="last axis of at least 1"):
        check_sample_shapes("node", (2, 0))
    assert check_sample_shapes("node", (2, 3, 10), ("offset", (2, 3))) == 6


def test_the_cpu_floor_is_the_rule_for_small_and_large_k():
    """The CPU kernel's top-k floor (a sorted buffer up to SMALL_K, a partition above) is
    ``top_k_floor`` on rows with ties and NaN, for k off, small, large and past the row."""
    rng = np.random.default_rng(4)
    for _ in range(200):
        vocab = int(rng.integers(1, 3 * SMALL_K))
        x = np.round(rng.standard_normal(vocab) * 2).astype(np.float32)
        x[rng.random(vocab) < 0.05] = np.nan
        for k in {-1, 0, 1, int(rng.integers(1, vocab + 2)), SMALL_K, SMALL_K + 1, vocab}:
            assert _floor(x, k) == top_k_floor(x[None], np.array([k]))[0], (vocab, k)
