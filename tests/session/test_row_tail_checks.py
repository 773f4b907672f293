"""Which graph outputs have a row-local tail (``session.row_tail``), op by op, and the
last-row runs of those that do against onnxruntime's run of every row (found by a mutation
run: MatMulNBits and fused-norm starts, the axis and reduction attributes, tails that read a
graph output or a value with two readers, and non-standard ops after the start had no test).

Each case is a small graph ``x -> ... -> logits``. Where a tail exists, a prefill-like run
on the last row must give onnxruntime's last row of every tail output (and every other
output whole); where none does, ``last_row_of`` is refused and every row still matches."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_genrt.core.errors import KernelError
from onnx_genrt.session import InferenceSession

from .test_norm_matmul_fusion import FusingCPU

ROWS, HIDDEN, VOCAB, BLOCK = 5, 32, 12, 32
MS = "com.microsoft"
F, I64 = TensorProto.FLOAT, TensorProto.INT64


def _const(name: str, value, dtype=np.float32) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(value, dtype), name)


def _weights(rng: np.random.Generator, rows: int = HIDDEN, cols: int = VOCAB) -> np.ndarray:
    return (rng.standard_normal((rows, cols)) / np.sqrt(rows)).astype(np.float32)


def _nbits(rng: np.random.Generator, name: str = "W") -> list[onnx.TensorProto]:
    """A 4-bit [HIDDEN, VOCAB] weight as com.microsoft MatMulNBits takes it (block 32,
    uint8 zero points): B, scales, zero points."""
    blocks = HIDDEN // BLOCK
    q = rng.integers(0, 16, (VOCAB, blocks, BLOCK))
    packed = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
    zeros = rng.integers(0, 16, (VOCAB, blocks + blocks % 2))
    zp = (zeros[:, 0::2] | (zeros[:, 1::2] << 4)).astype(np.uint8)
    scales = rng.uniform(0.01, 0.05, (VOCAB, blocks)).astype(np.float32)
    return [
        numpy_helper.from_array(packed, f"{name}_q"),
        numpy_helper.from_array(scales, f"{name}_scales"),
        numpy_helper.from_array(zp, f"{name}_zp"),
    ]


def _nbits_node(inputs: list[str], output: str, name: str = "W") -> onnx.NodeProto:
    return helper.make_node(
        "MatMulNBits",
        [*inputs, f"{name}_q", f"{name}_scales", f"{name}_zp"],
        [output],
        domain=MS,
        K=HIDDEN,
        N=VOCAB,
        bits=4,
        block_size=BLOCK,
    )


def _model(
    nodes: list[onnx.NodeProto],
    inits: list[onnx.TensorProto],
    outputs: dict[str, int],
    inputs: dict[str, tuple[int, list[int]]] | None = None,
    opset: int = 18,
) -> onnx.ModelProto:
    inputs = inputs or {"x": (F, [1, ROWS, HIDDEN])}
    graph = helper.make_graph(
        nodes,
        "row_tail_case",
        [helper.make_tensor_value_info(n, t, s) for n, (t, s) in inputs.items()],
        [helper.make_tensor_value_info(n, t, None) for n, t in outputs.items()],
        inits,
    )
    opsets = [helper.make_opsetid("", opset), helper.make_opsetid(MS, 1)]
    if any(n.domain == "onnx_genrt" for n in nodes):
        opsets.append(helper.make_opsetid("onnx_genrt", 1))
    return helper.make_model(graph, opset_imports=opsets)


def _projected(tail: list[onnx.NodeProto], inits=(), outputs=None, opset: int = 18, **kw):
    """x -> MatMul(W) -> z -> ``tail`` (which makes ``logits``; without one, z is it)."""
    rng = np.random.default_rng(0)
    z = "z" if tail else "logits"
    nodes = [helper.make_node("MatMul", ["x", "W"], [z], name="head"), *tail]
    return _model(
        nodes,
        [numpy_helper.from_array(_weights(rng), "W"), *inits],
        outputs or {"logits": F},
        opset=opset,
        **kw,
    )


def _normed(skip: bool, total: str = "", nbits: bool = False, extra=()) -> onnx.ModelProto:
    """x [+ res] -> (Skip)SimplifiedLayerNormalization -> normed -> MatMul / MatMulNBits ->
    logits: fusion makes it one NormMatMul / NormMatMulNBits step. ``total``: the name of
    the skip norm's residual sum output; ``extra``: nodes after the projection."""
    rng = np.random.default_rng(1)
    gamma = _const("gamma", 1 + 0.1 * rng.standard_normal(HIDDEN))
    if skip:
        outs = ["normed", "", "", total] if total else ["normed"]
        norm = helper.make_node(
            "SkipSimplifiedLayerNormalization", ["x", "res", "gamma"], outs, domain=MS, epsilon=1e-5
        )
    else:
        norm = helper.make_node(
            "SimplifiedLayerNormalization", ["x", "gamma"], ["normed"], axis=-1, epsilon=1e-5
        )
    if nbits:
        proj, weights = _nbits_node(["normed"], "logits"), _nbits(rng)
    else:
        proj = helper.make_node("MatMul", ["normed", "W"], ["logits"], name="head")
        weights = [numpy_helper.from_array(_weights(rng), "W")]
    inputs = {"x": (F, [1, ROWS, HIDDEN])}
    if skip:
        inputs["res"] = (F, [1, ROWS, HIDDEN])
    outputs = {"logits": F, **{n.output[0]: F for n in extra}}
    return _model([norm, proj, *extra], [gamma, *weights], outputs, inputs)


