"""Classic ONNX ops (opsets 6-22) on every provider: ONNX's node tests through a whole session,
plus onnxruntime / ``onnx.reference`` comparisons for forms the node tests do not cover."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from onnx_genrt import conformance
from onnx_genrt.conformance import Status
from onnx_genrt.core.errors import KernelError, UnsupportedOpError

from .op_tester import OpTester

RNG = np.random.default_rng(1234)

#: Ops whose every ONNX node test (and expanded function body) must pass on cpu, and on
#: another provider where it runs the case's op.
CLASSIC_OPS = [
    "MaxPool",
    "AveragePool",
    "LpPool",
    "GlobalMaxPool",
    "GlobalAveragePool",
    "ConvTranspose",
    "NegativeLogLikelihoodLoss",
    "SoftmaxCrossEntropyLoss",
    "StringNormalizer",
    "StringSplit",
    "StringConcat",
    "RegexFullMatch",
    "LabelEncoder",
    "BitCast",
    "Hardmax",
    "LpNormalization",
    "Shrink",
    "SwiGLU",
    "Det",
    "LRN",
    "MeanVarianceNormalization",
    "TensorScatter",
    "HannWindow",
    "HammingWindow",
    "BlackmanWindow",
    "Binarizer",
    "ArrayFeatureExtractor",
    "DynamicQuantizeLinear",
    "QLinearMatMul",
    "ConvInteger",
    "QLinearConv",
    "MaxUnpool",
    "Upsample",
    "RNN",
    "GRU",
    "LSTM",
    "DFT",
    "STFT",
    "Adagrad",
    "Momentum",
    "Adam",
    "GridSample",
    "AffineGrid",
    "CausalConvWithState",
    "LinearAttention",
    "NonMaxSuppression",
    "TfIdfVectorizer",
    "RoiAlign",
    "DeformConv",
]

_TYPES = {
    np.dtype(np.float32): TensorProto.FLOAT,
    np.dtype(np.float64): TensorProto.DOUBLE,
    np.dtype(np.float16): TensorProto.FLOAT16,
    np.dtype(np.int64): TensorProto.INT64,
    np.dtype(np.int32): TensorProto.INT32,
    np.dtype(np.uint8): TensorProto.UINT8,
    np.dtype(np.int8): TensorProto.INT8,
    np.dtype(object): TensorProto.STRING,
}


#: Function bodies that need an op the cpu provider does not have (If, a subgraph op).
NOT_YET = {"AffineGrid (expanded)", "LinearAttention (expanded)"}


def _node_cases() -> list[Any]:
    cases = conformance.load_cases(ops=CLASSIC_OPS)
    return [pytest.param(c, id=c.name) for c in cases if c.op not in NOT_YET]


@pytest.mark.parametrize("case", _node_cases())
def test_onnx_node_case_passes(case: conformance.Case, tester: OpTester) -> None:
    if not tester.is_reference and conformance.EXPANDED in case.op:
        pytest.skip("a function body: its primitive ops have node tests of their own")
    result = conformance.run_case(case, tester.session_providers(), require_on=tester.name)
    if result.status is Status.SKIPPED and not tester.is_reference:
        pytest.skip(result.reason)
    assert result.status is Status.PASSED, (
        f"{case.name} [{case.op}] on {tester.name}: {result.reason}"
    )


def _model(
    nodes: list[onnx.NodeProto],
    inputs: dict[str, np.ndarray],
    outputs: list[tuple[str, int]],
    opset: int,
    initializers: dict[str, np.ndarray] | None = None,
) -> onnx.ModelProto:
    inits = initializers or {}
    graph = helper.make_graph(
        nodes,
        "classic",
        [helper.make_tensor_value_info(n, _TYPES[a.dtype], a.shape) for n, a in inputs.items()],
        [helper.make_tensor_value_info(n, t, None) for n, t in outputs],
        [onnx.numpy_helper.from_array(a, n) for n, a in inits.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 7 if opset < 15 else 10
    return model


def _ours(
    tester: OpTester, model: onnx.ModelProto, feeds: dict[str, np.ndarray]
) -> list[np.ndarray]:
    return tester.run_model(model, feeds)


def _onnxruntime(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def _reference(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    return ReferenceEvaluator(model).run(None, feeds)


def _assert_same(got: list[np.ndarray], want: list[np.ndarray], tol: float = 1e-5) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        w = np.asarray(w)
        if w.dtype.kind in "OSU":
            assert g.dtype == object and g.shape == w.shape, (g.dtype, g.shape, w.shape)
            assert g.tolist() == w.astype(object).tolist()
            continue
        assert g.dtype == w.dtype and g.shape == w.shape, (g.dtype, g.shape, w.dtype, w.shape)
        if w.dtype.kind in "iub":
            np.testing.assert_array_equal(g, w)
        else:
            np.testing.assert_allclose(g, w, rtol=tol, atol=tol)


# -- pooling -----------------------------------------------------------------------------------

_POOL_CASES = [
    ("MaxPool", (2, 3, 11), {"kernel_shape": [3], "strides": [2], "pads": [1, 2], "ceil_mode": 1}),
    ("MaxPool", (1, 2, 9, 8), {"kernel_shape": [3, 2], "dilations": [2, 1], "strides": [2, 3]}),
    ("MaxPool", (1, 2, 7, 6, 5), {"kernel_shape": [2, 3, 2], "pads": [1, 0, 1, 0, 2, 1]}),
    ("MaxPool", (1, 3, 10, 7), {"kernel_shape": [3, 3], "strides": [3, 2], "auto_pad": "SAME_LOWER"}),
    ("AveragePool", (2, 3, 10), {"kernel_shape": [4], "strides": [3], "pads": [2, 1], "ceil_mode": 1}),
    (
        "AveragePool",
        (1, 2, 9, 7),
        {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "ceil_mode": 1,
         "count_include_pad": 1},
    ),
    ("AveragePool", (1, 2, 6, 5, 7), {"kernel_shape": [2, 2, 3], "auto_pad": "SAME_UPPER", "strides": [2, 1, 2]}),
    ("AveragePool", (1, 1, 8, 8), {"kernel_shape": [3, 3], "dilations": [2, 2], "pads": [2, 2, 2, 2], "count_include_pad": 1}),
    ("LpPool", (1, 3, 9, 6), {"kernel_shape": [3, 2], "strides": [2, 2], "pads": [1, 0, 1, 1], "p": 3}),
]  # fmt: skip


@pytest.mark.parametrize(("op", "shape", "attrs"), _POOL_CASES)
def test_pool_matches_onnxruntime(
    op: str, shape: tuple[int, ...], attrs: dict, tester: OpTester
) -> None:
    x = RNG.standard_normal(shape).astype(np.float32)
    outs = ["y", "idx"] if op == "MaxPool" and "dilations" not in attrs else ["y"]
    types = [TensorProto.FLOAT, TensorProto.INT64][: len(outs)]
    model = _model(
        [helper.make_node(op, ["x"], outs, **attrs)],
        {"x": x},
        list(zip(outs, types, strict=True)),
        19,
    )
    _assert_same(_ours(tester, model, {"x": x}), _onnxruntime(model, {"x": x}))


def test_max_pool_indices_column_major_and_int8(tester: OpTester) -> None:
    x = RNG.integers(-100, 100, (2, 3, 7, 9)).astype(np.int8)
    attrs = {"kernel_shape": [2, 3], "strides": [2, 2], "pads": [1, 1, 0, 1], "storage_order": 1}
    node = helper.make_node("MaxPool", ["x"], ["y", "i"], **attrs)
    model = _model([node], {"x": x}, [("y", TensorProto.INT8), ("i", TensorProto.INT64)], 12)
    got = _ours(tester, model, {"x": x})
    _assert_same(got, _reference(model, {"x": x}))
    # each index names an element holding the window's maximum
    np.testing.assert_array_equal(x.reshape(-1, order="C")[got[1]].shape, got[0].shape)


def test_pool_refuses_bad_attributes_when_loading(tester: OpTester) -> None:
    x = np.zeros((1, 1, 4, 4), np.float32)
    node = helper.make_node("AveragePool", ["x"], ["y"], kernel_shape=[2, 2], auto_pad="SAME")
    with pytest.raises(UnsupportedOpError, match="auto_pad='SAME'"):
        tester.session_alone(_model([node], {"x": x}, [("y", TensorProto.FLOAT)], 11))


def test_pool_kernel_rank_mismatch_names_the_node(tester: OpTester) -> None:
    x = np.zeros((1, 1, 4, 4), np.float32)
    node = helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[2], name="pool1")
    model = _model([node], {"x": x}, [("y", TensorProto.FLOAT)], 11)
    with pytest.raises(KernelError, match="pool1.*kernel_shape"):
        _ours(tester, model, {"x": x})


# -- ConvTranspose ---------------------------------------------------------------------------

_CONV_T_CASES = [
    ((1, 4, 5, 6), (4, 3, 3, 3), {"group": 2, "strides": [2, 3], "dilations": [1, 2], "pads": [1, 0, 2, 1]}),
    ((2, 3, 7), (3, 2, 4), {"strides": [3], "output_padding": [2], "pads": [1, 2]}),
    ((1, 2, 4, 5), (2, 5, 2, 3), {"strides": [2, 2], "output_shape": [9, 12]}),
    ((1, 2, 3, 4, 3), (2, 2, 2, 2, 3), {"strides": [1, 2, 2], "dilations": [2, 1, 1]}),
    ((1, 6, 5, 5), (6, 1, 3, 3), {"group": 6, "strides": [2, 2], "auto_pad": "SAME_UPPER"}),
]  # fmt: skip


@pytest.mark.parametrize(("xshape", "wshape", "attrs"), _CONV_T_CASES)
def test_conv_transpose_matches_onnxruntime(
    xshape: tuple, wshape: tuple, attrs: dict, tester: OpTester
) -> None:
    x = RNG.standard_normal(xshape).astype(np.float32)
    w = RNG.standard_normal(wshape).astype(np.float32)
    b = RNG.standard_normal(wshape[1] * attrs.get("group", 1)).astype(np.float32)
    node = helper.make_node("ConvTranspose", ["x", "w", "b"], ["y"], **attrs)
    model = _model([node], {"x": x}, [("y", TensorProto.FLOAT)], 17, {"w": w, "b": b})
    _assert_same(_ours(tester, model, {"x": x}), _onnxruntime(model, {"x": x}), tol=1e-4)


def test_conv_transpose_rejects_output_padding_not_below_stride(tester: OpTester) -> None:
    x = np.zeros((1, 1, 3, 3), np.float32)
    w = np.zeros((1, 1, 2, 2), np.float32)
    node = helper.make_node(
        "ConvTranspose", ["x", "w"], ["y"], strides=[2, 2], output_padding=[2, 0]
    )
    model = _model([node], {"x": x}, [("y", TensorProto.FLOAT)], 11, {"w": w})
    with pytest.raises(KernelError, match="output_padding"):
        _ours(tester, model, {"x": x})


# -- losses ------------------------------------------------------------------------------------


def test_nll_loss_target_outside_classes_is_a_clear_error(tester: OpTester) -> None:
    x = RNG.standard_normal((3, 4)).astype(np.float32)
    target = np.array([0, 4, 1], np.int64)
    node = helper.make_node(
        "NegativeLogLikelihoodLoss", ["x", "t"], ["y"], reduction="sum", ignore_index=-1
    )
    model = _model([node], {"x": x, "t": target}, [("y", TensorProto.FLOAT)], 13)
    with pytest.raises(KernelError, match=r"class 4 outside \[0, 4\)"):
        _ours(tester, model, {"x": x, "t": target})
    target[1] = -1  # the ignored class may lie outside the range
    _assert_same(
        _ours(tester, model, {"x": x, "t": target}), _onnxruntime(model, {"x": x, "t": target})
    )


# -- opset 1-6 elementwise forms ---------------------------------------------------------------

_NUMPY = {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Div": np.divide, "Pow": np.power}


@pytest.mark.parametrize("op", sorted(_NUMPY))
@pytest.mark.parametrize(
    ("b_shape", "axis", "aligned"),
    [((3, 4), 1, (1, 3, 4, 1)), ((2,), 0, (2, 1, 1, 1)), ((3,), -3, (1, 3, 1, 1)),
     ((5,), None, (5,)), ((1,), None, ())],
)  # fmt: skip
def test_opset6_broadcast_axis_matches_numpy(
    op: str, b_shape: tuple, axis: int | None, aligned: tuple, tester: OpTester
) -> None:
    """Old PyTorch wrote e.g. Add(conv_out, bias, broadcast=1, axis=1) with bias [C]."""
    a = RNG.uniform(0.5, 2.0, (2, 3, 4, 5)).astype(np.float32)
    b = RNG.uniform(0.5, 2.0, b_shape).astype(np.float32)
    attrs = {"broadcast": 1} if axis is None else {"broadcast": 1, "axis": axis}
    node = helper.make_node(op, ["a", "b"], ["y"], **attrs)
    model = _model([node], {"a": a, "b": b}, [("y", TensorProto.FLOAT)], 6)
    (got,) = _ours(tester, model, {"a": a, "b": b})
    want = _NUMPY[op](a.astype(np.float64), b.astype(np.float64).reshape(aligned))
    assert got.dtype == np.float32 and got.shape == a.shape
    np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize("op", sorted(_NUMPY))
def test_opset6_trailing_broadcast_matches_onnxruntime_after_upgrade(
    op: str, tester: OpTester
) -> None:
    a = RNG.uniform(0.5, 2.0, (2, 3, 4, 5)).astype(np.float32)
    b = RNG.uniform(0.5, 2.0, (4, 5)).astype(np.float32)
    node = helper.make_node(op, ["a", "b"], ["y"], broadcast=1)
    model = _model([node], {"a": a, "b": b}, [("y", TensorProto.FLOAT)], 6)
    upgraded = onnx.version_converter.convert_version(model, 13)
    _assert_same(_ours(tester, model, {"a": a, "b": b}), _onnxruntime(upgraded, {"a": a, "b": b}))


def test_opset1_comparison_with_axis(tester: OpTester) -> None:
    a = RNG.standard_normal((2, 3, 4)).astype(np.float32)
    b = RNG.standard_normal((3,)).astype(np.float32)
    node = helper.make_node("Greater", ["a", "b"], ["y"], broadcast=1, axis=1)
    model = _model([node], {"a": a, "b": b}, [("y", TensorProto.BOOL)], 1)
    (got,) = _ours(tester, model, {"a": a, "b": b})
    np.testing.assert_array_equal(got, a > b.reshape(1, 3, 1))


@pytest.mark.parametrize(
    ("attrs", "b_shape", "fragment"),
    [({}, (5,), "broadcast=1"), ({"broadcast": 1, "axis": 2}, (3,), "does not fit")],
)
def test_opset6_shape_mismatch_says_what_to_change(
    attrs: dict, b_shape: tuple, fragment: str, tester: OpTester
):
    a = np.ones((2, 3, 5), np.float32)
    b = np.ones(b_shape, np.float32)
    node = helper.make_node("Add", ["a", "b"], ["y"], name="bias_add", **attrs)
    model = _model([node], {"a": a, "b": b}, [("y", TensorProto.FLOAT)], 6)
    with pytest.raises(KernelError, match=f"bias_add.*{fragment}"):
        _ours(tester, model, {"a": a, "b": b})


def test_opset6_variadic_needs_equal_shapes_and_opset1_tile(tester: OpTester) -> None:
    a, b = np.ones((2, 3), np.float32), np.ones((3,), np.float32)
    node = helper.make_node("Sum", ["a", "b"], ["y"])
    model = _model([node], {"a": a, "b": b}, [("y", TensorProto.FLOAT)], 6)
    with pytest.raises(KernelError, match="before opset 8"):
        _ours(tester, model, {"a": a, "b": b})
    x = RNG.standard_normal((2, 3)).astype(np.float32)
    tiles, axis = np.array([3], np.int64), np.array([1], np.int64)
    node = helper.make_node("Tile", ["x", "t", "ax"], ["y"])
    model = _model([node], {"x": x}, [("y", TensorProto.FLOAT)], 1, {"t": tiles, "ax": axis})
    (got,) = _ours(tester, model, {"x": x})
    np.testing.assert_array_equal(got, np.concatenate([x, x, x], axis=1))


# -- PRelu -------------------------------------------------------------------------------------


@pytest.mark.parametrize("opset", [6, 9, 16])
def test_prelu_per_channel_slope_on_nchw(opset: int, tester: OpTester) -> None:
    """A [C] slope against NCHW, as old PyTorch exported it: per channel."""
    x = RNG.standard_normal((2, 3, 4, 5)).astype(np.float32)
    slope = RNG.uniform(0.1, 0.5, (3,)).astype(np.float32)
    node = helper.make_node("PRelu", ["x", "s"], ["y"])
    model = _model([node], {"x": x}, [("y", TensorProto.FLOAT)], opset, {"s": slope})
    (got,) = _ours(tester, model, {"x": x})
    x64 = x.astype(np.float64)
    want = np.where(x64 >= 0, x64, x64 * slope.astype(np.float64).reshape(1, 3, 1, 1))
    np.testing.assert_allclose(got, want, rtol=1e-6)
    if opset >= 7:
        _assert_same([got], _reference(model, {"x": x}))


@pytest.mark.parametrize("slope_shape", [(3, 1, 1), (5,), (1,), (4, 5)])
def test_prelu_broadcasting_slopes_match_onnxruntime(slope_shape: tuple, tester: OpTester) -> None:
    x = RNG.standard_normal((2, 3, 4, 5)).astype(np.float32)
    slope = RNG.uniform(0.1, 0.5, slope_shape).astype(np.float32)
    node = helper.make_node("PRelu", ["x", "s"], ["y"])
    model = _model([node], {"x": x}, [("y", TensorProto.FLOAT)], 16, {"s": slope})
    _assert_same(_ours(tester, model, {"x": x}), _onnxruntime(model, {"x": x}))


def test_prelu_slope_that_fits_nowhere_is_a_clear_error(tester: OpTester) -> None:
    x = np.ones((2, 3, 4, 5), np.float32)
    node = helper.make_node("PRelu", ["x", "s"], ["y"], name="act")
    model = _model([node], {"x": x}, [("y", TensorProto.FLOAT)], 16, {"s": np.ones(7, np.float32)})
    with pytest.raises(KernelError, match="act.*slope \\[7\\] does not broadcast"):
        _ours(tester, model, {"x": x})


def test_prelu_slope_matching_both_channels_and_width_follows_the_opset(tester: OpTester) -> None:
    """Before opset 7 a 1-D slope is per channel; from 7 on it broadcasts like numpy."""
    x = RNG.standard_normal((2, 3, 4, 3)).astype(np.float32)
    slope = np.array([0.1, 0.2, 0.3], np.float32)
    node = helper.make_node("PRelu", ["x", "s"], ["y"])
    x64 = x.astype(np.float64)
    for opset, aligned in ((6, (1, 3, 1, 1)), (9, (3,))):
        model = _model([node], {"x": x}, [("y", TensorProto.FLOAT)], opset, {"s": slope})
        (got,) = _ours(tester, model, {"x": x})
        want = np.where(x64 >= 0, x64, x64 * slope.astype(np.float64).reshape(aligned))
        np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=f"opset {opset}")


# -- strings -----------------------------------------------------------------------------------

_WORDS = np.array(["Monday", "tuesday", "MONDAY", "Friday", "Wednesday"], dtype=object)


@pytest.mark.parametrize(
    ("attrs", "shape"),
    [
        ({"stopwords": ["monday"], "case_change_action": "UPPER"}, (5,)),
        ({"stopwords": ["monday"], "is_case_sensitive": 1, "case_change_action": "LOWER"}, (1, 5)),
        ({"stopwords": ["Monday", "tuesday", "MONDAY", "friday", "WEDNESDAY"]}, (1, 5)),
        ({"stopwords": ["TUESDAY", "friday"], "case_change_action": "LOWER"}, (5,)),
        ({"case_change_action": "NONE"}, (5,)),
    ],
)
def test_string_normalizer_matches_onnxruntime(attrs: dict, shape: tuple, tester: OpTester) -> None:
    x = _WORDS.reshape(shape)
    # onnxruntime's default en_US.UTF-8 locale may not be installed; "C" always is
    node = helper.make_node("StringNormalizer", ["x"], ["y"], locale="C", **attrs)
    model = _model([node], {"x": x}, [("y", TensorProto.STRING)], 10)
    _assert_same(_ours(tester, model, {"x": x}), _onnxruntime(model, {"x": x}))


def test_string_normalizer_refuses_unknown_case_action_and_3d_input(tester: OpTester) -> None:
    x = _WORDS.reshape(5)
    node = helper.make_node("StringNormalizer", ["x"], ["y"], case_change_action="TITLE")
    with pytest.raises(UnsupportedOpError, match="case_change_action='TITLE'"):
        tester.session_alone(_model([node], {"x": x}, [("y", TensorProto.STRING)], 10))
    x3 = _WORDS.reshape(1, 1, 5)
    node = helper.make_node("StringNormalizer", ["x"], ["y"])
    with pytest.raises(KernelError, match=r"\[C\] or \[1, C\]"):
        _ours(tester, _model([node], {"x": x3}, [("y", TensorProto.STRING)], 10), {"x": x3})


def test_string_split_and_concat_match_the_reference(tester: OpTester) -> None:
    x = np.array([["a,b,,c", ""], [",x", "no commas"]], dtype=object)
    nodes = [
        helper.make_node("StringSplit", ["x"], ["parts", "counts"], delimiter=",", maxsplit=2),
        helper.make_node("StringConcat", ["x", "suffix"], ["joined"]),
    ]
    suffix = np.array(["!"], dtype=object)
    model = _model(
        nodes,
        {"x": x, "suffix": suffix},
        [
            ("parts", TensorProto.STRING),
            ("counts", TensorProto.INT64),
            ("joined", TensorProto.STRING),
        ],
        20,
    )
    feeds = {"x": x, "suffix": suffix}
    _assert_same(_ours(tester, model, feeds), _reference(model, feeds))


# -- small classic ops against onnxruntime --------------------------------------------------


def _f32(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


_SMALL_CASES = [
    ("Hardmax", 11, {"axis": 1}, [_f32(2, 3, 4)], TensorProto.FLOAT),
    ("LRN", 13, {"size": 5, "alpha": 0.01, "beta": 0.6, "bias": 1.5}, [_f32(2, 6, 3, 3)], TensorProto.FLOAT),
    ("LpNormalization", 11, {"axis": 1, "p": 1}, [_f32(3, 5, 2)], TensorProto.FLOAT),
    ("Upsample", 9, {"mode": "linear"}, [_f32(1, 2, 3, 4), np.array([1, 1, 2, 3], np.float32)], TensorProto.FLOAT),
    ("Upsample", 7, {"mode": "nearest", "scales": [1.0, 1.0, 3.0, 2.0]}, [_f32(1, 2, 3, 4)], TensorProto.FLOAT),
    ("Shrink", 9, {"lambd": 0.3, "bias": 0.1}, [_f32(4, 5)], TensorProto.FLOAT),
    ("MeanVarianceNormalization", 13, {"axes": [1, 2]}, [_f32(2, 3, 4, 2)], TensorProto.FLOAT),
]  # fmt: skip


@pytest.mark.parametrize(("op", "opset", "attrs", "inputs", "out_type"), _SMALL_CASES)
def test_small_classic_op_matches_onnxruntime(
    op, opset, attrs, inputs, out_type, tester: OpTester
) -> None:
    names = [f"in{i}" for i in range(len(inputs))]
    node = helper.make_node(op, names, ["y"], **attrs)
    feeds = dict(zip(names, inputs, strict=True))
    model = _model([node], feeds, [("y", out_type)], opset)
    _assert_same(_ours(tester, model, feeds), _onnxruntime(model, feeds), tol=1e-5)


def test_qlinear_conv_per_channel_matches_onnxruntime(tester: OpTester) -> None:
    x = RNG.integers(0, 255, (1, 3, 7, 6)).astype(np.uint8)
    w = RNG.integers(-60, 60, (4, 3, 3, 3)).astype(np.int8)
    inits = {
        "xs": np.array(0.02, np.float32), "xz": np.array(120, np.uint8),
        "w": w, "ws": RNG.uniform(0.01, 0.05, 4).astype(np.float32),
        "wz": np.zeros(4, np.int8), "ys": np.array(0.5, np.float32),
        "yz": np.array(100, np.uint8), "b": RNG.integers(-500, 500, 4).astype(np.int32),
    }  # fmt: skip
    node = helper.make_node(
        "QLinearConv", ["x", "xs", "xz", "w", "ws", "wz", "ys", "yz", "b"], ["y"],
        pads=[1, 0, 1, 1], strides=[2, 1],
    )  # fmt: skip
    model = _model([node], {"x": x}, [("y", TensorProto.UINT8)], 13, inits)
    (got,) = _ours(tester, model, {"x": x})
    (want,) = _onnxruntime(model, {"x": x})
    assert got.dtype == want.dtype and got.shape == want.shape
    # onnxruntime requantizes in float32; allow one step where it rounds a tie the other way
    assert np.abs(got.astype(int) - want.astype(int)).max() <= 1
    assert np.mean(got == want) > 0.95


def test_max_unpool_inverts_max_pool_indices(tester: OpTester) -> None:
    x = _f32(2, 3, 6, 8)
    pool = helper.make_node("MaxPool", ["x"], ["p", "i"], kernel_shape=[2, 2], strides=[2, 2])
    unpool = helper.make_node("MaxUnpool", ["p", "i"], ["y"], kernel_shape=[2, 2], strides=[2, 2])
    model = _model([pool, unpool], {"x": x}, [("y", TensorProto.FLOAT)], 11)
    (got,) = _ours(tester, model, {"x": x})
    win = x.reshape(2, 3, 3, 2, 4, 2)
    is_max = win == win.max(axis=(3, 5), keepdims=True)
    np.testing.assert_array_equal(got, np.where(is_max, win, 0).reshape(x.shape))


def test_lrn_even_size_window_follows_the_spec_formula(tester: OpTester) -> None:
    """An even window reaches floor((size-1)/2) channels before and ceil((size-1)/2) after
    (onnxruntime refuses even sizes, so the spec's sum is written out here in float64)."""
    x = _f32(2, 6, 2, 3)
    size, alpha, beta, bias = 4, 0.5, 0.7, 1.0
    node = helper.make_node("LRN", ["x"], ["y"], size=size, alpha=alpha, beta=beta, bias=bias)
    (got,) = _ours(tester, _model([node], {"x": x}, [("y", TensorProto.FLOAT)], 13), {"x": x})
    sq = x.astype(np.float64) ** 2
    want = np.empty_like(sq)
    for c in range(6):
        lo, hi = max(0, c - (size - 1) // 2), min(5, c + -(-(size - 1) // 2))
        want[:, c] = x[:, c] / (bias + alpha / size * sq[:, lo : hi + 1].sum(axis=1)) ** beta
    np.testing.assert_allclose(got, want, rtol=1e-5)


# -- recurrent layers --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("op", "attrs"),
    [
        ("RNN", {"direction": "bidirectional", "activations": ["Relu", "Tanh"]}),
        ("GRU", {"direction": "reverse", "linear_before_reset": 1, "clip": 0.8}),
        ("GRU", {"direction": "bidirectional", "layout": 1}),
        ("LSTM", {"direction": "bidirectional", "clip": 1.5}),
        ("LSTM", {"direction": "reverse", "layout": 1, "input_forget": 1}),
    ],
)
def test_recurrent_layer_matches_onnxruntime(op: str, attrs: dict, tester: OpTester) -> None:
    gates = {"RNN": 1, "GRU": 3, "LSTM": 4}[op]
    dirs = 2 if attrs["direction"] == "bidirectional" else 1
    seq, batch, size, hidden = 5, 3, 4, 6
    layout = attrs.get("layout", 0)
    x = _f32(batch, seq, size) if layout else _f32(seq, batch, size)
    state = (batch, dirs, hidden) if layout else (dirs, batch, hidden)
    inits = {
        "w": _f32(dirs, gates * hidden, size) * 0.5,
        "r": _f32(dirs, gates * hidden, hidden) * 0.5,
        "b": _f32(dirs, 2 * gates * hidden) * 0.5,
        "lens": np.array([5, 2, 4], np.int32),
        "h0": _f32(*state),
    }
    names = ["x", "w", "r", "b", "lens", "h0"]
    outs = ["y", "yh"]
    if op == "LSTM":
        inits["c0"] = _f32(*state)
        inits["p"] = _f32(dirs, 3 * hidden) * 0.5
        names += ["c0", "p"]
        outs.append("yc")
    node = helper.make_node(op, names, outs, hidden_size=hidden, **attrs)
    model = _model([node], {"x": x}, [(o, TensorProto.FLOAT) for o in outs], 14, inits)
    # onnxruntime refuses layout=1; the batch-major form is checked against its transpose
    if layout:
        want = _onnxruntime(_time_major(model), {"x": np.swapaxes(x, 0, 1)})
        want = [np.transpose(want[0], (2, 0, 1, 3)), *(np.swapaxes(w, 0, 1) for w in want[1:])]
    else:
        want = _onnxruntime(model, {"x": x})
    _assert_same(_ours(tester, model, {"x": x}), want, tol=1e-5)


def _time_major(model: onnx.ModelProto) -> onnx.ModelProto:
    """The layout=1 recurrent model as layout=0, its initial states transposed to match."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    node = out.graph.node[0]
    for a in node.attribute:
        if a.name == "layout":
            a.i = 0
    dims = out.graph.input[0].type.tensor_type.shape.dim
    first, second = dims[0].dim_value, dims[1].dim_value
    dims[0].dim_value, dims[1].dim_value = second, first
    for init in out.graph.initializer:
        if init.name in ("h0", "c0"):
            init.CopyFrom(
                onnx.numpy_helper.from_array(
                    np.swapaxes(onnx.numpy_helper.to_array(init), 0, 1).copy(), init.name
                )
            )
    return out


# -- spectral ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "axis", "length", "attrs"),
    [((2, 9, 3, 1), 1, 12, {"onesided": 1}), ((2, 4, 7, 2), -2, 5, {"inverse": 1}),
     ((3, 8, 2), 1, 8, {})],
)  # fmt: skip
def test_dft_matches_onnxruntime(
    shape: tuple, axis: int, length: int, attrs: dict, tester: OpTester
) -> None:
    x = _f32(*shape)
    inits = {"n": np.array(length, np.int64), "axis": np.array(axis, np.int64)}
    node = helper.make_node("DFT", ["x", "n", "axis"], ["y"], **attrs)
    model = _model([node], {"x": x}, [("y", TensorProto.FLOAT)], 20, inits)
    _assert_same(_ours(tester, model, {"x": x}), _onnxruntime(model, {"x": x}), tol=1e-4)


# -- sampling ----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["bilinear", "nearest", "bicubic"])
@pytest.mark.parametrize("padding", ["zeros", "border", "reflection"])
@pytest.mark.parametrize("align", [0, 1])
def test_grid_sample_matches_onnxruntime(
    mode: str, padding: str, align: int, tester: OpTester
) -> None:
    x = _f32(2, 3, 5, 7)
    grid = RNG.uniform(-1.6, 1.6, (2, 4, 6, 2)).astype(np.float32)
    node = helper.make_node(
        "GridSample", ["x", "g"], ["y"], mode=mode, padding_mode=padding, align_corners=align
    )
    model = _model([node], {"x": x, "g": grid}, [("y", TensorProto.FLOAT)], 16)
    feeds = {"x": x, "g": grid}
    _assert_same(_ours(tester, model, feeds), _onnxruntime(model, feeds), tol=1e-4)


# -- sequence mixers ---------------------------------------------------------------------------


@pytest.mark.parametrize("rule", ["linear", "gated", "delta", "gated_delta"])
def test_linear_attention_unequal_head_sizes_match_the_reference(
    rule: str, tester: OpTester
) -> None:
    """Key and value head sizes differ here (4 and 6), unlike in ONNX's node tests."""
    b, t, hq, hkv, dk, dv = 2, 5, 4, 2, 4, 6
    feeds = {
        "q": _f32(b, t, hq * dk) * 0.5,
        "k": _f32(b, t, hkv * dk) * 0.5,
        "v": _f32(b, t, hkv * dv),
        "past": _f32(b, hkv, dk, dv) * 0.1,
    }
    names = ["q", "k", "v", "past", "", ""]
    if rule in ("gated", "gated_delta"):
        feeds["decay"] = -RNG.uniform(0.0, 0.5, (b, t, hkv * dk)).astype(np.float32)
        names[4] = "decay"
    if rule in ("delta", "gated_delta"):
        feeds["beta"] = RNG.uniform(0.0, 1.0, (b, t, hkv)).astype(np.float32)
        names[5] = "beta"
    while not names[-1]:
        names.pop()
    node = helper.make_node(
        "LinearAttention", names, ["o", "s"], q_num_heads=hq, kv_num_heads=hkv, update_rule=rule
    )
    model = _model([node], feeds, [("o", TensorProto.FLOAT), ("s", TensorProto.FLOAT)], 27)
    _assert_same(_ours(tester, model, feeds), _reference(model, feeds), tol=1e-5)


def test_causal_conv_decode_continues_the_prefill(tester: OpTester) -> None:
    """Prefill of L tokens, then one decode step from present_state, equals L + 1 at once."""
    x = _f32(2, 3, 9)
    w, bias = _f32(3, 1, 4), _f32(3)
    whole = helper.make_node("CausalConvWithState", ["x", "w", "b"], ["y", "s"], activation="silu")
    model = _model([whole], {"x": x}, [("y", TensorProto.FLOAT), ("s", TensorProto.FLOAT)], 27,
                   {"w": w, "b": bias})  # fmt: skip
    y_all, s_all = _ours(tester, model, {"x": x})
    prefix = {"x": np.ascontiguousarray(x[:, :, :8])}
    pre_model = _model([whole], prefix, [("y", TensorProto.FLOAT), ("s", TensorProto.FLOAT)], 27,
                       {"w": w, "b": bias})  # fmt: skip
    y_pre, s_pre = _ours(tester, pre_model, prefix)
    step = helper.make_node(
        "CausalConvWithState", ["x", "w", "b", "p"], ["y", "s"], activation="silu"
    )
    inputs = {"x": np.ascontiguousarray(x[:, :, 8:]), "p": s_pre}
    step_model = _model([step], inputs, [("y", TensorProto.FLOAT), ("s", TensorProto.FLOAT)],
                        27, {"w": w, "b": bias})  # fmt: skip
    y_step, s_step = _ours(tester, step_model, inputs)
    np.testing.assert_allclose(np.concatenate([y_pre, y_step], axis=2), y_all, rtol=1e-6)
    np.testing.assert_allclose(s_step, s_all, rtol=1e-6)
    np.testing.assert_array_equal(s_all, x[:, :, -3:])


# -- detection and text features ---------------------------------------------------------------


@pytest.mark.parametrize("center", [0, 1])
def test_non_max_suppression_matches_onnxruntime(center: int, tester: OpTester) -> None:
    corner = RNG.uniform(0, 10, (2, 40, 2))
    size = RNG.uniform(1, 4, (2, 40, 2))
    boxes = np.concatenate([corner, corner + size], axis=-1).astype(np.float32)
    if center:
        boxes = np.concatenate([corner + size / 2, size], axis=-1)[..., [1, 0, 3, 2]]
        boxes = boxes.astype(np.float32)
    scores = RNG.uniform(0, 1, (2, 3, 40)).astype(np.float32)
    inits = {"k": np.array([7], np.int64), "iou": np.array([0.3], np.float32),
             "min": np.array([0.2], np.float32)}  # fmt: skip
    node = helper.make_node(
        "NonMaxSuppression", ["b", "s", "k", "iou", "min"], ["sel"], center_point_box=center
    )
    feeds = {"b": boxes, "s": scores}
    model = _model([node], feeds, [("sel", TensorProto.INT64)], 11, inits)
    _assert_same(_ours(tester, model, feeds), _onnxruntime(model, feeds))


@pytest.mark.parametrize("mode", ["TF", "IDF", "TFIDF"])
def test_tfidf_trigrams_with_skips_match_onnxruntime(mode: str, tester: OpTester) -> None:
    x = RNG.integers(0, 5, (3, 14)).astype(np.int64)
    pool = [0, 1, 2, 3, 0, 1, 2, 2, 4, 1, 1, 0, 0, 2, 3, 1, 0, 0, 0]
    node = helper.make_node(
        "TfIdfVectorizer", ["x"], ["y"], mode=mode, min_gram_length=1, max_gram_length=3,
        max_skip_count=2, ngram_counts=[0, 4, 10], ngram_indexes=[6, 5, 4, 3, 2, 1, 0, 7, 8, 9],
        pool_int64s=pool, weights=[0.5, 1.5, 2.0, 1.0, 0.25, 3.0, 1.0, 0.75, 2.5, 1.25],
    )  # fmt: skip
    model = _model([node], {"x": x}, [("y", TensorProto.FLOAT)], 11)
    _assert_same(_ours(tester, model, {"x": x}), _onnxruntime(model, {"x": x}))


@pytest.mark.parametrize(
    ("opset", "attrs"),
    [(10, {"mode": "avg", "sampling_ratio": 0}), (16, {"mode": "avg", "sampling_ratio": 2}),
     (16, {"mode": "max", "sampling_ratio": 0, "coordinate_transformation_mode": "output_half_pixel"}),
     (16, {"mode": "avg", "spatial_scale": 0.5})],
)  # fmt: skip
def test_roi_align_matches_onnxruntime(opset: int, attrs: dict, tester: OpTester) -> None:
    x = _f32(2, 3, 10, 12)
    rois = np.array(
        [[0, 0, 9, 9], [2.5, 1.2, 7.7, 8.1], [-2, -1, 4, 3], [6, 5, 14, 12], [3, 3, 3.5, 4]],
        np.float32,
    )
    batch = np.array([0, 1, 1, 0, 1], np.int64)
    node = helper.make_node(
        "RoiAlign", ["x", "rois", "b"], ["y"], output_height=3, output_width=4, **attrs
    )
    feeds = {"x": x, "rois": rois, "b": batch}
    model = _model([node], feeds, [("y", TensorProto.FLOAT)], opset)
    _assert_same(_ours(tester, model, feeds), _onnxruntime(model, feeds), tol=1e-5)


@pytest.mark.parametrize("op", ["Adam", "Adagrad", "Momentum"])
def test_optimizer_step_after_the_first_matches_the_reference(op: str, tester: OpTester) -> None:
    """T > 0: Adam's bias correction and Momentum's beta apply (node tests use T = 0)."""
    groups = {"Adam": 4, "Adagrad": 3, "Momentum": 3}[op]
    tensors = {
        f"t{g}_{i}": _f32(*shape) for g in range(groups) for i, shape in enumerate([(3,), (2, 2)])
    }
    for name in tensors:
        if name.startswith(("t3_", "t2_")) and op != "Momentum":
            tensors[name] = np.abs(tensors[name])  # accumulated squares are >= 0
    attrs = {
        "Adam": {"alpha": 0.9, "beta": 0.99, "epsilon": 1e-3, "norm_coefficient": 0.01},
        "Adagrad": {"decay_factor": 0.1, "epsilon": 1e-3, "norm_coefficient": 0.01},
        "Momentum": {"alpha": 0.9, "beta": 0.5, "mode": "standard", "norm_coefficient": 0.01},
    }[op]
    feeds = {"r": np.array(0.1, np.float32), "t": np.array(3, np.int64), **tensors}
    outs = [f"o{k}" for k in range((groups - 1) * 2)]
    node = helper.make_node(op, list(feeds), outs, domain="ai.onnx.preview.training", **attrs)
    graph = helper.make_graph(
        [node], "g",
        [helper.make_tensor_value_info(n, _TYPES[a.dtype], a.shape) for n, a in feeds.items()],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outs],
    )  # fmt: skip
    model = helper.make_model(
        graph,
        opset_imports=[
            helper.make_opsetid("", 17),
            helper.make_opsetid("ai.onnx.preview.training", 1),
        ],
    )
    _assert_same(_ours(tester, model, feeds), _reference(model, feeds), tol=1e-5)


def test_deform_conv_groups_strides_mask_match_the_reference(tester: OpTester) -> None:
    x = _f32(2, 4, 7, 6)
    w = _f32(6, 2, 3, 2)
    attrs = {"group": 2, "offset_group": 2, "strides": [2, 1], "dilations": [1, 2],
             "pads": [1, 2, 0, 1], "kernel_shape": [3, 2]}  # fmt: skip
    out_h, out_w = (7 + 1 - 3) // 2 + 1, (6 + 3 - 3) // 1 + 1
    offset = (_f32(2, 2 * 2 * 6, out_h, out_w) * 1.5).astype(np.float32)
    mask = RNG.uniform(0, 1, (2, 2 * 6, out_h, out_w)).astype(np.float32)
    bias = _f32(6)
    node = helper.make_node("DeformConv", ["x", "w", "off", "b", "m"], ["y"], **attrs)
    feeds = {"x": x, "w": w, "off": offset, "b": bias, "m": mask}
    model = _model([node], feeds, [("y", TensorProto.FLOAT)], 19)
    _assert_same(_ours(tester, model, feeds), _reference(model, feeds), tol=1e-4)
