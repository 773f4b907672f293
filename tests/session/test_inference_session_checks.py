"""What ``InferenceSession`` checks and decides itself (found by a mutation run: declared
dims of 0 and 1, providers given as (name, options) pairs or as an empty iterable, which
provider is the main one, bound runs with an input or output unbound, a feed with a dtype but
no shape, and the release of weights fusion replaced had no test), and its thread contract:
a run paused halfway by a launch hook keeps another thread's run out (removing the lock of
``run``, of an eager bound run or of a slot run makes these fail every time). Accepted and
refused feeds are compared with onnxruntime, values with numpy float64."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_genrt.core.errors import InvalidInputError, ProviderUnavailableError
from onnx_genrt.core.graph_slots import DeviceGraphSlot
from onnx_genrt.session import InferenceSession

from ..models import mlp, mlp_reference
from .test_mixed_placement import Island, IslandArray, Mainland

F = TensorProto.FLOAT


def _neg(dims, name: str = "neg") -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("Neg", ["x"], ["y"], name=name)],
        "neg",
        [helper.make_tensor_value_info("x", F, dims)],
        [helper.make_tensor_value_info("y", F, None)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


@pytest.mark.parametrize("dims", [[1, 4], [0, 4], [-1, 4], ["n", 4]])
@pytest.mark.parametrize("rows", [0, 1, 2])
def test_a_feed_is_refused_where_onnxruntime_refuses_it(dims, rows):
    """A declared dim of 0 or 1 is fixed; a negative or named one is free (onnxruntime's
    rules). Both ``run`` and ``bind_input`` check."""
    model = _neg(dims)
    x = np.arange(rows * 4, dtype=np.float32).reshape(rows, 4)
    reference = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    try:
        want = reference.run(None, {"x": x})[0]
    except Exception:  # noqa: BLE001 - onnxruntime's own error type
        want = None
    sess = InferenceSession(model)
    if want is None:
        with pytest.raises(InvalidInputError, match="input 'x' dimension 0 is"):
            sess.run(None, {"x": x})
        with pytest.raises(InvalidInputError, match="input 'x' dimension 0 is"):
            sess.io_binding().bind_input("x", x)
        return
    (y,) = sess.run(None, {"x": x})
    np.testing.assert_array_equal(y, want)
    np.testing.assert_array_equal(y, -x)


def test_providers_given_as_name_and_options_pairs():
    sess = InferenceSession(
        _neg([2, 4]),
        providers=[("CPUExecutionProvider", {"threads": None, "skinny_matmul": False})],
    )
    (provider,) = sess.providers
    assert provider.name == "cpu" and provider.threads is None
    assert provider.option("skinny_matmul") is False
    x = np.ones((2, 4), np.float32)
    np.testing.assert_array_equal(sess.run(None, {"x": x})[0], -x)


def test_a_provider_list_that_yields_nothing_is_refused():
    """An empty list means the default (the CPU); an iterable that yields no provider is a
    mistake, not a request for the default."""
    assert InferenceSession(_neg([2, 4]), providers=[]).get_providers() == ["cpu"]
    with pytest.raises(ProviderUnavailableError, match="no provider given"):
        InferenceSession(_neg([2, 4]), providers=(p for p in ["cpu"] if p != "cpu"))


def test_the_main_provider_is_the_first_the_plan_runs_on():
    """The island has no Neg: the plan runs on the mainland alone, whose arrays bindings
    and the engine's transfers then use; nothing crosses."""
    island, mainland = Island(), Mainland()
    sess = InferenceSession(_neg([2, 4]), providers=[island, mainland])
    assert sess.main_provider is mainland
    binding = sess.io_binding()
    x = binding.bind_input("x", np.zeros((2, 4), np.float32))
    y = binding.bind_output("y", shape=(2, 4), dtype=np.float32)
    assert not isinstance(x, IslandArray) and mainland.holds(y)
    assert not isinstance(sess.device_io.upload(np.zeros(2, np.float32)), IslandArray)
    for step in range(3):
        x[...] = np.arange(8, dtype=np.float32).reshape(2, 4) + step
        sess.run_with_iobinding(binding)
        np.testing.assert_array_equal(y, -x)
    assert sess.graph_stats().as_dict()["edge_copies"] == 0


