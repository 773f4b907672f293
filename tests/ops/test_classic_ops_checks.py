"""Boundaries of the pooling, ConvTranspose, opset-6 broadcast and PRelu rules
(``core.op_rules``) that tests/ops/test_classic_ops.py left open (found by a mutation run):
each against onnxruntime or ONNX's reference evaluator, or a refusal that onnxruntime makes
too, checked beside ours."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper

from onnx_genrt.core.errors import KernelError, UnsupportedOpError

from .op_tester import OpTester
from .test_classic_ops import _assert_same, _model, _onnxruntime, _ours, _reference

RNG = np.random.default_rng(4321)
FLOAT = TensorProto.FLOAT


def _onnxruntime_refuses(model, feeds: dict[str, np.ndarray]) -> None:
    with pytest.raises(Exception):  # noqa: B017 (onnxruntime's own exception types)
        _onnxruntime(model, feeds)


def _onnxruntime_refuses_in_child(model, tmp_path: Path) -> None:
    """onnxruntime does not load ``model``, asked in a child process: onnxruntime 1.30 dies
    of a floating-point exception on some refusals (ConvTranspose group=0) that 1.32 reports
    as an error. Either way it never accepts the model."""
    path = tmp_path / "model.onnx"
    path.write_bytes(model.SerializeToString())
    code = (
        "import sys, onnxruntime as ort\n"
        "ort.InferenceSession(sys.argv[1], providers=['CPUExecutionProvider'])\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, timeout=120)
    assert done.returncode != 0, "onnxruntime loaded a model it should refuse"


# -- pooling -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("attrs", "message"),
    [
        ({"kernel_shape": [2, 2], "strides": [2]}, r"strides has 1 values, expected 2"),
        ({"kernel_shape": [2, 2], "dilations": [1, 1, 1]}, r"dilations has 3 values, expected 2"),
        ({"kernel_shape": [2, 2], "pads": [1, 1]}, r"pads has 2 values, expected 4"),
        ({"kernel_shape": [2, 2], "strides": [0, 1]}, r"strides and dilations must be >= 1"),
        ({"kernel_shape": [0, 2]}, r"kernel_shape, strides and dilations must be >= 1"),
        ({"kernel_shape": [2, 2], "dilations": [1, 0]}, r"dilations must be >= 1"),
        ({"kernel_shape": [2, 2], "pads": [0, 0, 0, -1]}, r"negative pads \[0, 0, 0, -1\]"),
        ({"kernel_shape": [2, 2], "pads": [-1, 0, 0, 0]}, r"negative pads"),
    ],
)
def test_pool_geometry_refusals_name_the_node_and_attribute(
    attrs: dict, message: str, tester: OpTester
) -> None:
    """Every one of these onnxruntime refuses as well."""
    x = RNG.standard_normal((1, 2, 5, 5)).astype(np.float32)
    node = helper.make_node("MaxPool", ["x"], ["y"], name="pool7", **attrs)
    model = _model([node], {"x": x}, [("y", FLOAT)], 12)
    _onnxruntime_refuses(model, {"x": x})
    with pytest.raises(KernelError, match=f"pool7.*{message}"):
        _ours(tester, model, {"x": x})


@pytest.mark.parametrize(
    ("attrs", "message"),
    [
        ({"kernel_shape": [6, 2]}, r"window of 6 does not fit axis 0 of size 5 padded by \(0, 0\)"),
        ({"kernel_shape": [2, 7], "pads": [0, 1, 0, 0]}, r"window of 7 does not fit axis 1"),
        ({"kernel_shape": [2, 6], "auto_pad": "VALID"}, r"window of 6 does not fit axis 1 of size 5"),
        ({"kernel_shape": [2, 3], "dilations": [1, 3], "auto_pad": "VALID"}, r"window of 7 does not"),
    ],
)  # fmt: skip
def test_pool_window_wider_than_the_padded_axis_is_refused(
    attrs: dict, message: str, tester: OpTester
) -> None:
    """The runtimes disagree here: onnxruntime gives an empty axis (or, at stride 2, one
    window that runs past the input), ONNX's reference evaluator an empty axis or an error;
    onnx-genrt refuses, naming the window and the axis."""
    x = RNG.standard_normal((1, 2, 5, 5)).astype(np.float32)
    node = helper.make_node("AveragePool", ["x"], ["y"], name="pool7", **attrs)
    model = _model([node], {"x": x}, [("y", FLOAT)], 19)
    with pytest.raises(KernelError, match=f"pool7.*{message}"):
        _ours(tester, model, {"x": x})


@pytest.mark.parametrize("auto_pad", ["NOTSET", "SAME_UPPER", "VALID"])
def test_pool_over_an_empty_axis_is_refused(auto_pad: str, tester: OpTester) -> None:
    x = np.zeros((1, 2, 0, 4), np.float32)
    node = helper.make_node(
        "AveragePool", ["x"], ["y"], name="pool0", kernel_shape=[1, 2], auto_pad=auto_pad
    )
    model = _model([node], {"x": x}, [("y", FLOAT)], 19)
    _onnxruntime_refuses(model, {"x": x})
    with pytest.raises(KernelError, match=r"pool0.*spatial shape \[0, 4\]; pooling needs"):
        _ours(tester, model, {"x": x})


@pytest.mark.parametrize(
    ("op", "attrs", "message"),
    [
        ("MaxPool", {"storage_order": 2}, "storage_order=2 must be 0 or 1"),
        ("LpPool", {"p": 0}, "p=0 must be >= 1"),
    ],
)
def test_pool_attribute_refusals_when_loading(
    op: str, attrs: dict, message: str, tester: OpTester
) -> None:
    """onnxruntime refuses storage_order=2; LpPool with p=0 it runs, but the op's 1/p has no
    value there (ONNX's reference evaluator divides by zero), so ours refuses it."""
    x = np.ones((1, 1, 4, 4), np.float32)
    node = helper.make_node(op, ["x"], ["y"], kernel_shape=[2, 2], **attrs)
    model = _model([node], {"x": x}, [("y", FLOAT)], 12)
    if op == "MaxPool":
        _onnxruntime_refuses(model, {"x": x})
    else:
        with pytest.raises(ZeroDivisionError):
            _reference(model, {"x": x})
    with pytest.raises(UnsupportedOpError, match=message):
        tester.session_alone(model)


_POOL_EDGE_CASES = [
    # p = 1, the smallest LpPool takes
    ("LpPool", (1, 2, 6, 5), {"kernel_shape": [3, 2], "p": 1, "strides": [2, 1]}),
    # SAME padding that needs no pad at all (total 0)
    ("MaxPool", (1, 2, 6, 8), {"kernel_shape": [2, 2], "strides": [2, 2], "auto_pad": "SAME_LOWER"}),
    ("AveragePool", (1, 2, 6, 8), {"kernel_shape": [2, 2], "strides": [2, 2], "auto_pad": "SAME_LOWER"}),
    # ceil_mode: the last window runs past the end pad (onto the extension), with pads that
    # differ between the ends and between the axes
    ("MaxPool", (1, 2, 7, 7), {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 0, 0, 1], "ceil_mode": 1}),
    ("AveragePool", (1, 2, 7, 7), {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 0, 0, 1], "ceil_mode": 1, "count_include_pad": 1}),
    ("MaxPool", (1, 2, 7, 8), {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 0, 1, 0], "ceil_mode": 1}),
    # VALID: windows that fit, strides that do and do not divide what is left
    ("MaxPool", (1, 2, 6, 7), {"kernel_shape": [3, 3], "strides": [2, 2], "auto_pad": "VALID"}),
    ("AveragePool", (1, 2, 6, 7), {"kernel_shape": [3, 2], "strides": [2, 3], "auto_pad": "VALID"}),
    # a window exactly as wide as the padded axis
    ("MaxPool", (1, 2, 5, 5), {"kernel_shape": [7, 2], "pads": [1, 0, 1, 0]}),
    ("AveragePool", (1, 2, 5, 5), {"kernel_shape": [5, 5], "auto_pad": "VALID"}),
]  # fmt: skip


