"""Discover execution providers through pluggy entry points, each plugin loaded in isolation.

Every entry point of the ``onnx_genrt.providers`` group (the built-in CPU and CUDA providers
included) is imported, asked for its providers and checked on its own. Whatever goes wrong
(an import that raises or calls ``sys.exit()``, a hook that raises, something registered
that is not a :class:`ProviderSpec`, an API version this runtime does not implement, a name
another distribution owns, a factory that builds no :class:`ExecutionProvider`) is recorded
as a :class:`PluginError` naming the distribution and version, and that provider is never
used. Other plugins load as if it were not installed. Only ``KeyboardInterrupt`` passes.
"""

from __future__ import annotations

import importlib.metadata
import re
import threading
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import pluggy

from . import hookspecs
from .errors import OnnxGenrtError, ProviderUnavailableError, UnknownProviderError
from .provider import PROVIDER_API_VERSION, ExecutionProvider

#: The distribution whose entry points are the built-in providers; their names are reserved.
OWN_DISTRIBUTION = "onnx-genrt"

ApiVersion = tuple[int, int]


def _available() -> str | None:
    return None


@dataclass(frozen=True)
class ProviderSpec:
    """What a plugin registers for one provider.

    ``factory(**options)`` returns a new :class:`ExecutionProvider`. ``availability()``
    returns ``None`` when the provider can run here, else the reason it cannot (for example
    ``"no GPU or CuPy"``); it should not raise (if it does, the provider is listed as
    unavailable with the exception).

    ``api_version`` is the provider API ``(major, minor)`` the plugin was written for,
    normally :data:`~onnx_genrt.core.provider.PROVIDER_API_VERSION` of the onnx-genrt it was
    developed against. It has no default on purpose: a spec that leaves it ``None`` is refused.
    A plugin that does not say was written before the contract was versioned, and assuming
    ``(1, 0)`` for it would turn a clear refusal at load time into a failure deep inside a
    session. Graph slots are not declared here: they are a property of the provider instance
    (``ExecutionProvider.graph_slots``), known once it is built.
    """

    name: str
    factory: Callable[..., ExecutionProvider]
    availability: Callable[[], str | None] = _available
    description: str = ""
    api_version: ApiVersion | None = None


@dataclass(frozen=True)
class PluginSource:
    """Where a plugin comes from: an entry point of a distribution, or an in-process object."""

    entry_point: str
    distribution: str | None = None
    version: str = ""

    @property
    def label(self) -> str:
        """``"NAME VERSION"`` of the distribution, or ``"in-process plugin NAME"``."""
        if self.distribution is None:
            return f"in-process plugin {self.entry_point!r}"
        return f"{self.distribution} {self.version}".strip()

    @property
    def builtin(self) -> bool:
        """Whether this plugin ships in the onnx-genrt distribution itself."""
        return self.distribution is not None and _normalize(self.distribution) == OWN_DISTRIBUTION

    def __str__(self) -> str:
        if self.distribution is None:
            return self.label
        return f"{self.label} (entry point {self.entry_point})"


@dataclass(frozen=True)
class ProviderInfo:
    """A provider as listed by ``onnx-genrt providers``."""

    name: str
    plugin: str
    distribution: str
    api_version: str
    available: bool
    reason: str
    description: str


@dataclass(frozen=True)
class PluginError:
    """A plugin, or one provider of it, that was refused; it does not stop the others."""

    plugin: str
    error: str
    detail: str = field(repr=False, default="")


@dataclass(frozen=True)
class _Entry:
    spec: ProviderSpec
    source: PluginSource
    api_version: ApiVersion


def _normalize(distribution: str) -> str:
    return re.sub(r"[-_.]+", "-", distribution).lower()


def _one_line(text: str, limit: int = 300) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def _describe(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return _one_line(text)


def format_api_version(version: ApiVersion) -> str:
    """``(1, 0)`` as ``"1.0"``."""
    return f"{version[0]}.{version[1]}"


def api_version_problem(declared: object) -> str | None:
    """Why a plugin written for provider API ``declared`` cannot load here, or ``None``."""
    runtime = format_api_version(PROVIDER_API_VERSION)
    if declared is None:
        return (
            f"declares no provider API version; this onnx-genrt implements {runtime}: check the "
            f"plugin against that contract and set ProviderSpec(..., "
            f"api_version={PROVIDER_API_VERSION})"
        )
    if (
        not isinstance(declared, tuple)
        or len(declared) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in declared)
    ):
        return (
            f"api_version must be a (major, minor) tuple of ints such as (1, 0), not {declared!r}"
        )
    wanted = format_api_version(declared)
    if declared[0] != PROVIDER_API_VERSION[0]:
        return (
            f"written for provider API {wanted}, but this onnx-genrt implements {runtime}; "
            f"a different major version is incompatible: install a build of the plugin for "
            f"API {PROVIDER_API_VERSION[0]}.x"
        )
    if declared[1] > PROVIDER_API_VERSION[1]:
        return (
            f"written for provider API {wanted}, newer than the {runtime} this onnx-genrt "
            f"implements: upgrade onnx-genrt, or install a build of the plugin for API {runtime}"
        )
    return None


