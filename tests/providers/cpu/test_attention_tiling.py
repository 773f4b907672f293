"""The CPU Attention kernel's query tiling (``providers/cpu/kernels/attention.py``): with a
score budget of a few rows per tile, every form of tests/ops/test_nn.py's Attention cases
still matches ONNX's reference evaluator."""

from __future__ import annotations

import numpy as np
import pytest

from onnx_genrt.core.kernels import KernelContext, NodeInfo
from onnx_genrt.providers.cpu.kernels import REGISTRY
from onnx_genrt.providers.cpu.kernels import attention as attention_mod

from ...ops.test_nn import _node, _onnx_reference, _tiling_cases


def _run_cpu(node, opset: int, arrays: list[np.ndarray | None]) -> np.ndarray:
    kdef = REGISTRY.lookup(node.domain, node.op_type, opset)
    args = list(arrays)
    while args and args[-1] is None:
        args.pop()
    return kdef.fn(KernelContext(NodeInfo.from_proto(node, opset)), *args)


@pytest.mark.parametrize(
    "name,opset,attrs,inputs,arrays", _tiling_cases(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_attention_tiled_matches_onnx_reference(
    monkeypatch, name, opset, attrs, inputs, arrays
) -> None:
    node = _node("Attention", inputs, ["y"], **attrs)
    (want,) = _onnx_reference(node, opset, arrays)
    monkeypatch.setattr(attention_mod, "_SCORE_BUDGET", 40)  # a few query rows per tile
    tiled = _run_cpu(node, opset, arrays)
    np.testing.assert_allclose(tiled, want, rtol=1e-5, atol=1e-6, err_msg=name)
