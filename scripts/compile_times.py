#!/usr/bin/env python3
"""First-run Numba compilation of a CLI command, kernel by kernel.

Runs ``onnx-genrt ARGS`` (default: the README's ``generate --prompt "    def __init__(self"
--spec mtp --stats``) in this process with an empty Numba cache (a temporary
``NUMBA_CACHE_DIR``) and prints the wall time and the seconds spent compiling each jitted
function and cfunc, most first. A callee's time counts in its caller's line too.

    python scripts/compile_times.py [--most N] [-- onnx-genrt arguments]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import time

README_ARGS = ["generate", "--prompt", "    def __init__(self", "--spec", "mtp", "--stats"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--most", type=int, default=25, help="lines to print (default 25)")
    parser.add_argument("command", nargs="*", help="onnx-genrt arguments (after --)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        os.environ["NUMBA_CACHE_DIR"] = cache  # before numba is imported
        from numba.core import ccallback, dispatcher

        times: collections.Counter[str] = collections.Counter()
        compile_fn, compile_cfunc = dispatcher.Dispatcher.compile, ccallback.CFunc.compile

        def timed(self, sig):
            start = time.perf_counter()
            try:
                return compile_fn(self, sig)
            finally:
                name = f"{self.py_func.__module__}.{self.py_func.__name__}"
                times[name] += time.perf_counter() - start

        def timed_cfunc(self):
            start = time.perf_counter()
            try:
                return compile_cfunc(self)
            finally:
                times[f"cfunc {self._pyfunc.__module__}.{self._pyfunc.__name__}"] += (
                    time.perf_counter() - start
                )

        dispatcher.Dispatcher.compile = timed
        ccallback.CFunc.compile = timed_cfunc
        from onnx_genrt.cli import main as cli

        start = time.perf_counter()
        try:
            code = cli(args.command or README_ARGS)
        except SystemExit as stop:
            code = stop.code
        wall = time.perf_counter() - start
    print(f"wall {wall:.1f} s (exit {code}); compiling, by function:", file=sys.stderr)
    for name, seconds in times.most_common(args.most):
        print(f"{seconds:7.2f} s  {name}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
