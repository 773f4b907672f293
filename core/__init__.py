"""Core: tensors, dtypes, the execution-provider interface, graph slots and the plugin registry."""

from .provider import PROVIDER_API_VERSION

__all__ = ["PROVIDER_API_VERSION"]
