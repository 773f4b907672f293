"""Native replay: a recorded graph's kernel calls run from one compiled loop.

A decode step of a small model is a chain of short kernels (a few µs each on the embedded
model), and each replayed call pays a Python closure and Numba's dispatch (unboxing every
array argument): about 1 µs per call, 40-50 µs of a 250 µs step. A prebound replay call
may therefore offer a native form, a :class:`NativeCall`: a ``numba.cfunc``
``int64 run(words, 0, 0)`` that reads its operands from int64 words (addresses and sizes,
:func:`words`) and does exactly what the Python call does. The CPU provider's recorded
graph runs each run of consecutive native calls in one Numba call (:func:`run_calls`).

A native call returns 0 when it did all its work. Any other code hands control back to
Python, which calls the call's ``on_code(code)``, then goes on with the next call: the
Python form is run again (each native call must leave nothing that running its Python form
after it would get wrong: the kernels here write the same outputs from the same inputs),
or, for a pooled kernel whose late worker may still read its arrays, the pool keeps them
(:attr:`NativeCall.status_word` tells that hand-over apart: on a loaded machine, where a
worker is often descheduled mid-chunk, it is the common one).

Native forms read buffer addresses fixed when they are made, so the recorded graph makes
them again when the worker pool changes (:func:`~._worker_pool.pool_epoch`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numba
import numpy as np

from ._intrinsics import address_as_pointer, call_address
from ._worker_pool import chunk_runner

#: Bits of a :func:`run_calls` result that hold the call's code.
CODE_BITS = 8
#: ``run_calls``' result when every call returned 0.
ALL_DONE = -1


@dataclass(eq=False)
class NativeCall:
    """One replayed kernel call in native form."""

    #: Address of the ``numba.cfunc`` ``int64 run(words, 0, 0)`` (:func:`native_runner`).
    address: int
    #: The runner's int64 argument words; it may write results back into them.
    words: np.ndarray
    #: What Python does when the runner returns ``code`` != 0 (rerun the Python form,
    #: settle a pooled job, raise the kernel's own error).
    on_code: Callable[[int], None]
    #: Arrays the words point to, kept alive with the call.
    keep: tuple[Any, ...] = ()
    #: For a kernel split over the worker pool: the word its runner leaves ``run_job``'s
    #: status in when it returns 1 (bits 0-1 nonzero: a worker was late, which a loaded
    #: machine makes common, or failed; ``on_code`` settles it); None for a call that
    #: never uses the pool.
    status_word: int | None = None


#: ``fn(words_address, a, b) -> int64`` compiled as a ``numba.cfunc`` on first use (cached
#: on disk); returns a function giving its address. The pool's chunk runners have the same
#: signature.
native_runner = chunk_runner


def rerun(run: Callable[[], None]) -> Callable[[int], None]:
    """An ``on_code`` that runs the Python form ``run`` (which raises the kernel's error)."""

    def on_code(_code: int) -> None:
        run()

    return on_code


def address_of(a: np.ndarray | None) -> int:
    """The data address of ``a`` (0 for None)."""
    return 0 if a is None else int(a.ctypes.data)


def words(*values: int) -> np.ndarray:
    """The int64 argument words of a native call."""
    return np.array([int(v) for v in values], np.int64)


@numba.njit(cache=True, nogil=True, inline="always")
def word_view(addr, count):
    """The ``count`` int64 words at ``addr`` (a runner's first argument) as an array."""
    return numba.carray(address_as_pointer(addr, np.int64), (count,))


@numba.njit(cache=True, nogil=True)
def run_calls(fns, args, start):
    """Call ``fns[i](args[i], 0, 0)`` for i from ``start`` in order; ``ALL_DONE`` when every
    call returned 0, else ``i << CODE_BITS | code`` of the first that did not."""
    for i in range(start, fns.shape[0]):
        code = call_address(fns[i], args[i], 0, 0)
        if code != 0:
            return (i << CODE_BITS) | (code & ((1 << CODE_BITS) - 1))
    return -1


class NativeRun:
    """Consecutive native calls of a recorded graph, run by :func:`run_calls`."""

    __slots__ = ("calls", "fns", "args")

    def __init__(self, calls: list[NativeCall]) -> None:
        self.calls = calls
        self.fns = np.array([c.address for c in calls], np.int64)
        self.args = np.array([c.words.ctypes.data for c in calls], np.int64)

    def __call__(self) -> None:
        start = 0
        while True:
            result = run_calls(self.fns, self.args, start)
            if result == ALL_DONE:
                return
            i, code = result >> CODE_BITS, result & ((1 << CODE_BITS) - 1)
            self.calls[i].on_code(code)
            start = i + 1
