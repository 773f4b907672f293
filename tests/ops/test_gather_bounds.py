"""Gather-like kernels on every provider: indices at both ends of the valid range match ONNX's reference
evaluator, and an index one past either end raises a KernelError naming the node and the
index. The ONNX spec calls such an index an error; onnxruntime refuses it too (ONNX's
reference evaluator returns some value for GatherElements, so it is no reference there)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from onnx_genrt.core.errors import KernelError

from .op_tester import OpTester

DATA = np.arange(24, dtype=np.float32).reshape(2, 3, 4)


def _model(op: str, inputs: dict[str, np.ndarray], opset: int, **attrs) -> onnx.ModelProto:
    def info(name: str, value: np.ndarray) -> onnx.ValueInfoProto:
        elem = helper.np_dtype_to_tensor_dtype(value.dtype)
        return helper.make_tensor_value_info(name, elem, value.shape)

    node = helper.make_node(op, list(inputs), ["y"], name=f"my_{op}", **attrs)
    graph = helper.make_graph(
        [node],
        "g",
        [info(n, v) for n, v in inputs.items()],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 7 if opset < 15 else 10  # what older onnxruntime builds read
    return model


def _case(op: str, index: int) -> tuple[dict[str, np.ndarray], int, dict]:
    """Inputs, opset and attributes of one ``op`` case addressing ``index`` on axis 1 (size
    3) of DATA (GatherND/ScatterND: the first index of a tuple, on axis 0 of size 2)."""
    if op == "Gather":
        return {"x": DATA, "i": np.array([[0, index]], np.int64)}, 13, {"axis": 1}
    if op == "GatherElements":
        idx = np.zeros((2, 2, 4), np.int64)
        idx[1, 1, 2] = index
        return {"x": DATA, "i": idx}, 13, {"axis": 1}
    if op == "GatherND":
        return {"x": DATA, "i": np.array([[index, 2], [0, 1]], np.int64)}, 13, {}
    if op == "ScatterND":
        updates = np.full((2, 4), -1.0, np.float32)
        return {"x": DATA, "i": np.array([[index, 2], [0, 1]], np.int64), "u": updates}, 16, {}
    if op in ("ScatterElements", "Scatter"):
        idx = np.zeros((2, 1, 4), np.int64)
        idx[0, 0, 3] = index
        updates = np.full((2, 1, 4), -1.0, np.float32)
        opset = 13 if op == "ScatterElements" else 10
        return {"x": DATA, "i": idx, "u": updates}, opset, {"axis": 1}
    raise AssertionError(op)


OPS = ["Gather", "GatherElements", "GatherND", "ScatterND", "ScatterElements", "Scatter"]


def _dim(op: str) -> int:
    return DATA.shape[0] if op in ("GatherND", "ScatterND") else DATA.shape[1]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("end", ["last", "first"])
def test_indices_at_the_ends_match_the_reference(op: str, end: str, tester: OpTester) -> None:
    dim = _dim(op)
    inputs, opset, attrs = _case(op, dim - 1 if end == "last" else -dim)
    model = _model(op, inputs, opset, **attrs)
    # onnx.reference has no Scatter (opset <= 10); ScatterElements is the same op renamed.
    ref_op, ref_opset = ("ScatterElements", 11) if op == "Scatter" else (op, opset)
    (want,) = ReferenceEvaluator(_model(ref_op, inputs, ref_opset, **attrs)).run(None, inputs)
    (got,) = tester.run_model(model, inputs)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("past", ["end", "start"])
def test_an_index_past_the_range_raises_naming_node_and_index(
    op: str, past: str, tester: OpTester
) -> None:
    dim = _dim(op)
    bad = dim if past == "end" else -dim - 1
    inputs, opset, attrs = _case(op, bad)
    model = _model(op, inputs, opset, **attrs)
    ort = onnxruntime.InferenceSession(
        model.SerializeToString(), providers=["CPUExecutionProvider"]
    )
    with pytest.raises(Exception, match="(?i)ind(ex|ices|ice)|range|bound"):  # noqa: B017
        ort.run(None, inputs)
    session = tester.session(model)
    with pytest.raises(KernelError) as info:
        session.run(None, inputs)
    message = str(info.value)
    assert f"my_{op}" in message
    assert f"index {bad} out of range for axis of size {dim}" in message
