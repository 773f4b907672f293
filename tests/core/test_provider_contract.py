"""The provider contract's 1.1 additions on providers written here: a provider written for
API 1.0 (allocate / copy_from_host / copy_to_host / copy on Tensors) still moves data
through the 1.1 verbs, a class with neither is refused at construction, and a device-graph
provider (one whose capture only records) refuses kernel allocations while it records."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from onnx_genrt.core.device import CPU, Device
from onnx_genrt.core.dtypes import DType
from onnx_genrt.core.errors import GraphCaptureError
from onnx_genrt.core.graph_slots import DeviceGraphSlot
from onnx_genrt.core.kernels import KernelContext, KernelRegistry, NodeInfo
from onnx_genrt.core.provider import ExecutionProvider
from onnx_genrt.core.tensor import Tensor

NODE = NodeInfo("Probe", "probe", "", 1, {}, ("x",), ("y",))


class Legacy10(ExecutionProvider):
    """A provider as API 1.0 asked for: four Tensor methods, and a device graph hook set
    that records nothing (capture does not execute)."""

    name = "legacy"
    GRAPH_SLOTS = frozenset({DeviceGraphSlot.PRIMARY})

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    @property
    def device(self) -> Device:
        return CPU

    @property
    def kernels(self) -> KernelRegistry:
        return KernelRegistry()

    def allocate(self, shape: Sequence[int], dtype: DType) -> Tensor:
        self.calls.append("allocate")
        return Tensor(np.full(tuple(shape), 7, dtype.numpy), dtype)

    def copy_from_host(self, array, out=None):
        self.calls.append("copy_from_host")
        if out is None:
            return Tensor.from_numpy(np.array(array))
        np.copyto(out.buffer, array)
        return out

    def copy_to_host(self, tensor, out=None):
        self.calls.append("copy_to_host")
        return np.array(tensor.buffer)

    def copy(self, src, dst):
        self.calls.append("copy")
        np.copyto(dst.buffer, src.buffer)  # Tensors, as 1.0 passed them

    def graph_begin(self, slot, part):
        pass

    def graph_end(self, slot, part):
        pass


def test_a_1_0_provider_moves_data_through_the_verbs():
    p = Legacy10()
    a = p.empty((2, 3), np.float32)
    assert a.shape == (2, 3) and a.dtype == np.float32 and (a == 7).all()
    b = p.upload(np.arange(6, dtype=np.float32).reshape(2, 3))
    p.upload(np.ones((2, 3), np.float32), out=a)
    p.copy(a, b)  # arrays: the adapter wraps them as the 1.0 method expects
    got = p.read([a, b, np.zeros(2)])
    np.testing.assert_array_equal(got[1], np.ones((2, 3)))
    np.testing.assert_array_equal(got[2], np.zeros(2))
    assert (
        p.calls == ["allocate", "copy_from_host", "copy_from_host", "copy"] + ["copy_to_host"] * 3
    )
    assert p.to_numpy(p.as_array(np.array([3]))).tolist() == [3]  # the 1.0 names too


def test_a_provider_without_transfers_is_refused_at_construction():
    class Nothing(ExecutionProvider):
        name = "nothing"
        device = CPU
        kernels = KernelRegistry()

    with pytest.raises(TypeError, match=r"Nothing does not implement empty \(or 1.0 allocate\)"):
        Nothing()


def test_kernel_context_of_a_device_graph_provider():
    p = Legacy10()
    ctx = KernelContext(NODE, p, [p.empty((4,), np.float32)])
    held = ctx.scratch(32)
    assert ctx.stream is None and not ctx.capturing
    assert ctx.host_value(p.upload(np.array([1, 2]))).tolist() == [1, 2]
    p.begin_capture(DeviceGraphSlot.PRIMARY)
    assert ctx.capturing and ctx.recording_addresses
    assert ctx.out(0, (4,), np.float32) is ctx.planned[0]  # planned: fine in a capture
    with pytest.raises(GraphCaptureError, match=r"'probe'.*output 1 \[3\] float32 has no plan"):
        ctx.out(1, (3,), np.float32)
    with pytest.raises(GraphCaptureError, match="scratch of 64 bytes needed while capturing"):
        ctx.scratch(64)
    assert np.shares_memory(ctx.scratch(16), held)
    p.end_capture(DeviceGraphSlot.PRIMARY)
    p.calls.clear()
    fresh = ctx.out(1, (3,), np.float32)  # outside a capture: the provider's own array
    assert p.calls == ["allocate"] and (fresh == 7).all()
    assert ctx.scratch(64).size == 64  # grows again once the capture is over
    assert p.workspace.retired == 1  # the graph captured on the old buffer keeps it alive
    p.reset_graph(DeviceGraphSlot.PRIMARY)
    assert p.workspace.retired == 0


def test_a_1_1_provider_subclass_overriding_a_1_0_name_is_refused():
    from onnx_genrt.providers.cpu.provider import CPUProvider

    with pytest.raises(TypeError, match="overrides as_array, a provider API 1.0 name.*upload"):

        class Stale(CPUProvider):
            def as_array(self, host):
                return host


def test_host_value_asks_the_provider_for_its_own_arrays():
    class Shadowing(Legacy10):
        def host_value(self, array):
            return np.array([4, 2]) if array == "device array" else None

    ctx = KernelContext(NODE, Shadowing())
    assert ctx.host_value("device array").tolist() == [4, 2]
    assert ctx.host_value("another") is None
    assert KernelContext(NODE).host_value("device array") is None  # no provider: unknown
    assert ctx.host_value((3, 1)).tolist() == [3, 1]  # host values as they are


def test_kernel_context_reads_provider_options():
    from onnx_genrt.providers.cpu.provider import CPUProvider

    ctx = KernelContext(NODE, CPUProvider(nbits_cache=True))
    assert ctx.option("nbits_cache", False) is True
    assert ctx.option("no_such_option", "fallback") == "fallback"
    assert KernelContext(NODE).option("nbits_cache", False) is False
    assert KernelContext(NODE, Legacy10()).option("nbits_cache", 3) == 3  # not its option
