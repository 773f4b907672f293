"""Host <-> device copies on one CUDA stream through a ring of pinned host memory.

Uploads copy the host values into the next free bytes of the ring and queue an async copy
from there, so the caller may reuse its array at once. Downloads queue async copies into the
ring; ``read_later`` returns before they land and waits on an event when asked. The ring
starts over only after the stream has been waited for (every queued copy done); reads still
pending then copy their values out first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import cupy
import numpy as np

#: Host copies up to this size go through the pinned ring (async on the stream).
STAGING_MAX = 64 << 20
#: cudaMemcpyKind values used with ``memcpyAsync``.
MEMCPY_DEVICE_TO_HOST = 2
MEMCPY_DEVICE_TO_DEVICE = 3


def aligned_size(nbytes: int) -> int:
    """Bytes a ring slot takes: 256-byte aligned, at least one alignment unit."""
    return max(256, -(-nbytes // 256) * 256)


class _PendingRead:
    """Host copies queued by ``read_later``: views into the ring until the event fires."""

    def __init__(self, views: list[np.ndarray], event: Any, registry: list, idle: list) -> None:
        self._views, self._event, self._registry, self._idle = views, event, registry, idle
        self._values: list[np.ndarray] | None = None

    def materialize(self) -> None:
        """Copy out of the ring (the caller has synchronized the stream, or the event)."""
        if self._values is None:
            self._values = [v.copy() for v in self._views]
            self._views = []
            self._idle.append(self._event)  # it has fired: free to record again
            self._event = None

    def result(self) -> list[np.ndarray]:
        """The values, waiting for their copies first."""
        if self._values is None:
            self._event.synchronize()
            self.materialize()
            if self in self._registry:
                self._registry.remove(self)
        return self._values


class StagingRing:
    """The pinned ring of one stream, and the transfers that go through it."""

    def __init__(self, stream: Any, scope: Any = None) -> None:
        self.stream = stream
        self._scope = stream if scope is None else scope  # makes the device and stream current
        self._ring: np.ndarray | None = None
        self._memory: Any = None
        self._used = 0
        self._pending: list[_PendingRead] = []  # reads whose views still sit in the ring
        self._events: list[Any] = []  # idle events for read_later, reused

    @property
    def size(self) -> int:
        """Bytes of pinned memory held (0 before the first transfer)."""
        return 0 if self._ring is None else int(self._ring.size)

    def _reserve(self, need: int) -> int:
        """The offset of ``need`` free bytes of the ring; waits for the stream and starts
        over when they do not fit (growing the ring when one transfer needs more)."""
        if self._ring is None or self._used + need > self._ring.size:
            self.stream.synchronize()  # every queued copy from the ring is done
            self.restart()
            if self._ring is None or self._ring.size < need:
                old = 0 if self._ring is None else 2 * self._ring.size
                size = min(max(need, 1 << 20, old), max(STAGING_MAX, need))
                self._memory = cupy.cuda.alloc_pinned_memory(size)
                self._ring = np.frombuffer(self._memory, np.uint8, size)
        start = self._used
        self._used += need
        return start

    def _slice(self, start: int, nbytes: int, dtype: np.dtype, shape: tuple[int, ...]):
        assert self._ring is not None
        return self._ring[start : start + nbytes].view(dtype).reshape(shape)

    def _view(self, nbytes: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        """The next free bytes of the ring as an array (see ``_reserve``)."""
        return self._slice(self._reserve(aligned_size(nbytes)), nbytes, dtype, shape)

    def restart(self) -> None:
        """After a full stream sync: pending reads keep copies, and the ring starts over."""
        for pending in self._pending:
            pending.materialize()
        self._pending.clear()
        self._used = 0

    def upload(self, host: np.ndarray, dst: Any) -> None:
        """Contiguous ``host`` into contiguous ``dst`` (same shape and dtype) on the stream."""
        nbytes = int(host.nbytes)
        if nbytes == 0:
            return
        if nbytes > STAGING_MAX:
            dst.set(host, stream=self.stream)  # pageable: returns once the source is consumed
            return
        view = self._view(nbytes, host.dtype, host.shape)
        np.copyto(view, host)
        dst.set(view, stream=self.stream)

    def download(self, src: Any) -> np.ndarray:
        """A device array's values on the host, now (a fresh array)."""
        if src.size == 0:
            return np.empty(src.shape, src.dtype)
        if not src.flags.c_contiguous:
            with self._scope:
                src = cupy.ascontiguousarray(src)
        nbytes = int(src.nbytes)
        if nbytes > STAGING_MAX:
            return src.get(stream=self.stream)
        view = self._view(nbytes, src.dtype, tuple(src.shape))
        src.get(stream=self.stream, out=view)  # blocking: waits for the stream
        self.restart()  # the stream is idle: every staged upload has been consumed
        return view.copy()

    def queue_downloads(self, arrays: Sequence[Any]) -> list[np.ndarray] | None:
        """Device arrays queued one after another into the ring, on the stream (host
        values copied as they are); None when they do not fit (too large, or not
        contiguous). The views are valid once the stream has got there."""
        srcs = [a for a in arrays if isinstance(a, cupy.ndarray)]
        total = sum(aligned_size(int(a.nbytes)) for a in srcs)
        if total > STAGING_MAX or any(not a.flags.c_contiguous for a in srcs):
            return None
        # One reservation for them all: a ring that started over between two of them
        # would hand later arrays the bytes of earlier ones, still waiting to be read.
        at = self._reserve(total) if total else 0
        views: list[np.ndarray] = []
        for a in arrays:
            if not isinstance(a, cupy.ndarray):
                views.append(np.array(a, copy=True))
                continue
            view = self._slice(at, int(a.nbytes), a.dtype, tuple(a.shape))
            at += aligned_size(int(a.nbytes))
            if a.nbytes:
                cupy.cuda.runtime.memcpyAsync(
                    view.ctypes.data, a.data.ptr, int(a.nbytes), MEMCPY_DEVICE_TO_HOST,
                    self.stream.ptr,
                )  # fmt: skip
            views.append(view)
        return views

    def read(self, arrays: Sequence[Any]) -> list[np.ndarray] | None:
        """Small arrays queued into the ring, then one wait; None when they do not fit."""
        views = self.queue_downloads(arrays)
        if views is None:
            return None
        self.stream.synchronize()
        values = [v.copy() for v in views]
        self.restart()
        return values

    def read_later(self, arrays: Sequence[Any]) -> Callable[[], list[np.ndarray]] | None:
        """Small arrays queued into the ring behind the stream's work, and an event; the
        returned call waits on that event only. None when they do not fit."""
        views = self.queue_downloads(arrays)
        if views is None:
            return None
        event = self._events.pop() if self._events else cupy.cuda.Event(disable_timing=True)
        event.record(self.stream)
        pending = _PendingRead(views, event, self._pending, self._events)
        self._pending.append(pending)
        return pending.result
