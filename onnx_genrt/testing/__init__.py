"""The provider test kit: test an execution provider against the CPU provider and
independent references (ONNX's node tests, numpy in float64).

Run it with ``onnx-genrt check-provider NAME[,FALLBACK...]`` or
``pytest --pyargs onnx_genrt.testing --provider NAME[,FALLBACK...]``. The pytest plugin
(:mod:`onnx_genrt.testing.plugin`, installed through the ``pytest11`` entry point) also
gives your own tests the ``--provider`` option and fixtures per requested provider.
"""

from __future__ import annotations

from collections.abc import Sequence

#: The pytest option that names the providers, and its destination.
OPTION = "--provider"
OPTION_DEST = "genrt_providers"


def parse_providers(text: str | Sequence[str] | None) -> list[str]:
    """``"a,b,c"`` (or several such strings) to ``["a", "b", "c"]``; empty means ``cpu``."""
    parts = [text] if isinstance(text, str) else list(text or [])
    names = [n.strip() for part in parts for n in part.split(",") if n.strip()]
    if len(set(names)) != len(names):
        raise ValueError(f"provider list {','.join(names)!r} names a provider twice")
    return names or ["cpu"]
