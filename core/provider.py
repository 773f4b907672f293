"""The execution-provider interface: memory, copies, kernels, streams and graph slots."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import numpy as np

from .device import Device
from .dtypes import DType
from .errors import GraphCaptureError, UnsupportedGraphSlot
from .graph_slots import DeviceGraphSlot
from .kernels import KernelContext, KernelDef, KernelRegistry, NodeInfo
from .tensor import Tensor
from .workspace import StepWorkspace

#: The provider API this runtime implements, as (major, minor). A plugin states the version it
#: was written for in ``ProviderSpec.api_version``; it loads when the majors are equal and its
#: minor is not newer (as onnxruntime's plugin EPs report the ``ORT_API_VERSION`` they were
#: built with). A minor adds members with defaults; a major changes or removes them.
PROVIDER_API_VERSION: tuple[int, int] = (1, 0)


class ExecutionProvider(ABC):
    """Runs kernels on one device.

    A provider knows devices, memory, kernels and graphs; it knows nothing of LLMs.

    Graphs: a provider that holds a single graph overrides the ``_graph_*`` hooks and is
    routed ``PRIMARY`` by default. One that holds several declares them in ``GRAPH_SLOTS``
    and receives the slot in each hook. Any slot not declared raises
    :class:`UnsupportedGraphSlot`. A capture error latches its slot until the slot is reset.
    """

    #: Registry name, for example ``"cpu"``.
    name: ClassVar[str] = ""
    #: Slots this provider holds graphs in; ``None`` means derive it from the hooks.
    GRAPH_SLOTS: ClassVar[frozenset[DeviceGraphSlot] | None] = None
    #: True when capturing runs the work too (CPU); False when it only records (CUDA).
    CAPTURE_EXECUTES: ClassVar[bool] = False

    def __init__(self) -> None:
        self._capture_latch: dict[DeviceGraphSlot, str] = {}
        # Who captured each slot's graph (an executor); sessions sharing this provider
        # check it before a replay, so one never replays a graph another put in its slot.
        self._graph_owner: dict[DeviceGraphSlot, object] = {}
        self._capture_owner: object = None
        self._capturing: DeviceGraphSlot | None = None
        self.workspace = StepWorkspace(self._allocate_workspace)

    # -- device and memory -------------------------------------------------
    @property
    @abstractmethod
    def device(self) -> Device: ...

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
    def kernels(self) -> KernelRegistry: ...

    def get_kernel(self, domain: str, op_type: str, opset: int) -> KernelDef | None:
        return self.kernels.lookup(domain, op_type, opset)

    def supports(self, node: NodeInfo, input_types: Sequence[Any] = ()) -> tuple[bool, str]:
        """Whether this provider can run ``node``; when not, the reason."""
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
    @property
    def graph_slots(self) -> frozenset[DeviceGraphSlot]:
        """Slots this provider can capture into."""
        if self.GRAPH_SLOTS is not None:
            return self.GRAPH_SLOTS
        if type(self)._graph_begin is not ExecutionProvider._graph_begin:
            return frozenset({DeviceGraphSlot.PRIMARY})
        return frozenset()

    def check_slot(self, slot: DeviceGraphSlot) -> None:
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
        return self._capturing

    def graph_owner(self, slot: DeviceGraphSlot = DeviceGraphSlot.PRIMARY) -> object:
        """The ``owner`` given to the capture of the slot's current graph (None if none)."""
        return self._graph_owner.get(slot)

    def begin_capture(
        self, slot: DeviceGraphSlot = DeviceGraphSlot.PRIMARY, owner: object = None
    ) -> None:
        """Start recording into ``slot``; ``owner`` (a session's executor) is remembered with
        the graph, replacing any graph the slot held."""
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
        try:
            self._graph_begin(slot)
        except Exception as exc:
            self._capture_latch[slot] = f"{type(exc).__name__}: {exc}"
            raise GraphCaptureError(f"begin capture in slot {slot.value!r}: {exc}") from exc
        self._capturing = slot
        self._capture_owner = owner
        self._graph_owner.pop(slot, None)

    def end_capture(self, slot: DeviceGraphSlot = DeviceGraphSlot.PRIMARY) -> None:
        self._require_capturing(slot)
        self._capturing = None
        try:
            self._graph_end(slot)
        except Exception as exc:
            self._capture_latch[slot] = f"{type(exc).__name__}: {exc}"
            raise GraphCaptureError(f"end capture in slot {slot.value!r}: {exc}") from exc
        self._graph_owner[slot] = self._capture_owner

    def abort_capture(
        self, slot: DeviceGraphSlot = DeviceGraphSlot.PRIMARY, reason: str = "aborted"
    ) -> None:
        """Stop a capture that failed part-way; the slot latches with ``reason``."""
        self.check_slot(slot)
        if self._capturing == slot:
            self._capturing = None
            self._graph_abort(slot)
        self._capture_latch[slot] = reason

    def replay(self, slot: DeviceGraphSlot = DeviceGraphSlot.PRIMARY) -> None:
        self.check_slot(slot)
        if not self._graph_exists(slot):
            raise GraphCaptureError(f"slot {slot.value!r} holds no captured graph to replay")
        self._graph_replay(slot)

    def reset_graph(self, slot: DeviceGraphSlot = DeviceGraphSlot.PRIMARY) -> None:
        """Drop the slot's graph and its capture latch. Other slots are untouched."""
        self.check_slot(slot)
        if self._capturing == slot:
            self._capturing = None
            self._graph_abort(slot)
        self._capture_latch.pop(slot, None)
        self._graph_owner.pop(slot, None)
        self._graph_reset(slot)
        self.workspace.unpin(slot)

    def has_graph(self, slot: DeviceGraphSlot = DeviceGraphSlot.PRIMARY) -> bool:
        self.check_slot(slot)
        return self._graph_exists(slot)

    def _require_capturing(self, slot: DeviceGraphSlot) -> None:
        self.check_slot(slot)
        if self._capturing != slot:
            raise GraphCaptureError(f"slot {slot.value!r} is not capturing")

    # -- graph hooks (override; single-graph providers ignore ``slot``) ------
    def _graph_begin(self, slot: DeviceGraphSlot) -> None:
        raise UnsupportedGraphSlot(f"provider {self.name!r} does not capture graphs")

    def _graph_end(self, slot: DeviceGraphSlot) -> None:
        raise UnsupportedGraphSlot(f"provider {self.name!r} does not capture graphs")

    def _graph_abort(self, slot: DeviceGraphSlot) -> None:
        """Discard a partial capture."""

    def _graph_replay(self, slot: DeviceGraphSlot) -> None:
        raise UnsupportedGraphSlot(f"provider {self.name!r} does not capture graphs")

    def _graph_reset(self, slot: DeviceGraphSlot) -> None:
        """Forget the slot's graph."""

    def _graph_exists(self, slot: DeviceGraphSlot) -> bool:
        return False
