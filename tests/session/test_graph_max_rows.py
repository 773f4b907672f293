"""``InferenceSession.graph_max_rows``: the least row limit of the providers it captures on
(``ExecutionProvider.graph_max_rows``, API 1.3), None when none has one; a provider that
holds no graph slot does not count."""

from __future__ import annotations

from onnx_genrt.core.provider import PROVIDER_API_VERSION, ExecutionProvider
from onnx_genrt.providers.cpu.provider import CPUProvider
from onnx_genrt.session import InferenceSession

from ..models import mlp


class _Narrow(CPUProvider):
    @property
    def graph_max_rows(self) -> int | None:
        return 32


class _NoGraphs(_Narrow):
    GRAPH_SLOTS = frozenset()


def test_the_default_is_no_limit():
    assert PROVIDER_API_VERSION >= (1, 3)
    assert ExecutionProvider.graph_max_rows.fget(CPUProvider()) is None
    assert InferenceSession(mlp(hidden=4)).graph_max_rows is None


def test_a_provider_limit_is_the_sessions():
    assert InferenceSession(mlp(hidden=4), providers=[_Narrow()]).graph_max_rows == 32


def test_a_provider_without_graph_slots_does_not_limit():
    assert InferenceSession(mlp(hidden=4), providers=[_NoGraphs()]).graph_max_rows is None
