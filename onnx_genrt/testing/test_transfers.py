"""Memory and transfer: allocation, host<->device round trips over the element types the
provider's kernels take, device copies, in-place writes, batched and deferred reads,
and ``holds``."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from onnx_genrt.core.dtypes import DType
from onnx_genrt.core.kernels import NodeInfo, TensorType

from .plugin import KitTarget, kit_target

SHAPE = (3, 5)


def kernel_dtypes(provider: Any) -> list[DType]:
    """Element types at least one of the provider's kernels accepts, asked through
    ``supports`` with a node whose inputs all have that type (4-bit types left out)."""
    found = []
    candidates = [d for d in DType if not d.is_packed]
    for domain, op in provider.kernels.ops():
        opset = provider.kernels.versions(domain, op)[-1]
        node = NodeInfo(op, f"probe_{op}", domain, opset, {}, ("a", "b"), ("y",))
        for dtype in candidates:
            if dtype in found:
                continue
            types = [TensorType(dtype.numpy, SHAPE)] * 2
            try:
                ok, _ = provider.supports(node, types)
            except Exception:  # a check that needs attributes the probe lacks
                ok = False
            if ok:
                found.append(dtype)
    return sorted(found, key=lambda d: d.name)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "dtype" in metafunc.fixturenames:
        target = kit_target(metafunc.config)
        dtypes = [] if target.unavailable_reason() else kernel_dtypes(target.create())
        metafunc.parametrize(
            "dtype",
            dtypes or [pytest.param(None, marks=pytest.mark.skip("no kernel takes any type"))],
            ids=[d.name.lower() for d in dtypes] or None,
        )


def sample(dtype: DType, seed: int = 0, shape: tuple[int, ...] = SHAPE) -> np.ndarray:
    """Distinct values of ``dtype`` (random, so a transfer that drops bytes shows)."""
    rng = np.random.default_rng(seed)
    if dtype is DType.BOOL:
        return rng.integers(0, 2, shape).astype(bool)
    info_kind = dtype.numpy.kind
    if info_kind in "iu":
        return rng.integers(0, 100, shape).astype(dtype.numpy)
    return (rng.standard_normal(shape) * 10).astype(dtype.numpy)


@pytest.fixture
def provider(genrt_target: KitTarget) -> Any:
    return genrt_target.create()


def host(provider: Any, array: Any) -> np.ndarray:
    return np.asarray(provider.to_numpy(array))


def test_allocate(provider, dtype: DType):
    t = provider.allocate(SHAPE, dtype)
    assert t.shape == SHAPE and t.dtype is dtype
    assert provider.holds(t.buffer), f"{provider.name!r} does not hold its own allocation"
    assert np.dtype(t.buffer.dtype) == dtype.numpy


def test_host_device_host_round_trip(provider, dtype: DType):
    values = sample(dtype)
    t = provider.copy_from_host(values)
    assert provider.holds(t.buffer) and t.dtype is dtype and t.shape == SHAPE
    back = provider.copy_to_host(t)
    assert isinstance(back, np.ndarray) and back.dtype == values.dtype
    np.testing.assert_array_equal(back, values)
    into = np.zeros_like(values)
    provider.copy_to_host(t, out=into)
    np.testing.assert_array_equal(into, values)
    dst = provider.allocate(SHAPE, dtype)
    provider.copy_from_host(sample(dtype, 1), out=dst)
    np.testing.assert_array_equal(provider.copy_to_host(dst), sample(dtype, 1))


def test_device_to_device_copy(provider, dtype: DType):
    src = provider.copy_from_host(sample(dtype, 2))
    dst = provider.allocate(SHAPE, dtype)
    provider.copy(src, dst)
    provider.synchronize()
    np.testing.assert_array_equal(host(provider, dst.buffer), sample(dtype, 2))
    other = provider.allocate(SHAPE, dtype)
    provider.copy_array(src.buffer, other.buffer)
    np.testing.assert_array_equal(host(provider, other.buffer), sample(dtype, 2))


def test_write_from_host_in_place(provider, dtype: DType):
    buffer = provider.allocate(SHAPE, dtype).buffer
    provider.write_from_host(buffer, sample(dtype, 3))
    np.testing.assert_array_equal(host(provider, buffer), sample(dtype, 3))
    provider.write_from_host(buffer, sample(dtype, 4))
    np.testing.assert_array_equal(host(provider, buffer), sample(dtype, 4))


def test_to_numpy_many_returns_independent_copies(provider, dtype: DType):
    arrays = [provider.as_array(sample(dtype, s)) for s in range(3)]
    got = provider.to_numpy_many(arrays)
    provider.write_from_host(arrays[0], sample(dtype, 9))  # later writes must not show
    assert len(got) == 3
    for s, g in enumerate(got):
        assert isinstance(g, np.ndarray)
        np.testing.assert_array_equal(g, sample(dtype, s))


def test_read_later_sees_the_values_queued_before_it(provider, dtype: DType):
    arrays = [provider.as_array(sample(dtype, s)) for s in range(2)]
    fetch = provider.read_later(arrays)
    provider.write_from_host(arrays[0], sample(dtype, 7))  # queued after the read
    got = fetch()
    for s, g in enumerate(got):
        np.testing.assert_array_equal(g, sample(dtype, s))
    np.testing.assert_array_equal(host(provider, arrays[0]), sample(dtype, 7))


def test_holds_only_its_own_arrays(provider):
    own = provider.allocate(SHAPE, DType.FLOAT32).buffer
    assert provider.holds(own) and provider.holds(provider.as_array(np.ones(3, np.float32)))
    for foreign in (object(), "text", 1.5, [1.0, 2.0], None):
        assert not provider.holds(foreign), f"{provider.name!r} claims to hold {foreign!r}"
    second = provider.allocate(SHAPE, DType.FLOAT32).buffer
    assert not provider.may_share_memory(own, second), "two allocations overlap"
