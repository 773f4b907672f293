"""The OpenAI-compatible ASGI app: five endpoints over one model and its scheduler.

``create_app`` loads the model and returns a Starlette app; its lifespan starts the
scheduler (and warms it up) and, at shutdown, drains it: requests that run get
``grace_period`` seconds to finish, then the rest are cancelled. Any ASGI server can host
the app; ``onnx-genrt serve`` runs it under uvicorn and drains on SIGTERM first, answering
503 to new requests meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from onnx_genrt.core.errors import InvalidInputError, ModelLoadError
from onnx_genrt.engine.model import Model
from onnx_genrt.engine.scheduler import (
    FINISH_REASONS,
    QueueFullError,
    RequestHandle,
    Scheduler,
    SchedulerClosedError,
)
from onnx_genrt.engine.stops import prompt_ids

from . import DEFAULT_GRACE_PERIOD
from . import metrics as prom
from .protocol import (
    APIError,
    GenerationRequest,
    bad_field,
    chunk_body,
    completion_body,
    new_id,
    now,
    parse_request,
    usage,
)


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
    ) -> None:
        self.model = model
        self.model_name = model_name
        self.scheduler = Scheduler(
            model, max_batch=max_batch, max_queue=max_queue, max_length=max_length
        )
        self.counters = prom.ServerCounters()
        self.grace_period = grace_period
        self.warmup = warmup
        self.created = now()
        self._draining = threading.Event()
        self._drained = threading.Event()
        self._drain_lock = threading.Lock()

    # -- life cycle ---------------------------------------------------------------
    def start(self) -> None:
        """Start the scheduler; with ``warmup``, run one short request so that the first
        client does not pay for loading kernels and capturing the first graph."""
        self.scheduler.start()
        if self.warmup:
            bos = self.model.config.bos_token_id or 0
            self.scheduler.submit([bos], max_new_tokens=2, ignore_eos=True).result(timeout=600)

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
    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Tokenize the request, check it fits the context, and queue it."""
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
        room = self.scheduler.max_length - len(ids)
        if room < 1 or (request.max_tokens is not None and request.max_tokens > room):
            raise APIError(
                400,
                f"the prompt has {len(ids)} tokens and max_tokens is {request.max_tokens}; "
                f"together they must fit the context of {self.scheduler.max_length} tokens",
                param=param if room < 1 else "max_tokens",
                code="context_length_exceeded",
            )
        try:
            return self.scheduler.submit(
                ids,
                max_new_tokens=request.max_tokens or room,
                stop=request.stop,
                **request.search_options(),
            )
        except QueueFullError as exc:
            raise APIError(429, str(exc), type="rate_limit_error", code="queue_full") from None
        except SchedulerClosedError as exc:
            raise APIError(
                503, str(exc), type="service_unavailable_error", code="shutting_down"
            ) from None
        except InvalidInputError as exc:
            raise APIError(400, str(exc)) from None

    async def whole(
        self, request: GenerationRequest, handle: RequestHandle, http: Request, arrival: float
    ) -> Response:
        """Wait for the whole answer; a client that disconnects meanwhile cancels it."""
        watcher = asyncio.create_task(_cancel_on_disconnect(http, handle))
        pieces: list[str] = []
        tokens = 0
        reason = "cancelled"
        try:
            async for event in handle.stream():
                if event.token_ids and tokens == 0:
                    self.counters.first_token(time.perf_counter() - arrival)
                tokens += len(event.token_ids)
                pieces.append(event.text)
                if event.finish_reason is not None:
                    reason = event.finish_reason
        finally:
            watcher.cancel()
            if reason == "cancelled":
                handle.cancel()
            self.counters.request_finished(reason)
        if reason in ("stop", "length"):
            body = completion_body(
                request,
                new_id(request.chat),
                now(),
                "".join(pieces),
                reason,
                handle.prompt_tokens,
                tokens,
            )
            return JSONResponse(body)
        return error_response(_ended_early(handle, reason))

    async def events(
        self, request: GenerationRequest, handle: RequestHandle, arrival: float
    ) -> AsyncIterator[str]:
        """The answer as server-sent events in OpenAI's chunk format, ending ``[DONE]``.
        If the client goes away, the generator is closed and the request cancelled."""
        rid, created = new_id(request.chat), now()
        finished = False
        tokens = 0
        try:
            if request.chat:
                yield _sse(chunk_body(request, rid, created, text="", role=True))
            async for event in handle.stream():
                if event.token_ids and tokens == 0:
                    self.counters.first_token(time.perf_counter() - arrival)
                tokens += len(event.token_ids)
                reason = event.finish_reason
                if event.text:
                    yield _sse(chunk_body(request, rid, created, text=event.text))
                if reason is None:
                    continue
                finished = True
                self.counters.request_finished(reason)
                if reason in ("stop", "length"):
                    yield _sse(chunk_body(request, rid, created, finish_reason=reason))
                    if request.include_usage:
                        counts = usage(handle.prompt_tokens, tokens)
                        yield _sse(chunk_body(request, rid, created, usage_counts=counts))
                else:
                    yield _sse(_ended_early(handle, reason).body())
            yield "data: [DONE]\n\n"
        finally:
            if not finished:  # the client disconnected (or the server is forced down)
                handle.cancel()
                self.counters.request_finished("cancelled")


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


