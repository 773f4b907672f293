"""Small valid models the fuzzer mutates, and feeds that fit a model's declared inputs."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..models import chain, decomposed_head, mlp


def shape_ops(width: int = 4) -> onnx.ModelProto:
    """Reshape, Transpose, Gather, Concat, Slice, Cast, Softmax, ReduceSum, Where, Expand,
    Conv and a Constant: the shape-handling ops of exported graphs, on a [2, width] input."""
    rng = np.random.default_rng(0)

    def const(name: str, value: np.ndarray) -> onnx.TensorProto:
        return numpy_helper.from_array(value, name)

    inits = [
        const("shape", np.array([width, 2], np.int64)),
        const("idx", np.array([1, 0, 1], np.int64)),
        const("starts", np.array([0], np.int64)),
        const("ends", np.array([2], np.int64)),
        const("axes", np.array([1], np.int64)),
        const("kernel", rng.standard_normal((1, 2, 3)).astype(np.float32)),
        const("target", np.array([5, 3], np.int64)),
    ]
    nodes = [
        helper.make_node("Reshape", ["x", "shape"], ["r"], name="reshape"),
        helper.make_node("Transpose", ["r"], ["t"], perm=[1, 0], name="transpose"),
        helper.make_node("Gather", ["t", "idx"], ["g"], axis=0, name="gather"),
        helper.make_node("Concat", ["g", "t"], ["c"], axis=0, name="concat"),
        helper.make_node("Slice", ["c", "starts", "ends", "axes"], ["s"], name="slice"),
        helper.make_node("Softmax", ["s"], ["p"], axis=-1, name="softmax"),
        helper.make_node("ReduceSum", ["p", "axes"], ["rs"], keepdims=1, name="reduce"),
        helper.make_node("Cast", ["rs"], ["ri"], to=TensorProto.INT32, name="cast"),
        helper.make_node("Constant", [], ["zero"], value_float=0.0, name="constant"),
        helper.make_node("Greater", ["rs", "zero"], ["positive"], name="greater"),
        helper.make_node("Where", ["positive", "rs", "zero"], ["w"], name="where"),
        helper.make_node("Expand", ["w", "target"], ["e"], name="expand"),
        helper.make_node("Unsqueeze", ["x", "starts"], ["x3"], name="unsqueeze"),
        helper.make_node("Conv", ["x3", "kernel"], ["conv"], pads=[1, 1], name="conv"),
    ]
    graph = helper.make_graph(
        nodes,
        "shape_ops",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, width])],
        [
            helper.make_tensor_value_info("e", TensorProto.FLOAT, [5, 3]),
            helper.make_tensor_value_info("ri", TensorProto.INT32, None),
            helper.make_tensor_value_info("conv", TensorProto.FLOAT, [1, 1, width]),
        ],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def seed_models() -> list[onnx.ModelProto]:
    """Every seed is valid: it loads, plans and runs (checked by the fuzz test)."""
    return [mlp(hidden=4), chain(4, width=4), decomposed_head(hidden=8, vocab=16), shape_ops()]


NUMPY_OF = {
    TensorProto.FLOAT: np.float32,
    TensorProto.DOUBLE: np.float64,
    TensorProto.FLOAT16: np.float16,
    TensorProto.INT64: np.int64,
    TensorProto.INT32: np.int32,
    TensorProto.INT8: np.int8,
    TensorProto.UINT8: np.uint8,
    TensorProto.BOOL: np.bool_,
}


def feeds_for(model: onnx.ModelProto, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random feeds shaped as the graph inputs declare (symbolic or odd dims become 2;
    undeclared element types become float32): the feed a user reading the model would give."""
    initializers = {i.name for i in model.graph.initializer}
    feeds = {}
    for value in model.graph.input:
        if value.name in initializers:
            continue
        tensor = value.type.tensor_type
        dims = []
        if tensor.HasField("shape"):
            for d in tensor.shape.dim:
                dims.append(d.dim_value if d.HasField("dim_value") and 0 < d.dim_value < 9 else 2)
        dtype = NUMPY_OF.get(tensor.elem_type, np.float32)
        feeds[value.name] = (rng.standard_normal(dims) * 3).astype(dtype)
    return feeds
