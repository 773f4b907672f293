"""The host side of ``providers/cuda/cublas.py`` on the CPU, against a stand-in cuBLAS.

The stand-in implements the column-major BLAS contract of ``cublasGemmEx`` and
``cublasGemmStridedBatchedEx`` from NVIDIA's reference (``op(A)`` m x k, leading dimensions
at least the stored rows, strides in elements, the cudaDataType_t and compute-type codes)
in float64 over host memory, so the row-major mapping (transposes, leading dimensions,
batch strides, broadcast operands, beta) is checked against numpy's matmul without a GPU.
The GPU tests (``test_cuda_cublas.py``) run the same calls on the real library.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from onnx_genrt.core.errors import KernelError
from onnx_genrt.core.kernels import TransposedWeight
from onnx_genrt.providers.cuda import cublas
from onnx_genrt.providers.cuda.cublas import CublasHandle, GemmShape, matmul_gemm_shape

BF16 = np.dtype(ml_dtypes.bfloat16)
#: cudaDataType_t codes as NVIDIA's library_types.h defines them (written out here, not
#: taken from the module under test).
CODES = {0: np.dtype(np.float32), 2: np.dtype(np.float16), 14: BF16}
TOL = {np.dtype(np.float32): 1e-5, np.dtype(np.float16): 2e-3, BF16: 1e-2}


#: (address, bytes) of every host buffer handed out as a device array: the stand-in
#: refuses to read or write outside them (a wrong mapping fails instead of crashing).
_BUFFERS: list[tuple[int, int]] = []


def _view(ptr: int, rows: int, cols: int, ld: int, dtype: np.dtype) -> np.ndarray:
    """The column-major ``rows x cols`` matrix at ``ptr`` with leading dimension ``ld``."""
    count = ld * (cols - 1) + rows
    end = ptr + count * dtype.itemsize
    assert any(lo <= ptr and end <= lo + size for lo, size in _BUFFERS), "outside the operands"
    raw = (ctypes.c_uint8 * (count * dtype.itemsize)).from_address(ptr)
    flat = np.frombuffer(raw, dtype=dtype)
    return np.lib.stride_tricks.as_strided(
        flat, (rows, cols), (dtype.itemsize, ld * dtype.itemsize), writeable=True
    )


class FakeBlas:
    """The cuBLAS functions ``CublasHandle`` calls, per the documented contract. Each is a
    C function pointer of the prototype ``cublas.SIGNATURES`` declares (the argtypes the
    real library gets), so arguments go through ctypes' conversions as they would there."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple]] = []
        self.stream = self.workspace = None
        #: Exceptions raised inside the functions (ctypes would only print them): each call
        #: that raised returned CUBLAS_STATUS_INVALID_VALUE; the fixture re-raises them.
        self.errors: list[BaseException] = []
        self._keep = []
        for name, argtypes in cublas.SIGNATURES.items():
            fn = ctypes.CFUNCTYPE(ctypes.c_int, *argtypes)(self._guarded(getattr(self, "_" + name)))
            self._keep.append(fn)
            setattr(self, name, fn)

    def _guarded(self, fn):
        def call(*args):
            try:
                return fn(*args)
            except BaseException as exc:  # noqa: BLE001  (kept for the fixture)
                self.errors.append(exc)
                return 7

        return call

    def _log(self, name: str, args: tuple) -> None:
        self.calls.append((name, args))

    def _cublasCreate_v2(self, ref) -> int:
        ref[0] = 0x1234
        self._log("create", ())
        return 0

    def _cublasDestroy_v2(self, handle) -> int:
        self._log("destroy", ())
        return 0

    def _cublasSetStream_v2(self, handle, stream) -> int:
        self.stream, self.workspace = stream, None  # resets the workspace (reference)
        self._log("stream", (stream,))
        return 0

    def _cublasSetWorkspace_v2(self, handle, ptr, size) -> int:
        self.workspace = (ptr, size)
        self._log("workspace", self.workspace)
        return 0

    def _cublasGemmEx(self, handle, ta, tb, m, n, k, alpha, a, at, lda, b, bt, ldb, beta, c, ct,
                      ldc, compute, algo) -> int:  # fmt: skip
        return self._cublasGemmStridedBatchedEx(
            handle, ta, tb, m, n, k, alpha, a, at, lda, 0, b, bt, ldb, 0, beta, c, ct, ldc, 0,
            1, compute, algo,
        )  # fmt: skip

    def _cublasGemmStridedBatchedEx(self, handle, ta, tb, m, n, k, alpha, a, at, lda, sa, b, bt,
                                   ldb, sb, beta, c, ct, ldc, sc, count, compute, algo) -> int:  # fmt: skip
        self._log("gemm", (ta, tb, m, n, k, lda, ldb, ldc, sa, sb, sc, count))
        if count == 0:  # a call that only reports its arguments (test_strides_...)
            return 0
        assert handle == 0x1234 and self.workspace is not None, "workspace set after the stream"
        assert compute == 68 and algo == -1  # CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT
        assert at == bt == ct and at in CODES
        assert ta in (0, 1) and tb in (0, 1)
        dt = CODES[at]
        rows_a, cols_a = (m, k) if ta == 0 else (k, m)
        rows_b, cols_b = (k, n) if tb == 0 else (n, k)
        if lda < max(1, rows_a) or ldb < max(1, rows_b) or ldc < max(1, m):
            return 7  # CUBLAS_STATUS_INVALID_VALUE
        al = ctypes.c_float.from_address(alpha).value
        be = ctypes.c_float.from_address(beta).value
        size = dt.itemsize
        for i in range(count):
            op_a = _view(a + i * sa * size, rows_a, cols_a, lda, dt).astype(np.float64)
            op_b = _view(b + i * sb * size, rows_b, cols_b, ldb, dt).astype(np.float64)
            op_a = op_a if ta == 0 else op_a.T
            op_b = op_b if tb == 0 else op_b.T
            out = _view(c + i * sc * size, m, n, ldc, dt)
            value = al * (op_a @ op_b)
            if be != 0:  # with beta 0, C is not read (it may hold NaN)
                value += be * out.astype(np.float64)
            out[...] = value.astype(dt)
        return 0


