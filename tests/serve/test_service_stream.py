"""The server's streamed answer in-process (no HTTP): the SSE text of the pieces ready
together goes out as one write, and each event is a chunk the ``openai`` package accepts;
the warm-up prefills prompts of several lengths before the first client."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletionChunk

from onnx_genrt.engine import Model, generate
from onnx_genrt.models import default_model_path
from onnx_genrt.serve.protocol import TextChunks, chunk_body, parse_request, sse
from onnx_genrt.serve.service import WARMUP_PROMPT_LENGTHS, Service

from .conftest import MODEL_NAME


@pytest.fixture(scope="module")
def model() -> Model:
    return Model(default_model_path())


def _service(model: Model, *, warmup: bool = False, max_length: int | None = None) -> Service:
    return Service(
        model,
        model_name=MODEL_NAME,
        max_batch=2,
        max_queue=4,
        max_length=max_length,
        grace_period=5,
        warmup=warmup,
    )


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("include_usage", [False, True])
def test_text_chunks_equal_the_chunk_bodies(chat, include_usage):
    body = {"model": MODEL_NAME, "stream": True, "stream_options": {"include_usage": include_usage}}
    body |= {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "x"}
    request = parse_request(body, chat=chat)
    chunks = TextChunks(request, "cmpl-1", 1700000000)
    for text in ("", "a", ' "quoted" \\ back\nslash\t', "é中🙂", "\x00\x1f", "data: x\n\n"):
        assert chunks.event(text) == sse(chunk_body(request, "cmpl-1", 1700000000, text=text)), text


def _collect(service: Service, request, handles) -> list[str]:
    async def run() -> list[str]:
        return [piece async for piece in service.events(request, handles, time.perf_counter())]

    return asyncio.run(run())


def _events(write: str) -> list[str]:
    assert write.endswith("\n\n")
    events = write[:-2].split("\n\n")
    assert all(e.startswith("data: ") for e in events)
    return [e[len("data: ") :] for e in events]


@pytest.mark.parametrize("chat", [False, True])
def test_pieces_ready_together_go_out_in_one_write(model, chat):
    """A request read after it finished: its text events, the finish chunk, the usage chunk
    and ``[DONE]`` come in one string (chat: after the role chunk, sent first), one valid
    OpenAI chunk per text piece, together the text generated alone."""
    service = _service(model)
    service.start()
    try:
        body = {"model": MODEL_NAME, "max_tokens": 20, "temperature": 0, "stream": True}
        body["stream_options"] = {"include_usage": True}
        if chat:
            messages = [{"role": "user", "content": "import sys"}]
            body["messages"] = messages
            prompt = model.tokenizer.apply_chat_template(messages)
        else:
            body["prompt"] = prompt = "import os"
        request = parse_request(body, chat=chat)
        handles = service.submit(request)
        result = handles[0].result(60)
        writes = _collect(service, request, handles)
    finally:
        service.drain(0)
    assert len(writes) == (2 if chat else 1)
    *chunks, done = _events(writes[-1])
    assert done == "[DONE]"
    parsed = [json.loads(c) for c in chunks]
    *texts, finish, usage = parsed
    # openai's Completion type wants a finish reason; mid-stream chunks have none (null).
    checked = parsed if chat else [finish, usage]
    for chunk in checked:
        (ChatCompletionChunk if chat else Completion).model_validate(chunk)
    if chat:
        role = json.loads(_events(writes[0])[0])
        ChatCompletionChunk.model_validate(role)
        assert role["choices"][0]["delta"]["role"] == "assistant"
        pieces = [c["choices"][0]["delta"]["content"] for c in texts]
    else:
        pieces = [c["choices"][0]["text"] for c in texts]
    assert "".join(pieces) == generate(model, prompt, 20).text == result.text
    assert len(pieces) > 2 and all(pieces)  # a chunk per piece, none empty
    assert {c["choices"][0]["finish_reason"] for c in texts} == {None}
    assert finish["choices"][0]["finish_reason"] == "length"
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 20


def test_a_live_stream_ends_with_done_and_the_whole_text(model):
    """Read while it is generated (batches of any size): the same text, ending [DONE]."""
    service = _service(model)
    service.start()
    try:
        body = {"model": MODEL_NAME, "prompt": "class Foo:", "max_tokens": 30, "temperature": 0}
        request = parse_request({**body, "stream": True}, chat=False)
        writes = _collect(service, request, service.submit(request))
    finally:
        service.drain(0)
    events = [e for w in writes for e in _events(w)]
    assert events[-1] == "[DONE]"
    texts = [json.loads(e)["choices"][0]["text"] for e in events[:-1]]
    assert "".join(texts) == generate(model, "class Foo:", 30).text


@pytest.mark.parametrize(("max_length", "expected"), [(None, WARMUP_PROMPT_LENGTHS), (12, (1, 8))])
def test_warmup_prefills_each_prompt_length_that_fits(model, monkeypatch, max_length, expected):
    """The warm-up runs a prompt of each length in WARMUP_PROMPT_LENGTHS (1, a few, more
    than 16: other kernels each) before the server admits clients, those that fit."""
    service = _service(model, warmup=True, max_length=max_length)
    lengths: list[int] = []
    submit = service.scheduler.submit

    def recording_submit(prompt, **kwargs):
        lengths.append(len(prompt))
        return submit(prompt, **kwargs)

    monkeypatch.setattr(service.scheduler, "submit", recording_submit)
    service.start()
    try:
        metrics = service.scheduler.metrics()
    finally:
        service.drain(0)
    assert WARMUP_PROMPT_LENGTHS[0] == 1 and max(WARMUP_PROMPT_LENGTHS) > 16
    assert tuple(lengths) == expected
    assert metrics.requests_finished == len(expected)
    assert metrics.tokens_generated == 2 * len(expected)
