"""CUDA kernel of ``onnx_genrt::NormGatedMLP`` (declared in ``core.genrt_ops``, registered in
``genrt``): a decoder layer's whole MLP half, ``MatMul(SiluMul(MatMul(norm(x + skip),
W_gate_up); split=1), W_down)``, as one cooperative grid instead of three kernels (the
norm-fused gate/up GEMV, SiluMul, the down GEMV).

``norm_gated_mlp`` runs as many blocks as fit on every SM at once (the driver's occupancy
for its shared memory) and two phases with a grid barrier between them:

1. every warp issues its first gate/up loads, then every block normalizes the M rows into
   shared memory (``stage_act``, as the norm-fused GEMVs do; block 0 writes the residual
   sum), then each warp takes columns j of the gate and up halves (rows j and F + j of the
   transposed gate/up weight [2F, K]): g and u are rounded to the storage type as the
   unfused GEMV's output is, and ``act[m, j] = g * sigmoid(g) * u`` goes to a global
   buffer [M, F];
2. after the barrier every block copies ``act`` into shared memory and each warp takes
   columns n of the transposed down weight [N, F].

The down weights do not wait for the barrier: at the start each warp copies the row of its
first down column into shared memory (cp.async, where it fits) and prefetches its other rows
into L2 (sm_90), so they stream in while phase 1 runs. Each warp's next round of weights is
loaded before the math of the current one. A lane sums chunks lane, lane + 32, ... of its
column in order and the warp sums its lanes by butterfly: a row's arithmetic depends neither
on M, nor on the rows beside it, nor on the grid size or where a weight row was read from.

Shapes it does not take (``mlp_problem``: more than ``MLP_MAX_ROWS`` rows, float32, rows not
whole 16-byte vectors, activations that do not fit shared memory, a driver without
cooperative launch) run the unfused kernels (``NormMatMul``, then ``SiluMulMatMul``; see
``genrt.norm_gated_mlp``) into the node's planned buffers.
"""

from __future__ import annotations

import cupy
import numpy as np

from onnx_genrt.core.kernels import KernelContext

from ..driver import load as load_driver
from ._common import BF16, CP_ASYNC, DEVICE_COMMON, F16, function, sm_count, storage
from .matmul import TransposedWeight
from .reduce import zeroed_counters

#: Rows (batch x new tokens) up to which the fused grid runs; more run the unfused kernels.
MLP_MAX_ROWS = 8
#: Dynamic shared memory a block of the fused grid may use: the larger of the M x K
#: normalized rows and the M x F activations, as 16-bit values, and (when they fit too) one
#: down row of F values for each of its 8 warps.
MLP_SHARED_MAX = 200 << 10

