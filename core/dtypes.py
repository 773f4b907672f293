"""The element types onnx-genrt understands, mapped between ONNX and numpy."""

from __future__ import annotations

import enum

import ml_dtypes
import numpy as np
from onnx import TensorProto


class DType(enum.Enum):
    """An element type. The value is the ONNX ``TensorProto.DataType`` code."""

    FLOAT32 = TensorProto.FLOAT
    FLOAT16 = TensorProto.FLOAT16
    BFLOAT16 = TensorProto.BFLOAT16
    FLOAT64 = TensorProto.DOUBLE
    INT8 = TensorProto.INT8
    INT16 = TensorProto.INT16
    INT32 = TensorProto.INT32
    INT64 = TensorProto.INT64
    UINT8 = TensorProto.UINT8
    UINT16 = TensorProto.UINT16
    UINT32 = TensorProto.UINT32
    UINT64 = TensorProto.UINT64
    BOOL = TensorProto.BOOL
    INT4 = TensorProto.INT4
    UINT4 = TensorProto.UINT4

    @property
    def numpy(self) -> np.dtype:
        """The numpy dtype that holds one element in memory (int4/uint4 unpacked)."""
        return _TO_NUMPY[self]

    @property
    def itemsize(self) -> int:
        return self.numpy.itemsize

    @property
    def is_packed(self) -> bool:
        """True for 4-bit types, which ONNX stores two to a byte."""
        return self in (DType.INT4, DType.UINT4)

    @classmethod
    def from_onnx(cls, code: int) -> DType:
        try:
            return cls(code)
        except ValueError:
            name = (
                TensorProto.DataType.Name(code) if code in TensorProto.DataType.values() else code
            )
            raise TypeError(f"ONNX element type {name} is not supported by onnx-genrt") from None

    @classmethod
    def from_numpy(cls, dtype: np.dtype | type) -> DType:
        dt = np.dtype(dtype)
        try:
            return _FROM_NUMPY[dt]
        except KeyError:
            raise TypeError(f"numpy dtype {dt} has no onnx-genrt DType") from None


_TO_NUMPY: dict[DType, np.dtype] = {
    DType.FLOAT32: np.dtype(np.float32),
    DType.FLOAT16: np.dtype(np.float16),
    DType.BFLOAT16: np.dtype(ml_dtypes.bfloat16),
    DType.FLOAT64: np.dtype(np.float64),
    DType.INT8: np.dtype(np.int8),
    DType.INT16: np.dtype(np.int16),
    DType.INT32: np.dtype(np.int32),
    DType.INT64: np.dtype(np.int64),
    DType.UINT8: np.dtype(np.uint8),
    DType.UINT16: np.dtype(np.uint16),
    DType.UINT32: np.dtype(np.uint32),
    DType.UINT64: np.dtype(np.uint64),
    DType.BOOL: np.dtype(np.bool_),
    DType.INT4: np.dtype(ml_dtypes.int4),
    DType.UINT4: np.dtype(ml_dtypes.uint4),
}
_FROM_NUMPY: dict[np.dtype, DType] = {v: k for k, v in _TO_NUMPY.items()}


#: ml_dtypes' floating-point types, which numpy reports as kind "V".
_ML_FLOATS = frozenset(
    np.dtype(getattr(ml_dtypes, name))
    for name in ("bfloat16", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz")
    if hasattr(ml_dtypes, name)
)


def is_float_dtype(dtype: np.dtype | type) -> bool:
    """Whether ``dtype`` is a floating-point type, ml_dtypes' bfloat16 and float8 included."""
    dt = np.dtype(dtype)
    return dt.kind == "f" or dt in _ML_FLOATS


def numpy_dtype_of_onnx(code: int) -> np.dtype:
    """numpy dtype for an ONNX element-type code, including types outside :class:`DType`."""
    try:
        return DType.from_onnx(code).numpy
    except TypeError:
        from onnx import helper

        return np.dtype(helper.tensor_dtype_to_np_dtype(code))
