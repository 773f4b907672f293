"""Which constants ``session.constant_cache`` keeps on the host and which it releases after
prepacking (found by a mutation run: a weight read both prepacked and as it is, a prepacked
graph output, and the refusal to hand out a released constant had no test). Results are
checked against numpy float64."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_genrt.core.kernels import KernelRegistry
from onnx_genrt.providers.cpu.provider import CPUProvider
from onnx_genrt.session import InferenceSession
from onnx_genrt.session.constant_cache import ReleasedConstant
from tests.models import cpu_kernels

ROWS, K, N = 3, 6, 4


@dataclass(frozen=True)
class Transposed:
    """A weight in a kernel's own layout: its transpose."""

    t: np.ndarray


def _prepack(provider, node, index, host):
    """MatMul's weight (input 1) transposed, unless the node's name says to decline."""
    if index != 1 or node.name.startswith("plain"):
        return None
    return Transposed(np.ascontiguousarray(host.T))


def _matmul(ctx, a, b):
    return a @ (b.t.T if isinstance(b, Transposed) else b)


class PackingCPU(CPUProvider):
    """The CPU provider whose MatMul kernel reads its weight transposed (prepacked)."""

    name = "packing-cpu"

    @functools.cached_property
    def kernels(self) -> KernelRegistry:
        reg = cpu_kernels(lambda domain, op: (domain, op) == ("", "MatMul"))
        reg.register("MatMul", since=1, prepack=_prepack)(_matmul)
        return reg


def _weight() -> np.ndarray:
    return np.arange(K * N, dtype=np.float32).reshape(K, N) / 10 - 1


def _model(nodes: list[onnx.NodeProto], outputs: list[str]) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "constants",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [ROWS, K])],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs],
        [numpy_helper.from_array(_weight(), "W")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _x() -> np.ndarray:
    return np.random.default_rng(0).standard_normal((ROWS, K)).astype(np.float32)


def test_a_weight_read_only_prepacked_is_released_and_never_handed_out_as_it_is():
    sess = InferenceSession(
        _model([helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")], ["y"]),
        providers=[PackingCPU()],
    )
    constants = sess.executor.constants
    released = sess.plan.constants["W"]
    assert isinstance(released, ReleasedConstant)
    assert (released.shape, released.dtype, released.ndim) == ((K, N), np.float32, 2)
    assert constants.plain_names() == set()
    assert [type(v) for v in constants.values()] == [Transposed]
    with pytest.raises(RuntimeError, match="constant 'W' was released after prepacking"):
        constants.host("W")
    x = _x()
    (y,) = sess.run(["y"], {"x": x})
    np.testing.assert_allclose(y, x.astype(np.float64) @ _weight(), rtol=1e-5, atol=1e-5)


def test_a_weight_also_read_as_it_is_stays_on_the_host():
    """``W`` is read prepacked by a MatMul and as it is by an Add: both layouts exist, and
    the host array is kept (whichever reader comes last)."""
    for order in (1, -1):
        nodes = [
            helper.make_node("MatMul", ["x", "W"], ["y"], name="mm"),
            helper.make_node("Add", ["v", "W"], ["z"], name="add"),
        ][::order]
        model = _model(nodes, ["y", "z"])
        model.graph.input.append(helper.make_tensor_value_info("v", TensorProto.FLOAT, [K, N]))
        sess = InferenceSession(model, providers=[PackingCPU()])
        constants = sess.executor.constants
        assert constants.plain_names() == {"W"}
        np.testing.assert_array_equal(constants.host("W"), _weight())
        assert sorted(type(v).__name__ for v in constants.values()) == ["Transposed", "ndarray"]
        x, v = _x(), np.full((K, N), 0.5, np.float32)
        y, z = sess.run(["y", "z"], {"x": x, "v": v})
        np.testing.assert_allclose(y, x.astype(np.float64) @ _weight(), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(z, _weight().astype(np.float64) + 0.5, rtol=1e-6)


def test_a_declined_prepack_reads_the_weight_as_it_is():
    sess = InferenceSession(
        _model([helper.make_node("MatMul", ["x", "W"], ["y"], name="plain_mm")], ["y"]),
        providers=[PackingCPU()],
    )
    constants = sess.executor.constants
    assert constants.plain_names() == {"W"}
    assert [type(v).__name__ for v in constants.values()] == ["ndarray"]
    np.testing.assert_array_equal(constants.host("W"), _weight())
    x = _x()
    (y,) = sess.run(["y"], {"x": x})
    np.testing.assert_allclose(y, x.astype(np.float64) @ _weight(), rtol=1e-5, atol=1e-5)


def test_a_prepacked_weight_that_is_a_graph_output_is_kept():
    sess = InferenceSession(
        _model([helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")], ["y", "W"]),
        providers=[PackingCPU()],
    )
    assert sess.executor.constants.plain_names() == set()
    x = _x()
    y, w = sess.run(["y", "W"], {"x": x})
    np.testing.assert_array_equal(w, _weight())
    np.testing.assert_allclose(y, x.astype(np.float64) @ _weight(), rtol=1e-5, atol=1e-5)
