"""Prompt-sized numpy work split over the CPU provider's threads.

A prompt's matmuls (MatMul and Gemm past the skinny kernel's rows, MatMulNBits where it
dequantizes) and its attention run through numpy and BLAS. BLAS keeps one thread
(``blas_threads``): OpenBLAS's threads spin after each call and its caller waits for every
one of them, so they would take cores from the worker pool's decode kernels
(docs/performance.md). Here such work is cut into independent parts (runs of rows) and the
parts run at once, the calling thread taking its share and plain Python threads the rest,
each part on single-threaded BLAS (numpy releases the GIL; the Numba loops called from a
part are ``nogil``). The threads sleep between prompts. Splitting by rows does not change a
row's result: each row is the same dot products in the same order.

One executor per process, sized to ``pool_threads() - 1`` and made again when that changes,
forgotten in a forked child (its threads do not exist there).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from ._worker_pool import pool_threads

#: Multiply-adds from which a matmul is split over the threads (about 1 ms on one core).
SPLIT_MIN_WORK = 1 << 25
#: Elements from which a row-wise kernel (a norm, SiluMul) is split over the threads.
SPLIT_MIN_ELEMENTS = 1 << 21

_lock = threading.Lock()
_executor: ThreadPoolExecutor | None = None
_executor_threads = 0


def _pool(workers: int) -> ThreadPoolExecutor:
    global _executor, _executor_threads
    with _lock:
        if _executor is None or _executor_threads != workers:
            if _executor is not None:
                _executor.shutdown(wait=False)
            _executor = ThreadPoolExecutor(workers, thread_name_prefix="onnx-genrt-prompt")
            _executor_threads = workers
        return _executor


def run_parts(parts: Sequence[Callable[[], object]]) -> None:
    """Run every part, the first on the calling thread and the others on the executor's
    threads, and return when all have finished; the first error raised by a part is
    raised here (after the others finish, so no part still writes an output)."""
    if len(parts) <= 1 or pool_threads() < 2:
        for part in parts:
            part()
        return
    pool = _pool(pool_threads() - 1)
    futures: list[Future] = [pool.submit(part) for part in parts[1:]]
    error: BaseException | None = None
    try:
        parts[0]()
    except BaseException as exc:  # noqa: BLE001 - re-raised once the other parts are done
        error = exc
    for future in futures:
        exc = future.exception()
        if error is None and exc is not None:
            error = exc
    if error is not None:
        raise error


def row_bounds(m: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` runs of rows covering ``range(m)``, as even as whole rows allow."""
    edges = np.linspace(0, m, max(1, min(parts, m)) + 1).astype(int)
    return [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:], strict=True) if b > a]


def splits(m: int, k: int, n: int) -> bool:
    """Whether an (M, K) @ (K, N) product is worth splitting over the threads."""
    threads = pool_threads()
    return threads >= 2 and m >= 2 * threads and m * k * n >= SPLIT_MIN_WORK


def split_matmul(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``np.matmul(a, b, out=out)`` for 2-D ``a`` (M, K), ``b`` (K, N) and ``out`` (M, N),
    its rows split over the provider's threads when ``splits`` says so."""
    if not splits(*a.shape, b.shape[1]):
        return np.matmul(a, b, out=out)
    _over_rows(a.shape[0], lambda r0, r1: np.matmul(a[r0:r1], b, out=out[r0:r1]))
    return out


def row_parts(rows: int, elements: int, call: Callable[[int, int], object]) -> None:
    """``call(r0, r1)`` over runs of rows covering ``range(rows)``: split over the threads
    for a prompt of at least ``SPLIT_MIN_ELEMENTS`` elements (``call`` must release the GIL:
    a ``nogil`` Numba kernel), else one call for all the rows."""
    threads = pool_threads()
    if threads < 2 or rows < 2 * threads or elements < SPLIT_MIN_ELEMENTS:
        call(0, rows)
        return
    _over_rows(rows, call)


def _over_rows(rows: int, call: Callable[[int, int], object]) -> None:
    """``call(r0, r1)`` on one run of rows per thread, all at once (``run_parts``)."""
    run_parts([lambda r0=r0, r1=r1: call(r0, r1) for r0, r1 in row_bounds(rows, pool_threads())])


def _forget_in_child() -> None:
    global _executor, _executor_threads, _lock
    _executor, _executor_threads, _lock = None, 0, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
