"""The provider interface's slot-aware graph methods."""

from __future__ import annotations

import gc
from collections.abc import Sequence

import numpy as np
import pytest

from onnx_genrt.core import collector_pause
from onnx_genrt.core.device import CPU, Device
from onnx_genrt.core.dtypes import DType
from onnx_genrt.core.errors import GraphCaptureError, UnsupportedGraphSlot
from onnx_genrt.core.graph_slots import DeviceGraphSlot
from onnx_genrt.core.kernels import KernelContext, KernelDef, KernelRegistry, NodeInfo
from onnx_genrt.core.provider import ExecutionProvider
from onnx_genrt.core.tensor import Tensor
from onnx_genrt.core.workspace import Workspace
from onnx_genrt.providers.cpu.provider import CPUProvider

PRIMARY, VERIFY, DRAFT = DeviceGraphSlot.PRIMARY, DeviceGraphSlot.VERIFY, DeviceGraphSlot.DRAFT


class _HostBase(ExecutionProvider):
    name = "host-test"

    @property
    def device(self) -> Device:
        return CPU

    @property
    def kernels(self) -> KernelRegistry:
        return KernelRegistry()

    def allocate(self, shape: Sequence[int], dtype: DType) -> Tensor:
        return Tensor(np.empty(tuple(shape), dtype.numpy), dtype)

    def copy_from_host(self, array, out=None):
        return Tensor.from_numpy(np.array(array))

    def copy_to_host(self, tensor, out=None):
        return np.array(tensor.buffer)

    def copy(self, src, dst):
        np.copyto(dst.buffer, src.buffer)


class NoGraphProvider(_HostBase):
    """Implements no graph hooks at all."""


class SingleGraphProvider(_HostBase):
    """Implements the hooks for one graph, as most devices would."""

    def __init__(self) -> None:
        super().__init__()
        self.graph: str | None = None
        self.replayed = 0
        self.fail_next_end = False

    def graph_begin(self, slot, part):
        assert slot is PRIMARY
        self.graph = "capturing"

    def graph_end(self, slot, part):
        if self.fail_next_end:
            raise RuntimeError("driver refused the graph")
        self.graph = "ready"

    def graph_replay(self, slot, part):
        self.replayed += 1

    def graph_reset(self, slot, part):
        self.graph = None

    def graph_exists(self, slot, part):
        return self.graph == "ready"


def test_provider_without_graphs_declares_no_slots_and_refuses_capture():
    p = NoGraphProvider()
    assert p.graph_slots == frozenset()
    with pytest.raises(UnsupportedGraphSlot, match="no graph slot 'primary'"):
        p.begin_capture(PRIMARY)


def test_single_graph_provider_gets_primary_by_default_and_refuses_other_slots():
    p = SingleGraphProvider()
    assert p.graph_slots == frozenset({PRIMARY})
    p.begin_capture()  # PRIMARY by default
    p.end_capture()
    assert p.graph_parts(PRIMARY) == {0}
    p.replay(PRIMARY)
    assert p.replayed == 1
    for slot in (VERIFY, DRAFT):
        with pytest.raises(
            UnsupportedGraphSlot, match=f"no graph slot '{slot.value}'.*declares: primary"
        ):
            p.begin_capture(slot)
        with pytest.raises(UnsupportedGraphSlot):
            p.replay(slot)
        with pytest.raises(UnsupportedGraphSlot):
            p.reset_graph(slot)


def test_capture_error_latches_until_reset():
    p = SingleGraphProvider()
    p.fail_next_end = True
    p.begin_capture(PRIMARY)
    with pytest.raises(GraphCaptureError, match="driver refused"):
        p.end_capture(PRIMARY)
    assert "driver refused" in p.capture_error(PRIMARY)
    p.fail_next_end = False
    with pytest.raises(GraphCaptureError, match="latched"):
        p.begin_capture(PRIMARY)
    p.reset_graph(PRIMARY)
    assert p.capture_error(PRIMARY) is None
    p.begin_capture(PRIMARY)
    p.end_capture(PRIMARY)
    assert p.graph_parts(PRIMARY) == {0}


