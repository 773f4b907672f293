"""Memory layout of a planned run: the shapes a first run recorded, one arena per provider
for the values its steps make, the kernel contexts with their planned output buffers, and
the buffers that receive values crossing between segments."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from onnx_genrt.core.errors import KernelError
from onnx_genrt.core.kernels import KernelContext
from onnx_genrt.core.provider import ExecutionProvider

from .memory import Lifetime, MemoryPlan, plan_memory
from .segments import Segment


@dataclass
class Layout:
    """Shapes seen in a first run and the memory plans made from them (one arena per
    provider), with the buffers that receive values crossing between segments."""

    shapes: dict[str, tuple[tuple[int, ...], np.dtype]]
    memory: list[tuple[ExecutionProvider, MemoryPlan]]
    arenas: list[Any] = field(default_factory=list)
    buffers: dict[str, Any] = field(default_factory=dict)
    contexts: list[KernelContext] = field(default_factory=list)
    #: (value name, segment index) -> the reading provider's copy of the value.
    edges: dict[tuple[str, int], Any] = field(default_factory=dict)


class Record:
    """Shapes, producers and view aliases seen during a first, unplanned run."""

    def __init__(self) -> None:
        self.shapes: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
        self.produced_at: dict[str, int] = {}
        self.alias_of: dict[str, str] = {}

    def step(self, index: int, step: Any, args: Sequence[Any], results: Sequence[Any]) -> None:
        named = [o for o in step.outputs if o]
        if len(results) < len(named):
            raise KernelError(
                f"{step.node.describe()} returned {len(results)} outputs, expected {len(named)}"
            )
        for name, value in zip(step.outputs, results, strict=False):
            if not name:
                continue
            self.shapes[name] = (tuple(int(d) for d in value.shape), np.dtype(value.dtype))
            self.produced_at[name] = index
            for in_name, arg in zip(step.inputs, args, strict=False):
                if in_name and arg is not None and step.provider.may_share_memory(value, arg):
                    self.alias_of[name] = self.alias_of.get(in_name, in_name)
                    break


def plan_layout(
    record: Record,
    steps: Sequence[Any],
    segments: Sequence[Segment],
    inputs: set[str],
    graph_outputs: set[str],
    last_use: Mapping[str, int],
    outs: Mapping[str, Any],
) -> Layout:
    """Plan memory from a recorded run: values made by a provider share its arena when their
    lifetimes do not overlap; ``outs`` are the bound outputs (empty for an eager run)."""
    last_use = dict(last_use)
    # A view keeps its root's bytes alive: extend the root over the view's readers, and to
    # the end of the run where the view is a graph output (the caller reads it then).
    end = len(steps) - 1
    for view, root in record.alias_of.items():
        view_last = end if view in graph_outputs else last_use.get(view, -1)
        last_use[root] = max(last_use.get(root, -1), view_last)
    groups: dict[int, tuple[ExecutionProvider, list[Lifetime]]] = {}
    segment_end = {i: seg.stop - 1 for seg in segments for i in range(seg.start, seg.stop)}
    for name, (shape, dtype) in record.shapes.items():
        if name in inputs or name in record.alias_of:
            continue
        first = record.produced_at[name]
        provider = steps[first].provider
        last = max(first, last_use.get(name, first))
        if name in graph_outputs:
            bound = outs.get(name)
            if bound is None or provider.holds(bound):
                continue  # written into its bound buffer, or returned as made
            # Made here, copied to another provider's bound buffer after the segment: a
            # buffer of its own until then (a captured part may not allocate).
            last = max(last, segment_end[first])
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        lifetime = Lifetime(name, nbytes, first, last)
        groups.setdefault(id(provider), (provider, []))[1].append(lifetime)
    memory = [(provider, plan_memory(lifetimes)) for provider, lifetimes in groups.values()]
    layout = Layout(record.shapes, memory)
    materialize(layout, steps, outs)
    return layout


def materialize(layout: Layout, steps: Sequence[Any], outs: Mapping[str, Any]) -> None:
    """Allocate the arenas and hand each step its planned output buffers."""
    for provider, memory in layout.memory:
        if not memory.arena_bytes:
            continue
        arena = provider.empty((memory.arena_bytes,), np.uint8)
        layout.arenas.append(arena)
        for name, offset in memory.offsets.items():
            shape, dtype = layout.shapes[name]
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            layout.buffers[name] = arena[offset : offset + nbytes].view(dtype).reshape(shape)
    for step in steps:
        planned = []
        for name in step.outputs:
            bound = outs.get(name)
            if bound is not None and step.provider.holds(bound):
                planned.append(bound)
            else:  # planned here (when bound elsewhere: copied there after the segment)
                planned.append(layout.buffers.get(name))
        layout.contexts.append(KernelContext(step.node, step.provider, planned))
