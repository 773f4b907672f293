"""What the model fuzzer found, one case each: every one was a raw Python exception (from a
fusion pass, the planner or protobuf) before it became a ModelLoadError naming the culprit."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import AttributeProto, TensorProto, helper, numpy_helper

from onnx_genrt.core.errors import ModelLoadError, OnnxGenrtError, UnsupportedOpError
from onnx_genrt.session import InferenceSession

from ..models import decomposed_head, mlp
from .seeds import shape_ops


def _node(model: onnx.ModelProto, name: str) -> onnx.NodeProto:
    return next(n for n in model.graph.node if n.name == name or n.op_type == name)


def _set_attribute(node: onnx.NodeProto, attr: AttributeProto) -> None:
    kept = [a for a in node.attribute if a.name != attr.name]
    del node.attribute[:]
    node.attribute.extend([*kept, attr])


@pytest.mark.parametrize(
    "op,attr",
    [
        ("ArgMax", helper.make_attribute("keepdims", "no")),  # was ValueError in a fusion
        ("ReduceMax", helper.make_attribute("keepdims", [0, 1])),  # was TypeError
        ("Softmax", helper.make_attribute("axis", 1.5)),
    ],
    ids=["keepdims-string", "keepdims-ints", "axis-float"],
)
def test_attribute_of_the_wrong_type_names_node_attribute_and_schema(op, attr):
    model = decomposed_head(hidden=8, vocab=16)
    _set_attribute(_node(model, op), attr)
    with pytest.raises(ModelLoadError, match=rf"\({op}, opset 18\): attribute '{attr.name}' is"):
        InferenceSession(model)


def test_missing_required_attribute_is_refused():
    model = shape_ops()
    cast = _node(model, "cast")
    del cast.attribute[:]
    with pytest.raises(ModelLoadError, match="'cast' .*lacks the attribute 'to'"):
        InferenceSession(model)


def test_wrong_input_count_is_refused_before_fusion():
    """A Mul with one input inside an RMS-norm pattern was an IndexError in the fusion."""
    model = decomposed_head(hidden=8, vocab=16)
    muls = [n for n in model.graph.node if n.op_type == "Mul"]
    del muls[0].input[1]
    with pytest.raises(ModelLoadError, match=r"has 1 inputs; ONNX Mul-14 takes 2 to 2"):
        InferenceSession(model)


def test_unknown_element_type_is_refused_naming_the_value():
    model = mlp(hidden=4)
    model.graph.output[0].type.tensor_type.elem_type = 99  # was KeyError in the planner
    with pytest.raises(ModelLoadError, match="value 'y' declares element type 99"):
        InferenceSession(model)


def test_invalid_utf8_op_type_is_refused():
    data = mlp(hidden=4).SerializeToString().replace(b"Relu", b"R\x80lu")
    with pytest.raises(ModelLoadError, match=r"node 2 op type b'R\\x80lu' is not valid UTF-8"):
        InferenceSession(data)


def test_tensor_attribute_with_bytes_that_do_not_fit_is_refused():
    model = shape_ops()
    bad = TensorProto(name="v", data_type=TensorProto.FLOAT, raw_data=b"\0" * 3)
    _set_attribute(_node(model, "constant"), helper.make_attribute("value", bad))
    for attr in list(_node(model, "constant").attribute):
        if attr.name == "value_float":
            _node(model, "constant").attribute.remove(attr)
    with pytest.raises(ModelLoadError, match="'constant' .*unreadable attribute"):
        InferenceSession(model)


def test_float_reduction_axes_are_not_fused_and_refused_by_the_kernel():
    """Axes of ReduceMean turned into a float NaN tensor: a ValueError in the RMS-norm
    fusion before; now the pattern is left unfused and the kernel names the input."""
    model = decomposed_head(hidden=8, vocab=16)
    last = next(i for i in model.graph.initializer if i.name == "last")
    last.CopyFrom(numpy_helper.from_array(np.array([np.nan]), "last"))
    feeds = {n: np.ones((1, 2, 8), np.float32) for n in "ab"}
    with pytest.raises(OnnxGenrtError):
        InferenceSession(model).run(None, feeds)


def test_wrong_output_count_is_refused():
    model = mlp(hidden=4)
    _node(model, "relu").output.append("extra")
    with pytest.raises(ModelLoadError, match=r"'relu' \(Relu, opset 21\) has 2 outputs; ONNX Relu"):
        InferenceSession(model)


def test_ops_onnx_does_not_define_are_left_to_the_providers():
    model = mlp(hidden=4)
    _node(model, "relu").op_type = "NoSuchOp"
    with pytest.raises(UnsupportedOpError, match="no kernel for ai.onnx::NoSuchOp"):
        InferenceSession(model)
