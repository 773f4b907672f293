"""Discover execution providers through pluggy entry points, the built-ins included."""

from __future__ import annotations

import importlib.metadata
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pluggy

from . import hookspecs
from .errors import ProviderUnavailableError
from .provider import ExecutionProvider


@dataclass(frozen=True)
class ProviderSpec:
    """What a plugin registers: a name, a factory and an availability check.

    ``availability()`` returns ``None`` when the provider can run here, else the reason
    it cannot (for example ``"no GPU or CuPy"``). It must not raise.
    """

    name: str
    factory: Callable[..., ExecutionProvider]
    availability: Callable[[], str | None] = lambda: None
    description: str = ""
    #: Lower runs first when a session asks for providers by preference.
    priority: int = 100


@dataclass(frozen=True)
class ProviderInfo:
    """A provider as listed by ``onnx-genrt providers``."""

    name: str
    plugin: str
    available: bool
    reason: str
    description: str


@dataclass(frozen=True)
class PluginError:
    """A plugin that failed to load or register; it does not stop the others."""

    plugin: str
    error: str
    detail: str = field(repr=False, default="")


class ProviderRegistry:
    """Providers offered by every plugin that loaded."""

    def __init__(self, load_entry_points: bool = True) -> None:
        self._pm = pluggy.PluginManager(hookspecs.PROJECT)
        self._pm.add_hookspecs(hookspecs)
        self._specs: dict[str, tuple[ProviderSpec, str]] = {}
        self.errors: list[PluginError] = []
        if load_entry_points:
            self._load_entry_points()

    def _load_entry_points(self) -> None:
        eps = importlib.metadata.entry_points(group=hookspecs.ENTRY_POINT_GROUP)
        for ep in sorted(eps, key=lambda e: e.name):
            dist = getattr(ep.dist, "name", None) or "?"
            label = f"{ep.name} ({ep.value}, from {dist})"
            try:
                plugin = ep.load()
            except Exception as exc:
                self._fail(label, exc)
                continue
            self.register_plugin(plugin, name=ep.name, label=label)

    def _fail(self, label: str, exc: BaseException) -> None:
        self.errors.append(
            PluginError(label, f"{type(exc).__name__}: {exc}", traceback.format_exc())
        )

    def register_plugin(self, plugin: Any, name: str | None = None, label: str = "") -> None:
        """Register a plugin object or module in-process and collect its providers."""
        label = label or name or repr(plugin)
        if self._pm.is_registered(plugin) or (name and self._pm.has_plugin(name)):
            return
        try:
            self._pm.register(plugin, name=name)
        except Exception as exc:
            self._fail(label, exc)
            return
        collected: list[ProviderSpec] = []
        try:
            caller = self._pm.subset_hook_caller(
                "register_providers",
                remove_plugins=[p for p in self._pm.get_plugins() if p is not plugin],
            )
            caller(register=collected.append)
        except Exception as exc:
            self._pm.unregister(plugin)
            self._fail(label, exc)
            return
        for spec in collected:
            if spec.name in self._specs:
                other = self._specs[spec.name][1]
                self.errors.append(
                    PluginError(label, f"provider name {spec.name!r} already registered by {other}")
                )
                continue
            self._specs[spec.name] = (spec, label)

    def names(self) -> list[str]:
        return sorted(self._specs, key=lambda n: (self._specs[n][0].priority, n))

    def spec(self, name: str) -> ProviderSpec:
        try:
            return self._specs[name][0]
        except KeyError:
            known = ", ".join(self.names()) or "none"
            raise ProviderUnavailableError(
                f"no provider named {name!r} is installed (known: {known})"
            ) from None

    def unavailable_reason(self, name: str) -> str | None:
        spec = self.spec(name)
        try:
            return spec.availability()
        except Exception as exc:  # an availability check must not take the registry down
            return f"availability check raised {type(exc).__name__}: {exc}"

    def providers(self) -> list[ProviderInfo]:
        out = []
        for name in self.names():
            spec, label = self._specs[name]
            reason = self.unavailable_reason(name)
            out.append(ProviderInfo(name, label, reason is None, reason or "", spec.description))
        return out

    def create(self, name: str, **options: Any) -> ExecutionProvider:
        """Instantiate provider ``name``; raises with the reason when it cannot run here."""
        reason = self.unavailable_reason(name)
        if reason is not None:
            raise ProviderUnavailableError(f"provider {name!r} is unavailable: {reason}")
        return self.spec(name).factory(**options)


_default: ProviderRegistry | None = None
_lock = threading.Lock()


def get_registry() -> ProviderRegistry:
    """The process-wide registry, loaded from entry points on first use."""
    global _default
    with _lock:
        if _default is None:
            _default = ProviderRegistry()
        return _default


def reset_registry() -> None:
    """Forget the process-wide registry (tests install plugins and reload)."""
    global _default
    with _lock:
        _default = None
