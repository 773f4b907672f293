"""Shared helpers of the CUDA kernels: output buffers, capture checks, host ints, compiling."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import cupy
import ml_dtypes
import numpy as np

from onnx_genrt.core.kernels import KernelContext

from ..kernel_source import has_wait
from ..launch import Kernel, compile_defines

#: Options for every module this package compiles (NVRTC through CuPy, which caches them).
OPTIONS = ("-std=c++17",)

F32 = np.dtype(np.float32)
F16 = np.dtype(np.float16)
BF16 = np.dtype(ml_dtypes.bfloat16)
#: The float dtypes the RawKernels take.
FLOAT_DTYPES = (F32, F16, BF16)

#: C storage type of each dtype the RawKernels take: fp16 travels as raw 16-bit words
#: (``half_t``), bf16 as ``bf16_t`` (a struct of its 16 bits, so overloads tell them apart).
_STORAGE = {F32: "float", F16: "unsigned short", BF16: "bf16_t"}


class CaptureUnsupported(RuntimeError):
    """Work that cannot be recorded into a CUDA graph was attempted while capturing."""


def capturing(ctx: KernelContext) -> bool:
    """True while the provider's stream records a graph (a call without a provider asks
    CuPy's current stream)."""
    if ctx.provider is not None:
        return ctx.capturing
    return bool(cupy.cuda.get_current_stream().is_capturing())


def refuse_in_capture(ctx: KernelContext, what: str) -> None:
    """Raise :class:`CaptureUnsupported` naming the node when capturing."""
    if capturing(ctx):
        raise CaptureUnsupported(f"{ctx.node.describe()}: {what} cannot run inside a CUDA graph")


def out(ctx: KernelContext, index: int, shape: Sequence[int], dtype: Any) -> cupy.ndarray:
    """``ctx.out``: the planned buffer for output ``index`` when it fits, else a new device
    array (refused while capturing). A call without a provider (a test calling a kernel
    directly) gets a CuPy array the same way."""
    if ctx.provider is not None:
        return ctx.out(index, shape, dtype)
    shape = tuple(int(s) for s in shape)
    dt = np.dtype(dtype)
    if index < len(ctx.planned):
        buf = ctx.planned[index]
        fits = isinstance(buf, cupy.ndarray) and buf.shape == shape and buf.dtype == dt
        if fits and buf.flags.c_contiguous:
            return buf
    refuse_in_capture(ctx, f"output {index} {list(shape)} {dt} has no planned buffer; allocating")
    return cupy.empty(shape, dt)


def contiguous(ctx: KernelContext, x: cupy.ndarray) -> cupy.ndarray:
    """``x`` when C-contiguous, else a contiguous copy (not allowed while capturing)."""
    if x.flags.c_contiguous:
        return x
    refuse_in_capture(ctx, "copying a non-contiguous input")
    return cupy.ascontiguousarray(x)


def host_ints(ctx: KernelContext, value: Any) -> list[int]:
    """A small integer tensor (shape, axes, slice bounds) as Python ints.

    Host arrays are read directly, device arrays through ``ctx.host_value`` (the copy the
    provider kept when it uploaded them); otherwise they are read with a blocking copy on
    the provider's stream, which is refused while capturing.
    """
    if value is None:
        return []
    host = ctx.host_value(value)
    if host is not None:
        return [int(v) for v in np.asarray(host).reshape(-1)]
    refuse_in_capture(ctx, "reading a device tensor on the host")
    return [int(v) for v in value.get(stream=ctx.stream).reshape(-1)]


@functools.cache
def _cupy_has_bf16() -> bool:
    """CuPy takes ``ml_dtypes.bfloat16`` arrays from v14 on (with NumPy >= 2.1.2)."""
    try:
        cupy.empty(0, BF16)
    except Exception:  # noqa: BLE001  (CuPy raises TypeError or ValueError by version)
        return False
    return True


def storage(ctx: KernelContext, dtype: Any) -> str:
    """C storage type of ``dtype`` for the RawKernels (fp32, fp16, bf16)."""
    dt = np.dtype(dtype)
    try:
        return _STORAGE[dt]
    except KeyError:
        raise TypeError(
            f"{ctx.node.describe()}: dtype {dt} is not supported by the CUDA kernels "
            "(float32, float16 and bfloat16 only)"
        ) from None


