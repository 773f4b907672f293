"""``core.tensor`` and ``core.device``: a tensor's host copy, the data address of each kind of
array and a device's name (found by a mutation run: only numpy arrays had a test; CuPy's
paths run on a GPU). The stand-ins below
follow the CUDA array interface and CuPy's ``data.ptr``; numpy's own address is the
reference for host arrays."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from onnx_genrt.core.device import Device
from onnx_genrt.core.dtypes import DType
from onnx_genrt.core.tensor import Tensor, buffer_address


class DeviceArray:
    """A device array as CuPy's: ``get()`` copies to the host, ``data.ptr`` is the address."""

    def __init__(self, host: np.ndarray, ptr: int) -> None:
        self.host, self.shape, self.dtype = host, host.shape, host.dtype
        self.data = SimpleNamespace(ptr=ptr)

    def get(self) -> np.ndarray:
        return self.host.copy()


class InterfaceArray:
    """An array that only exports the CUDA array interface (Numba's, PyTorch's)."""

    def __init__(self, ptr: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (4,),
            "typestr": "<f4",
            "data": (ptr, False),
            "version": 3,
        }


def test_a_host_arrays_address_is_numpys():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert buffer_address(x) == x.ctypes.data
    assert buffer_address(x[1:]) == x.ctypes.data + 16


def test_device_arrays_give_their_interface_or_pointer_address():
    assert buffer_address(InterfaceArray(0x7F00_0000_1000)) == 0x7F00_0000_1000
    assert buffer_address(DeviceArray(np.zeros(2), 0x7F00_0000_2000)) == 0x7F00_0000_2000


@pytest.mark.parametrize("thing", [[1.0, 2.0], SimpleNamespace(data=b"bytes"), 3.0])
def test_an_object_without_an_address_is_refused_by_type(thing):
    with pytest.raises(TypeError, match=f"cannot take the address of a {type(thing).__name__}"):
        buffer_address(thing)


def test_a_tensor_comes_to_the_host_as_is_or_through_get():
    host = np.arange(6, dtype=np.int64).reshape(2, 3)
    on_host = Tensor.from_numpy(host)
    assert on_host.numpy() is host and on_host.dtype is DType.INT64
    assert (on_host.size, on_host.nbytes, on_host.shape) == (6, 48, (2, 3))
    on_device = Tensor(DeviceArray(host, 0x1000), DType.INT64)
    np.testing.assert_array_equal(on_device.numpy(), host)
    with pytest.raises(TypeError, match="cannot bring a list to the host"):
        Tensor([1, 2], DType.INT64).numpy()


@pytest.mark.parametrize(
    ("device", "text"),
    [(Device("cpu"), "cpu"), (Device("cuda"), "cuda:0"), (Device("cuda", 1), "cuda:1")],
)
def test_a_device_reads_as_torch_and_cupy_name_it(device, text):
    """The host is "cpu"; an accelerator is "kind:index", index 0 unless given."""
    assert str(device) == text
    assert Device("cuda") == Device("cuda", 0) != Device("cuda", 1)
