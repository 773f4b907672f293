"""CUDA MatMul: own kernels for up to 64 rows, cuBLAS above (both capturable).

The skinny kernel reads the row-major weight B [K, N] once, which is what bounds a decode
or verify step. Each block owns a tile of N columns; its threads stride over K with
vector loads of a B row (float4 / 8 halves), so a warp reads whole 32-byte sectors. A
block holds up to four rows of A as 4 x V fp32 accumulators; larger M is cut into row
groups whose blocks for one column tile sit side by side in the grid, so B comes from DRAM
about once and from L2 for the other groups. When the tiles alone cannot fill the GPU, K is
split across blocks and a second kernel adds the parts.

A constant 2-D weight is prepacked once, when the session is built, as its transpose
[N, K] (:class:`TransposedWeight`). Then each output column is one contiguous row: a warp
(or a few, for long rows) reads it with 16-byte loads and reduces with shuffles, in one
launch with no split-K pass; fp16/bf16 from ``mma_min_rows`` rows (one, by default) up to
MMA_MAX_M run on the tensor cores (``gemm_mma``), whose sums over K do not depend on M, with
a fused RMS norm or SiLU gating made in each block as ``gemv_nk`` and the norm kernel make it:
a row's bits are the same alone, in a batch and in a verify step (``MMA_MIN_ROWS``).

Everything else (more rows, broadcast batches, misaligned operands) runs cuBLAS on the
provider's own handle (``providers/cuda/cublas.py``, provider option ``cublas_in_graphs``),
which a graph capture records, so prompt chunks of any width replay graphs. With the option
off it is CuPy's matmul, which CuPy refuses during stream capture: such a step raises
:class:`CaptureUnsupported` and runs eagerly, counted as a fallback with that reason. Batch
dims that broadcast other than whole (one side's batch all ones) go the same way.
"""

from __future__ import annotations

import math
from typing import Any

import cupy
import numpy as np

from onnx_genrt.core.kernels import KernelContext, TransposedWeight
from onnx_genrt.core.op_rules import matmul_shape

from ..cublas import CublasHandle, GemmShape, matmul_gemm_shape
from ._common import (
    BF16,
    DEVICE_COMMON,
    F16,
    F32,
    FLOAT_DTYPES,
    CaptureUnsupported,
    capturing,
    contiguous,
    function,
    out,
    scratch,
    sm_count,
    storage,
)
from ._registry import REGISTRY

#: The constant weights each kernel prefetches into L2 before its GRID_WAIT() (only these:
#: an activation is not ready then; tests/providers/cuda/test_pdl_launch.py checks it).
PDL_WEIGHTS = {"gemv_nk": ("W",), "gemm_mma": ("W",)}
#: Largest M (rows of A, batch dims folded in) that runs on the skinny kernel.
SKINNY_MAX_M = 16
#: Threads per block of the skinny kernel.
_THREADS = 256

