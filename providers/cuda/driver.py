"""The few CUDA driver calls the provider makes itself, through ctypes against
``libcuda.so.1``: ``cuLaunchKernelEx`` with the programmatic-stream-serialization launch
attribute (programmatic dependent launch, PDL), ``cuFuncGetParamInfo`` for a kernel's
parameter table, and ``cuGetErrorName``.

Why ctypes and not ``cuda.bindings`` (cuda-python): the driver library is there wherever
CuPy runs a kernel at all, while cuda-python is a further dependency that neither CI nor the
CPU machines have; three entry points with fixed C layouts do not need it. The structures
below follow ``cuda.h`` (CUDA 12 and 13): ``CUlaunchConfig`` is 56 bytes (seven unsigned
ints, the stream, the attribute array, their count), ``CUlaunchAttribute`` 72 (an int id,
4 bytes of padding, a 64-byte value union); ``tests/providers/cuda/test_pdl_launch.py``
checks both sizes and offsets.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Sequence

#: ``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION``: the kernel may start before the
#: previous kernel on its stream has finished; it waits for it in ``griddepcontrol.wait``.
ATTR_PROGRAMMATIC_STREAM_SERIALIZATION = 6
#: ``CU_LAUNCH_ATTRIBUTE_COOPERATIVE``: every block of the grid is resident at once (the launch
#: fails otherwise), so blocks may wait on each other (a grid barrier).
ATTR_COOPERATIVE = 2
#: ``CUDA_ERROR_INVALID_VALUE``: what ``cuFuncGetParamInfo`` returns past the last parameter.
_INVALID_VALUE = 1


class LaunchAttribute(ctypes.Structure):
    """``CUlaunchAttribute``."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_char * 64)]