@pytest.mark.parametrize(("op", "shape", "attrs"), _POOL_EDGE_CASES)
def test_pool_edges_match_onnxruntime(
    op: str, shape: tuple[int, ...], attrs: dict, tester: OpTester
) -> None:
    x = RNG.standard_normal(shape).astype(np.float32)
    opset = 18 if op == "LpPool" else 19
    model = _model([helper.make_node(op, ["x"], ["y"], **attrs)], {"x": x}, [("y", FLOAT)], opset)
    _assert_same(_ours(tester, model, {"x": x}), _onnxruntime(model, {"x": x}))


@pytest.mark.parametrize("op", ["MaxPool", "AveragePool"])
@pytest.mark.parametrize("auto_pad", ["SAME_UPPER", "SAME_LOWER"])
def test_pool_same_with_strides_past_the_kernel_pads_nothing(
    op: str, auto_pad: str, tester: OpTester
) -> None:
    """SAME where the strides pass the kernel: the pad formula's total is -1 and -2 here, and
    no pad is added (as TensorFlow's SAME, where the mode comes from, clamps it at 0). The
    references disagree: onnxruntime fails on MaxPool ("padding values must be non-negative")
    and shifts SAME_UPPER AveragePool windows by the negative pad, ONNX's reference evaluator
    fails on AveragePool and gives SAME_LOWER MaxPool one row too few; the windows are taken
    with numpy."""
    x = RNG.standard_normal((1, 2, 5, 8)).astype(np.float32)
    attrs = {"kernel_shape": [1, 2], "strides": [3, 4], "auto_pad": auto_pad}
    model = _model([helper.make_node(op, ["x"], ["y"], **attrs)], {"x": x}, [("y", FLOAT)], 19)
    (got,) = _ours(tester, model, {"x": x})
    pairs = np.stack([x[:, :, ::3, 0::4], x[:, :, ::3, 1::4]]).astype(np.float64)
    want = pairs.max(axis=0) if op == "MaxPool" else pairs.mean(axis=0)
    assert got.shape == want.shape == (1, 2, 2, 2)
    np.testing.assert_allclose(got, want, rtol=1e-6)


