"""The thread contract's two tools: provider locks that serialize work, and a guard that
refuses an object used by two threads at once.

What may be shared (the README's "Threads" section says the same for users):

- a provider instance: yes. Every session run holds the locks of the providers it runs
  on (:func:`hold`), so the shared state a provider keeps (graph slots, staging buffers,
  a stream) sees one run at a time;
- an ``InferenceSession`` or a ``Model``: yes, runs and generation steps are serialized;
- a ``Generator`` (one sequence): no. A second thread that calls it while the first is
  inside gets :class:`~onnx_genrt.core.errors.ConcurrentUseError` at once.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any

from .errors import ConcurrentUseError

_creating = threading.Lock()


def lock_of(obj: Any) -> threading.RLock:
    """The re-entrant lock that serializes work on ``obj`` (made on first use, so a
    provider whose ``__init__`` does not call its base class still gets one)."""
    lock = obj.__dict__.get("_genrt_lock")
    if lock is None:
        with _creating:
            lock = obj.__dict__.setdefault("_genrt_lock", threading.RLock())
    return lock


def hold(objects: Iterable[Any]) -> AbstractContextManager[Any]:
    """Hold the locks of ``objects`` (each once, always in the same order, so two threads
    that hold overlapping sets cannot deadlock). Re-entrant within a thread."""
    unique = {id(o): o for o in objects}
    if len(unique) == 1:  # the common case, on a decode step's path: the lock itself
        return lock_of(next(iter(unique.values())))
    return _hold_all([lock_of(unique[key]) for key in sorted(unique)])


@contextmanager
def _hold_all(locks: list[threading.RLock]) -> Iterator[None]:
    with ExitStack() as stack:
        for lock in locks:
            stack.enter_context(lock)
        yield


class SingleUser:
    """A context manager that refuses a second thread while one is inside (re-entrant for
    the thread inside). ``what`` names the guarded object, for example ``"this Generator"``.
    """

    def __init__(self, what: str) -> None:
        self._what = what
        self._lock = threading.RLock()

    def __enter__(self) -> None:
        if not self._lock.acquire(blocking=False):
            raise ConcurrentUseError(
                f"{self._what} is being used by another thread; it holds one sequence and "
                "serves one thread at a time (create one per thread; the Model may be shared)"
            )

    def __exit__(self, *exc: object) -> None:
        self._lock.release()
