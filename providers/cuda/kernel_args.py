"""Kernel arguments packed into the bytes of a kernel's parameters, by its parameter table.

``cuLaunchKernelEx`` (``launch.Kernel``) takes a pointer per parameter and copies as many
bytes from it as the parameter has (the table comes from ``cuFuncGetParamInfo``). CuPy's own
RawKernel launch hands the driver the same pointers, made from each argument by its own rules
(``cupy/_core/raw.pyx`` ``_pointer``): a device array is its address (8 bytes), ``None`` a
null address, a numpy scalar (or one-element numpy array) its own bytes, a Python ``int`` or
``bool`` an int64, a Python ``float`` a double. The driver then reads the parameter's size
from those bytes, little-endian: an int64 into an ``int`` keeps its low four bytes, but a
double into a ``float``, or an int32 into a ``long long``, reads garbage.

:func:`pack` gives the same bytes wherever CuPy's are well defined, and refuses (TypeError
naming the kernel and the parameter) where CuPy's would be garbage or silently truncated,
so that the two launch paths of a provider never disagree quietly: an integer is packed to
the parameter's size when its value fits there (signed or unsigned), a float only into a
parameter of its own size (a Python float: a ``double``), an address only into 8 bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

#: (offset, size) in bytes of each parameter of a kernel, in order.
ParamTable = Sequence[tuple[int, int]]
#: A device array's address, or None for anything that is not a device array.
AddressOf = Callable[[Any], int | None]


def pack(params: ParamTable, args: Sequence[Any], kernel: str, address: AddressOf) -> bytearray:
    """The parameters' bytes at their offsets (``max(offset + size)`` bytes; padding zero)."""
    if len(args) != len(params):
        raise TypeError(f"kernel {kernel}: {len(args)} arguments for its {len(params)} parameters")
    out = bytearray(max((o + s for o, s in params), default=0))
    for index, ((offset, size), arg) in enumerate(zip(params, args, strict=True)):
        out[offset : offset + size] = arg_bytes(arg, size, address, kernel, index)
    return out


def arg_bytes(arg: Any, size: int, address: AddressOf, kernel: str, index: int) -> bytes:
    """The ``size`` bytes of one parameter from ``arg`` (see the module's rules)."""

    def refuse(what: str) -> TypeError:
        return TypeError(f"kernel {kernel}: parameter {index} ({size} bytes): {what}")

    ptr = address(arg)
    if ptr is not None or arg is None:
        if size != 8:
            raise refuse("an address (a device array or None) needs an 8-byte parameter")
        return int(ptr or 0).to_bytes(8, "little")
    if isinstance(arg, np.ndarray):  # CuPy passes a one-element numpy array by value
        if arg.size != 1:
            raise refuse(f"a numpy array of shape {arg.shape} (a host array, not a scalar)")
        arg = arg.reshape(-1)[0]
    if isinstance(arg, bool | int):  # CuPy: an int64
        if size > 8:
            raise refuse("a Python int travels as an int64 (8 bytes)")
        return _int_bytes(int(arg), size, refuse, "a Python int")
    if isinstance(arg, np.bool_ | np.integer):
        if arg.itemsize < size:
            raise refuse(f"a {arg.dtype} scalar is narrower than the parameter")
        if arg.itemsize == size:
            return arg.tobytes()
        return _int_bytes(int(arg), size, refuse, f"a {arg.dtype} scalar")
    if isinstance(arg, float):  # CuPy: a double
        if size != 8:
            raise refuse("a Python float travels as a double; pass np.float32 for a float")
        return np.float64(arg).tobytes()
    if isinstance(arg, np.floating | np.complexfloating):
        if arg.itemsize != size:
            raise refuse(f"a {arg.dtype} scalar does not have the parameter's size")
        return arg.tobytes()
    if isinstance(arg, complex):
        if size != 16:
            raise refuse("a Python complex travels as a complex double (16 bytes)")
        return np.complex128(arg).tobytes()
    raise refuse(f"unsupported argument type {type(arg).__name__}")


def _int_bytes(value: int, size: int, refuse: Callable[[str], TypeError], what: str) -> bytes:
    """``value`` in ``size`` bytes, little-endian, when it fits there signed or unsigned."""
    bits = 8 * size
    if not -(1 << (bits - 1)) <= value < (1 << bits):
        raise refuse(f"{what} {value} does not fit in {size} bytes")
    return (value & ((1 << bits) - 1)).to_bytes(size, "little")
