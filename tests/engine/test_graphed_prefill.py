"""Prompts as graphed chunks of padded rows (``DecoderRunner.prefill(graphed=True)``, the
default where reads are asynchronous: a GPU), forced here on the CPU: every chunk's real
rows equal an eager prefill of the same prompt, each width captures once and then replays,
and generation (greedy and with the MTP head) is token-identical to the eager prefill. The
CPU provider captures any number of rows, so every width of ``PREFILL_WIDTHS`` (up to 512)
runs here; a session that captures fewer rows (``graph_max_rows``: the CUDA provider with
``cublas_in_graphs`` off says 64) keeps the narrower widths and the shorter limit."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from onnx_genrt.core.graph_slots import DeviceGraphSlot
from onnx_genrt.engine import Generator, Model, generate
from onnx_genrt.engine import decoder as decoder_module
from onnx_genrt.engine.decoder import (
    PREFILL_GRAPH_MAX_CHUNKS,
    PREFILL_GRAPH_MAX_TOKENS,
    PREFILL_WIDTHS,
    DecoderRunner,
)
from onnx_genrt.models import default_model_path
from onnx_genrt.session import InferenceSession

#: Prompt lengths around each width and across chunks: 65 is one chunk of width 128, 300 one
#: of 512, 513 the widest then 8, 700 the widest then 256.
LENGTHS = [2, 7, 8, 9, 20, 33, 63, 64, 65, 130, 200, 256, 257, 300, 512, 513, 700]
#: The cache of these tests: the embedded model's whole context (1024 positions).
CACHE = 1024


@pytest.fixture(scope="module")
def model() -> Model:
    return Model(default_model_path())


def _prompt(model: Model, n: int) -> list[int]:
    rng = np.random.default_rng(n)
    return rng.integers(1, model.config.vocab_size, n).tolist()


def _last_logits(model: Model, tokens: list[int], graphed: bool, max_length: int = CACHE):
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
    runner = DecoderRunner(model.session, model.config, CACHE)
    assert runner.prefill_widths() == PREFILL_WIDTHS
    before = copy.deepcopy(model.session.graph_stats("verify"))  # the counters are live
    captures, replays = before.captures, before.replays
    for n in [*LENGTHS, *LENGTHS, *LENGTHS]:
        runner.cache.length = 0
        runner.prefill(_prompt(model, n), graphed=True)
    stats = model.session.graph_stats("verify")
    assert stats.captures - captures == len(PREFILL_WIDTHS)
    assert stats.replays - replays > len(LENGTHS)
    assert stats.invalidations == before.invalidations and stats.fallbacks == before.fallbacks


def _verify_runs(model: Model) -> int:
    stats = model.session.graph_stats("verify")
    return stats.eager_runs + stats.captures + stats.replays


def test_a_prompt_longer_than_the_graphed_limit_runs_eagerly(model, monkeypatch):
    """Past the limit one eager step beats many replays (the limit lowered to 300 here: the
    default, PREFILL_GRAPH_MAX_TOKENS, leaves no room for a next token in this model's
    context)."""
    runner = DecoderRunner(model.session, model.config, CACHE)
    assert runner.prefill_graph_max_tokens() == PREFILL_GRAPH_MAX_TOKENS
    monkeypatch.setattr(decoder_module, "PREFILL_GRAPH_MAX_TOKENS", 300)
    assert runner.prefill_graph_max_tokens() == 300
    tokens = _prompt(model, 301)
    before = _verify_runs(model)
    got, _ = _last_logits(model, tokens, graphed=True)
    assert _verify_runs(model) == before
    want, _ = _last_logits(model, tokens, graphed=False)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    got, _ = _last_logits(model, tokens[:300], graphed=True)  # at the limit: one chunk
    assert _verify_runs(model) == before + 1


def test_a_chunk_whose_padding_passes_the_cache_end_runs_eagerly(model):
    """A 514-token prompt in a 516-position cache: the first chunk (512) replays its
    graph, the second (2 tokens, width 8) would pad past the end, so it runs eagerly; the
    logits equal the eager prefill's."""
    tokens = _prompt(model, 514)
    want, _ = _last_logits(model, tokens, graphed=False, max_length=516)
    before = _verify_runs(model)
    got, runner = _last_logits(model, tokens, graphed=True, max_length=516)
    assert _verify_runs(model) == before + 1
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    assert runner.cache.length == 514


def _record_widths(monkeypatch) -> list[int]:
    """The widths of the graphed chunks launched from now on (slot VERIFY)."""
    widths: list[int] = []
    launch = DecoderRunner.launch

    def spy(self, tokens, slot, width=None, *args, **kwargs):
        if slot is DeviceGraphSlot.VERIFY:
            widths.append(width)
        return launch(self, tokens, slot, width, *args, **kwargs)

    monkeypatch.setattr(DecoderRunner, "launch", spy)
    return widths


