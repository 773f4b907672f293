"""Host state of one graph slot: counters, the signature and warm-up that key its graph,
and the program a captured run replays (part replays with the edge copies between them)."""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from onnx_genrt.core.graph_slots import DeviceGraphSlot
from onnx_genrt.core.provider import ExecutionProvider

from .binding import Signature
from .layout import Layout
from .segments import Segment


@dataclass
class SlotStats:
    """Counters for one graph slot."""

    captures: int = 0
    replays: int = 0
    fallbacks: int = 0
    invalidations: int = 0
    #: Invalidations because another session on the same provider captured into the slot.
    displaced: int = 0
    eager_runs: int = 0
    fallback_reasons: Counter[str] = field(default_factory=Counter)
    #: Graph parts captured and replayed, per provider name (one part per segment).
    provider_captures: Counter[str] = field(default_factory=Counter)
    provider_replays: Counter[str] = field(default_factory=Counter)
    #: Values copied between providers' segments during replays.
    edge_copies: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "captures": self.captures,
            "replays": self.replays,
            "fallbacks": self.fallbacks,
            "invalidations": self.invalidations,
            "displaced": self.displaced,
            "eager_runs": self.eager_runs,
            "fallback_reasons": dict(self.fallback_reasons),
            "provider_captures": dict(self.provider_captures),
            "provider_replays": dict(self.provider_replays),
            "edge_copies": self.edge_copies,
        }


@dataclass
class SlotState:
    """Host capture state of one slot."""

    signature: Signature | None = None
    warmups: int = 0
    captured: bool = False
    layout: Layout | None = None
    stats: SlotStats = field(default_factory=SlotStats)
    #: What a replay runs: part replays and the edge copies between them, in order.
    program: list[Callable[[], None]] = field(default_factory=list)


class CaptureProgram:
    """One capture of a bound run: begins and ends each segment's part, replays a part
    right away where capturing only records (its results are needed next), and collects
    the replay program."""

    def __init__(
        self, slot: DeviceGraphSlot, owner: object, stats: SlotStats, first_part: int = 0
    ) -> None:
        self.slot, self.owner, self.stats = slot, owner, stats
        #: Segment ``n`` of a provider is captured as part ``first_part + n``.
        self.first_part = first_part
        self.program: list[Callable[[], None]] = []
        self._parts: dict[int, set[int]] = {}
        #: The provider whose part is being captured (the one to latch if it fails).
        self.provider: ExecutionProvider | None = None

    def begin(self, segment: Segment) -> None:
        self.provider = segment.provider
        part = self.first_part + segment.part
        self._parts.setdefault(id(segment.provider), set()).add(part)
        segment.provider.begin_capture(self.slot, owner=self.owner, part=part)

    def end(self, segment: Segment) -> None:
        provider = segment.provider
        provider.end_capture(self.slot)
        self.provider = None
        self.stats.provider_captures[provider.name] += 1
        replay = functools.partial(provider.replay, self.slot, self.first_part + segment.part)
        if not provider.CAPTURE_EXECUTES:
            replay()
        replays = self.stats.provider_replays

        def counted_replay(name: str = provider.name) -> None:
            replay()
            replays[name] += 1

        self.program.append(counted_replay)

    def parts(self, provider: ExecutionProvider) -> set[int]:
        """The parts this capture began on ``provider`` (to drop if it fails)."""
        return self._parts.get(id(provider), set())

    def counted(self, copy: Callable[[], None]) -> Callable[[], None]:
        stats = self.stats

        def counted_copy() -> None:
            copy()
            stats.edge_copies += 1

        return counted_copy
