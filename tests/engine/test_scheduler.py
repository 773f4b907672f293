"""The continuous-batching scheduler: answers equal requests served alone, rows free at once."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from onnx_genrt.core.errors import InvalidInputError
from onnx_genrt.engine import Model, generate
from onnx_genrt.engine.scheduler import QueueFullError, Scheduler, SchedulerClosedError
from onnx_genrt.generate_cli import default_model_dir

TEXTS = ["    def __init__(self", "import os\n", "class Foo:", "def fib(n):", "x = [", "return"]


@pytest.fixture(scope="module")
def model() -> Model:
    return Model(default_model_dir())


def _wait(condition, seconds: float = 30.0) -> None:
    end = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > end:
            raise AssertionError("condition not reached in time")
        time.sleep(0.005)


def test_many_requests_equal_each_served_alone(model):
    """24 requests from 6 threads through 4 rows: every greedy text equals generate() of
    that prompt alone, with its stop reason, and the decode steps replay bucket graphs."""
    alone = {t: generate(model, t, 24) for t in TEXTS}
    results: dict[int, tuple[str, object]] = {}
    with Scheduler(model, max_batch=4) as sched:

        def client(k: int) -> None:
            for j in range(4):
                text = TEXTS[(k + j) % len(TEXTS)]
                results[k * 4 + j] = (text, sched.submit(text, max_new_tokens=24).result(60))

        threads = [threading.Thread(target=client, args=(k,)) for k in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        metrics = sched.metrics()
    assert len(results) == 24
    for text, result in results.values():
        ref = alone[text]
        assert result.text == ref.text, text
        assert result.token_ids == ref.tokens[ref.prompt_tokens :]
        assert result.finish_reason == ("stop" if ref.stop_reason == "eos" else "length")
        assert result.prompt_tokens == ref.prompt_tokens
    assert metrics.requests_finished == 24 and metrics.running_rows == 0
    assert metrics.tokens_generated == sum(r.completion_tokens for _, r in results.values())
    primary = metrics.graph_stats["primary"]
    assert primary["fallbacks"] == 0 and primary["invalidations"] == 0
    assert primary["replays"] > metrics.decode_steps // 2


def test_stop_strings_and_events(model):
    """Events carry the text piece by piece; a stop string ends the request with
    finish_reason 'stop' and is not in the text (as generate() cuts it)."""
    full = generate(model, "def fib(n):", 40).text
    assert "return" in full  # the stop string occurs, after some text
    expected = full[: full.index("return")]
    with Scheduler(model, max_batch=2) as sched:
        handle = sched.submit("def fib(n):", max_new_tokens=40, stop=["return", "zzz"])
        events = list(handle.events(timeout=30))
    assert "".join(e.text for e in events) == expected
    assert events[-1].finish_reason == "stop"
    assert all(e.finish_reason is None for e in events[:-1])
    assert handle.result().text == expected


def test_asyncio_stream(model):
    ref = generate(model, "class Foo:", 16)

    async def consume() -> str:
        with Scheduler(model, max_batch=2) as sched:
            handle = sched.submit("class Foo:", max_new_tokens=16)
            return "".join([e.text async for e in handle.stream()])

    assert asyncio.run(consume()) == ref.text


def test_cancel_frees_the_row(model):
    """A cancelled request ends with 'cancelled' at the next step and its row takes the
    next queued request."""
    with Scheduler(model, max_batch=1) as sched:
        long = sched.submit("import os\n", max_new_tokens=200, ignore_eos=True)
        queued = sched.submit("x = [", max_new_tokens=8)
        next(long.events(timeout=30))
        long.cancel()
        assert long.result(30).finish_reason == "cancelled"
        assert queued.result(30).text == generate(model, "x = [", 8).text
        _wait(lambda: sched.metrics().running_rows == 0)
        assert sched.metrics().requests_cancelled == 1


def test_queue_full_and_closed(model):
    sched = Scheduler(model, max_batch=1, max_queue=1)  # not started: nothing leaves the queue
    first = sched.submit("x", max_new_tokens=4)  # will take the free row
    second = sched.submit("x", max_new_tokens=4)  # waits for it
    with pytest.raises(QueueFullError, match="max_queue=1"):
        sched.submit("x", max_new_tokens=4)
    sched.close()
    assert first.result(5).finish_reason == second.result(5).finish_reason == "cancelled"
    with pytest.raises(SchedulerClosedError):
        sched.submit("x", max_new_tokens=4)


def test_close_finishes_or_cancels(model):
    with Scheduler(model, max_batch=1) as sched:
        running = sched.submit("import os\n", max_new_tokens=30, ignore_eos=True)
        next(running.events(timeout=30))
    assert running.result(0).finish_reason == "length"  # close() let it finish
    sched = Scheduler(model, max_batch=1).start()
    running = sched.submit("import os\n", max_new_tokens=200, ignore_eos=True)
    queued = sched.submit("x", max_new_tokens=4)
    next(running.events(timeout=30))
    sched.close(cancel=True, timeout=30)
    assert running.result(0).finish_reason == "cancelled"
    assert queued.result(0).finish_reason == "cancelled"


def test_bad_requests_are_refused_at_submit(model):
    with Scheduler(model, max_batch=1) as sched:
        with pytest.raises(InvalidInputError, match="max_new_tokens"):
            sched.submit("x", max_new_tokens=0)
        with pytest.raises(InvalidInputError, match="temperature"):
            sched.submit("x", do_sample=True, temperature=float("nan"))
        with pytest.raises(InvalidInputError, match="unknown search options"):
            sched.submit("x", beams=2)
        with pytest.raises(InvalidInputError, match="exceeds the scheduler's max_length"):
            sched.submit("x", max_new_tokens=10**6)
        assert sched.metrics().queue_depth == 0
