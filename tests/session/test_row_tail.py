"""A prefill's logits for its last row only: the row-local tail of a graph output, and the
executor running that tail on the last row (against numpy float64)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_genrt.core.errors import KernelError
from onnx_genrt.engine.decode_heads import ARGMAX, NONFINITE, add_decode_heads
from onnx_genrt.session import InferenceSession

ROWS, HIDDEN, VOCAB = 6, 8, 20
CAP = 3.0


def _lm(tail: str) -> onnx.ModelProto:
    """x -> h = 0.5 * x (a graph output, like hidden_states) -> MatMul(h, W) -> ``tail``."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((HIDDEN, VOCAB)).astype(np.float32)
    inits = [
        numpy_helper.from_array(np.array(0.5, np.float32), "half"),
        numpy_helper.from_array(np.array(CAP, np.float32), "cap"),
    ]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, None, HIDDEN])]
    nodes = [helper.make_node("Mul", ["x", "half"], ["h"])]
    if tail == "weight_is_an_input":
        inputs.append(helper.make_tensor_value_info("w", TensorProto.FLOAT, [HIDDEN, VOCAB]))
    else:
        inits.append(numpy_helper.from_array(w, "w"))
    nodes.append(helper.make_node("MatMul", ["h", "w"], ["z"]))
    if tail == "cast":
        nodes.append(helper.make_node("Cast", ["z"], ["logits"], to=TensorProto.FLOAT))
    elif tail in ("softcap", "weight_is_an_input"):
        nodes += [
            helper.make_node("Div", ["z", "cap"], ["zc"]),
            helper.make_node("Tanh", ["zc"], ["t"]),
            helper.make_node("Mul", ["t", "cap"], ["logits"]),
        ]
    elif tail == "transpose":
        nodes.append(helper.make_node("Transpose", ["z"], ["logits"], perm=[0, 2, 1]))
    elif tail == "runtime_bias":
        inputs.append(helper.make_tensor_value_info("bias", TensorProto.FLOAT, [1, None, VOCAB]))
        nodes.append(helper.make_node("Add", ["z", "bias"], ["logits"]))
    else:
        raise AssertionError(tail)
    outputs = [
        helper.make_tensor_value_info("h", TensorProto.FLOAT, None),
        helper.make_tensor_value_info("logits", TensorProto.FLOAT, None),
    ]
    graph = helper.make_graph(nodes, "lm", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return add_decode_heads(model, "logits")


def _reference(model: onnx.ModelProto, x: np.ndarray, tail: str) -> np.ndarray:
    w = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}["w"]
    z = (0.5 * x.astype(np.float64)) @ w.astype(np.float64)
    return CAP * np.tanh(z / CAP) if tail == "softcap" else z


@pytest.mark.parametrize(
    ("tail", "outputs"),
    [
        ("cast", {"logits", ARGMAX, NONFINITE}),
        ("softcap", {"logits", ARGMAX, NONFINITE}),
        ("transpose", None),  # not row-local: rows become columns
        ("runtime_bias", None),  # reads another input's rows
        ("weight_is_an_input", None),  # no projection on a constant weight
    ],
)
def test_row_tail_only_where_every_step_is_row_local(tail, outputs):
    sess = InferenceSession(_lm(tail), providers=["cpu"])
    found = sess.executor.row_tail("logits")
    if outputs is None:
        assert found is None
        return
    assert found is not None and found.outputs == outputs
    assert sess.plan.steps[found.start].node.op_type == "MatMul"
    assert sess.executor.row_tail("h") is None  # made by a Mul on the input, not a projection


@pytest.mark.parametrize("tail", ["cast", "softcap"])
def test_last_row_prefill_matches_numpy_and_leaves_other_outputs_whole(tail):
    model = _lm(tail)
    sess = InferenceSession(model, providers=["cpu"])
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, ROWS, HIDDEN)).astype(np.float32)
    want = _reference(model, x, tail)

    last = sess.io_binding()
    last.bind_input("x", x)
    logits = last.bind_output("logits", shape=(1, 1, VOCAB), dtype=np.float32)
    argmax = last.bind_output(ARGMAX, shape=(1, 1), dtype=np.int64)
    probe = last.bind_output(NONFINITE, shape=(), dtype=np.float32)
    hidden = last.bind_output("h", shape=(1, ROWS, HIDDEN), dtype=np.float32)
    for _ in range(2):  # planned on the first run, run on that plan on the second
        logits.fill(np.nan)
        hidden.fill(np.nan)
        sess.executor.run_bound_eager(last, last_row_of="logits")
        np.testing.assert_allclose(logits, want[:, -1:], rtol=1e-5, atol=1e-5)
        assert argmax[0, 0] == np.argmax(want[0, -1])
        assert float(probe) == 0.0
        np.testing.assert_allclose(hidden, 0.5 * x, rtol=1e-6)

    # the same input shapes without the tail: every row, on a plan of its own
    full = sess.io_binding()
    full.bind_input("x", x)
    every = full.bind_output("logits", shape=(1, ROWS, VOCAB), dtype=np.float32)
    full.bind_output(ARGMAX, shape=(1, ROWS), dtype=np.int64)
    full.bind_output(NONFINITE, shape=(), dtype=np.float32)
    full.bind_output("h", shape=(1, ROWS, HIDDEN), dtype=np.float32)
    sess.executor.run_bound_eager(full)
    np.testing.assert_allclose(every, want, rtol=1e-5, atol=1e-5)


def test_last_row_of_an_output_without_a_tail_names_it():
    sess = InferenceSession(_lm("transpose"), providers=["cpu"])
    binding = sess.io_binding()
    binding.bind_input("x", np.zeros((1, ROWS, HIDDEN), np.float32))
    with pytest.raises(KernelError, match="'logits' is not made row by row"):
        sess.executor.run_bound_eager(binding, last_row_of="logits")


def _plain_lm(x_shape: list) -> tuple[onnx.ModelProto, np.ndarray]:
    """x -> Mul(0.5) -> MatMul(W) -> logits, with an ``x`` of the given rank."""
    w = np.random.default_rng(2).standard_normal((HIDDEN, VOCAB)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("Mul", ["x", "half"], ["h"], name="scale"),
            helper.make_node("MatMul", ["h", "w"], ["logits"], name="head"),
        ],
        "plain_lm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, None)],
        [
            numpy_helper.from_array(np.array(0.5, np.float32), "half"),
            numpy_helper.from_array(w, "w"),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), w


def test_last_row_of_a_two_dimensional_activation_matches_numpy():
    model, w = _plain_lm([None, HIDDEN])
    sess = InferenceSession(model, providers=["cpu"])
    x = np.random.default_rng(3).standard_normal((ROWS, HIDDEN)).astype(np.float32)
    binding = sess.io_binding()
    binding.bind_input("x", x)
    logits = binding.bind_output("logits", shape=(1, VOCAB), dtype=np.float32)
    sess.executor.run_bound_eager(binding, last_row_of="logits")
    want = (0.5 * x[-1:].astype(np.float64)) @ w.astype(np.float64)
    np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-5)


def test_last_row_of_a_one_dimensional_activation_is_refused_with_its_shape():
    model, _ = _plain_lm([HIDDEN])
    sess = InferenceSession(model, providers=["cpu"])
    binding = sess.io_binding()
    binding.bind_input("x", np.ones(HIDDEN, np.float32))
    binding.bind_output("logits", shape=(VOCAB,), dtype=np.float32)
    with pytest.raises(KernelError, match=r"node 'head' .*no rows to take the last of in \[8\]"):
        sess.executor.run_bound_eager(binding, last_row_of="logits")
