"""A provider written for a provider API major version this runtime does not implement."""

from onnx_genrt.core.hookspecs import hookimpl
from onnx_genrt.core.registry import ProviderSpec
from onnx_genrt.providers.cpu.provider import CPUProvider


@hookimpl
def register_providers(register) -> None:
    register(ProviderSpec("future_major", factory=CPUProvider, api_version=(2, 0)))
