"""CPU kernels write into the output buffer the session planned (``KernelContext.out``), so a
bound run copies nothing after them: checked on MatMul against numpy float64."""

from __future__ import annotations

import numpy as np
from onnx import helper

from onnx_genrt.core.kernels import KernelContext, NodeInfo
from onnx_genrt.providers.cpu.kernels import REGISTRY


def test_matmul_writes_planned_buffer() -> None:
    rng = np.random.default_rng(1234)
    a = rng.standard_normal((2, 3, 8)).astype(np.float32)
    b = rng.standard_normal((8, 5)).astype(np.float32)
    planned = np.empty((2, 3, 5), np.float32)
    node = NodeInfo.from_proto(helper.make_node("MatMul", ["a", "b"], ["y"]), 13)
    kdef = REGISTRY.lookup("", "MatMul", 13)
    y = kdef.fn(KernelContext(node, planned=[planned]), a, b)
    assert y is planned
    np.testing.assert_allclose(y, a.astype(np.float64) @ b, rtol=1e-5, atol=1e-5)
