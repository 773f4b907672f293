"""Entry-point plugin that registers the CPU provider, as any third-party plugin would."""

from __future__ import annotations

from onnx_genrt.core.hookspecs import hookimpl
from onnx_genrt.core.provider import PROVIDER_API_VERSION
from onnx_genrt.core.registry import ProviderSpec


def _factory(threads: int | str | None = "auto", **options: object):
    from .provider import CPUProvider

    return CPUProvider(threads=threads, **options)


@hookimpl
def register_providers(register) -> None:
    register(
        ProviderSpec(
            "cpu",
            factory=_factory,
            description="host CPU: numpy BLAS and Numba kernels, recorded graphs in every slot",
            # Built-ins ship with the runtime; a third-party plugin writes the literal
            # version it was checked against, for example (1, 0).
            api_version=PROVIDER_API_VERSION,
        )
    )
