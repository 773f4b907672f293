"""The element types onnx-genrt understands, mapped between ONNX and numpy.

Neither onnx nor ml_dtypes is imported here until a type needs them (ml_dtypes takes about
half a second to import): importing the engine costs neither.
"""

from __future__ import annotations

import enum
import functools
import sys

import numpy as np


class DType(enum.Enum):
    """An element type. The value is the ONNX ``TensorProto.DataType`` code (fixed by the
    ONNX standard; ``tests/core/test_dtypes.py`` checks them against onnx)."""

    FLOAT32 = 1
    FLOAT16 = 10
    BFLOAT16 = 16
    FLOAT64 = 11
    INT8 = 3
    INT16 = 5
    INT32 = 6
    INT64 = 7
    UINT8 = 2
    UINT16 = 4
    UINT32 = 12
    UINT64 = 13
    BOOL = 9
    INT4 = 22
    UINT4 = 21

    @property
    def numpy(self) -> np.dtype:
        """The numpy dtype that holds one element in memory (int4/uint4 unpacked)."""
        return _to_numpy()[self]

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
            from onnx import TensorProto

            name = (
                TensorProto.DataType.Name(code) if code in TensorProto.DataType.values() else code
            )
            raise TypeError(f"ONNX element type {name} is not supported by onnx-genrt") from None

    @classmethod
    def from_numpy(cls, dtype: np.dtype | type) -> DType:
        dt = np.dtype(dtype)
        try:
            return _from_numpy()[dt]
        except KeyError:
            raise TypeError(f"numpy dtype {dt} has no onnx-genrt DType") from None


#: The numpy dtypes of the types numpy has itself; the others come from ml_dtypes.
_NUMPY_OWN: dict[DType, np.dtype] = {
    DType.FLOAT32: np.dtype(np.float32),
    DType.FLOAT16: np.dtype(np.float16),
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
}


@functools.cache
def _to_numpy() -> dict[DType, np.dtype]:
    import ml_dtypes

    return {
        **_NUMPY_OWN,
        DType.BFLOAT16: np.dtype(ml_dtypes.bfloat16),
        DType.INT4: np.dtype(ml_dtypes.int4),
        DType.UINT4: np.dtype(ml_dtypes.uint4),
    }


@functools.cache
def _from_numpy() -> dict[np.dtype, DType]:
    return {v: k for k, v in _to_numpy().items()}


#: ml_dtypes' floating-point types, which numpy reports as kind "V".
_ML_FLOAT_NAMES = ("bfloat16", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz")


def is_float_dtype(dtype: np.dtype | type) -> bool:
    """Whether ``dtype`` is a floating-point type, ml_dtypes' bfloat16 and float8 included."""
    dt = np.dtype(dtype)
    if dt.kind == "f":
        return True
    ml_dtypes = sys.modules.get("ml_dtypes")  # a dtype of it exists only once it is imported
    return ml_dtypes is not None and dt.kind == "V" and dt in _ml_floats()


@functools.cache
def _ml_floats() -> frozenset[np.dtype]:
    import ml_dtypes

    return frozenset(
        np.dtype(getattr(ml_dtypes, name)) for name in _ML_FLOAT_NAMES if hasattr(ml_dtypes, name)
    )


def numpy_dtype_of_onnx(code: int) -> np.dtype:
    """numpy dtype for an ONNX element-type code, including types outside :class:`DType`."""
    try:
        return DType.from_onnx(code).numpy
    except TypeError:
        from onnx import helper

        return np.dtype(helper.tensor_dtype_to_np_dtype(code))
