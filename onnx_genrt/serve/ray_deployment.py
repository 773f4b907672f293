"""The OpenAI-compatible app as a Ray Serve deployment: each replica builds its own app
(its own model, KV cache and scheduler); Ray's HTTP proxy spreads requests over them.

    serve run onnx_genrt.serve.ray_deployment:app_builder num_replicas=2 max_batch=8

Ray (``pip install "ray[serve]"``) is not a dependency of onnx-genrt; this module imports
it when a deployment is built. See docs/deploy.md.
"""

from __future__ import annotations

from typing import Any

from onnx_genrt.engine.scheduler import DEFAULT_MAX_BATCH, DEFAULT_MAX_QUEUE

#: ``app_builder`` arguments and their types (``serve run`` passes strings).
ARGUMENTS: dict[str, type] = {
    "model_dir": str,
    "provider": str,
    "max_batch": int,
    "max_queue": int,
    "model_name": str,
    "num_replicas": int,
    "num_cpus": float,
    "spec": str,
    "k": int,
}


def deployment(
    *,
    model_dir: str | None = None,
    provider: str = "cpu",
    max_batch: int = DEFAULT_MAX_BATCH,
    max_queue: int = DEFAULT_MAX_QUEUE,
    model_name: str | None = None,
    num_replicas: int = 1,
    num_cpus: float = 1.0,
    spec: str | None = None,
    k: int | None = None,
):
    """A bound Ray Serve application of ``num_replicas`` replicas of ``create_app``
    (``spec``, ``k``: speculation per row, as ``onnx-genrt serve --spec``)."""
    from ray import serve

    def build_app():
        from onnx_genrt.serve import create_app

        return create_app(
            model_dir,
            provider,
            max_batch,
            max_queue=max_queue,
            model_name=model_name,
            spec=spec,
            k=k,
        )

    ingress = serve.ingress(build_app)()
    return serve.deployment(
        ingress,
        name="onnx-genrt",
        num_replicas=num_replicas,
        ray_actor_options={"num_cpus": num_cpus},
        # A replica holds up to max_batch running and max_queue waiting requests itself.
        max_ongoing_requests=max_batch + max_queue,
    ).bind()


def app_builder(args: dict[str, Any]):
    """``serve run onnx_genrt.serve.ray_deployment:app_builder key=value ...``"""
    from onnx_genrt.core.errors import InvalidInputError

    unknown = sorted(set(args) - set(ARGUMENTS))
    if unknown:
        raise InvalidInputError(f"unknown arguments {unknown}; known: {sorted(ARGUMENTS)}")
    kwargs = {}
    for key, value in args.items():
        try:
            kwargs[key] = ARGUMENTS[key](value)
        except ValueError:
            raise InvalidInputError(f"{key}={value!r} must be {ARGUMENTS[key].__name__}") from None
    return deployment(**kwargs)
