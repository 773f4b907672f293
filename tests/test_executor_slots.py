"""Per-slot host capture state: decode and verify graphs side by side."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from onnx_genrt.core.dtypes import DType
from onnx_genrt.core.errors import InvalidInputError
from onnx_genrt.core.graph_slots import DeviceGraphSlot
from onnx_genrt.providers.cpu.provider import CPUProvider
from onnx_genrt.session import InferenceSession
from onnx_genrt.session.memory import Lifetime, plan_memory

from .models import chain, chain_reference, mlp, mlp_reference

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
    assert stats.fallbacks == 4
    reasons = list(stats.fallback_reasons)
    assert any("not permitted when stream is capturing" in r for r in reasons)
    assert sess.main_provider.capture_error(PRIMARY) is not None


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
    plain = [k for k in sess.executor._consts if len(k) == 2 and k[1] in weights]
    assert plain == []  # only the transposed layout exists
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