@dataclass
class _Data:
    ptr: int


class HostArray:
    """A numpy array with the members of a CuPy array that ``CublasHandle.gemm`` reads."""

    def __init__(self, values: np.ndarray) -> None:
        self.values = np.ascontiguousarray(values)
        self.data = _Data(self.values.ctypes.data)
        _BUFFERS.append((self.values.ctypes.data, self.values.nbytes))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.values, name)


@pytest.fixture
def fake(monkeypatch) -> Iterator[FakeBlas]:
    lib = FakeBlas()
    monkeypatch.setattr(cublas, "library", lambda: lib)
    yield lib
    _BUFFERS.clear()
    if lib.errors:
        raise lib.errors[0]


def _handle(fake: FakeBlas) -> CublasHandle:
    workspace = HostArray(np.zeros(64, np.uint8))
    return CublasHandle(0xBEEF, workspace)


def _operands(rng, dtype, batch_a, batch_w, m, k, n):
    a = rng.standard_normal((*batch_a, m, k)).astype(dtype)
    w = (rng.standard_normal((*batch_w, k, n)) / np.sqrt(k)).astype(dtype)
    return a, w


@pytest.mark.parametrize("dtype", [np.float32, np.float16, BF16], ids=str)
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("mkn", [(1, 1, 1), (65, 24, 40), (100, 33, 17), (512, 20, 6)])
def test_a_gemm_equals_numpy(fake, rng, dtype, transposed, mkn):
    """``c = a @ w`` for a weight [K, N] and for its transposed prepack [N, K]; M of 65, 100
    and 512 rows, K not a multiple of 8."""
    m, k, n = mkn
    a, w = _operands(rng, dtype, (), (), m, k, n)
    handle = _handle(fake)
    weight = TransposedWeight(HostArray(w.T)) if transposed else HostArray(w)
    c = HostArray(np.full((m, n), np.nan, dtype))
    handle.gemm(HostArray(a), weight, c, GemmShape(m, k, n, transposed=transposed))
    want = a.astype(np.float64) @ w.astype(np.float64)
    tol = TOL[np.dtype(dtype)]
    np.testing.assert_allclose(c.values.astype(np.float64), want, rtol=tol, atol=tol)
    assert [name for name, _ in fake.calls] == ["create", "stream", "workspace", "gemm"]
    assert fake.calls[1][1] == (0xBEEF,)


