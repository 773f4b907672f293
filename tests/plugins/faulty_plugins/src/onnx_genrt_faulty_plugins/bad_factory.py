"""A provider whose factory builds something that is not an ExecutionProvider."""

from onnx_genrt.core.hookspecs import hookimpl
from onnx_genrt.core.registry import ProviderSpec


class NotAProvider:
    """Looks like a provider by name only."""

    name = "halfway"


@hookimpl
def register_providers(register) -> None:
    register(ProviderSpec("halfway", factory=NotAProvider, api_version=(1, 0)))
