"""The CUDA execution provider: CuPy memory, one non-blocking stream, CUDA graphs per slot.

Everything this provider does goes onto ``self.stream``: kernel launches, device copies and
host copies (through the pinned ring of ``staging.StagingRing``; small integer uploads keep a
host copy in ``host_shadow.HostShadow``). Work queued elsewhere (CuPy's default
stream) is not ordered with it; write into bound buffers under ``with provider.stream:``
or with ``array.set(host, stream=provider.stream)``.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import cupy
import numpy as np

from onnx_genrt.core.device import Device
from onnx_genrt.core.errors import GraphCaptureError, InvalidInputError, KernelError
from onnx_genrt.core.graph_slots import DeviceGraphSlot
from onnx_genrt.core.kernels import GENRT_DOMAIN, KernelContext, KernelDef, KernelRegistry
from onnx_genrt.core.provider import ExecutionProvider, ProviderOption

from . import driver as cuda_driver
from .cublas import WORKSPACE_BYTES, CublasHandle
from .grouped_decode import DECODE_HEAD_GROUPS
from .host_shadow import HostShadow
from .kernels import REGISTRY
from .kernels._common import BF16, bf16_unsupported
from .kernels.contrib_attention import (
    ATTENTION_CLUSTER_MAX_KEYS,
    ATTENTION_CLUSTER_MAX_ROWS,
    ATTENTION_FLASH_MIN_ROWS,
    ATTENTION_GEMM_MIN_ROWS,
    ATTENTION_GROUPED_CLUSTER,
    ATTENTION_GROUPED_CLUSTER_MAX_ROWS,
)
from .kernels.contrib_quant import NBITS_MMA_MIN_ROWS
from .kernels.genrt import PROLOGUE_MAX_ROWS
from .kernels.matmul import (
    MMA_MAX_M,
    MMA_MAX_SPLITS,
    MMA_MIN_ROWS,
    MMA_SPLIT_MIN_K,
    PIECES_MAX_M,
)
from .launch import allow_programmatic, forbid_programmatic
from .staging import MEMCPY_DEVICE_TO_DEVICE, StagingRing

#: Fused ops whose GEMV makes its own activations (an RMS norm or SiluMul, staged per block
#: in shared memory after the first weight loads are issued). On by default: faster on the H200
#: except fp16 at K=4864, where SiluMul into wide float GEMVs stays a launch of its own (see
#: ``genrt.SILU_FLOAT_GEMV_MAX_K``); figures in docs/performance.md.
#: ``gemv_prologues=False`` or ONNX_GENRT_GEMV_PROLOGUES=0 keeps the norm and SiluMul
#: launches.
#: The MLP half of a decoder layer as one cooperative grid (``kernels/_gated_mlp.py``):
#: ``fused_mlp`` (off until timed against the three kernels it replaces).
FUSED_MLP_OP = (GENRT_DOMAIN, "NormGatedMLP")
#: A gated MLP's SiluMul in its gate/up GEMV's store (each activation made once) instead of
#: the down projection's: ``gated_gemv`` (on: the same tokens, 8% / 13% faster at one row in
#: fp16 / int4 on an H100, docs/performance.md).
GATED_GEMV_OPS = frozenset(
    (GENRT_DOMAIN, op) for op in ("NormMatMulSiluMul", "NormMatMulNBitsSiluMul")
)
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

    def holds_dtype(self, dtype: np.dtype) -> bool:
        """CuPy arrays hold booleans, integers, floats and complex numbers of numpy's own
        widths, and bfloat16 where CuPy has it (``bf16_unsupported``); not float8 or int4,
        nor strings and objects."""
        dt = np.dtype(dtype)
        return dt.kind in "biufc" or (dt == BF16 and bf16_unsupported() is None)

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
            "fused_mlp",
            False,
            "let the plan fuse a decoder layer's norm, gate/up projection, SiluMul and down "
            "projection into one cooperative grid (NormGatedMLP; fp16 / bf16, up to 8 rows; "
            "needs gemv_prologues)",
            env="ONNX_GENRT_FUSED_MLP",
        ),
        ProviderOption(
            "gated_gemv",
            True,
            "let the plan move a gated MLP's SiluMul from its down projection into its gate/up "
            "projection (NormMatMulSiluMul, NormMatMulNBitsSiluMul: the gate/up GEMV writes the activations, each "
            "made once; needs gemv_prologues)",
            env="ONNX_GENRT_GATED_GEMV",
        ),
        ProviderOption(
            "gated_mma",
            True,
            "with gated_gemv, gate on the tensor cores (gemm_mma, gemm_mma_nbits4) and in GEMV "
            f"pieces too, up to {PIECES_MAX_M} rows (off: those rows run the projection, then "
            "the SiluMul kernel)",
            env="ONNX_GENRT_GATED_MMA",
        ),
        ProviderOption(
            "prologue_max_rows",
            PROLOGUE_MAX_ROWS,
            "rows (M) up to which a GEMV makes its fused norm or SiluMul itself; more rows "
            "run that prologue as its own kernel before the GEMV",
            env="ONNX_GENRT_PROLOGUE_MAX_ROWS",
        ),
        ProviderOption(
            "mma_min_rows",
            MMA_MIN_ROWS,
            "rows (M) from which MatMul on a transposed fp16/bf16 weight runs on the tensor "
            f"cores, up to {MMA_MAX_M} rows (0: never; gemv_nk up to 16 rows, then cuBLAS). "
            "1 keeps a row's bits the same alone, in a batch and in a verify step; more runs "
            "fewer rows faster on gemv_nk, and batched or speculative rows may then part from "
            "greedy alone at near ties",
            env="ONNX_GENRT_MMA_MIN_ROWS",
        ),
        ProviderOption(
            "mma_max_splits",
            MMA_MAX_SPLITS,
            "the most blocks a tensor-core GEMM splits K over (their parts summed by a second "
            "kernel); 1 never splits. The split depends on K and N only, so a row's bits stay "
            "the same at every row count",
            env="ONNX_GENRT_MMA_MAX_SPLITS",
        ),
        ProviderOption(
            "mma_split_min_k",
            MMA_SPLIT_MIN_K,
            "K below which a tensor-core GEMM never splits K (0: any K may split); a function "
            "of K only, so a row's bits stay the same at every row count",
            env="ONNX_GENRT_MMA_SPLIT_MIN_K",
        ),
        ProviderOption(
            "cublas_in_graphs",
            True,
            "MatMul above the own kernels' rows (and 4-bit MatMulNBits above "
            f"{PIECES_MAX_M} rows, on its dequantized weight) runs cuBLAS on a handle of this "
            "provider bound to its stream, eager and inside CUDA graphs, so prompt chunks "
            f"wider than {PIECES_MAX_M} rows replay graphs (False: CuPy's cuBLAS, eager only; "
            "steps needing it run eagerly, counted as fallbacks)",
            env="ONNX_GENRT_CUBLAS_IN_GRAPHS",
        ),
        ProviderOption(
            "attention_flash_min_rows",
            ATTENTION_FLASH_MIN_ROWS,
            "new rows (a prompt of more than 16) from which fp16/bf16 GroupQueryAttention with "
            "head size 64 or 128 runs the tensor-core flash kernel, eager and captured (0: "
            "never; then attention_gemm_min_rows decides)",
            env="ONNX_GENRT_ATTENTION_FLASH_MIN_ROWS",
        ),
        ProviderOption(
            "attention_gemm_min_rows",
            ATTENTION_GEMM_MIN_ROWS,
            "new rows (a prompt) from which GroupQueryAttention runs as matrix products on "
            "eager runs (0: never; the attention kernels instead)",
            env="ONNX_GENRT_ATTENTION_GEMM_MIN_ROWS",
        ),
        ProviderOption(
            "attention_cluster_max_keys",
            ATTENTION_CLUSTER_MAX_KEYS,
            "KV cache positions up to which decode and verify attention run as one "
            "8-block cluster per row (sm_90+; 0: any); a longer cache spreads over many "
            "blocks per row (attention_grouped_decode)",
            env="ONNX_GENRT_ATTENTION_CLUSTER_MAX_KEYS",
        ),
        ProviderOption(
            "attention_cluster_max_rows",
            ATTENTION_CLUSTER_MAX_ROWS,
            "query rows (batch rows x new tokens) up to which decode and verify attention on a "
            "short cache run the cluster kernel; more rows run the grouped kernel, faster for "
            "a large batch (8: 32 streams 1.3x on an H100) but rounded differently, so a row's "
            "greedy tokens may then depend on the rows sharing its step (0: the cluster "
            "kernel for any number of rows, the same tokens)",
            env="ONNX_GENRT_ATTENTION_CLUSTER_MAX_ROWS",
        ),
        ProviderOption(
            "attention_grouped_cluster",
            ATTENTION_GROUPED_CLUSTER,
            "decode and verify attention on a cache of at most attention_cluster_max_keys "
            "positions run as one 8-block cluster per KV head and row, each key read once for "
            "the group's query heads, the same arithmetic at any batch size (sm_90+; off: one "
            "cluster per query head and row, 1.6% slower at one row and 24% at 32 on the H200)",
            env="ONNX_GENRT_ATTENTION_GROUPED_CLUSTER",
        ),
        ProviderOption(
            "attention_grouped_cluster_max_rows",
            ATTENTION_GROUPED_CLUSTER_MAX_ROWS,
            "query rows (batch rows x new tokens) up to which that cluster launch is used; "
            "more rows run the grouped kernel's plain launch over the fewest splits that cut "
            "the keys as the cluster's 8 do: the same bits, without the idle blocks of a "
            "short cache (0: the cluster for any number of rows)",
            env="ONNX_GENRT_ATTENTION_GROUPED_CLUSTER_MAX_ROWS",
        ),
        ProviderOption(
            "attention_grouped_decode",
            True,  # H200, 0.5B fp16, cache 32768: 644 -> 739 tok/s after 30000 tokens
            "decode and verify attention over a cache longer than attention_cluster_max_keys "
            "run the grouped kernel (one block per split, KV head and row, each key read once "
            "for the group's query heads); off: up to 64 blocks per query row and head",
            env="ONNX_GENRT_ATTENTION_GROUPED_DECODE",
        ),
        ProviderOption(
            "attention_decode_splits",
            0,
            "splits of each KV head and row in the grouped decode kernel (0: sized from the "
            "cache capacity and the SM count; at most 512)",
            env="ONNX_GENRT_ATTENTION_DECODE_SPLITS",
        ),
        ProviderOption(
            "attention_decode_head_groups",
            DECODE_HEAD_GROUPS,
            "warp groups sharing the query heads of a grouped decode block (1, 2 or 4), the same "
            "bits either way (0: two where the launch has fewer blocks than SMs, as at one "
            "row, else one)",
            env="ONNX_GENRT_ATTENTION_DECODE_HEAD_GROUPS",
        ),
        ProviderOption(
            "nbits_mma_min_rows",
            NBITS_MMA_MIN_ROWS,
            "rows (M) from which 4-bit MatMulNBits with fp16/bf16 activations runs on the "
            f"tensor cores, up to {MMA_MAX_M} rows (0: never; the GEMVs instead); 1 keeps a "
            "row's bits independent of its batch, as mma_min_rows",
            env="ONNX_GENRT_NBITS_MMA_MIN_ROWS",
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
            "fp16 activations with integer zero points: 4-bit GEMV math and tensor-core "
            "dequantization on packed halves",
            env="ONNX_GENRT_NBITS_HALF2",
        ),
        ProviderOption(
            # On since session 21: the GPU tests pass with it on (the captured test that once
            # failed met a finalizer inside its capture, now held off: core/collector_pause).
            # H200, 0.5B fp16 (session 18): 1200 -> 1258 tok/s, verify/decode 1.28x -> 1.23x.
            "programmatic_launch",
            True,
            "programmatic dependent launch of the provider's own kernels (sm_90+ and a driver "
            "with cuLaunchKernelEx and cuFuncGetParamInfo): each may start while the one "
            "before it finishes; `programmatic_launch_problem` says why it is not used",
            env="ONNX_GENRT_PROGRAMMATIC_LAUNCH",
        ),
        ProviderOption(
            "pdl_prefetch",
            True,
            "with programmatic launch, the weight-streaming GEMVs prefetch their first "
            "weights into L2 before they wait for the kernel before them",
            env="ONNX_GENRT_PDL_PREFETCH",
        ),
        ProviderOption(
            # 1 by default since session 28 (H100, 0.5B, one stream, in one call: fp16
            # 1222.0 -> 1251.4 tok/s, int4 1436.4 -> 1466.1; 32 streams unchanged; 2: fp16
            # 1193.8, int4 1511.4); the 4-bit GEMVs joined level 1 in session 29 (H100, int4
            # one stream 1447-1450 -> 1487-1496 tok/s, 32 streams even).
            "pdl_early_launch",
            1,
            "with programmatic launch, which kernels let the next one be scheduled as soon "
            "as their own wait returns, so its blocks prefetch their weights into L2 while "
            "they run (else once their blocks end): 0 none, 1 the decode attention kernels "
            "and the 4-bit one-row GEMVs, 2 every kernel",
            env="ONNX_GENRT_PDL_EARLY_LAUNCH",
        ),
    )

    def __init__(self, device_id: int = 0, **options: Any) -> None:
        super().__init__(**options)
        #: Whether the plan may fuse norms and SiluMul into GEMVs (``GEMV_PROLOGUE_OPS``).
        self.gemv_prologues = self.option("gemv_prologues")
        #: Whether the plan may fuse a layer's MLP half into one grid (``FUSED_MLP_OP``).
        self.fused_mlp = self.option("fused_mlp")
        self._index = int(device_id)
        self._device = Device("cuda", self._index)
        self._cuda_device = cupy.cuda.Device(self._index)
        with self._cuda_device:
            self.stream = cupy.cuda.Stream(non_blocking=True)
        self._scope = (
            self.stream if self._index == 0 else _DeviceStream(self._cuda_device, self.stream)
        )
        self._graphs: dict[tuple[DeviceGraphSlot, int], Any] = {}
        #: Host <-> device transfers through pinned memory, on ``stream``.
        self.staging = StagingRing(self.stream, self._scope)
        #: Host copies of the small integer arrays uploaded (``host_value``).
        self.shadow = HostShadow()
        self._cublas: CublasHandle | None = None
        self._cublas_error: KernelError | None = None
        #: Why the provider's kernels are not launched programmatically (None: they are, on
        #: ``stream``; see the ``programmatic_launch`` option and ``launch.Kernel``).
        self.programmatic_launch_problem = self._programmatic_problem()
        early = self.option("pdl_early_launch")
        if early not in (0, 1, 2):
            raise InvalidInputError(
                f"provider 'cuda' option 'pdl_early_launch' must be 0, 1 or 2, got {early!r}"
            )
        if self.programmatic_launch_problem is None:
            allow_programmatic(
                self.stream,
                prefetch=self.option("pdl_prefetch"),
                early=early,
            )
            weakref.finalize(self, forbid_programmatic, int(self.stream.ptr))

    # -- cuBLAS ---------------------------------------------------------------
    @property
    def cublas(self) -> CublasHandle:
        """This provider's cuBLAS handle, bound to ``stream`` with a workspace of its own
        memory (made on first use, which must not be inside a capture: ``graph_begin``
        makes it first). A :class:`KernelError` when cuBLAS cannot be opened, every time."""
        if self._cublas is None:
            if self._cublas_error is not None:
                raise self._cublas_error
            if self.capturing is not None:
                raise GraphCaptureError(
                    "the cuBLAS handle is made outside a capture (graph_begin makes it)"
                )
            try:
                with self._scope:
                    workspace = cupy.empty(WORKSPACE_BYTES, np.uint8)
                    self._cublas = CublasHandle(self.stream.ptr, workspace)
            except KernelError as exc:
                self._cublas_error = exc
                raise
        return self._cublas

    @property
    def graph_max_rows(self) -> int | None:
        """Rows (M) up to which matrix products on constant weights record into a graph:
        any with ``cublas_in_graphs``, else the own kernels' PIECES_MAX_M."""
        return None if self.option("cublas_in_graphs") else PIECES_MAX_M

    # -- programmatic dependent launch ------------------------------------------
    def _programmatic_problem(self) -> str | None:
        if not self.option("programmatic_launch"):
            return "off (programmatic_launch=False or ONNX_GENRT_PROGRAMMATIC_LAUNCH=0)"
        cc = int(self._cuda_device.compute_capability)
        return cuda_driver.programmatic_launch_problem(cc, cuda_driver.load())

    @property
    def programmatic_launch(self) -> bool:
        """Whether this provider's kernels launch with programmatic dependent launch."""
        return self.programmatic_launch_problem is None

    def status_notes(self) -> tuple[str, ...]:
        if self.programmatic_launch_problem is None:
            prefetch = "with" if self.option("pdl_prefetch") else "without"
            level = self.option("pdl_early_launch")
            early = f", early launch {level}" if level else ""
            return (f"programmatic launch: on ({prefetch} L2 weight prefetch{early})",)
        return (f"programmatic launch: {self.programmatic_launch_problem}",)

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
        if (domain, op_type) == FUSED_MLP_OP and not (self.gemv_prologues and self.fused_mlp):
            return None
        if (domain, op_type) in GATED_GEMV_OPS and not self.option("gated_gemv"):
            return None
        return super().get_kernel(domain, op_type, opset)

    def empty(self, shape: Sequence[int], dtype: Any) -> Any:
        """An uninitialised CuPy array on this device (from CuPy's pool)."""
        dt = np.dtype(dtype)
        self._check_dtype(dt)
        with self._scope:
            return cupy.empty(tuple(int(s) for s in shape), dt)

    @staticmethod
    def _check_dtype(dtype: np.dtype) -> None:
        """A clear error for a bfloat16 tensor on a CuPy without bfloat16."""
        if dtype == BF16:
            reason = bf16_unsupported()
            if reason:
                raise TypeError(reason)

    def upload(self, host: Any, out: Any = None) -> Any:
        """Through the pinned staging ring, on the stream. Without ``out``, a small integer
        array (shapes, axes, slice bounds) also keeps a host copy (``host_value``): do not
        write such arrays in place afterwards except through ``upload``."""
        if isinstance(host, cupy.ndarray) and out is None:
            return host
        self._refuse_host_copy("host-to-device copy")
        host = np.asarray(host)
        if out is None:
            host = np.asarray(host, order="C")  # ascontiguousarray would make 0-d 1-d
            dst = self.empty(host.shape, host.dtype)
            self.staging.upload(host, dst)
            self.shadow.keep(dst, host)
            return dst
        self.shadow.forget(out)  # overwritten: its host copy is stale
        if host.shape != out.shape or host.dtype != out.dtype or not host.flags.c_contiguous:
            host = np.asarray(np.broadcast_to(host, out.shape), dtype=out.dtype, order="C")
        if out.flags.c_contiguous:
            self.staging.upload(host, out)
        else:
            tmp = self.empty(host.shape, host.dtype)
            self.staging.upload(host, tmp)
            with self._scope:
                cupy.copyto(out, tmp)
        return out

    def read(self, arrays: Sequence[Any]) -> list[np.ndarray]:
        """Small arrays queued to pinned memory one after another, then one wait; larger
        or strided ones one at a time."""
        self._refuse_host_copy("device-to-host copy")
        values = self.staging.read(arrays)
        if values is not None:
            return values
        return [
            self.staging.download(a) if isinstance(a, cupy.ndarray) else np.array(a, copy=True)
            for a in arrays
        ]

    ASYNC_READS = True

    def read_later(self, arrays: Sequence[Any]) -> Callable[[], list[np.ndarray]]:
        """Small device arrays queued to pinned memory behind the stream's work, and an
        event; the returned call waits on that event only, so later steps can be queued
        (and run) before the host looks at these values."""
        self._refuse_host_copy("device-to-host copy")
        later = self.staging.read_later(arrays)
        return later if later is not None else super().read_later(arrays)

    def copy(self, src: Any, dst: Any) -> None:
        """Device to device on the stream: one async memcpy for contiguous arrays of one
        shape and dtype, else ``cupy.copyto``. A host array on either side (deprecated) is
        uploaded or read back."""
        if not isinstance(src, cupy.ndarray):
            self.upload(src, dst)
            return
        if not isinstance(dst, cupy.ndarray):
            np.copyto(dst, self.read([src])[0])
            return
        same = src.dtype == dst.dtype and src.shape == dst.shape
        if same and src.flags.c_contiguous and dst.flags.c_contiguous:
            if src.nbytes:
                cupy.cuda.runtime.memcpyAsync(
                    dst.data.ptr, src.data.ptr, int(src.nbytes), MEMCPY_DEVICE_TO_DEVICE,
                    self.stream.ptr,
                )  # fmt: skip
            return
        with self._scope:
            cupy.copyto(dst, src)

    def synchronize(self) -> None:
        self.stream.synchronize()

    def host_value(self, array: Any) -> np.ndarray | None:
        """The host copy kept when a small integer array was uploaded (None if not kept)."""
        if not isinstance(array, cupy.ndarray):
            return np.asarray(array)
        return self.shadow.lookup(array)

    def host_shadow(self, array: Any) -> np.ndarray | None:
        """Deprecated: ``host_value(array)``."""
        return self.host_value(array)

    def _refuse_host_copy(self, what: str) -> None:
        if self.capturing is not None:
            raise GraphCaptureError(
                f"{what} while capturing slot {self.capturing.value!r}: host copies cannot be "
                "recorded into a CUDA graph"
            )

    # -- kernels ------------------------------------------------------------
    def launch(self, kdef: KernelDef, ctx: KernelContext, inputs: Sequence[Any]) -> Any:
        with self._scope:
            return kdef.fn(ctx, *inputs)

    # -- graph hooks: one CUDA graph per (slot, part) ----------------------------
    def graph_begin(self, slot: DeviceGraphSlot, part: int) -> None:
        if self.option("cublas_in_graphs") and self._cublas is None:
            # Made before the stream records. Without cuBLAS, graphs that need no GEMM still
            # capture; a MatMul that needs it raises the kept error, and its step runs
            # eagerly with that reason.
            with contextlib.suppress(KernelError):
                self.cublas  # noqa: B018
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
