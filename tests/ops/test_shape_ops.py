"""Shape / indexing kernels on every provider: ONNX backend node cases plus a few targeted
checks against numpy."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from onnx_genrt.providers.cpu.kernels import REGISTRY

from .op_tester import OpTester, run_case_on, single_node_cases

SHAPE_OPS = [
    "Reshape",
    "Transpose",
    "Concat",
    "Split",
    "Slice",
    "Squeeze",
    "Unsqueeze",
    "Expand",
    "Tile",
    "Pad",
    "Shape",
    "Size",
    "ConstantOfShape",
    "Range",
    "Flatten",
    "Gather",
    "GatherElements",
    "GatherND",
    "ScatterND",
    "ScatterElements",
    "Scatter",
    "Trilu",
    "OneHot",
    "NonZero",
    "Compress",
    "EyeLike",
    "DepthToSpace",
    "SpaceToDepth",
    "ReverseSequence",
    "Unique",
    "Resize",
    "CenterCropPad",
    "Col2Im",
]

# Backend cases that cannot pass, with the reason (none at present).
XFAIL: dict[str, str] = {}


def _case_params() -> list[object]:
    params = []
    for case in single_node_cases(SHAPE_OPS):
        marks = (
            [pytest.mark.xfail(reason=XFAIL[case.name], strict=True)] if case.name in XFAIL else []
        )
        params.append(pytest.param(case, id=case.name, marks=marks))
    return params


@pytest.mark.parametrize("case", _case_params())
def test_backend_case(case: object, tester: OpTester) -> None:
    run_case_on(tester, case)


def _run(
    tester: OpTester,
    op: str,
    *inputs: np.ndarray | None,
    opset: int = 21,
    n_out: int = 1,
    **attrs: object,
):
    """Run one kernel on ``inputs`` with ``attrs`` on the tester's provider."""
    return tester.call(op, *inputs, opset=opset, n_out=n_out, **attrs)


def _i64(*v: int) -> np.ndarray:
    return np.array(v, dtype=np.int64)


def test_all_ops_registered_on_the_reference_provider() -> None:
    missing = [op for op in SHAPE_OPS if ("", op) not in REGISTRY]
    assert not missing


def test_slice_negative_steps_bfloat16(tester: OpTester) -> None:
    x = np.arange(24, dtype=np.float32).reshape(4, 6).astype(ml_dtypes.bfloat16)
    big = np.iinfo(np.int64).max
    y = _run(tester, "Slice", x, _i64(-1, big), _i64(-big, 0), _i64(0, 1), _i64(-2, -3))
    assert y.dtype == x.dtype
    np.testing.assert_array_equal(y.astype(np.float32), x[::-2, :0:-3].astype(np.float32))


def test_slice_out_of_range_clamps(tester: OpTester) -> None:
    x = np.arange(10)
    np.testing.assert_array_equal(_run(tester, "Slice", x, _i64(-100), _i64(100)), x)
    assert _run(tester, "Slice", x, _i64(20), _i64(30)).shape == (0,)


def test_gather_negative_indices(tester: OpTester) -> None:
    x = np.arange(12, dtype=np.float16).reshape(3, 4)
    y = _run(tester, "Gather", x, np.array([[-1, 0], [1, -3]], np.int32), axis=1)
    np.testing.assert_array_equal(y, np.take(x, [[3, 0], [1, 1]], axis=1))
    assert y.dtype == np.float16


def test_gather_out_of_range_names_node(tester: OpTester) -> None:
    x = np.zeros((3, 4), np.float32)
    with pytest.raises(IndexError, match=r"Gather.*index 3 out of range"):
        _run(tester, "Gather", x, _i64(0, 3))
    with pytest.raises(IndexError, match="Gather"):
        _run(tester, "Gather", x, _i64(-4))


def test_gather_elements_out_of_range(tester: OpTester) -> None:
    with pytest.raises(IndexError, match="GatherElements"):
        _run(tester, "GatherElements", np.zeros((2, 2)), np.array([[0, 2], [1, 0]]))


