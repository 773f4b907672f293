"""Fixtures of the GPU tests (marked ``gpu``: skipped without a usable GPU by the root
conftest, failed instead when ONNX_GENRT_REQUIRE_GPU=1)."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from onnx_genrt.core.graph_slots import DeviceGraphSlot


@pytest.fixture(scope="module")
def cp():
    """CuPy, once a GPU is known to be usable; fails the test otherwise."""
    from onnx_genrt.providers.cuda.plugin import cuda_unavailable_reason

    reason = cuda_unavailable_reason()
    if reason is not None:  # only reached with ONNX_GENRT_REQUIRE_GPU=1 (else skipped)
        pytest.fail(f"ONNX_GENRT_REQUIRE_GPU=1 but no GPU is usable: {reason}")
    import cupy

    return cupy


@pytest.fixture(scope="module")
def prov(cp):
    """One provider shared by a module's kernel tests (they never capture)."""
    from onnx_genrt.providers.cuda.provider import CUDAProvider

    return CUDAProvider()


@pytest.fixture
def fresh(cp):
    """A provider of its own, for tests that capture or latch slots."""
    from onnx_genrt.providers.cuda.provider import CUDAProvider

    p = CUDAProvider()
    yield p
    for slot in DeviceGraphSlot:
        p.reset_graph(slot)


@pytest.fixture
def rng(request) -> np.random.Generator:
    """Fresh random inputs per test, reproducible from the test's name."""
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))
