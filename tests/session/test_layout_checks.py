"""Memory layouts planned from a first run (``session.layout``): which values get arena
buffers, how long views keep their roots, bound outputs copied to another provider (found by
a mutation run; the first test is a bug it led to: a graph output that is a view of an
intermediate was overwritten by later steps on every planned eager run). Every value is
checked against numpy float64."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_genrt.core.errors import KernelError
from onnx_genrt.core.kernels import KernelRegistry
from onnx_genrt.providers.cpu.kernels import REGISTRY
from onnx_genrt.providers.cpu.provider import CPUProvider
from onnx_genrt.session import InferenceSession

from .test_mixed_placement import Island, Mainland

F = TensorProto.FLOAT


def _model(nodes, outputs: dict[str, list[int]], inits=()) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "layout",
        [helper.make_tensor_value_info("x", F, [4, 8])],
        [helper.make_tensor_value_info(n, F, s) for n, s in outputs.items()],
        [numpy_helper.from_array(np.array(s, np.int64), n) for n, s in inits],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _x(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((4, 8)).astype(np.float32)


def _sigmoid(v: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-v))


def _top2(v: np.ndarray) -> np.ndarray:
    return -np.sort(-v, axis=-1)[:, :2]


def _view_output_model() -> onnx.ModelProto:
    """``y`` is a Reshape (a view) of the intermediate ``r``; the steps after it make new
    values that the arena may place where ``r`` was."""
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("Reshape", ["r", "flat"], ["y"], name="view"),
        helper.make_node("Neg", ["x"], ["n"], name="neg"),
        helper.make_node("Exp", ["n"], ["e"], name="exp"),
        helper.make_node("Sigmoid", ["e"], ["g"], name="sigmoid"),
        # the last step: its values are an output, its indices are never read
        helper.make_node("TopK", ["g", "two"], ["s", "unread"], name="top2", axis=-1),
    ]
    return _model(nodes, {"y": [32], "s": [4, 2]}, [("flat", [32]), ("two", [2])])


def test_a_graph_output_that_is_a_view_of_an_intermediate_keeps_its_values():
    sess = InferenceSession(_view_output_model(), providers=["cpu"])
    for seed in range(3):  # planned on the first run, run on that plan after
        x = _x(seed)
        y, s = sess.run(["y", "s"], {"x": x})
        np.testing.assert_array_equal(y, np.maximum(x, 0).reshape(-1))
        np.testing.assert_allclose(s, _top2(_sigmoid(np.exp(-x.astype(np.float64)))), rtol=1e-6)
    binding = sess.io_binding()
    x = binding.bind_input("x", _x(5))
    y = binding.bind_output("y", shape=(32,))
    s = binding.bind_output("s", shape=(4, 2))
    for seed in range(4):  # planned, captured, replayed
        x[...] = _x(seed + 10)
        sess.run_with_iobinding(binding)
        np.testing.assert_array_equal(y, np.maximum(x, 0).reshape(-1))
        np.testing.assert_allclose(s, _top2(_sigmoid(np.exp(-x.astype(np.float64)))), rtol=1e-6)


def test_a_view_read_late_keeps_its_root_alive_until_then():
    """``v`` views ``r``; new values are made after ``r``'s own last reader (the Reshape),
    and ``v`` is read only at the end."""
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("Reshape", ["r", "flat"], ["v"], name="view"),
        helper.make_node("Neg", ["x"], ["n"], name="neg"),
        helper.make_node("Exp", ["n"], ["e"], name="exp"),
        helper.make_node("Reshape", ["e", "flat"], ["ev"], name="view_e"),
        helper.make_node("Add", ["v", "ev"], ["y"], name="add"),
    ]
    sess = InferenceSession(_model(nodes, {"y": [32]}, [("flat", [32])]), providers=["cpu"])
    for seed in range(3):
        x = _x(seed).astype(np.float64)
        (y,) = sess.run(["y"], {"x": x.astype(np.float32)})
        np.testing.assert_allclose(y, (np.maximum(x, 0) + np.exp(-x)).reshape(-1), rtol=1e-6)
    layout = sess.executor.memory.eager_layout(sess.executor.memory.eager_keys()[0])
    # only values that own their bytes are planned: not the views, not the graph output
    assert set(layout.buffers) == {"r", "n", "e"}


class ShortSplitCPU(CPUProvider):
    """A CPU provider whose Split kernel returns one output whatever the node asks for (a
    plugin's bug)."""

    name = "short-split"

    @property
    def kernels(self) -> KernelRegistry:
        reg = KernelRegistry()
        reg.add(REGISTRY.lookup("", "Relu", 18))
        reg.register("Split", since=1)(lambda ctx, x, split=None: np.split(x, 2, axis=0)[0])
        return reg


def test_a_kernel_returning_fewer_outputs_than_its_node_names_is_refused():
    nodes = [
        helper.make_node("Split", ["x"], ["a", "b"], name="halves", axis=0, num_outputs=2),
        helper.make_node("Relu", ["b"], ["y"], name="relu"),
    ]
    sess = InferenceSession(_model(nodes, {"a": [2, 8], "y": [2, 8]}), providers=[ShortSplitCPU()])
    with pytest.raises(KernelError, match=r"node 'halves' .*returned 1 outputs, expected 2"):
        sess.run(["a", "y"], {"x": _x()})


def test_an_output_bound_on_another_provider_keeps_its_buffer_until_the_segment_ends():
    """After the island's Relu, the mainland makes ``a`` first and ``d`` last in one
    segment; both are bound to the island's buffers (the session's main provider), so they
    are copied there after the segment: ``a``'s bytes may not be reused by ``d`` before
    that copy."""
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("Neg", ["r"], ["a"], name="first"),
        helper.make_node("Exp", ["r"], ["b"], name="exp"),
        helper.make_node("Sigmoid", ["b"], ["c"], name="sigmoid"),
        helper.make_node("Neg", ["c"], ["d"], name="last"),
    ]
    island, mainland = Island(), Mainland()
    sess = InferenceSession(_model(nodes, {"a": [4, 8], "d": [4, 8]}), providers=[island, mainland])
    assert [s.provider.name for s in sess.plan.steps] == ["island"] + 4 * ["mainland"]
    binding = sess.io_binding()
    x = binding.bind_input("x", np.zeros((4, 8), np.float32))
    a = binding.bind_output("a", shape=(4, 8))
    d = binding.bind_output("d", shape=(4, 8))
    assert island.holds(a) and not mainland.holds(a)
    for seed in range(4):  # planned, captured, replayed
        x[...] = _x(seed)
        a[...], d[...] = np.nan, np.nan
        sess.run_with_iobinding(binding)
        r = np.maximum(x.astype(np.float64), 0)
        np.testing.assert_array_equal(a, -r)
        np.testing.assert_allclose(d, -_sigmoid(np.exp(r)), rtol=1e-6)
    assert sess.graph_stats().replays == 2
