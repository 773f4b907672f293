"""A provider written for a newer minor of the provider API than this runtime implements."""

from onnx_genrt.core.hookspecs import hookimpl
from onnx_genrt.core.registry import ProviderSpec
from onnx_genrt.providers.cpu.provider import CPUProvider


@hookimpl
def register_providers(register) -> None:
    register(ProviderSpec("future_minor", factory=CPUProvider, api_version=(1, 7)))
