"""Initializers read from external-data files by mapping them, not copying them.

A tensor whose bytes lie in an external file in the layout numpy reads as they are (an
element type of fixed size, an offset that is a multiple of it, a little-endian host)
becomes a read-only view of one memory map of that file, shared by all its tensors: pages
come from the page cache when a kernel first touches them, so an embedding table costs
only the rows that prompts gather.

A constant that a kernel prepacked into its own layout is not read again; ``release_pages``
then drops its pages from this process (``madvise(MADV_DONTNEED)``), so the weight is
resident once, in the prepacked form. Dropped pages are read from the file again if
anything touches them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import sys
from pathlib import Path
from typing import Any

import numpy as np

#: The external-data location written into an initializer whose bytes a session dropped
#: once its plan held them as arrays (``session.loader.without_initializer_bytes``).
RELEASED_LOCATION = "onnx-genrt:released"

#: ONNX element types stored one element per fixed number of bytes, exactly as numpy holds
#: them (4-bit and string tensors are not: they are read and converted instead).
_MAPPABLE_KINDS = "biufc?V"


class MappedFiles:
    """Read-only memory maps of a model's external-data files, one per file."""

    def __init__(self) -> None:
        self._maps: dict[Path, mmap.mmap] = {}

    def view(
        self, path: Path, offset: int, length: int, dtype: np.dtype, shape: tuple[int, ...]
    ) -> np.ndarray | None:
        """``length`` bytes at ``offset`` of ``path`` as a read-only array, or None where
        the layout does not allow a view (then the caller reads a copy)."""
        count = int(np.prod(shape, dtype=np.int64))
        if not _mappable(dtype, offset) or count * dtype.itemsize != length or length == 0:
            return None
        data = self._map(path)
        array = np.frombuffer(data, dtype=dtype, count=count, offset=offset)
        return array.reshape(shape)

    def _map(self, path: Path) -> mmap.mmap:
        if path not in self._maps:
            with open(path, "rb") as f:
                self._maps[path] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return self._maps[path]


def _mappable(dtype: np.dtype, offset: int) -> bool:
    return (
        sys.byteorder == "little"
        and dtype.kind in _MAPPABLE_KINDS
        and dtype.itemsize > 0
        and offset % dtype.itemsize == 0
    )


def mapped_buffer(array: np.ndarray) -> mmap.mmap | None:
    """The memory map ``array`` views (through its chain of bases), or None."""
    base = array
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, memoryview):  # numpy's frombuffer keeps a view of the buffer
        base = base.obj
    return base if isinstance(base, mmap.mmap) else None


def release_pages(array: np.ndarray) -> int:
    """Drop the whole pages of a mapped ``array`` from this process's resident memory;
    returns the bytes released (0 for an array that maps no file, or where the platform
    has no ``madvise``). The array stays valid: a later read faults its pages in again."""
    data = mapped_buffer(array)
    if data is None or not hasattr(data, "madvise") or array.nbytes == 0:
        return 0
    start = array.__array_interface__["data"][0] - _address(data)
    page = mmap.PAGESIZE
    first = -(-start // page) * page  # pages wholly inside the array: a neighbour keeps its own
    last = (start + array.nbytes) // page * page
    if last <= first:
        return 0
    data.madvise(mmap.MADV_DONTNEED, first, last - first)
    return last - first


def trim_heap() -> None:
    """Hand the C heap's free memory back to the system (glibc's ``malloc_trim``; nothing
    elsewhere). Loading frees the proto's weight bytes and the prepacks' temporaries while
    the packed weights (in their own blocks) stay: glibc keeps such freed memory resident
    until something reuses it, about the weights' size again."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Any:
    """glibc's ``malloc_trim``, or None where the C library has none."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):
        return None


def _address(data: mmap.mmap) -> int:
    return np.frombuffer(data, np.uint8, count=1).__array_interface__["data"][0]
