"""Shape / indexing kernels: ONNX backend node cases plus a few targeted checks."""

from __future__ import annotations

import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from onnx import helper

from onnx_genrt.core.kernels import KernelContext, NodeInfo
from onnx_genrt.providers.cpu.kernels import REGISTRY

sys.path.insert(0, str(Path(__file__).parent))
from onnx_cases import run_case_with_kernel, single_node_cases  # noqa: E402

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
def test_backend_case(case: object) -> None:
    run_case_with_kernel(case)


def _run(op: str, *inputs: np.ndarray | None, opset: int = 21, n_out: int = 1, **attrs: object):
    """Run one kernel on ``inputs`` with ``attrs``."""
    names = [f"i{k}" if v is not None else "" for k, v in enumerate(inputs)]
    node = helper.make_node(op, names, [f"o{k}" for k in range(n_out)], **attrs)
    kdef = REGISTRY.lookup("", op, opset)
    assert kdef is not None
    return kdef.fn(KernelContext(NodeInfo.from_proto(node, opset)), *inputs)


def _i64(*v: int) -> np.ndarray:
    return np.array(v, dtype=np.int64)


def test_all_ops_registered() -> None:
    missing = [op for op in SHAPE_OPS if ("", op) not in REGISTRY]
    assert not missing


def test_slice_negative_steps_bfloat16() -> None:
    x = np.arange(24, dtype=np.float32).reshape(4, 6).astype(ml_dtypes.bfloat16)
    big = np.iinfo(np.int64).max
    y = _run("Slice", x, _i64(-1, big), _i64(-big, 0), _i64(0, 1), _i64(-2, -3))
    assert y.dtype == x.dtype
    np.testing.assert_array_equal(y.astype(np.float32), x[::-2, :0:-3].astype(np.float32))


def test_slice_out_of_range_clamps() -> None:
    x = np.arange(10)
    np.testing.assert_array_equal(_run("Slice", x, _i64(-100), _i64(100)), x)
    assert _run("Slice", x, _i64(20), _i64(30)).shape == (0,)


def test_gather_negative_indices() -> None:
    x = np.arange(12, dtype=np.float16).reshape(3, 4)
    y = _run("Gather", x, np.array([[-1, 0], [1, -3]], np.int32), axis=1)
    np.testing.assert_array_equal(y, np.take(x, [[3, 0], [1, 1]], axis=1))
    assert y.dtype == np.float16


def test_gather_out_of_range_names_node() -> None:
    x = np.zeros((3, 4), np.float32)
    with pytest.raises(IndexError, match=r"Gather.*index 3 out of range"):
        _run("Gather", x, _i64(0, 3))
    with pytest.raises(IndexError, match="Gather"):
        _run("Gather", x, _i64(-4))


def test_gather_elements_out_of_range() -> None:
    with pytest.raises(IndexError, match="GatherElements"):
        _run("GatherElements", np.zeros((2, 2)), np.array([[0, 2], [1, 0]]))


def test_gather_nd_batch_dims() -> None:
    rng = np.random.default_rng(0)
    data = rng.standard_normal((2, 3, 4, 5)).astype(np.float32)
    idx = rng.integers(-4, 4, size=(2, 3, 6, 1))
    y = _run("GatherND", data, idx, batch_dims=2)
    want = np.stack([[data[b, c][idx[b, c, :, 0]] for c in range(3)] for b in range(2)])
    np.testing.assert_array_equal(y, want)


def test_scatter_nd_add_duplicates() -> None:
    data = np.zeros(4, np.float32)
    y = _run(
        "ScatterND", data, _i64(1, 1, 3).reshape(3, 1), np.ones(3, np.float32), reduction="add"
    )
    np.testing.assert_array_equal(y, [0, 2, 0, 1])
    assert not data.any()  # input untouched


def test_scatter_elements_negative_axis_max() -> None:
    data = np.ones((2, 3), np.int32)
    idx = np.array([[0, -1], [2, 2]])
    upd = np.array([[5, 7], [-1, 4]], np.int32)
    y = _run("ScatterElements", data, idx, upd, axis=-1, reduction="max")
    np.testing.assert_array_equal(y, [[5, 1, 7], [1, 1, 4]])


def test_reshape_zero_and_minus_one() -> None:
    x = np.zeros((2, 3, 4), np.int8)
    assert _run("Reshape", x, _i64(0, -1)).shape == (2, 12)
    assert _run("Reshape", np.zeros((0, 3)), _i64(3, 0), allowzero=1).shape == (3, 0)


def test_split_num_outputs_uneven() -> None:
    parts = _run("Split", np.arange(7), n_out=3, num_outputs=3, opset=18)
    assert [p.tolist() for p in parts] == [[0, 1, 2], [3, 4, 5], [6]]


def test_pad_negative_and_wrap() -> None:
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    y = _run("Pad", x, _i64(0, -1, 1, 2), mode="wrap")
    np.testing.assert_array_equal(y, np.pad(x[:, 1:], ((0, 1), (0, 2)), mode="wrap"))
    y = _run("Pad", x, _i64(1, -1), np.array(9.0, np.float32), _i64(1))
    np.testing.assert_array_equal(y, [[9, 0, 1], [9, 3, 4]])


def test_shapes_are_int64_arrays() -> None:
    x = np.zeros((2, 3, 4), bool)
    s = _run("Shape", x, start=-2)
    assert s.dtype == np.int64 and s.tolist() == [3, 4]
    n = _run("Size", x)
    assert isinstance(n, np.ndarray) and n.dtype == np.int64 and n.shape == () and n == 24
    nz = _run("NonZero", np.eye(3, dtype=bool))
    assert nz.dtype == np.int64 and nz.shape == (2, 3)


def test_transpose_int4() -> None:
    x = np.arange(6).reshape(2, 3).astype(ml_dtypes.int4)
    y = _run("Transpose", x)
    assert y.dtype == x.dtype and y.flags.c_contiguous
    np.testing.assert_array_equal(y.astype(np.int8), x.astype(np.int8).T)


def test_unique_unsorted_axis() -> None:
    x = np.array([[1, 0], [0, 1], [1, 0]], np.int64)
    y, first, inv, counts = _run("Unique", x, n_out=4, sorted=0, axis=0)
    np.testing.assert_array_equal(y, [[1, 0], [0, 1]])
    assert first.tolist() == [0, 1] and inv.tolist() == [0, 1, 0] and counts.tolist() == [2, 1]
