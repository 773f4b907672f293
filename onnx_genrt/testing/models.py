"""The kit's small models, built in code, and their numpy float64 references."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

#: Ops of the kit model; a provider under test needs at least one of them.
KIT_OPS = ("MatMul", "Add", "Relu", "Sigmoid", "Mul", "Softmax")
#: The constant every node of ``elementwise_chain`` applies.
CHAIN_CONSTANT = 1.0001


def kit_model(hidden: int = 16, seed: int = 0) -> onnx.ModelProto:
    """y = softmax(sigmoid(relu(x @ w1 + b1) @ w2) * 0.5 + x), x of shape [rows, hidden]."""
    rng = np.random.default_rng(seed)
    w1 = rng.standard_normal((hidden, 2 * hidden)).astype(np.float32) * 0.2
    b1 = rng.standard_normal((2 * hidden,)).astype(np.float32) * 0.2
    w2 = rng.standard_normal((2 * hidden, hidden)).astype(np.float32) * 0.2
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h0"], name="mm1"),
        helper.make_node("Add", ["h0", "b1"], ["h1"], name="bias"),
        helper.make_node("Relu", ["h1"], ["h2"], name="relu"),
        helper.make_node("MatMul", ["h2", "w2"], ["h3"], name="mm2"),
        helper.make_node("Sigmoid", ["h3"], ["h4"], name="gate"),
        helper.make_node("Mul", ["h4", "half"], ["h5"], name="scale"),
        helper.make_node("Add", ["h5", "x"], ["h6"], name="residual"),
        helper.make_node("Softmax", ["h6"], ["y"], name="softmax", axis=-1),
    ]
    inits = [
        numpy_helper.from_array(w1, "w1"),
        numpy_helper.from_array(b1, "b1"),
        numpy_helper.from_array(w2, "w2"),
        numpy_helper.from_array(np.array(0.5, np.float32), "half"),
    ]
    graph = helper.make_graph(
        nodes,
        "kit",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", hidden])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["rows", hidden])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def elementwise_chain(nodes: int, width: int = 8) -> onnx.ModelProto:
    """``nodes`` tiny Add/Mul/Sub nodes in a row: a model whose cost is all dispatch."""
    graph_nodes = []
    prev = "x"
    for i in range(nodes):
        out = "y" if i == nodes - 1 else f"t{i}"
        graph_nodes.append(helper.make_node(("Add", "Mul", "Sub")[i % 3], [prev, "c"], [out]))
        prev = out
    graph = helper.make_graph(
        graph_nodes,
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, width])],
        [numpy_helper.from_array(np.full((1, width), CHAIN_CONSTANT, np.float32), "c")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def elementwise_chain_reference(nodes: int, x: np.ndarray) -> np.ndarray:
    """``elementwise_chain(nodes)`` in numpy float64."""
    y = x.astype(np.float64)
    for i in range(nodes):
        y = (y + CHAIN_CONSTANT, y * CHAIN_CONSTANT, y - CHAIN_CONSTANT)[i % 3]
    return y


def kit_reference(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    """The kit model in numpy float64, independent of onnx-genrt."""
    w = {i.name: numpy_helper.to_array(i).astype(np.float64) for i in model.graph.initializer}
    xd = x.astype(np.float64)
    h = np.maximum(xd @ w["w1"] + w["b1"], 0.0) @ w["w2"]
    z = 1.0 / (1.0 + np.exp(-h)) * w["half"] + xd
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)