# -- ConvTranspose ---------------------------------------------------------------------------


def _conv_transpose(attrs: dict, w_shape: tuple[int, ...] = (1, 1, 3, 3)):
    x = RNG.standard_normal((1, w_shape[0], 6, 6)).astype(np.float32)
    w = RNG.standard_normal(w_shape).astype(np.float32)
    node = helper.make_node("ConvTranspose", ["x", "w"], ["y"], name="up1", **attrs)
    return _model([node], {"x": x}, [("y", FLOAT)], 17, {"w": w}), {"x": x}


@pytest.mark.parametrize(
    ("attrs", "message"),
    [
        ({"kernel_shape": [2, 2]}, r"kernel_shape \[2, 2\] does not match the weight's spatial"),
        ({"output_shape": [9]}, r"output_shape \[9\] needs 2 spatial sizes"),
        ({"strides": [2, 2, 2]}, r"strides has 3 values, expected 2"),
        ({"output_padding": [0, -1], "strides": [2, 2]}, r"output_padding\[1\]=-1 must be >= 0"),
        ({"pads": [4, 0, 5, 0]}, r"leave a negative output size"),
    ],
)
def test_conv_transpose_refusals_name_the_node_and_attribute(
    attrs: dict, message: str, tester: OpTester
) -> None:
    model, feeds = _conv_transpose(attrs)
    _onnxruntime_refuses(model, feeds)
    with pytest.raises(KernelError, match=f"up1.*{message}"):
        _ours(tester, model, feeds)


def test_conv_transpose_group_zero_is_refused_when_loading(tester: OpTester, tmp_path) -> None:
    model, _ = _conv_transpose({"group": 0}, (2, 1, 3, 3))
    _onnxruntime_refuses_in_child(model, tmp_path)
    with pytest.raises(UnsupportedOpError, match="group=0 must be >= 1"):
        tester.session_alone(model)


def test_conv_transpose_pads_that_leave_nothing_give_the_empty_result(tester: OpTester) -> None:
    """Pads of exactly the full length: ONNX's reference evaluator gives an empty axis
    (onnxruntime refuses any output size below 1); one pad more is refused (above)."""
    model, feeds = _conv_transpose({"pads": [4, 0, 4, 0]})
    (got,) = _ours(tester, model, feeds)
    (want,) = _reference(model, feeds)
    assert got.shape == want.shape == (1, 1, 0, 8)
    assert got.dtype == want.dtype


@pytest.mark.parametrize(
    "attrs",
    [
        {"auto_pad": "SAME_UPPER"},
        {"auto_pad": "SAME_LOWER"},
        {"output_shape": [3, 4], "auto_pad": "SAME_UPPER"},
        {"output_shape": [5, 4], "auto_pad": "SAME_LOWER"},
        {"output_shape": [7, 4]},
        {"auto_pad": "VALID", "strides": [2, 1]},
    ],
)
def test_conv_transpose_padding_split_matches_onnxruntime(attrs: dict, tester: OpTester) -> None:
    """Totals of 2 to 5 to take off (a 5x3 kernel at stride 1): the split between the two
    ends, odd unit where auto_pad puts it."""
    x = RNG.standard_normal((1, 2, 4, 5)).astype(np.float32)
    w = RNG.standard_normal((2, 3, 5, 3)).astype(np.float32)
    node = helper.make_node("ConvTranspose", ["x", "w"], ["y"], **attrs)
    model = _model([node], {"x": x}, [("y", FLOAT)], 17, {"w": w})
    _assert_same(_ours(tester, model, {"x": x}), _onnxruntime(model, {"x": x}), tol=1e-4)