def test_accumulate_adds_to_c(fake, rng):
    """``accumulate`` (beta 1) adds the products to what ``c`` holds (a bias), and the next
    call without it overwrites."""
    a, w = _operands(rng, np.float32, (), (), 70, 16, 8)
    bias = rng.standard_normal(8).astype(np.float32)
    handle = _handle(fake)
    c = HostArray(np.broadcast_to(bias, (70, 8)).copy())
    shape = GemmShape(70, 16, 8, transposed=True)
    handle.gemm(HostArray(a), TransposedWeight(HostArray(w.T)), c, shape, accumulate=True)
    want = a.astype(np.float64) @ w + bias
    np.testing.assert_allclose(c.values, want, rtol=1e-5, atol=1e-5)
    handle.gemm(HostArray(a), TransposedWeight(HostArray(w.T)), c, shape)
    np.testing.assert_allclose(c.values, a.astype(np.float64) @ w, rtol=1e-5, atol=1e-5)


MATMUL_SHAPES = [
    ((3, 70, 16), (16, 9)),  # leading dims fold into M = 210
    ((2, 3, 33, 8), (2, 3, 8, 5)),  # same batch dims
    ((33, 8), (4, 8, 5)),  # A shared by B's batch
    ((1, 33, 8), (4, 8, 5)),  # A's batch all ones
    ((4, 33, 8), (1, 8, 5)),  # W shared by A's batch
    ((2, 1, 20, 8), (1, 1, 8, 6)),
    ((8,), (3, 8, 5)),  # 1-D A
    ((70, 8), (8,)),  # 1-D B
]


@pytest.mark.parametrize(("a_shape", "b_shape"), MATMUL_SHAPES)
def test_matmul_shapes_equal_numpy_matmul(fake, rng, a_shape, b_shape):
    """``matmul_gemm_shape`` then the GEMM give numpy's matmul, broadcasting included."""
    a = rng.standard_normal(a_shape).astype(np.float32)
    b = rng.standard_normal(b_shape).astype(np.float32)
    want = np.matmul(a.astype(np.float64), b.astype(np.float64))
    shape = matmul_gemm_shape(a_shape, b_shape)
    assert shape is not None
    c = HostArray(np.full(want.shape, np.nan, np.float32))
    _handle(fake).gemm(HostArray(a), HostArray(b), c, shape)
    np.testing.assert_allclose(c.values, want, rtol=1e-5, atol=1e-5)
    batched = [args for name, args in fake.calls if name == "gemm"][0][-1] > 1
    assert batched == (len(b_shape) > 2 and shape.batch > 1)


@pytest.mark.parametrize(
    ("a_shape", "b_shape"), [((2, 1, 5, 8), (1, 3, 8, 4)), ((2, 5, 8), (3, 1, 8, 4))]
)
def test_partly_broadcast_batches_have_no_gemm_shape(a_shape, b_shape):
    """Batches that broadcast on both sides are not one strided GEMM: the MatMul kernel
    then takes CuPy's matmul (eager) or raises CaptureUnsupported while capturing."""
    np.broadcast_shapes(a_shape[:-2], b_shape[:-2])  # valid for numpy's matmul
    assert matmul_gemm_shape(a_shape, b_shape) is None


