"""Launch hooks (``InferenceSession.on_launch``): called around every kernel launch of an
eager walk, in order, with the node; nothing of them runs when no hook is registered; and
``step_profile`` times the nodes of a decode step through them."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest

from onnx_genrt.core.errors import KernelError
from onnx_genrt.core.graph_slots import DeviceGraphSlot
from onnx_genrt.providers.cpu.provider import CPUProvider
from onnx_genrt.session import InferenceSession
from onnx_genrt.session.interpreter import Interpreter

from ..models import mlp, mlp_reference

HIDDEN = 8


class LoggingCPU(CPUProvider):
    """The CPU provider, logging each launch into a shared event list."""

    name = "logging-cpu"

    def __init__(self, events: list[tuple[str, str]]) -> None:
        super().__init__()
        self.events = events

    def launch(self, kdef, ctx, inputs):
        self.events.append(("launch", ctx.node.name))
        return super().launch(kdef, ctx, inputs)


def _hook(events: list[tuple[str, str]], tag: str = ""):
    @contextmanager
    def hook(node) -> Iterator[None]:
        events.append((f"enter{tag}", node.name))
        yield
        events.append((f"exit{tag}", node.name))

    return hook


def _feed(rows: int = 2) -> np.ndarray:
    return np.random.default_rng(rows).standard_normal((rows, HIDDEN)).astype(np.float32)


def test_a_hook_wraps_every_launch_of_an_eager_run_in_node_order():
    model = mlp(hidden=HIDDEN)
    events: list[tuple[str, str]] = []
    sess = InferenceSession(model, providers=[LoggingCPU(events)])
    x = _feed()
    with sess.on_launch(_hook(events)):
        (y,) = sess.run(["y"], {"x": x})
    order = [s.node.name for s in sess.plan.steps]  # plan order: mm1 and its bias are one step
    assert order[0] == "mm1/MatMulAdd"
    assert events == [(kind, name) for name in order for kind in ("enter", "launch", "exit")]
    np.testing.assert_allclose(y, mlp_reference(model, x), rtol=1e-5, atol=1e-5)
    events.clear()
    sess.run(["y"], {"x": x})  # the block is closed: launches only
    assert events == [("launch", name) for name in order]


def test_hooks_nest_in_the_order_they_were_added_and_leave_one_by_one():
    model = mlp(hidden=HIDDEN)
    events: list[tuple[str, str]] = []
    sess = InferenceSession(model, providers=[LoggingCPU(events)])
    first = sess.plan.steps[0].node.name
    with sess.on_launch(_hook(events, "1")):
        with sess.on_launch(_hook(events, "2")):
            sess.run(["y"], {"x": _feed()})
        assert events[:5] == [
            ("enter1", first),
            ("enter2", first),
            ("launch", first),
            ("exit2", first),
            ("exit1", first),
        ]
        events.clear()
        sess.run(["y"], {"x": _feed()})
        assert events[:3] == [("enter1", first), ("launch", first), ("exit1", first)]
        assert not any(kind.endswith("2") for kind, _ in events)


def test_bound_runs_show_their_eager_and_capture_walks_but_no_replay():
    """Warm-up (planning) and capture walk the nodes; a replay launches none one by one."""
    model = mlp(hidden=HIDDEN)
    events: list[tuple[str, str]] = []
    sess = InferenceSession(model, providers=[LoggingCPU(events)])
    binding = sess.io_binding()
    x = binding.bind_input("x", _feed())
    y = binding.bind_output("y", shape=(2, HIDDEN))
    nodes = len(sess.plan.steps)
    seen = []
    with sess.on_launch(_hook(events)):
        for _ in range(4):
            events.clear()
            x[...] = _feed()
            sess.run_with_iobinding(binding, DeviceGraphSlot.PRIMARY)
            np.testing.assert_allclose(y, mlp_reference(model, x), rtol=1e-5, atol=1e-5)
            seen.append(sum(kind == "enter" for kind, _ in events))
    stats = sess.graph_stats(DeviceGraphSlot.PRIMARY)
    assert (stats.eager_runs, stats.captures, stats.replays) == (1, 1, 2)
    assert seen == [nodes, nodes, 0, 0]


def test_a_hook_sees_the_failing_launch_and_the_error_still_names_the_node():
    model = mlp(hidden=HIDDEN)
    sess = InferenceSession(model)
    failures: list[tuple[str, type]] = []

    @contextmanager
    def hook(node) -> Iterator[None]:
        try:
            yield
        except Exception as exc:
            failures.append((node.name, type(exc)))
            raise

    wrong = np.zeros((2, HIDDEN + 1), np.float32)  # mm1 cannot multiply it by w1
    with sess.on_launch(hook), pytest.raises(KernelError, match="node 'mm1/MatMulAdd'"):
        sess.executor.run({"x": wrong}, ["y"])
    assert failures == [("mm1/MatMulAdd", KernelError)]  # mm1 with its bias Add


def test_without_hooks_no_hook_machinery_runs(monkeypatch):
    """Unused, the hook costs a falsy check per launch: the hooked launch is never taken,
    neither before any hook was added nor after the last one left."""
    model = mlp(hidden=HIDDEN)
    sess = InferenceSession(model)
    x = _feed()
    hooked = []
    original = Interpreter._launch_hooked

    def spy(self, *args):
        hooked.append(args[2].node.name)
        return original(self, *args)

    monkeypatch.setattr(Interpreter, "_launch_hooked", spy)
    (y,) = sess.run(["y"], {"x": x})
    assert hooked == []
    with sess.on_launch(_hook([])):
        sess.run(["y"], {"x": x})
    assert hooked == [s.node.name for s in sess.plan.steps]
    hooked.clear()
    (again,) = sess.run(["y"], {"x": x})
    assert hooked == []
    np.testing.assert_array_equal(again, y)


def test_step_profile_times_every_node_of_the_step_and_of_the_work_after_it():
    """``profile_nodes`` on the embedded model: one time per node of the decoder's eager
    step, in plan order, then the nodes of the work ``then`` runs on another session."""
    from onnx_genrt.engine import Model
    from onnx_genrt.generate_cli import default_model_dir
    from onnx_genrt.tools.step_profile import profile_nodes

    class Owner:
        pass

    model = Model(default_model_dir(), "cpu")
    owner = Owner()
    runner = model.acquire_runner(owner, 32)
    runner.forward(list(range(1, 9)), None)
    tail_model = mlp(hidden=HIDDEN)
    after = model.session.sibling(tail_model)
    x = _feed()
    nodes = profile_nodes(
        runner, 2, repeats=2, then=lambda: after.run(None, {"x": x}), then_session=after
    )
    expected = [p.node for p in model.session.placement()] + [s.node.name for s in after.plan.steps]
    assert [n.name for n in nodes] == expected
    assert all(n.ms >= 0 for n in nodes)
    assert runner.cache.length == 8  # rewound to where it was
