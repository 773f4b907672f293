"""The CUDA provider's host-shadow cache (providers/cuda/host_shadow.py) without a GPU: it
imports no CuPy, so it runs on stand-ins with a device address, shape and dtype."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from onnx_genrt.providers.cuda.host_shadow import HostShadow


def _device(ptr: int, host: np.ndarray) -> SimpleNamespace:
    return SimpleNamespace(data=SimpleNamespace(ptr=ptr), shape=host.shape, dtype=host.dtype)


def test_keeps_small_integer_arrays_only():
    shadow = HostShadow(max_elems=4)
    shape = np.array([2, -1], np.int64)
    dev = _device(0x1000, shape)
    shadow.keep(dev, shape)
    shape[0] = 9  # the caller's array may change: the copy does not
    np.testing.assert_array_equal(shadow.lookup(dev), [2, -1])
    for host in (np.zeros(3, np.float32), np.arange(5, dtype=np.int32)):
        other = _device(0x2000, host)
        shadow.keep(other, host)
        assert shadow.lookup(other) is None
    # the same address seen with another shape or dtype is another array
    assert shadow.lookup(_device(0x1000, np.zeros(2, np.int32))) is None


def test_forget_and_least_recent_eviction():
    shadow = HostShadow(entries=2)
    devs = [_device(0x100 * (i + 1), np.array([i])) for i in range(3)]
    for i, dev in enumerate(devs):
        shadow.keep(dev, np.array([i]))
    assert len(shadow) == 2 and shadow.lookup(devs[0]) is None
    assert shadow.lookup(devs[2]).tolist() == [2]
    shadow.forget(devs[2])
    assert shadow.lookup(devs[2]) is None and len(shadow) == 1
