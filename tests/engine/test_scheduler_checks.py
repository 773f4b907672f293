"""The scheduler's limits, chunked prefill and counters, against onnxruntime-genai decoding
the same embedded model greedily, request by request."""

from __future__ import annotations

import math
import time
from functools import cache
from pathlib import Path

import numpy as np
import pytest

from onnx_genrt.core.errors import InvalidInputError
from onnx_genrt.engine import Model, generate
from onnx_genrt.engine.api import DEFAULT_MAX_NEW_TOKENS
from onnx_genrt.engine.batch import BatchGenerator
from onnx_genrt.engine.scheduler import QueueFullError, RequestHandle, Scheduler
from onnx_genrt.generate_cli import default_model_dir

from ..llm_fixtures import nan_token_copy

SHORT = "import os\n"
LONG = "    def __init__(self, name, value=None):\n        self.name = name\n        self.value"


@pytest.fixture(scope="module")
def model() -> Model:
    return Model(default_model_dir())


@cache
def _og_model(folder: Path | None = None):
    og = pytest.importorskip("onnxruntime_genai")
    return og, og.Model(str(folder or default_model_dir()))


def _og_greedy(ids: list[int], new: int, folder: Path | None = None) -> list[int]:
    """onnxruntime-genai's greedy continuation of ``ids`` (the embedded model unless
    ``folder``): ``new`` tokens, checked to hold no end-of-sequence token (onnxruntime-genai
    leaves it out of its sequence)."""
    og, og_model = _og_model(folder)
    params = og.GeneratorParams(og_model)
    params.set_search_options(max_length=len(ids) + new)
    gen = og.Generator(og_model, params)
    gen.append_tokens(np.array([ids], np.int32))
    while not gen.is_done():
        gen.generate_next_token()
    out = [int(t) for t in gen.get_sequence(0)][len(ids) :]
    assert len(out) == new, "the reference met end of sequence; pick another prompt"
    return out


def _og_text(tokens: list[int]) -> str:
    og, og_model = _og_model()
    return og.Tokenizer(og_model).decode(np.array(tokens, np.int32))


def _spy(monkeypatch, cls, name: str, log: list, describe) -> None:
    """Wrap ``cls.name`` to append ``describe(args, kwargs, result)`` to ``log``."""
    real = getattr(cls, name)

    def wrapper(*args, **kwargs):
        result = real(*args, **kwargs)
        log.append(describe(args, kwargs, result))
        return result

    monkeypatch.setattr(cls, name, wrapper)


@pytest.mark.parametrize("chunk", [1, 4])
def test_a_long_prompt_is_prefilled_a_chunk_per_step_while_a_row_decodes(model, monkeypatch, chunk):
    """With ``prefill_chunk`` a long prompt goes in that many tokens per scheduler step, a
    decode step of the running row after each chunk, and both answers equal
    onnxruntime-genai's."""
    log: list[tuple] = []
    _spy(monkeypatch, BatchGenerator, "add", log, lambda a, k, r: ("add", r, k["chunk"]))
    _spy(monkeypatch, BatchGenerator, "prefill_step", log, lambda a, k, r: ("prefill", a[1], r))
    _spy(monkeypatch, BatchGenerator, "step", log, lambda a, k, r: ("step", sorted(r)))
    short, long = model.tokenizer.encode(SHORT)[:chunk], model.tokenizer.encode(LONG)
    assert len(short) <= chunk and len(long) > 20
    sched = Scheduler(model, max_batch=2, prefill_chunk=chunk)
    running = sched.submit(short, max_new_tokens=40)
    chunked = sched.submit(long, max_new_tokens=6)
    sched.start()  # both are queued: the loop admits them in order
    try:
        first, second = running.result(60), chunked.result(60)
    finally:
        sched.close(timeout=60)
    assert first.token_ids == _og_greedy(short, 40)
    assert second.token_ids == _og_greedy(long, 6)
    assert second.text == _og_text(second.token_ids)
    adds = [entry for entry in log if entry[0] == "add"]
    assert adds == [("add", 0, chunk), ("add", 1, chunk)]
    prefills = [entry for entry in log if entry[0] == "prefill"]
    chunks = math.ceil(len(long) / chunk) - 1  # the first chunk went in with add
    assert prefills[:chunks] == [("prefill", chunk, None)] * (chunks - 1) + [("prefill", chunk, 1)]
    start, end = log.index(adds[1]), log.index(prefills[chunks - 1])
    between = [entry for entry in log[start:end] if entry[0] == "step"]
    assert between == [("step", [0])] * (chunks - 1)  # row 0 decoded between the chunks