def bf16_unsupported() -> str | None:
    """Why bfloat16 tensors cannot live on this CuPy, or None."""
    if _cupy_has_bf16():
        return None
    return (
        f"bfloat16 on CUDA needs CuPy >= 14 with NumPy >= 2.1.2 (found CuPy {cupy.__version__}, "
        f"NumPy {np.__version__})"
    )


def rows_cols(shape: Sequence[int], axis: int) -> tuple[int, int]:
    """(rows, cols) of ``shape`` flattened to 2-D at ``axis``."""
    return math.prod(shape[:axis]), math.prod(shape[axis:])


def row_threads(cols: int) -> int:
    """Threads per block for a one-block-per-row kernel: a power of two from 32 to 1024."""
    threads = 32
    while threads < 1024 and threads * 4 < cols:
        threads *= 2
    return threads


_FUNCTIONS: dict[tuple[str, str, int, tuple[str, ...]], Kernel] = {}


def function(source: str, name: str) -> Kernel:
    """Kernel ``name`` (a template instance such as ``f<float>``) compiled from ``source`` for
    the current stream, called as CuPy's RawKernel is: ``fn(grid, block, args,
    shared_mem=...)``. On a stream that allows programmatic dependent launch it is compiled
    with the PDL macros (``GRID_DEPENDENCY``) and, when its source waits on the previous grid
    (``GRID_WAIT()``), launched programmatically; else as before (``launch.Kernel``)."""
    defines = compile_defines()
    key = (source, name, cupy.cuda.runtime.getDevice(), defines)
    fn = _FUNCTIONS.get(key)
    if fn is None:
        options = OPTIONS + defines
        module = cupy.RawModule(code=source, options=options, name_expressions=(name,))
        fn = Kernel(module.get_function(name), name, bool(defines) and has_wait(source, name))
        _FUNCTIONS[key] = fn
    return fn


_SM_COUNT: dict[int, int] = {}


def sm_count() -> int:
    """Streaming multiprocessors on the current device."""
    dev = cupy.cuda.runtime.getDevice()
    if dev not in _SM_COUNT:
        _SM_COUNT[dev] = int(cupy.cuda.Device(dev).attributes["MultiProcessorCount"])
    return _SM_COUNT[dev]


def scratch(ctx: KernelContext, nbytes: int) -> cupy.ndarray:
    """``ctx.scratch``: bytes of the provider's workspace, which stay at their address while
    graphs use them. A call without a provider gets fresh CuPy memory (not in a capture)."""
    if ctx.provider is not None:
        return ctx.scratch(nbytes)
    refuse_in_capture(ctx, "scratch memory without a CUDA provider")
    return cupy.empty(max(int(nbytes), 1), np.uint8)


