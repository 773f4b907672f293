"""Op tests run on every provider, through the provider test kit's parametrization
(``onnx_genrt.testing``: ``genrt_provider``, ``--provider a,b,c``), as onnxruntime's OpTester
or ggml's test-backend-ops run one test on every backend.

Without ``--provider`` the providers are pyproject.toml's ``genrt_providers``: CUDA (marked
``gpu``: skipped without a GPU, failed under ``ONNX_GENRT_REQUIRE_GPU=1``), the example
plugin of ``tests/plugins/example_provider`` (registered in-process when it is not installed)
and the CPU provider. A test takes the ``tester`` fixture (``op_tester.OpTester``); a
registered provider that cannot run here skips, a name no plugin registers fails.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from onnx_genrt.core.provider import ExecutionProvider
from onnx_genrt.core.registry import get_registry, reset_registry

from .op_tester import OpTester

#: Providers whose op tests need a GPU (marked ``gpu``, gated by tests/conftest.py).
GPU_PROVIDERS = frozenset({"cuda"})
#: The example plugin: registered from its source when no installed distribution has.
EXAMPLE = "example"
EXAMPLE_SOURCE = (
    Path(__file__).resolve().parents[1]
    / "plugins/example_provider/src/onnx_genrt_example_provider/__init__.py"
)


@pytest.hookimpl(tryfirst=True)  # before tests/conftest.py turns the gpu mark into a skip
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and callspec.params.get("genrt_provider") in GPU_PROVIDERS:
            item.add_marker(pytest.mark.gpu)


def _example_plugin() -> ModuleType:
    """The example plugin's module, loaded from its source once (under a private name, so an
    installed copy imported elsewhere is not shadowed)."""
    name = "_tests_ops_example_provider"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, EXAMPLE_SOURCE)
        assert spec is not None and spec.loader is not None, EXAMPLE_SOURCE
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
    return sys.modules[name]


@pytest.fixture(scope="session")
def _registered_here() -> Iterator[list[str]]:
    """Names this folder registered in-process; the registry is rebuilt from the entry
    points afterwards, so later tests see only what is installed."""
    names: list[str] = []
    yield names
    if names:
        reset_registry()


@pytest.fixture(scope="session")
def _instances() -> dict[str, ExecutionProvider]:
    """One instance per provider for direct kernel launches (sessions make their own)."""
    return {}


@pytest.fixture
def tester(
    genrt_provider: str,
    genrt_stack: list[str],
    _registered_here: list[str],
    _instances: dict[str, ExecutionProvider],
) -> OpTester:
    """Runs this test's nodes on ``genrt_provider`` (its fallbacks after it)."""
    registry = get_registry()
    if EXAMPLE in genrt_stack and EXAMPLE not in registry.names():
        registry.register_plugin(_example_plugin(), name=str(EXAMPLE_SOURCE.parents[2]))
        _registered_here.append(EXAMPLE)
    for name in genrt_stack:
        if name not in registry.names():
            known = ", ".join(registry.names())
            pytest.fail(f"no provider named {name!r} is registered (known: {known})")
    reason = registry.unavailable_reason(genrt_provider)
    if reason:
        pytest.skip(f"provider {genrt_provider!r} cannot run here: {reason}")
    # A fallback that cannot run here (the CPU provider without Numba on a GPU machine) only
    # matters to the tests that build sessions: they skip, kernel launches still run.
    unusable = [
        f"fallback {name!r} cannot run here: {why}"
        for name in genrt_stack[1:]
        if (why := registry.unavailable_reason(name))
    ]
    if genrt_provider not in _instances:
        _instances[genrt_provider] = registry.create(genrt_provider)
    return OpTester(
        genrt_provider, tuple(genrt_stack), _instances[genrt_provider], "; ".join(unusable)
    )