@cache
def builtin_provider_names() -> frozenset[str]:
    """Entry-point names the onnx-genrt distribution declares (``cpu``, ``cuda``): reserved."""
    try:
        eps = importlib.metadata.distribution(OWN_DISTRIBUTION).entry_points
    except importlib.metadata.PackageNotFoundError:
        return frozenset()
    return frozenset(ep.name for ep in eps if ep.group == hookspecs.ENTRY_POINT_GROUP)


def _builtin_label() -> str:
    try:
        return f"{OWN_DISTRIBUTION} {importlib.metadata.version(OWN_DISTRIBUTION)}"
    except importlib.metadata.PackageNotFoundError:
        return OWN_DISTRIBUTION


def _source_of(ep: importlib.metadata.EntryPoint) -> PluginSource:
    dist = ep.dist
    name = dist.name if dist is not None else None
    return PluginSource(f"{ep.name} = {ep.value}", name, dist.version if dist is not None else "")


class ProviderRegistry:
    """Providers offered by every plugin that loaded, and the plugins that were refused.

    ``entry_points`` defaults to every installed entry point of the ``onnx_genrt.providers``
    group; tests pass a selection.
    """

    def __init__(self, entry_points: Iterable[importlib.metadata.EntryPoint] | None = None) -> None:
        self._pm = pluggy.PluginManager(hookspecs.PROJECT)
        self._pm.add_hookspecs(hookspecs)
        self._specs: dict[str, _Entry] = {}
        # Providers refused by name, so that asking for one says why instead of "unknown".
        self._refused: dict[str, PluginError] = {}
        self._lock = threading.Lock()
        self.errors: list[PluginError] = []
        if entry_points is None:
            entry_points = importlib.metadata.entry_points(group=hookspecs.ENTRY_POINT_GROUP)
        self._load_entry_points(entry_points)

    # -- loading ------------------------------------------------------------
    def _load_entry_points(self, entry_points: Iterable[importlib.metadata.EntryPoint]) -> None:
        # Built-ins first, then by distribution and entry point: a stable, documented order.
        loaded = sorted(
            ((ep, _source_of(ep)) for ep in entry_points),
            key=lambda pair: (not pair[1].builtin, pair[1].distribution or "", pair[0].name),
        )
        for ep, source in loaded:
            try:
                plugin = ep.load()
            except KeyboardInterrupt:
                raise
            except BaseException as exc:  # SystemExit included: a plugin must not end the process
                hint = (
                    " (a plugin must not exit the process)" if isinstance(exc, SystemExit) else ""
                )
                self._fail(source, f"import failed: {_describe(exc)}{hint}", exc)
                continue
            self._register(plugin, source)

    def register_plugin(self, plugin: Any, name: str) -> None:
        """Register a plugin object or module in-process (not from a distribution)."""
        self._register(plugin, PluginSource(name))

    def _register(self, plugin: Any, source: PluginSource) -> None:
        key = f"{source.distribution or '<in-process>'}:{source.entry_point}"
        if self._pm.is_registered(plugin) or self._pm.has_plugin(key):
            other = self._pm.get_name(plugin) if self._pm.is_registered(plugin) else key
            self._fail(source, f"already registered as {other}")
            return
        try:
            self._pm.register(plugin, name=key)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:
            self._fail(source, f"not a valid plugin: {_describe(exc)}", exc)
            return
        collected: list[object] = []
        try:
            caller = self._pm.subset_hook_caller(
                "register_providers",
                remove_plugins=[p for p in self._pm.get_plugins() if p is not plugin],
            )
            caller(register=collected.append)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:
            self._pm.unregister(plugin)
            self._fail(source, f"register_providers raised {_describe(exc)}", exc)
            return
        if not collected:
            self._fail(
                source,
                "registered no providers: define register_providers(register) marked "
                "@onnx_genrt.core.hookspecs.hookimpl and call register(ProviderSpec(...))",
            )
        for spec in collected:
            problem = self._spec_problem(spec, source)
            if problem is None:
                assert isinstance(spec, ProviderSpec) and spec.api_version is not None
                self._specs[spec.name] = _Entry(spec, source, spec.api_version)
                continue
            name = spec.name if isinstance(spec, ProviderSpec) else None
            error = self._fail(source, problem)
            if isinstance(name, str) and name not in self._specs:
                self._refused.setdefault(name, error)

    def _spec_problem(self, spec: object, source: PluginSource) -> str | None:
        if not isinstance(spec, ProviderSpec):
            return (
                f"register() was given {type(spec).__name__} {_one_line(repr(spec), 60)}, not a "
                f"ProviderSpec: call register(ProviderSpec(name, factory=..., api_version=...))"
            )
        name = spec.name
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]+", name):
            return (
                f"provider name {name!r} is not usable: use letters, digits, '_', '-' or '.' "
                "(it is written in provider lists such as --provider a,b)"
            )
        where = f"provider {name!r}"
        if not callable(spec.factory):
            return f"{where}: factory {spec.factory!r} is not callable"
        if not callable(spec.availability):
            return f"{where}: availability {spec.availability!r} is not callable"
        version_problem = api_version_problem(spec.api_version)
        if version_problem is not None:
            return f"{where}: {version_problem}"
        if name in builtin_provider_names() and not source.builtin:
            return (
                f"{where} is built into {_builtin_label()}; {source.label} cannot take it over: "
                "give the provider another name"
            )
        if name in self._specs:
            return (
                f"{where} is already registered by {self._specs[name].source}; "
                f"{source.label} cannot register it again: rename one of them"
            )
        return None

    def _fail(
        self, source: PluginSource, message: str, exc: BaseException | None = None
    ) -> PluginError:
        detail = "".join(traceback.format_exception(exc)) if exc is not None else ""
        error = PluginError(str(source), message, detail)
        self.errors.append(error)
        return error

    # -- queries ------------------------------------------------------------
    def names(self) -> list[str]:
        """Names of the providers that loaded, sorted."""
        return sorted(self._specs)

    def _entry(self, name: str) -> _Entry:
        try:
            return self._specs[name]
        except KeyError:
            pass
        refused = self._refused.get(name)
        if refused is not None:
            raise ProviderUnavailableError(
                f"provider {name!r} from {refused.plugin} is not used: {refused.error}"
            )
        known = ", ".join(self.names()) or "none"
        raise UnknownProviderError(f"no provider named {name!r} is installed (known: {known})")

    def spec(self, name: str) -> ProviderSpec:
        """The spec registered as ``name``; raises naming the known ones, or why it was refused."""
        return self._entry(name).spec

    def unavailable_reason(self, name: str) -> str | None:
        """``None`` when provider ``name`` can run here, else why not."""
        spec = self.spec(name)
        try:
            reason = spec.availability()
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # an availability check must not take the registry down
            return f"availability check raised {_describe(exc)}"
        if reason is not None and not isinstance(reason, str):
            return f"availability check returned {reason!r}, not None or a reason"
        return reason

    def providers(self) -> list[ProviderInfo]:
        """Every provider that loaded, with its origin and availability; nothing is built."""
        out = []
        for name in self.names():
            entry = self._specs[name]
            reason = self.unavailable_reason(name)
            out.append(
                ProviderInfo(
                    name=name,
                    plugin=str(entry.source),
                    distribution=entry.source.label,
                    api_version=format_api_version(entry.api_version),
                    available=reason is None,
                    reason=reason or "",
                    description=entry.spec.description,
                )
            )
        return out

    def create(self, name: str, **options: Any) -> ExecutionProvider:
        """Build provider ``name``; raises :class:`ProviderUnavailableError` with the reason when
        it cannot run here or its factory fails. A factory that returns something other than
        an :class:`ExecutionProvider` marks the provider broken: it is not used again."""
        entry = self._entry(name)
        reason = self.unavailable_reason(name)
        if reason is not None:
            raise ProviderUnavailableError(f"provider {name!r} is unavailable: {reason}")
        try:
            provider = entry.spec.factory(**options)
        except KeyboardInterrupt:
            raise
        except OnnxGenrtError:
            raise
        except BaseException as exc:
            given = f" with options {options}" if options else ""
            raise ProviderUnavailableError(
                f"provider {name!r} ({entry.source.label}) could not be created{given}: "
                f"{_describe(exc)}"
            ) from exc
        if not isinstance(provider, ExecutionProvider):
            problem = (
                f"provider {name!r}: factory returned {type(provider).__qualname__}, not an "
                "ExecutionProvider: return an instance of a subclass of "
                "onnx_genrt.core.provider.ExecutionProvider"
            )
            with self._lock:
                if self._specs.get(name) is entry:
                    del self._specs[name]
                    self._refused[name] = self._fail(entry.source, problem)
            raise ProviderUnavailableError(
                f"provider {name!r} from {entry.source} is broken and not used: {problem}"
            )
        return provider


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
