"""What a kernel is handed (``KernelContext``) on the provider under test: its planned output
buffers or the provider's own arrays, scratch that stays put, host values of small inputs,
the provider's stream, and no allocation while a device graph records."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from onnx_genrt.core.errors import GraphCaptureError
from onnx_genrt.core.graph_slots import DeviceGraphSlot
from onnx_genrt.core.kernels import KernelContext, NodeInfo

from .plugin import KitTarget

NODE = NodeInfo("Probe", "probe", "", 1, {}, ("x",), ("y",))


@pytest.fixture
def provider(genrt_target: KitTarget) -> Any:
    return genrt_target.create()


def test_out_hands_over_a_fitting_planned_buffer_else_a_new_array(provider):
    planned = provider.empty((2, 3), np.float32)
    ctx = KernelContext(NODE, provider, [planned, None])
    assert ctx.out(0, (2, 3), np.float32) is planned
    for index, shape, dtype in (
        (0, (3, 2), np.float32),
        (0, (2, 3), np.int64),
        (1, (4,), np.int32),
    ):
        got = ctx.out(index, shape, dtype)
        assert got is not planned and provider.holds(got)
        assert tuple(got.shape) == shape and np.dtype(got.dtype) == np.dtype(dtype)


def test_scratch_is_the_providers_and_keeps_its_address(provider):
    ctx = KernelContext(NODE, provider)
    first = ctx.scratch(256)
    assert provider.holds(first) and first.size == 256 and np.dtype(first.dtype) == np.uint8
    again = KernelContext(NODE, provider).scratch(128)  # another kernel: the same memory
    assert provider.may_share_memory(first, again)
    assert provider.workspace.capacity >= 256


def test_host_value_of_small_inputs(provider):
    ctx = KernelContext(NODE, provider)
    shape = np.array([2, -1, 8], np.int64)
    np.testing.assert_array_equal(ctx.host_value(shape), shape)  # a host array as it is
    known = ctx.host_value(provider.upload(shape))
    if known is not None:  # a provider may not keep host copies; then kernels read back
        np.testing.assert_array_equal(known, shape)
    assert ctx.host_value(None) is None


def test_stream_is_the_providers(provider):
    assert KernelContext(NODE, provider).stream is provider.stream
    assert KernelContext(NODE).stream is None


def test_no_allocation_while_a_device_graph_records(provider):
    slot = DeviceGraphSlot.DRAFT
    if slot not in provider.graph_slots:
        pytest.skip(f"{provider.name!r} holds no graph in the DRAFT slot")
    ctx = KernelContext(NODE, provider)
    ctx.scratch(64)
    provider.begin_capture(slot)
    try:
        assert ctx.capturing
        if provider.CAPTURE_EXECUTES:  # a host recording keeps its arrays alive: fine
            assert provider.holds(ctx.out(0, (2,), np.float32))
        else:
            with pytest.raises(GraphCaptureError, match="has no planned buffer"):
                ctx.out(0, (2,), np.float32)
            with pytest.raises(GraphCaptureError, match="needed while capturing"):
                ctx.scratch(1 << 20)
        assert ctx.scratch(64).size == 64  # what is held already may be used
    finally:
        provider.abort_capture(slot)
        provider.reset_graph(slot)
    assert not ctx.capturing
