"""Fixtures of the GPU tests (marked ``gpu``: skipped without a usable GPU by the root
conftest, failed instead when ONNX_GENRT_REQUIRE_GPU=1)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def cp():
    """CuPy, once a GPU is known to be usable; fails the test otherwise."""
    from onnx_genrt.providers.cuda.plugin import cuda_unavailable_reason

    reason = cuda_unavailable_reason()
    if reason is not None:  # only reached with ONNX_GENRT_REQUIRE_GPU=1 (else skipped)
        pytest.fail(f"ONNX_GENRT_REQUIRE_GPU=1 but no GPU is usable: {reason}")
    import cupy

    return cupy