async def _cancel_on_disconnect(http: Request, handle: RequestHandle) -> None:
    while True:
        message = await http.receive()
        if message["type"] == "http.disconnect":
            handle.cancel()
            return


def _sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


# -- endpoints ------------------------------------------------------------------------
def _service(http: Request) -> Service:
    return http.app.state.service


async def _generate(http: Request, *, chat: bool) -> Response:
    service = _service(http)
    arrival = time.perf_counter()
    try:
        try:
            body = await http.json()
        except (ValueError, UnicodeDecodeError):
            raise APIError(400, "the request body is not valid JSON", code="invalid_json") from None
        request = parse_request(body, chat=chat)
        handle = service.submit(request)
    except APIError as error:
        reason = {429: "queue_full", 503: "draining"}.get(error.status, "invalid")
        service.counters.request_rejected(reason)
        return error_response(error)
    if request.stream:
        return StreamingResponse(
            service.events(request, handle, arrival),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    return await service.whole(request, handle, http, arrival)


async def completions(http: Request) -> Response:
    return await _generate(http, chat=False)


async def chat_completions(http: Request) -> Response:
    return await _generate(http, chat=True)


async def models(http: Request) -> Response:
    service = _service(http)
    entry = {
        "id": service.model_name,
        "object": "model",
        "created": service.created,
        "owned_by": "onnx-genrt",
    }
    return JSONResponse({"object": "list", "data": [entry]})


async def health(http: Request) -> Response:
    service = _service(http)
    if service.draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    return JSONResponse({"status": "ok", "model": service.model_name})


async def metrics(http: Request) -> Response:
    service = _service(http)
    text = prom.render(
        service.scheduler.metrics(),
        service.counters,
        draining=service.draining,
        finish_reasons=FINISH_REASONS,
    )
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


async def _http_error(http: Request, exc: Exception) -> Response:
    """Starlette's own refusals (unknown path, wrong method) in OpenAI's error shape."""
    assert isinstance(exc, HTTPException)
    return error_response(
        APIError(exc.status_code, f"{http.method} {http.url.path}: {exc.detail}", code=None)
    )


async def _internal_error(http: Request, exc: Exception) -> Response:
    """A bug: answered in OpenAI's error shape (uvicorn logs the traceback)."""
    return error_response(
        APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")
    )


def create_app(
    model_dir: str | Path | None = None,
    provider: str | Sequence[Any] = "cpu",
    max_batch: int = 8,
    *,
    max_queue: int = 256,
    max_length: int | None = None,
    model_name: str | None = None,
    grace_period: float = DEFAULT_GRACE_PERIOD,
    warmup: bool = True,
    enable_graphs: bool = True,
) -> Starlette:
    """Load the model in ``model_dir`` (default: the embedded one) on ``provider`` (a name
    or a priority list) and return the ASGI app serving it as ``model_name`` (default: the
    folder's name) with ``max_batch`` rows and at most ``max_queue`` waiting requests."""
    from onnx_genrt.generate_cli import default_model_dir

    folder = Path(model_dir) if model_dir is not None else default_model_dir()
    if grace_period < 0:
        raise InvalidInputError(f"grace_period must be >= 0 seconds, got {grace_period}")
    model = Model(folder, provider, enable_graphs=enable_graphs)
    if not (folder / "tokenizer.json").is_file():
        raise ModelLoadError(f"serving needs a tokenizer: no tokenizer.json in {folder}")
    service = Service(
        model,
        model_name=model_name or folder.resolve().name,
        max_batch=max_batch,
        max_queue=max_queue,
        max_length=max_length,
        grace_period=grace_period,
        warmup=warmup,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await asyncio.to_thread(service.start)
        try:
            yield
        finally:
            await asyncio.to_thread(service.drain)

    app = Starlette(
        routes=[
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
        ],
        lifespan=lifespan,
        exception_handlers={HTTPException: _http_error, Exception: _internal_error},
    )
    app.state.service = service
    return app


__all__ = ["Service", "create_app"]
