"""Per-slot host capture state: decode and verify graphs side by side."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from onnx_genrt.core.dtypes import DType
from onnx_genrt.core.errors import InvalidInputError, KernelError
from onnx_genrt.core.graph_slots import DeviceGraphSlot
from onnx_genrt.providers.cpu.provider import CPUProvider
from onnx_genrt.session import InferenceSession
from onnx_genrt.session.memory import Lifetime, plan_memory

from ..models import chain, chain_reference, mlp, mlp_reference

PRIMARY, VERIFY = DeviceGraphSlot.PRIMARY, DeviceGraphSlot.VERIFY


def _bind(sess: InferenceSession, rows: int, hidden: int):
    binding = sess.io_binding()
    x = binding.bind_input("x", np.zeros((rows, hidden), np.float32))
    y = binding.bind_output("y", shape=(rows, hidden))
    return binding, x, y


def test_decode_and_verify_graphs_both_replay_interleaved():
    hidden = 16
    model = mlp(hidden=hidden)
    sess = InferenceSession(model)
    decode, xd, yd = _bind(sess, 1, hidden)
    verify, xv, yv = _bind(sess, 4, hidden)
    rng = np.random.default_rng(7)
    for _ in range(12):
        xd[...] = rng.standard_normal(xd.shape)
        sess.run_with_iobinding(decode, PRIMARY)
        np.testing.assert_allclose(yd, mlp_reference(model, xd), rtol=1e-5, atol=1e-5)
        xv[...] = rng.standard_normal(xv.shape)
        sess.run_with_iobinding(verify, VERIFY)
        np.testing.assert_allclose(yv, mlp_reference(model, xv), rtol=1e-5, atol=1e-5)
    for slot in (PRIMARY, VERIFY):
        stats = sess.graph_stats(slot)
        assert stats.captures == 1, slot
        assert stats.replays == 10, slot  # 1 planning run + 1 capture, then replays
        assert stats.invalidations == 0 and stats.fallbacks == 0, slot


def test_signature_change_invalidates_only_that_slot():
    hidden = 8
    model = mlp(hidden=hidden)
    sess = InferenceSession(model)
    decode, xd, yd = _bind(sess, 1, hidden)
    verify, xv, yv = _bind(sess, 3, hidden)
    for _ in range(3):
        sess.run_with_iobinding(decode, PRIMARY)
        sess.run_with_iobinding(verify, VERIFY)
    assert sess.main_provider.has_graph(PRIMARY) and sess.main_provider.has_graph(VERIFY)
    # Rebind VERIFY's input to a new buffer: its address changes, so its graph is stale.
    new_x = np.full((3, hidden), 2.0, np.float32)
    verify.bind_input("x", new_x)
    sess.run_with_iobinding(verify, VERIFY)
    np.testing.assert_allclose(yv, mlp_reference(model, new_x), rtol=1e-5, atol=1e-5)
    assert sess.graph_stats(VERIFY).invalidations == 1
    assert not sess.main_provider.has_graph(VERIFY)
    assert sess.main_provider.has_graph(PRIMARY)
    xd[...] = 3.0
    sess.run_with_iobinding(decode, PRIMARY)
    np.testing.assert_allclose(yd, mlp_reference(model, xd), rtol=1e-5, atol=1e-5)
    assert sess.graph_stats(PRIMARY).invalidations == 0
    assert sess.graph_stats(PRIMARY).replays == 2


def test_set_graph_slot_retargets_without_resetting():
    sess = InferenceSession(mlp(hidden=4))
    binding, x, y = _bind(sess, 1, 4)
    for _ in range(3):
        sess.run_with_iobinding(binding)
    sess.set_graph_slot(VERIFY)
    assert sess.executor.graph_slot is VERIFY
    sess.run_with_iobinding(binding)
    assert sess.main_provider.has_graph(PRIMARY)
    assert sess.graph_stats(PRIMARY).replays == 1
    assert sess.graph_stats(VERIFY).eager_runs == 1


def test_replay_matches_eager_over_a_long_chain():
    length = 60
    sess = InferenceSession(chain(length))
    binding = sess.io_binding()
    x = binding.bind_input("x", np.zeros((1, 8), np.float32))
    y = binding.bind_output("y", shape=(1, 8))
    for step in range(6):
        x[...] = np.linspace(-1, 1, 8, dtype=np.float32) * step
        sess.run_with_iobinding(binding)
        np.testing.assert_allclose(y, chain_reference(length, x), rtol=1e-4, atol=1e-4)
    assert sess.graph_stats().replays == 4
    assert sess.main_provider.recorded_calls(PRIMARY) == length


def test_graphs_can_be_turned_off():
    sess = InferenceSession(mlp(hidden=4), enable_graphs=False)
    binding, x, y = _bind(sess, 1, 4)
    for _ in range(4):
        sess.run_with_iobinding(binding)
    stats = sess.graph_stats()
    assert stats.captures == 0 and stats.replays == 0 and stats.eager_runs == 4
    assert stats.fallbacks == 0


class FlakyCaptureCPU(CPUProvider):
    """A CPU provider whose graph capture fails, as an uncapturable kernel would."""

    name = "flaky"

    def graph_end(self, slot, part):
        super().graph_end(slot, part)
        raise RuntimeError("operation not permitted when stream is capturing")


def test_failed_capture_falls_back_to_eager_with_reason_and_latches():
    model = mlp(hidden=8)
    sess = InferenceSession(model, providers=[FlakyCaptureCPU()])
    binding, x, y = _bind(sess, 2, 8)
    for step in range(5):
        x[...] = step
        sess.run_with_iobinding(binding)
        np.testing.assert_allclose(y, mlp_reference(model, x), rtol=1e-5, atol=1e-5)
    stats = sess.graph_stats()
    assert stats.captures == 0 and stats.replays == 0
    # run 1 plans, run 2's capture fails, runs 3-5 find the latch: all five ran eagerly
    assert stats.fallbacks == 4 and stats.eager_runs == 5
    failed = (
        "GraphCaptureError: end capture in slot 'primary': operation not permitted when "
        "stream is capturing"
    )
    assert stats.fallback_reasons == {
        f"capture failed: {failed}": 1,
        f"capture failed earlier on 'flaky': {failed}": 3,
    }
    assert sess.main_provider.capture_error(PRIMARY) is not None


class InterruptedCaptureCPU(CPUProvider):
    """A CPU provider whose first capture is interrupted (Ctrl-C) in its second launch."""

    name = "interrupted"
    interrupts = 1

    def launch(self, kdef, ctx, inputs):
        if self.capturing is not None and self.interrupts:
            self.interrupts -= 1
            raise KeyboardInterrupt
        return super().launch(kdef, ctx, inputs)


def test_interrupted_capture_leaves_the_slot_free_and_the_collector_on():
    import gc

    from onnx_genrt.core import collector_pause

    model = mlp(hidden=8)
    provider = InterruptedCaptureCPU()
    sess = InferenceSession(model, providers=[provider])
    binding, x, y = _bind(sess, 2, 8)
    sess.run_with_iobinding(binding)  # plans
    with pytest.raises(KeyboardInterrupt):
        sess.run_with_iobinding(binding)  # the capture, interrupted
    assert provider.capturing is None and provider.capture_error(PRIMARY) is None
    assert collector_pause.held() == 0 and gc.isenabled()
    for step in range(3):
        x[...] = step
        sess.run_with_iobinding(binding)
        np.testing.assert_allclose(y, mlp_reference(model, x), rtol=1e-5, atol=1e-5)
    stats = sess.graph_stats()
    assert stats.captures == 1 and stats.replays == 2 and stats.fallbacks == 0


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 5000), st.integers(0, 30), st.integers(0, 10)),
        min_size=1,
        max_size=40,
    )
)
def test_memory_plan_never_overlaps_live_values(items):
    lifetimes = [Lifetime(f"v{i}", n, a, a + d) for i, (n, a, d) in enumerate(items)]
    plan = plan_memory(lifetimes)
    assert plan.arena_bytes <= plan.naive_bytes
    spans = {
        lt.name: (plan.offsets[lt.name], plan.offsets[lt.name] + lt.nbytes) for lt in lifetimes
    }
    for i, a in enumerate(lifetimes):
        assert spans[a.name][1] <= plan.arena_bytes
        assert plan.offsets[a.name] % 64 == 0
        for b in lifetimes[i + 1 :]:
            live_together = not (a.last < b.first or b.last < a.first)
            if live_together:
                (s1, e1), (s2, e2) = spans[a.name], spans[b.name]
                assert e1 <= s2 or e2 <= s1, (a, b)


@pytest.mark.parametrize("rows", [1, 5])
def test_bound_run_writes_into_bound_output(rows):
    model = mlp(hidden=4)
    sess = InferenceSession(model)
    binding, x, y = _bind(sess, rows, 4)
    x[...] = 1.0
    address = y.__array_interface__["data"][0]
    sess.run_with_iobinding(binding)
    assert y.__array_interface__["data"][0] == address
    np.testing.assert_allclose(binding.get_outputs()["y"], mlp_reference(model, x), rtol=1e-5)


def test_prepacked_constants_are_made_once_and_only_in_the_packed_layout():
    """A kernel's prepack hook turns a constant weight into its own layout once per
    provider; the kernel receives it, and no plain copy is kept when nothing else reads it."""
    from dataclasses import dataclass

    from onnx_genrt.core.kernels import KernelRegistry
    from onnx_genrt.providers.cpu.kernels import REGISTRY

    @dataclass(frozen=True)
    class Transposed:
        t: np.ndarray

    calls: list[tuple[str, int]] = []

    def prepack(provider, node, index, host):
        calls.append((node.name, index))
        return Transposed(np.ascontiguousarray(host.T)) if index == 1 else None

    def matmul(ctx, a, b):
        assert isinstance(b, Transposed), type(b)
        return a @ b.t.T

    class PackingCPU(CPUProvider):
        name = "packing-cpu"
        _registry = KernelRegistry()

        @property
        def kernels(self):
            if not len(self._registry):
                for op in ("Add", "Relu", "Sigmoid", "Mul", "Softmax"):
                    kdef = REGISTRY.lookup("", op, 21)
                    if kdef is not None:
                        self._registry.add(kdef)
                self._registry.register("MatMul", since=1, prepack=prepack)(matmul)
            return self._registry

    model = mlp(hidden=8)
    matmuls = [n for n in model.graph.node if n.op_type == "MatMul"]
    sess = InferenceSession(model, providers=[PackingCPU()])
    assert sorted(calls) == sorted((n.name, 1) for n in matmuls)
    weights = {n.input[1] for n in matmuls}
    assert (
        sess.executor.constants.plain_names() & weights == set()
    )  # only the transposed layout exists
    x = np.random.default_rng(3).standard_normal((2, 8)).astype(np.float32)
    (y,) = sess.run(["y"], {"x": x})
    np.testing.assert_allclose(y, mlp_reference(model, x), rtol=1e-5, atol=1e-5)


def test_sessions_sharing_a_provider_never_replay_each_others_graph():
    """Two sessions on one provider instance, both in PRIMARY: the slot holds one graph, so
    each notices when the other replaced it (displaced) and captures again."""
    hidden = 8
    provider = CPUProvider()
    models = [mlp(hidden=hidden, seed=1), mlp(hidden=hidden, seed=2)]
    sessions = [InferenceSession(m, providers=[provider]) for m in models]
    bound = [_bind(s, 1, hidden) for s in sessions]
    rng = np.random.default_rng(3)
    for _ in range(6):
        for model, sess, (binding, x, y) in zip(models, sessions, bound, strict=True):
            x[...] = rng.standard_normal(x.shape)
            sess.run_with_iobinding(binding, PRIMARY)
            np.testing.assert_allclose(y, mlp_reference(model, x), rtol=1e-5, atol=1e-5)
    for sess in sessions:
        stats = sess.graph_stats(PRIMARY)
        assert stats.captures >= 2 and stats.displaced >= 1, stats
        assert stats.invalidations == stats.displaced, stats
    assert provider.graph_owner(PRIMARY) is sessions[1].executor


def test_rebinding_an_output_after_capture_writes_the_new_buffer():
    """An output rebound after a capture changes the binding signature: the stale graph
    (which writes the old buffer) is dropped, and the new buffer receives the values."""
    hidden = 8
    model = mlp(hidden=hidden)
    sess = InferenceSession(model)
    binding, x, old_y = _bind(sess, 2, hidden)
    rng = np.random.default_rng(11)
    for _ in range(3):  # planning run, capture, replay
        x[...] = rng.standard_normal(x.shape)
        sess.run_with_iobinding(binding, PRIMARY)
    assert sess.main_provider.has_graph(PRIMARY)
    stale = old_y.copy()
    new_y = binding.bind_output("y", shape=(2, hidden))
    new_y[...] = np.nan
    for _ in range(3):
        x[...] = rng.standard_normal(x.shape)
        sess.run_with_iobinding(binding, PRIMARY)
        np.testing.assert_allclose(new_y, mlp_reference(model, x), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(old_y, stale)  # the old buffer is no longer written
    assert sess.graph_stats(PRIMARY).invalidations == 1


def test_bindings_refuse_what_the_model_does_not_declare():
    """Each refusal names the binding and says what is wrong (found by a mutation run:
    none of these paths was exercised)."""
    sess = InferenceSession(mlp(hidden=4))
    binding = sess.io_binding()
    with pytest.raises(InvalidInputError, match="input 'x' expects float32, bound buffer is"):
        binding.bind_input("x", np.zeros((1, 4), np.float64))
    with pytest.raises(InvalidInputError, match="input 'x' dimension 1 is 5, model declares 4"):
        binding.bind_input("x", np.zeros((1, 5), np.float32))
    with pytest.raises(InvalidInputError, match="C-contiguous"):
        binding.bind_input("x", np.zeros((4, 2), np.float32).T)
    with pytest.raises(InvalidInputError, match=r"bind_output\('y'\) needs a buffer or a shape"):
        binding.bind_output("y")
    assert binding.inputs == {} and binding.outputs == {}


def test_tensors_and_host_arrays_bind_as_their_own_buffers():
    model = mlp(hidden=4)
    sess = InferenceSession(model)
    binding = sess.io_binding()
    x = sess.main_provider.allocate((2, 4), DType.FLOAT32)
    x.buffer[...] = 0.25
    assert binding.bind_input("x", x) is x.buffer  # a Tensor binds its buffer, not a copy
    y = np.zeros((2, 4), np.float32)
    assert binding.bind_output("y", y) is y  # a host array on the CPU provider, as is
    sess.run_with_iobinding(binding)
    np.testing.assert_allclose(y, mlp_reference(model, x.buffer), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("warmup_runs", "eager_before_capture"), [(0, 1), (1, 1), (3, 3)])
def test_warmup_runs_eager_runs_precede_the_capture(warmup_runs, eager_before_capture):
    """The first run always plans memory (so at least one eager run); ``warmup_runs`` eager
    runs come before the capture, then every run replays."""
    model = mlp(hidden=8)
    sess = InferenceSession(model, warmup_runs=warmup_runs)
    binding, x, y = _bind(sess, 2, 8)
    rng = np.random.default_rng(warmup_runs)
    runs = eager_before_capture + 3
    for run in range(1, runs + 1):
        x[...] = rng.standard_normal(x.shape)
        sess.run_with_iobinding(binding, PRIMARY)
        np.testing.assert_allclose(y, mlp_reference(model, x), rtol=1e-5, atol=1e-5)
        stats = sess.graph_stats(PRIMARY)
        assert stats.eager_runs == min(run, eager_before_capture), (run, stats)
        assert stats.captures == (run > eager_before_capture), (run, stats)
    assert stats.replays == runs - eager_before_capture - 1


def test_a_bound_output_of_the_wrong_shape_is_refused_not_broadcast():
    """A (1, 8) result would broadcast into a (3, 8) buffer without a word."""
    sess = InferenceSession(mlp(hidden=8))
    binding = sess.io_binding()
    binding.bind_input("x", np.ones((1, 8), np.float32))
    y = binding.bind_output("y", shape=(3, 8))
    y[...] = -7.0
    with pytest.raises(
        KernelError,
        match=r"output 'y' of node 'residual'.* has shape \[1, 8\], but the bound buffer has "
        r"shape \[3, 8\]",
    ):
        sess.run_with_iobinding(binding)
    assert (y == -7.0).all()


def _relu_with_undeclared_output_type() -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"], name="relu")],
        "relu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.UNDEFINED, None)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_bound_output_of_another_dtype_is_refused_where_the_model_declares_none():
    """Where the model declares no output type, bind_output cannot check it: the run does,
    rather than casting float32 results into a float64 buffer."""
    sess = InferenceSession(_relu_with_undeclared_output_type())
    assert sess.get_outputs()[0].dtype is None
    binding = sess.io_binding()
    x = binding.bind_input("x", np.array([[-1, 2, -3], [4, -5, 6]], np.float32))
    wrong = binding.bind_output("y", np.zeros((2, 3), np.float64))
    with pytest.raises(
        KernelError, match="output 'y' of node 'relu'.* is float32, but the bound buffer is float64"
    ):
        sess.run_with_iobinding(binding)
    assert not wrong.any()
    right = binding.bind_output("y", np.zeros((2, 3), np.float32))
    sess.run_with_iobinding(binding)
    np.testing.assert_array_equal(right, np.maximum(x.astype(np.float64), 0.0))


def test_a_graph_output_that_a_later_node_reads_is_kept_for_the_caller():
    """``a`` is a graph output and also read by the last node: it is not freed after that
    node, eager or bound."""
    graph = helper.make_graph(
        [
            helper.make_node("Relu", ["x"], ["a"], name="relu"),
            helper.make_node("Mul", ["a", "x"], ["m"], name="mul"),
            helper.make_node("Add", ["m", "a"], ["b"], name="add"),
        ],
        "kept",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [
            helper.make_tensor_value_info("a", TensorProto.FLOAT, [2, 3]),
            helper.make_tensor_value_info("b", TensorProto.FLOAT, [2, 3]),
        ],
    )
    sess = InferenceSession(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    x = np.array([[-1.5, 2.0, -3.0], [4.0, -0.5, 6.0]], np.float32)
    want_a = np.maximum(x.astype(np.float64), 0.0)
    want_b = want_a * x + want_a
    for _ in range(2):  # planned, then on the plan
        a, b = sess.run(["a", "b"], {"x": x})
        np.testing.assert_allclose(a, want_a)
        np.testing.assert_allclose(b, want_b)


def _with_constant_output() -> tuple[onnx.ModelProto, np.ndarray]:
    table = np.arange(6, dtype=np.float32).reshape(2, 3) - 2.5
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"], name="relu")],
        "const_out",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3]),
            helper.make_tensor_value_info("table", TensorProto.FLOAT, [2, 3]),
        ],
        [numpy_helper.from_array(table, "table")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), table


def test_a_constant_graph_output_is_returned_and_written_into_its_binding():
    model, table = _with_constant_output()
    sess = InferenceSession(model)
    x = np.ones((2, 3), np.float32)
    y, got = sess.run(["y", "table"], {"x": x})
    np.testing.assert_array_equal(got, table)
    binding = sess.io_binding()
    binding.bind_input("x", x)
    bound = binding.bind_output("table", shape=(2, 3))
    binding.bind_output("y", shape=(2, 3))
    for _ in range(3):  # planned, captured, replayed: the copy is outside the graph
        bound[...] = np.nan
        sess.run_with_iobinding(binding)
        np.testing.assert_array_equal(bound, table)
    wrong = binding.bind_output("table", shape=(3, 2))
    with pytest.raises(
        KernelError,
        match=r"output 'table' of constant has shape \[2, 3\], but the bound buffer has shape",
    ):
        sess.run_with_iobinding(binding)
    assert wrong.shape == (3, 2)


def test_eager_runs_keep_plans_for_the_most_recent_shapes():
    """Eager runs keep EAGER_PLAN_CACHE memory plans, dropping the least recently used."""
    from onnx_genrt.session.memory_planner import EAGER_PLAN_CACHE

    model = mlp(hidden=4)
    sess = InferenceSession(model)
    rng = np.random.default_rng(5)

    def run(rows: int) -> None:
        x = rng.standard_normal((rows, 4)).astype(np.float32)
        (y,) = sess.run(["y"], {"x": x})
        np.testing.assert_allclose(y, mlp_reference(model, x), rtol=1e-5, atol=1e-5)

    def kept_rows() -> list[int]:
        return [
            dict((n, s) for n, _, s in shapes)["x"][0]
            for _, shapes in sess.executor.memory.eager_keys()
        ]

    for rows in range(1, EAGER_PLAN_CACHE + 1):
        run(rows)
    assert kept_rows() == list(range(1, EAGER_PLAN_CACHE + 1))
    run(1)  # used again: now the most recent
    run(EAGER_PLAN_CACHE + 1)  # a new shape: the least recently used (2 rows) goes
    assert kept_rows() == [*range(3, EAGER_PLAN_CACHE + 1), 1, EAGER_PLAN_CACHE + 1]


def test_an_eager_bound_run_without_its_input_names_the_value_and_the_node():
    sess = InferenceSession(mlp(hidden=4))
    binding = sess.io_binding()
    binding.bind_output("y", shape=(1, 4))
    with pytest.raises(
        KernelError,
        match=r"value 'x' is needed by node 'mm1/MatMulAdd' .*but was not computed or fed",
    ):
        sess.executor.run_bound_eager(binding)


def test_a_graph_without_nodes_returns_its_input_and_its_constant():
    """No node, so no provider: a run holds no lock and returns the values as they are."""
    table = np.arange(4, dtype=np.float32)
    graph = helper.make_graph(
        [],
        "no_nodes",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [4]),
            helper.make_tensor_value_info("table", TensorProto.FLOAT, [4]),
        ],
        [numpy_helper.from_array(table, "table")],
    )
    sess = InferenceSession(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    x = np.array([1.5, -2.0, 0.0, 3.25], np.float32)
    got_x, got_table = sess.run(None, {"x": x})
    np.testing.assert_array_equal(got_x, x)
    np.testing.assert_array_equal(got_table, table)


def test_a_graph_input_that_is_also_an_output_is_written_into_its_binding():
    """``x`` is fed and returned as it is: its bound output buffer gets the fed values on
    every bound run (planned, captured, replayed), not only from eager runs."""
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"], name="relu")],
        "pass_through",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [4]),
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [4]),
        ],
    )
    sess = InferenceSession(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    binding = sess.io_binding()
    x = binding.bind_input("x", np.zeros(4, np.float32))
    x_out = binding.bind_output("x", shape=(4,))
    y = binding.bind_output("y", shape=(4,))
    rng = np.random.default_rng(8)
    for _ in range(4):
        x[...] = rng.standard_normal(4)
        x_out[...] = np.nan
        sess.run_with_iobinding(binding)
        np.testing.assert_array_equal(x_out, x)
        np.testing.assert_array_equal(y, np.maximum(x, 0.0))
    assert sess.graph_stats().replays == 2
    binding.bind_output("x", shape=(2,))
    with pytest.raises(KernelError, match=r"output 'x' of graph input has shape \[4\], but"):
        sess.run_with_iobinding(binding)