def test_first_token_times_and_counters(model, monkeypatch):
    """Each result's time to first token lies between the submission and the end of its
    first event carrying tokens; the metrics hold one such time per request, one decode step
    per token after each first, and every token."""
    emitted: list[tuple[str, float, float, int]] = []
    real_emit = RequestHandle._emit

    def timed_emit(self, text, tokens, *args, **kwargs):
        before = time.perf_counter()
        real_emit(self, text, tokens, *args, **kwargs)
        emitted.append((self.id, before, time.perf_counter(), len(tokens)))

    monkeypatch.setattr(RequestHandle, "_emit", timed_emit)
    requests = [(SHORT, 9), ("def fib(n):", 5)]
    results, handles = [], []
    with Scheduler(model, max_batch=1) as sched:
        for text, new in requests:
            handles.append(sched.submit(text, max_new_tokens=new))
            results.append(handles[-1].result(60))
        metrics = sched.metrics()
    for (text, new), handle, result in zip(requests, handles, results, strict=True):
        ids = model.tokenizer.encode(text)
        assert result.token_ids == _og_greedy(ids, new) and result.finish_reason == "length"
        mine = [e for e in emitted if e[0] == handle.id and e[3]]
        assert len(mine) > 1  # the first token and later ones came in separate events
        _, before, after, _ = mine[0]
        assert before - handle.submitted <= result.time_to_first_token <= after - handle.submitted
    assert len(metrics.time_to_first_token) == len(requests)
    for recorded, result in zip(metrics.time_to_first_token, results, strict=True):
        assert 0 < recorded <= result.time_to_first_token
    assert metrics.tokens_generated == sum(new for _, new in requests)
    assert metrics.decode_steps == sum(new - 1 for _, new in requests)
    assert metrics.requests_finished == len(requests)
    assert metrics.requests_cancelled == metrics.requests_failed == 0
    assert metrics.tokens_per_second > 0


def test_every_token_reaches_the_events_while_a_stop_string_holds_text_back(model):
    """A stop string that begins like the output holds that text back, but the tokens behind
    it still come in events: the events' tokens and text are onnxruntime-genai's."""
    ids = model.tokenizer.encode("def fib(n):")
    reference = _og_greedy(ids, 12)
    text = _og_text(reference)
    stop = _og_text(reference[:1]) + "\x00"  # the first piece is held back, then shown
    with Scheduler(model, max_batch=1) as sched:
        handle = sched.submit(ids, max_new_tokens=12, stop=stop)
        events = list(handle.events(timeout=60))
    assert any(e.token_ids and not e.text for e in events)  # tokens whose text was held
    assert [t for e in events for t in e.token_ids] == reference
    assert "".join(e.text for e in events) == text
    assert handle.result(0).token_ids == reference


def test_a_request_may_fill_the_schedulers_max_length(model):
    """A prompt plus max_new_tokens equal to max_length runs to the end; one more token is
    refused at submit."""
    ids = model.tokenizer.encode("def fib(n):")
    length = len(ids) + 12
    with Scheduler(model, max_batch=1, max_length=length) as sched:
        result = sched.submit(ids, max_new_tokens=12).result(60)
        with pytest.raises(InvalidInputError, match=f"max_length of {length}"):
            sched.submit(ids, max_new_tokens=13)
    assert result.token_ids == _og_greedy(ids, 12) and result.finish_reason == "length"


def test_the_smallest_max_length_runs_a_one_token_prompt(model):
    ids = model.tokenizer.encode("x")[:1]
    with Scheduler(model, max_batch=1, max_length=2) as sched:
        result = sched.submit(ids, max_new_tokens=1).result(60)
    assert result.token_ids == _og_greedy(ids, 1)
    with pytest.raises(InvalidInputError, match="max_length"):
        Scheduler(model, max_length=1)


@pytest.mark.parametrize(
    ("option", "value"), [("max_batch", 0), ("max_queue", -1), ("prefill_chunk", 0)]
)
def test_sizes_out_of_range_are_refused_at_construction(model, option, value):
    with pytest.raises(InvalidInputError, match=option):
        Scheduler(model, **{option: value})


def test_submit_makes_as_many_tokens_as_generate_by_default(model):
    with Scheduler(model, max_batch=1) as sched:
        result = sched.submit(SHORT, ignore_eos=True).result(120)
    assert result.completion_tokens == DEFAULT_MAX_NEW_TOKENS
    alone = generate(model, SHORT, ignore_eos=True)  # generate's own default
    assert result.token_ids == alone.tokens[alone.prompt_tokens :]


