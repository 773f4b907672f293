"""Memory and transfer: each verb of the contract (``empty``, ``upload`` new and in place,
``read``, ``read_later``, ``copy``) over the element types the provider's kernels take,
``holds``, and the deprecated 1.0 names that alias the verbs."""

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
    return provider.read([array])[0]


# -- the five verbs: empty, upload, read, read_later, copy ----------------------------------


def test_empty(provider, dtype: DType):
    a = provider.empty(SHAPE, dtype.numpy)
    assert provider.holds(a), f"{provider.name!r} does not hold its own allocation"
    assert tuple(a.shape) == SHAPE and np.dtype(a.dtype) == dtype.numpy


def test_upload_new_and_in_place(provider, dtype: DType):
    values = sample(dtype)
    dev = provider.upload(values)
    assert provider.holds(dev) and tuple(dev.shape) == SHAPE and np.dtype(dev.dtype) == dtype.numpy
    np.testing.assert_array_equal(host(provider, dev), values)
    dst = provider.empty(SHAPE, dtype.numpy)
    assert provider.upload(sample(dtype, 1), out=dst) is dst
    np.testing.assert_array_equal(host(provider, dst), sample(dtype, 1))
    provider.upload(sample(dtype, 2), out=dst)  # again: the new values, not the old
    np.testing.assert_array_equal(host(provider, dst), sample(dtype, 2))
    assert provider.upload(dst) is dst  # its own array passes through


def test_upload_broadcasts_into_a_buffer(provider, dtype: DType):
    dst = provider.empty(SHAPE, dtype.numpy)
    row = sample(dtype, 5, (SHAPE[1],))
    provider.upload(row, out=dst)
    np.testing.assert_array_equal(host(provider, dst), np.broadcast_to(row, SHAPE))


def test_read_returns_independent_copies(provider, dtype: DType):
    arrays = [provider.upload(sample(dtype, s)) for s in range(3)]
    got = provider.read(arrays + [sample(dtype, 8)])  # a host array among them
    provider.upload(sample(dtype, 9), out=arrays[0])  # later writes must not show
    assert len(got) == 4
    for s, g in enumerate(got):
        assert type(g) is np.ndarray
        np.testing.assert_array_equal(g, sample(dtype, 8 if s == 3 else s))


def test_read_later_sees_the_values_queued_before_it(provider, dtype: DType):
    arrays = [provider.upload(sample(dtype, s)) for s in range(2)]
    fetch = provider.read_later(arrays)
    provider.upload(sample(dtype, 7), out=arrays[0])  # queued after the read
    got = fetch()
    for s, g in enumerate(got):
        np.testing.assert_array_equal(g, sample(dtype, s))
    np.testing.assert_array_equal(host(provider, arrays[0]), sample(dtype, 7))


def test_device_to_device_copy(provider, dtype: DType):
    src = provider.upload(sample(dtype, 2))
    dst = provider.empty(SHAPE, dtype.numpy)
    provider.copy(src, dst)
    provider.upload(sample(dtype, 3), out=src)  # the copy is done: src may change
    provider.synchronize()
    np.testing.assert_array_equal(host(provider, dst), sample(dtype, 2))
    view = provider.empty((SHAPE[0], 2 * SHAPE[1]), dtype.numpy)[:, ::2]  # strided target
    provider.copy(src, view)
    np.testing.assert_array_equal(host(provider, view), sample(dtype, 3))


def test_holds_only_its_own_arrays(provider):
    own = provider.empty(SHAPE, np.float32)
    assert provider.holds(own) and provider.holds(provider.upload(np.ones(3, np.float32)))
    for foreign in (object(), "text", 1.5, [1.0, 2.0], None):
        assert not provider.holds(foreign), f"{provider.name!r} claims to hold {foreign!r}"
    second = provider.empty(SHAPE, np.float32)
    assert not provider.may_share_memory(own, second), "two allocations overlap"


# -- the 1.0 names, kept as aliases of the verbs while callers move off them ---------------


def test_deprecated_aliases_still_move_data(provider, dtype: DType):
    t = provider.allocate(SHAPE, dtype)
    assert t.shape == SHAPE and t.dtype is dtype and provider.holds(t.buffer)
    u = provider.copy_from_host(sample(dtype))
    v = provider.copy_from_host(sample(dtype))
    assert not provider.may_share_memory(u.buffer, v.buffer)  # always a new array
    np.testing.assert_array_equal(provider.copy_to_host(u), sample(dtype))
    into = np.zeros_like(sample(dtype))
    provider.copy_to_host(u, out=into)
    np.testing.assert_array_equal(into, sample(dtype))
    provider.copy_from_host(sample(dtype, 1), out=t)
    provider.write_from_host(u.buffer, sample(dtype, 2))
    provider.copy_array(u.buffer, v.buffer)
    provider.copy(t, u)  # Tensors are unwrapped
    got = provider.to_numpy_many([u.buffer, v.buffer])
    np.testing.assert_array_equal(got[0], sample(dtype, 1))
    np.testing.assert_array_equal(got[1], sample(dtype, 2))
    np.testing.assert_array_equal(
        provider.to_numpy(provider.as_array(sample(dtype, 3))), sample(dtype, 3)
    )