_SOURCE = (
    DEVICE_COMMON
    + r"""
// V consecutive elements of a B row as floats; p is aligned to V elements.
template <typename S, int V> struct Row;
template <> struct Row<float, 1> {
  static DEVI void load(const float* p, float* v) { v[0] = p[0]; }
};
template <> struct Row<float, 2> {
  static DEVI void load(const float* p, float* v) {
    const float2 q = *reinterpret_cast<const float2*>(p); v[0] = q.x; v[1] = q.y;
  }
};
template <> struct Row<float, 4> {
  static DEVI void load(const float* p, float* v) {
    const float4 q = *reinterpret_cast<const float4*>(p);
    v[0] = q.x; v[1] = q.y; v[2] = q.z; v[3] = q.w;
  }
};
// 16-bit storage (half_t, bf16_t): V consecutive values through unpack2.
template <typename S, int V> struct Row16 {
  static DEVI void load(const S* p, float* v) {
    if constexpr (V == 1) {
      v[0] = ld(p, 0);
    } else if constexpr (V == 2) {
      unpack2(p, *reinterpret_cast<const unsigned int*>(p), v[0], v[1]);
    } else if constexpr (V == 4) {
      const uint2 q = *reinterpret_cast<const uint2*>(p);
      unpack2(p, q.x, v[0], v[1]); unpack2(p, q.y, v[2], v[3]);
    } else {
      static_assert(V == 8, "16-bit rows load 1, 2, 4 or 8 values");
      const uint4 q = *reinterpret_cast<const uint4*>(p);
      unpack2(p, q.x, v[0], v[1]); unpack2(p, q.y, v[2], v[3]);
      unpack2(p, q.z, v[4], v[5]); unpack2(p, q.w, v[6], v[7]);
    }
  }
};
template <int V> struct Row<half_t, V> : Row16<half_t, V> {};
template <int V> struct Row<bf16_t, V> : Row16<bf16_t, V> {};

// C[z, m, n] = sum_k A[z, m, k] * B[z, k, n], fp32 accumulation.
// grid (column tiles * row groups, K splits, batch); block (TX, TY), TX * TY = 256, powers of 2.
// A block owns TX * V columns and MT rows (row group blockIdx.x % groups); its threads stride
// over K by TY. splits == 1 writes C; otherwise fp32 partial sums go to P[z, split, m, n].
template <typename S, int V, int MT>
__global__ void __launch_bounds__(256) skinny_gemm(
    const S* __restrict__ A, const S* __restrict__ B, S* __restrict__ C, float* __restrict__ P,
    int M, int K, int N, int k_chunk, long long b_batch, int splits, int groups) {
  extern __shared__ float red[];
  GRID_WAIT();  // B may be an activation: nothing is read before the previous kernel ends
  const int tx = threadIdx.x, ty = threadIdx.y, TX = blockDim.x, TY = blockDim.y;
  const int tid = ty * TX + tx, nthreads = TX * TY;
  const int z = blockIdx.z, split = blockIdx.y;
  const int m0 = (blockIdx.x % groups) * MT, rows = min(MT, M - m0);
  const int n_base = (blockIdx.x / groups) * TX * V;
  const int n0 = n_base + tx * V;
  const S* Az = A + ((long long)z * M + m0) * K;
  const S* Bz = B + (long long)z * b_batch;
  const int k_end = min(K, (split + 1) * k_chunk);
  float acc[MT][V];
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int v = 0; v < V; ++v) acc[m][v] = 0.f;
  if (n0 < N) {
    int k = split * k_chunk + ty;
    for (; k + 3 * TY < k_end; k += 4 * TY) {
      float b[4][V];
#pragma unroll
      for (int u = 0; u < 4; ++u) Row<S, V>::load(Bz + (long long)(k + u * TY) * N + n0, b[u]);
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        if (m < rows) {
          const S* a = Az + (long long)m * K + k;
#pragma unroll
          for (int u = 0; u < 4; ++u) {
            const float av = ld(a, (long long)u * TY);
#pragma unroll
            for (int v = 0; v < V; ++v) acc[m][v] = fmaf(av, b[u][v], acc[m][v]);
          }
        }
      }
    }
    for (; k < k_end; k += TY) {
      float b[V];
      Row<S, V>::load(Bz + (long long)k * N + n0, b);
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        if (m < rows) {
          const float av = ld(Az, (long long)m * K + k);
#pragma unroll
          for (int v = 0; v < V; ++v) acc[m][v] = fmaf(av, b[v], acc[m][v]);
        }
      }
    }
  }
  GRID_LAUNCH_DEPENDENTS();
  // Sum over ty: red[e][ty][tx] with e = m * V + v. Each of the MT * V * TX sums is shared
  // by G adjacent threads (strided partial sums, then a shuffle), so every thread does about
  // MT * V additions instead of a log2(TY)-level tree.
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int v = 0; v < V; ++v) red[(m * V + v) * nthreads + tid] = acc[m][v];
  __syncthreads();
  const int outs = MT * V * TX;
  const int G = outs >= nthreads ? 1 : nthreads / outs;  // a power of two, at most 32
  const int part = tid % G;
  for (int o = tid / G; o < outs; o += nthreads / G) {
    const int e = o / TX, c = o % TX;
    float r = 0.f;
    for (int y = part; y < TY; y += G) r += red[e * nthreads + y * TX + c];
    for (int off = G >> 1; off > 0; off >>= 1) r += __shfl_down_sync(0xffffffffu, r, off, G);
    const int m = e / V, n = n_base + c * V + e % V;
    if (part == 0 && m < rows && n < N) {
      if (splits == 1) st(C, ((long long)z * M + m0 + m) * N + n, r);
      else P[(((long long)z * splits + split) * M + m0 + m) * N + n] = r;
    }
  }
}

// 16 bytes of S as floats (8 values of a 16-bit S).
template <typename S> struct Vec16 {
  static constexpr int N = 8;
  static DEVI void load(const S* p, float* v) { Row<S, 8>::load(p, v); }
};
template <> struct Vec16<float> {
  static constexpr int N = 4;
  static DEVI void load(const float* p, float* v) { Row<float, 4>::load(p, v); }
};

// C[m, n] = sum_k A[m, k] * W[n, k]: W is a transposed weight [N, K], K a multiple of 16
// bytes, A and W 16-byte aligned. Block (32, 8): warp y owns columns NR * g .. NR * g + NR - 1
// with g = blockIdx.x * (8 / wpc) + y / wpc, and the (y % wpc)-th share of their 16-byte
// chunks. A lane loads U chunks of each of its columns before any math.
// NORM != 0: the activations of a fused op (see stage_act; NORM = 1: an RMS norm, 2: SiLU
// gating) are made by the block in shared memory (M * K of S, the launch's dynamic shared
// memory) after its first weight loads are issued; the dot products then read them there.
// GATED = 1 (NR = 2): W holds gate and up columns side by side (N = 2F); warp group j owns
// gate column j and up column j + F, and C is [M, F]: silu_times(gate, up) (gemv_store_gated).
template <typename S, int MT, int NR, int NORM, int GATED>
__global__ void __launch_bounds__(256) gemv_nk(
    const S* __restrict__ A_in, const S* __restrict__ W, S* __restrict__ C, int M, int K, int N,
    int wpc, const S* __restrict__ skip, const S* __restrict__ gamma, S* __restrict__ sum_out,
    float eps, int norm_flags) {
  static_assert(!GATED || NR == 2, "a gated GEMV's warp holds one gate and one up column");
  constexpr int V = Vec16<S>::N;
  constexpr int U = 2;
  __shared__ float red[8][NR][MT];
  const int lane = threadIdx.x, wy = threadIdx.y;
  const long long group = (long long)blockIdx.x * (8 / wpc) + wy / wpc;
  // column r of the warp's group: n0 + r * cs
  const long long n0 = GATED ? group : group * NR, cs = GATED ? N / 2 : 1;
  const long long n_end = GATED ? N / 2 : N;  // n0 + r * cs < N exactly where n0 < n_end
  const int share = wy % wpc;
  const int chunks = K / V, step = 32 * wpc;
  // The first round of the block's loads (each column's first U * step chunks) into L2 while
  // the previous kernel finishes: one bulk prefetch a column.
  if (share == 0 && lane < NR && (GATED ? n0 < n_end : n0 + lane < N))
    pdl_prefetch_bytes(W + (n0 + lane * cs) * K, min(chunks, U * step) * 16u);
  GRID_WAIT();
  float acc[NR][MT];
#pragma unroll
  for (int r = 0; r < NR; ++r)
#pragma unroll
    for (int m = 0; m < MT; ++m) acc[r][m] = 0.f;
  auto load_w = [&](int c0, float (&w)[U][NR][V]) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + u * step;
#pragma unroll
      for (int r = 0; r < NR; ++r) {
        if (c < chunks && (GATED ? n0 < n_end : n0 + r < N)) {
          Vec16<S>::load(W + (n0 + r * cs) * K + (long long)c * V, w[u][r]);
        } else {
#pragma unroll
          for (int v = 0; v < V; ++v) w[u][r][v] = 0.f;
        }
      }
    }
  };
  auto math = [&](int c0, const float (&w)[U][NR][V], const S* A) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + u * step;
      if (c < chunks) {
#pragma unroll
        for (int m = 0; m < MT; ++m) {
          if (m < M) {
            float a[V];
            Vec16<S>::load(A + (long long)m * K + (long long)c * V, a);
#pragma unroll
            for (int r = 0; r < NR; ++r)
#pragma unroll
              for (int v = 0; v < V; ++v) acc[r][m] = fmaf(a[v], w[u][r][v], acc[r][m]);
          }
        }
      }
    }
  };
  gemv_chunk_loop<NORM, MT, float[U][NR][V]>(share * 32 + lane, chunks, U * step, load_w, math,
                                               A_in, skip, gamma, sum_out, eps, norm_flags, M, K);
  GRID_LAUNCH_DEPENDENTS();
  if constexpr (GATED)
    gemv_store_gated<S, MT>(acc, red, wy, wpc, lane, n0, N / 2, M, C);
  else
    gemv_store<S, NR, MT>(acc, red, wy, wpc, lane, n0, N, M, C, C, 0);
}

// C[i] = sum over splits of P; i runs over batch * M * N.
template <typename S>
__global__ void splitk_sum(const float* __restrict__ P, S* __restrict__ C, long long mn,
                           int splits, long long total) {
  GRID_WAIT();
  GRID_LAUNCH_DEPENDENTS();
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= total) return;
  const long long z = i / mn, r = i - z * mn;
  const float* p = P + z * splits * mn + r;
  float s = 0.f;
  for (int t = 0; t < splits; ++t) s += p[t * mn];
  st(C, i, s);
}

// C[m, j] = silu_times(gate, up) of P's split sums of columns j and j + F of [M, 2F], each
// rounded to S first (as splitk_sum stores them); i runs over M * F.
template <typename S>
__global__ void splitk_sum_gated(const float* __restrict__ P, S* __restrict__ C, int M, int F,
                                 int splits) {
  GRID_WAIT();
  GRID_LAUNCH_DEPENDENTS();
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (long long)M * F) return;
  const long long m = i / F, j = i - m * F, mn = 2LL * M * F;
  const float* p = P + m * 2 * F + j;
  float gs = 0.f, us = 0.f;
  for (int t = 0; t < splits; ++t) {
    gs += p[t * mn];
    us += p[t * mn + F];
  }
  st(C, i, silu_times_stored<S>(gs, us));
}
"""
)