_SOURCE = (
    DEVICE_COMMON
    + CP_ASYNC
    + r"""
// Grid barrier of a cooperative launch (every block resident): count[0] counts arrivals over
// the launch, so the b-th barrier (from 1) waits for b * gridDim.x of them; grid_done, after
// the last barrier, lets the last block out set both counters back to zero for the next launch.
DEVI void grid_sync(unsigned int* count, unsigned int target) {
  __syncthreads();
  if (threadIdx.x == 0 && threadIdx.y == 0) {
    __threadfence();
    atomicAdd(count, 1u);
    unsigned int seen;
    do {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(count) : "memory");
    } while (seen < target);
  }
  __syncthreads();
}
DEVI void grid_done(unsigned int* count) {
  if (threadIdx.x == 0 && threadIdx.y == 0 && atomicAdd(count + 1, 1u) == gridDim.x - 1u) {
    count[0] = 0u;
    count[1] = 0u;
  }
}

// `bytes` from p into L2 (sm_90: one bulk prefetch; p 16-byte aligned; a hint only).
DEVI void l2_prefetch(const void* p, unsigned int bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if ((reinterpret_cast<unsigned long long>(p) & 15ull) == 0ull && bytes >= 16u)
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes & ~15u));
#endif
}

DEVI uint4 ld_weight(const void* p) {
  return __ldg(reinterpret_cast<const uint4*>(p));
}

// Columns c = first, first + stride, ... < ncols of a warp, each the dot products of R weight
// rows with the M rows of A (shared memory, M x K, K a multiple of 8 values of the 16-bit S):
// load(col, r, c) gives chunk c (8 values) of the col's r-th row. A lane takes chunks lane,
// lane + 32, ... in ascending order, G of them a load round, the next round's loads issued
// before this round's math (so the sums do not depend on G, on where the weights are or on
// which warp takes a column); before() runs once after the first round is issued (every
// warp calls it). done(c, acc) gets the warp's sums (every lane the same).
template <typename S, int MT, int R, int G, typename Load, typename Before, typename Done>
DEVI void warp_columns(Load&& load_w, int K, int ncols, const S* A, int M, int first,
                       int stride, Before&& before, Done&& done) {
  const int lane = threadIdx.x, chunks = K / 8;
  const int groups = (chunks + 32 * G - 1) / (32 * G);
  const int mine = first < ncols ? (ncols - first + stride - 1) / stride : 0;
  const int tasks = mine * groups;
  float acc[R][MT];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int m = 0; m < MT; ++m) acc[r][m] = 0.f;
  auto load = [&](int t, uint4 (&b)[R][G]) {
    const int ci = t / groups, gi = t - ci * groups;
    const long long col = first + (long long)ci * stride;
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int i = 0; i < G; ++i) {
        const int c = (gi * G + i) * 32 + lane;
        b[r][i] = c < chunks ? load_w(col, r, c) : make_uint4(0u, 0u, 0u, 0u);
      }
  };
  auto math = [&](int t, const uint4 (&b)[R][G]) {
    const int ci = t / groups, gi = t - ci * groups;
#pragma unroll
    for (int i = 0; i < G; ++i) {
      const int c = (gi * G + i) * 32 + lane;
      if (c < chunks) {
        float w[R][8];
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const unsigned int q[4] = {b[r][i].x, b[r][i].y, b[r][i].z, b[r][i].w};
#pragma unroll
          for (int u = 0; u < 4; ++u) unpack2(A, q[u], w[r][2 * u], w[r][2 * u + 1]);
        }
#pragma unroll
        for (int m = 0; m < MT; ++m) {
          if (m < M) {
            float a[8];
            ld16(A + (long long)m * K + (long long)c * 8, a);
#pragma unroll
            for (int r = 0; r < R; ++r)
#pragma unroll
              for (int v = 0; v < 8; ++v) acc[r][m] = fmaf(a[v], w[r][v], acc[r][m]);
          }
        }
      }
    }
    if (gi == groups - 1) {
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int m = 0; m < MT; ++m) acc[r][m] = warp_sum(acc[r][m]);
      done(first + ci * stride, acc);
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int m = 0; m < MT; ++m) acc[r][m] = 0.f;
    }
  };
  uint4 b0[R][G], b1[R][G];
  if (tasks > 0) load(0, b0);
  before();
  for (int t = 0; t < tasks; t += 2) {
    if (t + 1 < tasks) load(t + 1, b1);
    math(t, b0);
    if (t + 2 < tasks) load(t + 2, b0);
    if (t + 1 < tasks) math(t + 1, b1);
  }
}

// y [M, N] = MatMul(SiluMul(MatMul(norm(x + skip) * gamma, Wgu)), Wd) for M <= MT rows; Wgu
// and Wd transposed ([2F, K] and [N, F]). act [M, F]: global scratch between the phases;
// bar: two zeroed counters. Block (32, 8), one cooperative grid. Dynamic shared memory: the
// activations (MT x max(K, F) values), then with `pre` one down row of F values per warp,
// which the warp copies in (cp.async) at the start, so phase 2 reads its first column there.
// See the module docstring.
template <typename S, int MT>
__global__ void __launch_bounds__(256, MT <= 2 ? 2 : 1) norm_gated_mlp(
    const S* x, const S* skip, const S* gamma, S* sum_out, float eps, int flags,
    const S* __restrict__ Wgu, const S* __restrict__ Wd, S* act, S* y, int M, int K, int F,
    int N, int pre, unsigned int* bar) {
  extern __shared__ __align__(16) unsigned char stage_bytes[];
  S* sh = reinterpret_cast<S*>(stage_bytes);
  const int warp = blockIdx.x * 8 + threadIdx.y, warps = gridDim.x * 8;
  const int tid = threadIdx.y * 32 + threadIdx.x, lane = threadIdx.x;
  S* row = sh + (long long)MT * (K > F ? K : F) + (long long)threadIdx.y * F;
  const bool held = pre && warp < N;
  GRID_WAIT();
  if (held)  // this warp's first down row, into shared memory while phase 1 runs
    for (int c = lane; c < F / 8; c += 32)
      cp_async16(row + c * 8, Wd + (long long)warp * F + c * 8, true);
  cp_async_commit();
  for (int n = warp + (held ? warps : 0); n < N; n += warps)  // the others, into L2
    if (lane == 0) l2_prefetch(Wd + (long long)n * F, (unsigned int)F * sizeof(S));
  auto from_gu = [&](long long col, int r, int c) {
    return ld_weight(Wgu + (col + (long long)r * F) * K + (long long)c * 8);
  };
  auto stage = [&]() { stage_act<1, MT>(x, skip, gamma, sum_out, eps, flags, M, K, sh); };
  warp_columns<S, MT, 2, 4>(from_gu, K, F, sh, M, warp, warps, stage,
                            [&](int j, float (&acc)[2][MT]) {
    if (lane == 0) {
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        if (m < M) st(act, (long long)m * F + j, silu_times_stored<S>(acc[0][m], acc[1][m]));
      }
    }
  });
  grid_sync(bar, gridDim.x);
  GRID_LAUNCH_DEPENDENTS();
  const int vecs = M * F / 8;
  for (int i = tid; i < vecs; i += 256)
    reinterpret_cast<uint4*>(sh)[i] = __ldcg(reinterpret_cast<const uint4*>(act) + i);
  cp_async_wait_all();
  __syncthreads();
  auto store = [&](int n, float (&acc)[1][MT]) {
    if (lane == 0) {
#pragma unroll
      for (int m = 0; m < MT; ++m)
        if (m < M) st(y, (long long)m * N + n, acc[0][m]);
    }
  };
  auto nothing = [] {};
  if (held) {
    auto from_row = [&](long long, int, int c) {
      return *reinterpret_cast<const uint4*>(row + (long long)c * 8);
    };
    warp_columns<S, MT, 1, 8>(from_row, F, warp + 1, sh, M, warp, warps, nothing, store);
  }
  auto from_d = [&](long long col, int, int c) {
    return ld_weight(Wd + col * F + (long long)c * 8);
  };
  warp_columns<S, MT, 1, 8>(from_d, F, N, sh, M, held ? warp + warps : warp, warps, nothing,
                            store);
  grid_done(bar);
}
"""
)