def test_a_plan_without_steps_takes_the_first_provider_given():
    graph = helper.make_graph(
        [],
        "passthrough",
        [helper.make_tensor_value_info("x", F, [2])],
        [helper.make_tensor_value_info("x", F, [2])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    island, mainland = Island(), Mainland()
    sess = InferenceSession(model, providers=[island, mainland])
    assert sess.main_provider is island
    x = np.array([1.5, -2.0], np.float32)
    np.testing.assert_array_equal(sess.run(None, {"x": x})[0], x)


@pytest.mark.parametrize("unbound", ["x", "y"])
def test_a_bound_run_with_a_value_unbound_names_it(unbound):
    sess = InferenceSession(_neg([2, 4]))
    binding = sess.io_binding()
    if unbound != "x":
        binding.bind_input("x", np.ones((2, 4), np.float32))
    if unbound != "y":
        binding.bind_output("y", shape=(2, 4), dtype=np.float32)
    kind = "inputs" if unbound == "x" else "outputs"
    with pytest.raises(InvalidInputError, match=rf"unbound {kind} \['{unbound}'\]"):
        sess.run_with_iobinding(binding)


def test_a_feed_with_a_dtype_but_no_shape_is_converted_and_refused():
    class DtypeOnly:
        dtype = np.dtype(np.float32)

    with pytest.raises(InvalidInputError, match="input 'x' expects float32, got object"):
        InferenceSession(_neg([2, 4])).run(None, {"x": DtypeOnly()})


def _resident_bytes(path: Path) -> int:
    """Resident bytes of this process's mappings of ``path`` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            parts = line.split()
            if len(parts) >= 5 and "-" in parts[0] and ":" in parts[3]:  # a mapping's header
                inside = parts[-1] == str(path)
            elif inside and parts[0] == "Rss:":
                total += int(parts[1]) * 1024
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux /proc")
def test_mapped_weights_that_fusion_replaced_leave_memory(tmp_path):
    """Gate and up weights (4 MiB, mapped from their file) are merged into one new weight:
    once the session is made, no page of the originals stays resident; the bias, read as it
    is, stays mapped. The output matches numpy float64."""
    rng = np.random.default_rng(9)
    hidden, ffn = 512, 1024
    wg, wu = (rng.standard_normal((2, hidden, ffn)) / np.sqrt(hidden)).astype(np.float32)
    bias = rng.standard_normal(ffn).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "wg"], ["g"]),
        helper.make_node("MatMul", ["x", "wu"], ["u"]),
        helper.make_node("Sigmoid", ["g"], ["s"]),
        helper.make_node("Mul", ["g", "s"], ["gs"]),
        helper.make_node("Mul", ["gs", "u"], ["act"]),
        helper.make_node("Add", ["act", "bias"], ["y"]),
    ]
    inits = [numpy_helper.from_array(a, n) for a, n in ((wg, "wg"), (wu, "wu"), (bias, "bias"))]
    graph = helper.make_graph(
        nodes,
        "gated",
        [helper.make_tensor_value_info("x", F, [2, hidden])],
        [helper.make_tensor_value_info("y", F, [2, ffn])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    onnx.save_model(
        model,
        str(tmp_path / "model.onnx"),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="weights.bin",
        size_threshold=0,
    )
    sess = InferenceSession(tmp_path)
    assert "wg" not in sess.plan.constants and "wu" not in sess.plan.constants
    assert _resident_bytes((tmp_path / "weights.bin").resolve()) < 64 << 10
    x = rng.standard_normal((2, hidden)).astype(np.float32)
    (y,) = sess.run(None, {"x": x})
    g, u = x.astype(np.float64) @ wg, x.astype(np.float64) @ wu
    np.testing.assert_allclose(y, g / (1 + np.exp(-g)) * u + bias, rtol=1e-4, atol=1e-4)


# -- the thread contract: one run at a time ---------------------------------------------------
HIDDEN = 16


class PauseAt:
    """A launch hook that holds thread ``thread``'s run before node ``node`` (once) until
    ``done`` is set, for at most ``wait`` seconds: another thread's whole run fits in the
    pause unless the session keeps it out."""

    def __init__(self, thread: str, node: str, wait: float = 0.5) -> None:
        self.thread, self.node, self.wait = thread, node, wait
        self.paused, self.done = threading.Event(), threading.Event()

    @contextlib.contextmanager
    def __call__(self, node) -> Iterator[None]:
        here = threading.current_thread().name == self.thread
        if here and node.name == self.node and not self.paused.is_set():
            self.paused.set()
            self.done.wait(self.wait)
        yield


def _race(sess: InferenceSession, first: Callable[[], None], second: Callable[[], None]):
    """``first`` in thread A, paused before its relu; ``second`` in thread B, started once A
    is paused. Both must finish."""
    pause = PauseAt("A", "relu")

    def run_second() -> None:
        assert pause.paused.wait(10)
        second()
        pause.done.set()

    with sess.on_launch(pause):
        threads = [
            threading.Thread(target=first, name="A"),
            threading.Thread(target=run_second, name="B"),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    assert pause.paused.is_set() and not any(t.is_alive() for t in threads)


def _check(model, x, y) -> None:
    np.testing.assert_allclose(y, mlp_reference(model, x), rtol=1e-5, atol=1e-5)


def test_a_run_paused_halfway_keeps_another_threads_run_out():
    """Two runs of one shape share the eager layout's arena: B's run must wait for A's."""
    model = mlp(hidden=HIDDEN, seed=3)
    sess = InferenceSession(model)
    rng = np.random.default_rng(10)
    xa, xb = rng.standard_normal((2, 3, HIDDEN)).astype(np.float32)
    sess.run(None, {"x": xa})  # plans the layout both runs use
    got = {}
    _race(
        sess,
        lambda: got.update(a=sess.run(None, {"x": xa})[0]),
        lambda: got.update(b=sess.run(None, {"x": xb})[0]),
    )
    _check(model, xa, got["a"])
    _check(model, xb, got["b"])


def _bound(sess: InferenceSession, x: np.ndarray):
    binding = sess.io_binding()
    bound_x = binding.bind_input("x", x)
    return binding, bound_x, binding.bind_output("y", shape=x.shape, dtype=np.float32)


def test_an_eager_bound_run_paused_halfway_keeps_another_threads_run_out():
    model = mlp(hidden=HIDDEN, seed=4)
    sess = InferenceSession(model)
    rng = np.random.default_rng(11)
    (a, xa, ya), (b, xb, yb) = (
        _bound(sess, rng.standard_normal((3, HIDDEN)).astype(np.float32)) for _ in range(2)
    )
    sess.run_eager_with_iobinding(a)  # plans the eager layout both runs use
    _race(sess, lambda: sess.run_eager_with_iobinding(a), lambda: sess.run_eager_with_iobinding(b))
    _check(model, xa, ya)
    _check(model, xb, yb)


def test_a_capture_paused_halfway_records_no_other_threads_launches():
    """A captures its PRIMARY graph while B makes its first VERIFY run: B waits, so A's
    graph holds A's steps only, and replaying it never writes B's buffers."""
    model = mlp(hidden=HIDDEN, seed=5)
    sess = InferenceSession(model)
    rng = np.random.default_rng(12)
    (a, xa, ya), (b, xb, yb) = (
        _bound(sess, rng.standard_normal((3, HIDDEN)).astype(np.float32)) for _ in range(2)
    )
    primary, verify = DeviceGraphSlot.PRIMARY, DeviceGraphSlot.VERIFY
    sess.run_with_iobinding(a, primary)  # planned (one warm-up): A's next run captures
    _race(
        sess,
        lambda: sess.run_with_iobinding(a, primary),
        lambda: sess.run_with_iobinding(b, verify),
    )
    assert sess.graph_stats(primary).captures == 1
    _check(model, xa, ya)
    _check(model, xb, yb)
    for _ in range(3):
        xa[...], xb[...] = rng.standard_normal((2, 3, HIDDEN))
        sess.run_with_iobinding(b, verify)
        _check(model, xb, yb)
        b_result = yb.copy()
        xb[...] = rng.standard_normal(xb.shape)  # B's next input, written but not run yet
        sess.run_with_iobinding(a, primary)  # a replay
        _check(model, xa, ya)
        np.testing.assert_array_equal(yb, b_result)
    assert sess.graph_stats(primary).replays == 3
