"""OpenAI-compatible HTTP serving: ``create_app`` builds the ASGI app (Starlette), and
``onnx-genrt serve`` runs it under uvicorn (``onnx_genrt.serve.cli``).

Starlette and uvicorn are the ``serve`` extra: they are imported when the app is built,
so the rest of the command line works without them.
"""

from __future__ import annotations

from typing import Any

#: Seconds running requests get to finish at shutdown before they are cancelled.
DEFAULT_GRACE_PERIOD = 30.0


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from .app import create_app

        return create_app
    if name == "Service":
        from .service import Service

        return Service
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["DEFAULT_GRACE_PERIOD", "Service", "create_app"]
