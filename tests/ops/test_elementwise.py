"""Elementwise kernels on every provider: ONNX backend node cases plus float16/bfloat16
checks against numpy float64."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from .op_tester import OpTester, run_case_node, run_case_on, single_node_cases

ELEMENTWISE_OPS = [
    "Abs",
    "Neg",
    "Reciprocal",
    "Floor",
    "Ceil",
    "Round",
    "Sqrt",
    "Exp",
    "Log",
    "Sin",
    "Cos",
    "Tan",
    "Asin",
    "Acos",
    "Atan",
    "Sinh",
    "Cosh",
    "Tanh",
    "Asinh",
    "Acosh",
    "Atanh",
    "Erf",
    "Sign",
    "IsNaN",
    "IsInf",
    "Not",
    "Relu",
    "LeakyRelu",
    "Elu",
    "Selu",
    "Celu",
    "Sigmoid",
    "HardSigmoid",
    "HardSwish",
    "Softplus",
    "Softsign",
    "Mish",
    "Gelu",
    "ThresholdedRelu",
    "PRelu",
    "Swish",
    "Add",
    "Sub",
    "Mul",
    "Div",
    "Pow",
    "Mod",
    "BitShift",
    "BitwiseAnd",
    "BitwiseOr",
    "BitwiseXor",
    "BitwiseNot",
    "And",
    "Or",
    "Xor",
    "Equal",
    "Less",
    "LessOrEqual",
    "Greater",
    "GreaterOrEqual",
    "Max",
    "Min",
    "Sum",
    "Mean",
    "Cast",
    "CastLike",
    "Where",
    "Clip",
    "Identity",
    "Dropout",
    "Constant",
]

_TRAINING = (
    "Dropout in training mode with ratio > 0 is random; the kernel raises NotImplementedError"
)
XFAIL: dict[str, str] = {
    "test_training_dropout": _TRAINING,
    "test_training_dropout_default": _TRAINING,
    "test_training_dropout_default_mask": _TRAINING,
    "test_training_dropout_mask": _TRAINING,
}


def _to_numpy(v: Any) -> Any:
    """Backend-case data as the runtime passes it: ndarrays (TensorProtos decoded)."""
    if isinstance(v, TensorProto):
        return numpy_helper.to_array(v)
    if isinstance(v, list):
        return [_to_numpy(e) for e in v]
    return None if v is None else np.asarray(v)


def _run_sequence_case(tester: OpTester, case: Any) -> None:
    """Identity on a sequence/optional value: the list passes through unchanged."""
    for inputs, outputs in case.data_sets:
        (got,) = run_case_node(tester, case, list(inputs))
        assert isinstance(got, list) and len(got) == len(outputs[0])
        for g, w in zip(got, outputs[0], strict=True):
            np.testing.assert_array_equal(g, w)


def _params() -> list[Any]:
    out = []
    for case in single_node_cases(ELEMENTWISE_OPS):
        marks = (
            [pytest.mark.xfail(reason=XFAIL[case.name], raises=NotImplementedError, strict=True)]
            if case.name in XFAIL
            else []
        )
        out.append(pytest.param(case, id=case.name, marks=marks))
    return out


@pytest.mark.parametrize("case", _params())
def test_backend_case(case: Any, tester: OpTester) -> None:
    sets = [
        ([_to_numpy(i) for i in ins], [_to_numpy(o) for o in outs]) for ins, outs in case.data_sets
    ]
    conv = SimpleNamespace(
        name=case.name, model=case.model, data_sets=sets, rtol=case.rtol, atol=case.atol
    )
    if sets and any(isinstance(i, list) for i in sets[0][0]):
        _run_sequence_case(tester, conv)
    else:
        run_case_on(tester, conv)


# --------------------------------------------------------------------------- own checks


def _call(tester: OpTester, op: str, *inputs: Any, opset: int = 22, **attrs: Any) -> Any:
    return tester.call(op, *inputs, opset=opset, **attrs)


_RNG = np.random.default_rng(0)
_X = np.linspace(-4, 4, 97)
_ERF = np.vectorize(math.erf)

UNARY_REFS = {
    "Sigmoid": lambda x: 1 / (1 + np.exp(-x)),
    "Tanh": np.tanh,
    "Exp": np.exp,
    "Erf": _ERF,
    "Gelu": lambda x: 0.5 * x * (1 + _ERF(x / np.sqrt(2))),
    "Softplus": lambda x: np.log1p(np.exp(x)),
    "Mish": lambda x: x * np.tanh(np.log1p(np.exp(x))),
    "HardSwish": lambda x: x * np.clip(x / 6 + 0.5, 0, 1),
    "Elu": lambda x: np.where(x > 0, x, np.expm1(x)),
    "Softsign": lambda x: x / (1 + np.abs(x)),
    "Relu": lambda x: np.maximum(x, 0),
    "Sin": np.sin,
}


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32], ids=str)
@pytest.mark.parametrize("op", sorted(UNARY_REFS))
def test_unary_low_precision(op: str, dtype: Any, tester: OpTester) -> None:
    x = _X.astype(dtype)
    got = _call(tester, op, x)
    assert got.dtype == np.dtype(dtype) and got.shape == x.shape
    want = UNARY_REFS[op](x.astype(np.float64))
    tol = {np.dtype(np.float16): 2e-3, np.dtype(ml_dtypes.bfloat16): 1.6e-2}.get(
        np.dtype(dtype), 1e-5
    )
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=tol, atol=tol)


def test_gelu_tanh_bf16(tester: OpTester) -> None:
    x = _X.astype(ml_dtypes.bfloat16)
    xf = x.astype(np.float64)
    want = 0.5 * xf * (1 + np.tanh(np.sqrt(2 / np.pi) * (xf + 0.044715 * xf**3)))
    got = _call(tester, "Gelu", x, approximate="tanh")
    assert got.dtype == x.dtype
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=1.6e-2, atol=1.6e-2)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=str)
@pytest.mark.parametrize(
    "op,ref", [("Add", np.add), ("Mul", np.multiply), ("Div", np.divide), ("Pow", np.power)]
)
def test_binary_low_precision(op: str, ref: Any, dtype: Any, tester: OpTester) -> None:
    a = _RNG.uniform(0.5, 3, (4, 5)).astype(dtype)
    b = _RNG.uniform(0.5, 2, (5,)).astype(dtype)
    got = _call(tester, op, a, b)
    assert got.dtype == np.dtype(dtype) and got.shape == (4, 5)
    want = ref(a.astype(np.float64), b.astype(np.float64))
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=1.6e-2)


def test_integer_div_truncates_and_mod_signs(tester: OpTester) -> None:
    a = np.array([7, -7, 7, -7, 0], np.int32)
    b = np.array([2, 2, -2, -2, 3], np.int32)
    np.testing.assert_array_equal(_call(tester, "Div", a, b), [3, -3, -3, 3, 0])
    np.testing.assert_array_equal(_call(tester, "Mod", a, b), [1, 1, -1, -1, 0])
    np.testing.assert_array_equal(_call(tester, "Mod", a, b, fmod=1), [1, -1, 1, -1, 0])


def test_pow_int_base_float_exponent(tester: OpTester) -> None:
    got = _call(
        tester, "Pow", np.array([2, 3, 4], np.int64), np.array([0.5, 2.0, -1.0], np.float32)
    )
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, [1, 9, 0])


def test_cast_saturation_and_strings(tester: OpTester) -> None:
    x = np.array([1e6, -1e6, np.nan, 0.5], np.float32)
    got = _call(tester, "Cast", x, to=TensorProto.FLOAT8E4M3FN)
    np.testing.assert_array_equal(got.astype(np.float32)[:2], [448, -448])
    assert np.isnan(got.astype(np.float32)[2])
    bf = _call(tester, "Cast", x, to=TensorProto.BFLOAT16)
    assert bf.dtype == ml_dtypes.bfloat16
    assert _call(tester, "Cast", np.array([1.0, 0.0]), to="BOOL", opset=1).tolist() == [True, False]
    node, kdef = tester.kernel(helper.make_node("Cast", ["x"], ["y"], to=TensorProto.STRING), 22)
    supported, reason = tester.provider.supports(node, [])
    assert not supported and "string" in reason
    if tester.is_reference:  # the CPU kernel's own guard, for a caller that never asked
        with pytest.raises(NotImplementedError, match="string"):
            tester.launch(node, kdef, [x])


def test_clip_attrs_and_missing_bounds(tester: OpTester) -> None:
    x = np.array([-3.0, 0.5, 3.0], np.float32)
    np.testing.assert_array_equal(
        _call(tester, "Clip", x, opset=6, min=-1.0, max=1.0), [-1, 0.5, 1]
    )
    np.testing.assert_array_equal(
        _call(tester, "Clip", x, None, np.float32(1), opset=13), [-3, 0.5, 1]
    )
    np.testing.assert_array_equal(_call(tester, "Clip", x, opset=13), x)


def test_constant_scalars_and_unsupported(tester: OpTester) -> None:
    got = _call(tester, "Constant", value_floats=[1.0, 2.0])
    assert got.dtype == np.float32 and got.shape == (2,)
    got = _call(tester, "Constant", value_int=3)
    assert got.dtype == np.int64 and got.shape == ()
    node, _ = tester.kernel(helper.make_node("Constant", [], ["y"], value_string="a"), 22)
    supported, reason = tester.provider.supports(node, [])
    assert not supported and "value_string" in reason


@pytest.mark.parametrize("op", ["Add", "Mul", "Equal", "Max"])
def test_zero_dim_outputs_are_arrays(op: str, tester: OpTester) -> None:
    got = _call(tester, op, np.array(1.5, np.float32), np.array(2.0, np.float32))
    assert isinstance(got, np.ndarray) and got.shape == ()