#: Rows (M) up to which ``gemm_mma`` runs a transposed fp16/bf16 weight (4 tiles of 16).
MMA_MAX_M = 64
#: Rows up to which a prepacked MatMul runs ``gemv_nk`` in pieces of SKINNY_MAX_M rows.
PIECES_MAX_M = 64
#: Default of the CUDA provider's ``mma_min_rows``: rows from which a transposed fp16/bf16
#: weight runs on the tensor cores (``gemm_mma``) rather than ``gemv_nk``. From one row, so
#: every decode-width step (one row, a batch, a verify step) sums each row the same way and a
#: row's logits never depend on what it shares a step with: batched and speculative greedy
#: give the tokens of greedy alone. 3 runs one and two rows on ``gemv_nk``, 13% faster at one
#: row on the 0.5B fp16 shape, but a row then parts from alone at near ties
#: (docs/performance.md, session 31).
MMA_MIN_ROWS = 1
#: Default of the CUDA provider's ``mma_max_splits``: the most blocks a tensor-core GEMM
#: splits K over (their fp32 parts summed by ``splitk_sum``, a second launch); 1 never splits.
MMA_MAX_SPLITS = 16
#: Default of the CUDA provider's ``mma_split_min_k``: K shorter than this is never split (0:
#: any K may be). Unsplit, the attention projections of the 0.5B and 1.5B shapes (K = 896,
#: 1536) lose their second launch, while the down projections (K = 4864, 8960) keep the split
#: they gain from: graphed greedy +7.6% (0.5B fp16), +5.1% (int4), +4% / +1.4% (1.5B), the
#: 7B shape unchanged (docs/performance.md, session 34).
MMA_SPLIT_MIN_K = 2048
#: Rows up to which a tensor-core GEMM stages a fused RMS norm itself (``mma_act``).
MMA_STAGE_MAX_ROWS = 16
#: Shared memory of ``mma_tiles``' reduction buffer per 16-row tile (red[8][MT][32][4]).
MMA_REDUCE_BYTES = 8 * 32 * 4 * 4

