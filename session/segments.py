"""Cut a plan's steps into segments: maximal runs of consecutive steps on one provider.

A bound run is captured segment by segment: each provider records its segments as parts
of its graph in the run's slot, and the values that cross from one segment to another
are copied between the parts' replays (see ``session.slot_runner``). A plan on one
provider is one segment, part 0.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from onnx_genrt.core.provider import ExecutionProvider


@dataclass(frozen=True)
class Segment:
    """Steps ``start`` to ``stop - 1``, all on ``provider``; its ``part`` number counts the
    provider's earlier segments. ``reads`` are the values it takes from outside itself
    (graph inputs and other segments' results), which may need a transfer."""

    index: int
    provider: ExecutionProvider
    start: int
    stop: int
    part: int
    reads: tuple[str, ...]


def split_segments(steps: Sequence[Any], constants: Mapping[str, Any]) -> list[Segment]:
    """The segments of ``steps`` (each with ``provider``, ``inputs``, ``outputs``)."""
    bounds: list[tuple[int, int]] = []
    for i, step in enumerate(steps):
        if bounds and steps[bounds[-1][0]].provider is step.provider:
            bounds[-1] = (bounds[-1][0], i + 1)
        else:
            bounds.append((i, i + 1))
    parts: dict[int, int] = {}
    segments = []
    for index, (start, stop) in enumerate(bounds):
        provider = steps[start].provider
        made: set[str] = set()
        reads: dict[str, None] = {}
        for step in steps[start:stop]:
            for name in step.inputs:
                if name and name not in constants and name not in made:
                    reads[name] = None
            made.update(n for n in step.outputs if n)
        part = parts.get(id(provider), 0)
        parts[id(provider)] = part + 1
        segments.append(Segment(index, provider, start, stop, part, tuple(reads)))
    return segments
