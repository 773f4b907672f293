"""One model served: its scheduler, the server's counters and draining state, and the
answers of one request, whole or as server-sent events."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from onnx_genrt.core.errors import InvalidInputError, ModelLoadError
from onnx_genrt.engine.decoder import PREFILL_WIDTHS
from onnx_genrt.engine.logprobs import TokenLogprob
from onnx_genrt.engine.model import Model
from onnx_genrt.engine.scheduler import (
    QueueFullError,
    RequestHandle,
    Scheduler,
    SchedulerClosedError,
    TokenEvent,
)
from onnx_genrt.engine.stops import prompt_ids

from . import metrics as prom
from .protocol import (
    APIError,
    GenerationRequest,
    TextChunks,
    bad_field,
    chunk_body,
    completion_body,
    echoed_logprobs_body,
    logprobs_body,
    new_id,
    now,
    sse,
    usage,
)

#: Prompt lengths of the warm-up requests: one token, then each width graphed prompt chunks
#: are padded to on a GPU (row 0's graphs). On the CPU, 2-16 tokens and more than 16 take
#: other kernels: their Numba compile cost a cold server's first client 1.9 s (a 2-token
#: prompt) and 0.9 s (17 tokens) before the warm-up covered them (docs/performance.md).
WARMUP_PROMPT_LENGTHS = (1, *PREFILL_WIDTHS)


class Service:
    """One model, its scheduler, the server's counters and its draining state."""

    def __init__(
        self,
        model: Model,
        *,
        model_name: str,
        max_batch: int,
        max_queue: int,
        max_length: int | None,
        grace_period: float,
        warmup: bool,
        spec: str | None = None,
        k: int | None = None,
        device_sampling: bool | None = None,
    ) -> None:
        self.model = model
        self.model_name = model_name
        self.scheduler = Scheduler(
            model,
            max_batch=max_batch,
            max_queue=max_queue,
            max_length=max_length,
            spec=spec,
            k=k,
            device_sampling=device_sampling,
        )
        self.counters = prom.ServerCounters()
        self.grace_period = grace_period
        self.warmup = warmup
        self.created = now()
        self._draining = threading.Event()
        self._drained = threading.Event()
        self._drain_lock = threading.Lock()

    @property
    def token_text(self) -> Callable[[int], str]:
        """A token id's text (``Tokenizer.token_text``): each log-probability entry's."""
        return self.model.tokenizer.token_text

    # -- life cycle ---------------------------------------------------------------
    def start(self) -> None:
        """Start the scheduler; with ``warmup``, run a short request per prompt length of
        ``WARMUP_PROMPT_LENGTHS`` (that fits ``max_length``), one after another, so that the
        first clients do not pay for compiling kernels and capturing the first graphs."""
        self.scheduler.start()
        if self.warmup:
            bos = self.model.config.bos_token_id or 0
            for length in WARMUP_PROMPT_LENGTHS:
                if length + 2 > self.scheduler.max_length:
                    break
                handle = self.scheduler.submit([bos] * length, max_new_tokens=2, ignore_eos=True)
                handle.result(timeout=600)

    @property
    def draining(self) -> bool:
        return self._draining.is_set()

    def drain(self, grace_period: float | None = None) -> None:
        """Stop admitting (new requests get 503), give running and queued requests
        ``grace_period`` seconds to finish, then cancel the rest. Blocking; idempotent."""
        self._draining.set()
        with self._drain_lock:
            if self._drained.is_set():
                return
            grace = self.grace_period if grace_period is None else grace_period
            self.scheduler.close(cancel=False, timeout=grace)
            left = self.scheduler.metrics()
            if left.running_rows or left.queue_depth:
                self.scheduler.close(cancel=True, timeout=60)
            self._drained.set()

    # -- requests -----------------------------------------------------------------
    def submit(self, request: GenerationRequest) -> list[RequestHandle]:
        """Tokenize the request, check it fits the context, and queue its ``n`` answers
        (one handle each; none stays queued when one cannot be)."""
        if self.draining:
            raise APIError(
                503,
                "the server is shutting down and admits no new requests; retry on another replica",
                type="service_unavailable_error",
                code="shutting_down",
            )
        if request.model != self.model_name:
            raise APIError(
                404,
                f"model {request.model!r} is not served here; this server serves "
                f"{self.model_name!r} (see /v1/models)",
                param="model",
                code="model_not_found",
            )
        param = "messages" if request.chat else "prompt"
        try:
            if request.chat:
                text = self.model.tokenizer.apply_chat_template(request.messages or [])
                ids = prompt_ids(self.model, text)
            else:
                assert request.prompt is not None
                ids = prompt_ids(self.model, request.prompt)
        except InvalidInputError as exc:
            raise bad_field(param, str(exc)) from None
        except ModelLoadError as exc:
            raise APIError(500, str(exc), type="server_error", code="model_error") from None
        if request.logprobs is not None:
            try:
                self.token_text  # noqa: B018 (the tokenizer names the tokens)
            except ModelLoadError as exc:
                raise bad_field("logprobs", f"needs the model's tokenizer: {exc}") from None
        vocab = self.model.config.vocab_size
        outside = [token for token, _ in request.logit_bias if token >= vocab]
        if outside:
            raise bad_field(
                "logit_bias", f"token ids {outside[:5]} are outside the vocabulary of {vocab}"
            )
        room = self.scheduler.max_length - len(ids)
        if room < 1 or (request.max_tokens is not None and request.max_tokens > room):
            raise APIError(
                400,
                f"the prompt has {len(ids)} tokens and max_tokens is {request.max_tokens}; "
                f"together they must fit the context of {self.scheduler.max_length} tokens",
                param=param if room < 1 else "max_tokens",
                code="context_length_exceeded",
            )
        # max_tokens 0 (echo): one token is generated, and left out of the answer
        new_tokens = room if request.max_tokens is None else max(1, request.max_tokens)
        handles: list[RequestHandle] = []
        queued: list[RequestHandle] | None = None
        try:
            for index in range(request.n):
                handles.append(
                    self.scheduler.submit(
                        ids,
                        max_new_tokens=new_tokens,
                        stop=request.stop,
                        logprobs=request.logprobs,
                        prompt_logprobs=request.echo and request.logprobs is not None,
                        **request.search_options(index),
                    )
                )
            queued = handles
            return handles
        except QueueFullError as exc:
            raise APIError(429, str(exc), type="rate_limit_error", code="queue_full") from None
        except SchedulerClosedError as exc:
            raise APIError(
                503, str(exc), type="service_unavailable_error", code="shutting_down"
            ) from None
        except InvalidInputError as exc:
            raise APIError(400, str(exc)) from None
        finally:
            if queued is not handles:  # refused part-way: no answer of it stays queued
                for handle in handles:
                    handle.cancel()

    def _echo(self, request: GenerationRequest) -> tuple[str, int] | None:
        """For a completion with ``echo``: the prompt's text and first token id; else None."""
        if not request.echo:
            return None
        assert request.prompt is not None
        ids = prompt_ids(self.model, request.prompt)
        if isinstance(request.prompt, str):
            return request.prompt, ids[0]
        return self.model.tokenizer.decode(ids), ids[0]

    def _choice_logprobs(
        self,
        request: GenerationRequest,
        echo: tuple[str, int] | None,
        prompt: Sequence[TokenLogprob],
        answer: Sequence[TokenLogprob],
        offset: int = 0,
    ) -> dict[str, Any]:
        """A choice's ``logprobs`` for ``answer`` (text offsets from ``offset``), after the
        echoed prompt's (``echo``: its text and first token, ``prompt``: the rest's)."""
        if echo is None:
            return logprobs_body(request, answer, self.token_text, offset)
        return echoed_logprobs_body(request, echo[1], prompt, answer, self.token_text)

    async def whole(
        self,
        request: GenerationRequest,
        handles: list[RequestHandle],
        http: Request,
        arrival: float,
    ) -> Response:
        """Wait for every answer; a client that disconnects meanwhile cancels them."""
        watcher = asyncio.create_task(_cancel_on_disconnect(http, handles))
        timed = [False]  # time to first token: of the request's first answer to have one

        async def collect(
            handle: RequestHandle,
        ) -> tuple[str, int, str, list[TokenLogprob], list[TokenLogprob]]:
            pieces: list[str] = []
            tokens = 0
            reason = "cancelled"
            logprobs: list[TokenLogprob] = []
            prompt: list[TokenLogprob] = []
            try:
                async for batch in handle.stream_batches():
                    if request.max_tokens == 0:
                        batch = _unanswered(batch)
                    if not timed[0] and any(event.token_ids for event in batch):
                        timed[0] = True
                        self.counters.first_token(time.perf_counter() - arrival)
                    tokens += sum(len(event.token_ids) for event in batch)
                    pieces += [event.text for event in batch]
                    logprobs += [entry for event in batch for entry in event.logprobs]
                    prompt += [entry for event in batch for entry in event.prompt_logprobs]
                    if batch[-1].finish_reason is not None:
                        reason = batch[-1].finish_reason
            finally:
                if reason == "cancelled":
                    handle.cancel()
                self.counters.request_finished(reason)
            return "".join(pieces), tokens, reason, logprobs, prompt

        try:
            answers = await asyncio.gather(*(collect(handle) for handle in handles))
        finally:
            watcher.cancel()
        for handle, (_, _, reason, _, _) in zip(handles, answers, strict=True):
            if reason not in ("stop", "length"):
                return error_response(_ended_early(handle, reason))
        echo = self._echo(request)
        head = "" if echo is None else echo[0]
        logprobs = []
        if request.logprobs is not None:
            logprobs = [self._choice_logprobs(request, echo, p, e) for *_, e, p in answers]
        body = completion_body(
            request,
            new_id(request.chat),
            now(),
            [(head + text, reason) for text, _, reason, _, _ in answers],
            handles[0].prompt_tokens,
            sum(tokens for _, tokens, *_ in answers),
            logprobs,
        )
        return JSONResponse(body)

    async def events(
        self, request: GenerationRequest, handles: list[RequestHandle], arrival: float
    ) -> AsyncIterator[str]:
        """The answers as server-sent events in OpenAI's chunk format, ending ``[DONE]``: one
        event per text piece (its choice's index), the events of the pieces ready together
        in one string (one write). If the client goes away, the generator is closed and the
        answers cancelled; an answer that fails ends the stream with its error."""
        rid, created = new_id(request.chat), now()
        text_events = [TextChunks(request, rid, created, i).event for i in range(len(handles))]
        echo = self._echo(request)
        first = [echo is not None] * len(handles)  # answers whose prompt is still to echo
        offsets = [0] * len(handles)  # characters of each answer's tokens so far

        def piece(index: int, event: TokenEvent) -> str:
            """The event's chunk: its text (after the echoed prompt, on an answer's first)
            and its tokens' log-probabilities (the prompt's too, echoed)."""
            if request.logprobs is None and not first[index]:
                return text_events[index](event.text)
            text, probs, echoed = event.text, None, first[index]
            first[index] = False
            if echoed:
                assert echo is not None
                text = echo[0] + text
            if request.logprobs is not None:
                probs = self._choice_logprobs(
                    request, echo if echoed else None, event.prompt_logprobs, event.logprobs,
                    offsets[index],
                )  # fmt: skip
                if not request.chat and probs["tokens"]:  # where the next chunk's text starts
                    offsets[index] = probs["text_offset"][-1] + len(probs["tokens"][-1])
            return sse(chunk_body(request, rid, created, text=text, index=index, logprobs=probs))

        running = set(range(len(handles)))
        tokens = 0
        try:
            if request.chat:
                yield "".join(
                    sse(chunk_body(request, rid, created, text="", role=True, index=i))
                    for i in running
                )
            async for index, batch in _merged(handles):
                if request.max_tokens == 0:
                    batch = _unanswered(batch)
                if tokens == 0 and any(event.token_ids for event in batch):
                    self.counters.first_token(time.perf_counter() - arrival)
                out = [piece(index, e) for e in batch if e.text or e.logprobs or first[index]]
                tokens += sum(len(event.token_ids) for event in batch)
                reason = batch[-1].finish_reason
                if reason is not None:
                    running.discard(index)
                    self.counters.request_finished(reason)
                    if reason not in ("stop", "length"):
                        out.append(sse(_ended_early(handles[index], reason).body()))
                        out.append("data: [DONE]\n\n")
                        yield "".join(out)
                        return  # the other answers are cancelled below
                    out.append(
                        sse(chunk_body(request, rid, created, finish_reason=reason, index=index))
                    )
                    if not running:
                        if request.include_usage:
                            counts = usage(handles[0].prompt_tokens, tokens)
                            out.append(sse(chunk_body(request, rid, created, usage_counts=counts)))
                        out.append("data: [DONE]\n\n")
                if out:
                    yield "".join(out)
        finally:
            for index in running:  # the client disconnected, or another answer failed
                handles[index].cancel()
                self.counters.request_finished("cancelled")