def test_replay_without_graph_is_an_error():
    p = CPUProvider()
    with pytest.raises(GraphCaptureError, match="holds no captured graph"):
        p.replay(VERIFY)


def _scale_kernel() -> KernelDef:
    def scale(ctx, x, out):
        np.multiply(x, ctx.attr("k"), out=out)
        return out

    return KernelDef("", "Scale", 1, scale)


def _record(
    p: CPUProvider, slot: DeviceGraphSlot, k: float, x: np.ndarray, out: np.ndarray
) -> None:
    p.begin_capture(slot)
    ctx = KernelContext(NodeInfo("Scale", f"scale{k}", "", 1, {"k": k}))
    p.launch(_scale_kernel(), ctx, [x, out])
    p.end_capture(slot)


def test_cpu_slots_are_independent_resetting_one_leaves_the_others():
    p = CPUProvider()
    assert p.graph_slots == frozenset(DeviceGraphSlot)
    x = np.ones(4, np.float32)
    out_p, out_v, out_d = (np.zeros(4, np.float32) for _ in range(3))
    _record(p, PRIMARY, 2.0, x, out_p)
    _record(p, VERIFY, 3.0, x, out_v)
    _record(p, DRAFT, 5.0, x, out_d)
    x[:] = 10.0
    p.reset_graph(VERIFY)
    assert not p.has_graph(VERIFY)
    assert p.has_graph(PRIMARY) and p.has_graph(DRAFT)
    p.replay(PRIMARY)
    p.replay(DRAFT)
    np.testing.assert_array_equal(out_p, np.full(4, 20.0))
    np.testing.assert_array_equal(out_d, np.full(4, 50.0))
    np.testing.assert_array_equal(out_v, np.full(4, 3.0))  # not replayed after reset


def test_latch_is_per_slot():
    p = CPUProvider()
    p.begin_capture(VERIFY)
    p.abort_capture(VERIFY, "kernel not capturable")
    assert p.capture_error(VERIFY) == "kernel not capturable"
    assert p.capture_error(PRIMARY) is None
    x, out = np.ones(2, np.float32), np.zeros(2, np.float32)
    _record(p, PRIMARY, 4.0, x, out)  # PRIMARY still captures
    assert p.graph_parts(PRIMARY) == {0}
    with pytest.raises(GraphCaptureError, match="kernel not capturable"):
        p.begin_capture(VERIFY)
    p.reset_graph(VERIFY)
    _record(p, VERIFY, 4.0, x, out)
    assert p.has_graph(VERIFY)


def test_cannot_capture_two_slots_at_once():
    p = CPUProvider()
    p.begin_capture(PRIMARY)
    with pytest.raises(GraphCaptureError, match="while slot 'primary' is capturing"):
        p.begin_capture(VERIFY)
    p.abort_capture(PRIMARY)


def _counting_workspace() -> tuple[Workspace, list[np.ndarray]]:
    allocations: list[np.ndarray] = []

    def allocate(n):
        buf = np.zeros(n, np.uint8)
        allocations.append(buf)
        return buf

    return Workspace(allocate), allocations


def test_workspace_grows_and_hands_out_views_of_one_buffer():
    ws, allocations = _counting_workspace()
    a = ws.acquire(64)
    b = ws.acquire(32)
    assert a.size == 64 and b.size == 32 and np.shares_memory(a, b) and len(allocations) == 1
    c = ws.acquire(100)  # at least doubles: the next few requests fit
    assert c.size == 100 and ws.capacity == 128 and len(allocations) == 2
    assert ws.retired == 0  # nothing pinned: the old buffer is simply dropped


