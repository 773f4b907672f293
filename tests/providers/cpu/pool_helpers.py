"""Helpers for tests that run kernels on the CPU worker pool with real threads."""

from __future__ import annotations

import time
from collections.abc import Callable

from onnx_genrt.providers.cpu.kernels import _worker_pool as wp

#: Seconds a test keeps calling before it decides the worker never took a chunk.
HELP_TIMEOUT_S = 60.0


def worker_chunks(pool: wp.WorkerPool) -> int:
    """Chunks the pool's workers have computed so far."""
    return sum(pool.stats()["chunks"])


def worker_helps(pool: wp.WorkerPool, call: Callable[[], None], least: int = 3) -> int:
    """Repeat ``call`` (which checks its own result) until the pool's workers computed at
    least ``least`` chunks during the calls, so that the results checked include chunks of
    another thread copied from its scratch buffer. Returns the calls made."""
    start_chunks, start = worker_chunks(pool), time.monotonic()
    calls = 0
    while worker_chunks(pool) - start_chunks < least:
        assert time.monotonic() - start < HELP_TIMEOUT_S, "the worker thread took no chunks"
        call()
        calls += 1
    call()
    return calls + 1
