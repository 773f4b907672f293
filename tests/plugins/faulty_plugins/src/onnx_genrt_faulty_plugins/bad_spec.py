"""Registers a string instead of a ProviderSpec."""

from onnx_genrt.core.hookspecs import hookimpl


@hookimpl
def register_providers(register) -> None:
    register("not a spec")
