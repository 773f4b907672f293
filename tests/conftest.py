"""Shared test configuration: the GPU marker and small model builders."""

from __future__ import annotations

import os

import pytest


def _gpu_reason() -> str | None:
    from onnx_genrt.providers.cuda.plugin import cuda_unavailable_reason

    return cuda_unavailable_reason()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [i for i in items if i.get_closest_marker("gpu")]
    if not gpu_items:
        return
    reason = _gpu_reason()
    if reason is None:
        return
    required = os.environ.get("ONNX_GENRT_REQUIRE_GPU") == "1"
    for item in gpu_items:
        if required:
            item.add_marker(pytest.mark.usefixtures("_gpu_required_but_missing"))
        else:
            item.add_marker(pytest.mark.skip(reason=f"no GPU: {reason}"))


@pytest.fixture
def _gpu_required_but_missing() -> None:
    pytest.fail(f"ONNX_GENRT_REQUIRE_GPU=1 but no GPU is usable: {_gpu_reason()}")
