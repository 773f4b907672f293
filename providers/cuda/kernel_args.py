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
:class:`Packer` gives the same bytes faster, for the launches of one kernel.
"""

from __future__ import annotations

import struct
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


_SIGNED = {1: "b", 2: "h", 4: "i", 8: "q"}
_UNSIGNED = {1: "B", 2: "H", 4: "I", 8: "Q"}
_FLOATS = {2: "e", 4: "f", 8: "d"}


def _zero(_arg: Any) -> int:
    return 0


class Packer:
    """:func:`pack` for one kernel, fast: per tuple of argument types seen, one
    ``struct.Struct`` of the parameter table (padding included) and how each argument
    becomes its value. Arguments of other types, and values the struct refuses (out of range,
    an unsigned value in a signed slot), go through :func:`pack`, which packs them or raises
    its error; the bytes are the same either way. ``arrays``: device array types and their
    address getter (what ``address`` returns for them)."""

    def __init__(
        self,
        params: ParamTable,
        kernel: str,
        address: AddressOf,
        arrays: dict[type, Callable[[Any], int]],
    ) -> None:
        self.params = tuple((int(o), int(s)) for o, s in params)
        self.kernel = kernel
        #: Bytes of the packed parameters.
        self.size = max((o + s for o, s in self.params), default=0)
        self._address = address
        self._arrays = dict(arrays)
        self._layouts: dict[tuple[type, ...], Any] = {}

    def pack(self, args: Sequence[Any]) -> bytearray:
        """The parameters' bytes (``size`` of them)."""
        out = bytearray(self.size)
        self.pack_into(out, args)
        return out

    def pack_into(self, out: Any, args: Sequence[Any]) -> None:
        """Write the parameters' bytes at the start of the writable buffer ``out``."""
        key = tuple(map(type, args))
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layouts[key] = self._layout(key)
        if layout is not False:
            st, conversions = layout
            values = list(args)
            for i, convert in conversions:
                values[i] = convert(values[i])
            try:
                st.pack_into(out, 0, *values)
                return
            except struct.error:
                pass
        memoryview(out).cast("B")[: self.size] = pack(self.params, args, self.kernel, self._address)

    def _layout(self, types: tuple[type, ...]) -> Any:
        """(struct, (index, conversion) of the arguments that are not their own value) for
        arguments of ``types``, or False where :func:`pack` decides."""
        if len(types) != len(self.params):
            return False
        fmt, conversions, at = ["<"], [], 0
        for i, (t, (offset, size)) in enumerate(zip(types, self.params, strict=True)):
            code, convert = self._code(t, size)
            if code is None or offset < at:
                return False
            fmt.append("x" * (offset - at) + code)
            if convert is not None:
                conversions.append((i, convert))
            at = offset + size
        fmt.append("x" * (self.size - at))
        return struct.Struct("".join(fmt)), tuple(conversions)

    def _code(self, t: type, size: int) -> tuple[str | None, Callable[[Any], Any] | None]:
        """The struct code of an argument of type ``t`` in a parameter of ``size`` bytes (None
        where :func:`pack` decides) and how it becomes that code's value (None: as it is)."""
        if t in self._arrays:
            return ("Q" if size == 8 else None), self._arrays[t]
        if t is type(None):
            return ("Q" if size == 8 else None), _zero
        if t in (bool, int):
            return _SIGNED.get(size), None
        if issubclass(t, np.bool_ | np.integer):
            width = np.dtype(t).itemsize
            if width == size and issubclass(t, np.unsignedinteger | np.bool_):
                return _UNSIGNED.get(size), None
            return (_SIGNED.get(size) if width >= size else None), None
        if t is float:
            return ("d" if size == 8 else None), None
        if issubclass(t, np.floating) and np.dtype(t).itemsize == size:
            return _FLOATS.get(size), None
        return None, None
