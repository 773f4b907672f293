"""Moving values between the host and a session's device: the engine's one road to memory.

The engine never calls a provider: it asks its session's :class:`DeviceIO` to make device
arrays, write host values into them, copy between them and read them back (now, or later
in one transfer). Each call goes to the session's main provider, on its stream.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from onnx_genrt.core.provider import ExecutionProvider


class DeviceIO:
    """Host <-> device transfers of one session (its main provider)."""

    def __init__(self, provider: ExecutionProvider) -> None:
        self._provider = provider

    def upload(self, host: np.ndarray) -> Any:
        """A new device array holding a copy of ``host`` (never ``host`` itself, even on a
        provider whose arrays are host arrays)."""
        host = np.asarray(host)
        array = self._provider.empty(host.shape, host.dtype)
        self._provider.upload(host, out=array)
        return array

    def write(self, array: Any, host: np.ndarray) -> None:
        """Write ``host`` into the device array ``array`` (same shape), in place."""
        self._provider.upload(host, out=array)

    def copy(self, src: Any, dst: Any) -> None:
        """Copy device array ``src`` into ``dst`` on the device, queued after earlier work."""
        self._provider.copy(src, dst)

    def read(self, arrays: Sequence[Any]) -> list[np.ndarray]:
        """Host copies of ``arrays``, after the work queued before."""
        return self._provider.read(list(arrays))

    def read_later(self, arrays: Sequence[Any]) -> Callable[[], list[np.ndarray]]:
        """Queue the read-back of ``arrays`` now; the returned call waits for it."""
        return self._provider.read_later(list(arrays))

    def holds(self, value: Any) -> bool:
        """Whether ``value`` is an array in this device's memory (a device-to-device copy
        can take it)."""
        return self._provider.holds(value)

    @property
    def reads_async(self) -> bool:
        """Whether read-backs overlap with the device's work (a GPU): then queuing the next
        step before reading this one pays."""
        return bool(self._provider.ASYNC_READS)

    def auto(self, wanted: bool | None) -> bool:
        """A setting that is on where reads are asynchronous unless forced: ``wanted``
        when True or False, else (None) :attr:`reads_async`."""
        return bool(self.reads_async if wanted is None else wanted)

    def memory_limit(self) -> int | None:
        """Bytes of memory this device offers (None when it does not say)."""
        return self._provider.memory_limit()