#: Device code of the tensor-core GEMMs (``gemm_mma`` here, ``gemm_mma_nbits4`` for 4-bit
#: weights): the mma.m16n8k16 wrapper and the tile loop, generic in how a lane gets its eight
#: words of weight. sm_80 or newer (its own sources, so older GPUs still build the GEMVs).
MMA_TILES = r"""
// D = A * B + D for one 16x8x16 tile on the tensor cores (fp32 accumulators); a0..a3 and
// b0, b1 hold two 16-bit values each, in the fragment layout of mma.m16n8k16.
template <typename S> struct Mma;
template <> struct Mma<half_t> {
  static DEVI void run(float (&c)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                       unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
};
template <> struct Mma<bf16_t> {
  static DEVI void run(float (&c)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                       unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
};

// 32 bytes (16 values of 16 bits) at p as 8 words; zeros when !ok.
DEVI void ld32(const void* p, bool ok, unsigned (&w)[8]) {
  if (ok) {
    const uint4 x = reinterpret_cast<const uint4*>(p)[0];
    const uint4 y = reinterpret_cast<const uint4*>(p)[1];
    w[0] = x.x; w[1] = x.y; w[2] = x.z; w[3] = x.w;
    w[4] = y.x; w[5] = y.y; w[6] = y.z; w[7] = y.w;
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) w[i] = 0u;
  }
}

// C[m, n] = sum_k A[m, k] * W[n, k] + bias[n] on the tensor cores, A [M, K] (M <= 16 * MT)
// 16-byte aligned, K a multiple of 64, N of 8; the weight comes from ``load``: load(n, k, b)
// fills b with the 16 values of W's row n from k as 8 words of two values of S (the lower k
// in the low half). A block owns 8 columns of N and the K range [y * k_per_split,
// +k_per_split); its 8 warps take the range's 64-wide chunks in turn. In a chunk, lane
// (g, t) = (lane / 4, lane % 4) takes the 16 values at k + 16 t of W's row n0 + g and of A's
// rows g and g + 8 of each 16-row tile, one 32-byte load each for A, and feeds them to four
// mma.m16n8k16: the dot products sum over k in another order than the fragment layout's,
// the same for A and W, so each weight byte is read once in whole lines. The 8 warps' sums
// meet in shared memory; with splits > 1 the block writes fp32 partials P[y][m][n] (summed by
// splitk_sum; the bias goes into split 0's), else C.
// GATED = 1 (no bias): W holds gate and up columns side by side (N = 2F); the block's 8
// columns are gate columns j0 .. j0 + 3 (j0 = 4 * blockIdx.x) and their up columns j0 + F ..,
// and C [M, F] gets silu_times(gate, up) of the sums rounded to S (with splits > 1 the
// partials keep W's column numbers and splitk_sum_gated gates them).
// W's row (a column of C = A W^T) that slot x (0..7) of this block's 8 columns reads: row
// 8 * blockIdx.x + x, or with GATED gate row 4 * blockIdx.x + x (x < 4) and its up row N / 2
// further (x >= 4). mma_tiles' lanes and the kernels' L2 prefetches both use it.
template <int GATED>
DEVI int mma_w_row(int x, int N) {
  const int j0 = blockIdx.x * 4;
  return GATED ? (x < 4 ? j0 + x : N / 2 + j0 + x - 4) : blockIdx.x * 8 + x;
}

// The activations a tensor-core GEMM reads: A itself (R = 0), or, with a prologue fused
// (NORM = 1: an RMS norm, 2: SiLU gating; R >= M rows, a power of two up to 16), the block's
// rows made in the launch's dynamic shared memory by stage_act, as the GEMVs and the norm
// kernel make them (the same bits). After GRID_WAIT: A is the previous kernel's output.
template <int NORM, int R, typename S>
DEVI const S* mma_act(const S* __restrict__ A, const S* __restrict__ skip,
                      const S* __restrict__ gamma, S* __restrict__ sum_out, float eps,
                      int flags, int M, int K) {
  if constexpr (R == 0) {
    return A;
  } else {
    extern __shared__ __align__(16) unsigned char stage_bytes[];
    S* act = reinterpret_cast<S*>(stage_bytes);
    stage_act<NORM, R, true>(A, skip, gamma, sum_out, eps, flags, M, K, act);
    return act;
  }
}

// One 64-wide chunk at k of the MT row tiles against a lane's weight words b (mma_tiles).
template <typename S, int MT>
DEVI void mma_chunk(float (&acc)[MT][4], const S* arow, int k, int K, int M, int g,
                    const unsigned (&b)[8]) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const int r0 = mt * 16 + g;
    unsigned lo[8], hi[8];
    ld32(arow + (long long)(mt * 16) * K + k, r0 < M, lo);
    ld32(arow + (long long)(mt * 16 + 8) * K + k, r0 + 8 < M, hi);
#pragma unroll
    for (int j = 0; j < 4; ++j)
      Mma<S>::run(acc[mt], lo[2 * j], hi[2 * j], lo[2 * j + 1], hi[2 * j + 1], b[2 * j],
                  b[2 * j + 1]);
  }
}

template <typename S, int MT, int GATED, typename Load>
DEVI void mma_tiles(const S* __restrict__ A, const Load& load, const S* __restrict__ bias,
                    S* __restrict__ C, float* __restrict__ P, int M, int K, int N,
                    int k_per_split, int splits) {
  __shared__ float red[8][MT][32][4];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int n0 = blockIdx.x * 8, j0 = blockIdx.x * 4, F = N / 2;
  const int w_row = mma_w_row<GATED>(g, N);  // the W row lane g loads
  const int kb = blockIdx.y * k_per_split;
  const int ke = min(K, kb + k_per_split);
  float acc[MT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[mt][e] = 0.f;
  const S* arow = A + (long long)g * K + 16 * t;
  // The warp's chunks two a round, both chunks' weights loaded before either's mma (as
  // gemv_nk's U = 2), so a warp with two chunks waits for memory once; the sums run in the
  // order of one chunk a round.
  int k = kb + warp * 64;
  for (; k + 8 * 64 < ke; k += 2 * 8 * 64) {
    unsigned b0[8], b1[8];
    load(w_row, k + 16 * t, b0);
    load(w_row, k + 8 * 64 + 16 * t, b1);
    mma_chunk<S, MT>(acc, arow, k, K, M, g, b0);
    mma_chunk<S, MT>(acc, arow, k + 8 * 64, K, M, g, b1);
  }
  if (k < ke) {
    unsigned b0[8];
    load(w_row, k + 16 * t, b0);
    mma_chunk<S, MT>(acc, arow, k, K, M, g, b0);
  }
  GRID_LAUNCH_DEPENDENTS();
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int e = 0; e < 4; ++e) red[warp][mt][lane][e] = acc[mt][e];
  __syncthreads();
  if constexpr (GATED) {
    // row r of a tile and column slot c sit at lane (r % 8) * 4 + c / 2, element c % 2 +
    // 2 * (r / 8); gate slot c (< 4) pairs with up slot c + 4, two lanes on
    for (int i = threadIdx.x; i < MT * 64; i += 256) {
      const int mt = i >> 6, r = (i >> 2) & 15, c = i & 3;
      const int ln = (r & 7) * 4 + (c >> 1), e = (c & 1) + 2 * (r >> 3);
      float gs = 0.f, us = 0.f;
#pragma unroll
      for (int w = 0; w < 8; ++w) {
        gs += red[w][mt][ln][e];
        us += red[w][mt][ln + 2][e];
      }
      const int row = mt * 16 + r, j = j0 + c;
      if (row < M) {
        if (splits > 1) {
          float* p = P + (long long)blockIdx.y * M * N + (long long)row * N;
          p[j] = gs;
          p[F + j] = us;
        } else {
          st(C, (long long)row * F + j, silu_times_stored<S>(gs, us));
        }
      }
    }
  } else {
    for (int i = threadIdx.x; i < MT * 128; i += 256) {
      const int mt = i >> 7, ln = (i >> 2) & 31, e = i & 3;
      float s = 0.f;
#pragma unroll
      for (int w = 0; w < 8; ++w) s += red[w][mt][ln][e];
      const int row = mt * 16 + (ln >> 2) + (e >= 2 ? 8 : 0);
      const long long col = n0 + 2 * (ln & 3) + (e & 1);
      if (bias != nullptr && blockIdx.y == 0) s += ld(bias, col);
      if (row < M) {
        if (splits > 1) {
          P[(long long)blockIdx.y * M * N + (long long)row * N + col] = s;
        } else {
          st(C, (long long)row * N + col, s);
        }
      }
    }
  }
}
"""

