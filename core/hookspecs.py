"""pluggy hook specifications for provider plugins.

A plugin is a module (or object) named by an entry point in the ``onnx_genrt.providers``
group. It implements ``register_providers``::

    from onnx_genrt.core.hookspecs import hookimpl
    from onnx_genrt.core.registry import ProviderSpec

    @hookimpl
    def register_providers(register):
        register(
            ProviderSpec(
                "mydev", factory=MyProvider, availability=check_driver, api_version=(1, 0)
            )
        )

``api_version`` is the provider API the plugin was written for
(``onnx_genrt.core.PROVIDER_API_VERSION``); see :class:`~onnx_genrt.core.registry.ProviderSpec`.
Each plugin is imported and called in isolation: if it fails, it is reported by
``onnx-genrt providers`` with its distribution and version, and the others load regardless.
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
    """Call ``register(spec)`` once for each provider this plugin offers.

    Do not build providers or touch devices here: ``availability`` says whether the provider
    can run, and ``factory`` builds it when a session asks for it.
    """
