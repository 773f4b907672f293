"""Run a snippet against the CUDA provider's modules without a GPU: in a child process whose
``cupy`` is a stub (every attribute a callable stand-in), so the modules import and register
their kernels while nothing touches a device. The snippet prints one JSON line last."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

_PRELUDE = """
import sys
from unittest import mock
class Stub(mock.MagicMock):
    def _get_child_mock(self, **kw):
        child = Stub(**kw)
        child.__name__ = str(kw.get("name") or "stub")
        return child
sys.modules["cupy"] = Stub()
"""


def run_with_cupy_stub(snippet: str, *args: str) -> Any:
    """The JSON value ``snippet`` prints last, run with CuPy stubbed (``args`` as argv)."""
    done = subprocess.run(
        [sys.executable, "-c", _PRELUDE + snippet, *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
