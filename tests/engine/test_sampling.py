"""The host sampler (``engine/sampling.py``) against the plain numpy it replaces: the top-p
prefix found by partition is the one a full stable sort gives (ties included), with the same
sums, and ``draw`` is ``Generator.choice`` on the same uniform draw."""

from __future__ import annotations

import numpy as np
import pytest

from onnx_genrt.engine.config import SearchOptions
from onnx_genrt.engine.sampling import TOP_P_FIRST, descending_prefix, distribution, draw


def _full_sort_distribution(logits: np.ndarray, options: SearchOptions) -> np.ndarray:
    """The distribution as written with a full argsort (the definition)."""
    x = np.asarray(logits, dtype=np.float64) / options.temperature
    x = x - x.max()
    p = np.exp(x)
    p /= p.sum()
    keep = np.ones(p.shape, bool)
    if options.top_k and options.top_k < p.size:
        keep &= p >= np.sort(p)[-options.top_k]
    if options.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        cut = int(np.searchsorted(np.cumsum(p[order]), options.top_p, side="left")) + 1
        mask = np.zeros(p.shape, bool)
        mask[order[:cut]] = True
        keep &= mask
    if options.min_p > 0.0:
        keep &= p >= options.min_p * p.max()
    p = np.where(keep, p, 0.0)
    return p / p.sum()


def _logits(rng: np.random.Generator, vocab: int, ties: bool, scale: float) -> np.ndarray:
    x = rng.standard_normal(vocab) * scale
    if ties:  # few distinct values: long runs of equal probabilities at every cut
        x = np.round(x * 2) / 2
    return x.astype(np.float32)


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("scale", [0.5, 4.0], ids=["flat", "peaked"])
@pytest.mark.parametrize(
    "top_k,top_p,min_p,temperature",
    [(0, 1.0, 0.0, 1.0), (0, 0.9, 0.0, 0.7), (0, 0.999, 0.0, 1.3), (40, 0.95, 0.0, 1.0),
     (0, 0.5, 0.05, 1.0), (5, 1.0, 0.0, 0.5), (0, 1e-9, 0.0, 1.0)],
)  # fmt: skip
def test_distribution_is_the_full_sort_one_bit_for_bit(
    ties, scale, top_k, top_p, min_p, temperature
):
    rng = np.random.default_rng(7)
    options = SearchOptions(
        do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p
    )
    for vocab in (50, 3000, 40000):
        logits = _logits(rng, vocab, ties, scale)
        got = distribution(logits, options)
        want = _full_sort_distribution(logits, options)
        np.testing.assert_array_equal(got, want)


def test_the_prefix_grows_until_it_holds_the_mass():
    """A flat distribution needs more than TOP_P_FIRST tokens for 0.9 of its mass: the
    prefix grows (8x at a time, then the whole vocabulary) and stays the sorted one."""
    p = np.full(20000, 1.0 / 20000)
    p[::7] *= 1.5
    p /= p.sum()
    order, cumulative = descending_prefix(p, 0.9)
    full = np.argsort(-p, kind="stable")
    assert len(order) > TOP_P_FIRST
    np.testing.assert_array_equal(order, full[: len(order)])
    np.testing.assert_array_equal(cumulative, np.cumsum(p[full])[: len(order)])
    assert cumulative[-1] >= 0.9


def test_draw_is_choice_on_the_same_draw():
    """Same index as ``Generator.choice(p.size, p=p)`` from generators seeded alike, and the
    generators stay in step."""
    p = np.random.default_rng(1).random(5000) ** 4
    p /= p.sum()
    ours, theirs = np.random.default_rng(11), np.random.default_rng(11)
    for _ in range(300):
        assert draw(p, ours) == int(theirs.choice(p.size, p=p))
    assert ours.random() == theirs.random()
