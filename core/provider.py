"""The execution-provider interface: memory, copies, kernels, streams and graph slots."""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from . import collector_pause
from .device import Device
from .dtypes import DType
from .errors import GraphCaptureError, InvalidInputError, UnsupportedGraphSlot
from .graph_slots import DeviceGraphSlot
from .kernels import KernelContext, KernelDef, KernelRegistry, NodeInfo, TensorType
from .tensor import Tensor
from .workspace import Workspace

#: The provider API this runtime implements, as (major, minor). A plugin states the version it
#: was written for in ``ProviderSpec.api_version``; it loads when the majors are equal and its
#: minor is not newer (as onnxruntime's plugin EPs report the ``ORT_API_VERSION`` they were
#: built with). A minor adds members with defaults; a major changes or removes them.
#: 1.1: the transfer verbs ``empty``, ``upload``, ``read`` (``copy`` on arrays); a 1.0
#: provider that implements ``allocate``, ``copy_from_host``, ``copy_to_host`` and
#: ``copy`` on Tensors keeps working through adapters. ``KernelContext`` gains ``stream``,
#: ``scratch``, ``host_value``, ``state``; the provider gains ``host_value`` and ``stream``.
#: 1.2: ``holds_dtype``. 1.3: ``graph_max_rows``.
PROVIDER_API_VERSION: tuple[int, int] = (1, 3)

#: The 1.0 transfer methods, each with the 1.1 verb that replaces it.
_LEGACY_TRANSFERS = {"allocate": "empty", "copy_from_host": "upload", "copy_to_host": "read"}
#: The verbs 1.1 added (``copy`` and ``read_later`` were in 1.0 already).
_VERBS = ("empty", "upload", "read")
#: Every deprecated 1.0 name, with what replaces it.
_ALIASES = {
    **_LEGACY_TRANSFERS,
    "as_array": "upload",
    "write_from_host": "upload",
    "to_numpy": "read",
    "to_numpy_many": "read",
    "copy_array": "copy",
}


@dataclass(frozen=True)
class ProviderOption:
    """A provider setting, fixed when the provider is made: the keyword argument when one is
    given, else the environment variable ``env`` when it is set, else ``default``. The
    default's type (bool, int, float or str) is the option's type."""

    name: str
    default: bool | int | float | str
    doc: str
    env: str | None = None

    def resolve(self, provider: str, given: Any = None) -> Any:
        """The option's value: ``given``, else its environment variable, else the default."""
        kind = type(self.default)
        if given is None and self.env and os.environ.get(self.env) is not None:
            raw = os.environ[self.env].strip()
            where = f"environment variable {self.env}={raw!r}"
            if kind is bool:
                if raw.lower() not in ("0", "1", "false", "true", "off", "on"):
                    raise InvalidInputError(f"{where}: expected 0 or 1")
                return raw.lower() in ("1", "true", "on")
            try:
                return kind(raw)
            except ValueError:
                raise InvalidInputError(f"{where}: expected a {kind.__name__}") from None
        if given is None:
            return self.default
        ok = isinstance(given, kind) and (kind is not int or not isinstance(given, bool))
        if kind is float and isinstance(given, int) and not isinstance(given, bool):
            ok, given = True, float(given)
        if not ok:
            raise InvalidInputError(
                f"provider {provider!r} option {self.name!r} must be a {kind.__name__}, "
                f"got {given!r}"
            )
        return given


def _tensor_copy_adapter(copy: Callable[..., None]) -> Callable[..., None]:
    """A 1.0 ``copy(src: Tensor, dst: Tensor)`` called with arrays (the 1.1 verb)."""

    def adapted(self: ExecutionProvider, src: Any, dst: Any) -> None:
        copy(
            self,
            src if isinstance(src, Tensor) else self._tensor(src),
            dst if isinstance(dst, Tensor) else self._tensor(dst),
        )

    adapted.__doc__ = copy.__doc__
    return adapted


