"""Reduction kernels on every provider: ONNX backend node cases plus float16/bfloat16 and TopK
checks against numpy float64."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest

from .op_tester import OpTester, run_case_on, single_node_cases

REDUCE_OPS = [
    "ReduceSum",
    "ReduceMean",
    "ReduceMax",
    "ReduceMin",
    "ReduceProd",
    "ReduceL1",
    "ReduceL2",
    "ReduceLogSum",
    "ReduceLogSumExp",
    "ReduceSumSquare",
    "ArgMax",
    "ArgMin",
    "TopK",
    "CumSum",
    "CumProd",
]


@pytest.mark.parametrize(
    "case", [pytest.param(c, id=c.name) for c in single_node_cases(REDUCE_OPS)]
)
def test_backend_case(case: Any, tester: OpTester) -> None:
    run_case_on(tester, case)


# --------------------------------------------------------------------------- own checks


def _call(tester: OpTester, op: str, *inputs: Any, opset: int = 18, **attrs: Any) -> Any:
    return tester.call(op, *inputs, opset=opset, **attrs)


_RNG = np.random.default_rng(0)
_X = _RNG.normal(size=(3, 50, 8))
_AXES = np.array([1], np.int64)

REFS = {
    "ReduceSum": lambda x: x.sum(1, keepdims=True),
    "ReduceMean": lambda x: x.mean(1, keepdims=True),
    "ReduceMax": lambda x: x.max(1, keepdims=True),
    "ReduceL2": lambda x: np.sqrt((x * x).sum(1, keepdims=True)),
    "ReduceSumSquare": lambda x: (x * x).sum(1, keepdims=True),
    "ReduceLogSumExp": lambda x: np.log(np.exp(x).sum(1, keepdims=True)),
}


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=str)
@pytest.mark.parametrize("op", sorted(REFS))
def test_reduce_low_precision(op: str, dtype: Any, tester: OpTester) -> None:
    x = _X.astype(dtype)
    got = _call(tester, op, x, _AXES)
    assert got.dtype == np.dtype(dtype) and got.shape == (3, 1, 8)
    want = REFS[op](x.astype(np.float64))
    tol = 2e-3 if dtype == np.float16 else 1.6e-2
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=tol, atol=tol * 4)


def test_axes_attribute_before_input_opset(tester: OpTester) -> None:
    x = _X.astype(np.float32)
    got = _call(tester, "ReduceMean", x, opset=13, axes=[0, -1], keepdims=0)
    np.testing.assert_allclose(got, x.mean((0, 2)), rtol=1e-5)
    got = _call(tester, "ReduceSum", x, np.array([], np.int64), opset=13, noop_with_empty_axes=1)
    np.testing.assert_array_equal(got, x)


def test_integer_sum_keeps_dtype(tester: OpTester) -> None:
    x = np.full((4, 100), 100, np.int8)
    got = _call(tester, "ReduceSum", x, np.array([1], np.int64), keepdims=0)
    assert got.dtype == np.int8 and got.shape == (4,)


def test_empty_set_identities(tester: OpTester) -> None:
    x = np.zeros((2, 0, 3), np.float32)
    ax = np.array([1], np.int64)
    assert np.all(_call(tester, "ReduceMax", x, ax) == -np.inf)
    assert np.all(_call(tester, "ReduceMin", x, ax) == np.inf)
    assert np.all(_call(tester, "ReduceProd", x, ax) == 1)
    assert np.all(_call(tester, "ReduceSum", x, ax) == 0)
    assert (
        _call(tester, "ReduceMax", np.zeros((0,), np.int32), np.array([0], np.int64))
        == np.iinfo(np.int32).min
    )


@pytest.mark.parametrize("largest", [1, 0])
def test_topk_ties_and_partition_path(largest: int, tester: OpTester) -> None:
    x = _RNG.integers(0, 20, size=(3, 400)).astype(np.float32)  # many ties
    vals, idx = _call(
        tester, "TopK", x, np.array([7], np.int64), n_out=2, opset=11, largest=largest
    )
    assert vals.dtype == np.float32 and idx.dtype == np.int64 and idx.shape == (3, 7)
    key = -x if largest else x
    want = np.argsort(key, axis=1, kind="stable")[:, :7]
    np.testing.assert_array_equal(idx, want)
    np.testing.assert_array_equal(vals, np.take_along_axis(x, want, axis=1))


def test_topk_bf16_axis0(tester: OpTester) -> None:
    x = _RNG.normal(size=(30, 4)).astype(ml_dtypes.bfloat16)
    vals, idx = _call(tester, "TopK", x, np.array([3], np.int64), n_out=2, opset=11, axis=0)
    assert vals.dtype == x.dtype and vals.shape == (3, 4)
    want = np.argsort(-x.astype(np.float32), axis=0, kind="stable")[:3]
    np.testing.assert_array_equal(idx, want)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.int32], ids=str)
def test_cumsum_reverse_exclusive(dtype: Any, tester: OpTester) -> None:
    x = np.arange(1, 13).reshape(3, 4).astype(dtype)
    got = _call(tester, "CumSum", x, np.array(1, np.int64), opset=14, exclusive=1, reverse=1)
    want = np.flip(np.cumsum(np.flip(x.astype(np.float64), 1), 1), 1) - x.astype(np.float64)
    assert got.dtype == np.dtype(dtype)
    np.testing.assert_allclose(got.astype(np.float64), want)


def test_argmax_bf16_last_index(tester: OpTester) -> None:
    x = np.array([[1, 3, 3], [2, 2, 0]], ml_dtypes.bfloat16)
    got = _call(tester, "ArgMax", x, opset=12, axis=1, select_last_index=1)
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, [[2], [1]])


@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("op", ["CumSum", "CumProd"])
def test_scan_every_axis(op: str, axis: int, tester: OpTester) -> None:
    x = _RNG.uniform(0.5, 1.5, size=(3, 4, 5))
    got = _call(tester, op, x, np.array([axis], np.int32), opset=26, reverse=1)
    ref = np.cumsum if op == "CumSum" else np.cumprod
    want = np.flip(ref(np.flip(x, axis), axis=axis), axis)
    np.testing.assert_allclose(got, want, rtol=1e-12)


def test_topk_nan_fills_last(tester: OpTester) -> None:
    x = np.full((1, 100), np.nan, np.float32)
    x[0, [5, 50]] = [1.0, 2.0]
    vals, idx = _call(tester, "TopK", x, np.array([4], np.int64), n_out=2, opset=11)
    np.testing.assert_array_equal(idx[0, :2], [50, 5])
    assert np.isnan(vals[0, 2:]).all() and len(set(idx[0].tolist())) == 4
