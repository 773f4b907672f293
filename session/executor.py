"""The executor: one session's coordinator of the parts that run its plan.

It builds and holds the parts, each in its own module, and routes every session API to
them:

- ``ConstantCache`` (``session.constant_cache``): constants on each provider, uploaded or
  in a kernel's prepacked layout, made once (host arrays of prepacked ones released);
- ``Interpreter`` (``session.interpreter``): runs the steps eagerly, segment by segment,
  with launch hooks (:meth:`Executor.on_launch`);
- ``MemoryPlanner`` (``session.memory_planner``): liveness, and the layouts planned from
  recorded first runs (kept per input-shape set for eager runs);
- ``SlotRunner`` (``session.slot_runner``): bound runs in graph slots, the per-slot
  capture state machine with its state and counters.

The executor itself runs the eager roads (host feeds, and bound prefills with a row tail)
and holds the providers' locks around every run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import numpy as np

from onnx_genrt.core.errors import KernelError
from onnx_genrt.core.graph_slots import DeviceGraphSlot
from onnx_genrt.core.locking import hold
from onnx_genrt.core.provider import ExecutionProvider

from .binding import IOBinding, Signature
from .constant_cache import ConstantCache
from .interpreter import Interpreter, LaunchHook
from .layout import Layout
from .memory_planner import MemoryPlanner
from .plan import GraphPlan
from .row_tail import RowTail, find_row_tail
from .segments import Segment, split_segments
from .slot_runner import SlotRunner
from .slot_state import SlotState, SlotStats

__all__ = ["Executor", "LaunchHook", "Layout", "SlotState", "SlotStats"]


class Executor:
    """Runs a :class:`GraphPlan`; shared by every session API (run, bindings, slots)."""

    def __init__(self, plan: GraphPlan, *, graphs: bool = True, warmup_runs: int = 1) -> None:
        self.plan = plan
        #: The providers the plan's steps run on (computed once: every run asks).
        self.providers: list[ExecutionProvider] = plan.providers
        self.main_provider = plan.providers[0] if plan.providers else None
        self.segments: list[Segment] = split_segments(plan.steps, plan.constants)
        self.constants = ConstantCache(
            plan.constants, plan.steps, keep={o.name for o in plan.outputs}
        )
        self.memory = MemoryPlanner(plan, self.segments)
        self.interpreter = Interpreter(plan, self.segments, self.constants, self.memory.free_after)
        self.slots = SlotRunner(
            self, self.interpreter, self.memory, graphs=graphs, warmup_runs=warmup_runs
        )
        self._graph_outputs = {o.name for o in plan.outputs}
        self._row_tails: dict[str, RowTail | None] = {}

    def on_launch(self, hook: LaunchHook) -> AbstractContextManager[None]:
        """A context manager: ``hook(node)`` wraps every kernel launch while it is open
        (:meth:`Interpreter.on_launch`)."""
        return self.interpreter.on_launch(hook)

    def to_host(self, value: Any) -> np.ndarray:
        """``value`` (any provider's array of this plan, or a host array) as a numpy array."""
        return self.interpreter.to_host(value)

    # -- graph slots (the SlotRunner's) -------------------------------------------
    @property
    def graph_slot(self) -> DeviceGraphSlot:
        return self.slots.graph_slot

    def set_graph_slot(self, slot: DeviceGraphSlot) -> None:
        """Route later bound runs to ``slot``. Other slots keep their graphs."""
        self.slots.set_graph_slot(slot)

    def stats(self, slot: DeviceGraphSlot | str | None = None) -> SlotStats:
        """The counters of ``slot`` (all its variants together)."""
        return self.slots.stats(slot)

    def all_stats(self) -> dict[str, dict[str, Any]]:
        """The counters of every slot used so far, by slot name."""
        return self.slots.all_stats()

    def reset_slot(
        self, slot: DeviceGraphSlot, signature: Signature | None = None, variant: int | None = None
    ) -> None:
        """Drop the slot's graph, latch and planned memory (:meth:`SlotRunner.reset_slot`)."""
        self.slots.reset_slot(slot, signature, variant)

    def peak_bytes(self, slot: DeviceGraphSlot | None = None) -> tuple[int, int] | None:
        """(arena bytes, naive bytes) of the slot's memory plan, all providers, once planned."""
        return self.slots.peak_bytes(slot)

    def run_bound(
        self, binding: IOBinding, slot: DeviceGraphSlot | None = None, variant: int = 0
    ) -> None:
        """Run with persistent bindings in ``slot`` (default: the current graph slot), as
        the slot's graph ``variant``.

        Thread-safe: runs hold the locks of the plan's providers, one run at a time."""
        with hold(self.providers):
            self.slots.run(binding, slot, variant)

    # -- eager runs -----------------------------------------------------------------
    def run(self, feeds: Mapping[str, Any], output_names: Sequence[str]) -> list[Any]:
        """Eager run on fresh outputs; memory planned per distinct input-shape set.

        Thread-safe (the provider locks are held): results never come from another run."""
        with hold(self.providers):
            return self._run(feeds, output_names)

    def _run(self, feeds: Mapping[str, Any], output_names: Sequence[str]) -> list[Any]:
        env = dict(feeds)
        layout = self._eager_run(env, {})
        results = []
        for name in output_names:
            value = env[name] if name in env else self.constants.host(name)
            # A host view into an arena would be overwritten by the next run; device
            # values are copied to the host by the caller before anything else runs.
            if isinstance(value, np.ndarray) and any(
                isinstance(arena, np.ndarray) and np.may_share_memory(value, arena)
                for arena in layout.arenas
            ):
                value = value.copy()
            results.append(value)
        return results

    def row_tail(self, output: str) -> RowTail | None:
        """The steps that make graph output ``output`` row by row from one projection, and
        the graph outputs they make (``session.row_tail``); None where there are none."""
        if output not in self._row_tails:
            self._row_tails[output] = find_row_tail(
                self.plan.steps, self.plan.constants, self._graph_outputs, output
            )
        return self._row_tails[output]

    def run_bound_eager(self, binding: IOBinding, last_row_of: str | None = None) -> None:
        """Run on bound buffers without any graph slot (prefill-like, varying shapes).

        ``last_row_of``: the steps of that output's :meth:`row_tail` see only the last row
        (token) of their input, so the tail's outputs are bound with one row; every other
        value is computed for all rows. A prefill wants the last row's logits only.
        """
        tail = None
        if last_row_of is not None:
            tail = self.row_tail(last_row_of)
            if tail is None:
                raise KernelError(
                    f"output {last_row_of!r} is not made row by row from one projection "
                    "(a MatMul on a constant weight, a MatMulNBits or a norm fused into one, "
                    "then row-local ops), so it cannot be computed for the last row alone"
                )
        with hold(self.providers):
            self._eager_run(dict(binding.inputs), binding.outputs, tail)

    def _eager_run(
        self, env: dict[str, Any], outs: Mapping[str, Any], tail: RowTail | None = None
    ) -> Layout:
        """Run on the layout kept for these input shapes, or plan one from this run."""
        # the dtype object itself: hashable, and str() of it costs about 2.6 us an input
        shapes = tuple((n, v.dtype, tuple(v.shape)) for n, v in sorted(env.items()))
        key = (tail, shapes)
        layout = self.memory.eager_layout(key)
        if layout is None:
            inputs = set(env)
            layout = self.memory.plan(self.interpreter.first_run(env, outs, tail), inputs, {})
            self.memory.keep_eager_layout(key, layout)
        else:
            self.interpreter.execute(env, layout, outs, tail=tail)
        return layout