@pytest.mark.parametrize("limit", [64, 200])
def test_a_session_capturing_fewer_rows_keeps_narrower_chunks(monkeypatch, limit):
    """Where the session's graphs hold at most ``limit`` rows, chunks are no wider and
    prompts of more than PREFILL_GRAPH_MAX_CHUNKS widest chunks run eagerly (64 rows: 256
    tokens, as before wider chunks captured); the logits still equal the eager prefill's."""
    monkeypatch.setattr(InferenceSession, "graph_max_rows", property(lambda s: limit))
    model = Model(default_model_path())
    runner = DecoderRunner(model.session, model.config, CACHE)
    widths = tuple(w for w in PREFILL_WIDTHS if w <= limit)
    assert runner.prefill_widths() == widths and widths[-1] <= limit < 2 * widths[-1]
    longest = PREFILL_GRAPH_MAX_CHUNKS * widths[-1]
    assert runner.prefill_graph_max_tokens() == longest
    launched = _record_widths(monkeypatch)
    for n in (widths[-1] + 6, longest):
        tokens = _prompt(model, n)
        want, _ = _last_logits(model, tokens, graphed=False)
        got, _ = _last_logits(model, tokens, graphed=True)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    assert launched == [widths[-1], 8] + [widths[-1]] * PREFILL_GRAPH_MAX_CHUNKS
    before = _verify_runs(model)
    _last_logits(model, _prompt(model, longest + 1), graphed=True)
    assert _verify_runs(model) == before


def test_no_width_fits_a_session_capturing_very_few_rows(monkeypatch, model):
    """Below the narrowest width no prompt runs as graphed chunks."""
    monkeypatch.setattr(InferenceSession, "graph_max_rows", property(lambda s: 4))
    runner = DecoderRunner(model.session, model.config, CACHE)
    assert runner.prefill_widths() == () and runner.prefill_graph_max_tokens() == 0
    before = _verify_runs(model)
    got, _ = _last_logits(model, _prompt(model, 20), graphed=True)
    assert _verify_runs(model) == before
    want, _ = _last_logits(model, _prompt(model, 20), graphed=False)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_prefill_widths_leave_room_between_batch_rows():
    """A batch's row runners number their graph variants 1024 apart (``engine/batch.py``
    ``_row_runner``): every width stays below that."""
    assert max(PREFILL_WIDTHS) < 1024 and list(PREFILL_WIDTHS) == sorted(set(PREFILL_WIDTHS))


@pytest.mark.parametrize("repeats", [3, 20])
@pytest.mark.parametrize("spec", [None, "mtp"])
def test_generation_with_graphed_prompts_is_token_identical(model, monkeypatch, spec, repeats):
    """A short prompt (one narrow chunk) and a long one (wide chunks, up to 512 rows)."""
    text = "    def __init__(self, a, b, c):\n        self.a = a\n" * repeats
    plain = generate(model, text, max_new_tokens=24, spec=spec)
    monkeypatch.setattr(Generator, "graph_prefill", True)
    graphed = generate(model, text, max_new_tokens=24, spec=spec)
    assert graphed.tokens == plain.tokens


def test_a_session_without_a_row_limit_feeds_wide_chunks(model, monkeypatch):
    """The CPU provider captures any number of rows: a 300-token prompt is one graphed
    chunk (wider than the 64 rows the CUDA kernels capture without cuBLAS), a 700-token
    prompt the widest chunk and one more."""
    assert model.session.graph_max_rows is None
    assert PREFILL_WIDTHS[-1] >= 300
    launched = _record_widths(monkeypatch)
    for n in (300, 700):
        _last_logits(model, _prompt(model, n), graphed=True)
    wide = next(w for w in PREFILL_WIDTHS if w >= 300)
    rest = next(w for w in PREFILL_WIDTHS if w >= 700 - PREFILL_WIDTHS[-1])
    assert launched == [wide, PREFILL_WIDTHS[-1], rest]


def test_batch_rows_keep_narrow_prompt_graphs():
    """A batch row keeps its own prompt graphs, so its widths stop at
    ``ROW_PREFILL_MAX_WIDTH`` while a single sequence's runner takes every width the session
    captures; a row's longer prompt still equals the prompt generated alone."""
    from onnx_genrt.engine import GeneratorParams
    from onnx_genrt.engine.batch import ROW_PREFILL_MAX_WIDTH, BatchGenerator

    model = Model(default_model_path())
    batch = BatchGenerator(model, 2, 256)
    batch.graph_prefill = True
    row_widths = batch._row_runner(1).prefill_widths()
    assert row_widths == tuple(w for w in PREFILL_WIDTHS if w <= ROW_PREFILL_MAX_WIDTH)
    assert batch.runner.prefill_widths()[-1] > ROW_PREFILL_MAX_WIDTH  # the CPU captures any
    text = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n" * 3
    ids = model.tokenizer.encode(text)
    assert 64 < len(ids) <= 4 * ROW_PREFILL_MAX_WIDTH
    params = GeneratorParams(model)
    params.set_search_options(max_length=len(ids) + 8)
    batch.add(ids, params, ignore_eos=True)
    row = batch.add(ids, params, ignore_eos=True)
    while not batch.is_done(row):
        batch.step()
    assert batch.sequence(row) == generate(model, ids, 8, ignore_eos=True).tokens