def _rows_of(x: cupy.ndarray) -> int:
    return int(x.size // x.shape[-1]) if x.ndim and x.shape[-1] else 0


def _mt(rows: int) -> int:
    return next(t for t in (1, 2, 4, 8) if t >= rows)


def mlp_problem(x: cupy.ndarray, skip, gamma, wgu, wd) -> str | None:
    """Why the fused grid does not take a call (None: it does)."""
    if not isinstance(wgu, TransposedWeight) or not isinstance(wd, TransposedWeight):
        return "weights not prepacked"
    if x.dtype not in (F16, BF16) or gamma.dtype != x.dtype:
        return f"{x.dtype} activations (fp16 and bf16 only)"
    rows, k = _rows_of(x), int(x.shape[-1])
    two_f, f = int(wgu.shape[1]), int(wd.shape[0])
    if not 0 < rows <= MLP_MAX_ROWS:
        return f"{rows} rows (1 to {MLP_MAX_ROWS})"
    if int(wgu.shape[0]) != k or two_f != 2 * f or k % 8 or f % 8:
        return "shapes"
    if skip is not None and (skip.shape != x.shape or skip.dtype != x.dtype):
        return "skip shape"
    if _shared_bytes(rows, k, f)[0] > MLP_SHARED_MAX:
        return "activations larger than shared memory"
    if not all(t is None or t.data.ptr % 16 == 0 for t in (x, skip, gamma, wgu.t, wd.t)):
        return "unaligned"
    driver = load_driver()
    if isinstance(driver, str):
        return driver
    return None


def _shared_bytes(rows: int, k: int, f: int) -> tuple[int, int]:
    """(dynamic shared bytes a block takes, 1 when they hold each warp's first down row)."""
    act = max(k, f) * _mt(rows) * 2
    held = act + 8 * f * 2
    return (held, 1) if held <= MLP_SHARED_MAX else (act, 0)


def launch_gated_mlp(
    ctx: KernelContext, x, skip, gamma, wgu: TransposedWeight, wd: TransposedWeight, outs, eps
) -> None:
    """Queue the grid for a call ``mlp_problem`` accepts; ``outs``: (y, sum or None, act)."""
    y, total, act = outs
    rows, k, f, n = _rows_of(x), int(x.shape[-1]), int(wd.shape[0]), int(wd.shape[1])
    mt = _mt(rows)
    flags = (skip is not None) | (2 * (total is not None))
    fn = function(_SOURCE, f"norm_gated_mlp<{storage(ctx, x.dtype)}, {mt}>")
    shared, held = _shared_bytes(rows, k, f)
    if shared > 48 << 10:
        fn.raw.max_dynamic_shared_size_bytes = shared
    fn.cooperative(
        (sm_count() * max(1, fn.blocks_per_sm(256, shared)),),
        (32, 8),
        (
            x,
            skip if skip is not None else x,
            gamma,
            total if total is not None else x,
            np.float32(eps),
            np.int32(flags),
            wgu.t,
            wd.t,
            act,
            y,
            np.int32(rows),
            np.int32(k),
            np.int32(f),
            np.int32(n),
            np.int32(held),
            zeroed_counters(ctx, 2),
        ),
        shared_mem=shared,
    )