def _last_rows(axis: int = -2) -> Callable[[dict[str, np.ndarray], str], np.ndarray]:
    def take(ref: dict[str, np.ndarray], name: str) -> np.ndarray:
        value = ref[name]
        return np.take(value, [value.shape[axis] - 1], axis=axis)

    return take


def _peak_of_last_row(ref: dict[str, np.ndarray], name: str) -> np.ndarray:
    """A full reduction in a tail covers the rows the tail computes: the last one."""
    return ref["logits"][0, -1].astype(np.float64).max().astype(ref[name].dtype)


def _capped_peak_of_last_row(ref: dict[str, np.ndarray], name: str) -> np.ndarray:
    return (3.0 * _peak_of_last_row(ref, "peak").astype(np.float64)).astype(ref[name].dtype)


CAP = _const("cap", 3.0)
BIAS_1D = _const("bias", np.linspace(-1, 1, VOCAB))
BIAS_2D = _const("bias", np.linspace(-1, 1, ROWS * VOCAB).reshape(ROWS, VOCAB))
SOFTCAP = [
    helper.make_node("Div", ["z", "cap"], ["zc"]),
    helper.make_node("Tanh", ["zc"], ["t"]),
    helper.make_node("Mul", ["t", "cap"], ["logits"]),
]


def _cases():
    rng = np.random.default_rng(2)
    mat = ("MatMul", {"logits"})
    yield "matmul", _projected([]), mat
    yield (  # the bias goes into the projection (fuse_matmul_add): the fused step starts it
        "bias_1d",
        _projected([helper.make_node("Add", ["z", "bias"], ["logits"])], [BIAS_1D]),
        ("MatMulAdd", {"logits"}),
    )
    # a 2-D constant gives each row its own bias: not row-local
    yield (
        "bias_2d",
        _projected([helper.make_node("Add", ["z", "bias"], ["logits"])], [BIAS_2D]),
        None,
    )
    # a 1-D weight makes one value per row: the rows become the last axis
    weight_1d = _model(
        [helper.make_node("MatMul", ["x", "w"], ["logits"])],
        [_const("w", rng.standard_normal(HIDDEN))],
        {"logits": F},
    )
    yield "weight_1d", weight_1d, None
    nbits = _model([_nbits_node(["x"], "logits")], _nbits(rng), {"logits": F})
    yield "nbits", nbits, ("MatMulNBits", {"logits"})
    yield "norm_matmul", _normed(skip=True), ("NormMatMul", {"logits"})
    yield "norm_matmul_sum_unread", _normed(skip=True, total="sum"), ("NormMatMul", {"logits"})
    # the residual sum read afterwards: the norm is no start, and it reads two row values
    sum_read = [helper.make_node("Cast", ["sum"], ["sum_out"], to=F)]
    yield "norm_matmul_sum_read", _normed(skip=True, total="sum", extra=sum_read), None
    yield "norm_nbits", _normed(skip=False, nbits=True), ("NormMatMulNBits", {"logits"})
    yield "softcap", _projected(SOFTCAP, [CAP]), mat
    # softcap's inner value is a graph output too / has a second reader
    yield "inner_output", _projected(SOFTCAP, [CAP], {"logits": F, "zc": F}), None
    second = [*SOFTCAP, helper.make_node("Relu", ["z"], ["zr"])]
    yield "inner_two_readers", _projected(second, [CAP], {"logits": F, "zr": F}), None
    softmax = [helper.make_node("Softmax", ["z"], ["logits"], axis=-1)]
    yield "softmax_last_axis", _projected(softmax), mat
    across = [helper.make_node("Softmax", ["z"], ["logits"], axis=1)]
    yield "softmax_across_rows", _projected(across), None
    best = [helper.make_node("ArgMax", ["logits"], ["best"], axis=-1, keepdims=0)]
    argmax = _projected([], outputs={"logits": F, "best": I64})
    argmax.graph.node.extend(best)
    yield "argmax_last_axis", argmax, ("MatMul", {"logits", "best"}), {"best": _last_rows(-1)}
    # ArgMax without an axis reduces axis 0: over the rows of 2-D logits
    first_axis = _projected(
        [], outputs={"logits": F, "best": I64}, inputs={"x": (F, [ROWS, HIDDEN])}
    )
    first_axis.graph.node.append(helper.make_node("ArgMax", ["logits"], ["best"], keepdims=0))
    yield "argmax_default_axis", first_axis, None
    # a full reduction, and a value made from it and a constant: both cover the last row
    peak = _projected([], [CAP], {"logits": F, "peak": F, "capped": F})
    peak.graph.node.extend(
        [
            helper.make_node("ReduceMax", ["logits"], ["peak"], keepdims=0),
            helper.make_node("Mul", ["peak", "cap"], ["capped"]),
        ]
    )
    of_last_row = {"peak": _peak_of_last_row, "capped": _capped_peak_of_last_row}
    yield "full_reduction", peak, ("MatMul", {"logits", "peak", "capped"}), of_last_row
    kept = _projected([], outputs={"logits": F, "peak": F})
    kept.graph.node.append(helper.make_node("ReduceMax", ["logits"], ["peak"]))  # keepdims=1
    yield "full_reduction_keepdims", kept, None
    over_rows = _projected([], outputs={"logits": F, "peak": F}, opset=17)
    over_rows.graph.node.append(
        helper.make_node("ReduceMax", ["logits"], ["peak"], axes=[1], keepdims=0)
    )
    yield "reduction_over_rows", over_rows, None
    # a full reduction of the tail's rows read back into rows: the rows would each see
    # the reduction of the last row only
    shifted = _projected([], outputs={"logits": F, "peak": F, "shifted": F})
    shifted.graph.node.extend(
        [
            helper.make_node("ReduceMax", ["logits"], ["peak"], keepdims=0),
            helper.make_node("Sub", ["logits", "peak"], ["shifted"]),
        ]
    )
    yield "full_reduction_read_by_rows", shifted, None
    # the same through a value made from the reduction
    shifted_scaled = _projected([], [CAP], {"logits": F, "shifted": F})
    shifted_scaled.graph.node.extend(
        [
            helper.make_node("ReduceMax", ["logits"], ["peak"], keepdims=0),
            helper.make_node("Mul", ["peak", "cap"], ["capped"]),
            helper.make_node("Sub", ["logits", "capped"], ["shifted"]),
        ]
    )
    yield "scaled_reduction_read_by_rows", shifted_scaled, None
    after = _projected(
        [],
        [numpy_helper.from_array(_weights(rng, VOCAB, 4), "W2")],
        {"logits": F, "extra": F},
    )
    after.graph.node.append(helper.make_node("MatMul", ["logits", "W2"], ["extra"]))
    yield "projection_after", after, ("MatMul", {"logits", "extra"})
    # a step after the start that reads no row value is not part of the tail
    unrelated = _projected([], outputs={"logits": F, "xt": F})
    unrelated.graph.node.append(helper.make_node("Transpose", ["x"], ["xt"], perm=[0, 2, 1]))
    yield "unrelated_after", unrelated, mat
    # a com.microsoft op after the start: rotary reads every row's position
    half = VOCAB // 4  # two heads of VOCAB // 2
    angles = np.outer(np.arange(16), 1.0 / 10000 ** (np.arange(half) / half))
    rotary = _projected(
        [],
        [_const("cos", np.cos(angles)), _const("sin", np.sin(angles))],
        {"logits": F, "rot": F},
        inputs={"x": (F, [1, ROWS, HIDDEN]), "pos": (I64, [1, ROWS])},
    )
    rotary.graph.node.append(
        helper.make_node(
            "RotaryEmbedding", ["logits", "pos", "cos", "sin"], ["rot"], domain=MS, num_heads=2
        )
    )
    yield "rotary_after", rotary, None


