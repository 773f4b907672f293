"""The execution-provider interface: memory, copies, kernels, streams and graph slots."""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from .device import Device
from .dtypes import DType
from .errors import GraphCaptureError, InvalidInputError, UnsupportedGraphSlot
from .graph_slots import DeviceGraphSlot
from .kernels import KernelContext, KernelDef, KernelRegistry, NodeInfo, TensorType
from .tensor import Tensor
from .workspace import StepWorkspace

#: The provider API this runtime implements, as (major, minor). A plugin states the version it
#: was written for in ``ProviderSpec.api_version``; it loads when the majors are equal and its
#: minor is not newer (as onnxruntime's plugin EPs report the ``ORT_API_VERSION`` they were
#: built with). A minor adds members with defaults; a major changes or removes them.
PROVIDER_API_VERSION: tuple[int, int] = (1, 0)


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

    def __init__(self, **options: Any) -> None:
        self._options = resolve_options(self.name, self.OPTIONS, options)
        self._capture_latch: dict[DeviceGraphSlot, str] = {}
        # Who captured each slot's graph (an executor); sessions sharing this provider
        # check it before a replay, so one never replays a graph another put in its slot.
        self._graph_owner: dict[DeviceGraphSlot, object] = {}
        self._capture_owner: object = None
        self._capturing: DeviceGraphSlot | None = None
        self._capturing_part = 0
        self._parts: dict[DeviceGraphSlot, set[int]] = {}
        self.workspace = StepWorkspace(self._allocate_workspace)

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
    @property
    @abstractmethod
    def device(self) -> Device:
        """The device this provider's memory lives on."""

    @abstractmethod
    def allocate(self, shape: Sequence[int], dtype: DType) -> Tensor:
        """Uninitialised device memory for a tensor."""

    @abstractmethod
    def copy_from_host(self, array: np.ndarray, out: Tensor | None = None) -> Tensor:
        """Host to device. Writes into ``out`` when given, else allocates."""

    @abstractmethod
    def copy_to_host(self, tensor: Tensor, out: np.ndarray | None = None) -> np.ndarray:
        """Device to host."""

    @abstractmethod
    def copy(self, src: Tensor, dst: Tensor) -> None:
        """Device to device, same shape and dtype."""

    def synchronize(self) -> None:
        """Wait until all work queued on this provider's stream is done."""

    def memory_limit(self) -> int | None:
        """Bytes this provider can hold at most, for checks made before a large allocation
        (a KV cache); None when it does not say (its allocator reports what does not fit)."""
        return None

    #: The array types this provider's kernels take as they are (host numpy arrays by
    #: default; a device provider sets its own). Arrays must slice, ``.view(dtype)`` and
    #: ``.reshape(shape)`` like numpy's: the session carves planned buffers out of one arena.
    ARRAY_TYPES: tuple[type, ...] = (np.ndarray,)

    def holds(self, value: Any) -> bool:
        """Whether ``value`` is one of this provider's arrays (no transfer needed). The
        session asks this instead of comparing device names."""
        return isinstance(value, self.ARRAY_TYPES)

    def may_share_memory(self, a: Any, b: Any) -> bool:
        """Whether two of this provider's arrays may overlap (an output that is a view)."""
        if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
            return bool(np.may_share_memory(a, b))
        return False

    def as_array(self, host: np.ndarray) -> Any:
        """Host array to this provider's array type (used for feeds and constants)."""
        return self.copy_from_host(np.require(host, requirements="C")).buffer

    def write_from_host(self, buffer: Any, host: np.ndarray) -> None:
        """Copy ``host`` into an existing buffer of this provider, in place (same shape)."""
        if isinstance(buffer, np.ndarray):
            np.copyto(buffer, host, casting="unsafe")
            return
        self.copy_from_host(host, Tensor(buffer, DType.from_numpy(buffer.dtype), self.device))

    def to_numpy(self, array: Any) -> np.ndarray:
        """This provider's array type to a host numpy array."""
        if isinstance(array, np.ndarray):
            return array
        return self.copy_to_host(Tensor(array, DType.from_numpy(array.dtype), self.device))

    def to_numpy_many(self, arrays: Sequence[Any]) -> list[np.ndarray]:
        """Several arrays to the host at once; a device provider waits only once for all."""
        return [np.array(self.to_numpy(a), copy=True) for a in arrays]

    #: Whether ``read_later`` returns before the values are ready (work queued on a stream).
    ASYNC_READS = False

    def read_later(self, arrays: Sequence[Any]) -> Callable[[], list[np.ndarray]]:
        """Queue host copies of ``arrays`` behind the work queued so far; the returned call
        waits for them. Later work may be queued before that call. Synchronous providers
        read at once."""
        values = self.to_numpy_many(arrays)
        return lambda: values

    def copy_array(self, src: Any, dst: Any) -> None:
        """Device to device between two of this provider's arrays (same shape and dtype)."""
        dt = DType.from_numpy(dst.dtype)
        self.copy(Tensor(src, dt, self.device), Tensor(dst, dt, self.device))

    def _allocate_workspace(self, nbytes: int) -> Any:
        return self.allocate((nbytes,), DType.UINT8).buffer

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
        try:
            self.graph_begin(slot, part)
        except Exception as exc:
            self._capture_latch[slot] = f"{type(exc).__name__}: {exc}"
            raise GraphCaptureError(f"begin capture in slot {slot.value!r}: {exc}") from exc
        self._capturing = slot
        self._capturing_part = part
        self._capture_owner = owner
        self._graph_owner.pop(slot, None)

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
        self._graph_owner[slot] = self._capture_owner
        self._parts.setdefault(slot, set()).add(part)

    def abort_capture(
        self, slot: DeviceGraphSlot = DeviceGraphSlot.PRIMARY, reason: str = "aborted"
    ) -> None:
        """Stop a capture that failed part-way; the slot latches with ``reason``."""
        self.check_slot(slot)
        if self._capturing == slot:
            self._capturing = None
            self.graph_abort(slot, self._capturing_part)
        self._capture_latch[slot] = reason

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
        if self._capturing == slot:
            self._capturing = None
            self.graph_abort(slot, self._capturing_part)
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
