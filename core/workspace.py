"""Kernel scratch memory that stays where captured graphs expect it.

Upstream's NaN: an eager step with a larger shape grew and moved the workspace, and a graph
captured earlier replayed against the freed address. Here the buffer grows only outside a
device capture, and a buffer replaced while graphs are pinned to it is retired, not freed:
the graphs captured on it keep writing into live memory until their slots are reset.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .errors import GraphCaptureError


class Workspace:
    """Scratch bytes for kernels, allocated through ``allocate(nbytes)`` (a 1-D uint8 array
    of the provider). One per provider; kernels reach it as ``KernelContext.scratch``."""

    def __init__(self, allocate: Callable[[int], Any]) -> None:
        self._allocate = allocate
        self._buffer: Any = None
        self._capacity = 0
        self._pins: set[object] = set()
        self._retired: list[Any] = []

    @property
    def capacity(self) -> int:
        """Bytes held now (0 before the first request)."""
        return self._capacity

    @property
    def pinned(self) -> bool:
        """Whether some slot's graph may read or write the buffer."""
        return bool(self._pins)

    @property
    def retired(self) -> int:
        """Replaced buffers kept alive for the graphs pinned to them."""
        return len(self._retired)

    def acquire(self, nbytes: int, frozen: bool = False) -> Any:
        """The first ``nbytes`` of the buffer, grown (at least doubled) when too small.

        ``frozen``: a device graph is recording, so the buffer may not move; a request that
        does not fit raises :class:`GraphCaptureError` (run the step eagerly first)."""
        nbytes = max(int(nbytes), 1)
        if nbytes > self._capacity:
            if frozen:
                raise GraphCaptureError(
                    f"scratch of {nbytes} bytes needed while capturing, {self._capacity} held; "
                    "run the step eagerly first"
                )
            if self._buffer is not None and self._pins:
                self._retired.append(self._buffer)  # graphs captured on it still use it
            self._capacity = max(nbytes, 2 * self._capacity)
            self._buffer = self._allocate(self._capacity)
        return self._buffer[:nbytes]

    def pin(self, owner: object) -> None:
        """A graph of ``owner`` (a slot) is being captured on the buffer: keep it alive."""
        self._pins.add(owner)

    def unpin(self, owner: object) -> None:
        """``owner``'s graphs are gone; with no pins left, retired buffers are freed."""
        self._pins.discard(owner)
        if not self._pins:
            self._retired.clear()
