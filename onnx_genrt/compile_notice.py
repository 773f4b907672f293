"""One line on stderr when Numba compiles a kernel: a first run of the CPU provider spends
seconds compiling (cached on disk for later runs), and a command should not sit silent."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO


class CompileNotice:
    """A Numba event listener that prints one notice, at the first compilation it sees."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream
        self._told = threading.Event()

    @property
    def told(self) -> bool:
        return self._told.is_set()

    def on_start(self, event: object) -> None:
        if self._told.is_set():
            return
        self._told.set()
        stream = self._stream or sys.stderr
        print(
            "onnx-genrt: compiling CPU kernels with Numba (a first run only: they are cached "
            "on disk for later runs) ...",
            file=stream,
            flush=True,
        )

    def on_end(self, event: object) -> None:
        pass


@contextmanager
def install(stream: TextIO | None = None) -> Iterator[CompileNotice]:
    """While inside, print the notice at the first Numba compilation (then no more)."""
    from numba.core import event

    notice = CompileNotice(stream)

    class _Listener(event.Listener):
        def on_start(self, ev: event.Event) -> None:
            notice.on_start(ev)

        def on_end(self, ev: event.Event) -> None:
            notice.on_end(ev)

    listener = _Listener()
    event.register("numba:compile", listener)
    try:
        yield notice
    finally:
        event.unregister("numba:compile", listener)