def _params():
    """(name, model, want: None or (start op, tail outputs), expected values by output)."""
    for name, model, want, *expect in _cases():
        yield pytest.param(name, model, want, expect[0] if expect else {}, id=name)


def _feeds(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    feeds = {}
    for value in model.graph.input:
        shape = [d.dim_value for d in value.type.tensor_type.shape.dim]
        if value.type.tensor_type.elem_type == I64:
            feeds[value.name] = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape) + 3
        else:
            feeds[value.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def _onnxruntime(model: onnx.ModelProto, feeds) -> dict[str, np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds), strict=True))


def _bind_and_run(sess, feeds, want: dict[str, np.ndarray], last_row_of=None) -> None:
    binding = sess.io_binding()
    for name, value in feeds.items():
        binding.bind_input(name, value)
    got = {}
    for name, value in want.items():  # a float64 reference is compared with float32 results
        dtype = np.float32 if value.dtype == np.float64 else value.dtype
        fill = np.nan if value.dtype.kind == "f" else -1
        got[name] = binding.bind_output(name, np.full(value.shape, fill, dtype))
    sess.executor.run_bound_eager(binding, last_row_of=last_row_of)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=2e-5, atol=2e-5, err_msg=name)


@pytest.mark.parametrize(("case", "model", "want", "expect"), list(_params()))
def test_row_tail_of_each_case_and_its_last_row_run_against_onnxruntime(case, model, want, expect):
    sess = InferenceSession(model, providers=[FusingCPU()])  # the CPU plus fused projections
    tail = sess.executor.row_tail("logits")
    feeds = _feeds(model)
    ref = _onnxruntime(model, feeds)
    if want is None:
        assert tail is None, case
        with pytest.raises(KernelError, match="'logits' is not made row by row"):
            _bind_and_run(sess, feeds, ref, last_row_of="logits")
        _bind_and_run(sess, feeds, ref)  # every row, as onnxruntime
        return
    start, outputs = want
    assert tail is not None, case
    assert sess.plan.steps[tail.start].node.op_type == start
    assert tail.outputs == outputs
    last = {
        name: expect.get(name, _last_rows())(ref, name) if name in outputs else value
        for name, value in ref.items()
    }
    for _ in range(2):  # planned on the first run, run on that plan on the second
        _bind_and_run(sess, feeds, last, last_row_of="logits")