_MMA_SOURCE = (
    DEVICE_COMMON
    + MMA_TILES
    + r"""
// A transposed weight W [N, K] (16-byte aligned rows): a lane's 16 values in one 32-byte load.
template <typename S>
struct FloatRows {
  const S* W;
  int K;
  DEVI void operator()(int n, int k, unsigned (&b)[8]) const {
    ld32(W + (long long)n * K + k, true, b);
  }
};

// C = A @ W^T on the tensor cores (see mma_tiles; GATED: C [M, N / 2], the gating; R > 0:
// A's prologue NORM made first, see mma_act).
template <typename S, int MT, int GATED, int NORM, int R>
__global__ void __launch_bounds__(256) gemm_mma(
    const S* __restrict__ A, const S* __restrict__ W, S* __restrict__ C, float* __restrict__ P,
    int M, int K, int N, int k_per_split, int splits, const S* __restrict__ skip,
    const S* __restrict__ gamma, S* __restrict__ sum_out, float eps, int norm_flags) {
  if (threadIdx.x < 8) {  // mma_tiles' first round (512 values of each row) into L2
    const int kb = blockIdx.y * k_per_split, ke = min(K, kb + k_per_split);
    const long long n = mma_w_row<GATED>(threadIdx.x, N);
    if (kb < ke)
      pdl_prefetch_bytes(W + n * K + kb,
                         (unsigned int)(min(ke, kb + 512) - kb) * (unsigned int)sizeof(S));
  }
  GRID_WAIT();
  const S* act = mma_act<NORM, R>(A, skip, gamma, sum_out, eps, norm_flags, M, K);
  mma_tiles<S, MT, GATED>(act, FloatRows<S>{W, K}, (const S*)nullptr, C, P, M, K, N,
                          k_per_split, splits);
}
"""
)


def mma_fits(a: cupy.ndarray, w: TransposedWeight, m: int) -> bool:
    """Whether ``gemm_mma`` runs ``a @ w``: fp16 or bf16, 1..MMA_MAX_M rows, K a multiple of
    64, N of 8, and both operands 16-byte aligned."""
    k, n = w.shape
    return (
        a.dtype in (F16, BF16)
        and 0 < m <= MMA_MAX_M
        and k % 64 == 0
        and n % 8 == 0
        and a.data.ptr % 16 == 0
        and w.t.data.ptr % 16 == 0
    )