def test_a_pinned_workspace_retires_a_replaced_buffer_until_unpinned():
    ws, allocations = _counting_workspace()
    small = ws.acquire(64)
    ws.pin(PRIMARY)
    bigger = ws.acquire(4096)  # an eager larger step while a graph holds the small one
    assert bigger.size == 4096 and not np.shares_memory(bigger, small)
    assert ws.retired == 1  # kept alive: the captured graph still writes into it
    ws.unpin(PRIMARY)
    assert ws.retired == 0 and not ws.pinned


def test_workspace_does_not_move_while_a_device_graph_records():
    ws, _ = _counting_workspace()
    ws.acquire(64)
    assert ws.acquire(64, frozen=True).size == 64
    with pytest.raises(GraphCaptureError, match="scratch of 65 bytes needed while capturing"):
        ws.acquire(65, frozen=True)


def test_capture_pins_the_scratch_and_reset_unpins_it():
    p = CPUProvider()
    p.begin_capture(PRIMARY)
    p.end_capture(PRIMARY)
    assert p.workspace.pinned
    p.reset_graph(PRIMARY)
    assert not p.workspace.pinned


def test_resetting_one_slot_leaves_another_slots_latch_and_graph():
    p = CPUProvider()
    x, out_d = np.ones(3, np.float32), np.zeros(3, np.float32)
    _record(p, DRAFT, 6.0, x, out_d)
    for slot in (PRIMARY, VERIFY):
        p.begin_capture(slot)
        p.abort_capture(slot, f"{slot.value} kernel not capturable")
    p.reset_graph(VERIFY)
    assert p.capture_error(VERIFY) is None
    assert p.capture_error(PRIMARY) == "primary kernel not capturable"
    with pytest.raises(GraphCaptureError, match="primary kernel not capturable"):
        p.begin_capture(PRIMARY)
    assert p.has_graph(DRAFT)
    x[:] = 2.0
    p.replay(DRAFT)
    np.testing.assert_array_equal(out_d, np.full(3, 12.0))


class RecordingProvider(SingleGraphProvider):
    """Records the abort hook; its begin hook can be made to fail."""

    def __init__(self) -> None:
        super().__init__()
        self.aborted = 0
        self.fail_next_begin = False

    def graph_begin(self, slot, part):
        if self.fail_next_begin:
            raise RuntimeError("stream is busy")
        super().graph_begin(slot, part)

    def graph_abort(self, slot, part):
        self.aborted += 1
        self.graph = None


def test_a_failing_begin_latches_the_slot_and_starts_no_capture():
    p = RecordingProvider()
    p.fail_next_begin = True
    with pytest.raises(GraphCaptureError, match="begin capture in slot 'primary': stream is busy"):
        p.begin_capture(PRIMARY)
    assert p.capturing is None
    assert p.capture_error(PRIMARY) == "RuntimeError: stream is busy"


def test_reset_while_capturing_aborts_the_capture_and_unpins_the_workspace():
    p = RecordingProvider()
    p.begin_capture(PRIMARY, owner="session-a")
    p.workspace.acquire(64)
    p.workspace.pin(PRIMARY)
    p.reset_graph(PRIMARY)
    assert p.aborted == 1 and p.capturing is None
    assert not p.workspace.pinned
    p.begin_capture(PRIMARY, owner="session-b")  # not "while ... is capturing"
    p.end_capture(PRIMARY)
    assert p.graph_owner(PRIMARY) == "session-b"


def test_graph_owner_is_forgotten_when_the_slot_is_reset_or_recaptured():
    p = RecordingProvider()
    p.begin_capture(PRIMARY, owner="session-a")
    p.end_capture(PRIMARY)
    assert p.graph_owner(PRIMARY) == "session-a"
    p.begin_capture(PRIMARY, owner="session-b")  # replacing the graph: no owner until done
    assert p.graph_owner(PRIMARY) is None
    p.abort_capture(PRIMARY, "kernel not capturable")
    assert p.aborted == 1 and p.graph_owner(PRIMARY) is None
    p.reset_graph(PRIMARY)
    p.begin_capture(PRIMARY, owner="session-c")
    p.end_capture(PRIMARY)
    p.reset_graph(PRIMARY)
    assert p.graph_owner(PRIMARY) is None