#: Programmatic dependent launch in device code, compiled in where ``GENRT_PDL`` is defined
#: (``launch.compile_defines``: a stream that allows it) on sm_90+, and to nothing elsewhere,
#: so a kernel built without it is the same machine code as before these macros existed.
#: A kernel launched with PDL may start while the kernel
#: before it on the stream still runs. ``GRID_WAIT()`` returns once that kernel has completed
#: and its writes are visible (at once when this one was launched without PDL): every kernel
#: calls it before it reads anything an earlier kernel may write (activations, the KV cache,
#: scratch, counters, lengths) and before it writes anything (the memory planner hands a
#: kernel outputs that the previous kernel may still be reading), and before any return.
#: Before it, a kernel may only ``pdl_prefetch`` its weights into L2: a hint that changes no
#: value a load returns (the L2 is where every SM's writes meet); compiled in only with
#: ``GENRT_PDL_PREFETCH`` (the provider's ``pdl_prefetch``). ``GRID_LAUNCH_DEPENDENTS()``
#: lets the next kernel be scheduled once every block of this one has called it or exited.
#: ``GENRT_PDL_EARLY`` (the provider's ``pdl_early_launch``) calls it as soon as the wait
#: returns, so the next kernel's blocks are resident and prefetch their weights while this
#: one runs: at 1 in the kernels that say ``GRID_EARLY_LAUNCH()`` after their wait (decode
#: attention: few blocks, little memory; the 4-bit one-row GEMVs ``nbits4_gemv16*``), at 2
#: in every GRID_WAIT(). At most two kernels overlap: the next one's own trigger comes after
#: its wait, which this kernel's end releases.
#: tests/providers/cuda/test_cuda_kernel_sources.py checks every kernel against these rules.
GRID_DEPENDENCY = r"""
#if defined(GENRT_PDL) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#if defined(GENRT_PDL_EARLY) && GENRT_PDL_EARLY >= 2
#define GRID_WAIT() \
  asm volatile("griddepcontrol.wait;\n\tgriddepcontrol.launch_dependents;" ::: "memory")
#else
#define GRID_WAIT() asm volatile("griddepcontrol.wait;" ::: "memory")
#endif
#define GRID_LAUNCH_DEPENDENTS() asm volatile("griddepcontrol.launch_dependents;")
#if defined(GENRT_PDL_EARLY) && GENRT_PDL_EARLY == 1
#define GRID_EARLY_LAUNCH() GRID_LAUNCH_DEPENDENTS()
#else
#define GRID_EARLY_LAUNCH() ((void)0)
#endif
#else
#define GRID_WAIT() ((void)0)
#define GRID_LAUNCH_DEPENDENTS() ((void)0)
#define GRID_EARLY_LAUNCH() ((void)0)
#endif
#if defined(GENRT_PDL) && GENRT_PDL_PREFETCH && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// The line holding p, into L2.
__device__ __forceinline__ void pdl_prefetch(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}
// `bytes` from p into L2 in one instruction of the copy engine (p 16-byte aligned and bytes
// at least 16, rounded down to a multiple of 16; nothing otherwise).
__device__ __forceinline__ void pdl_prefetch_bytes(const void* p, unsigned int bytes) {
  if ((reinterpret_cast<unsigned long long>(p) & 15ull) == 0ull && bytes >= 16u)
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes & ~15u));
}
#else
__device__ __forceinline__ void pdl_prefetch(const void*) {}
__device__ __forceinline__ void pdl_prefetch_bytes(const void*, unsigned int) {}
#endif
"""

#: Asynchronous copies from global into shared memory (sm_80+), for the sources that stream
#: tiles or weights through shared memory (``_flash``, ``_gated_mlp``).
CP_ASYNC = r"""
DEVI unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
// 16 bytes from global memory into shared memory, asynchronously; zeros when !ok.
DEVI void cp_async16(void* dst, const void* src, bool ok) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)),
               "l"(src), "r"(ok ? 16 : 0)
               : "memory");
}
DEVI void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most one committed group is still in flight.
DEVI void cp_async_wait1() { asm volatile("cp.async.wait_group 1;\n" ::: "memory"); }
// Waits until every committed group has landed (this thread's copies).
DEVI void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }
"""

