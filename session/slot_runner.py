"""Bound runs in graph slots: the per-slot capture state machine, its state and counters.

Per slot (and variant) it keeps host capture state (binding signature, warm-up count,
captured graph, planned memory; ``session.slot_state``), so a decode graph in PRIMARY and
a verify graph in VERIFY live side by side and both replay. One bound run in slot ``s``::

    signature changed          -> reset s's graph (invalidations += 1), start over
    graph captured             -> run s's replay program (each provider's parts) (replays += 1)
    first run                  -> eager, record shapes, plan memory
    warm-up not done           -> eager on planned memory
    capture impossible/latched -> eager (fallbacks += 1, reason kept)
    otherwise                  -> capture into s                           (captures += 1)

Variants: a slot holds one graph per *variant* (an integer the caller picks, 0 by
default), each with its own signature, memory plan and program: a batched decode step
keeps one graph per batch-size bucket in PRIMARY, and switching buckets replays instead
of recapturing. Variant ``v``'s parts are numbered from ``v * VARIANT_PARTS`` in the
providers' graphs; the slot's counters are shared by its variants.

Mixed placement: each provider captures its segments (``session.segments``) as parts of
its graph in ``s``; a captured run replays as a program: part replays with the copies of
values crossing providers between them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from onnx_genrt.core.errors import InvalidInputError
from onnx_genrt.core.graph_slots import DeviceGraphSlot
from onnx_genrt.core.provider import ExecutionProvider

from .binding import IOBinding, Signature
from .interpreter import Interpreter
from .memory_planner import MemoryPlanner
from .slot_state import CaptureProgram, SlotState, SlotStats

#: Part numbers reserved for each variant of a slot (segments of one variant count up from
#: ``variant * VARIANT_PARTS``).
VARIANT_PARTS = 1 << 16


class SlotRunner:
    """Runs bound runs in graph slots: eager while warming up, then captured and replayed.

    ``owner`` is the object providers remember as the slot's graph owner (the session's
    executor): a graph another owner captured into a shared provider's slot is never
    replayed as ours.
    """

    def __init__(
        self,
        owner: object,
        interpreter: Interpreter,
        planner: MemoryPlanner,
        *,
        graphs: bool = True,
        warmup_runs: int = 1,
    ) -> None:
        self._owner = owner
        self._interpreter = interpreter
        self._planner = planner
        self.providers: list[ExecutionProvider] = interpreter.providers
        self.graphs_enabled = graphs
        self.warmup_runs = max(1, warmup_runs)
        self._slot = DeviceGraphSlot.PRIMARY
        self._states: dict[tuple[DeviceGraphSlot, int], SlotState] = {}
        self._stats: dict[DeviceGraphSlot, SlotStats] = {}

    # -- slots, state and counters ------------------------------------------------
    @property
    def graph_slot(self) -> DeviceGraphSlot:
        return self._slot

    def set_graph_slot(self, slot: DeviceGraphSlot) -> None:
        """Route later bound runs to ``slot``. Other slots keep their graphs."""
        self._slot = slot

    def state(self, slot: DeviceGraphSlot | None = None, variant: int = 0) -> SlotState:
        """The host state of ``slot``'s ``variant`` (default: the current slot)."""
        slot = self._slot if slot is None else slot
        state = self._states.get((slot, variant))
        if state is None:
            stats = self._stats.setdefault(slot, SlotStats())
            state = self._states[slot, variant] = SlotState(stats=stats)
        return state

    def stats(self, slot: DeviceGraphSlot | str | None = None) -> SlotStats:
        """The counters of ``slot`` (a slot or its name; all its variants together)."""
        if slot is None:
            slot = self._slot
        elif not isinstance(slot, DeviceGraphSlot):
            names = [s.value for s in DeviceGraphSlot]
            if slot not in names:
                raise InvalidInputError(f"no graph slot {slot!r}; the slots are {names}")
            slot = DeviceGraphSlot(slot)
        return self._stats.setdefault(slot, SlotStats())

    def all_stats(self) -> dict[str, dict[str, Any]]:
        """The counters of every slot used so far, by slot name."""
        return {s.value: st.as_dict() for s, st in self._stats.items()}

    def variants(self, slot: DeviceGraphSlot) -> list[int]:
        """The variants of ``slot`` holding a captured graph."""
        return sorted(v for (s, v), st in self._states.items() if s == slot and st.captured)

    def reset_slot(
        self, slot: DeviceGraphSlot, signature: Signature | None = None, variant: int | None = None
    ) -> None:
        """Drop the slot's graph (every provider's parts), latch and planned memory, for
        one variant or (``variant=None``) all of them; other slots are untouched. Dropping
        a captured graph counts as an invalidation."""
        others = [v for v in self.variants(slot) if v != variant]
        if variant is not None and others:  # the other variants keep their graphs
            parts = range(variant * VARIANT_PARTS, (variant + 1) * VARIANT_PARTS)
            for provider in self.providers:
                if slot in provider.graph_slots:
                    provider.reset_parts(slot, parts)
            self._forget(slot, variant, signature)
            return
        # The whole slot: every part, and the latch of a failed capture (the next run
        # tries again).
        for provider in self.providers:
            if slot in provider.graph_slots:
                provider.reset_graph(slot)
        forget = [v for s, v in self._states if s == slot] if variant is None else [variant]
        for v in forget:
            self._forget(slot, v, signature)

    def _forget(self, slot: DeviceGraphSlot, variant: int, signature: Signature | None) -> None:
        state = self.state(slot, variant)
        if state.captured:
            state.stats.invalidations += 1
        state.captured = False
        state.signature = signature
        state.warmups = 0
        state.layout = None
        state.program = []

    def capture_blocker(self, slot: DeviceGraphSlot) -> str | None:
        """Why ``slot`` cannot be captured, or None when it can: every provider the plan
        runs on must hold the slot, and none may be latched after a failed capture."""
        for provider in self.providers:
            if slot not in provider.graph_slots:
                declared = ", ".join(sorted(s.value for s in provider.graph_slots)) or "none"
                return (
                    f"provider {provider.name!r} has no graph slot {slot.value!r} "
                    f"(declares: {declared})"
                )
            latched = provider.capture_error(slot)
            if latched:
                return f"capture failed earlier on {provider.name!r}: {latched}"
        return None

    # -- one bound run ------------------------------------------------------------
    def run(
        self, binding: IOBinding, slot: DeviceGraphSlot | None = None, variant: int = 0
    ) -> None:
        """One bound run in ``slot`` (default: the current slot) as its graph ``variant``.
        The caller holds the providers' locks."""
        slot = self._slot if slot is None else slot
        state = self.state(slot, variant)
        sig = binding.signature()
        if sig != state.signature:
            self.reset_slot(slot, sig, variant)
        env = dict(binding.inputs)
        outs = binding.outputs
        if state.captured and any(p.graph_owner(slot) is not self._owner for p in self.providers):
            # Another session on a provider captured into the slot since: our graph is
            # gone (and the slot's pinned workspace may have moved). Capture again.
            state.captured = False
            state.stats.invalidations += 1
            state.stats.displaced += 1
        if state.captured:
            for action in state.program:
                action()
            state.stats.replays += 1
            return
        if state.layout is None:
            inputs = set(env)
            state.layout = self._planner.plan(self._interpreter.first_run(env, outs), inputs, outs)
            state.warmups = 1
            state.stats.eager_runs += 1
            return
        if not self.graphs_enabled or state.warmups < self.warmup_runs:
            self._interpreter.execute(env, state.layout, outs)
            state.warmups += 1
            state.stats.eager_runs += 1
            return
        blocker = self.capture_blocker(slot)
        if blocker is not None:
            state.stats.fallbacks += 1
            state.stats.fallback_reasons[blocker] += 1
            state.stats.eager_runs += 1
            self._interpreter.execute(env, state.layout, outs)
            return
        self._capture(slot, variant, state, env, outs)

    def _capture(
        self, slot: DeviceGraphSlot, variant: int, state: SlotState, env: dict, outs: Mapping
    ) -> None:
        """Capture every segment as a part of its provider's graph in ``slot`` (running the
        step once), and keep the replay program; on failure latch, drop the parts captured
        so far and run eagerly."""
        for provider in self.providers:
            provider.workspace.pin(slot)
        capture = CaptureProgram(slot, self._owner, state.stats, variant * VARIANT_PARTS)
        try:
            self._interpreter.execute(dict(env), state.layout, outs, capture=capture)
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}"
            self._discard_capture(slot, capture, reason)
            state.stats.fallbacks += 1
            state.stats.fallback_reasons[f"capture failed: {reason}"] += 1
            state.stats.eager_runs += 1
            self._interpreter.execute(env, state.layout, outs)
            return
        except BaseException:
            # An interrupt (Ctrl-C, a cancelled thread) is no capture failure: the slot is
            # left free to capture at the next run, and the collector runs again.
            self._discard_capture(slot, capture, None)
            raise
        state.program = capture.program
        state.captured = True
        state.stats.captures += 1

    def _discard_capture(
        self, slot: DeviceGraphSlot, capture: CaptureProgram, reason: str | None
    ) -> None:
        """Stop the capture that runs, latched with ``reason`` (not latched when None), and
        drop the parts this capture made on every provider."""
        for provider in self.providers:
            if provider is capture.provider:
                provider.abort_capture(slot, reason or "interrupted", latch=reason is not None)
            provider.reset_parts(slot, capture.parts(provider))
            provider.workspace.unpin(slot)

    def peak_bytes(self, slot: DeviceGraphSlot | None = None) -> tuple[int, int] | None:
        """(arena bytes, naive bytes) of the slot's memory plan (variant 0), all providers,
        once planned."""
        layout = self.state(slot).layout
        if layout is None:
            return None
        return (
            sum(m.arena_bytes for _, m in layout.memory),
            sum(m.naive_bytes for _, m in layout.memory),
        )
