"""A tensor: dtype, shape, device and the buffer that holds its elements."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .device import CPU, Device
from .dtypes import DType


@dataclass(frozen=True)
class Tensor:
    """A typed view over a provider's buffer.

    ``buffer`` is a numpy array on the CPU and a CuPy array on CUDA; a plugin may use its
    own array type as long as it has ``shape``, ``dtype`` and a stable data address.
    """

    buffer: Any
    dtype: DType
    device: Device = CPU

    @property
    def shape(self) -> tuple[int, ...]:
        """The buffer's shape."""
        return tuple(int(d) for d in self.buffer.shape)

    @property
    def size(self) -> int:
        """Number of elements."""
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        """Bytes of the elements."""
        return self.size * self.dtype.itemsize

    @classmethod
    def from_numpy(cls, array: np.ndarray) -> Tensor:
        """A host tensor over ``array`` (no copy)."""
        arr = np.asarray(array)
        return cls(arr, DType.from_numpy(arr.dtype), CPU)

    def numpy(self) -> np.ndarray:
        """The elements as a host numpy array (a copy when the tensor is not on the CPU)."""
        if isinstance(self.buffer, np.ndarray):
            return self.buffer
        get = getattr(self.buffer, "get", None)
        if get is None:
            raise TypeError(f"cannot bring a {type(self.buffer).__name__} to the host")
        return get()


def buffer_address(buffer: Any) -> int:
    """Data address of a numpy or CuPy-like array."""
    if isinstance(buffer, np.ndarray):
        return int(buffer.__array_interface__["data"][0])
    cai = getattr(buffer, "__cuda_array_interface__", None)
    if cai is not None:
        return int(cai["data"][0])
    data = getattr(buffer, "data", None)
    ptr = getattr(data, "ptr", None)
    if ptr is not None:
        return int(ptr)
    raise TypeError(f"cannot take the address of a {type(buffer).__name__}")