def test_bad_operands_are_refused_with_the_node_named(fake, rng):
    handle = _handle(fake)
    a = HostArray(np.zeros((4, 8), np.float16))
    w = HostArray(np.zeros((8, 3), np.float32))
    c = HostArray(np.zeros((4, 3), np.float16))
    with pytest.raises(KernelError, match="node7: cuBLAS GEMM takes .* of one dtype"):
        handle.gemm(a, w, c, GemmShape(4, 8, 3), where="node7")
    with pytest.raises(KernelError, match="does not match the weight's layout"):
        handle.gemm(a, HostArray(np.zeros((8, 3), np.float16)), c, GemmShape(4, 8, 3, True))
    with pytest.raises(KernelError, match="operand C"):
        handle.gemm(a, HostArray(np.zeros((8, 3), np.float16)), a, GemmShape(4, 8, 3))
    with pytest.raises(KernelError, match="out of"):
        GemmShape(0, 8, 3).check()
    assert [n for n, _ in fake.calls] == ["create", "stream", "workspace"]


def test_a_failed_call_names_the_function_and_status(fake):
    fake.cublasGemmEx = lambda *args: 13  # CUBLAS_STATUS_EXECUTION_FAILED
    a, w, c = (HostArray(np.zeros(s, np.float32)) for s in ((2, 4), (4, 3), (2, 3)))
    with pytest.raises(KernelError, match=r"n1: cublasGemmEx failed: status 13"):
        _handle(fake).gemm(a, w, c, GemmShape(2, 4, 3), where="n1")


def test_the_library_is_the_one_cupy_mapped():
    maps = (
        "7f00-7f01 r-xp 00000000 08:01 12 /usr/lib/libc.so.6\n"
        "7f02-7f03 r-xp 00000000 08:01 13 /site/nvidia/cu13/lib/libcublasLt.so.13\n"
        "7f04-7f05 r-xp 00000000 08:01 14 /site/nvidia/cu13/lib/libcublas.so.13\n"
        "7f05-7f06 r--p 00100000 08:01 14 /site/nvidia/cu13/lib/libcublas.so.13\n"
        "7f06-7f07 rw-p 00000000 00:00 0 \n"
    )
    assert cublas.mapped_cublas(maps) == ["/site/nvidia/cu13/lib/libcublas.so.13"]


def test_no_library_is_a_kernel_error_naming_the_option(monkeypatch):
    monkeypatch.setattr(cublas, "_LIBRARY", None)
    monkeypatch.setattr(cublas, "_loaded_by_cupy", lambda: ["/nowhere/libcublas.so.99"])
    monkeypatch.setattr(cublas.ctypes.util, "find_library", lambda name: None)

    def refuse(path, *args, **kwargs):
        raise OSError(f"{path}: cannot open shared object file")

    monkeypatch.setattr(cublas.ctypes, "CDLL", refuse)
    with pytest.raises(KernelError) as info:
        cublas.library()
    text = str(info.value)
    assert "/nowhere/libcublas.so.99" in text and "libcublas.so.12" in text
    assert "cublas_in_graphs=False" in text and "ONNX_GENRT_CUBLAS_IN_GRAPHS=0" in text


def test_strides_travel_as_64_bit_integers(fake):
    """Batch strides past 2**31 elements reach the library whole (``long long``)."""
    shape = GemmShape(4, 8, 3, batch=0, a_stride=2**33 + 5, w_stride=2**32 + 7)
    name, args = cublas.gemm_arguments(1, shape, np.dtype(np.float16), 16, 32, 48, (0, 0))
    assert name == "cublasGemmStridedBatchedEx"
    assert getattr(fake, name)(*args) == 0
    logged = fake.calls[-1][1]
    assert logged[8:10] == (2**32 + 7, 2**33 + 5)  # W's stride (cuBLAS's A), then A's
