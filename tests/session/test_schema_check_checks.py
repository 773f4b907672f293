"""Attributes an ONNX op's schema does not define (``session.schema_check``; found by the
mutation run of core/op_rules.py: a Shape node at opset 14 with opset 15's ``start`` ran and
ignored it, where onnxruntime refuses the model). Refusals are compared with onnxruntime's,
values with ONNX's reference evaluator."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from onnx_genrt.core.errors import ModelLoadError
from onnx_genrt.session import InferenceSession

X = np.random.default_rng(13).standard_normal((2, 3, 4)).astype(np.float32)


def _model(node: onnx.NodeProto, opset: int, out_type: int = TensorProto.FLOAT, out_shape=None):
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4])],
        [helper.make_tensor_value_info("y", out_type, out_shape)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _onnxruntime_refuses(model: onnx.ModelProto) -> None:
    with pytest.raises(Exception, match="Unrecognized attribute"):  # onnxruntime's own type
        ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize(
    ("node", "opset", "message"),
    [
        (
            helper.make_node("Shape", ["x"], ["y"], start=1),
            14,
            r"\(Shape, opset 14\) has attributes \['start'\] that ONNX Shape-13 does not define",
        ),
        (
            helper.make_node("Relu", ["x"], ["y"], alpha=0.1),
            21,
            r"\(Relu, opset 21\) has attributes \['alpha'\] that ONNX Relu-14 does not define",
        ),
        (
            helper.make_node("Softmax", ["x"], ["y"], axis=-1, keepdims=1),
            21,
            r"has attributes \['keepdims'\] that ONNX Softmax-13 does not define \(it defines "
            r"\['axis'\]\)",
        ),
    ],
)
def test_an_attribute_the_ops_opset_does_not_define_is_refused(node, opset, message):
    out = TensorProto.INT64 if node.op_type == "Shape" else TensorProto.FLOAT
    model = _model(node, opset, out)
    with pytest.raises(ModelLoadError, match=message):
        InferenceSession(model)
    _onnxruntime_refuses(model)


def test_the_attribute_at_the_opset_that_defines_it_runs():
    model = _model(helper.make_node("Shape", ["x"], ["y"], start=1), 15, TensorProto.INT64)
    (y,) = InferenceSession(model).run(None, {"x": X})
    np.testing.assert_array_equal(y, ReferenceEvaluator(model).run(None, {"x": X})[0])
    np.testing.assert_array_equal(y, [3, 4])


def test_layer_normalization_takes_attributes_it_does_not_list_as_onnx_does():
    """LayerNormalization's ONNX schema allows unlisted attributes (onnx's checker and
    onnxruntime accept them; the reference evaluator does not): values against numpy
    float64 and onnxruntime."""
    scale = helper.make_tensor("scale", TensorProto.FLOAT, [4], [1.0, 0.5, 2.0, -1.0])
    node = helper.make_node("LayerNormalization", ["x", "scale"], ["y"], axis=-1, legacy=1)
    model = _model(node, 17, out_shape=[2, 3, 4])
    model.graph.initializer.append(scale)
    onnx.checker.check_model(model)
    (y,) = InferenceSession(model).run(None, {"x": X})
    x64 = X.astype(np.float64)
    mean, var = x64.mean(-1, keepdims=True), x64.var(-1, keepdims=True)
    want = (x64 - mean) / np.sqrt(var + 1e-5) * np.array([1.0, 0.5, 2.0, -1.0])
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(y, session.run(None, {"x": X})[0], rtol=1e-5, atol=1e-5)


def _typed_model(node: onnx.NodeProto, inputs: dict[str, int], out: int) -> onnx.ModelProto:
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info(n, t, [2]) for n, t in inputs.items()],
        [helper.make_tensor_value_info("y", out, None)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize(
    ("node", "inputs", "message"),
    [
        (  # float indices were truncated: Gather gave x[1] for 1.7
            helper.make_node("Gather", ["x", "i"], ["y"], name="g"),
            {"x": TensorProto.FLOAT, "i": TensorProto.FLOAT},
            r"node 'g' \(Gather, opset 17\): input 1 \('i', indices\) is tensor\(float\); ONNX "
            r"Gather-13 takes tensor\(int32\) or tensor\(int64\)",
        ),
        (
            helper.make_node("Gather", ["x", "i"], ["y"], name="g"),
            {"x": TensorProto.FLOAT, "i": TensorProto.COMPLEX64},
            r"input 1 \('i', indices\) is tensor\(complex64\)",
        ),
        (  # one type parameter, two types
            helper.make_node("Add", ["x", "z"], ["y"], name="a"),
            {"x": TensorProto.FLOAT, "z": TensorProto.DOUBLE},
            r"node 'a' \(Add, opset 17\): input 1 \('z'\) is tensor\(double\) but 'x' is "
            r"tensor\(float\); both are T of ONNX Add-14, one type",
        ),
        (  # a fixed type: Reshape's shape is int64
            helper.make_node("Reshape", ["x", "s"], ["y"], name="r"),
            {"x": TensorProto.FLOAT, "s": TensorProto.INT32},
            r"input 1 \('s', shape\) is tensor\(int32\); ONNX Reshape-14 takes tensor\(int64\)",
        ),
    ],
)
def test_an_input_type_the_schema_does_not_allow_is_refused(node, inputs, message):
    """Input element types against the op's type constraints, as onnxruntime checks them
    (it refuses these models too); the node, input and allowed types are named."""
    model = _typed_model(node, inputs, TensorProto.FLOAT)
    with pytest.raises(ModelLoadError, match=message):
        InferenceSession(model.SerializeToString())
    with pytest.raises(Exception, match="(?i)type"):
        ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def test_inputs_of_allowed_types_run() -> None:
    node = helper.make_node("Gather", ["x", "i"], ["y"])
    for index_type in (TensorProto.INT32, TensorProto.INT64):
        model = _typed_model(node, {"x": TensorProto.FLOAT, "i": index_type}, TensorProto.FLOAT)
        x = np.array([3.0, 4.0], np.float32)
        i = np.array([1, 0], helper.tensor_dtype_to_np_dtype(index_type))
        (y,) = InferenceSession(model.SerializeToString()).run(None, {"x": x, "i": i})
        np.testing.assert_array_equal(y, ReferenceEvaluator(model).run(None, {"x": x, "i": i})[0])
