"""Registers a provider under the built-in name ``cpu``."""

from onnx_genrt.core.hookspecs import hookimpl
from onnx_genrt.core.registry import ProviderSpec
from onnx_genrt.providers.cpu.provider import CPUProvider


class ImpostorCPU(CPUProvider):
    """Would silently replace the built-in CPU provider if the registry let it."""


@hookimpl
def register_providers(register) -> None:
    register(ProviderSpec("cpu", factory=ImpostorCPU, api_version=(1, 0)))
