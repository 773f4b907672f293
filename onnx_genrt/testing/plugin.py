"""The pytest plugin: the ``--provider a,b,c`` option and fixtures per requested provider.

Installed through the ``pytest11`` entry point ``onnx_genrt``, so any pytest run in an
environment with onnx-genrt has them:

* ``genrt_providers`` -- the requested names, provider under test first: ``--provider``, else
  the ``genrt_providers`` ini value (a project's default list), else ``cpu``;
* ``genrt_provider`` -- parametrizes a test over the requested names (one test id each);
* ``genrt_stack`` -- the providers a session gets for ``genrt_provider``: that name, then
  the names after it in ``--provider`` as fallbacks;
* ``genrt_session(model, **kw)`` / ``genrt_model(folder=None, **kw)`` -- an
  ``InferenceSession`` / an engine ``Model`` on ``genrt_stack``;
* ``genrt_target`` -- the kit's provider under test and its fallbacks (not parametrized).

With pytest-benchmark, ``def test_x(benchmark, genrt_session): ...`` run with
``--provider cuda,cpu --benchmark-enable`` prints one table with a row per provider.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from . import OPTION, OPTION_DEST, parse_providers

#: The ini key that gives the providers when the command line has no ``--provider``.
INI_PROVIDERS = "genrt_providers"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("onnx-genrt", "onnx-genrt provider test kit")
    group.addoption(
        OPTION,
        action="append",
        dest=OPTION_DEST,
        default=None,
        metavar="NAME[,FALLBACK...]",
        help=(
            f"execution providers: the one under test, then its fallbacks (default: the "
            f"{INI_PROVIDERS} ini value, else cpu)"
        ),
    )
    parser.addini(
        INI_PROVIDERS,
        help=f"the providers when {OPTION} is not given: NAME[,FALLBACK...] (default: cpu)",
        default="",
    )


def requested_providers(config: pytest.Config) -> list[str]:
    """The names given with ``--provider``, else those of the ``genrt_providers`` ini value
    (``["cpu"]`` when neither says)."""
    given = config.getoption(OPTION_DEST)
    source = OPTION
    if not given:
        given, source = config.getini(INI_PROVIDERS) or None, f"ini {INI_PROVIDERS}"
    try:
        return parse_providers(given)
    except ValueError as exc:
        raise pytest.UsageError(f"{source}: {exc}") from None


@dataclass(frozen=True)
class KitTarget:
    """The provider under test and the providers that run what it does not claim."""

    name: str
    fallback: tuple[str, ...]

    def create(self) -> Any:
        """A fresh instance of the provider under test, from the registry."""
        from onnx_genrt.core.registry import get_registry

        return get_registry().create(self.name)

    def stack(self, instance: Any = None) -> list[Any]:
        """The session's provider list: the provider under test (``instance`` when given),
        then the fallbacks."""
        return [instance if instance is not None else self.name, *self.fallback]

    def unavailable_reason(self) -> str | None:
        """Why the provider under test or a fallback cannot run here, or None."""
        from onnx_genrt.core.registry import get_registry

        registry = get_registry()
        for name in (self.name, *self.fallback):
            if name not in registry.names():
                known = ", ".join(registry.names())
                return f"no provider named {name!r} is registered (known: {known})"
            reason = registry.unavailable_reason(name)
            if reason:
                return f"provider {name!r} is unavailable: {reason}"
        return None


def kit_target(config: pytest.Config) -> KitTarget:
    names = requested_providers(config)
    return KitTarget(names[0], tuple(names[1:]))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "genrt_provider" in metafunc.fixturenames:
        names = requested_providers(metafunc.config)
        metafunc.parametrize("genrt_provider", names, ids=names, scope="session")


@pytest.fixture(scope="session")
def genrt_providers(pytestconfig: pytest.Config) -> list[str]:
    """The requested provider names, the one under test first."""
    return requested_providers(pytestconfig)


@pytest.fixture(scope="session")
def genrt_target(pytestconfig: pytest.Config) -> KitTarget:
    """The provider under test and its fallbacks; fails when one cannot run here."""
    target = kit_target(pytestconfig)
    reason = target.unavailable_reason()
    if reason:
        pytest.fail(reason, pytrace=False)
    return target


@pytest.fixture(scope="session")
def genrt_stack(genrt_provider: str, genrt_providers: list[str]) -> list[str]:
    """``genrt_provider`` then the requested names after it (its fallbacks)."""
    return genrt_providers[genrt_providers.index(genrt_provider) :]


@pytest.fixture
def genrt_session(genrt_stack: list[str]) -> Callable[..., Any]:
    """Factory: ``genrt_session(model, **options)`` -> an InferenceSession on ``genrt_stack``."""
    from onnx_genrt.session import InferenceSession

    def make(model: Any, **options: Any) -> InferenceSession:
        return InferenceSession(model, providers=list(genrt_stack), **options)

    return make


@pytest.fixture
def genrt_model(genrt_stack: list[str]) -> Callable[..., Any]:
    """Factory: ``genrt_model(folder=None, **options)`` -> an engine Model on
    ``genrt_stack`` (the embedded default model when no folder is given)."""
    from onnx_genrt.engine.model import Model
    from onnx_genrt.models import default_model_path

    def make(folder: str | Path | None = None, **options: Any) -> Model:
        return Model(folder or default_model_path(), list(genrt_stack), **options)

    return make
