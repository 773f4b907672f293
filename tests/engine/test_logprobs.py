"""Log-probabilities of generated tokens (``logprobs``): float64 ``log_softmax`` of the raw
logits, checked against scipy and against onnxruntime run teacher-forced on the same model."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.special import log_softmax

from onnx_genrt.core.errors import InvalidInputError
from onnx_genrt.engine import GeneratorParams, Model, generate
from onnx_genrt.engine.batch import BatchGenerator
from onnx_genrt.engine.logprobs import MAX_TOP_LOGPROBS, TokenLogprob, token_logprob
from onnx_genrt.engine.scheduler import Scheduler
from onnx_genrt.generate_cli import default_model_dir

from ..llm_fixtures import ort_forced

TEXTS = ["    def __init__(self", "import os\n", "class Foo:"]


@pytest.fixture(scope="module")
def model() -> Model:
    return Model(default_model_dir())


def _reference(model: Model, tokens: list[int], prompt_length: int) -> np.ndarray:
    """float64 log-probabilities [generated, vocab] of the positions that picked each
    generated token, from onnxruntime fed the whole sequence."""
    logits = ort_forced(model.folder, tokens[:prompt_length], tokens[prompt_length:-1])
    return log_softmax(logits[prompt_length - 1 :].astype(np.float64), axis=-1)


def _check(entries: list[TokenLogprob], tokens: list[int], want: np.ndarray, top: int) -> None:
    assert [e.token for e in entries] == tokens
    assert len(entries) == len(want)
    for entry, row in zip(entries, want, strict=True):
        assert entry.logprob == pytest.approx(row[entry.token], abs=1e-4)
        assert len(entry.top) == top
        order = np.argsort(-row, kind="stable")[:top]
        assert [t for t, _ in entry.top] == order.tolist()
        for token, logprob in entry.top:
            assert logprob == pytest.approx(row[token], abs=1e-4)


def test_token_logprob_is_log_softmax_in_float64() -> None:
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 4, 1000).astype(np.float32)
    logits[[10, 20]] = logits.max() + 1  # a tie at the top: the lower id first
    want = log_softmax(logits.astype(np.float64))
    entry = token_logprob(logits, 5, 4)
    assert entry.token == 5 and entry.logprob == pytest.approx(want[5], abs=1e-12)
    assert [t for t, _ in entry.top] == [10, 20, *np.argsort(-want)[2:4].tolist()]
    assert all(lp == pytest.approx(want[t], abs=1e-12) for t, lp in entry.top)
    assert token_logprob(logits, 5, 0).top == ()
    assert len(token_logprob(logits[:3], 0, 20).top) == 3  # at most the vocabulary
    masked = logits.copy()
    masked[7] = -np.inf
    assert token_logprob(masked, 7, 1).logprob == -np.inf


@pytest.mark.parametrize("spec", [None, "ngram"])
def test_batch_rows_keep_the_logprobs_of_their_tokens(model: Model, spec: str | None) -> None:
    """Rows asking for log-probabilities (3 and 0 alternatives) beside one that does not:
    every row's greedy tokens equal the prompt alone, and each kept log-probability is
    onnxruntime's, teacher-forced on the row's own sequence; with prompt lookup the
    tokens come from verify steps (several a step) and keep the same log-probabilities."""
    batch = BatchGenerator(model, 4, 128)
    if spec:
        batch.speculate(spec, 3)
    tops = [3, None, 0]
    prompts = [model.tokenizer.encode(t) for t in TEXTS]
    rows = []
    for prompt, top in zip(prompts, tops, strict=True):
        params = GeneratorParams(model)
        params.set_search_options(max_length=len(prompt) + 20)
        rows.append(batch.add(prompt, params, logprobs=top))
    kept: dict[int, list[TokenLogprob]] = {r: list(batch.last_logprobs(r) or []) for r in rows}
    assert batch.last_logprobs(rows[1]) is None
    widths = set()
    while not all(batch.is_done(r) for r in rows):
        new = batch.step()
        widths |= {len(t) for t in new.values()}
        for r in rows:
            if r in new and tops[r] is not None:
                kept[r] += batch.last_logprobs(r)
    if spec:
        assert max(widths) > 1, "no verify step kept drafts"
    for r, (prompt, top) in enumerate(zip(prompts, tops, strict=True)):
        tokens = batch.sequence(r)
        alone = generate(model, prompt, max_new_tokens=20)
        assert (
            tokens[len(prompt) :]
            == alone.tokens[alone.prompt_tokens :][: len(tokens) - len(prompt)]
        )
        if top is None:
            continue
        generated = tokens[len(prompt) :]
        _check(kept[r], generated, _reference(model, tokens, len(prompt)), top)
        if top:  # greedy: the chosen token is the likeliest
            assert all(e.top[0][0] == e.token for e in kept[r])


def test_a_sampled_row_reports_the_models_own_distribution(model: Model) -> None:
    """Temperature, top-k and a penalty shape the pick, not the reported log-probability:
    it is the raw logits' log_softmax at the sampled token."""
    batch = BatchGenerator(model, 2, 128)
    prompt = model.tokenizer.encode("import os\n")
    params = GeneratorParams(model)
    params.set_search_options(
        max_length=len(prompt) + 16,
        do_sample=True,
        temperature=1.7,
        top_k=20,
        repetition_penalty=1.3,
        seed=3,
    )
    row = batch.add(prompt, params, logprobs=2)
    kept = list(batch.last_logprobs(row))
    while not batch.is_done(row):
        batch.step()
        kept += batch.last_logprobs(row)
    tokens = batch.sequence(row)
    _check(kept, tokens[len(prompt) :], _reference(model, tokens, len(prompt)), 2)


