"""Host copies of small integer device arrays (shapes, axes, slice bounds), kept at upload so
kernels read them without a device sync (``KernelContext.host_value``)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np

#: Integer arrays up to this many elements keep a host copy when uploaded.
SHADOW_MAX_ELEMS = 64
#: Host copies kept at once (the least recently kept dropped first).
SHADOW_ENTRIES = 4096


def _key(array: Any) -> tuple:
    return (int(array.data.ptr), tuple(array.shape), array.dtype.str)


class HostShadow:
    """Device array (by address, shape and dtype) -> the host values it was uploaded with.

    An entry holds its device array, so the address cannot be reused while the entry lives.
    Writing into a shadowed array other than through ``forget`` first leaves a stale copy:
    the provider forgets an array before it uploads into it.
    """

    def __init__(self, max_elems: int = SHADOW_MAX_ELEMS, entries: int = SHADOW_ENTRIES) -> None:
        self.max_elems = max_elems
        self.entries = entries
        self._copies: OrderedDict[tuple, tuple[Any, np.ndarray]] = OrderedDict()

    def keep(self, device: Any, host: np.ndarray) -> None:
        """Remember ``host`` as the values of ``device`` when it is a small integer array."""
        if host.dtype.kind in "iu" and host.size <= self.max_elems:
            self._copies[_key(device)] = (device, np.array(host, copy=True))
            while len(self._copies) > self.entries:
                self._copies.popitem(last=False)

    def lookup(self, device: Any) -> np.ndarray | None:
        """The kept host values of ``device`` (None when none are kept)."""
        hit = self._copies.get(_key(device))
        return None if hit is None else hit[1]

    def forget(self, device: Any) -> None:
        """Drop the copy of ``device`` (it is about to be overwritten)."""
        self._copies.pop(_key(device), None)

    def __len__(self) -> int:
        return len(self._copies)
