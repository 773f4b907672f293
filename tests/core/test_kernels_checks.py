"""The kernel registry and the kernel context (``core.kernels``), found by a mutation run to
have no test of: a duplicate registration, the default version, membership, the message that
describes a node without a name, the prepacked weight's array look, and scratch memory
without a provider."""

from __future__ import annotations

import numpy as np
import pytest

from onnx_genrt.core.kernels import (
    KernelContext,
    KernelDef,
    KernelRegistry,
    NodeInfo,
    TransposedWeight,
)
from onnx_genrt.providers.cpu.provider import CPUProvider


def _kernel(ctx, x):
    return x


def _other(ctx, x):
    return -x


def test_an_op_registered_twice_at_one_version_is_refused():
    reg = KernelRegistry()
    reg.register("Twice", since=7)(_kernel)
    with pytest.raises(ValueError, match="kernel ::Twice since 7 registered twice"):
        reg.add(KernelDef("", "Twice", 7, _other))
    assert reg.lookup("", "Twice", 7).fn is _kernel
    reg.add(KernelDef("", "Twice", 9, _other))  # another version is another kernel
    assert reg.versions("", "Twice") == [7, 9]


def test_a_kernel_registered_without_a_version_serves_every_opset():
    reg = KernelRegistry()
    reg.register("Op")(_kernel)
    reg.register("Op", since=13)(_other)
    assert reg.versions("ai.onnx", "Op") == [1, 13]
    assert [reg.lookup("", "Op", v).fn for v in (1, 12, 13, 21)] == [
        _kernel,
        _kernel,
        _other,
        _other,
    ]
    assert reg.lookup("", "Op", 0) is None


def test_membership_takes_either_name_of_the_onnx_domain():
    reg = KernelRegistry()
    reg.register(["A", "B"], domain="ai.onnx")(_kernel)
    reg.register("A", domain="com.microsoft")(_kernel)
    assert ("", "A") in reg and ("ai.onnx", "B") in reg and ("com.microsoft", "A") in reg
    assert ("", "C") not in reg and ("com.microsoft", "B") not in reg
    assert len(reg) == 3 and reg.ops() == [("", "A"), ("", "B"), ("com.microsoft", "A")]


@pytest.mark.parametrize(
    ("name", "domain", "want"),
    [
        ("mm", "", "node 'mm' (ai.onnx::MatMul, opset 13)"),
        ("", "", "node '<unnamed>' (ai.onnx::MatMul, opset 13)"),
        ("q", "com.microsoft", "node 'q' (com.microsoft::MatMul, opset 13)"),
    ],
)
def test_a_node_is_described_by_its_name_or_as_unnamed(name, domain, want):
    assert NodeInfo("MatMul", name, domain, 13, {}).describe() == want


def test_a_prepacked_weight_looks_like_the_weight_it_packs():
    """Code that reads a constant's shape, dtype or rank gets the [K, N] weight's, not the
    transposed copy's."""
    weight = np.arange(12, dtype=np.float32).reshape(3, 4)  # [K, N]
    packed = TransposedWeight(np.ascontiguousarray(weight.T))
    assert packed.shape == weight.shape and packed.dtype == weight.dtype
    assert packed.ndim == weight.ndim
    np.testing.assert_array_equal(packed.t.T, weight)


@pytest.mark.parametrize("nbytes", [0, 1, 2, 100])
def test_scratch_without_a_provider_is_the_size_a_workspace_gives(nbytes):
    node = NodeInfo("Op", "op", "", 1, {})
    alone = KernelContext(node).scratch(nbytes)
    held = KernelContext(node, CPUProvider()).scratch(nbytes)
    assert alone.dtype == held.dtype == np.uint8
    assert alone.shape == held.shape == (max(nbytes, 1),)


def test_attributes_are_decoded_to_arrays_graphs_and_strings():
    """What kernels read from ``NodeInfo.attrs``: a tensor as a numpy array, a graph as the
    GraphProto, strings decoded; other values as onnx's helper gives them."""
    from onnx import helper, numpy_helper

    value = np.arange(6, dtype=np.float32).reshape(2, 3)
    branch = helper.make_graph([], "branch", [], [])
    proto = helper.make_node(
        "Op",
        ["x"],
        ["y"],
        name="n",
        value=numpy_helper.from_array(value),
        then_branch=branch,
        mode="nearest",
        names=["a", "bc"],
        alpha=0.5,
        axes=[1, -1],
    )
    attrs = NodeInfo.from_proto(proto, 7).attrs
    assert isinstance(attrs["value"], np.ndarray)
    np.testing.assert_array_equal(attrs["value"], value)
    assert attrs["then_branch"] == branch
    assert attrs["mode"] == "nearest"
    assert attrs["names"] == ["a", "bc"]
    assert attrs["alpha"] == 0.5
    assert attrs["axes"] == [1, -1]
    assert attrs["value"].dtype == np.float32


def test_out_returns_the_planned_buffer_only_when_it_fits():
    node = NodeInfo("Op", "n", "", 1, {})
    planned = np.zeros((2, 3), np.float32)
    ctx = KernelContext(node, None, [planned, None])
    assert ctx.out(0, (2, 3), np.float32) is planned
    for shape, dtype in [((3, 2), np.float32), ((2, 3), np.float16), ((6,), np.float32)]:
        got = ctx.out(0, shape, dtype)
        assert got is not planned and got.shape == shape and got.dtype == dtype
    strided = np.zeros((2, 6), np.float32)[:, ::2]
    ctx = KernelContext(node, None, [strided])
    got = ctx.out(0, (2, 3), np.float32)
    assert got is not strided and got.flags.c_contiguous
    assert KernelContext(node, None, [planned]).out(1, (2, 3), np.float32) is not planned
    assert KernelContext(node, None, [None]).out(0, (2, 3), np.float32).shape == (2, 3)