#: Device helpers shared by the RawKernel sources: fp16 <-> fp32, block reductions, and
#: the programmatic-launch macros (GRID_DEPENDENCY).
DEVICE_COMMON = (
    GRID_DEPENDENCY
    + r"""
#define DEVI __device__ __forceinline__
typedef unsigned short half_t;

struct __align__(2) bf16_t { unsigned short bits; };

DEVI float h2f(half_t h) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f; }
DEVI half_t f2h(float f) { half_t h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h; }
DEVI float bf2f(unsigned short b) { return __uint_as_float((unsigned int)b << 16); }
DEVI unsigned short f2bf(float f) {
  unsigned short b;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b) : "f"(f));
  return b;
}

DEVI float ld(const float* p, long long i) { return p[i]; }
DEVI float ld(const half_t* p, long long i) { return h2f(p[i]); }
DEVI float ld(const bf16_t* p, long long i) { return bf2f(p[i].bits); }
DEVI void st(float* p, long long i, float v) { p[i] = v; }
DEVI void st(half_t* p, long long i, float v) { p[i] = f2h(v); }
DEVI void st(bf16_t* p, long long i, float v) { p[i].bits = f2bf(v); }

// A 32-bit word of two 16-bit values of S (the pointer only picks the type) as two floats,
// the lower address first; and two floats packed back.
DEVI void unpack2(const half_t*, unsigned int w, float& a, float& b) {
  a = h2f((half_t)(w & 0xffffu));
  b = h2f((half_t)(w >> 16));
}
DEVI void unpack2(const bf16_t*, unsigned int w, float& a, float& b) {
  a = __uint_as_float(w << 16);
  b = __uint_as_float(w & 0xffff0000u);
}
DEVI unsigned int pack2(const half_t*, float a, float b) {
  return (unsigned int)f2h(a) | ((unsigned int)f2h(b) << 16);
}
DEVI unsigned int pack2(const bf16_t*, float a, float b) {
  return (unsigned int)f2bf(a) | ((unsigned int)f2bf(b) << 16);
}

DEVI float neg_inf() { return __int_as_float(0xff800000); }

// Sum over aligned groups of W lanes (the whole warp by default); every lane must call it.
template <int W = 32>
DEVI float warp_sum(float v) {
#pragma unroll
  for (int o = W / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
DEVI float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sums each lane's acc[r][m] of a warp-per-column GEMV (block (32, 8)) over the warp, then
// over the wpc warps sharing the columns (red: the block's [8][NR][MT] shared floats); true in
// the thread that then holds the columns' sums (lane 0 of share 0). Every thread of the block
// must call it.
template <int NR, int MT>
DEVI bool gemv_reduce(float (&acc)[NR][MT], float (*red)[NR][MT], int wy, int wpc, int lane) {
#pragma unroll
  for (int r = 0; r < NR; ++r)
#pragma unroll
    for (int m = 0; m < MT; ++m) acc[r][m] = warp_sum(acc[r][m]);
  if (wpc > 1) {
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < NR; ++r)
#pragma unroll
        for (int m = 0; m < MT; ++m) red[wy][r][m] = acc[r][m];
    }
    __syncthreads();
    if (wy % wpc == 0 && lane == 0) {
      for (int p = 1; p < wpc; ++p)
#pragma unroll
        for (int r = 0; r < NR; ++r)
#pragma unroll
          for (int m = 0; m < MT; ++m) acc[r][m] += red[wy + p][r][m];
    }
  }
  return wy % wpc == 0 && lane == 0;
}

// Finishes a warp-per-column GEMV (gemv_reduce): C[m, n0 + r] (+ bias).
template <typename S, int NR, int MT>
DEVI void gemv_store(float (&acc)[NR][MT], float (*red)[NR][MT], int wy, int wpc, int lane,
                     long long n0, int N, int M, S* C, const S* bias, int has_bias) {
  if (!gemv_reduce<NR, MT>(acc, red, wy, wpc, lane)) return;
#pragma unroll
  for (int r = 0; r < NR; ++r) {
    const long long n = n0 + r;
    if (n < N) {
      const float bv = has_bias ? ld(bias, n) : 0.f;
#pragma unroll
      for (int m = 0; m < MT; ++m)
        if (m < M) st(C, (long long)m * N + n, acc[r][m] + bv);
    }
  }
}

// SiLU gating of a gate value g and an up value u, in float: g * sigmoid(g) * u.
DEVI float silu_times(float g, float u) { return (g * (1.f / (1.f + expf(-g)))) * u; }

// silu_times of a gate sum and an up sum, each first rounded to S as a gate/up projection
// stores them for a SiluMul kernel to read (a gated store then gives the unfused path's bits).
template <typename S>
DEVI float silu_times_stored(float g, float u) {
  S gs, us;
  st(&gs, 0, g);
  st(&us, 0, u);
  return silu_times(ld(&gs, 0), ld(&us, 0));
}

// Finishes a gated warp-per-column GEMV (gemv_reduce) whose warp holds a gate column (r = 0)
// and its up column (r = 1): C[m, j] = silu_times_stored(gate, up) of [M, F] C.
template <typename S, int MT>
DEVI void gemv_store_gated(float (&acc)[2][MT], float (*red)[2][MT], int wy, int wpc, int lane,
                           long long j, int F, int M, S* C) {
  if (!gemv_reduce<2, MT>(acc, red, wy, wpc, lane) || j >= F) return;
#pragma unroll
  for (int m = 0; m < MT; ++m) {
    if (m < M) st(C, (long long)m * F + j, silu_times_stored<S>(acc[0][m], acc[1][m]));
  }
}

// 16 bytes of S as floats, and back (p 16-byte aligned; global or shared memory).
DEVI void ld16(const float* p, float* v) {
  const float4 q = *reinterpret_cast<const float4*>(p);
  v[0] = q.x; v[1] = q.y; v[2] = q.z; v[3] = q.w;
}
template <typename S>  // half_t or bf16_t: 8 values
DEVI void ld16(const S* p, float* v) {
  const uint4 q = *reinterpret_cast<const uint4*>(p);
  const unsigned int w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
  for (int u = 0; u < 4; ++u) unpack2(p, w[u], v[2 * u], v[2 * u + 1]);
}
DEVI void st16(float* p, const float* v) {
  *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
}
template <typename S>  // half_t or bf16_t: 8 values
DEVI void st16(S* p, const float* v) {
  unsigned int w[4];
#pragma unroll
  for (int u = 0; u < 4; ++u) w[u] = pack2(p, v[2 * u], v[2 * u + 1]);
  *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
}

// The fused GEMVs (NORM = 1 / 2, block (32, 8)) and tensor-core GEMMs (NORM = 1, FLAT):
// the block makes the activations of its M rows once, into shared memory act[M][K] as S
// (what the unfused norm or SiluMul kernel writes), then syncs. The GEMVs issue their first
// weight loads before, so the weights are in flight while the block stages. K is a multiple of 16 bytes of S; pointers 16-byte aligned.
// NORM = 1: RMS norm of h = A_in (+ skip when flags & 1) times gamma; block 0 writes h to
//   sum_out (flags & 2).
// NORM = 2: silu(g) * u with g = A_in and u = skip, or the second half of A_in's rows of 2K
//   (flags & 4).
// FLAT: a block of (256) threads (the tensor-core GEMMs) rather than (32, 8).
template <int NORM, int MT, bool FLAT = false, typename S>
DEVI void stage_act(const S* __restrict__ A_in, const S* __restrict__ skip,
                    const S* __restrict__ gamma, S* __restrict__ sum_out, float eps, int flags,
                    int M, int K, S* act) {
  constexpr int V = 16 / sizeof(S);
  const int tid = threadIdx.y * 32 + threadIdx.x, kv = K / V;
  if constexpr (NORM == 1) {
    const int lane = FLAT ? threadIdx.x & 31 : threadIdx.x;
    const int warp = FLAT ? threadIdx.x >> 5 : threadIdx.y;
    __shared__ float part[8][MT];
    float ss[MT];
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      ss[m] = 0.f;
      if (m < M) {
        for (int i = tid; i < kv; i += 256) {
          float h[V];
          ld16(A_in + (long long)m * K + i * V, h);
          if (flags & 1) {
            float b[V];
            ld16(skip + (long long)m * K + i * V, b);
#pragma unroll
            for (int v = 0; v < V; ++v) h[v] += b[v];
          }
#pragma unroll
          for (int v = 0; v < V; ++v) ss[m] = fmaf(h[v], h[v], ss[m]);
        }
      }
      ss[m] = warp_sum(ss[m]);
      if (lane == 0) part[warp][m] = ss[m];
    }
    __syncthreads();
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      if (m < M) {
        float t = 0.f;
#pragma unroll
        for (int w = 0; w < 8; ++w) t += part[w][m];
        const float inv = rsqrtf(t / (float)K + eps);
        for (int i = tid; i < kv; i += 256) {
          const long long at = (long long)m * K + i * V;
          float h[V], g[V];
          ld16(A_in + at, h);
          if (flags & 1) {
            float b[V];
            ld16(skip + at, b);
#pragma unroll
            for (int v = 0; v < V; ++v) h[v] += b[v];
            if ((flags & 2) && blockIdx.x == 0) st16(sum_out + at, h);
          }
          ld16(gamma + i * V, g);
#pragma unroll
          for (int v = 0; v < V; ++v) h[v] = h[v] * inv * g[v];
          st16(act + at, h);
        }
      }
    }
  } else {
    const int split = flags & 4;
    const long long pitch = split ? 2LL * K : (long long)K;
#pragma unroll 4
    for (int j = tid; j < M * kv; j += 256) {
      const int m = j / kv, i = j - m * kv;
      float g[V], u[V];
      ld16(A_in + m * pitch + i * V, g);
      ld16(split ? A_in + m * pitch + K + i * V : skip + (long long)m * K + i * V, u);
#pragma unroll
      for (int v = 0; v < V; ++v) g[v] = silu_times(g[v], u[v]);
      st16(act + (long long)m * K + i * V, g);
    }
  }
  __syncthreads();
}

// The chunk loop of a warp-per-column GEMV (gemv_nk, nbits4_gemv16), a lane's chunks from c0
// in steps of `stride`: load(c, buf) issues the loads of the chunks at c, math(c, buf, A)
// consumes them. NORM != 0: the first loads are issued, then the block stages the fused op's
// activations (stage_act) in the launch's dynamic shared memory, and the math reads them there.
template <int NORM, int MT, typename Buf, typename S, typename Load, typename Math>
DEVI void gemv_chunk_loop(int c0, int chunks, int stride, Load&& load, Math&& math,
                          const S* A_in, const S* skip, const S* gamma, S* sum_out, float eps,
                          int flags, int M, int K) {
  if constexpr (NORM == 0) {
    for (; c0 < chunks; c0 += stride) {
      Buf w;
      load(c0, w);
      math(c0, w, A_in);
    }
  } else {
    extern __shared__ __align__(16) unsigned char stage_bytes[];
    S* act = reinterpret_cast<S*>(stage_bytes);
    Buf w;
    load(c0, w);
    stage_act<NORM, MT>(A_in, skip, gamma, sum_out, eps, flags, M, K, act);
    for (; c0 < chunks; c0 += stride) {
      math(c0, w, act);
      if (c0 + stride < chunks) load(c0 + stride, w);
    }
  }
}

// Block-wide sum / max; blockDim.x is a multiple of 32, sh holds at least 33 floats.
DEVI float block_sum(float v, float* sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float w = lane < warps ? sh[lane] : 0.f;
    w = warp_sum(w);
    if (lane == 0) sh[32] = w;
  }
  __syncthreads();
  return sh[32];
}
DEVI float block_max(float v, float* sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float w = lane < warps ? sh[lane] : neg_inf();
    w = warp_max(w);
    if (lane == 0) sh[32] = w;
  }
  __syncthreads();
  return sh[32];
}
"""
)

