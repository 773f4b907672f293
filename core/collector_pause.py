"""Python's cyclic garbage collector held off while any graph capture runs.

A finalizer of unrelated garbage (an old provider's stream, module or pinned buffer) may call
the device API; run by the collector inside a capture, such a call can invalidate the capture
(CUDA: ``STREAM_CAPTURE_INVALIDATED`` at the next launch), at a moment no test reproduces.
The collector is off from the first capture that begins until the last one ends, process-wide
and counted, and back to the state it had before. Garbage made meanwhile is collected after.
"""

from __future__ import annotations

import gc
import threading

_lock = threading.Lock()
_depth = 0
_was_enabled = False


def hold() -> None:
    """A capture begins: the collector is off until every ``hold`` has its ``release``."""
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1


def release() -> None:
    """A capture ended or was abandoned: the collector's state before the first ``hold`` comes
    back once none is held. A release without a hold does nothing."""
    global _depth
    with _lock:
        if _depth == 0:
            return
        _depth -= 1
        if _depth == 0 and _was_enabled:
            gc.enable()


def held() -> int:
    """How many captures hold the collector off now."""
    return _depth
