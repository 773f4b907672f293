"""Memory planning by liveness: intermediates share one arena when their lifetimes do not overlap."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

ALIGNMENT = 64


@dataclass(frozen=True)
class Lifetime:
    """A value needs ``nbytes`` from step ``first`` (its producer) to ``last`` (its last reader)."""

    name: str
    nbytes: int
    first: int
    last: int


@dataclass(frozen=True)
class MemoryPlan:
    """Byte offsets of each planned value inside one arena."""

    offsets: Mapping[str, int]
    arena_bytes: int
    naive_bytes: int

    @property
    def saved_fraction(self) -> float:
        return 1.0 - self.arena_bytes / self.naive_bytes if self.naive_bytes else 0.0


def _align(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def plan_memory(lifetimes: Sequence[Lifetime]) -> MemoryPlan:
    """Greedy by size: place the largest values first at the lowest offset that fits.

    Two values may share bytes only when their step intervals (inclusive) are disjoint.
    """
    placed: list[tuple[int, int, Lifetime]] = []  # (offset, size, lifetime)
    offsets: dict[str, int] = {}
    arena = 0
    for lt in sorted(lifetimes, key=lambda x: (-x.nbytes, x.first, x.name)):
        size = _align(max(lt.nbytes, 1))
        busy = sorted(
            (off, off + sz)
            for off, sz, other in placed
            if not (other.last < lt.first or lt.last < other.first)
        )
        offset = 0
        for start, end in busy:
            if offset + size <= start:
                break
            offset = max(offset, end)
        placed.append((offset, size, lt))
        offsets[lt.name] = offset
        arena = max(arena, offset + size)
    naive = sum(_align(max(lt.nbytes, 1)) for lt in lifetimes)
    return MemoryPlan(offsets, arena, naive)