def _array_copy_adapter(copy: Callable[..., None]) -> Callable[..., None]:
    """A 1.1 ``copy(src, dst)`` on arrays, called by code still passing Tensors."""

    def adapted(self: ExecutionProvider, src: Any, dst: Any) -> None:
        copy(
            self,
            src.buffer if isinstance(src, Tensor) else src,
            dst.buffer if isinstance(dst, Tensor) else dst,
        )

    adapted.__doc__ = copy.__doc__
    return adapted


def resolve_options(
    provider: str, declared: Sequence[ProviderOption], given: Mapping[str, Any]
) -> dict[str, Any]:
    """Every declared option's value; an unknown name is refused with the known ones."""
    known = {o.name: o for o in declared}
    unknown = sorted(set(given) - set(known))
    if unknown:
        listed = ", ".join(sorted(known)) or "none"
        raise InvalidInputError(
            f"provider {provider!r} has no option {', '.join(map(repr, unknown))} "
            f"(its options: {listed})"
        )
    return {name: o.resolve(provider, given.get(name)) for name, o in known.items()}


class ExecutionProvider(ABC):
    """Runs kernels on one device.

    A provider knows devices, memory, kernels and graphs; it knows nothing of LLMs.

    Graphs: a provider that captures graphs overrides the ``graph_*`` hooks (which receive
    the slot and a part number) and declares its slots in ``GRAPH_SLOTS``; one that
    overrides the hooks without declaring slots holds ``PRIMARY``. Any slot not declared
    raises :class:`UnsupportedGraphSlot`. A capture error latches its slot until the slot
    is reset.
    """

    #: Registry name, for example ``"cpu"``.
    name: ClassVar[str] = ""
    #: Slots this provider holds graphs in; ``None`` means derive it from the hooks.
    GRAPH_SLOTS: ClassVar[frozenset[DeviceGraphSlot] | None] = None
    #: True when capturing runs the work too (CPU); False when it only records (CUDA).
    CAPTURE_EXECUTES: ClassVar[bool] = False
    #: Settings that choose kernel variants, fixed at construction (see :class:`ProviderOption`).
    OPTIONS: ClassVar[tuple[ProviderOption, ...]] = ()
    #: The queue this provider's work goes on (a CUDA stream), handed to kernels as
    #: ``KernelContext.stream``; None for a provider that runs each call at once.
    stream: Any = None

    def __init__(self, **options: Any) -> None:
        self._check_transfers()
        self._options = resolve_options(self.name, self.OPTIONS, options)
        self._capture_latch: dict[DeviceGraphSlot, str] = {}
        # Who captured each slot's graph (an executor); sessions sharing this provider
        # check it before a replay, so one never replays a graph another put in its slot.
        self._graph_owner: dict[DeviceGraphSlot, object] = {}
        self._capture_owner: object = None
        self._capturing: DeviceGraphSlot | None = None
        self._capturing_part = 0
        self._parts: dict[DeviceGraphSlot, set[int]] = {}
        #: Scratch memory for this provider's kernels (``KernelContext.scratch``).
        self.workspace = Workspace(self._allocate_workspace)

    def option(self, name: str) -> Any:
        """The value of one of this provider's :attr:`OPTIONS`."""
        options = self.__dict__.get("_options")
        if options is None:  # a subclass that did not call ExecutionProvider.__init__
            options = self._options = resolve_options(self.name, self.OPTIONS, {})
        try:
            return options[name]
        except KeyError:
            raise InvalidInputError(f"provider {self.name!r} has no option {name!r}") from None

    @property
    def options(self) -> dict[str, Any]:
        """Every option and its value."""
        return {o.name: self.option(o.name) for o in self.OPTIONS}

    # -- device and memory -------------------------------------------------
    # One currency: arrays of this provider (``ARRAY_TYPES``), which slice, ``.view`` and
    # ``.reshape`` like numpy's. Five verbs move data: ``empty`` (allocate), ``upload``
    # (host to device, new or in place), ``read`` (device to host now), ``read_later``
    # (device to host behind queued work) and ``copy`` (device to device). A provider
    # implements ``empty``, ``upload``, ``read`` and ``copy``; ``read_later`` has a
    # synchronous default. Everything runs on the provider's ``stream`` in order.
    @property
    @abstractmethod
    def device(self) -> Device:
        """The device this provider's memory lives on."""

    def empty(self, shape: Sequence[int], dtype: Any) -> Any:
        """An uninitialised array of this provider (``dtype``: anything ``np.dtype`` takes)."""
        self._require_legacy("empty")
        return type(self).__legacy__["allocate"](self, shape, DType.from_numpy(dtype)).buffer

    def upload(self, host: Any, out: Any = None) -> Any:
        """Host values onto this provider, returning the array that holds them: ``out`` (one
        of its arrays, written in place; ``host`` is broadcast and cast to it like
        ``np.copyto``) when given; else a new C-contiguous array, or, on a host provider,
        ``host`` itself when it already is one (do not write into it afterwards). An array of
        this provider passes through."""
        self._require_legacy("upload")
        legacy = type(self).__legacy__["copy_from_host"]
        host = np.require(host, requirements="C")
        return legacy(self, host, None if out is None else self._tensor(out)).buffer

    def read(self, arrays: Sequence[Any]) -> list[np.ndarray]:
        """Host copies of ``arrays`` (this provider's, or host arrays), after the work queued
        so far; a device provider waits once for all of them."""
        self._require_legacy("read")
        legacy = type(self).__legacy__["copy_to_host"]
        return [
            legacy(self, self._tensor(a)) if self.holds(a) else np.array(a, copy=True)
            for a in arrays
        ]

    #: Whether ``read_later`` returns before the values are ready (work queued on a stream).
    ASYNC_READS = False

    def read_later(self, arrays: Sequence[Any]) -> Callable[[], list[np.ndarray]]:
        """Queue host copies of ``arrays`` behind the work queued so far; the returned call
        waits for them and returns what ``read`` would have. Later work may be queued
        before that call. Synchronous providers read at once."""
        values = self.read(arrays)
        return lambda: values

    def copy(self, src: Any, dst: Any) -> None:
        """Device to device, ``src`` into ``dst`` (arrays of this provider, same shape and
        dtype), in stream order. Deprecated: :class:`Tensor` arguments are unwrapped."""
        raise NotImplementedError(f"provider {self.name!r} does not implement copy")

    # A 1.0 provider implements allocate / copy_from_host / copy_to_host and copy(Tensor,
    # Tensor); ``__init_subclass__`` keeps those as ``__legacy__`` and the verbs call them.
    __legacy__: ClassVar[dict[str, Callable[..., Any]]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        own = {n: cls.__dict__[n] for n in _LEGACY_TRANSFERS if n in cls.__dict__}
        aliases = [n for n in _ALIASES if n in cls.__dict__]
        verbs = [v for v in _VERBS if getattr(cls, v) is not getattr(ExecutionProvider, v)]
        if (own or aliases) and verbs:
            name = (list(own) + aliases)[0]
            raise TypeError(
                f"provider class {cls.__name__} overrides {name}, a provider API 1.0 name, "
                f"but implements the 1.1 verbs ({', '.join(verbs)}): override "
                f"{_ALIASES[name]} instead"
            )
        if own:
            cls.__legacy__ = {**cls.__legacy__, **own}
            for name in own:  # the 1.0 names become the base class's aliases of the verbs
                delattr(cls, name)
        if "copy" in cls.__dict__:  # 1.0 callers pass Tensors, 1.1 callers arrays
            adapt = _tensor_copy_adapter if cls.__legacy__ else _array_copy_adapter
            cls.copy = adapt(cls.__dict__["copy"])

    def _check_transfers(self) -> None:
        """TypeError naming the transfer verbs this provider class lacks (as an abstract
        method would, but a 1.0 provider's methods count)."""
        cls = type(self)
        missing = [
            f"{verb} (or 1.0 {old})"
            for old, verb in _LEGACY_TRANSFERS.items()
            if getattr(cls, verb) is getattr(ExecutionProvider, verb) and old not in cls.__legacy__
        ]
        if cls.copy is ExecutionProvider.copy:
            missing.append("copy")
        if missing:
            raise TypeError(
                f"provider class {cls.__name__} does not implement {', '.join(missing)}"
            )

    def _require_legacy(self, verb: str) -> None:
        """Refuse a verb that neither the provider nor its 1.0 method implements."""
        old = next(n for n, v in _LEGACY_TRANSFERS.items() if v == verb)
        if old not in type(self).__legacy__:
            raise NotImplementedError(
                f"provider {self.name!r} implements neither {verb} (API 1.1) nor {old} (1.0)"
            )

    def _tensor(self, array: Any) -> Tensor:
        return Tensor(array, DType.from_numpy(array.dtype), self.device)

    def synchronize(self) -> None:
        """Wait until all work queued on this provider's stream is done."""

    def memory_limit(self) -> int | None:
        """Bytes this provider can hold at most, for checks made before a large allocation
        (a KV cache); None when it does not say (its allocator reports what does not fit)."""
        return None

    def status_notes(self) -> tuple[str, ...]:
        """Short lines on what this instance uses, or leaves out and why (a feature its
        options ask for that the device or driver cannot give), shown by ``onnx-genrt
        providers``; none by default."""
        return ()

    #: The array types this provider's kernels take as they are (host numpy arrays by
    #: default; a device provider sets its own). Arrays must slice, ``.view(dtype)`` and
    #: ``.reshape(shape)`` like numpy's: the session carves planned buffers out of one arena.
    ARRAY_TYPES: tuple[type, ...] = (np.ndarray,)

    def holds(self, value: Any) -> bool:
        """Whether ``value`` is one of this provider's arrays (no transfer needed). The
        session asks this instead of comparing device names."""
        return isinstance(value, self.ARRAY_TYPES)

    def holds_dtype(self, dtype: np.dtype) -> bool:
        """Whether this provider's arrays can hold elements of ``dtype`` (bfloat16, int4,
        float8 and strings are numpy dtypes some devices' arrays lack). ``supports`` refuses
        a node whose known input types it cannot hold, so placement keeps it elsewhere
        (API 1.2; the default holds every dtype)."""
        return True

    def may_share_memory(self, a: Any, b: Any) -> bool:
        """Whether two of this provider's arrays may overlap (an output that is a view)."""
        if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
            return bool(np.may_share_memory(a, b))
        return False

    def host_value(self, array: Any) -> np.ndarray | None:
        """The host copy of one of this provider's arrays when it is known without a read
        (small integer inputs kept at upload: shapes, axes); None when it is not. Host
        providers return the array itself. Kernels ask through ``KernelContext.host_value``."""
        return array if isinstance(array, np.ndarray) else None

    def _allocate_workspace(self, nbytes: int) -> Any:
        return self.empty((nbytes,), np.uint8)

    # -- deprecated data movement: thin aliases of the verbs above, kept while the engine
    # and session move off them (each says which verb replaces it).
    def allocate(self, shape: Sequence[int], dtype: DType) -> Tensor:
        """Deprecated: ``Tensor(empty(shape, dtype.numpy), dtype, device)``."""
        return Tensor(self.empty(shape, dtype.numpy), dtype, self.device)

    def copy_from_host(self, array: np.ndarray, out: Tensor | None = None) -> Tensor:
        """Deprecated: ``upload(array, out)``; without ``out`` always a new array (``upload``
        may hand a host provider's array back as it is)."""
        if out is not None:
            self.upload(array, out.buffer)
            return out
        host = np.asarray(array)
        buf = self.upload(host, self.empty(host.shape, host.dtype))
        return Tensor(buf, DType.from_numpy(buf.dtype), self.device)

    def copy_to_host(self, tensor: Tensor, out: np.ndarray | None = None) -> np.ndarray:
        """Deprecated: ``read([tensor.buffer])[0]`` (copied into ``out`` when given)."""
        host = self.read([tensor.buffer])[0]
        if out is None:
            return host
        np.copyto(out, host)
        return out

    def as_array(self, host: np.ndarray) -> Any:
        """Deprecated: ``upload(host)``."""
        return self.upload(host)

    def write_from_host(self, buffer: Any, host: np.ndarray) -> None:
        """Deprecated: ``upload(host, out=buffer)``."""
        self.upload(host, buffer)

    def to_numpy(self, array: Any) -> np.ndarray:
        """Deprecated: ``read([array])[0]`` (a host array is returned as it is)."""
        if isinstance(array, np.ndarray):
            return array
        return self.read([array])[0]

    def to_numpy_many(self, arrays: Sequence[Any]) -> list[np.ndarray]:
        """Deprecated: ``read(arrays)``."""
        return self.read(arrays)

    def copy_array(self, src: Any, dst: Any) -> None:
        """Deprecated: ``copy(src, dst)``."""
        self.copy(src, dst)

    # -- kernels ------------------------------------------------------------
    @property
    @abstractmethod
    def kernels(self) -> KernelRegistry:
        """This provider's kernel registry."""

    def get_kernel(self, domain: str, op_type: str, opset: int) -> KernelDef | None:
        """The kernel for ``domain::op_type`` at ``opset`` (None when there is none)."""
        return self.kernels.lookup(domain, op_type, opset)

    def supports(
        self, node: NodeInfo, input_types: Sequence[TensorType | None] = ()
    ) -> tuple[bool, str]:
        """Whether this provider can run ``node`` given its inputs' types (a
        :class:`TensorType` or None per input); when not, the reason. Placement and every
        fusion ask this; the default asks the kernel's ``check``."""
        kdef = self.get_kernel(node.domain, node.op_type, node.opset)
        if kdef is None:
            versions = self.kernels.versions(node.domain, node.op_type)
            if versions:
                return False, (
                    f"{self.name}: {node.op_type} kernels start at opset {versions[0]}, "
                    f"model uses opset {node.opset}"
                )
            return False, f"{self.name}: no kernel for {node.domain or 'ai.onnx'}::{node.op_type}"
        for index, known in enumerate(input_types):
            if known is not None and known.dtype is not None and not self.holds_dtype(known.dtype):
                name = node.input_names[index] if index < len(node.input_names) else index
                return False, f"{self.name}: cannot hold {known.dtype} (input {name!r})"
        if kdef.check is not None:
            reason = kdef.check(node, input_types)
            if reason:
                return False, f"{self.name}: {reason}"
        return True, ""

    def launch(self, kdef: KernelDef, ctx: KernelContext, inputs: Sequence[Any]) -> Any:
        """Run one kernel on this provider's stream; while capturing, it is recorded."""
        return kdef.fn(ctx, *inputs)

    # -- graph slots (public, slot-aware) ----------------------------------
    # A provider holds graphs per slot. A session whose nodes all run here captures one
    # graph (part 0) per slot; one whose nodes alternate with another provider's captures
    # one part per contiguous run of this provider's nodes, all in the same slot. The base
    # class keeps the bookkeeping (latch, owner, parts); a provider implements the
    # ``graph_*`` hooks, which see the slot and the part.
    @property
    def graph_slots(self) -> frozenset[DeviceGraphSlot]:
        """Slots this provider can capture into."""
        if self.GRAPH_SLOTS is not None:
            return self.GRAPH_SLOTS
        if type(self).graph_begin is not ExecutionProvider.graph_begin:
            return frozenset({DeviceGraphSlot.PRIMARY})
        return frozenset()

    @property
    def graph_max_rows(self) -> int | None:
        """The most rows (M of a matrix product on a constant weight, batch dims folded in)
        this provider's kernels can record into a graph; None when any number can (API
        1.3). A session tells its callers through ``InferenceSession.graph_max_rows``, so an
        engine picks step widths that capture."""
        return None

    def check_slot(self, slot: DeviceGraphSlot) -> None:
        """Raise :class:`UnsupportedGraphSlot` unless this provider declares ``slot``."""
        if slot not in self.graph_slots:
            declared = ", ".join(sorted(s.value for s in self.graph_slots)) or "none"
            raise UnsupportedGraphSlot(
                f"provider {self.name!r} has no graph slot {slot.value!r} (declares: {declared})"
            )

    def capture_error(self, slot: DeviceGraphSlot) -> str | None:
        """Why the last capture in ``slot`` failed, if it did and was not reset since."""
        return self._capture_latch.get(slot)

    @property
    def capturing(self) -> DeviceGraphSlot | None:
        """The slot being captured now (None when none is)."""
        return self._capturing

    def graph_owner(self, slot: DeviceGraphSlot = DeviceGraphSlot.PRIMARY) -> object:
        """The ``owner`` given to the captures of the slot's current graph (None if none)."""
        return self._graph_owner.get(slot)

    def graph_parts(self, slot: DeviceGraphSlot = DeviceGraphSlot.PRIMARY) -> frozenset[int]:
        """The parts captured in ``slot`` since it was last reset."""
        return frozenset(self._parts.get(slot, ()))

    def begin_capture(
        self, slot: DeviceGraphSlot = DeviceGraphSlot.PRIMARY, owner: object = None, part: int = 0
    ) -> None:
        """Start recording part ``part`` of ``slot``'s graph.

        ``owner`` (a session's executor) is remembered with the slot. A capture by another
        owner first drops every part the slot held; the same owner may capture several
        parts, one after the other.
        """
        self.check_slot(slot)
        if slot in self._capture_latch:
            raise GraphCaptureError(
                f"slot {slot.value!r} is latched after a failed capture: "
                f"{self._capture_latch[slot]}; reset the slot first"
            )
        if self._capturing is not None:
            raise GraphCaptureError(
                f"cannot capture slot {slot.value!r} while slot {self._capturing.value!r} is capturing"
            )
        if self._graph_owner.get(slot, owner) is not owner:
            self._drop_parts(slot)
        collector_pause.hold()  # no finalizer of unrelated garbage runs inside the capture
        try:
            self.graph_begin(slot, part)
        except Exception as exc:
            collector_pause.release()
            self._capture_latch[slot] = f"{type(exc).__name__}: {exc}"
            raise GraphCaptureError(f"begin capture in slot {slot.value!r}: {exc}") from exc
        self._capturing = slot
        self._capturing_part = part
        self._capture_owner = owner
        self._graph_owner.pop(slot, None)
        self.workspace.pin(slot)  # until the slot is reset: its graphs may use the scratch

    def end_capture(self, slot: DeviceGraphSlot = DeviceGraphSlot.PRIMARY) -> None:
        """Finish the capture in ``slot``; the part becomes replayable, owned by the capture's owner."""
        self._require_capturing(slot)
        self._capturing = None
        part = self._capturing_part
        try:
            self.graph_end(slot, part)
        except Exception as exc:
            self._capture_latch[slot] = f"{type(exc).__name__}: {exc}"
            raise GraphCaptureError(f"end capture in slot {slot.value!r}: {exc}") from exc
        finally:
            collector_pause.release()
        self._graph_owner[slot] = self._capture_owner
        self._parts.setdefault(slot, set()).add(part)

    def abort_capture(
        self,
        slot: DeviceGraphSlot = DeviceGraphSlot.PRIMARY,
        reason: str = "aborted",
        *,
        latch: bool = True,
    ) -> None:
        """Stop a capture that failed part-way; the slot latches with ``reason``. With
        ``latch=False`` (a capture interrupted, not failed) the slot may capture again."""
        self.check_slot(slot)
        self._abandon_capture(slot)
        if latch:
            self._capture_latch[slot] = reason

    def _abandon_capture(self, slot: DeviceGraphSlot) -> None:
        """Discard the capture running in ``slot``, if one is, and release the collector."""
        if self._capturing == slot:
            self._capturing = None
            try:
                self.graph_abort(slot, self._capturing_part)
            finally:
                collector_pause.release()

    def replay(self, slot: DeviceGraphSlot = DeviceGraphSlot.PRIMARY, part: int = 0) -> None:
        """Run the graph captured as ``(slot, part)`` again."""
        self.check_slot(slot)
        if not self.graph_exists(slot, part):
            raise GraphCaptureError(
                f"slot {slot.value!r} holds no captured graph"
                + (f" part {part}" if part else "")
                + " to replay"
            )
        self.graph_replay(slot, part)

    def reset_graph(self, slot: DeviceGraphSlot = DeviceGraphSlot.PRIMARY) -> None:
        """Drop every part of the slot's graph and its capture latch. Other slots are
        untouched."""
        self.check_slot(slot)
        self._abandon_capture(slot)
        self._capture_latch.pop(slot, None)
        self._drop_parts(slot)
        self.workspace.unpin(slot)

    def reset_parts(self, slot: DeviceGraphSlot, parts: Iterable[int]) -> None:
        """Drop the given parts of the slot's graph; its other parts, owner and latch stay
        (a session keeps one graph per variant of a slot, and resets one variant)."""
        self.check_slot(slot)
        held = self._parts.get(slot, set())
        for part in sorted(p for p in held if p in parts):
            held.discard(part)
            self.graph_reset(slot, part)

    def has_graph(self, slot: DeviceGraphSlot = DeviceGraphSlot.PRIMARY, part: int = 0) -> bool:
        """Whether ``(slot, part)`` holds a captured graph."""
        self.check_slot(slot)
        return self.graph_exists(slot, part)

    def _drop_parts(self, slot: DeviceGraphSlot) -> None:
        self._graph_owner.pop(slot, None)
        for part in sorted(self._parts.pop(slot, {0})):
            self.graph_reset(slot, part)

    def _require_capturing(self, slot: DeviceGraphSlot) -> None:
        self.check_slot(slot)
        if self._capturing != slot:
            raise GraphCaptureError(f"slot {slot.value!r} is not capturing")

    # -- graph hooks: a provider that captures graphs overrides these ---------------
    # Each sees the slot and the part (0 unless the session alternates providers). A
    # provider that declares no GRAPH_SLOTS but overrides ``graph_begin`` holds PRIMARY.
    def graph_begin(self, slot: DeviceGraphSlot, part: int) -> None:
        """Start recording the work launched from now on as ``(slot, part)``."""
        raise UnsupportedGraphSlot(f"provider {self.name!r} does not capture graphs")

    def graph_end(self, slot: DeviceGraphSlot, part: int) -> None:
        """Finish the recording; it replaces any graph ``(slot, part)`` held."""
        raise UnsupportedGraphSlot(f"provider {self.name!r} does not capture graphs")

    def graph_abort(self, slot: DeviceGraphSlot, part: int) -> None:
        """Discard a partial recording."""

    def graph_replay(self, slot: DeviceGraphSlot, part: int) -> None:
        """Run the recorded work again, on the buffers it was recorded with."""
        raise UnsupportedGraphSlot(f"provider {self.name!r} does not capture graphs")

    def graph_reset(self, slot: DeviceGraphSlot, part: int) -> None:
        """Forget the graph of ``(slot, part)`` (a no-op when there is none)."""

    def graph_exists(self, slot: DeviceGraphSlot, part: int) -> bool:
        """Whether ``(slot, part)`` holds a graph."""
        return False
