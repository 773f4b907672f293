"""The OpenAI-compatible ASGI app: five endpoints over one :class:`Service`.

``create_app`` loads the model and returns a Starlette app; its lifespan starts the
scheduler (and warms it up) and, at shutdown, drains it: requests that run get
``grace_period`` seconds to finish, then the rest are cancelled. Any ASGI server can host
the app; ``onnx-genrt serve`` runs it under uvicorn and drains on SIGTERM first, answering
503 to new requests meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
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
from onnx_genrt.engine.scheduler import DEFAULT_MAX_BATCH, DEFAULT_MAX_QUEUE, FINISH_REASONS

from . import DEFAULT_GRACE_PERIOD
from . import metrics as prom
from .protocol import APIError, parse_request
from .service import Service, error_response


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
        handles = service.submit(request)
    except APIError as error:
        reason = {429: "queue_full", 503: "draining"}.get(error.status, "invalid")
        service.counters.request_rejected(reason)
        return error_response(error)
    if request.stream:
        return StreamingResponse(
            service.events(request, handles, arrival),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    return await service.whole(request, handles, http, arrival)


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
    max_batch: int = DEFAULT_MAX_BATCH,
    *,
    max_queue: int = DEFAULT_MAX_QUEUE,
    max_length: int | None = None,
    model_name: str | None = None,
    grace_period: float = DEFAULT_GRACE_PERIOD,
    warmup: bool = True,
    enable_graphs: bool = True,
    spec: str | None = None,
    k: int | None = None,
    device_sampling: bool | None = None,
) -> Starlette:
    """Load the model in ``model_dir`` (default: the embedded one) on ``provider`` (a name
    or a priority list) and return the ASGI app serving it as ``model_name`` (default: the
    folder's name) with ``max_batch`` rows and at most ``max_queue`` waiting requests.
    ``spec`` (``"ngram"`` or ``"auto"``) verifies up to ``k`` prompt-lookup drafts per greedy
    row in each decode step; ``device_sampling`` draws sampled tokens on the device (None:
    on a GPU; :class:`~onnx_genrt.engine.scheduler.Scheduler`)."""
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
        spec=spec,
        k=k,
        device_sampling=device_sampling,
    )

    return service_app(service)


def service_app(service: Service) -> Starlette:
    """The ASGI app serving ``service``: its lifespan starts the service and drains it."""

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


__all__ = ["Service", "create_app", "service_app"]