def test_gather_nd_batch_dims(tester: OpTester) -> None:
    rng = np.random.default_rng(0)
    data = rng.standard_normal((2, 3, 4, 5)).astype(np.float32)
    idx = rng.integers(-4, 4, size=(2, 3, 6, 1))
    y = _run(tester, "GatherND", data, idx, batch_dims=2)
    want = np.stack([[data[b, c][idx[b, c, :, 0]] for c in range(3)] for b in range(2)])
    np.testing.assert_array_equal(y, want)


def test_scatter_nd_add_duplicates(tester: OpTester) -> None:
    data = np.zeros(4, np.float32)
    y = _run(
        tester,
        "ScatterND",
        data,
        _i64(1, 1, 3).reshape(3, 1),
        np.ones(3, np.float32),
        reduction="add",
    )
    np.testing.assert_array_equal(y, [0, 2, 0, 1])
    assert not data.any()  # input untouched


def test_scatter_elements_negative_axis_max(tester: OpTester) -> None:
    data = np.ones((2, 3), np.int32)
    idx = np.array([[0, -1], [2, 2]])
    upd = np.array([[5, 7], [-1, 4]], np.int32)
    y = _run(tester, "ScatterElements", data, idx, upd, axis=-1, reduction="max")
    np.testing.assert_array_equal(y, [[5, 1, 7], [1, 1, 4]])


def test_reshape_zero_and_minus_one(tester: OpTester) -> None:
    x = np.zeros((2, 3, 4), np.int8)
    assert _run(tester, "Reshape", x, _i64(0, -1)).shape == (2, 12)
    assert _run(tester, "Reshape", np.zeros((0, 3)), _i64(3, 0), allowzero=1).shape == (3, 0)


def test_split_num_outputs_uneven(tester: OpTester) -> None:
    parts = _run(tester, "Split", np.arange(7), n_out=3, num_outputs=3, opset=18)
    assert [p.tolist() for p in parts] == [[0, 1, 2], [3, 4, 5], [6]]


def test_pad_negative_and_wrap(tester: OpTester) -> None:
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    y = _run(tester, "Pad", x, _i64(0, -1, 1, 2), mode="wrap")
    np.testing.assert_array_equal(y, np.pad(x[:, 1:], ((0, 1), (0, 2)), mode="wrap"))
    y = _run(tester, "Pad", x, _i64(1, -1), np.array(9.0, np.float32), _i64(1))
    np.testing.assert_array_equal(y, [[9, 0, 1], [9, 3, 4]])


def test_shapes_are_int64_arrays(tester: OpTester) -> None:
    x = np.zeros((2, 3, 4), bool)
    s = _run(tester, "Shape", x, start=-2)
    assert s.dtype == np.int64 and s.tolist() == [3, 4]
    n = _run(tester, "Size", x)
    assert isinstance(n, np.ndarray) and n.dtype == np.int64 and n.shape == () and n == 24
    nz = _run(tester, "NonZero", np.eye(3, dtype=bool))
    assert nz.dtype == np.int64 and nz.shape == (2, 3)


def test_transpose_int4(tester: OpTester) -> None:
    x = np.arange(6).reshape(2, 3).astype(ml_dtypes.int4)
    y = _run(tester, "Transpose", x)
    assert y.dtype == x.dtype and y.flags.c_contiguous
    np.testing.assert_array_equal(y.astype(np.int8), x.astype(np.int8).T)


def test_unique_unsorted_axis(tester: OpTester) -> None:
    x = np.array([[1, 0], [0, 1], [1, 0]], np.int64)
    y, first, inv, counts = _run(tester, "Unique", x, n_out=4, sorted=0, axis=0)
    np.testing.assert_array_equal(y, [[1, 0], [0, 1]])
    assert first.tolist() == [0, 1] and inv.tolist() == [0, 1, 0] and counts.tolist() == [2, 1]
