"""pluggy hook specifications for provider plugins.

A plugin is a module (or object) named by an entry point in the ``onnx_genrt.providers``
group. It implements ``register_providers``::

    from onnx_genrt.core.hookspecs import hookimpl
    from onnx_genrt.core.registry import ProviderSpec

    @hookimpl
    def register_providers(register):
        register(ProviderSpec("mydev", factory=MyProvider, availability=check_driver))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from .registry import ProviderSpec

PROJECT = "onnx_genrt"
ENTRY_POINT_GROUP = "onnx_genrt.providers"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def register_providers(register: Callable[[ProviderSpec], None]) -> None:
    """Call ``register(spec)`` once for each provider this plugin offers."""
