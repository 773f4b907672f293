"""A provider that does not say which provider API it was written for."""

from onnx_genrt.core.hookspecs import hookimpl
from onnx_genrt.core.registry import ProviderSpec
from onnx_genrt.providers.cpu.provider import CPUProvider


@hookimpl
def register_providers(register) -> None:
    register(ProviderSpec("unversioned", factory=CPUProvider))