async def _merged(
    handles: list[RequestHandle],
) -> AsyncIterator[tuple[int, list[TokenEvent]]]:
    """(answer index, events) of every handle as they come: one handle is read directly,
    several through a queue their readers fill."""
    if len(handles) == 1:
        async for batch in handles[0].stream_batches():
            yield 0, batch
        return
    queue: asyncio.Queue[tuple[int, list[TokenEvent] | BaseException | None]] = asyncio.Queue()

    async def read(index: int, handle: RequestHandle) -> None:
        try:
            async for batch in handle.stream_batches():
                queue.put_nowait((index, batch))
        except Exception as exc:  # handed to the consumer, raised there
            queue.put_nowait((index, exc))
            return
        queue.put_nowait((index, None))

    readers = [asyncio.create_task(read(i, h)) for i, h in enumerate(handles)]
    try:
        left = len(readers)
        while left:
            index, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for reader in readers:
            reader.cancel()


def _unanswered(batch: list[TokenEvent]) -> list[TokenEvent]:
    """Events of a request with ``max_tokens`` 0 (``echo``): without the token generated,
    which the answer leaves out (its prompt's log-probabilities stay)."""
    return [replace(event, text="", token_ids=(), logprobs=()) for event in batch]


def _ended_early(handle: RequestHandle, reason: str) -> APIError:
    if reason == "error":
        result = handle.result(timeout=5)  # set just before the last event is delivered
        return APIError(
            500,
            f"generation failed: {result.error}",
            type="server_error",
            code="generation_failed",
        )
    return APIError(
        503,
        "the request was cancelled: the server is shutting down",
        type="service_unavailable_error",
        code="shutting_down",
    )


async def _cancel_on_disconnect(http: Request, handles: list[RequestHandle]) -> None:
    while True:
        message = await http.receive()
        if message["type"] == "http.disconnect":
            for handle in handles:
                handle.cancel()
            return


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)
