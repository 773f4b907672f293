"""The CPU execution provider: numpy memory, Numba/numpy kernels, recorded graphs."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from onnx_genrt.core.checks import check_int
from onnx_genrt.core.device import CPU, Device
from onnx_genrt.core.errors import GraphCaptureError
from onnx_genrt.core.graph_slots import DeviceGraphSlot
from onnx_genrt.core.kernels import Bind, KernelContext, KernelDef, KernelRegistry
from onnx_genrt.core.provider import ExecutionProvider, ProviderOption
from onnx_genrt.core.tensor import buffer_address

from .cores import physical_cores
from .kernels import REGISTRY
from .kernels._native_calls import NativeCall, NativeRun
from .kernels._native_small import copy_native
from .kernels._weight_arena import WeightArena
from .kernels._worker_pool import pool_epoch

ALIGNMENT = 64
#: The ``threads`` option's default: one thread per physical core this process may use.
AUTO_THREADS = "auto"


class RecordedGraph:
    """Kernel calls recorded during a capture, with the buffers they were bound to.

    Replay calls each kernel with its recorded inputs and makes sure the result lands in
    the recorded output buffer, which is what later calls read. No lookup, no planning.
    """

    def __init__(self, native: bool = True) -> None:
        self.calls: list[Callable[[], Any]] = []
        self.bound = 0  # calls recorded as prebound closures
        #: Whether runs of calls with a native form replay from one compiled loop
        #: (``kernels._native_calls``); the program is made again when the pool changes.
        self.native = native
        self._program: list[Callable[[], Any]] | None = None
        self._epoch = -1
        self.native_calls = 0  # calls the program runs natively

    def record(
        self,
        fn: Callable[..., Any],
        ctx: KernelContext,
        inputs: Sequence[Any],
        outputs: Any,
        bind: Bind | None = None,
    ) -> None:
        outs = outputs if isinstance(outputs, tuple | list) else (outputs,)
        targets = tuple(outs)
        args = tuple(inputs)
        if bind is not None and targets and all(isinstance(t, np.ndarray) for t in targets):
            # The kernel offers a prebound call (a ufunc with its buffers): no wrapper at all.
            # It gets its one output buffer, or the tuple of them; None keeps the call below.
            prebound = bind(ctx, args, targets[0] if len(targets) == 1 else targets)
            if prebound is not None:
                self.calls.append(prebound)
                self.bound += 1
                return

        def call() -> None:
            result = fn(ctx, *args)
            results = result if isinstance(result, tuple | list) else (result,)
            for got, want in zip(results, targets, strict=False):
                if want is None or got is want:
                    continue
                if _same_memory(got, want):
                    continue
                np.copyto(want, got, casting="unsafe")

        self.calls.append(call)

    def replay(self) -> None:
        if not self.native:
            for call in self.calls:
                call()
            return
        if self._epoch != pool_epoch():
            self._make_program()
        for step in self._program:
            step()

    def _make_program(self) -> None:
        """The calls as the replay runs them: each run of calls with a native form
        (``call.native()``) as one ``NativeRun``, the others as they are."""
        program: list[Callable[[], Any]] = []
        run: list[NativeCall] = []
        for call in self.calls:
            make = getattr(call, "native", None)
            native = make() if make is not None else None
            if native is not None:
                run.append(native)
                continue
            if run:
                program.append(NativeRun(run))
                run = []
            program.append(call)
        if run:
            program.append(NativeRun(run))
        self._program = program
        self.native_calls = sum(len(s.calls) for s in program if isinstance(s, NativeRun))
        self._epoch = pool_epoch()  # after the natives were made: making one may start the pool


def _copy_kernel(ctx: Any, src: np.ndarray) -> np.ndarray:
    return src


def _bind_copy(ctx: Any, inputs: Sequence[Any], out: np.ndarray) -> Callable[[], Any]:
    call = functools.partial(np.copyto, out, inputs[0])
    if isinstance(inputs[0], np.ndarray) and inputs[0].dtype == out.dtype:
        call.native = copy_native(inputs[0], out, call)  # type: ignore[attr-defined]
    return call


def _same_memory(a: Any, b: Any) -> bool:
    return (
        isinstance(a, np.ndarray)
        and a.shape == b.shape
        and a.dtype == b.dtype
        and a.strides == b.strides
        and buffer_address(a) == buffer_address(b)
    )


class CPUProvider(ExecutionProvider):
    """Runs kernels on the host. Holds one recorded graph per slot, in every slot."""

    name = "cpu"
    GRAPH_SLOTS = frozenset(DeviceGraphSlot)
    CAPTURE_EXECUTES = True
    OPTIONS = (
        ProviderOption(
            "skinny_matmul",
            True,
            "prepack constant float32 MatMul/Gemm weights for the decode-sized skinny GEMM "
            "(off: numpy/BLAS only)",
            env="ONNX_GENRT_SKINNY_MATMUL",
        ),
        ProviderOption(
            "blas_threads",
            1,
            "threads of numpy's BLAS (prompt-sized matmuls), set with ``threads`` unless that is "
            "None: OpenBLAS's caller waits for each of its threads, so more than 1 pays only on "
            "otherwise idle cores (docs/performance.md)",
            env="ONNX_GENRT_BLAS_THREADS",
        ),
        ProviderOption(
            "native_replay",
            True,
            "replay runs of recorded kernel calls that have a native form from one compiled "
            "loop, without a Python call and Numba dispatch per kernel (off: every call "
            "from Python)",
            env="ONNX_GENRT_NATIVE_REPLAY",
        ),
        ProviderOption(
            "nbits_cache",
            False,
            "keep the float32 copy a prompt-sized MatMulNBits makes of its 4-bit weights "
            "(8x their packed bytes) instead of dequantizing again on each prompt",
            env="ONNX_GENRT_NBITS_CACHE",
        ),
        ProviderOption(
            "int4_vnni",
            True,
            "accuracy-level-4 MatMulNBits with AVX-512 VNNI (vpdpbusd) where the CPU has it "
            "(off: the int16 kernel, on any x86-64)",
            env="ONNX_GENRT_INT4_VNNI",
        ),
    )

    def __init__(self, threads: int | str | None = AUTO_THREADS, **options: Any) -> None:
        """``threads`` sets the process's threads for the skinny kernels' worker pool and
        Numba: ``"auto"`` (the default) one per physical core this process may use
        (:func:`~onnx_genrt.providers.cpu.cores.physical_cores`), ``None`` leaves them (and
        BLAS's). BLAS gets the ``blas_threads`` option (default 1).

        The skinny kernels' workers make the caller wait only a bounded time
        (``kernels/_worker_pool``), so a core busy with other work costs about the share of
        a step it would have done; OpenBLAS's threads make it wait (docs/performance.md).
        """
        super().__init__(**options)
        self._graphs: dict[tuple[DeviceGraphSlot, int], RecordedGraph] = {}
        self._recording: RecordedGraph | None = None
        #: Where the kernels' prepacks put the session's weights (2 MB-aligned blocks).
        self.weight_arena = WeightArena()
        self.threads = physical_cores() if threads == AUTO_THREADS else threads
        if self.threads is not None:
            set_threads(self.threads, self.option("blas_threads"))

    @property
    def device(self) -> Device:
        return CPU

    @property
    def kernels(self) -> KernelRegistry:
        return REGISTRY

    def memory_limit(self) -> int | None:
        """The machine's physical memory."""
        return host_memory_bytes()

    def empty(self, shape: Sequence[int], dtype: Any) -> np.ndarray:
        """An uninitialised host array whose data starts on a 64-byte boundary."""
        return aligned_empty(tuple(int(d) for d in shape), np.dtype(dtype))

    def upload(self, host: Any, out: np.ndarray | None = None) -> np.ndarray:
        """Into ``out`` in place (np.copyto, unsafe casting); without ``out``, ``host`` itself
        when it is a C-contiguous array (no copy: host memory is this provider's memory)."""
        if out is None:
            return np.require(host, requirements="C")
        np.copyto(out, host, casting="unsafe")
        return out

    def read(self, arrays: Sequence[Any]) -> list[np.ndarray]:
        """Copies of the arrays (the values are there already: nothing is queued)."""
        return [np.array(a, copy=True) for a in arrays]

    def copy(self, src: Any, dst: Any) -> None:
        """``np.copyto``; while a graph records, the copy is recorded too."""
        np.copyto(dst, src)
        if self._recording is not None:
            self._recording.record(_copy_kernel, None, (src,), dst, _bind_copy)

    def launch(self, kdef: KernelDef, ctx: KernelContext, inputs: Sequence[Any]) -> Any:
        result = kdef.fn(ctx, *inputs)
        if self._recording is not None:
            self._recording.record(kdef.fn, ctx, inputs, result, kdef.bind)
        return result

    # graph hooks: one recording per (slot, part)
    def graph_begin(self, slot: DeviceGraphSlot, part: int) -> None:
        self._recording = RecordedGraph(native=bool(self.option("native_replay")))

    def graph_end(self, slot: DeviceGraphSlot, part: int) -> None:
        graph, self._recording = self._recording, None
        if graph is None:
            raise GraphCaptureError("no recording in progress")
        self._graphs[slot, part] = graph

    def graph_abort(self, slot: DeviceGraphSlot, part: int) -> None:
        self._recording = None

    def graph_replay(self, slot: DeviceGraphSlot, part: int) -> None:
        self._graphs[slot, part].replay()

    def graph_reset(self, slot: DeviceGraphSlot, part: int) -> None:
        self._graphs.pop((slot, part), None)

    def graph_exists(self, slot: DeviceGraphSlot, part: int) -> bool:
        return (slot, part) in self._graphs

    def recorded_graph(self, slot: DeviceGraphSlot, part: int = 0) -> RecordedGraph | None:
        """The recording held in ``(slot, part)``, for inspection (None when none)."""
        return self._graphs.get((slot, part))

    def recorded_calls(self, slot: DeviceGraphSlot) -> int:
        """Number of kernel calls in the slot's graph, all parts (0 when none)."""
        return sum(len(g.calls) for (s, _), g in self._graphs.items() if s == slot)


def set_threads(threads: int, blas_threads: int | None = None) -> None:
    """Set the threads of this process's pooled kernels (the worker pool: skinny matmuls,
    the GroupQueryAttention step), and BLAS's to ``blas_threads`` (default: ``threads``).
    No kernel uses Numba's parallel regions, whose threads this leaves unstarted."""
    threads = check_int(threads, "CPU provider option threads", minimum=1)
    blas = threads if blas_threads is None else blas_threads
    blas = check_int(blas, "CPU provider option blas_threads", minimum=1)
    from threadpoolctl import threadpool_limits

    from .kernels._worker_pool import set_pool_threads

    set_pool_threads(threads)
    threadpool_limits(limits=blas, user_api="blas")


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialised array whose data starts on a 64-byte boundary."""
    dt = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    raw = np.empty(nbytes + ALIGNMENT, np.uint8)
    offset = (-raw.__array_interface__["data"][0]) % ALIGNMENT
    return raw[offset : offset + nbytes].view(dt).reshape(shape)


def host_memory_bytes() -> int | None:
    """This machine's physical memory in bytes (None where the OS does not say)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return None
