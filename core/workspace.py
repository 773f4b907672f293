"""A step workspace whose buffer can be pinned while a captured graph reads it.

Upstream's NaN: an eager step with a larger shape grew and moved the workspace, and a
graph captured earlier replayed against the freed address. Here a pinned buffer is never
released or moved; a larger request while pinned gets a separate buffer instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class StepWorkspace:
    """Scratch memory for one step, allocated through ``allocate(nbytes)``."""

    def __init__(self, allocate: Callable[[int], Any]) -> None:
        self._allocate = allocate
        self._buffer: Any = None
        self._capacity = 0
        self._pins: set[object] = set()
        self._overflow: Any = None

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def pinned(self) -> bool:
        return bool(self._pins)

    def acquire(self, nbytes: int) -> Any:
        """A buffer of at least ``nbytes``. Never moves a pinned buffer."""
        if nbytes <= self._capacity:
            return self._buffer
        if self._pins:
            # The pinned buffer stays where a captured graph expects it.
            self._overflow = self._allocate(nbytes)
            return self._overflow
        self._buffer = self._allocate(nbytes)
        self._capacity = nbytes
        return self._buffer

    def release(self) -> None:
        """Free the buffer after a step, unless a captured graph pins it."""
        self._overflow = None
        if not self._pins:
            self._buffer = None
            self._capacity = 0

    def pin(self, owner: object) -> None:
        """Keep the current buffer at its address until ``owner`` unpins it."""
        self._pins.add(owner)

    def unpin(self, owner: object) -> None:
        self._pins.discard(owner)
