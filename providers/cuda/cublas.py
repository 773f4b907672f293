"""cuBLAS GEMMs on a handle the CUDA provider owns, which a CUDA graph capture can record.

CuPy refuses its cuBLAS calls while a stream captures (its handle's ``setStream`` raises), so
a MatMul above the own kernels' rows could only run eagerly. The library CuPy loaded is
opened again with ctypes; :class:`CublasHandle` keeps one handle per provider stream, made
outside any capture, bound to the stream once, with a workspace of the provider's memory
that stays at its address (without one, cuBLAS allocates a workspace inside each capture).
cuBLAS records its kernels into the capture like any launch; alpha and beta are read from
the host when a call is issued, so a replay repeats them.

Arrays are row-major; cuBLAS is column-major. A row-major ``[R, C]`` buffer read as
column-major is its transpose, so ``C = A @ W`` is issued as ``C^T = W^T A^T``
(:func:`gemm_arguments`). All products accumulate in float32 (``CUBLAS_COMPUTE_32F``:
no TF32 for float32 operands); float16 and bfloat16 are stored as such.

Enum values and signatures follow NVIDIA's cuBLAS reference (``cublas_api.h`` and
``library_types.h``), checked against its published bindings: cudaDataType_t ``CUDA_R_32F``
0, ``CUDA_R_16F`` 2, ``CUDA_R_16BF`` 14; cublasOperation_t N 0, T 1;
``CUBLAS_COMPUTE_32F`` 68; ``CUBLAS_GEMM_DEFAULT`` -1. ``cublasSetStream`` resets the
workspace to cuBLAS's own pool, so the workspace is set after the stream.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import os
import weakref
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from onnx_genrt.core.errors import KernelError
from onnx_genrt.core.kernels import TransposedWeight

#: cudaDataType_t of the element types the GEMM takes.
CUDA_R_32F = 0
CUDA_R_16F = 2
CUDA_R_16BF = 14
DATA_TYPES: dict[np.dtype, int] = {
    np.dtype(np.float32): CUDA_R_32F,
    np.dtype(np.float16): CUDA_R_16F,
    np.dtype(ml_dtypes.bfloat16): CUDA_R_16BF,
}
#: cublasOperation_t.
OP_N = 0
OP_T = 1
#: cublasComputeType_t: float32 accumulation, no down-conversion of float32 inputs.
COMPUTE_32F = 68
#: cublasGemmAlgo_t: cuBLAS's heuristics pick the kernel.
GEMM_DEFAULT = -1
#: Bytes of the handle's workspace (cuBLAS asks for 32 MiB on Hopper for its best kernels).
WORKSPACE_BYTES = 32 << 20
#: Largest value cuBLAS's 32-bit dimension and leading-dimension arguments take.
_INT_MAX = (1 << 31) - 1

_c_int, _c_ll, _c_ptr = ctypes.c_int, ctypes.c_longlong, ctypes.c_void_p
#: ctypes argument types of the functions called, from the cuBLAS reference.
SIGNATURES: dict[str, list[Any]] = {
    "cublasCreate_v2": [ctypes.POINTER(_c_ptr)],
    "cublasDestroy_v2": [_c_ptr],
    "cublasSetStream_v2": [_c_ptr, _c_ptr],
    "cublasSetWorkspace_v2": [_c_ptr, _c_ptr, ctypes.c_size_t],
    # handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype,
    # ldc, computeType, algo
    "cublasGemmEx": [_c_ptr, _c_int, _c_int, _c_int, _c_int, _c_int, _c_ptr]
    + [_c_ptr, _c_int, _c_int, _c_ptr, _c_int, _c_int, _c_ptr, _c_ptr, _c_int, _c_int]
    + [_c_int, _c_int],
    # as cublasGemmEx, with strideA after lda, strideB after ldb, strideC and batchCount
    # after ldc (strides in elements)
    "cublasGemmStridedBatchedEx": [_c_ptr, _c_int, _c_int, _c_int, _c_int, _c_int, _c_ptr]
    + [_c_ptr, _c_int, _c_int, _c_ll, _c_ptr, _c_int, _c_int, _c_ll, _c_ptr]
    + [_c_ptr, _c_int, _c_int, _c_ll, _c_int, _c_int, _c_int],
}


# ----------------------------------------------------------------------------- the library


def mapped_cublas(maps: str) -> list[str]:
    """Paths of the cuBLAS library (not cuBLASLt) in the text of ``/proc/self/maps``."""
    found = []
    for line in maps.splitlines():
        parts = line.split(maxsplit=5)
        path = parts[5].strip() if len(parts) == 6 else ""
        if os.path.basename(path).startswith("libcublas.so") and path not in found:
            found.append(path)
    return found


def _loaded_by_cupy() -> list[str]:
    """Where the cuBLAS that CuPy uses was loaded from (made to load first)."""
    try:
        import cupy

        cupy.cuda.device.get_cublas_handle()
    except Exception:  # noqa: BLE001  (then the name lookup below decides)
        return []
    try:
        with open("/proc/self/maps") as f:
            return mapped_cublas(f.read())
    except OSError:
        return []


_LIBRARY: ctypes.CDLL | None = None


def library() -> ctypes.CDLL:
    """The cuBLAS library CuPy loaded (the same file, so one copy lives in the process), else
    the one the loader finds by name; a :class:`KernelError` saying what to change when
    neither opens or lacks a function called here."""
    global _LIBRARY
    if _LIBRARY is not None:
        return _LIBRARY
    tried: list[str] = []
    candidates = _loaded_by_cupy()
    by_name = ctypes.util.find_library("cublas")
    candidates += [by_name] if by_name else []
    candidates += ["libcublas.so.13", "libcublas.so.12", "libcublas.so.11"]
    for path in candidates:
        try:
            lib = ctypes.CDLL(path)
        except OSError as exc:
            tried.append(f"{path} ({exc})")
            continue
        missing = [name for name in SIGNATURES if not hasattr(lib, name)]
        if missing:
            tried.append(f"{path} (no {', '.join(missing)})")
            continue
        for name, argtypes in SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
        _LIBRARY = lib
        return lib
    raise KernelError(
        "cuBLAS for CUDA graphs: no usable libcublas (tried: "
        + "; ".join(tried)
        + "). Install the cuBLAS of CuPy's CUDA (for example the nvidia-cublas wheel), or set "
        "the CUDA provider option cublas_in_graphs=False (ONNX_GENRT_CUBLAS_IN_GRAPHS=0): "
        "MatMul above 64 rows then runs CuPy's matmul, eagerly only"
    )


def status_text(lib: Any, status: int) -> str:
    """cuBLAS's name for a status code (``cublasGetStatusName`` where the library has it)."""
    getter = getattr(lib, "cublasGetStatusName", None)
    if getter is None:
        return f"status {status}"
    getter.argtypes, getter.restype = [ctypes.c_int], ctypes.c_char_p
    name = getter(status)
    return f"{name.decode()} ({status})" if name else f"status {status}"


