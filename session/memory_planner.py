"""Memory planning of a plan's runs: the liveness of its values, and the layouts planned
from recorded first runs.

A first run (with no layout) records every value's shape (``session.layout.Record``); the
planner turns that record into a :class:`~session.layout.Layout`: one arena per provider,
intermediates placed by liveness (``session.memory.plan_memory``). A slot variant keeps
its layout in its ``SlotState``; eager runs keep theirs here, one per input-shape set, for
the :data:`EAGER_PLAN_CACHE` most recently used.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

from .layout import Layout, Record, plan_layout
from .plan import GraphPlan
from .segments import Segment

#: Eager (unslotted) runs keep memory plans for this many distinct input shapes.
EAGER_PLAN_CACHE = 8


def liveness(
    steps: Sequence[Any], constants: Mapping[str, Any], graph_outputs: set[str]
) -> tuple[dict[str, int], list[list[str]]]:
    """(last reader of each computed or fed value, the values to drop after each step):
    a value no graph output needs is dropped right after its last reader."""
    last_use: dict[str, int] = {}
    for i, step in enumerate(steps):
        for name in step.inputs:
            if name and name not in constants:
                last_use[name] = i
    free_after: list[list[str]] = [[] for _ in steps]
    for name, i in last_use.items():
        if name not in graph_outputs:
            free_after[i].append(name)
    return last_use, free_after


class MemoryPlanner:
    """Plans the memory of a plan's runs from what their first run recorded."""

    def __init__(self, plan: GraphPlan, segments: Sequence[Segment]) -> None:
        self._steps = plan.steps
        self._segments = segments
        self._graph_outputs = {o.name for o in plan.outputs}
        self.last_use, self.free_after = liveness(plan.steps, plan.constants, self._graph_outputs)
        self._eager: OrderedDict[Hashable, Layout] = OrderedDict()

    def plan(self, record: Record, inputs: set[str], bound: Mapping[str, Any]) -> Layout:
        """The layout for runs shaped like ``record``'s: ``inputs`` are fed (never
        planned), ``bound`` the outputs written into bound buffers (empty for eager runs)."""
        return plan_layout(
            record,
            self._steps,
            self._segments,
            inputs,
            self._graph_outputs,
            self.last_use,
            bound,
        )

    # -- eager runs: a small cache of layouts by input shapes ----------------------
    def eager_layout(self, key: Hashable) -> Layout | None:
        """The eager layout kept for ``key`` (now the most recently used), or None."""
        layout = self._eager.get(key)
        if layout is not None:
            self._eager.move_to_end(key)
        return layout

    def keep_eager_layout(self, key: Hashable, layout: Layout) -> None:
        """Keep ``layout`` for ``key``, dropping the least recently used past the cap."""
        self._eager[key] = layout
        if len(self._eager) > EAGER_PLAN_CACHE:
            self._eager.popitem(last=False)

    def eager_keys(self) -> list[Hashable]:
        """The keys of the kept eager layouts, least recently used first."""
        return list(self._eager)
