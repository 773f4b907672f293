"""``core.dtypes``: ``is_float_dtype`` (numpy's float kinds plus ml_dtypes' floats, kind "V"),
and each ``DType`` against onnx's element types."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto, helper

from onnx_genrt.core.dtypes import DType, is_float_dtype, numpy_dtype_of_onnx


@pytest.mark.parametrize(
    "dtype",
    [np.float16, np.float32, np.float64, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn],
)
def test_floats(dtype):
    assert is_float_dtype(dtype)
    ml_dtypes.finfo(dtype)  # the independent check: ml_dtypes has float info for it


@pytest.mark.parametrize(
    "dtype", [np.int64, np.uint8, np.bool_, ml_dtypes.int4, ml_dtypes.uint4, np.dtype("V2")]
)
def test_not_floats(dtype):
    assert not is_float_dtype(dtype)
    with pytest.raises(ValueError):
        ml_dtypes.finfo(dtype)


# -- DType: the ONNX codes and numpy types (found by a mutation run: no test pinned them) ------

ONNX_NAMES = {"FLOAT32": "FLOAT", "FLOAT64": "DOUBLE"}  # where the names differ


@pytest.mark.parametrize("dtype", list(DType), ids=lambda d: d.name)
def test_each_dtype_is_onnxs_code_and_numpys_type(dtype):
    """The code is onnx's ``TensorProto`` value of that name, and the numpy type the one onnx
    maps that code to (external data is mapped into memory by it)."""
    code = getattr(TensorProto, ONNX_NAMES.get(dtype.name, dtype.name))
    assert dtype.value == code
    assert DType.from_onnx(code) is dtype
    want = np.dtype(helper.tensor_dtype_to_np_dtype(code))
    assert dtype.numpy == want and dtype.itemsize == want.itemsize
    assert DType.from_numpy(want) is dtype
    assert numpy_dtype_of_onnx(code) == want
    assert dtype.is_packed == (code in (TensorProto.INT4, TensorProto.UINT4))


@pytest.mark.parametrize("code", [TensorProto.STRING, TensorProto.COMPLEX64, 999])
def test_an_onnx_type_without_a_dtype_is_named_in_the_refusal(code):
    name = TensorProto.DataType.Name(code) if code != 999 else "999"
    with pytest.raises(TypeError, match=f"ONNX element type {name} is not supported"):
        DType.from_onnx(code)


def test_onnx_types_outside_dtype_still_have_numpys_type():
    assert numpy_dtype_of_onnx(TensorProto.STRING) == np.dtype(object)
    assert numpy_dtype_of_onnx(TensorProto.COMPLEX64) == np.dtype(np.complex64)
    with pytest.raises(TypeError, match="numpy dtype complex64 has no onnx-genrt DType"):
        DType.from_numpy(np.complex64)