def test_free_rows_take_requests_and_max_queue_counts_those_that_wait(model):
    """Requests that will find a free row do not count against max_queue: a scheduler with
    max_queue=0 serves one request per free row and refuses the rest. Cancelled requests,
    queued or running, count once each, and not as finished."""
    sched = Scheduler(model, max_batch=2, max_queue=1)  # not started: nothing leaves the queue
    queued = [sched.submit("x", max_new_tokens=2) for _ in range(3)]  # two rows, one waits
    with pytest.raises(QueueFullError, match=r"1 requests already wait .*max_queue=1"):
        sched.submit("x", max_new_tokens=2)
    sched.close()
    assert [h.result(0).finish_reason for h in queued] == ["cancelled"] * 3
    assert sched.metrics().requests_cancelled == 3

    ids = model.tokenizer.encode(SHORT)
    with Scheduler(model, max_batch=1, max_queue=0) as sched:
        running = sched.submit(ids, max_new_tokens=500, ignore_eos=True)
        next(running.events(timeout=60))  # admitted: the one row is in use
        with pytest.raises(QueueFullError, match="0 requests already wait .*max_queue=0"):
            sched.submit(ids, max_new_tokens=2)
        running.cancel()
        assert running.result(60).finish_reason == "cancelled"
        assert sched.submit(ids, max_new_tokens=3).result(60).token_ids == _og_greedy(ids, 3)
        metrics = sched.metrics()
    assert (metrics.requests_finished, metrics.requests_cancelled) == (1, 1)
    assert metrics.requests_failed == 0


def test_a_model_fault_ends_its_requests_with_an_error_and_the_scheduler_goes_on(
    qwen2_dir, tmp_path
):
    """In a copy of the builder model whose embedding row of one token is NaN: a prompt
    holding that token fails at its prefill (that request alone), a row whose first token is
    that token fails the next decode step (every running row with it). Each ends with
    finish_reason 'error' and the error's class; the failures are counted, and the next
    request is served as onnxruntime-genai serves it."""
    healthy = [5, 17, 99, 3]
    bad_token = _og_greedy(healthy, 1, qwen2_dir)[0]
    folder = nan_token_copy(qwen2_dir, tmp_path / "nan", bad_token)
    model = Model(folder)
    other = next(p for p in ([7, 8, 9], [11, 12], [21, 22, 23]) if bad_token not in p)

    sched = Scheduler(model, max_batch=2)
    at_prefill = sched.submit([5, bad_token, 7], max_new_tokens=4)
    running = sched.submit(other, max_new_tokens=40, ignore_eos=True)
    at_step = sched.submit(healthy, max_new_tokens=4)
    sched.start()  # the first fails at admission, the other two share the failing step
    try:
        results = [h.result(60) for h in (at_prefill, running, at_step)]
        after = sched.submit(other, max_new_tokens=6).result(60)
        metrics = sched.metrics()
    finally:
        sched.close(timeout=60)
    for result in results:
        assert result.finish_reason == "error" and result.error.startswith("NonFiniteError")
    assert results[2].token_ids == [bad_token]  # its first token, then the failed step
    assert metrics.requests_failed == 3 and metrics.running_rows == 0
    assert after.finish_reason == "length" and after.error is None
    assert after.token_ids == _og_greedy(other, 6, folder)


def test_any_fault_at_admission_ends_that_request_alone(model, monkeypatch):
    """An exception outside the project's hierarchy while a prompt is prefilled ends that
    request with 'error' (its consumer is not left waiting); the row already running and
    the next request are served."""
    real_add = BatchGenerator.add

    def add(self, prompt, *args, **kwargs):
        if list(prompt) == [1, 2, 3]:
            raise RuntimeError("prefill exploded")
        return real_add(self, prompt, *args, **kwargs)

    monkeypatch.setattr(BatchGenerator, "add", add)
    ids = model.tokenizer.encode(SHORT)
    sched = Scheduler(model, max_batch=2)
    running = sched.submit(ids, max_new_tokens=12)
    failing = sched.submit([1, 2, 3], max_new_tokens=4)
    sched.start()  # both are queued: the first is running when the second fails
    try:
        failed, first = failing.result(30), running.result(30)
        served = sched.submit(ids, max_new_tokens=4).result(30)
        metrics = sched.metrics()
    finally:
        sched.close(timeout=30)
    assert failed.finish_reason == "error" and failed.error == "RuntimeError: prefill exploded"
    assert first.finish_reason == "length" and first.token_ids == _og_greedy(ids, 12)
    assert served.token_ids == _og_greedy(ids, 4)
    assert (metrics.requests_failed, metrics.requests_finished) == (1, 2)
