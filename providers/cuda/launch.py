"""The one door of the CUDA provider's RawKernel launches: :class:`Kernel`, which
``kernels._common.function`` returns, called like CuPy's ``RawKernel``:
``fn(grid, block, args, shared_mem=...)``.

On a stream that allows programmatic dependent launch (PDL; :func:`allow_programmatic`, done
by a provider whose ``programmatic_launch`` is active), kernels are compiled with the device
macros of PDL in force (:func:`compile_defines`), and a kernel whose source waits on the
previous grid (``GRID_WAIT()``, see ``kernel_source``) is launched through the driver's
``cuLaunchKernelEx`` with the programmatic-stream-serialization attribute: it may start while
the kernel before it finishes, running only up to its GRID_WAIT(); that kernel's
``GRID_LAUNCH_DEPENDENTS()`` lets it be scheduled before its own last blocks end. Everything
else goes through CuPy's launch, from kernels compiled without those macros (the same
machine code as before PDL existed). Arguments are packed by the kernel's own parameter table
(``kernel_args``). :func:`launch_counts` says how many launches took each way.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import cupy

from onnx_genrt.core.errors import KernelError

from . import driver as cuda_driver
from .kernel_args import Packer


@dataclass(frozen=True)
class Programmatic:
    """How a stream's kernels are compiled for programmatic launch: ``prefetch``, with their
    L2 weight prefetches before GRID_WAIT() (``pdl_prefetch``); ``early``
    (``pdl_early_launch``), which kernels let the next one be scheduled right after their
    wait, so its blocks prefetch their weights while they run: 0 none, 1 the decode
    attention kernels and the 4-bit GEMVs (``GRID_EARLY_LAUNCH()``), 2 every kernel."""

    prefetch: bool = True
    early: int = 0

    def defines(self) -> tuple[str, ...]:
        """The NVRTC options of ``kernels/_common.GRID_DEPENDENCY`` for these settings."""
        return (
            "-DGENRT_PDL=1",
            f"-DGENRT_PDL_PREFETCH={int(self.prefetch)}",
            f"-DGENRT_PDL_EARLY={int(self.early)}",
        )


#: Streams (by handle) whose kernels go through cuLaunchKernelEx with the PDL attribute, and
#: how their kernels are compiled for it.
_PROGRAMMATIC: dict[int, Programmatic] = {}
#: Reentrant: ``forbid_programmatic`` runs from a provider's finalizer, which the garbage
#: collector may call on a thread that holds the lock (it deadlocked a GPU test run when the
#: lock was plain and ``stream.ptr`` was read under it); nothing that allocates runs under it.
_LOCK = threading.RLock()


def allow_programmatic(stream: Any, prefetch: bool = True, early: int = 0) -> None:
    """Launch PDL-ready kernels on ``stream`` (a CuPy stream) programmatically; ``prefetch``
    and ``early``: see :class:`Programmatic`."""
    key, value = int(stream.ptr), Programmatic(bool(prefetch), int(early))
    with _LOCK:
        _PROGRAMMATIC[key] = value


def forbid_programmatic(stream_ptr: int) -> None:
    """Undo :func:`allow_programmatic` (by the stream's handle, which may be reused later)."""
    key = int(stream_ptr)
    with _LOCK:
        _PROGRAMMATIC.pop(key, None)


def compile_defines() -> tuple[str, ...]:
    """NVRTC options for kernels about to run on the current stream: ``GENRT_PDL`` (the PDL
    macros of ``kernels/_common.GRID_DEPENDENCY`` in force), ``GENRT_PDL_PREFETCH`` and
    ``GENRT_PDL_EARLY`` on a stream that allows programmatic launch; none elsewhere."""
    settings = _PROGRAMMATIC.get(cupy.cuda.get_current_stream().ptr)
    return () if settings is None else settings.defines()


@dataclass
class LaunchCounts:
    """Launches by the way they went: ``programmatic`` through cuLaunchKernelEx with the PDL
    attribute; ``ordinary`` through CuPy on a stream without PDL; ``unready`` through CuPy on
    a PDL stream because the kernel's source has no GRID_WAIT() (it serialises fully)."""

    programmatic: int = 0
    ordinary: int = 0
    unready: int = 0
    #: Cooperative launches (``Kernel.cooperative``): every block resident, never with PDL.
    cooperative: int = 0


_COUNTS = LaunchCounts()


def launch_counts() -> LaunchCounts:
    """A copy of the launch counts since the process started (or the last reset)."""
    return LaunchCounts(
        _COUNTS.programmatic, _COUNTS.ordinary, _COUNTS.unready, _COUNTS.cooperative
    )


def reset_launch_counts() -> None:
    """Zero the launch counts."""
    _COUNTS.programmatic = _COUNTS.ordinary = _COUNTS.unready = _COUNTS.cooperative = 0


def _address(arg: Any) -> int | None:
    """A CuPy array's (or memory pointer's) device address; None for anything else."""
    if isinstance(arg, cupy.ndarray):
        return int(arg.data.ptr)
    if isinstance(arg, cupy.cuda.MemoryPointer):
        return int(arg.ptr)
    return None


def _array_address(arg: Any) -> int:
    return arg.data.ptr


#: The argument types the packer's fast path takes as device addresses.
_ARRAYS = {cupy.ndarray: _array_address}


def _dims(d: int | Sequence[int]) -> tuple[int, int, int]:
    """A grid or block as three ints (CuPy takes an int or 1 to 3 of them)."""
    t = (int(d),) if isinstance(d, int) else tuple(int(x) for x in d)
    if not 1 <= len(t) <= 3:
        raise ValueError(f"a grid or block has 1 to 3 dimensions, got {d!r}")
    return (*t, *(1,) * (3 - len(t)))  # type: ignore[return-value]


class Kernel:
    """A compiled kernel (``raw``, CuPy's RawKernel) launched as described in the module.
    Other attributes (``num_regs``, ``attributes``...) are the RawKernel's."""

    __slots__ = ("raw", "name", "ready", "_function", "_packer", "_params")

    def __init__(self, raw: Any, name: str, ready: bool) -> None:
        #: CuPy's RawKernel.
        self.raw = raw
        #: The name it was compiled as (a template instance).
        self.name = name
        #: Whether it may be launched programmatically: compiled with GENRT_PDL, and its
        #: source waits on the previous grid before touching memory.
        self.ready = ready
        # Set at its first programmatic launch: the CUfunction, the argument packer of its
        # parameter table and the parameter block the driver reads.
        self._function = 0
        self._packer: Packer | None = None
        self._params: cuda_driver.ParamBlock | None = None

    def __getattr__(self, attr: str) -> Any:
        if attr in Kernel.__slots__:  # not set yet: never recurse
            raise AttributeError(attr)
        return getattr(self.raw, attr)

    def __call__(
        self,
        grid: int | Sequence[int],
        block: int | Sequence[int],
        args: Sequence[Any],
        *,
        shared_mem: int = 0,
    ) -> None:
        stream = cupy.cuda.get_current_stream().ptr
        if stream in _PROGRAMMATIC:
            if self.ready:
                self._programmatic(grid, block, args, shared_mem, stream)
                _COUNTS.programmatic += 1
                return
            _COUNTS.unready += 1
        else:
            _COUNTS.ordinary += 1
        self.raw(grid, block, args, shared_mem=shared_mem)

    def cooperative(
        self,
        grid: int | Sequence[int],
        block: int | Sequence[int],
        args: Sequence[Any],
        *,
        shared_mem: int = 0,
    ) -> None:
        """Launch with every block resident at once (cuLaunchKernelEx with the cooperative
        attribute, never programmatically: a grid that waits on itself does not also start
        early), for kernels with grid barriers. KernelError when the grid does not fit."""
        stream = cupy.cuda.get_current_stream().ptr
        self._driver_launch(grid, block, args, shared_mem, stream, cooperative=True)
        _COUNTS.cooperative += 1

    def blocks_per_sm(self, threads: int, shared_mem: int = 0) -> int:
        """How many blocks of ``threads`` threads and ``shared_mem`` dynamic shared bytes one
        SM holds at once (the driver's occupancy; for sizing a cooperative grid)."""
        drv = cuda_driver.load()
        if isinstance(drv, str):
            raise KernelError(f"kernel {self.name}: occupancy unavailable: {drv}")
        try:
            return drv.blocks_per_sm(int(self.raw.kernel.ptr), int(threads), int(shared_mem))
        except cuda_driver.DriverError as exc:
            raise KernelError(f"kernel {self.name}: {exc}") from exc

    def _programmatic(
        self, grid: Any, block: Any, args: Sequence[Any], shared_mem: int, stream: int
    ) -> None:
        """cuLaunchKernelEx with the PDL attribute; a driver error raises KernelError."""
        self._driver_launch(grid, block, args, shared_mem, stream, cooperative=False)

    def _driver_launch(
        self,
        grid: Any,
        block: Any,
        args: Sequence[Any],
        shared_mem: int,
        stream: int,
        cooperative: bool,
    ) -> None:
        how = "cooperative launch" if cooperative else "programmatic dependent launch"
        drv = cuda_driver.load()
        if isinstance(drv, str):  # the provider checked this before allowing the stream
            raise KernelError(f"kernel {self.name}: {how} unavailable: {drv}")
        try:
            if self._params is None:
                self._function = int(self.raw.kernel.ptr)
                table = drv.param_table(self._function)
                self._packer = Packer(table, self.name, _address, _ARRAYS)
                self._params = cuda_driver.ParamBlock([o for o, _ in table], self._packer.size)
            params = self._params
            with params.lock:
                self._packer.pack_into(params.buffer, args)
                where = (self._function, _dims(grid), _dims(block), int(shared_mem), stream)
                if cooperative:
                    drv.launch(*where, params, programmatic=False, cooperative=True)
                else:
                    drv.launch(*where, params)
        except cuda_driver.DriverError as exc:
            raise KernelError(
                f"kernel {self.name}: {exc} (grid {grid}, block {block}, {shared_mem} bytes "
                f"of dynamic shared memory, {how})"
            ) from exc
