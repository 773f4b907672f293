"""Edges of the kernel scratch workspace (``core.workspace``; found by a mutation run: the
first request and a request of no bytes had no test)."""

from __future__ import annotations

import numpy as np

from onnx_genrt.core.workspace import Workspace


def _workspace() -> tuple[Workspace, list[int]]:
    sizes: list[int] = []

    def allocate(nbytes: int) -> np.ndarray:
        sizes.append(nbytes)
        return np.zeros(nbytes, np.uint8)

    return Workspace(allocate), sizes


def test_nothing_is_held_before_the_first_request():
    ws, sizes = _workspace()
    assert ws.capacity == 0 and sizes == [] and not ws.pinned and ws.retired == 0
    one = ws.acquire(1)
    assert one.size == 1 and ws.capacity == 1 and sizes == [1]


def test_a_request_of_no_bytes_gets_a_buffer_of_one():
    """A kernel that needs no scratch may still ask: it gets a valid (one-byte) view, and
    the first buffer is made then, not on a later capture."""
    ws, sizes = _workspace()
    empty = ws.acquire(0)
    assert isinstance(empty, np.ndarray) and empty.size == 1 and sizes == [1]
    assert ws.acquire(1, frozen=True).size == 1  # held: fits while capturing
    assert sizes == [1]
