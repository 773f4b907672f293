"""Garbage collected inside a CUDA graph capture (marked ``gpu``).

A finalizer that calls the device API while a stream captures can invalidate the capture
(``STREAM_CAPTURE_INVALIDATED`` at the next launch). The cyclic collector runs finalizers at
any allocation, so the core holds it off while a capture runs (``core.collector_pause``).
First the hazard itself, on CuPy's stream alone; then the provider's capture with the same
garbage and the collector set to run at every allocation: it captures, replays the right
values, and the garbage is collected once the capture ends.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest

from onnx_genrt.core.graph_slots import DeviceGraphSlot

from .test_cuda_llm_kernels import launch, node

pytestmark = pytest.mark.gpu

PRIMARY = DeviceGraphSlot.PRIMARY


class _Syncing:
    """Cyclic garbage whose finalizer synchronizes the device, as a freed stream or module
    can; notes whether it ran and what the call raised."""

    def __init__(self, cp, notes: list[str]) -> None:
        self.me, self.cp, self.notes = self, cp, notes

    def __del__(self) -> None:
        try:
            self.cp.cuda.runtime.deviceSynchronize()
            self.notes.append("ok")
        except Exception as exc:  # the capture conflict: noted, never raised from __del__
            self.notes.append(type(exc).__name__)


def _add(prov, x, y, out):
    """Add on the provider into the planned ``out``."""
    (got,) = launch(prov, node("Add", [x, y], opset=14), [x, y], [out])
    assert got is out


def test_a_syncing_finalizer_inside_a_bare_capture_breaks_it(cp):
    """The hazard the pause removes, shown without the provider: CuPy's capture, garbage
    whose finalizer synchronizes the device collected inside it."""
    notes: list[str] = []
    stream = cp.cuda.Stream(non_blocking=True)
    failed = None
    with stream:
        x = cp.ones(1024, cp.float32)
        stream.synchronize()
        stream.begin_capture()
        try:
            _Syncing(cp, notes)
            gc.collect()
            y = x + 1  # noqa: F841 - the launch after it reports the invalidated capture
        except Exception as exc:  # CuPy's error type varies by version
            failed = exc
        finally:
            try:
                stream.end_capture()  # always ends it: a capturing stream blocks later syncs
            except Exception as exc:
                failed = failed or exc
    assert failed is not None and "CAPTURE_INVALIDATED" in str(failed), failed
    assert notes and notes[0] != "ok", notes


def test_the_provider_captures_while_syncing_garbage_waits(cp, fresh, eager_collector):
    prov = fresh
    notes: list[str] = []
    with prov.stream:
        x = cp.arange(4096, dtype=cp.float32)
        y = cp.full(4096, 2.0, cp.float32)
        out = cp.empty(4096, cp.float32)
    _add(prov, x, y, out)
    prov.stream.synchronize()
    prov.begin_capture(PRIMARY)
    for _ in range(20):  # garbage, and allocations that would run the collector
        _Syncing(cp, notes)
        [object() for _ in range(50)]
    _add(prov, x, y, out)
    assert notes == []
    prov.end_capture(PRIMARY)
    with prov.stream:
        x[:] = 5.0
    prov.replay(PRIMARY)
    np.testing.assert_array_equal(prov.to_numpy(out), np.full(4096, 7.0, np.float32))
    gc.collect()
    assert notes and set(notes) == {"ok"}, notes
