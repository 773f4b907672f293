"""A request's events read from asyncio: what was ready comes together, and the scheduler
wakes an event loop once per step for all of its waiting consumers."""

from __future__ import annotations

import asyncio

import pytest

from onnx_genrt.engine import Model, generate
from onnx_genrt.engine.scheduler import RequestHandle, Scheduler
from onnx_genrt.generate_cli import default_model_dir

PROMPTS = ("import os", "class Foo:", "def fib(n):", "x = [")


@pytest.fixture(scope="module")
def model() -> Model:
    return Model(default_model_dir())


def test_events_ready_together_come_in_one_batch(model):
    """A consumer that comes after the request finished gets every event in one list: the
    whole text, token by token, ending with the finish reason."""
    reference = generate(model, "import os", 24)
    with Scheduler(model, max_batch=2) as sched:
        handle = sched.submit("import os", max_new_tokens=24)
        result = handle.result(60)

        async def consume() -> list[list]:
            return [batch async for batch in handle.stream_batches()]

        batches = asyncio.run(consume())
    assert len(batches) == 1
    events = batches[0]
    assert "".join(e.text for e in events) == reference.text == result.text
    assert [t for e in events for t in e.token_ids] == reference.tokens[reference.prompt_tokens :]
    assert len(events) > 2  # one event per step, not one for the whole answer
    assert events[-1].finish_reason == "length"
    assert all(e.finish_reason is None for e in events[:-1])


class CountingLoop(asyncio.SelectorEventLoop):
    """An event loop that counts the callbacks other threads hand it."""

    threadsafe_calls = 0

    def call_soon_threadsafe(self, callback, *args, context=None):
        self.threadsafe_calls += 1
        return super().call_soon_threadsafe(callback, *args, context=context)


def test_one_wake_up_per_step_for_all_consumers_of_a_loop(model):
    """Four requests read by four consumers on one loop: each text equals the prompt
    generated alone, and the scheduler wakes the loop at most once per step (a decode step,
    or an admission), not once per token of each consumer."""
    tokens = 40
    references = [generate(model, p, tokens).text for p in PROMPTS]
    loop = CountingLoop()
    try:
        with Scheduler(model, max_batch=len(PROMPTS)) as sched:

            async def read(handle: RequestHandle) -> tuple[str, int]:
                texts, events = [], 0
                async for batch in handle.stream_batches():
                    texts += [e.text for e in batch]
                    events += len(batch)
                return "".join(texts), events

            async def main() -> list[tuple[str, int]]:
                handles = [sched.submit(p, max_new_tokens=tokens) for p in PROMPTS]
                return await asyncio.gather(*(read(h) for h in handles))

            answers = loop.run_until_complete(main())
            metrics = sched.metrics()
    finally:
        loop.close()
    assert [text for text, _ in answers] == references
    events = sum(count for _, count in answers)
    steps = metrics.decode_steps + len(PROMPTS)  # each admission hands out a first token
    assert events > 2 * steps  # the four requests shared their steps
    assert 0 < loop.threadsafe_calls <= steps


def test_an_event_for_a_consumer_whose_loop_closed_is_kept(model):
    """A consumer waits (its loop's waker armed), then its loop closes without it: the
    scheduler's next event neither raises in the scheduler's thread nor is lost."""
    handle = RequestHandle("req-test", prompt_tokens=1, submitted=0.0)
    loop = asyncio.new_event_loop()
    reading = loop.create_task(_first_batch(handle))
    loop.run_until_complete(asyncio.sleep(0.01))  # the consumer now waits for an event
    assert not reading.done()
    loop.close()  # without cancelling the consumer
    handle._emit("abc", (7,), "length")  # what the scheduler's thread does
    assert [(e.text, e.finish_reason) for e in handle.events(timeout=1)] == [("abc", "length")]
    assert handle.result(timeout=1).text == "abc"


async def _first_batch(handle: RequestHandle) -> list:
    async for batch in handle.stream_batches():
        return batch
    return []