# ----------------------------------------------------------------------------- arguments


@dataclass(frozen=True)
class GemmShape:
    """``C[b] = A[b] @ W[b]`` for ``b < batch``, row-major: A ``[M, K]``, C ``[M, N]``, and W
    ``[K, N]``, or, ``transposed``, a transposed weight's ``t`` ``[N, K]``. Strides are in
    elements between batches; 0 shares one A or W across the batch."""

    m: int
    k: int
    n: int
    transposed: bool = False
    batch: int = 1
    a_stride: int = 0
    w_stride: int = 0

    def check(self) -> None:
        """Refuse what cuBLAS's 32-bit arguments cannot say (KernelError)."""
        dims = {"M": self.m, "K": self.k, "N": self.n, "batch": self.batch}
        bad = [f"{k}={v}" for k, v in dims.items() if not 1 <= v <= _INT_MAX]
        if bad:
            raise KernelError(f"cuBLAS GEMM of {self}: {', '.join(bad)} out of [1, 2**31)")


def matmul_gemm_shape(a_shape: tuple[int, ...], b_shape: tuple[int, ...]) -> GemmShape | None:
    """How cuBLAS runs ``a @ b`` (numpy's matmul rules; the shapes already checked): B of
    one or two dims folds A's leading dims into M; batched operands share batch dims, or one
    side's are all ones (one matrix for the whole batch: stride 0). None where batch dims
    broadcast otherwise (say [2, 1] against [1, 3])."""
    k = int(a_shape[-1])
    if len(b_shape) <= 2:
        n = 1 if len(b_shape) == 1 else int(b_shape[-1])
        return GemmShape(math.prod(a_shape[:-1]), k, n)
    n = int(b_shape[-1])
    m = 1 if len(a_shape) == 1 else int(a_shape[-2])
    a_batch, b_batch = tuple(a_shape[:-2]), tuple(b_shape[:-2])
    full = np.broadcast_shapes(a_batch, b_batch)

    def stride(own: tuple[int, ...], size: int) -> int | None:
        if (1,) * (len(full) - len(own)) + own == full:
            return size
        return 0 if math.prod(own) == 1 else None

    a_stride, w_stride = stride(a_batch, m * k), stride(b_batch, k * n)
    if a_stride is None or w_stride is None:
        return None
    return GemmShape(m, k, n, batch=math.prod(full), a_stride=a_stride, w_stride=w_stride)