def test_the_scheduler_hands_out_the_logprobs_of_the_tokens_it_gives(model: Model) -> None:
    """Events carry their tokens' log-probabilities; a stop string that cuts a step's
    tokens cuts their log-probabilities too, so the result has one per token."""
    scheduler = Scheduler(model, max_batch=2)
    scheduler.start()
    try:
        full = scheduler.submit("def add(a, b):", max_new_tokens=12, logprobs=1).result(60)
        assert full.logprobs is not None and len(full.logprobs) == len(full.token_ids) == 12
        stop = full.text[5:8]
        handle = scheduler.submit("def add(a, b):", max_new_tokens=12, logprobs=1, stop=stop)
        events = list(handle.events(timeout=60))
        cut = handle.result(1)
        assert cut.finish_reason == "stop" and len(cut.token_ids) < 12
        assert [e.token for e in cut.logprobs] == cut.token_ids
        assert [e for ev in events for e in ev.logprobs] == cut.logprobs
        assert cut.logprobs == full.logprobs[: len(cut.logprobs)]
        plain = scheduler.submit("def add(a, b):", max_new_tokens=3).result(60)
        assert plain.logprobs is None
    finally:
        scheduler.close()


@pytest.mark.parametrize("value", [-1, MAX_TOP_LOGPROBS + 1, True, 1.5])
def test_bad_logprobs_are_refused(model: Model, value) -> None:
    batch = BatchGenerator(model, 1, 64)
    params = GeneratorParams(model)
    params.set_search_options(max_length=8)
    with pytest.raises(InvalidInputError, match="logprobs"):
        batch.add([5, 6], params, logprobs=value)
    assert not batch.rows  # nothing taken


@pytest.mark.parametrize("spec", [None, "mtp"])
def test_generate_keeps_logprobs_with_the_same_tokens(model: Model, spec: str | None) -> None:
    """``generate(..., logprobs=N)`` (one prompt: a batch of one) gives the tokens of plain
    ``generate`` and onnxruntime's log-probabilities; a stop string cuts both."""
    text = "import os\n"
    plain = generate(model, text, max_new_tokens=16, spec=spec)
    got = generate(model, text, max_new_tokens=16, spec=spec, logprobs=2)
    assert got.tokens == plain.tokens and got.text == plain.text
    assert plain.logprobs is None
    generated = got.tokens[got.prompt_tokens :]
    _check(got.logprobs, generated, _reference(model, got.tokens, got.prompt_tokens), 2)
    stop = got.text[3:6]
    cut = generate(model, text, max_new_tokens=16, logprobs=0, stop=stop)
    assert len(cut.logprobs) == cut.new_tokens < got.new_tokens
    want = [e.logprob for e in got.logprobs[: cut.new_tokens]]  # verify steps round apart
    assert [e.logprob for e in cut.logprobs] == pytest.approx(want, abs=1e-5)


def test_generate_refuses_logprobs_with_a_draft_model(model: Model) -> None:
    with pytest.raises(InvalidInputError, match="not by a draft model"):
        generate(model, "x", max_new_tokens=2, spec="draft", logprobs=1)


@pytest.mark.parametrize("chunk", [None, 5])
def test_a_row_scores_its_prompt(model: Model, chunk: int | None, monkeypatch) -> None:
    """``prompt_logprobs``: each prompt token after the first gets onnxruntime's
    log-probability given the tokens before it, across the pieces the prompt is fed in
    (three of at most 4 tokens here; with ``chunk``, scheduler-style chunks of 5 too), and
    the row's generated tokens are those of the prompt alone."""
    from onnx_genrt.engine import batch as batch_module

    monkeypatch.setattr(batch_module, "PROMPT_LOGPROBS_CHUNK", 4)
    prompt = model.tokenizer.encode("    def __init__(self, x):")
    assert len(prompt) > 8
    batch = BatchGenerator(model, 2, 128)
    params = GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + 6)
    row = batch.add(prompt, params, logprobs=1, prompt_logprobs=True, chunk=chunk)
    while batch.prefilling(row):
        batch.prefill_step(chunk)
    while not batch.is_done(row):
        batch.step()
    alone = generate(model, prompt, max_new_tokens=6)
    assert batch.sequence(row) == alone.tokens
    logits = ort_forced(model.folder, prompt, [])
    want = log_softmax(logits[:-1].astype(np.float64), axis=-1)
    _check(batch.prompt_logprobs(row), prompt[1:], want, 1)
    with pytest.raises(InvalidInputError, match="prompt_logprobs needs logprobs"):
        batch.add(prompt, params, prompt_logprobs=True)