# -- opset 1-6 broadcasting and PRelu ----------------------------------------------------------


@pytest.mark.parametrize(("b_shape", "axis", "aligned"), [((5,), -1, (5,)), ((4, 5), -2, (4, 5))])
def test_opset6_negative_axis_counts_from_the_end(
    b_shape: tuple, axis: int, aligned: tuple, tester: OpTester
) -> None:
    a = RNG.uniform(0.5, 2.0, (2, 3, 4, 5)).astype(np.float32)
    b = RNG.uniform(0.5, 2.0, b_shape).astype(np.float32)
    node = helper.make_node("Sub", ["a", "b"], ["y"], broadcast=1, axis=axis)
    model = _model([node], {"a": a, "b": b}, [("y", FLOAT)], 6)
    (got,) = _ours(tester, model, {"a": a, "b": b})
    want = a.astype(np.float64) - b.astype(np.float64).reshape(aligned)
    assert got.shape == a.shape
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_opset6_axis_past_the_front_is_refused(tester: OpTester) -> None:
    """axis -4 against a rank-3 A counts from before A's first dim, even where B would fit
    A's last dim from there."""
    a, b = np.ones((2, 3, 5), np.float32), np.ones((5,), np.float32)
    node = helper.make_node("Add", ["a", "b"], ["y"], name="bias_add", broadcast=1, axis=-4)
    model = _model([node], {"a": a, "b": b}, [("y", FLOAT)], 6)
    with pytest.raises(KernelError, match=r"bias_add.*B \[5\] does not fit A \[2, 3, 5\]"):
        _ours(tester, model, {"a": a, "b": b})


@pytest.mark.parametrize("slope_shape", [(5,), (1,)])
def test_prelu_on_a_vector_matches_onnxruntime(slope_shape: tuple, tester: OpTester) -> None:
    x = RNG.standard_normal((5,)).astype(np.float32)
    slope = RNG.uniform(0.1, 0.5, slope_shape).astype(np.float32)
    node = helper.make_node("PRelu", ["x", "s"], ["y"])
    model = _model([node], {"x": x}, [("y", FLOAT)], 16, {"s": slope})
    _assert_same(_ours(tester, model, {"x": x}), _onnxruntime(model, {"x": x}))


@pytest.mark.parametrize(
    ("x_shape", "hint"),
    [((2, 3, 4, 5), "give one slope, a per-channel slope of 3 values or"), ((4, 3), "of 3 values"),
     ((5,), "give one slope or a shape")],
)  # fmt: skip
def test_prelu_refusal_names_the_channel_count(x_shape: tuple, hint: str, tester: OpTester) -> None:
    x = np.ones(x_shape, np.float32)
    node = helper.make_node("PRelu", ["x", "s"], ["y"], name="act")
    model = _model([node], {"x": x}, [("y", FLOAT)], 16, {"s": np.ones(7, np.float32)})
    _onnxruntime_refuses(model, {"x": x})
    with pytest.raises(KernelError, match=f"act.*slope \\[7\\] does not broadcast.*{hint}"):
        _ours(tester, model, {"x": x})


@pytest.mark.parametrize("opset", [6, 16])
def test_prelu_per_channel_slope_of_two_channels(opset: int, tester: OpTester) -> None:
    """Two channels, width 5: per channel at every opset (numpy could not broadcast [2])."""
    x = RNG.standard_normal((2, 2, 3, 5)).astype(np.float32)
    slope = np.array([0.1, 0.4], np.float32)
    node = helper.make_node("PRelu", ["x", "s"], ["y"])
    model = _model([node], {"x": x}, [("y", FLOAT)], opset, {"s": slope})
    (got,) = _ours(tester, model, {"x": x})
    x64 = x.astype(np.float64)
    want = np.where(x64 >= 0, x64, x64 * slope.astype(np.float64).reshape(1, 2, 1, 1))
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_prelu_at_opset_7_broadcasts_like_numpy(tester: OpTester) -> None:
    """Opset 7 is the first whose 1-D slope broadcasts against the last axis (3 channels,
    width 3: the two readings differ)."""
    x = RNG.standard_normal((2, 3, 4, 3)).astype(np.float32)
    slope = np.array([0.1, 0.2, 0.3], np.float32)
    node = helper.make_node("PRelu", ["x", "s"], ["y"])
    model = _model([node], {"x": x}, [("y", FLOAT)], 7, {"s": slope})
    _assert_same(_ours(tester, model, {"x": x}), _onnxruntime(model, {"x": x}))
