"""Shared test configuration: the GPU marker.

Tests marked ``gpu`` are skipped when no GPU is usable, unless ``ONNX_GENRT_REQUIRE_GPU=1``:
then each of them fails at setup (before its fixtures or body could skip it), naming why no
GPU is usable.
"""

from __future__ import annotations

import gc
import os

import pytest

pytest_plugins = ["pytester"]  # tests/package/test_gpu_gate.py runs this file on generated tests

REQUIRE_GPU_VARIABLE = "ONNX_GENRT_REQUIRE_GPU"


def gpu_required() -> bool:
    """Whether the run demands a GPU (``ONNX_GENRT_REQUIRE_GPU=1``)."""
    return os.environ.get(REQUIRE_GPU_VARIABLE) == "1"


def _gpu_reason() -> str | None:
    from onnx_genrt.providers.cuda.plugin import cuda_unavailable_reason

    return cuda_unavailable_reason()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if gpu_required() or not any(i.get_closest_marker("gpu") for i in items):
        return
    reason = _gpu_reason()
    if reason is None:
        return
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(pytest.mark.skip(reason=f"no GPU: {reason}"))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if not gpu_required() or item.get_closest_marker("gpu") is None:
        return
    reason = _gpu_reason()
    if reason is not None:
        pytest.fail(f"{REQUIRE_GPU_VARIABLE}=1 but no GPU is usable: {reason}", pytrace=False)


@pytest.fixture
def eager_collector():
    """Python's cyclic collector on and running at every allocation (settings restored
    after): garbage with finalizers is collected wherever the collector may run."""
    was, thresholds = gc.isenabled(), gc.get_threshold()
    gc.enable()
    gc.collect()
    gc.set_threshold(1)
    yield
    gc.set_threshold(*thresholds)
    (gc.enable if was else gc.disable)()
