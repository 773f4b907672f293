"""Mixed placement keeps graphs: a partial provider beside the CPU provider captures its
segments as parts of its graph in each slot, values crossing providers are copied between
the parts' replays, and every output equals numpy's float64 reference."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from onnx_genrt.core.errors import GraphCaptureError
from onnx_genrt.core.graph_slots import DeviceGraphSlot
from onnx_genrt.core.kernels import KernelRegistry
from onnx_genrt.providers.cpu.kernels import REGISTRY
from onnx_genrt.providers.cpu.provider import CPUProvider
from onnx_genrt.session import InferenceSession

from ..models import mlp, mlp_reference

PRIMARY, VERIFY, DRAFT = DeviceGraphSlot.PRIMARY, DeviceGraphSlot.VERIFY, DeviceGraphSlot.DRAFT


class IslandArray(np.ndarray):
    """Memory of the 'island' device: host bytes the mainland provider does not accept."""


class Island(CPUProvider):
    """A partial provider on a device of its own: Add and Relu only, its own array type,
    so every value crossing to or from it needs a transfer."""

    name = "island"
    ARRAY_TYPES = (IslandArray,)
    _only = KernelRegistry()

    @property
    def kernels(self) -> KernelRegistry:
        if not len(self._only):
            for op in ("Add", "Relu"):
                self._only.add(REGISTRY.lookup("", op, 21))
        return self._only

    def empty(self, shape, dtype) -> IslandArray:
        return super().empty(shape, dtype).view(IslandArray)

    def upload(self, host, out=None) -> IslandArray:
        if out is None:
            return np.array(host, copy=True).view(IslandArray)
        return super().upload(host, out)

    def read(self, arrays) -> list[np.ndarray]:
        return [np.array(a, copy=True).view(np.ndarray) for a in arrays]

    def launch(self, kdef, ctx, inputs):
        """As a GPU's: a kernel may not allocate while its part is captured, so every
        output then must be a buffer the session planned on this provider."""
        result = super().launch(kdef, ctx, inputs)
        results = result if isinstance(result, tuple | list) else (result,)
        if self.capturing is not None and not all(self.holds(r) for r in results):
            raise GraphCaptureError(f"{ctx.node.describe()} allocated during a capture")
        return result


class Mainland(CPUProvider):
    """The CPU provider, refusing the island's arrays (as a GPU's would be refused)."""

    name = "mainland"

    def holds(self, value) -> bool:
        return isinstance(value, np.ndarray) and not isinstance(value, IslandArray)


class NoGraphs(Island):
    name = "no-graphs"
    GRAPH_SLOTS = frozenset()


def _bind(sess: InferenceSession, rows: int, hidden: int):
    binding = sess.io_binding()
    x = binding.bind_input("x", np.zeros((rows, hidden), np.float32))
    y = binding.bind_output("y", shape=(rows, hidden))
    return binding, x, y


def test_segments_alternate_between_the_providers():
    sess = InferenceSession(mlp(hidden=8), providers=[Island(), Mainland()])
    runs = [(s.provider.name, s.part) for s in sess.executor.segments]
    # mm1 | bias, relu | mm2, scale | residual
    assert runs == [("mainland", 0), ("island", 0), ("mainland", 1), ("island", 1)]


def test_a_partial_provider_and_the_cpu_replay_in_primary_and_verify_side_by_side():
    hidden = 16
    model = mlp(hidden=hidden)
    island, mainland = Island(), Mainland()
    sess = InferenceSession(model, providers=[island, mainland])
    decode, xd, yd = _bind(sess, 1, hidden)
    verify, xv, yv = _bind(sess, 5, hidden)
    rng = np.random.default_rng(3)
    for _ in range(8):  # new values every step: a stale copy would show
        xd[...] = rng.standard_normal(xd.shape)
        sess.run_with_iobinding(decode, PRIMARY)
        np.testing.assert_allclose(yd, mlp_reference(model, xd), rtol=1e-5, atol=1e-5)
        xv[...] = rng.standard_normal(xv.shape)
        sess.run_with_iobinding(verify, VERIFY)
        np.testing.assert_allclose(yv, mlp_reference(model, xv), rtol=1e-5, atol=1e-5)
    for slot in (PRIMARY, VERIFY):
        stats = sess.graph_stats(slot)
        assert (stats.captures, stats.replays, stats.fallbacks) == (1, 6, 0), slot
        assert stats.provider_captures == {"mainland": 2, "island": 2}, slot
        assert stats.provider_replays == {"mainland": 12, "island": 12}, slot
        # To the island: h0, then h4 and x; back: h2, then y into its bound buffer.
        assert stats.edge_copies == 5 * 6, slot
        assert island.graph_parts(slot) == {0, 1} and mainland.graph_parts(slot) == {0, 1}
    # Resetting VERIFY drops both providers' parts there and leaves PRIMARY replaying.
    sess.executor.reset_slot(VERIFY)
    assert not island.graph_parts(VERIFY) and not mainland.graph_parts(VERIFY)
    xd[...] = 0.25
    sess.run_with_iobinding(decode, PRIMARY)
    np.testing.assert_allclose(yd, mlp_reference(model, xd), rtol=1e-5, atol=1e-5)
    assert sess.graph_stats(PRIMARY).replays == 7


def test_replays_equal_eager_runs_of_the_same_session():
    hidden = 8
    model = mlp(hidden=hidden, seed=5)
    graphed = InferenceSession(model, providers=[Island(), Mainland()])
    eager = InferenceSession(model, providers=[Island(), Mainland()], enable_graphs=False)
    b1, x1, y1 = _bind(graphed, 3, hidden)
    b2, x2, y2 = _bind(eager, 3, hidden)
    rng = np.random.default_rng(0)
    for _ in range(5):
        x1[...] = x2[...] = rng.standard_normal(x1.shape)
        graphed.run_with_iobinding(b1, VERIFY)
        eager.run_with_iobinding(b2, VERIFY)
        np.testing.assert_array_equal(y1, y2)
    assert graphed.graph_stats(VERIFY).replays == 3
    assert eager.graph_stats(VERIFY).replays == 0


def test_a_provider_without_the_slot_falls_back_and_names_itself():
    model = mlp(hidden=8)
    sess = InferenceSession(model, providers=[NoGraphs(), Mainland()])
    binding, x, y = _bind(sess, 2, 8)
    for step in range(4):
        x[...] = step
        sess.run_with_iobinding(binding, PRIMARY)
        np.testing.assert_allclose(y, mlp_reference(model, x), rtol=1e-5, atol=1e-5)
    stats = sess.graph_stats(PRIMARY)
    # the first run plans; each of the three after it is a fallback, and all four are eager
    assert stats.captures == 0 and stats.fallbacks == 3 and stats.eager_runs == 4
    assert stats.fallback_reasons == {
        "provider 'no-graphs' has no graph slot 'primary' (declares: none)": 3
    }


class FailingIsland(Island):
    name = "failing-island"

    def graph_end(self, slot, part):
        super().graph_end(slot, part)
        if part == 1:
            raise RuntimeError("the island's driver refused part 1")


def test_a_failed_part_latches_its_provider_drops_the_others_parts_and_runs_eagerly():
    model = mlp(hidden=8)
    island, mainland = FailingIsland(), Mainland()
    sess = InferenceSession(model, providers=[island, mainland])
    binding, x, y = _bind(sess, 2, 8)
    for step in range(4):
        x[...] = step + 0.5
        sess.run_with_iobinding(binding, PRIMARY)
        np.testing.assert_allclose(y, mlp_reference(model, x), rtol=1e-5, atol=1e-5)
    stats = sess.graph_stats(PRIMARY)
    assert stats.captures == 0 and stats.replays == 0 and stats.fallbacks == 3
    assert "refused part 1" in island.capture_error(PRIMARY)
    assert mainland.capture_error(PRIMARY) is None and not mainland.graph_parts(PRIMARY)
    reasons = list(stats.fallback_reasons)
    assert reasons[0].startswith("capture failed: GraphCaptureError")
    assert reasons[1].startswith("capture failed earlier on 'failing-island'")


@pytest.mark.parametrize("rows", [1, 4])
def test_eager_runs_with_host_feeds_cross_to_the_island_and_back(rows):
    model = mlp(hidden=8, seed=2)
    sess = InferenceSession(model, providers=[Island(), Mainland()])
    x = np.random.default_rng(rows).standard_normal((rows, 8)).astype(np.float32)
    for _ in range(2):  # the second run reuses the eager layout and its edge buffers
        (y,) = sess.run(None, {"x": x})
        assert type(y) is np.ndarray
        np.testing.assert_allclose(y, mlp_reference(model, x), rtol=1e-5, atol=1e-5)


def test_a_data_dependent_shape_crossing_to_the_island_gets_a_buffer_of_its_size():
    """NonZero's result has a shape of its own each run for one input shape: the edge buffer
    the island reads it from follows that shape (eager runs on one plan)."""
    graph = helper.make_graph(
        [
            helper.make_node("NonZero", ["x"], ["nz"], name="nonzero"),
            helper.make_node("Cast", ["nz"], ["f"], to=TensorProto.FLOAT, name="cast"),
            helper.make_node("Add", ["f", "f"], ["y"], name="double"),
        ],
        "nonzero_island",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    sess = InferenceSession(model, providers=[Island(), Mainland()])
    assert [p.provider for p in sess.placement()] == ["mainland", "mainland", "island"]
    for values in ([0, 1, 0, 2, 3, 0], [1, 1, 1, 1, 1, 0], [0, 0, 4, 0, 0, 0]):
        x = np.array(values, np.float32)
        (y,) = sess.run(None, {"x": x})
        np.testing.assert_array_equal(y, 2.0 * np.stack(np.nonzero(x)))