def gemm_arguments(
    handle: int, shape: GemmShape, dtype: np.dtype, a: int, w: int, c: int, scalars: tuple
) -> tuple[str, tuple]:
    """The cuBLAS function and its arguments for ``shape`` on device addresses ``a``, ``w``,
    ``c`` of ``dtype`` elements; ``scalars`` are references to the float32 alpha and beta.

    Column-major, the product is ``C^T [N, M] = op(W) [N, K] @ A^T [K, M]``: A's buffer is
    ``A^T`` with leading dimension K; a row-major W ``[K, N]`` is ``W^T`` (no op, ld N); a
    transposed weight ``t [N, K]`` is W (op T, ld K); C's buffer is ``C^T`` with ld N.
    """
    s = shape
    code = DATA_TYPES[np.dtype(dtype)]
    op_w, ld_w = (OP_T, s.k) if s.transposed else (OP_N, s.n)
    alpha, beta = scalars
    head = (handle, op_w, OP_N, s.n, s.m, s.k, alpha)
    if s.batch == 1:
        args = (*head, w, code, ld_w, a, code, s.k, beta, c, code, s.n, COMPUTE_32F, GEMM_DEFAULT)
        return "cublasGemmEx", args
    args = (*head, w, code, ld_w, s.w_stride, a, code, s.k, s.a_stride, beta, c, code, s.n)
    args += (s.m * s.n, s.batch, COMPUTE_32F, GEMM_DEFAULT)
    return "cublasGemmStridedBatchedEx", args


# ----------------------------------------------------------------------------- the handle


def _destroy(lib: ctypes.CDLL, handle: ctypes.c_void_p, workspace: Any) -> None:
    """Drop the handle. ``workspace`` is only held: the finalizer's reference keeps the
    memory alive until the handle that may use it is gone."""
    lib.cublasDestroy_v2(handle)


class CublasHandle:
    """A cuBLAS handle bound to one stream, with a workspace that never moves.

    Make it outside any capture, with the stream's device current; ``workspace`` is a
    device array of at least one byte (the provider's memory) that the handle keeps.
    """

    def __init__(self, stream_ptr: int, workspace: Any) -> None:
        self._lib = library()
        self.stream_ptr = int(stream_ptr)
        self.workspace = workspace
        handle = ctypes.c_void_p()
        self._call("cublasCreate_v2", ctypes.byref(handle))
        self._handle = handle
        self._finalizer = weakref.finalize(self, _destroy, self._lib, handle, workspace)
        self._finalizer.atexit = False  # the CUDA context may be gone by then
        self._call("cublasSetStream_v2", handle, ctypes.c_void_p(self.stream_ptr))
        ptr, size = int(workspace.data.ptr), int(workspace.nbytes)
        self._call("cublasSetWorkspace_v2", handle, ctypes.c_void_p(ptr), ctypes.c_size_t(size))
        self._alpha, self._beta = ctypes.c_float(1.0), ctypes.c_float(0.0)

    def _call(self, name: str, *args: Any, where: str = "") -> None:
        status = getattr(self._lib, name)(*args)
        if status != 0:
            raise KernelError(
                f"{where + ': ' if where else ''}{name} failed: {status_text(self._lib, status)}"
            )

    def gemm(
        self,
        a: Any,
        w: Any,
        c: Any,
        shape: GemmShape,
        *,
        accumulate: bool = False,
        where: str = "",
    ) -> None:
        """``c = a @ w`` (``c += a @ w`` with ``accumulate``) on this handle's stream.

        ``a``, ``w`` and ``c`` are C-contiguous device arrays of one float dtype (float32,
        float16 or bfloat16), ``w`` a weight ``[K, N]`` (or batches of them) or a
        :class:`TransposedWeight`; ``shape`` says how they are read. ``where`` (the node)
        prefixes errors.
        """
        transposed = isinstance(w, TransposedWeight)
        wa = w.t if transposed else w
        if transposed != shape.transposed:
            raise KernelError(f"{where}: GEMM shape {shape} does not match the weight's layout")
        dtype = np.dtype(a.dtype)
        if dtype not in DATA_TYPES or wa.dtype != dtype or c.dtype != dtype:
            raise KernelError(
                f"{where}: cuBLAS GEMM takes float32, float16 or bfloat16 operands of one "
                f"dtype, got {a.dtype}, {wa.dtype}, {c.dtype}"
            )
        shape.check()
        s = shape
        need = {
            "A": (a, (s.batch - 1) * s.a_stride + s.m * s.k),
            "W": (wa, (s.batch - 1) * s.w_stride + s.k * s.n),
            "C": (c, s.batch * s.m * s.n),
        }
        for name, (x, size) in need.items():
            if not x.flags.c_contiguous or x.size < size or (name == "C" and x.size != size):
                raise KernelError(
                    f"{where}: GEMM operand {name} {list(x.shape)} is not a contiguous array "
                    f"of {size} elements for {shape}"
                )
        self._beta.value = 1.0 if accumulate else 0.0
        name, args = gemm_arguments(
            self._handle.value or 0,
            shape,
            dtype,
            int(a.data.ptr),
            int(wa.data.ptr),
            int(c.data.ptr),
            (ctypes.byref(self._alpha), ctypes.byref(self._beta)),
        )
        self._call(name, *args, where=where)

    def close(self) -> None:
        """Destroy the handle now (also done when the object is collected)."""
        self._finalizer()