def test_a_value_no_step_makes_has_no_tail():
    sess = InferenceSession(_projected(SOFTCAP, [CAP]), providers=["cpu"])
    assert sess.executor.row_tail("x") is None  # a graph input
    assert sess.executor.row_tail("W") is None  # a constant


def _mtp_accept_model() -> onnx.ModelProto:
    """The verify step's hidden rows (a projection) read by an MTPAccept, which picks the
    row at the accepted position: not the last row."""
    model = _projected(
        [],
        outputs={"logits": F, "accepted": I64, "token": I64, "row": F},
        inputs={
            "x": (F, [1, ROWS, HIDDEN]),
            "ids": (I64, [1, ROWS]),
            "argmax": (I64, [1, ROWS]),
            "count": (I64, [1]),
        },
    )
    model.graph.node.append(
        helper.make_node(
            "MTPAccept",
            ["ids", "argmax", "logits", "count"],
            ["accepted", "token", "row"],
            domain="onnx_genrt",
            to=F,
        )
    )
    model.opset_import.append(helper.make_opsetid("onnx_genrt", 1))
    return model


def test_an_onnx_genrt_op_is_neither_a_start_nor_row_local():
    model = _mtp_accept_model()
    sess = InferenceSession(model, providers=["cpu"])
    assert sess.executor.row_tail("logits") is None
    assert sess.executor.row_tail("row") is None
    ids = np.array([[7, 1, 2, 9, 4]], np.int64)
    argmax = np.array([[1, 2, 5, 5, 5]], np.int64)  # the first two drafts are accepted
    x = np.random.default_rng(4).standard_normal((1, ROWS, HIDDEN)).astype(np.float32)
    w = numpy_helper.to_array(model.graph.initializer[0]).astype(np.float64)
    logits = x.astype(np.float64) @ w
    feeds = {"x": x, "ids": ids, "argmax": argmax, "count": np.array([4], np.int64)}
    want = {
        "logits": logits,
        "accepted": np.array([2]),
        "token": np.array([[5]]),
        "row": logits[:, 2:3],
    }
    with pytest.raises(KernelError, match="'logits' is not made row by row"):
        _bind_and_run(sess, feeds, want, last_row_of="logits")
    _bind_and_run(sess, feeds, want)