class LaunchConfig(ctypes.Structure):
    """``CUlaunchConfig``."""

    _fields_ = [
        ("grid_x", ctypes.c_uint),
        ("grid_y", ctypes.c_uint),
        ("grid_z", ctypes.c_uint),
        ("block_x", ctypes.c_uint),
        ("block_y", ctypes.c_uint),
        ("block_z", ctypes.c_uint),
        ("shared_bytes", ctypes.c_uint),
        ("stream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(LaunchAttribute)),
        ("num_attrs", ctypes.c_uint),
    ]


def _int_attribute(attr_id: int) -> LaunchAttribute:
    """A launch attribute whose value is the int 1."""
    attr = LaunchAttribute()
    attr.id = attr_id
    ctypes.memmove(ctypes.addressof(attr) + LaunchAttribute.value.offset, (ctypes.c_int * 1)(1), 4)
    return attr


def programmatic_attribute() -> LaunchAttribute:
    """The attribute that allows a programmatic dependent launch (value: int 1)."""
    return _int_attribute(ATTR_PROGRAMMATIC_STREAM_SERIALIZATION)


def cooperative_attribute() -> LaunchAttribute:
    """The attribute of a cooperative launch (value: int 1)."""
    return _int_attribute(ATTR_COOPERATIVE)


class DriverError(RuntimeError):
    """A driver call returned an error code (``code``, ``name``)."""

    def __init__(self, call: str, code: int, name: str) -> None:
        super().__init__(f"{call} failed: {name} ({code})")
        self.code, self.name = code, name


class Driver:
    """The driver entry points, resolved once from a loaded ``libcuda``."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._launch = lib.cuLaunchKernelEx
        self._launch.argtypes = [
            ctypes.POINTER(LaunchConfig),
            ctypes.c_void_p,
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.POINTER(ctypes.c_void_p),
        ]
        self._launch.restype = ctypes.c_int
        self._param_info = lib.cuFuncGetParamInfo
        self._param_info.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.POINTER(ctypes.c_size_t),
            ctypes.POINTER(ctypes.c_size_t),
        ]
        self._param_info.restype = ctypes.c_int
        self._occupancy = lib.cuOccupancyMaxActiveBlocksPerMultiprocessor
        self._occupancy.argtypes = [
            ctypes.POINTER(ctypes.c_int),
            ctypes.c_void_p,
            ctypes.c_int,
            ctypes.c_size_t,
        ]
        self._occupancy.restype = ctypes.c_int
        self._error_name = lib.cuGetErrorName
        self._error_name.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        self._error_name.restype = ctypes.c_int
        self._attr = programmatic_attribute()  # read by the driver at each launch
        self._attr_pointer = ctypes.pointer(self._attr)
        self._coop = cooperative_attribute()
        self._coop_pointer = ctypes.pointer(self._coop)

    def error_name(self, code: int) -> str:
        """``CUDA_ERROR_...`` for a driver result code."""
        name = ctypes.c_char_p()
        if self._error_name(code, ctypes.byref(name)) != 0 or not name.value:
            return f"CUresult {code}"
        return name.value.decode()

    def blocks_per_sm(self, function: int, threads: int, shared_bytes: int) -> int:
        """Blocks of ``function`` (a ``CUfunction``) of ``threads`` threads and
        ``shared_bytes`` of dynamic shared memory that one SM holds at once."""
        blocks = ctypes.c_int()
        r = self._occupancy(ctypes.byref(blocks), function, threads, shared_bytes)
        if r != 0:
            raise DriverError("cuOccupancyMaxActiveBlocksPerMultiprocessor", r, self.error_name(r))
        return blocks.value

    def param_table(self, function: int) -> tuple[tuple[int, int], ...]:
        """(offset, size) of each parameter of the kernel ``function`` (a ``CUfunction``)."""
        table: list[tuple[int, int]] = []
        offset, size = ctypes.c_size_t(), ctypes.c_size_t()
        while True:
            r = self._param_info(function, len(table), ctypes.byref(offset), ctypes.byref(size))
            if r == _INVALID_VALUE:
                return tuple(table)
            if r != 0:
                raise DriverError("cuFuncGetParamInfo", r, self.error_name(r))
            table.append((offset.value, size.value))

    def launch(
        self,
        function: int,
        grid: Sequence[int],
        block: Sequence[int],
        shared_bytes: int,
        stream: int,
        params: ParamBlock,
        programmatic: bool = True,
        cooperative: bool = False,
    ) -> None:
        """``cuLaunchKernelEx`` of ``function`` on ``stream`` with the parameters packed in
        ``params`` (hold ``params.lock`` from packing to here), the PDL attribute when
        ``programmatic``, else the cooperative one when ``cooperative``."""
        c = params.config
        c.grid_x, c.grid_y, c.grid_z = grid
        c.block_x, c.block_y, c.block_z = block
        c.shared_bytes, c.stream = shared_bytes, stream
        if programmatic:
            c.attrs, c.num_attrs = self._attr_pointer, 1
        else:
            c.attrs, c.num_attrs = self._coop_pointer, int(cooperative)
        r = self._launch(ctypes.byref(c), function, params.pointers, None)
        if r != 0:
            raise DriverError("cuLaunchKernelEx", r, self.error_name(r))


class ParamBlock:
    """One kernel's parameter bytes at their offsets (``buffer``), a pointer to each
    (``pointers``, the launch's kernelParams) and a launch config, reused by every launch of
    the kernel: the driver copies all three when it launches. ``lock`` keeps threads that
    launch the same kernel apart."""

    def __init__(self, offsets: Sequence[int], size: int) -> None:
        self.buffer = (ctypes.c_char * max(size, 1))()
        base = ctypes.addressof(self.buffer)
        self.pointers = (ctypes.c_void_p * max(len(offsets), 1))(*(base + o for o in offsets))
        self.config = LaunchConfig()
        self.lock = threading.Lock()


@functools.cache
def load() -> Driver | str:
    """The driver's entry points, or why they cannot be had (no ``libcuda.so.1``, or a
    driver without ``cuLaunchKernelEx`` (CUDA 11.8) or ``cuFuncGetParamInfo`` (12.4))."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        return f"libcuda.so.1 does not load ({exc})"
    try:
        return Driver(lib)
    except AttributeError as exc:
        missing = str(exc).split(":")[-1].strip() or str(exc)
        return f"the CUDA driver lacks {missing} (cuLaunchKernelEx: 11.8, cuFuncGetParamInfo: 12.4)"


def programmatic_launch_problem(compute_capability: int, loaded: Driver | str) -> str | None:
    """Why a device of ``compute_capability`` (90 for sm_90) with this driver (``load()``)
    cannot launch kernels programmatically, or None: griddepcontrol needs sm_90."""
    if compute_capability < 90:
        return f"needs sm_90 or newer; the device is sm_{compute_capability}"
    return loaded if isinstance(loaded, str) else None
