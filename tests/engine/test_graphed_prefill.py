"""Prompts as graphed chunks of padded rows (``DecoderRunner.prefill(graphed=True)``, the
default where reads are asynchronous: a GPU), forced here on the CPU: every chunk's real
rows equal an eager prefill of the same prompt, each width captures once and then replays,
and generation (greedy and with the MTP head) is token-identical to the eager prefill."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from onnx_genrt.engine import Generator, Model, generate
from onnx_genrt.engine.decoder import PREFILL_GRAPH_MAX_TOKENS, PREFILL_WIDTHS, DecoderRunner
from onnx_genrt.models import default_model_path

#: Prompt lengths around each width and across chunks (the widest is one chunk).
LENGTHS = [2, 7, 8, 9, 20, 33, 63, 64, 65, 130, 200, PREFILL_GRAPH_MAX_TOKENS]


@pytest.fixture(scope="module")
def model() -> Model:
    return Model(default_model_path())


def _prompt(model: Model, n: int) -> list[int]:
    rng = np.random.default_rng(n)
    return rng.integers(1, model.config.vocab_size, n).tolist()


def _last_logits(model: Model, tokens: list[int], graphed: bool, max_length: int = 512):
    runner = DecoderRunner(model.session, model.config, max_length)
    out, _ = runner.prefill(tokens, graphed)
    assert runner.cache.length == len(tokens)
    return out.logits[-1].astype(np.float64), runner


@pytest.mark.parametrize("n", LENGTHS)
def test_graphed_chunks_equal_an_eager_prefill(model, n):
    """The last prompt row's logits, and the next step's, after graphed chunks equal those
    after one eager prefill: padded rows never reach a real row, and the keys and values
    the padding wrote past the prompt are overwritten by the next step."""
    tokens = _prompt(model, n)
    want, eager = _last_logits(model, tokens, graphed=False)
    got, graphed = _last_logits(model, tokens, graphed=True)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    following = int(np.argmax(want))
    steps = [r.forward([following], None).logits[-1].astype(np.float64) for r in (eager, graphed)]
    np.testing.assert_allclose(steps[1], steps[0], rtol=1e-4, atol=1e-4 * np.abs(steps[0]).max())


def test_each_width_captures_once_then_replays():
    """Prompts of every length share one graph per width (slot VERIFY, variants of their
    own): after a warm-up of each width, later prompts only replay. (A model of its own: a
    runner over another cache binds other buffers, which recaptures a width's graph.)"""
    model = Model(default_model_path())
    runner = DecoderRunner(model.session, model.config, 512)
    before = copy.deepcopy(model.session.graph_stats("verify"))  # the counters are live
    captures, replays = before.captures, before.replays
    for n in [*LENGTHS, *LENGTHS, *LENGTHS]:
        runner.cache.length = 0
        runner.prefill(_prompt(model, n), graphed=True)
    stats = model.session.graph_stats("verify")
    assert stats.captures - captures == len(PREFILL_WIDTHS)
    assert stats.replays - replays > len(LENGTHS)
    assert stats.invalidations == before.invalidations and stats.fallbacks == before.fallbacks


def test_a_prompt_longer_than_the_graphed_limit_runs_eagerly(model):
    """Past ``PREFILL_GRAPH_MAX_TOKENS`` one eager step beats many 64-row replays."""
    tokens = _prompt(model, PREFILL_GRAPH_MAX_TOKENS + 1)
    before = copy.deepcopy(model.session.graph_stats("verify"))
    got, _ = _last_logits(model, tokens, graphed=True, max_length=512)
    after = model.session.graph_stats("verify")
    assert (after.eager_runs, after.replays) == (before.eager_runs, before.replays)
    want, _ = _last_logits(model, tokens, graphed=False, max_length=512)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_a_chunk_whose_padding_passes_the_cache_end_runs_eagerly(model):
    """A 66-token prompt in a 70-position cache: the second chunk (2 tokens, width 8) would
    pad past the end, so it runs eagerly; the logits equal the eager prefill's."""
    tokens = _prompt(model, 66)
    want, _ = _last_logits(model, tokens, graphed=False, max_length=70)
    got, runner = _last_logits(model, tokens, graphed=True, max_length=70)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    assert runner.cache.length == 66


@pytest.mark.parametrize("spec", [None, "mtp"])
def test_generation_with_graphed_prompts_is_token_identical(model, monkeypatch, spec):
    text = "    def __init__(self, a, b, c):\n        self.a = a\n" * 3
    plain = generate(model, text, max_new_tokens=24, spec=spec)
    monkeypatch.setattr(Generator, "graph_prefill", True)
    graphed = generate(model, text, max_new_tokens=24, spec=spec)
    assert graphed.tokens == plain.tokens