EPS = 1e-5


def _written_norm(outputs: list[str], skip: bool, gamma_fed: bool = False, extra=()):
    """x [+ res] -> an ``onnx_genrt::NormMatMul`` node written in the model itself (not made
    by fusion, so it may have fewer outputs than fusion gives it) -> logits, then ``extra``
    nodes. ``gamma_fed``: gamma is a graph input instead of a constant."""
    rng = np.random.default_rng(5)
    gamma = _const("gamma", 1 + 0.1 * rng.standard_normal(HIDDEN))
    weight = numpy_helper.from_array(_weights(rng), "W")
    inputs = {"x": (F, [1, ROWS, HIDDEN])}
    if skip:
        inputs["res"] = (F, [1, ROWS, HIDDEN])
    if gamma_fed:
        inputs["gamma"] = (F, [HIDDEN])
    norm = helper.make_node(
        "NormMatMul",
        ["x", "res" if skip else "", "gamma", "W"],
        outputs,
        domain="onnx_genrt",
        epsilon=EPS,
    )
    graph_outputs = {"logits": F, **{n.output[0]: F for n in extra}}
    inits = [weight] if gamma_fed else [gamma, weight]
    model = _model([norm, *extra], [*inits, CAP], graph_outputs, inputs)
    return model, numpy_helper.to_array(gamma), numpy_helper.to_array(weight)


def _norm_reference(feeds, gamma, weight) -> dict[str, np.ndarray]:
    """The written norm's values in float64: the logits, the residual sum, and that sum
    scaled by the cap (3)."""
    h = feeds["x"].astype(np.float64) + feeds.get("res", np.zeros(1)).astype(np.float64)
    normed = h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + EPS) * gamma.astype(np.float64)
    return {"logits": normed @ weight.astype(np.float64), "sum": h, "scaled": 3.0 * h}