#: Device helpers of the ArgMax kernels: order keys that make the pick of a row one max.
ARG_KEYS = r"""
// Order key of element i of value v: the value's bits made unsigned-comparable (-0 as +0,
// NaN above everything as in numpy) over the index, so that the lower index wins a tie (the
// higher with last). The largest key is the pick whatever order keys are met in; 0 is no pick.
DEVI unsigned long long arg_key(float v, long long i, int last) {
  unsigned int u = __float_as_uint(v);
  u = v != v ? 0xffffffffu : (v == 0.f ? 0x80000000u : ((u & 0x80000000u) ? ~u : (u | 0x80000000u)));
  const unsigned int low = last ? (unsigned int)i : 0xffffffffu - (unsigned int)i;
  return ((unsigned long long)u << 32) | low;
}
DEVI long long arg_index(unsigned long long k, int last) {
  if (k == 0ull) return 0;
  const unsigned int low = (unsigned int)k;
  return last ? (long long)low : (long long)(0xffffffffu - low);
}
DEVI unsigned long long kmax(unsigned long long a, unsigned long long b) { return a > b ? a : b; }

// Block-wide largest key; thread 0 gets it. sh holds 32 entries.
DEVI unsigned long long block_kmax(unsigned long long k, unsigned long long* sh) {
  for (int o = 16; o > 0; o >>= 1) k = kmax(k, __shfl_xor_sync(0xffffffffu, k, o));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  __syncthreads();
  if (lane == 0) sh[warp] = k;
  __syncthreads();
  if (warp == 0) {
    k = lane < warps ? sh[lane] : 0ull;
    for (int o = 16; o > 0; o >>= 1) k = kmax(k, __shfl_xor_sync(0xffffffffu, k, o));
  }
  return k;
}
"""
