"""``onnx-genrt serve``: the OpenAI-compatible app under uvicorn, draining on SIGTERM.

The first SIGTERM (or Ctrl-C) stops admitting (new requests get 503, ``/health`` 503),
lets running requests finish for ``--grace-period`` seconds, cancels what is left, and
exits 0. A second signal exits at once.
"""

from __future__ import annotations

import argparse
import socket
import sys
import threading
from pathlib import Path
from types import FrameType

from onnx_genrt.cli_args import NON_NEGATIVE, POSITIVE_INT, int_at_least
from onnx_genrt.core.errors import InvalidInputError

from . import DEFAULT_GRACE_PERIOD

#: A TCP port (0: any free one); the socket layer would wrap a larger number around.
PORT = int_at_least(0, 65535)


def add_parser(sub: argparse._SubParsersAction) -> None:
    from onnx_genrt.generate_cli import add_drafts_argument, add_provider_argument

    p = sub.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API (continuous batching)",
        description="Serve /v1/models, /v1/completions, /v1/chat/completions (stream=true: "
        "server-sent events), /health and /metrics (Prometheus) with uvicorn. SIGTERM stops "
        "admitting, lets running requests finish within --grace-period, then exits 0.",
    )
    p.add_argument(
        "--model", type=Path, default=None, help="model folder (default: the embedded model)"
    )
    add_provider_argument(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=PORT, default=8000, help="port (default 8000; 0: any free)")
    # The engine's DEFAULT_MAX_BATCH and DEFAULT_MAX_QUEUE, written here so that building
    # the parser imports no engine (tests/serve/test_serve_cli.py checks they agree).
    p.add_argument(
        "--max-batch", type=POSITIVE_INT, default=8, help="rows decoded together (default 8)"
    )
    p.add_argument(
        "--max-queue",
        type=int_at_least(0),
        default=256,
        help="requests that may wait for a row; one more gets 429 (default 256)",
    )
    p.add_argument(
        "--max-length",
        type=int_at_least(2),
        default=None,
        help="positions per row: prompt + completion (default: the model's context length)",
    )
    p.add_argument(
        "--model-name", default=None, help="the model's name in the API (default: folder name)"
    )
    p.add_argument(
        "--grace-period",
        type=NON_NEGATIVE,
        default=DEFAULT_GRACE_PERIOD,
        help=f"seconds running requests get to finish at shutdown (default {DEFAULT_GRACE_PERIOD:g})",
    )
    p.add_argument(
        "--threads", type=POSITIVE_INT, default=None, help="CPU provider threads (default 1)"
    )
    p.add_argument(
        "--spec",
        choices=("ngram", "mtp", "auto"),
        default=None,
        help="speculate per row: drafts from each row's own text (ngram) or the model's MTP "
        "head (mtp), verified in one step for every row; auto: the MTP head where the model "
        "has one, else ngram, while it measurably pays",
    )
    add_drafts_argument(p)
    p.add_argument(
        "--device-sampling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="draw the tokens of requests that sample by temperature and top-k on the device "
        "(one token read back per row instead of its logits; a seed draws other tokens than "
        "on the host); default: on where reads are asynchronous (a GPU), off on the CPU",
    )
    p.add_argument("--no-warmup", action="store_true", help="skip the warm-up requests at start")
    p.add_argument("--access-log", action="store_true", help="log every request (uvicorn)")
    p.add_argument(
        "--log-level",
        choices=("critical", "error", "warning", "info", "debug"),
        default="warning",
        help="uvicorn's log level (default warning)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        import uvicorn
    except ImportError:
        raise InvalidInputError(
            "serving needs uvicorn and starlette: pip install 'onnx-genrt[serve]'"
        ) from None
    from onnx_genrt.generate_cli import provider_args

    from .app import create_app

    # Bound first (a taken port fails before the model loads); uvicorn listens once ready.
    sock = _bind(args.host, args.port)
    app = create_app(
        args.model,
        provider_args(args.provider, args.threads),
        args.max_batch,
        max_queue=args.max_queue,
        max_length=args.max_length,
        model_name=args.model_name,
        grace_period=args.grace_period,
        warmup=not args.no_warmup,
        spec=args.spec,
        k=args.k,
        device_sampling=args.device_sampling,
    )
    config = uvicorn.Config(
        app,
        log_level=args.log_level,
        access_log=args.access_log,
        lifespan="on",
        timeout_graceful_shutdown=10,
    )
    server = DrainingServer(config, app.state.service)
    server.run(sockets=[sock])
    return 0


def _bind(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (listening starts when the app is ready), or an
    error naming the flags."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise InvalidInputError(f"--host {host!r} cannot be resolved: {exc}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise InvalidInputError(
            f"--host {host} --port {port}: cannot listen there ({exc.strerror}); pick another "
            "port or stop the process using it"
        ) from None
    sock.set_inheritable(True)
    return sock


def _server_class():
    import uvicorn

    class _DrainingServer(uvicorn.Server):
        """uvicorn's server whose first exit signal drains the service before exiting."""

        def __init__(self, config: uvicorn.Config, service) -> None:
            super().__init__(config)
            self.service = service
            self._drainer: threading.Thread | None = None

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)
            if self.started and sockets:
                host, port = sockets[0].getsockname()[:2]
                print(
                    f"onnx-genrt serve: {self.service.model_name} on http://{host}:{port} "
                    f"(max batch {self.service.scheduler.max_batch}); SIGTERM drains and exits",
                    file=sys.stderr,
                    flush=True,
                )

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            # Not recorded in _captured_signals: uvicorn would re-raise it after shutdown,
            # and the process would end by the signal instead of exiting 0.
            if self._drainer is not None:  # a second signal: stop now
                self.force_exit = self.should_exit = True
                return
            print(
                f"onnx-genrt serve: signal {sig}: draining (up to "
                f"{self.service.grace_period:g} s), then exiting",
                file=sys.stderr,
                flush=True,
            )
            self._drainer = threading.Thread(target=self._drain, name="onnx-genrt-drain")
            self._drainer.start()

        def _drain(self) -> None:
            try:
                self.service.drain()
            finally:
                self.should_exit = True

    return _DrainingServer


def DrainingServer(config, service):  # noqa: N802 - a class built on first use
    """uvicorn's Server, draining ``service`` on the first SIGTERM (uvicorn imported lazily)."""
    return _server_class()(config, service)
