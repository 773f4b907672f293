"""The interpreter's roads between providers and its launch hooks (``session.interpreter``;
found by a mutation run: a plan no provider of which holds the fed host arrays, the copies
into bound outputs no step makes on a mixed plan, and hooks closed out of order had no
test). Values are checked against numpy float64."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from onnx_genrt.session import InferenceSession

from .test_mixed_placement import Island, IslandArray, Mainland

F = TensorProto.FLOAT


class StrictMainland(Mainland):
    """The mainland provider refusing to copy into or out of arrays it does not hold, as
    a device's copy refuses another device's memory."""

    name = "strict-mainland"

    def copy(self, src, dst) -> None:
        for what, value in (("source", src), ("destination", dst)):
            if not self.holds(value):
                raise TypeError(f"{self.name} copy: {what} is a {type(value).__name__}")
        super().copy(src, dst)


def test_host_feeds_cross_to_a_plan_that_holds_none_of_them():
    """Every step runs on the island, whose arrays are not numpy's: each planned run copies
    the fed host array across (no provider of the plan holds it)."""
    graph = helper.make_graph(
        [
            helper.make_node("Relu", ["x"], ["r"], name="relu"),
            helper.make_node("Add", ["r", "x"], ["y"], name="add"),
        ],
        "island_only",
        [helper.make_tensor_value_info("x", F, [3, 4])],
        [helper.make_tensor_value_info("y", F, [3, 4])],
    )
    island = Island()
    sess = InferenceSession(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), providers=[island]
    )
    assert sess.executor.providers == [island]
    for seed in range(3):  # planned on the first run, run on that plan after
        x = np.random.default_rng(seed).standard_normal((3, 4)).astype(np.float32)
        assert not island.holds(x)
        (y,) = sess.run(["y"], {"x": x})
        x64 = x.astype(np.float64)
        np.testing.assert_allclose(np.asarray(y), np.maximum(x64, 0) + x64, rtol=1e-6)


def test_outputs_no_step_makes_are_copied_by_the_main_provider_on_a_mixed_plan():
    """A constant graph output and a graph input that is also an output, bound to the
    main provider's (the island's) buffers, while the last step runs on the mainland."""
    table = np.arange(12, dtype=np.float32).reshape(3, 4) - 5
    graph = helper.make_graph(
        [
            helper.make_node("Relu", ["x"], ["r"], name="relu"),
            helper.make_node("Neg", ["r"], ["y"], name="neg"),
        ],
        "mixed",
        [helper.make_tensor_value_info("x", F, [3, 4])],
        [
            helper.make_tensor_value_info("y", F, [3, 4]),
            helper.make_tensor_value_info("x", F, [3, 4]),
            helper.make_tensor_value_info("table", F, [3, 4]),
        ],
        [numpy_helper.from_array(table, "table")],
    )
    island, mainland = Island(), StrictMainland()
    sess = InferenceSession(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]),
        providers=[island, mainland],
    )
    assert [s.provider.name for s in sess.plan.steps] == ["island", "strict-mainland"]
    binding = sess.io_binding()
    x = binding.bind_input("x", np.zeros((3, 4), np.float32))
    y = binding.bind_output("y", shape=(3, 4))
    x_out = binding.bind_output("x", shape=(3, 4))
    got_table = binding.bind_output("table", shape=(3, 4))
    assert all(isinstance(v, IslandArray) for v in (x, y, x_out, got_table))
    for seed in range(4):  # planned, captured, replayed
        x[...] = np.random.default_rng(seed).standard_normal((3, 4))
        for out in (y, x_out, got_table):
            out[...] = np.nan
        sess.run_with_iobinding(binding)
        np.testing.assert_array_equal(y, -np.maximum(x.astype(np.float64), 0))
        np.testing.assert_array_equal(x_out, x)
        np.testing.assert_array_equal(got_table, table)
    assert sess.graph_stats().replays == 2


def _hook(events: list[str], tag: str):
    @contextmanager
    def hook(node) -> Iterator[None]:
        events.append(f"{tag}:{node.name}")
        yield

    return hook


def test_a_hook_closed_before_a_later_one_leaves_the_later_one_in_place():
    """Two threads' hook blocks need not close in the order they opened."""
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"], name="relu")],
        "relu",
        [helper.make_tensor_value_info("x", F, [2])],
        [helper.make_tensor_value_info("y", F, [2])],
    )
    sess = InferenceSession(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), providers=["cpu"]
    )
    x = np.array([-1.0, 2.0], np.float32)
    events: list[str] = []
    first, second, third = (sess.on_launch(_hook(events, t)) for t in ("a", "b", "c"))
    first.__enter__()
    second.__enter__()
    third.__enter__()
    first.__exit__(None, None, None)  # closes before the two opened after it
    (y,) = sess.run(["y"], {"x": x})
    assert events == ["b:relu", "c:relu"]
    second.__exit__(None, None, None)
    events.clear()
    sess.run(["y"], {"x": x})
    assert events == ["c:relu"]
    third.__exit__(None, None, None)
    events.clear()
    sess.run(["y"], {"x": x})
    assert events == []
    np.testing.assert_array_equal(y, np.maximum(x, 0))


def test_a_graph_without_nodes_runs_bound_and_replayed():
    """A graph whose outputs are its input and a constant has no step, so no step's
    provider: bound runs and a captured replay copy them with the session's first."""
    from onnx_genrt.core.graph_slots import DeviceGraphSlot

    c = np.arange(3, dtype=np.float32)
    graph = helper.make_graph(
        [],
        "g",
        [helper.make_tensor_value_info("x", F, [2])],
        [helper.make_tensor_value_info("x", F, [2]), helper.make_tensor_value_info("c", F, [3])],
        initializer=[numpy_helper.from_array(c, "c")],
    )
    sess = InferenceSession(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]))
    assert sess.executor.plan.providers == [sess.main_provider]
    x = np.array([5, -1], np.float32)
    binding = sess.io_binding()
    binding.bind_input("x", x)
    out_x = binding.bind_output("x", shape=(2,), dtype=np.float32)
    out_c = binding.bind_output("c", shape=(3,), dtype=np.float32)
    for slot in (None, DeviceGraphSlot.PRIMARY, DeviceGraphSlot.PRIMARY):
        out_x[...] = 0
        sess.run_with_iobinding(binding, slot)
        np.testing.assert_array_equal(out_x, x)
        np.testing.assert_array_equal(out_c, c)
