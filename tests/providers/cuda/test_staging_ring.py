"""The CUDA provider's pinned staging ring (``providers/cuda/staging.py``) on a simulated
stream: device arrays are host memory, and every async copy lands only when the stream (or
an event recorded on it) is waited for, as on a GPU. Runs without a GPU."""

from __future__ import annotations

import ctypes
import importlib
import sys
import types
from collections.abc import Callable

import numpy as np
import pytest


class _Stream:
    """Queued copies run in order, only when waited for."""

    def __init__(self) -> None:
        self.ptr = 7
        self.queue: list[Callable[[], None]] = []
        self.done = 0

    def run_to(self, upto: int) -> None:
        while self.done < upto:
            self.queue[self.done]()
            self.done += 1

    def synchronize(self) -> None:
        self.run_to(len(self.queue))


class _Event:
    def __init__(self, disable_timing: bool = True) -> None:
        self.stream: _Stream | None = None
        self.mark = 0

    def record(self, stream: _Stream) -> None:
        self.stream, self.mark = stream, len(stream.queue)

    def synchronize(self) -> None:
        assert self.stream is not None
        self.stream.run_to(self.mark)


class _DeviceArray:
    """A "device" array: host memory reached only through queued copies."""

    def __init__(self, values: np.ndarray) -> None:
        self._host = np.ascontiguousarray(values).copy()
        self.data = types.SimpleNamespace(ptr=self._host.ctypes.data)
        self.nbytes, self.dtype, self.shape = self._host.nbytes, self._host.dtype, self._host.shape
        self.size, self.flags = self._host.size, self._host.flags

    def set(self, host: np.ndarray, stream: _Stream) -> None:
        src = np.ascontiguousarray(host)
        stream.queue.append(lambda: ctypes.memmove(self.data.ptr, src.ctypes.data, src.nbytes))


def _fake_cupy() -> types.ModuleType:
    cupy = types.ModuleType("cupy")
    cupy.ndarray = _DeviceArray  # type: ignore[attr-defined]
    streams: dict[int, _Stream] = {}

    def memcpy_async(dst: int, src: int, nbytes: int, kind: int, stream_ptr: int) -> None:
        streams[stream_ptr].queue.append(lambda: ctypes.memmove(dst, src, nbytes))

    runtime = types.SimpleNamespace(memcpyAsync=memcpy_async)
    cupy.cuda = types.SimpleNamespace(  # type: ignore[attr-defined]
        runtime=runtime,
        Event=_Event,
        alloc_pinned_memory=lambda size: bytearray(size),
    )
    cupy._streams = streams  # type: ignore[attr-defined]
    return cupy


@pytest.fixture
def ring(monkeypatch: pytest.MonkeyPatch):
    cupy = _fake_cupy()
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.delitem(sys.modules, "onnx_genrt.providers.cuda.staging", raising=False)
    staging = importlib.import_module("onnx_genrt.providers.cuda.staging")
    stream = _Stream()
    cupy._streams[stream.ptr] = stream
    yield staging.StagingRing(stream), staging
    sys.modules.pop("onnx_genrt.providers.cuda.staging", None)


def test_reads_queued_together_survive_the_ring_starting_over(ring) -> None:
    """Two small reads sit at the ring's end when a large one in the same call does not
    fit: the ring starts over, and the large copy must not land on the small ones (a
    batched step's argmax came back as logits bytes this way)."""
    staging_ring, staging = ring
    rng = np.random.default_rng(0)
    # Fill the ring to its last two slots.
    first = _DeviceArray(rng.standard_normal(1000).astype(np.float32))
    staging_ring.read_later([first])()
    while staging_ring.size - staging_ring._used > 2 * staging.aligned_size(8 * 16):
        staging_ring.read_later([_DeviceArray(np.zeros(64, np.int64))])()
    probe = _DeviceArray(np.array([3.5], np.float32))
    ids = _DeviceArray(np.arange(16, dtype=np.int64)[:, None] * 7 + 1)
    # Less than the whole ring (so it does not grow) but reaching the small reads' bytes.
    assert staging_ring.size - staging_ring._used == 512
    logits = _DeviceArray(rng.standard_normal((16, 1, 32_760)).astype(np.float16))
    fetch = staging_ring.read_later([probe, ids, logits])
    values = fetch()
    np.testing.assert_array_equal(values[0], probe._host)
    np.testing.assert_array_equal(values[1], ids._host)
    np.testing.assert_array_equal(values[2], logits._host)


def test_a_pending_read_keeps_its_values_while_later_transfers_wrap_the_ring(ring) -> None:
    """A read not yet waited for, then uploads and reads that start the ring over many
    times: the pending read still gives the values its arrays had when it was queued."""
    staging_ring, _ = ring
    rng = np.random.default_rng(1)
    src = _DeviceArray(rng.integers(0, 1 << 40, (32, 1)).astype(np.int64))
    expected = src._host.copy()
    pending = staging_ring.read_later([src])
    for i in range(40):
        dst = _DeviceArray(np.zeros(40_000, np.int64))
        staging_ring.upload(np.full(40_000, i, np.int64), dst)
        got = staging_ring.read_later([dst])()[0]
        assert (got == i).all()
    np.testing.assert_array_equal(pending()[0], expected)
