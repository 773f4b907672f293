"""``core.dtypes.is_float_dtype``: numpy's float kinds plus ml_dtypes' floats (kind "V")."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from onnx_genrt.core.dtypes import is_float_dtype


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
