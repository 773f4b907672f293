"""Graph slot lifecycle on the kit model, in every slot the provider under test declares:
capture and replay with new inputs each step, reset of one slot, abort and latch, a
displaced owner, and slots side by side. Each output is checked against numpy float64."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from onnx_genrt.core.errors import GraphCaptureError
from onnx_genrt.core.graph_slots import DeviceGraphSlot

from .models import kit_model, kit_reference
from .plugin import KitTarget, kit_target

HIDDEN = 16
RTOL = ATOL = 1e-5


def declared_slots(target: KitTarget) -> list[DeviceGraphSlot]:
    if target.unavailable_reason():
        return []
    return sorted(target.create().graph_slots, key=lambda s: s.value)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "slot" in metafunc.fixturenames:
        slots = declared_slots(kit_target(metafunc.config))
        metafunc.parametrize(
            "slot", slots or [pytest.param(None, marks=pytest.mark.skip("declares no slot"))]
        )


class Bound:
    """A session on the provider under test (then its fallbacks), bound for ``rows`` rows."""

    def __init__(
        self, target: KitTarget, provider: Any, rows: int, seed: int = 0, share: Bound | None = None
    ) -> None:
        from onnx_genrt.session import InferenceSession

        if share is not None:  # another binding on the same session
            self.model, self.session = share.model, share.session
        else:
            self.model = kit_model(HIDDEN, seed)
            self.session = InferenceSession(self.model, providers=target.stack(provider))
        placed = {p.provider for p in self.session.placement()}
        if target.name not in placed:
            pytest.skip(f"{target.name!r} claims no node of the kit model (ops: MatMul, Add, ...)")
        self.binding = self.session.io_binding()
        self.x = self.binding.bind_input("x", np.zeros((rows, HIDDEN), np.float32))
        self.y = self.binding.bind_output("y", shape=(rows, HIDDEN))
        self.provider = provider
        self.rng = np.random.default_rng(seed + 100 * rows)

    def step(self, slot: DeviceGraphSlot) -> None:
        """New input values, one bound run in ``slot``, output checked against float64."""
        x = self.rng.standard_normal(self.x.shape).astype(np.float32)
        self.provider.upload(x, out=self.x)
        self.session.run_with_iobinding(self.binding, slot)
        got = self.session.main_provider.read([self.y])[0]
        np.testing.assert_allclose(
            np.asarray(got, np.float64),
            kit_reference(self.model, x),
            rtol=RTOL,
            atol=ATOL,
            err_msg=f"slot {slot.value}: bound output differs from numpy float64",
        )

    def stats(self, slot: DeviceGraphSlot):
        return self.session.graph_stats(slot)


def _replays_on(bound: Bound, slot: DeviceGraphSlot, name: str, steps: int) -> None:
    stats = bound.stats(slot)
    assert stats.fallbacks == 0, f"slot {slot.value} fell back: {dict(stats.fallback_reasons)}"
    assert stats.captures == 1, f"slot {slot.value}: {stats.captures} captures, expected 1"
    assert stats.replays == steps - 2, f"slot {slot.value}: {stats.replays} replays"
    assert stats.provider_replays[name] >= stats.replays, (
        f"slot {slot.value}: {name!r} replayed {stats.provider_replays[name]} parts in "
        f"{stats.replays} replays"
    )


def test_capture_then_replay_with_new_inputs(genrt_target: KitTarget, slot: DeviceGraphSlot):
    bound = Bound(genrt_target, genrt_target.create(), rows=3)
    for _ in range(6):
        bound.step(slot)
    _replays_on(bound, slot, genrt_target.name, 6)
    assert bound.provider.graph_parts(slot), f"{genrt_target.name!r} holds no part in {slot}"


def test_reset_one_slot_leaves_the_others(genrt_target: KitTarget, slot: DeviceGraphSlot):
    provider = genrt_target.create()
    others = sorted(provider.graph_slots - {slot}, key=lambda s: s.value)
    if not others:
        pytest.skip(f"{genrt_target.name!r} declares one slot only")
    bound = Bound(genrt_target, provider, rows=2)
    for s in (slot, *others):
        for _ in range(3):
            bound.step(s)
    bound.session.executor.reset_slot(slot)
    assert not provider.graph_parts(slot), f"reset left parts in {slot.value}"
    assert not provider.has_graph(slot), f"reset left a graph in {slot.value}"
    for s in others:
        assert provider.graph_parts(s), f"resetting {slot.value} dropped {s.value}"
        bound.step(s)
        assert bound.stats(s).replays == 2, f"{s.value} did not replay after the reset"
    for _ in range(3):  # the reset slot captures again and replays
        bound.step(slot)
    assert bound.stats(slot).captures == 2 and bound.stats(slot).replays >= 2


def test_abort_latches_the_slot_until_reset(genrt_target: KitTarget, slot: DeviceGraphSlot):
    provider = genrt_target.create()
    bound = Bound(genrt_target, provider, rows=2)
    bound.step(slot)  # the first run plans memory; the next would capture
    provider.begin_capture(slot, owner=object())
    provider.abort_capture(slot, "aborted by the kit")
    assert provider.capture_error(slot) == "aborted by the kit"
    assert not provider.has_graph(slot)
    for other in provider.graph_slots - {slot}:
        assert provider.capture_error(other) is None, f"aborting {slot.value} latched {other}"
    with pytest.raises(GraphCaptureError, match="latched"):
        provider.begin_capture(slot)
    for _ in range(3):  # latched: the session runs eagerly, still correct
        bound.step(slot)
    stats = bound.stats(slot)
    assert stats.captures == 0 and stats.fallbacks == 3, stats.as_dict()
    assert any("aborted by the kit" in r for r in stats.fallback_reasons)
    provider.reset_graph(slot)
    assert provider.capture_error(slot) is None
    for _ in range(3):
        bound.step(slot)
    assert bound.stats(slot).captures == 1 and bound.stats(slot).replays == 2


def test_two_sessions_on_one_provider_displace_each_other(
    genrt_target: KitTarget, slot: DeviceGraphSlot
):
    provider = genrt_target.create()
    first = Bound(genrt_target, provider, rows=2, seed=1)
    second = Bound(genrt_target, provider, rows=3, seed=2)
    for _ in range(3):
        first.step(slot)
    assert provider.graph_owner(slot) is first.session.executor
    for _ in range(3):
        second.step(slot)
    assert provider.graph_owner(slot) is second.session.executor
    for _ in range(4):  # each run must notice the other owner and never replay its graph
        first.step(slot)
        second.step(slot)
    assert first.stats(slot).displaced + second.stats(slot).displaced >= 1


def test_slots_side_by_side(genrt_target: KitTarget):
    provider = genrt_target.create()
    slots = sorted(provider.graph_slots, key=lambda s: s.value)
    if len(slots) < 2:
        pytest.skip(f"{genrt_target.name!r} declares fewer than two slots")
    first = Bound(genrt_target, provider, rows=1)
    bound = {s: Bound(genrt_target, provider, rows=1 + i, share=first) for i, s in enumerate(slots)}
    for _ in range(5):
        for s in slots:
            bound[s].step(s)
    for s in slots:
        _replays_on(bound[s], s, genrt_target.name, 5)
