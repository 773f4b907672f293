"""Fixtures of the CPU provider's tests: the worker pool at two threads."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from onnx_genrt.providers.cpu.kernels import _worker_pool as wp


@pytest.fixture
def two_threads() -> Iterator[wp.WorkerPool]:
    """The process's worker pool at two threads (one worker); the thread count before is
    restored afterwards."""
    before = wp.pool_threads()
    wp.set_pool_threads(2)
    try:
        yield wp.worker_pool()
    finally:
        wp.set_pool_threads(before)
