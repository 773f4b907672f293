"""Programmatic dependent launch without a GPU: argument packing by a parameter table (against
bytes laid out independently with numpy, and against CuPy's own argument rules), the driver
structures and calls (with a fake libcuda), the launch routing of ``launch.Kernel`` and
``_common.function`` (CuPy stubbed, in a child process), and the source rules every kernel
obeys (``kernel_source``)."""

from __future__ import annotations

import ctypes
import re

import numpy as np
import pytest

from onnx_genrt.providers.cuda import driver as cuda_driver
from onnx_genrt.providers.cuda.kernel_args import Packer, pack
from onnx_genrt.providers.cuda.kernel_source import has_wait, kernels, pre_wait_problems
from tests.cuda_stub import run_with_cupy_stub


class FakeArray:
    """A device array as the packer sees one: an address."""

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


def address(arg):
    return arg.ptr if isinstance(arg, FakeArray) else None


def layout(entries) -> tuple[list[tuple[int, int]], bytes]:
    """(parameter table, expected bytes) of (numpy dtype, value) entries at C alignment."""
    table, chunks, at = [], [], 0
    for dtype, value in entries:
        dt = np.dtype(dtype)
        at = -(-at // dt.itemsize) * dt.itemsize
        table.append((at, dt.itemsize))
        chunks.append((at, np.array([value], dt).view(np.uint8)))
        at += dt.itemsize
    out = np.zeros(at, np.uint8)
    for offset, raw in chunks:
        out[offset : offset + raw.size] = raw
    return table, out.tobytes()


def test_pack_lays_out_a_gemv_call_as_the_c_parameters():
    # gemv_nk(const S*, const S*, S*, int M, int K, int N, int wpc, const S*, const S*, S*,
    # float eps, int flags) and a long long after an int (4 bytes of padding).
    table, want = layout(
        [(np.uint64, 0x7F0000001000), (np.uint64, 0x7F0000002000), (np.uint64, 0x7F0000003000)]
        + [(np.int32, 1), (np.int32, 896), (np.int32, 4864), (np.int32, -3)]
        + [(np.uint64, 0x7F0000004000), (np.uint64, 0), (np.uint64, 0x7F0000005000)]
        + [(np.float32, 1e-6), (np.int32, 3), (np.int32, 5), (np.int64, -(1 << 40))]
        + [(np.float64, 0.25)]
    )
    args = [FakeArray(0x7F0000001000), FakeArray(0x7F0000002000), FakeArray(0x7F0000003000)]
    args += [np.int32(1), 896, np.int64(4864), -3]
    args += [FakeArray(0x7F0000004000), None, FakeArray(0x7F0000005000)]
    args += [np.float32(1e-6), True + 2, np.uint8(5), -(1 << 40), 0.25]
    with pytest.raises(TypeError, match="parameter 12 .* a uint8 scalar is narrower"):
        pack(table, args, "gemv_nk<half_t, 1, 1, 0, 0>", address)
    args[12] = 5
    got = pack(table, args, "gemv_nk<half_t, 1, 1, 0, 0>", address)
    assert len(table) == 15 and table[13] == (80, 8)  # 4 bytes of padding after the int at 72
    assert bytes(got) == want


def _cupy_bytes(arg) -> bytes:
    """What CuPy hands the driver for ``arg`` (cupy/_core/raw.pyx ``_pointer``): Python int
    and bool as int64, float as double, numpy scalars as themselves; the driver then reads
    the parameter's size from these bytes."""
    if isinstance(arg, FakeArray):
        return arg.ptr.to_bytes(8, "little")
    if arg is None:
        return bytes(8)
    if isinstance(arg, bool | int):
        return np.int64(arg).tobytes()
    if isinstance(arg, float):
        return np.float64(arg).tobytes()
    if isinstance(arg, complex):
        return np.complex128(arg).tobytes()
    return arg.tobytes()  # a numpy scalar, or a one-element numpy array by value


ARGS = [
    7, -7, 0, True, 2**31 - 1, 2**31, 2**32 - 1, -(2**31), 2**40, -(2**40),
    np.int8(-5), np.int16(300), np.int32(-9), np.int64(5), np.int64(2**40), np.uint32(2**32 - 1),
    np.uint64(9), np.bool_(True), np.float16(1.5), np.float32(0.1), np.float64(0.1), 0.1,
    np.complex64(1 + 2j), 1 + 2j, None, FakeArray(0xDEADBEEF00), np.array([3], np.int32),
    np.array(2.5, np.float32),
]  # fmt: skip


@pytest.mark.parametrize("size", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("arg", ARGS, ids=lambda a: f"{type(a).__name__}({a!r:.16})")
def test_pack_agrees_with_cupy_or_refuses(arg, size):
    """Where the packer takes an argument, its bytes are the ones the driver reads from
    CuPy's; it refuses where those would be garbage (CuPy's value narrower than the parameter,
    a float of another width) or silently truncated (an integer that does not fit)."""
    cupy_raw = _cupy_bytes(arg)
    try:
        got = pack([(0, size)], [arg], "k", address)
    except TypeError as exc:
        assert "kernel k: parameter 0" in str(exc)
        scalar = arg.reshape(-1)[0] if isinstance(arg, np.ndarray) else arg
        value = None
        if isinstance(scalar, bool | int | np.integer | np.bool_):
            value = int(scalar)
        narrower = len(cupy_raw) < size
        is_float = isinstance(scalar, float | np.floating | complex | np.complexfloating)
        lost = value is not None and not -(1 << (8 * size - 1)) <= value < (1 << (8 * size))
        address_like = arg is None or isinstance(arg, FakeArray)
        assert narrower or (is_float and len(cupy_raw) != size) or lost or address_like
        return
    assert bytes(got) == cupy_raw[:size]
    if isinstance(arg, bool | int | np.integer | np.bool_):  # the value survives the cut
        signed = int.from_bytes(got, "little", signed=True)
        assert int(arg) in (signed, int.from_bytes(got, "little"))


@pytest.mark.parametrize("size", [1, 2, 4, 8, 16])
def test_packer_gives_the_bytes_and_errors_of_pack(size):
    """The fast packer (a struct per tuple of argument types) against :func:`pack`: the same
    bytes for every argument of ARGS beside a pointer and an int, or the same error, also
    when the same types come again with values the struct refuses."""
    table = [(0, 8), (8, size), (8 + size + (-(8 + size) % 8), 4)]
    packer = Packer(table, "k", address, {FakeArray: lambda a: a.ptr})
    for arg in [*ARGS, *ARGS]:  # twice: the second time from the cached layouts
        args = [FakeArray(0x7000), arg, np.int32(-4)]
        try:
            want = bytes(pack(table, args, "k", address))
        except TypeError as exc:
            with pytest.raises(TypeError, match=re.escape(str(exc))):
                packer.pack(args)
            continue
        assert bytes(packer.pack(args)) == want, arg
    assert packer.size == table[-1][0] + 4


def test_pack_names_the_kernel_and_parameter_it_refuses():
    with pytest.raises(
        TypeError, match=r"kernel f<float>: parameter 1 \(4 bytes\): a Python float"
    ):
        pack([(0, 8), (8, 4)], [FakeArray(1), 0.5], "f<float>", address)
    with pytest.raises(TypeError, match=r"parameter 0 \(8 bytes\): a int32 scalar is narrower"):
        pack([(0, 8)], [np.int32(1)], "g", address)
    with pytest.raises(TypeError, match=r"an address .* needs an 8-byte parameter"):
        pack([(0, 4)], [FakeArray(1)], "g", address)
    with pytest.raises(TypeError, match="3 arguments for its 2 parameters"):
        pack([(0, 4), (4, 4)], [1, 2, 3], "g", address)
    with pytest.raises(TypeError, match=r"a numpy array of shape \(2,\)"):
        pack([(0, 8)], [np.zeros(2)], "g", address)
    with pytest.raises(TypeError, match="unsupported argument type str"):
        pack([(0, 8)], ["x"], "g", address)


# ----------------------------------------------------------------------------- the driver


def test_driver_structures_have_the_layout_of_cuda_h():
    c = cuda_driver.LaunchConfig
    assert ctypes.sizeof(c) == 56
    assert (c.shared_bytes.offset, c.stream.offset, c.attrs.offset, c.num_attrs.offset) == (
        24, 32, 40, 48,
    )  # fmt: skip
    a = cuda_driver.LaunchAttribute
    assert ctypes.sizeof(a) == 72 and a.value.offset == 8
    raw = bytes(cuda_driver.programmatic_attribute())
    assert raw[:4] == (6).to_bytes(4, "little") and raw[8:12] == (1).to_bytes(4, "little")
    assert raw[12:] == bytes(60)


class FakeLib:
    """libcuda's three entry points, in Python: a kernel of ``table`` parameters."""

    def __init__(self, table, launch_result=0):
        self.table, self.launch_result, self.launches = table, launch_result, []

        def param_info(function, index, offset, size):
            if index >= len(self.table):
                return 1  # CUDA_ERROR_INVALID_VALUE
            offset._obj.value, size._obj.value = self.table[index]
            return 0

        def launch(config, function, params, extra):
            cfg = config._obj
            pointers = [params[i] for i in range(len(self.table))]
            self.launches.append(
                {
                    "grid": (cfg.grid_x, cfg.grid_y, cfg.grid_z),
                    "block": (cfg.block_x, cfg.block_y, cfg.block_z),
                    "shared": cfg.shared_bytes,
                    "stream": cfg.stream,
                    "num_attrs": cfg.num_attrs,
                    "attr": bytes(cfg.attrs.contents)[:12],
                    "function": function,
                    "params": [
                        ctypes.string_at(p, s)
                        for p, (_, s) in zip(pointers, self.table, strict=True)
                    ],
                    "extra": extra,
                }
            )
            return self.launch_result

        def error_name(code, name):
            name._obj.value = b"CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES" if code == 701 else None
            return 0 if code == 701 else 500

        def occupancy(blocks, function, threads, shared):
            self.occupancy_asked.append((function, threads, shared))
            blocks._obj.value = 3
            return 0

        self.occupancy_asked: list[tuple[int, int, int]] = []
        self.cuLaunchKernelEx, self.cuFuncGetParamInfo = launch, param_info
        self.cuGetErrorName = error_name
        self.cuOccupancyMaxActiveBlocksPerMultiprocessor = occupancy


def test_driver_reads_the_table_and_launches_with_the_attribute():
    table, want = layout([(np.uint64, 0xABC0), (np.int32, -2), (np.int64, 7), (np.float32, 0.5)])
    lib = FakeLib(table)
    drv = cuda_driver.Driver(lib)
    assert drv.param_table(0x1234) == tuple(table)
    params = cuda_driver.ParamBlock([o for o, _ in table], len(want))
    packer = Packer(table, "k", address, {FakeArray: lambda a: a.ptr})
    packer.pack_into(params.buffer, [FakeArray(0xABC0), -2, 7, np.float32(0.5)])
    drv.launch(0x1234, (3, 2, 1), (32, 8, 1), 4096, 0x5678, params)
    (call,) = lib.launches
    assert call["grid"] == (3, 2, 1) and call["block"] == (32, 8, 1) and call["shared"] == 4096
    assert call["stream"] == 0x5678 and call["function"] == 0x1234 and not call["extra"]
    assert call["num_attrs"] == 1 and call["attr"][:4] == (6).to_bytes(4, "little")
    assert call["attr"][8:12] == (1).to_bytes(4, "little")
    assert b"".join(call["params"]) == b"".join(want[o : o + s] for o, s in table)


def test_driver_launches_cooperatively_and_reads_the_occupancy():
    table, _ = layout([(np.uint64, 0xABC0)])
    lib = FakeLib(table)
    drv = cuda_driver.Driver(lib)
    params = cuda_driver.ParamBlock([o for o, _ in table], 8)
    drv.launch(0x1234, (132, 1, 1), (32, 8, 1), 0, 0x5678, params, programmatic=False,
               cooperative=True)  # fmt: skip
    drv.launch(0x1234, (1, 1, 1), (32, 1, 1), 0, 0x5678, params, programmatic=False)
    coop, plain = lib.launches
    assert coop["num_attrs"] == 1 and coop["attr"][:4] == (2).to_bytes(4, "little")
    assert coop["attr"][8:12] == (1).to_bytes(4, "little")
    assert plain["num_attrs"] == 0
    assert drv.blocks_per_sm(0x1234, 256, 90_000) == 3
    assert lib.occupancy_asked == [(0x1234, 256, 90_000)]


def test_driver_errors_carry_the_error_name():
    lib = FakeLib([(0, 8)], launch_result=701)
    drv = cuda_driver.Driver(lib)
    with pytest.raises(
        cuda_driver.DriverError,
        match=r"cuLaunchKernelEx failed: CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES \(701\)",
    ):
        drv.launch(1, (1, 1, 1), (1, 1, 1), 0, 0, cuda_driver.ParamBlock([0], 8))
    assert drv.error_name(9999) == "CUresult 9999"


def test_driver_load_says_why_not(monkeypatch):
    def no_lib(name):
        raise OSError(f"{name}: cannot open shared object file")

    cuda_driver.load.cache_clear()
    monkeypatch.setattr(cuda_driver.ctypes, "CDLL", no_lib)
    assert "libcuda.so.1 does not load" in cuda_driver.load()

    class Old:  # a driver before 12.4: no cuFuncGetParamInfo
        cuLaunchKernelEx = cuGetErrorName = staticmethod(lambda *a: 0)

        def __getattr__(self, name):
            raise AttributeError(f"libcuda.so.1: undefined symbol: {name}")

    cuda_driver.load.cache_clear()
    monkeypatch.setattr(cuda_driver.ctypes, "CDLL", lambda name: Old())
    assert cuda_driver.load().startswith("the CUDA driver lacks cuFuncGetParamInfo")
    cuda_driver.load.cache_clear()


def test_programmatic_launch_needs_sm90_and_the_driver():
    drv = cuda_driver.Driver(FakeLib([]))
    assert cuda_driver.programmatic_launch_problem(90, drv) is None
    assert cuda_driver.programmatic_launch_problem(100, drv) is None
    assert cuda_driver.programmatic_launch_problem(86, drv) == (
        "needs sm_90 or newer; the device is sm_86"
    )
    assert cuda_driver.programmatic_launch_problem(90, "no driver") == "no driver"


# ----------------------------------------------------------------------------- routing

_ROUTING = r"""
import json, sys
import cupy

class Array:  # what the stub's cupy.ndarray is here
    def __init__(self, ptr):
        self.data = type("Mem", (), {"ptr": ptr})()
cupy.ndarray = Array
cupy.cuda.MemoryPointer = type("MemoryPointer", (), {})
import onnx_genrt.providers.cuda.launch as launch
from onnx_genrt.providers.cuda import driver as cuda_driver
from onnx_genrt.providers.cuda.kernels import _common
from onnx_genrt.core.errors import KernelError
stream = cupy.cuda.get_current_stream.return_value
stream.ptr = 0x5000

class Drv:
    def __init__(self): self.calls, self.fail = [], False
    def param_table(self, fn): return ((0, 8), (8, 4), (16, 8))
    def launch(self, fn, grid, block, shared, strm, params, programmatic=True, cooperative=False):
        if self.fail:
            raise cuda_driver.DriverError("cuLaunchKernelEx", 701, "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES")
        base = cuda_driver.ctypes.addressof(params.buffer)
        offsets = [params.pointers[i] - base for i in range(3)]
        how = [] if programmatic and not cooperative else [programmatic, cooperative]
        self.calls.append([fn, list(grid), list(block), shared, strm, bytes(params.buffer).hex(), offsets, *how])
drv = Drv()
cuda_driver.load = lambda: drv

class Raw:
    def __init__(self): self.calls = []
    kernel = type("K", (), {"ptr": 0x77})()
    num_regs = 40
    def __call__(self, grid, block, args, shared_mem=0): self.calls.append([list(grid), list(block), shared_mem])

out = {}
raw = Raw()
k = launch.Kernel(raw, "f<float>", ready=True)
args = (Array(0x1000), 3, Array(0x2000))
k((2,), (64,), args)  # an ordinary stream
out["ordinary"] = [len(raw.calls), len(drv.calls), launch.launch_counts().__dict__]
out["defines_off"] = list(launch.compile_defines())
launch.allow_programmatic(stream, prefetch=False)
out["defines_on"] = list(launch.compile_defines())
k((2,), (64, 2), args, shared_mem=128)
out["programmatic"] = [len(raw.calls), list(drv.calls), launch.launch_counts().__dict__]
launch.Kernel(raw, "g<float>", ready=False)((1,), (32,), args)
out["unready"] = [len(raw.calls), len(drv.calls), launch.launch_counts().__dict__]
out["num_regs"] = k.num_regs
k.cooperative((3,), (32, 8), args, shared_mem=64)  # on a PDL stream too: never programmatic
out["cooperative"] = [len(raw.calls), drv.calls[-1], launch.launch_counts().__dict__]
drv.fail = True
try:
    k((1,), (32,), args)
except KernelError as exc:
    out["error"] = str(exc)
launch.allow_programmatic(stream, prefetch=True)
out["defines_prefetch"] = list(launch.compile_defines())
launch.allow_programmatic(stream, prefetch=True, early=2)
out["defines_early"] = list(launch.compile_defines())
launch.forbid_programmatic(0x5000)
out["defines_forbidden"] = list(launch.compile_defines())

# _common.function: the compile options and readiness follow the current stream
src = _common.DEVICE_COMMON + '''
template <typename S> __global__ void waits(S* y) { GRID_WAIT(); y[0] = 1; }
template <typename S> __global__ void plain(S* y) { y[0] = 1; }
'''
made = []
cupy.RawModule = lambda code, options, name_expressions: made.append(list(options)) or type(
    "M", (), {"get_function": lambda self, name: Raw()})()
f_plain = _common.function(src, "waits<float>")
launch.allow_programmatic(stream, prefetch=True)
f_pdl = _common.function(src, "waits<float>")
f_pdl_again = _common.function(src, "waits<float>")
f_unready = _common.function(src, "plain<float>")
out["function"] = [made, f_plain.ready, f_pdl.ready, f_pdl is f_pdl_again, f_unready.ready]
print(json.dumps(out))
"""


_FINALIZER_UNDER_THE_LOCK = r"""
import json, threading
from onnx_genrt.providers.cuda import launch

class Stream:
    @property
    def ptr(self):  # CuPy's property allocates: a collection may run a dead provider's finalizer
        launch.forbid_programmatic(0x9000)
        return 0x6000

done = []

def body():
    launch.allow_programmatic(Stream())
    with launch._LOCK:  # a collection while the lock is held, on the same thread
        launch.forbid_programmatic(0x6000)
    done.append(True)

thread = threading.Thread(target=body, daemon=True)
thread.start()
thread.join(10)
print(json.dumps({"done": bool(done), "left": sorted(launch._PROGRAMMATIC)}))
"""


def test_a_finalizer_that_forbids_a_stream_never_deadlocks():
    """A provider's finalizer (``forbid_programmatic``) may run inside ``allow_programmatic``
    or while the lock is held on the same thread, as the garbage collector decides: it once
    hung a GPU test worker for good."""
    got = run_with_cupy_stub(_FINALIZER_UNDER_THE_LOCK)
    assert got == {"done": True, "left": []}


def test_kernel_routes_by_stream_and_readiness():
    got = run_with_cupy_stub(_ROUTING)
    zero = {"programmatic": 0, "ordinary": 0, "unready": 0, "cooperative": 0}
    assert got["ordinary"] == [1, 0, {**zero, "ordinary": 1}]
    assert got["defines_off"] == [] and got["defines_forbidden"] == []
    pdl = "-DGENRT_PDL=1"
    assert got["defines_on"] == [pdl, "-DGENRT_PDL_PREFETCH=0", "-DGENRT_PDL_EARLY=0"]
    assert got["defines_prefetch"] == [pdl, "-DGENRT_PDL_PREFETCH=1", "-DGENRT_PDL_EARLY=0"]
    assert got["defines_early"] == [pdl, "-DGENRT_PDL_PREFETCH=1", "-DGENRT_PDL_EARLY=2"]
    raw_calls, calls, counts = got["programmatic"]
    assert raw_calls == 1 and counts == {**zero, "programmatic": 1, "ordinary": 1}
    _, want = layout([(np.uint64, 0x1000), (np.int32, 3), (np.uint64, 0x2000)])
    assert calls == [[0x77, [2, 1, 1], [64, 2, 1], 128, 0x5000, want.hex(), [0, 8, 16]]]
    assert got["unready"] == [2, 1, {**zero, "programmatic": 1, "ordinary": 1, "unready": 1}]
    raw_calls, call, counts = got["cooperative"]
    assert (
        raw_calls == 2 and call[1:4] == [[3, 1, 1], [32, 8, 1], 64] and call[-2:] == [False, True]
    )
    assert counts == {"programmatic": 1, "ordinary": 1, "unready": 1, "cooperative": 1}
    assert got["num_regs"] == 40  # the RawKernel's attributes show through
    assert got["error"].startswith("kernel f<float>: cuLaunchKernelEx failed: ")
    assert "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES (701)" in got["error"]
    made, plain_ready, pdl_ready, cached, unready = got["function"]
    assert made == [
        ["-std=c++17"],
        ["-std=c++17", "-DGENRT_PDL=1", "-DGENRT_PDL_PREFETCH=1", "-DGENRT_PDL_EARLY=0"],
        ["-std=c++17", "-DGENRT_PDL=1", "-DGENRT_PDL_PREFETCH=1", "-DGENRT_PDL_EARLY=0"],
    ]
    assert (plain_ready, pdl_ready, cached, unready) == (False, True, True, False)


# ----------------------------------------------------------------------------- source rules

_SOURCE = r"""
#define PARAMS const S* __restrict__ x, S* __restrict__ y, int n
template <typename S>
__global__ void __launch_bounds__(256) good(PARAMS) {
  __shared__ float sh[33];
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) pdl_prefetch(x + (long long)i * (n + 1));  // weights only: allowed
  GRID_WAIT();
  GRID_LAUNCH_DEPENDENTS();
  if (i < n) y[i] = x[i];
}
template <typename S>
__global__ void reads_early(const S* __restrict__ x, S* y, int n) {
  const S v = x[threadIdx.x];
  GRID_WAIT();
  y[0] = v;
}
template <typename S>
__global__ void returns_early(const S* x, S* y, int n) {
  if (threadIdx.x >= n) return;
  GRID_WAIT();
  y[threadIdx.x] = x[threadIdx.x];
}
__global__ void never_waits(float* y) { y[0] = 1.f; }
__global__ void __cluster_dims__(8, 1, 1) __launch_bounds__(128, 8)
    barrier_early(float* y) {
  __syncthreads();  // a { brace in a comment
  GRID_WAIT();
  y[0] = 0.f;
}
"""


def test_source_rules_find_each_way_to_touch_memory_before_the_wait():
    found = kernels(_SOURCE)
    assert sorted(found) == ["barrier_early", "good", "never_waits", "reads_early", "returns_early"]
    assert found["good"].pointer_params == ("x", "y")
    assert pre_wait_problems(found["good"], ("x",)) == []
    assert pre_wait_problems(found["good"]) == ["good: prefetches 'x', which is not a weight"]
    assert pre_wait_problems(found["reads_early"]) == [
        "reads_early: pointer 'x' used before GRID_WAIT();"
    ]
    assert pre_wait_problems(found["returns_early"]) == [
        "returns_early: 'return' before GRID_WAIT();"
    ]
    assert pre_wait_problems(found["never_waits"]) == ["never_waits: no GRID_WAIT();"]
    assert pre_wait_problems(found["barrier_early"]) == [
        "barrier_early: '__syncthreads' before GRID_WAIT();"
    ]
    assert has_wait(_SOURCE, "good<half_t>") and not has_wait(_SOURCE, "never_waits")
    assert not has_wait(_SOURCE, "absent<float>")


_ALL_SOURCES = r"""
import importlib, json, pathlib
import onnx_genrt.providers.cuda.kernels as pkg
from onnx_genrt.providers.cuda.kernel_source import kernels, pre_wait_problems
seen, problems = {}, []
for path in sorted(pathlib.Path(pkg.__file__).parent.glob("*.py")):
    if path.stem == "__init__":
        continue
    mod = importlib.import_module(f"{pkg.__name__}.{path.stem}")
    weights = getattr(mod, "PDL_WEIGHTS", {})
    for attr, value in sorted(vars(mod).items()):
        if isinstance(value, str) and "__global__" in value:
            for name, kernel in kernels(value).items():
                seen.setdefault(name, []).append(f"{path.stem}.{attr}")
                found = pre_wait_problems(kernel, weights.get(name, ()))
                problems += [f"{path.stem}.{attr}: {p}" for p in found]
            if "GRID_WAIT()" in value and "griddepcontrol.wait" not in value:
                problems.append(f"{path.stem}.{attr}: uses GRID_WAIT() without GRID_DEPENDENCY")
print(json.dumps({"kernels": sorted(seen), "problems": problems}))
"""


def test_every_kernel_waits_before_it_touches_memory():
    """Every ``__global__`` kernel of every source the CUDA kernels compile calls GRID_WAIT()
    before any return, barrier or use of a pointer parameter other than an L2 prefetch: the
    condition for launching it programmatically (what ``launch.Kernel`` relies on)."""
    got = run_with_cupy_stub(_ALL_SOURCES)
    assert len(got["kernels"]) >= 28, got["kernels"]
    assert {"gemv_nk", "nbits4_gemv16", "gqa_attn", "flash_attn", "concat_parts"} <= set(
        got["kernels"]
    )
    assert got["problems"] == []


def test_gqa_params_macro_expands_into_pointer_parameters():
    got = run_with_cupy_stub(
        r"""
import json
from onnx_genrt.providers.cuda.kernels import contrib_attention
from onnx_genrt.providers.cuda.kernel_source import kernels
k = kernels(contrib_attention._SOURCE)["gqa_attn_cluster"]
print(json.dumps(list(k.pointer_params)))
"""
    )
    assert {"q", "kc", "vc", "seqlens", "out", "part", "counters"} <= set(got)


_PROVIDER = r"""
import gc, json, os
import cupy
from onnx_genrt.providers.cuda import driver as cuda_driver, launch
from onnx_genrt.providers.cuda.provider import CUDAProvider
cupy.cuda.Device.return_value.compute_capability = os.environ["CC"]
from types import SimpleNamespace
lib = SimpleNamespace(cuLaunchKernelEx=lambda *a: 0, cuFuncGetParamInfo=lambda *a: 1,
                      cuGetErrorName=lambda *a: 0,
                      cuOccupancyMaxActiveBlocksPerMultiprocessor=lambda *a: 0)
cuda_driver.load = lambda: cuda_driver.Driver(lib)
streams = iter(range(0x100, 0x200, 0x10))
cupy.cuda.Stream.side_effect = lambda **kw: type("S", (), {"ptr": next(streams)})()
out = []
on = {"programmatic_launch": True}
allowed = lambda: {k: [v.prefetch, v.early] for k, v in launch._PROGRAMMATIC.items()}
for kw in (on, {"programmatic_launch": False}, {**on, "pdl_prefetch": False}, {},
           {**on, "pdl_early_launch": 0}):
    p = CUDAProvider(**kw)
    out.append([p.programmatic_launch, list(p.status_notes()), allowed()])
    del p
    gc.collect()
out.append(allowed())  # every provider gone: no stream left allowed
try:
    CUDAProvider(pdl_early_launch=3)
except Exception as exc:
    out.append(str(exc))
print(json.dumps(out))
"""


def test_provider_allows_its_stream_only_where_it_can(monkeypatch):
    monkeypatch.delenv("ONNX_GENRT_PROGRAMMATIC_LAUNCH", raising=False)
    monkeypatch.delenv("ONNX_GENRT_PDL_PREFETCH", raising=False)
    monkeypatch.setenv("CC", "90")
    monkeypatch.delenv("ONNX_GENRT_PDL_EARLY_LAUNCH", raising=False)
    on, off, no_prefetch, default, early, after, bad = run_with_cupy_stub(_PROVIDER)
    notes = ["programmatic launch: on (with L2 weight prefetch, early launch 1)"]
    assert on == [True, notes, {"256": [True, 1]}]
    assert default == [True, notes, {"304": [True, 1]}]
    assert early == [
        True,
        ["programmatic launch: on (with L2 weight prefetch)"],
        {"320": [True, 0]},
    ]
    assert bad == "provider 'cuda' option 'pdl_early_launch' must be 0, 1 or 2, got 3"
    assert off[0] is False and off[2] == {}
    assert off[1] == [
        "programmatic launch: off (programmatic_launch=False or ONNX_GENRT_PROGRAMMATIC_LAUNCH=0)"
    ]
    assert no_prefetch == [
        True,
        ["programmatic launch: on (without L2 weight prefetch, early launch 1)"],
        {"288": [False, 1]},
    ]
    assert after == {}
    monkeypatch.setenv("CC", "80")
    older = run_with_cupy_stub(_PROVIDER)
    assert older[0] == [
        False,
        ["programmatic launch: needs sm_90 or newer; the device is sm_80"],
        {},
    ]
    monkeypatch.setenv("CC", "90")
    # On by default; the environment variable turns it off for a provider given no option.
    monkeypatch.setenv("ONNX_GENRT_PROGRAMMATIC_LAUNCH", "0")
    assert run_with_cupy_stub(_PROVIDER)[3][0] is False