def test_a_written_norm_with_one_output_starts_a_tail():
    """A NormMatMul without its optional outputs (no residual sum to check): the last-row
    run gives numpy's last row of the logits."""
    model, gamma, weight = _written_norm(["logits"], skip=False)
    sess = InferenceSession(model, providers=[FusingCPU()])
    tail = sess.executor.row_tail("logits")
    assert tail is not None
    assert sess.plan.steps[tail.start].node.op_type == "NormMatMul"
    assert tail.outputs == {"logits"}
    feeds = _feeds(model)
    ref = _norm_reference(feeds, gamma, weight)
    for _ in range(2):
        _bind_and_run(sess, feeds, {"logits": ref["logits"][:, -1:]}, last_row_of="logits")


def test_a_written_norm_whose_residual_sum_is_read_is_no_start():
    """NormMatMul's outputs (y, sum) with the sum read by a later step: the sum is needed
    for every row, so the logits have no tail; every row is computed."""
    scaled = helper.make_node("Mul", ["sum", "cap"], ["scaled"])
    model, gamma, weight = _written_norm(["logits", "sum"], skip=True, extra=[scaled])
    sess = InferenceSession(model, providers=[FusingCPU()])
    assert sess.executor.row_tail("logits") is None
    feeds = _feeds(model)
    ref = _norm_reference(feeds, gamma, weight)
    want = {"logits": ref["logits"], "scaled": ref["scaled"]}
    with pytest.raises(KernelError, match="'logits' is not made row by row"):
        _bind_and_run(sess, feeds, want, last_row_of="logits")
    _bind_and_run(sess, feeds, want)


def test_a_written_norm_with_a_fed_gamma_is_no_start():
    """Only a norm on constant weights (gamma included) starts a tail: a fed gamma is
    refused with the row-tail message, and the whole run matches numpy."""
    model, gamma, weight = _written_norm(["logits"], skip=False, gamma_fed=True)
    sess = InferenceSession(model, providers=[FusingCPU()])
    assert sess.executor.row_tail("logits") is None
    feeds = {**_feeds(model), "gamma": gamma}
    ref = _norm_reference(feeds, gamma, weight)
    with pytest.raises(KernelError, match="'logits' is not made row by row"):
        _bind_and_run(sess, feeds, {"logits": ref["logits"]}, last_row_of="logits")
    _bind_and_run(sess, feeds, {"logits": ref["logits"]})


def test_an_onnx_genrt_op_with_constant_later_inputs_is_no_start():
    """MTPAccept reads every row of ids and argmax; with its hidden rows and count constant
    (its inputs 2 and 3, where a norm's weights are) it is still no start."""
    rng = np.random.default_rng(6)
    hidden = rng.standard_normal((1, ROWS, HIDDEN)).astype(np.float32)
    model = _model(
        [
            helper.make_node(
                "MTPAccept",
                ["ids", "argmax", "hidden", "count"],
                ["accepted", "token", "row"],
                domain="onnx_genrt",
                to=F,
            )
        ],
        [_const("hidden", hidden), _const("count", [4], np.int64)],
        {"accepted": I64, "token": I64, "row": F},
        {"ids": (I64, [1, ROWS]), "argmax": (I64, [1, ROWS])},
    )
    sess = InferenceSession(model, providers=["cpu"])
    assert sess.executor.row_tail("row") is None
    feeds = {
        "ids": np.array([[7, 1, 2, 9, 4]], np.int64),
        "argmax": np.array([[1, 2, 5, 5, 5]], np.int64),  # the first two drafts accepted
    }
    want = {"accepted": np.array([2]), "token": np.array([[5]]), "row": hidden[:, 2:3]}
    with pytest.raises(KernelError, match="'row' is not made row by row"):
        _bind_and_run(sess, feeds, want, last_row_of="row")
    _bind_and_run(sess, feeds, want)
