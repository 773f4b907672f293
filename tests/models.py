"""Small ONNX models built in code for tests."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnx_genrt.dispatch_bench import elementwise_chain


def mlp(hidden: int = 16, seed: int = 0, batch: int | str = "batch") -> onnx.ModelProto:
    """y = relu(x @ w1 + b1) @ w2 * 0.5 + x, with a few shape ops on the way."""
    rng = np.random.default_rng(seed)
    w1 = rng.standard_normal((hidden, 2 * hidden)).astype(np.float32) * 0.1
    b1 = rng.standard_normal((2 * hidden,)).astype(np.float32) * 0.1
    w2 = rng.standard_normal((2 * hidden, hidden)).astype(np.float32) * 0.1
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h0"], name="mm1"),
        helper.make_node("Add", ["h0", "b1"], ["h1"], name="bias"),
        helper.make_node("Relu", ["h1"], ["h2"], name="relu"),
        helper.make_node("MatMul", ["h2", "w2"], ["h3"], name="mm2"),
        helper.make_node("Mul", ["h3", "half"], ["h4"], name="scale"),
        helper.make_node("Add", ["h4", "x"], ["y"], name="residual"),
    ]
    inits = [
        numpy_helper.from_array(w1, "w1"),
        numpy_helper.from_array(b1, "b1"),
        numpy_helper.from_array(w2, "w2"),
        numpy_helper.from_array(np.array(0.5, np.float32), "half"),
    ]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, hidden])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, hidden])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def mlp_reference(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    """The same computation in numpy float64, independent of onnx-genrt."""
    w = {i.name: numpy_helper.to_array(i).astype(np.float64) for i in model.graph.initializer}
    xd = x.astype(np.float64)
    h = np.maximum(xd @ w["w1"] + w["b1"], 0.0)
    return h @ w["w2"] * w["half"] + xd


def chain(length: int, width: int = 8) -> onnx.ModelProto:
    """``length`` tiny elementwise nodes in a row: a model that is all dispatch cost."""
    return elementwise_chain(length, width)


def chain_reference(length: int, x: np.ndarray) -> np.ndarray:
    y = x.astype(np.float64)
    for i in range(length):
        y = (y + 1.0001, y * 1.0001, y - 1.0001)[i % 3]
    return y
