"""Entry-point plugin for the CUDA provider; reports itself unavailable without a GPU."""

from __future__ import annotations

from onnx_genrt.core.hookspecs import hookimpl
from onnx_genrt.core.provider import PROVIDER_API_VERSION
from onnx_genrt.core.registry import ProviderSpec


def cuda_unavailable_reason() -> str | None:
    """None when CuPy imports and sees a GPU, else why not."""
    try:
        import cupy
    except Exception as exc:
        return f"no GPU or CuPy: CuPy does not import ({type(exc).__name__}: {exc})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        return f"no GPU or CuPy: CUDA runtime error ({type(exc).__name__}: {exc})"
    if count < 1:
        return "no GPU or CuPy: CuPy sees no CUDA device"
    return None


def _factory(**options: object):
    from .provider import CUDAProvider

    return CUDAProvider(**options)


@hookimpl
def register_providers(register) -> None:
    register(
        ProviderSpec(
            "cuda",
            factory=_factory,
            availability=cuda_unavailable_reason,
            description="NVIDIA GPU through CuPy; CUDA graphs in PRIMARY, VERIFY and DRAFT",
            # Built-ins ship with the runtime; a third-party plugin writes the literal
            # version it was checked against, for example (1, 0).
            api_version=PROVIDER_API_VERSION,
        )
    )