def test_abort_capture_refuses_an_undeclared_slot():
    p = RecordingProvider()
    with pytest.raises(UnsupportedGraphSlot, match="no graph slot 'verify'"):
        p.abort_capture(VERIFY, "x")
    assert p.capture_error(VERIFY) is None


class _Cycle:
    """Cyclic garbage whose finalizer notes whether a capture was running then."""

    def __init__(self, seen: list[bool], provider: ExecutionProvider) -> None:
        self.me, self.seen, self.provider = self, seen, provider

    def __del__(self) -> None:
        self.seen.append(self.provider.capturing is not None)


def test_no_finalizer_of_cyclic_garbage_runs_inside_a_capture(eager_collector):
    p = RecordingProvider()
    seen: list[bool] = []
    p.begin_capture(PRIMARY)
    assert not gc.isenabled()
    for _ in range(50):  # garbage made and allocations that would trigger the collector
        _Cycle(seen, p)
        [object() for _ in range(20)]
    assert seen == []
    p.end_capture(PRIMARY)
    assert gc.isenabled()
    gc.collect()
    assert seen and not any(seen)  # collected after the capture, none inside it


def test_the_collector_comes_back_after_a_failed_begin_end_or_an_abort(eager_collector):
    p = RecordingProvider()
    p.fail_next_begin = True
    with pytest.raises(GraphCaptureError):
        p.begin_capture(PRIMARY)
    assert gc.isenabled() and collector_pause.held() == 0
    p.fail_next_begin = False
    p.reset_graph(PRIMARY)
    p.fail_next_end = True
    p.begin_capture(PRIMARY)
    with pytest.raises(GraphCaptureError):
        p.end_capture(PRIMARY)
    assert gc.isenabled() and collector_pause.held() == 0
    p.fail_next_end = False
    p.reset_graph(PRIMARY)
    p.begin_capture(PRIMARY)
    p.abort_capture(PRIMARY, "a kernel refused the stream")
    assert gc.isenabled() and collector_pause.held() == 0
    p.reset_graph(PRIMARY)
    p.begin_capture(PRIMARY)
    p.reset_graph(PRIMARY)  # a reset while capturing aborts it
    assert gc.isenabled() and collector_pause.held() == 0


def test_overlapping_captures_hold_the_collector_until_the_last_ends(eager_collector):
    a, b = RecordingProvider(), RecordingProvider()
    a.begin_capture(PRIMARY)
    b.begin_capture(PRIMARY)
    assert collector_pause.held() == 2
    a.end_capture(PRIMARY)
    assert not gc.isenabled()
    b.end_capture(PRIMARY)
    assert gc.isenabled() and collector_pause.held() == 0


def test_a_collector_the_user_turned_off_stays_off(eager_collector):
    gc.disable()
    p = RecordingProvider()
    p.begin_capture(PRIMARY)
    p.end_capture(PRIMARY)
    assert not gc.isenabled()
    collector_pause.release()  # a release without a hold does nothing
    assert not gc.isenabled() and collector_pause.held() == 0


def test_an_abort_without_latch_leaves_the_slot_free_to_capture(eager_collector):
    p = RecordingProvider()
    p.begin_capture(PRIMARY)
    p.abort_capture(PRIMARY, "interrupted", latch=False)
    assert p.capture_error(PRIMARY) is None and p.capturing is None
    assert gc.isenabled() and collector_pause.held() == 0
    p.begin_capture(PRIMARY)
    p.end_capture(PRIMARY)
    assert p.graph_parts(PRIMARY) == {0}
    p.begin_capture(PRIMARY, part=1)
    p.abort_capture(PRIMARY, "a kernel refused the stream")
    assert p.capture_error(PRIMARY) == "a kernel refused the stream"