def mma_config(
    m: int, k: int, n: int, sms: int, most: int = MMA_MAX_SPLITS
) -> tuple[int, int, int]:
    """(MT, splits, k_per_split) for ``gemm_mma``: 16-row tiles, and K split across blocks
    toward two blocks per SM while each split keeps at least four 64-wide chunks, in at most
    ``most`` splits. Nothing here depends on M, so a row's sums are the same at every M."""
    mt = -(-m // 16)
    chunks, blocks = k // 64, n // 8
    splits = max(1, min(-(-2 * sms // blocks), chunks // 4, most))
    per = -(-chunks // splits)
    return mt, -(-chunks // per), per * 64


def mma_norm_rows(norm: Any, a: cupy.ndarray, m: int) -> int:
    """The tensor-core GEMMs' staged rows (their ``R``) for ``norm`` (a fused norm or SiLU
    gating) in ``m`` rows of ``a``: the power of two at least ``m`` (at most 16), when the
    staged rows and the kernel's own reduction buffer fit a block's 48 KiB; 0 when unfused
    (``norm`` None) or when they do not fit (the caller runs ``norm.unfused()`` first)."""
    if norm is None or m > MMA_STAGE_MAX_ROWS:
        return 0
    mt = -(-m // 16)
    if norm.stage_bytes(a) + MMA_REDUCE_BYTES * mt > 48 << 10:
        return 0
    return next(r for r in (1, 2, 4, 8, 16) if r >= m)


def norm_args(norm: Any, a: cupy.ndarray, c: cupy.ndarray) -> tuple[tuple, int]:
    """The trailing (skip, gamma, sum_out, eps, flags) arguments of the kernels that may
    stage a fused norm, and their dynamic shared memory: ``norm``'s, or placeholders."""
    if norm is None:
        return (a, a, c, np.float32(0.0), np.int32(0)), 0
    return norm.kernel_args(a), norm.stage_bytes(a)


def gemm_mma(
    ctx: KernelContext,
    a: cupy.ndarray,
    w: TransposedWeight,
    c: cupy.ndarray,
    gated: bool = False,
    norm: Any = None,
) -> None:
    """c = a @ w on the tensor cores (``mma_fits`` must hold; ``a`` contiguous); ``gated``: c
    [m, N / 2] gets the SiLU gating of the product's gate and up halves; ``norm`` (a
    ``genrt.FusedNorm`` or ``FusedSilu`` that fits ``mma_norm_rows``): each block makes the
    activations from ``a`` first."""
    k, n = w.shape
    m = int(c.size // c.shape[-1])
    mt, splits, k_per = mma_config(m, k, n, sm_count(), mma_max_splits(ctx, k))
    rows = mma_norm_rows(norm, a, m)
    assert norm is None or rows, "gemm_mma: the fused norm does not fit (see mma_norm_rows)"
    s_type = storage(ctx, a.dtype)
    partial = c
    if splits > 1:
        partial = scratch(ctx, splits * m * n * 4).view(np.float32)
    fused = norm.ON_THE_FLY if rows else 0
    fn = function(_MMA_SOURCE, f"gemm_mma<{s_type}, {mt}, {int(gated)}, {fused}, {rows}>")
    args = (a, w.t, c, partial, np.int32(m), np.int32(k), np.int32(n), np.int32(k_per))
    extra, shared = norm_args(norm, a, c)
    args += (np.int32(splits), *extra)
    fn((n // 8, splits), (256,), args, shared_mem=shared)
    if splits > 1:
        sum_splits(ctx, partial, c, splits, gated)


def sum_splits(
    ctx: KernelContext, partial: cupy.ndarray, c: cupy.ndarray, splits: int, gated: bool = False
) -> None:
    """c = the sum of the ``splits`` fp32 partials [splits, c.size] (``splitk_sum``); gated:
    c [M, F] gets the SiLU gating of the sums of the partials' [M, 2F] gate and up halves
    (``splitk_sum_gated``)."""
    total = int(c.size)
    s_type = storage(ctx, c.dtype)
    if gated:
        f = int(c.shape[-1])
        reduce = function(_SOURCE, f"splitk_sum_gated<{s_type}>")
        args = (partial, c, np.int32(total // f), np.int32(f), np.int32(splits))
        reduce((-(-total // 256),), (256,), args)
        return
    reduce = function(_SOURCE, f"splitk_sum<{s_type}>")
    reduce(
        (-(-total // 256),),
        (256,),
        (partial, c, np.int64(total), np.int32(splits), np.int64(total)),
    )


def mma_max_splits(ctx: KernelContext, k: int) -> int:
    """The most blocks a tensor-core GEMM splits a K of ``k`` over: the CUDA provider's
    ``mma_max_splits`` (at least 1), or 1 where ``k`` is below its ``mma_split_min_k``."""
    if k < int(ctx.option("mma_split_min_k", MMA_SPLIT_MIN_K)):
        return 1
    return max(1, int(ctx.option("mma_max_splits", MMA_MAX_SPLITS)))


def mma_min_rows(ctx: KernelContext) -> int:
    """Rows from which transposed fp16/bf16 weights run on the tensor cores (the CUDA
    provider's ``mma_min_rows``; 0: never)."""
    return int(ctx.option("mma_min_rows", MMA_MIN_ROWS))


def provider_cublas(ctx: KernelContext) -> CublasHandle | None:
    """The provider's cuBLAS handle, which graph captures record, when its
    ``cublas_in_graphs`` option is on; None otherwise (then CuPy's matmul, eager only)."""
    if ctx.provider is None or not ctx.option("cublas_in_graphs", False):
        return None
    return ctx.provider.cublas  # type: ignore[attr-defined]


def skinny_dims(a_shape: tuple[int, ...], b_shape: tuple[int, ...]):
    """(batch, M, K, N, b_batch_elems) for the skinny kernel, or None when it does not apply.

    B 2-D (or 1-D): every leading dim of A folds into M. B batched: A must have the same
    batch dims (no broadcasting) and M is A's second-to-last dim.
    """
    k = int(a_shape[-1])
    if len(b_shape) <= 2:
        n = 1 if len(b_shape) == 1 else int(b_shape[-1])
        return 1, math.prod(a_shape[:-1]), k, n, 0
    if len(a_shape) != len(b_shape) or tuple(a_shape[:-2]) != tuple(b_shape[:-2]):
        return None
    n = int(b_shape[-1])
    return math.prod(a_shape[:-2]), int(a_shape[-2]), k, n, k * n


def skinny_config(
    itemsize: int, m: int, k: int, n: int, batch: int, b_ptr: int, b_batch: int, sms: int
) -> tuple[int, int, int, int, int, int]:
    """(MT, groups, V, TX, splits, k_chunk) for the skinny kernel.

    MT: rows per block (1, 2 or 4); M is cut into ``groups`` of MT rows, the blocks of one
    column tile side by side in the grid so they read B from L2 together. V: elements per
    vector load, 16 bytes while B's rows stay aligned. TX: threads across N, narrowed down
    to 128-byte row segments while the grid is short of blocks. K is then split across
    blocks toward about 16 blocks per SM (so no SM waits on a last, lone block), keeping at
    least 8 rows per thread and the fp32 partial sums small next to B.
    Measured bandwidth and floor on an H200: docs/performance.md.
    """
    mt = 1 if m <= 1 else 2 if m == 2 else 4
    groups = -(-m // mt)
    v = 16 // itemsize
    while v > 1 and (n % v or b_ptr % (v * itemsize) or (b_batch * itemsize) % (v * itemsize)):
        v //= 2
    target = 16 * sms
    min_tx = min(32, max(1, 128 // (v * itemsize)))
    tx = 32
    while tx > min_tx and batch * groups * -(-n // (tx * v)) < target:
        tx //= 2
    ty = _THREADS // tx
    blocks = batch * groups * -(-n // (tx * v))
    splits = 1
    if blocks < target:
        cap = min(64, max(1, k // (8 * ty)), max(1, k // (32 * m)))
        splits = max(1, min(-(-target // blocks), cap))
    k_chunk = -(-k // splits)
    splits = -(-k // k_chunk) if k else 1
    return mt, groups, v, tx, splits, k_chunk


def _skinny(
    ctx: KernelContext,
    a: cupy.ndarray,
    b: cupy.ndarray,
    c: cupy.ndarray,
    dims: tuple[int, int, int, int, int],
) -> None:
    batch, m, k, n, b_batch = dims
    s_type = storage(ctx, a.dtype)
    mt, groups, v, tx, splits, k_chunk = skinny_config(
        a.dtype.itemsize, m, k, n, batch, b.data.ptr, b_batch, sm_count()
    )
    ty = _THREADS // tx
    grid = (-(-n // (tx * v)) * groups, splits, batch)
    partial = c
    if splits > 1:
        partial = scratch(ctx, batch * splits * m * n * 4).view(np.float32)
    fn = function(_SOURCE, f"skinny_gemm<{s_type}, {v}, {mt}>")
    args = (a, b, c, partial, np.int32(m), np.int32(k), np.int32(n), np.int32(k_chunk))
    args += (np.int64(b_batch), np.int32(splits), np.int32(groups))
    fn(grid, (tx, ty), args, shared_mem=mt * v * _THREADS * 4)
    if splits > 1:
        total = batch * m * n
        reduce = function(_SOURCE, f"splitk_sum<{s_type}>")
        reduce(
            (-(-total // 256),),
            (256,),
            (partial, c, np.int64(m * n), np.int32(splits), np.int64(total)),
        )


def transpose_weight(provider, node, index: int, host: np.ndarray) -> TransposedWeight | None:
    """Prepack a constant 2-D fp32/fp16/bf16 weight (input B) whose rows are whole 16-byte chunks."""
    host = np.asarray(host)
    if index != 1 or host.ndim != 2 or host.dtype not in FLOAT_DTYPES or 0 in host.shape:
        return None
    if (host.shape[0] * host.dtype.itemsize) % 16:
        return None
    return TransposedWeight(provider.upload(np.ascontiguousarray(host.T)))


def gemv_layout(m: int, k_chunks: int, n: int, sms: int) -> tuple[int, int, int]:
    """(MT, NR, wpc) for ``gemv_nk``: rows per thread, columns per warp, warps per column.

    Two columns per warp once the columns alone fill the GPU many times over; more warps per
    column while the grid is short of blocks and rows are long enough to share.
    """
    mt = next(t for t in (1, 2, 4, 8, 16) if t >= m)
    nr = 2 if mt <= 4 and n >= 16 * 8 * sms else 1
    groups = -(-n // nr)
    wpc = 1
    while wpc < 8 and -(-groups * wpc // 8) < 2 * sms and k_chunks >= 64 * wpc:
        wpc *= 2
    return mt, nr, wpc


def _launch_gemv(
    ctx: KernelContext,
    a: cupy.ndarray,
    w: TransposedWeight,
    c: cupy.ndarray,
    m: int,
    norm: Any,
    gated: bool = False,
) -> None:
    """``gemv_nk`` of ``a`` [m, K] (M <= 16) and ``w`` into ``c``; ``norm``: the fused
    prologue (None: ``a`` is read as it is); ``gated``: ``c`` is [m, N / 2], the SiLU gating
    of the gate and up halves of the product."""
    k, n = w.shape
    v = 16 // a.dtype.itemsize
    # gated: the warps a column gets as ungated (a column's sums then the same bits)
    mt, nr, wpc = gemv_layout(m, k // v, n, sm_count())
    nr = 2 if gated else nr
    fused = norm.ON_THE_FLY if norm is not None else 0
    name = f"gemv_nk<{storage(ctx, a.dtype)}, {mt}, {nr}, {fused}, {int(gated)}>"
    groups = n // 2 if gated else -(-n // nr)
    args = (a, w.t, c, np.int32(m), np.int32(k), np.int32(n), np.int32(wpc))
    extra, shared = norm_args(norm, a, c)
    function(_SOURCE, name)((-(-groups * wpc // 8),), (32, 8), (*args, *extra), shared_mem=shared)


def gated_gemv(
    ctx: KernelContext, a: cupy.ndarray, w: TransposedWeight, norm: Any = None
) -> cupy.ndarray | None:
    """``silu(g) * u`` of the halves ``g, u`` of ``a @ w`` (``w`` [K, 2F]: gate and up side by
    side) as output 0 [..., F], made by the store of the kernel that multiplies (``gemv_nk``
    or ``gemm_mma`` with GATED = 1), each activation once and rounded as the ungated kernel
    and a SiluMul kernel round it: the rows ``_gemv_transposed`` runs on its own kernels (up
    to PIECES_MAX_M), the same kernel for the same rows. None otherwise (before any kernel,
    but for a misaligned ``a``, after at most the norm kernel)."""
    k, n = w.shape
    m = int(a.size // k) if k else 0
    if n % 2 or not 0 < m <= PIECES_MAX_M or a.dtype != w.dtype:
        return None
    if not gated_rows(ctx, m, a.dtype, mma_min_rows(ctx), SKINNY_MAX_M):
        return None
    return _gemv_transposed(ctx, a, w, norm, gated=True)


def gated_rows(ctx: KernelContext, m: int, dtype: np.dtype, least: int, whole: int) -> bool:
    """Whether a gated projection's kernels take ``m`` rows by the CUDA provider's
    ``gated_mma``: on, every row count its GEMV pieces and tensor cores take; off, only the
    rows a GEMV takes whole (at most ``whole``, below ``least``, the tensor cores' first row
    count for fp16/bf16); the other rows run the projection, then SiluMul."""
    if ctx.option("gated_mma", True):
        return True
    return m <= whole and not (least and least <= m and dtype in (F16, BF16))


def _gemv_transposed(
    ctx: KernelContext,
    a: cupy.ndarray,
    w: TransposedWeight,
    norm: Any = None,
    gated: bool = False,
) -> cupy.ndarray | None:
    """``a @ w`` on the tensor cores (``gemm_mma``) for fp16/bf16 from ``mma_min_rows`` rows
    up to MMA_MAX_M, else on ``gemv_nk`` for M <= 16 (in pieces up to PIECES_MAX_M), else
    cuBLAS (``provider_cublas``; CuPy's, eager only, without it). ``norm`` (a
    ``genrt.FusedNorm`` or ``FusedSilu``): the GEMV's blocks make the activations in
    shared memory, or the unfused kernel makes them first for shapes that do not fit.
    ``gated`` (see ``gated_gemv``): c [..., N / 2] gets the SiLU gating of its halves."""
    k, n = w.shape
    shape = matmul_shape(ctx, tuple(a.shape), (k, n))
    width = n // 2 if gated else n
    c = out(ctx, 0, (*shape[:-1], width), a.dtype)
    m = int(c.size // width) if width else 0
    if norm is not None and not (m <= SKINNY_MAX_M and c.size and norm.fits_on_the_fly(a)):
        a, norm = norm.unfused(), None
    if c.size == 0:
        return c
    least = mma_min_rows(ctx)
    if least and least <= m <= MMA_MAX_M and a.dtype in (F16, BF16):
        if norm is not None and not mma_norm_rows(norm, a, m):
            a, norm = norm.unfused(), None  # the prologue runs as its own kernel
        if norm is None:
            a = contiguous(ctx, a)
        if mma_fits(a, w, m):
            gemm_mma(ctx, a, w, c, gated, norm)
            return c
    if norm is None:  # the prologue reads the fused inputs itself
        a = contiguous(ctx, a)
    aligned = a.data.ptr % 16 == 0
    if m <= SKINNY_MAX_M and aligned:
        _launch_gemv(ctx, a, w, c, m, norm, gated)
        return c
    if m <= PIECES_MAX_M and aligned and (k * a.dtype.itemsize) % 16 == 0:
        # Pieces of SKINNY_MAX_M rows through the GEMV: capturable, so a batched decode
        # step of up to PIECES_MAX_M rows replays one graph; the weight is read per piece.
        a2, c2 = a.reshape(m, k), c.reshape(m, width)
        for r0 in range(0, m, SKINNY_MAX_M):
            r1 = min(m, r0 + SKINNY_MAX_M)
            _launch_gemv(ctx, a2[r0:r1], w, c2[r0:r1], r1 - r0, norm, gated)
        return c
    if gated:
        return None  # cuBLAS has no gated store: the caller runs the projection, then SiluMul
    blas = provider_cublas(ctx)
    if blas is not None:
        blas.gemm(a, w, c, GemmShape(m, k, n, transposed=True), where=ctx.node.describe())
        return c
    if capturing(ctx):
        raise CaptureUnsupported(
            f"{ctx.node.describe()}: MatMul {list(a.shape)} @ [{k}, {n}] with M={m} needs "
            "cuBLAS, and with the CUDA provider's cublas_in_graphs off that is CuPy's, which "
            "refuses stream capture; this shape runs eagerly"
        )
    cupy.dot(a.reshape(m, k), w.t.T, out=c.reshape(m, n))
    return c


@REGISTRY.register("MatMul", since=1, prepack=transpose_weight)
def matmul(ctx: KernelContext, a: cupy.ndarray, b: cupy.ndarray, norm: Any = None) -> cupy.ndarray:
    """ONNX MatMul. A prepacked weight: see ``_gemv_transposed``; other fp32/fp16/bf16 with
    M <= 16 (no broadcast batch) run the skinny kernel; the rest of those run cuBLAS on the
    provider's handle (``provider_cublas``), batched where batch dims match or one side's are
    all ones. What remains (integers, partly broadcast batches, or the option off) runs
    CuPy's matmul, which CuPy refuses during stream capture, so that case raises while
    capturing. ``norm``: see ``_gemv_transposed``."""
    if isinstance(b, TransposedWeight):
        if a.dtype != b.dtype:
            raise TypeError(
                f"{ctx.node.describe()}: MatMul operand dtypes differ: {a.dtype}, {b.dtype}"
            )
        return _gemv_transposed(ctx, a, b, norm)
    if norm is not None:
        a = norm.unfused()
    if a.dtype != b.dtype:
        raise TypeError(
            f"{ctx.node.describe()}: MatMul operand dtypes differ: {a.dtype}, {b.dtype}"
        )
    shape = matmul_shape(ctx, tuple(a.shape), tuple(b.shape))
    c = out(ctx, 0, shape, a.dtype)
    if c.size == 0:
        return c
    if a.shape[-1] == 0:
        c.fill(0)
        return c
    dims = skinny_dims(tuple(a.shape), tuple(b.shape))
    if dims is not None and a.dtype in FLOAT_DTYPES and dims[1] <= SKINNY_MAX_M:
        _skinny(ctx, contiguous(ctx, a), contiguous(ctx, b), c, dims)
        return c
    blas = provider_cublas(ctx) if a.dtype in FLOAT_DTYPES else None
    gemm = matmul_gemm_shape(tuple(a.shape), tuple(b.shape)) if blas is not None else None
    if blas is not None and gemm is not None:
        a, b = contiguous(ctx, a), contiguous(ctx, b)
        blas.gemm(a, b, c, gemm, where=ctx.node.describe())
        return c
    if capturing(ctx):
        if a.dtype not in FLOAT_DTYPES:
            why = f"dtype {a.dtype} has no own kernel and no cuBLAS GEMM here"
        elif blas is not None:
            why = f"batch dims of {list(a.shape)} @ {list(b.shape)} broadcast partly"
        else:
            why = "the CUDA provider's cublas_in_graphs is off"
        raise CaptureUnsupported(
            f"{ctx.node.describe()}: MatMul {list(a.shape)} @ {list(b.shape)} needs CuPy's "
            f"matmul ({why}), which CuPy refuses during stream capture; this shape runs eagerly"
        )
    if a.dtype == BF16:  # CuPy's matmul has no bfloat16: float32 products, rounded once
        cupy.copyto(c, cupy.matmul(a.astype(F32), b.astype(F32)), casting="unsafe")
        return c
    cupy.matmul(a, b, out=c)
    return c
