"""The CUDA execution provider: CuPy memory, one non-blocking stream, CUDA graphs per slot.

Everything this provider does goes onto ``self.stream``: kernel launches, device copies and
host copies (through a pinned staging buffer). Work queued elsewhere (CuPy's default
stream) is not ordered with it; write into bound buffers under ``with provider.stream:``
or with ``array.set(host, stream=provider.stream)``.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import cupy
import numpy as np

from onnx_genrt.core.device import Device
from onnx_genrt.core.dtypes import DType
from onnx_genrt.core.errors import GraphCaptureError
from onnx_genrt.core.graph_slots import DeviceGraphSlot
from onnx_genrt.core.kernels import GENRT_DOMAIN, KernelContext, KernelDef, KernelRegistry
from onnx_genrt.core.provider import ExecutionProvider, ProviderOption
from onnx_genrt.core.tensor import Tensor

from .kernels import REGISTRY
from .kernels._common import BF16, bf16_unsupported

#: Host copies up to this size go through the pinned staging buffer (async on the stream).
STAGING_MAX = 64 << 20
#: Integer arrays up to this many elements keep a host copy when uploaded by ``as_array``.
SHADOW_MAX_ELEMS = 64
#: Host copies of small integer arrays kept at once (oldest dropped first).
SHADOW_ENTRIES = 4096
#: Fused ops whose GEMV makes its own activations (an RMS norm or SiluMul, staged per block
#: in shared memory after the first weight loads are issued). On by default: H200, 0.5B shape,
#: graphed greedy (separate bench processes, same machine): int4 1138.5 -> 1166.8 tok/s, fp16
#: 1142.4 -> 1114.8 (slower; SiluMul into wide float GEMVs now stays a launch of its own, see
#: ``genrt.SILU_FLOAT_GEMV_MAX_K``), embedded model greedy 7068 -> 8493 and MTP 10363 ->
#: 13721. ``gemv_prologues=False`` or ONNX_GENRT_GEMV_PROLOGUES=0 keeps the norm and SiluMul
#: launches.
GEMV_PROLOGUE_OPS = frozenset(
    (GENRT_DOMAIN, op)
    for op in ("NormMatMul", "NormMatMulNBits", "SiluMulMatMul", "SiluMulMatMulNBits")
)


class CUDAProvider(ExecutionProvider):
    """Runs kernels on one NVIDIA GPU through CuPy; holds a CUDA graph in each slot."""

    name = "cuda"
    GRAPH_SLOTS = frozenset(DeviceGraphSlot)
    CAPTURE_EXECUTES = False
    ARRAY_TYPES = (cupy.ndarray,)

    def holds(self, value: Any) -> bool:
        return isinstance(value, cupy.ndarray) and value.device.id == self._index

    def may_share_memory(self, a: Any, b: Any) -> bool:
        return self.holds(a) and self.holds(b) and bool(cupy.may_share_memory(a, b))

    OPTIONS = (
        ProviderOption(
            "gemv_prologues",
            True,
            "let the plan fuse RMS norms and SiluMul into the GEMVs that read them "
            "(GEMV_PROLOGUE_OPS)",
            env="ONNX_GENRT_GEMV_PROLOGUES",
        ),
        ProviderOption(
            "nbits_stream",
            True,
            "4-bit rows of at most 128 words on the persistent, prefetching GEMV",
            env="ONNX_GENRT_NBITS_STREAM",
        ),
        ProviderOption(
            "nbits_chunk16",
            True,
            "4-bit weights with blocks of a multiple of 32 on the 16-byte-load GEMV",
            env="ONNX_GENRT_NBITS_CHUNK16",
        ),
        ProviderOption(
            "nbits_small_k",
            True,
            "lm_head-shaped 4-bit GEMVs (K <= 2048, M <= 8) with several lanes a column",
            env="ONNX_GENRT_NBITS_SMALL_K",
        ),
        ProviderOption(
            "nbits_half2",
            True,
            "fp16 activations with integer zero points: 4-bit GEMV math on packed halves",
            env="ONNX_GENRT_NBITS_HALF2",
        ),
    )

    def __init__(self, device_id: int = 0, **options: Any) -> None:
        super().__init__(**options)
        #: Whether the plan may fuse norms and SiluMul into GEMVs (``GEMV_PROLOGUE_OPS``).
        self.gemv_prologues = self.option("gemv_prologues")
        self._index = int(device_id)
        self._device = Device("cuda", self._index)
        self._cuda_device = cupy.cuda.Device(self._index)
        with self._cuda_device:
            self.stream = cupy.cuda.Stream(non_blocking=True)
        self._scope = (
            self.stream if self._index == 0 else _DeviceStream(self._cuda_device, self.stream)
        )
        self._graphs: dict[tuple[DeviceGraphSlot, int], Any] = {}
        self._staging: np.ndarray | None = None
        self._staging_mem: Any = None
        self._staging_used = 0
        # Reads queued by ``read_later`` whose views still sit in the staging ring.
        self._pending_reads: list[_PendingRead] = []
        self._events: list[Any] = []  # idle events for read_later, reused
        self._shadow: OrderedDict[tuple, tuple[Any, np.ndarray]] = OrderedDict()
        self._scratch: Any = None
        self._retired_scratch: list[Any] = []

    # -- device and memory -------------------------------------------------
    @property
    def device(self) -> Device:
        return self._device

    @property
    def kernels(self) -> KernelRegistry:
        return REGISTRY

    def get_kernel(self, domain: str, op_type: str, opset: int) -> KernelDef | None:
        if not self.gemv_prologues and (domain, op_type) in GEMV_PROLOGUE_OPS:
            return None
        return super().get_kernel(domain, op_type, opset)

    def allocate(self, shape: Sequence[int], dtype: DType) -> Tensor:
        self._check_dtype(dtype.numpy)
        with self._scope:
            buf = cupy.empty(tuple(int(s) for s in shape), dtype.numpy)
        return Tensor(buf, dtype, self._device)

    @staticmethod
    def _check_dtype(dtype: np.dtype) -> None:
        """A clear error for a bfloat16 tensor on a CuPy without bfloat16."""
        if dtype == BF16:
            reason = bf16_unsupported()
            if reason:
                raise TypeError(reason)

    def copy_from_host(self, array: np.ndarray, out: Tensor | None = None) -> Tensor:
        self._refuse_host_copy("host-to-device copy")
        host = np.asarray(array)
        if out is None:
            host = np.asarray(host, order="C")  # ascontiguousarray would make 0-d 1-d
            self._check_dtype(host.dtype)
            with self._scope:
                buf = cupy.empty(host.shape, host.dtype)
            self._upload(host, buf)
            return Tensor(buf, DType.from_numpy(host.dtype), self._device)
        dst = out.buffer
        self._shadow.pop(_shadow_key(dst), None)  # overwritten: its host copy is stale
        if host.shape != dst.shape or host.dtype != dst.dtype or not host.flags.c_contiguous:
            host = np.asarray(np.broadcast_to(host, dst.shape), dtype=dst.dtype, order="C")
        if dst.flags.c_contiguous:
            self._upload(host, dst)
        else:
            with self._scope:
                tmp = cupy.empty(host.shape, host.dtype)
            self._upload(host, tmp)
            with self._scope:
                cupy.copyto(dst, tmp)
        return out

    def copy_to_host(self, tensor: Tensor, out: np.ndarray | None = None) -> np.ndarray:
        self._refuse_host_copy("device-to-host copy")
        src = tensor.buffer
        if not isinstance(src, cupy.ndarray):
            host = src
        elif src.size == 0:
            host = np.empty(src.shape, src.dtype)
        else:
            host = self._download(src, keep_view=out is not None)
        if out is None:
            return host if host is not src else np.array(src, copy=True)
        np.copyto(out, host)
        return out

    def _download(self, src: Any, keep_view: bool) -> np.ndarray:
        """A device array to the host; the staging view itself when ``keep_view``."""
        if not src.flags.c_contiguous:
            with self._scope:
                src = cupy.ascontiguousarray(src)
        nbytes = int(src.nbytes)
        if nbytes > STAGING_MAX:
            return src.get(stream=self.stream)
        view = self._staging_view(nbytes, src.dtype, tuple(src.shape))
        src.get(stream=self.stream, out=view)  # blocking: waits for the stream
        self._reset_staging()  # the stream is idle: every staged upload has been consumed
        return view if keep_view else view.copy()  # a kept view is valid until the next copy

    def _queue_downloads(self, arrays: Sequence[Any]) -> list[np.ndarray] | None:
        """Device arrays queued one after another into the pinned staging ring, on the
        stream (host values copied as they are); None when they do not fit the ring (too
        large, or not contiguous). The views are valid once the stream has got there."""
        self._refuse_host_copy("device-to-host copy")
        srcs = [a for a in arrays if isinstance(a, cupy.ndarray)]
        total = sum(_aligned_size(int(a.nbytes)) for a in srcs)
        if total > STAGING_MAX or any(not a.flags.c_contiguous for a in srcs):
            return None
        views: list[np.ndarray] = []
        for a in arrays:
            if not isinstance(a, cupy.ndarray):
                views.append(np.array(a, copy=True))
                continue
            view = self._staging_view(int(a.nbytes), a.dtype, tuple(a.shape))
            if a.nbytes:
                cupy.cuda.runtime.memcpyAsync(
                    view.ctypes.data, a.data.ptr, int(a.nbytes), 2, self.stream.ptr
                )  # 2: device to host
            views.append(view)
        return views

    def to_numpy_many(self, arrays: Sequence[Any]) -> list[np.ndarray]:
        """Small device arrays queued to pinned memory one after another, then one wait."""
        views = self._queue_downloads(arrays)
        if views is None:
            return super().to_numpy_many(arrays)
        self.stream.synchronize()
        values = [v.copy() for v in views]
        self._reset_staging()
        return values

    ASYNC_READS = True

    def read_later(self, arrays: Sequence[Any]) -> Callable[[], list[np.ndarray]]:
        """Small device arrays queued to pinned memory behind the stream's work, and an
        event; the returned call waits on that event only, so later steps can be queued
        (and run) before the host looks at these values."""
        views = self._queue_downloads(arrays)
        if views is None:
            return super().read_later(arrays)
        event = self._events.pop() if self._events else cupy.cuda.Event(disable_timing=True)
        event.record(self.stream)
        pending = _PendingRead(views, event, self._pending_reads, self._events)
        self._pending_reads.append(pending)
        return pending.result

    def _reset_staging(self) -> None:
        """After a full stream sync: pending reads keep copies, and the ring starts over."""
        for pending in self._pending_reads:
            pending.materialize()
        self._pending_reads.clear()
        self._staging_used = 0

    def copy(self, src: Tensor, dst: Tensor) -> None:
        if not isinstance(src.buffer, cupy.ndarray):
            self.copy_from_host(src.buffer, dst)
            return
        if not isinstance(dst.buffer, cupy.ndarray):
            self.copy_to_host(src, dst.buffer)
            return
        with self._scope:
            cupy.copyto(dst.buffer, src.buffer)

    def synchronize(self) -> None:
        self.stream.synchronize()

    def copy_array(self, src: Any, dst: Any) -> None:
        """Device to device on the stream: one async memcpy for contiguous arrays (no kernel
        launch through CuPy's elementwise machinery)."""
        devices = isinstance(src, cupy.ndarray) and isinstance(dst, cupy.ndarray)
        same = devices and src.dtype == dst.dtype and src.shape == dst.shape
        if same and src.flags.c_contiguous and dst.flags.c_contiguous:
            if src.nbytes:
                cupy.cuda.runtime.memcpyAsync(
                    dst.data.ptr, src.data.ptr, int(src.nbytes), 3, self.stream.ptr
                )  # 3: device to device
            return
        super().copy_array(src, dst)

    def as_array(self, host: np.ndarray) -> Any:
        """Host array to a CuPy array on this device; CuPy arrays pass through.

        Small integer arrays (shapes, axes, slice bounds) also keep a host copy, so kernels
        read them without a device sync. Do not write such arrays in place afterwards.
        """
        if isinstance(host, cupy.ndarray):
            return host
        arr = np.asarray(host, order="C")
        dev = self.copy_from_host(arr).buffer
        if arr.dtype.kind in "iu" and arr.size <= SHADOW_MAX_ELEMS:
            self._shadow[_shadow_key(dev)] = (dev, arr.copy())
            while len(self._shadow) > SHADOW_ENTRIES:
                self._shadow.popitem(last=False)
        return dev

    def host_shadow(self, array: Any) -> np.ndarray | None:
        """The host copy of a small integer array uploaded by ``as_array``, if kept."""
        if not isinstance(array, cupy.ndarray):
            return np.asarray(array)
        hit = self._shadow.get(_shadow_key(array))
        return None if hit is None else hit[1]

    def to_numpy(self, array: Any) -> np.ndarray:
        if not isinstance(array, cupy.ndarray):
            return np.asarray(array)
        return self.copy_to_host(Tensor(array, DType.from_numpy(array.dtype), self._device))

    def scratch(self, nbytes: int) -> Any:
        """Scratch bytes for kernels (split-K partial sums).

        The buffer only grows outside a capture, and a replaced buffer is kept alive, since
        graphs captured earlier still write into it.
        """
        nbytes = max(int(nbytes), 1)
        if self._scratch is None or self._scratch.size < nbytes:
            if self.capturing is not None:
                raise GraphCaptureError(
                    f"scratch of {nbytes} bytes needed while capturing, {self._scratch_size()} "
                    "held; run the step eagerly first"
                )
            if self._scratch is not None:
                self._retired_scratch.append(self._scratch)
            with self._scope:
                self._scratch = cupy.empty(max(nbytes, 2 * self._scratch_size()), np.uint8)
        return self._scratch[:nbytes]

    def _scratch_size(self) -> int:
        return 0 if self._scratch is None else int(self._scratch.size)

    # -- kernels ------------------------------------------------------------
    def launch(self, kdef: KernelDef, ctx: KernelContext, inputs: Sequence[Any]) -> Any:
        with self._scope:
            return kdef.fn(ctx, *inputs)

    # -- graph hooks: one CUDA graph per (slot, part) ----------------------------
    def graph_begin(self, slot: DeviceGraphSlot, part: int) -> None:
        with self._scope:
            self.stream.begin_capture()

    def graph_end(self, slot: DeviceGraphSlot, part: int) -> None:
        with self._scope:
            graph = self.stream.end_capture()
            with contextlib.suppress(Exception):
                graph.upload(self.stream)
        self.graph_reset(slot, part)
        self._graphs[slot, part] = graph

    def graph_abort(self, slot: DeviceGraphSlot, part: int) -> None:
        with contextlib.suppress(Exception), self._scope:
            self.stream.end_capture()

    def graph_replay(self, slot: DeviceGraphSlot, part: int) -> None:
        with self._scope:
            self._graphs[slot, part].launch(self.stream)

    def graph_reset(self, slot: DeviceGraphSlot, part: int) -> None:
        if (slot, part) in self._graphs:
            if self.capturing is None:
                self.stream.synchronize()  # a replay in flight must finish first
            del self._graphs[slot, part]

    def graph_exists(self, slot: DeviceGraphSlot, part: int) -> bool:
        return (slot, part) in self._graphs

    # -- host staging -------------------------------------------------------------
    def _refuse_host_copy(self, what: str) -> None:
        if self.capturing is not None:
            raise GraphCaptureError(
                f"{what} while capturing slot {self.capturing.value!r}: host copies cannot be "
                "recorded into a CUDA graph"
            )

    def _staging_view(self, nbytes: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        """The next free bytes of the pinned staging ring, as an array.

        Uploads queued on the stream read their bytes later, so each takes fresh bytes; the
        ring starts over (after waiting for the stream) only when it is full.
        """
        need = _aligned_size(nbytes)
        if self._staging is None or self._staging_used + need > self._staging.size:
            self.stream.synchronize()  # every queued copy from the ring is done
            self._reset_staging()
            if self._staging is None or self._staging.size < need:
                old = 0 if self._staging is None else 2 * self._staging.size
                size = min(max(need, 1 << 20, old), max(STAGING_MAX, need))
                self._staging_mem = cupy.cuda.alloc_pinned_memory(size)
                self._staging = np.frombuffer(self._staging_mem, np.uint8, size)
        start = self._staging_used
        self._staging_used += need
        return self._staging[start : start + nbytes].view(dtype).reshape(shape)

    def _upload(self, host: np.ndarray, dst: Any) -> None:
        """Contiguous ``host`` into contiguous ``dst`` (same shape and dtype) on the stream."""
        nbytes = int(host.nbytes)
        if nbytes == 0:
            return
        if nbytes > STAGING_MAX:
            dst.set(host, stream=self.stream)  # pageable: returns once the source is consumed
            return
        view = self._staging_view(nbytes, host.dtype, host.shape)
        np.copyto(view, host)
        dst.set(view, stream=self.stream)


def _aligned_size(nbytes: int) -> int:
    """Bytes a staging slot takes: 256-byte aligned, at least one alignment unit."""
    return max(256, -(-nbytes // 256) * 256)


def _shadow_key(array: Any) -> tuple:
    return (int(array.data.ptr), tuple(array.shape), array.dtype.str)


class _DeviceStream:
    """Makes a device and then a stream current (for providers not on device 0)."""

    def __init__(self, device: Any, stream: Any) -> None:
        self._device = device
        self._stream = stream

    def __enter__(self) -> None:
        self._device.__enter__()
        self._stream.__enter__()

    def __exit__(self, *exc: object) -> None:
        self._stream.__exit__(*exc)
        self._device.__exit__(*exc)


class _PendingRead:
    """Host copies queued by ``read_later``: views into the staging ring until the event."""

    def __init__(self, views: list[np.ndarray], event: Any, registry: list, idle: list) -> None:
        self._views, self._event, self._registry, self._idle = views, event, registry, idle
        self._values: list[np.ndarray] | None = None

    def materialize(self) -> None:
        """Copy out of the ring (the caller has synchronized the stream, or the event)."""
        if self._values is None:
            self._values = [v.copy() for v in self._views]
            self._views = []
            self._idle.append(self._event)  # it has fired: free to record again
            self._event = None

    def result(self) -> list[np.ndarray]:
        if self._values is None:
            self._event.synchronize()
            self.materialize()
            if self in self._registry:
                self._registry.remove(self)
        return self._values
