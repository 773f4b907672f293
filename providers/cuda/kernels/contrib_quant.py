"""CUDA kernels: com.microsoft MatMulNBits and GatherBlockQuantized.

MatMulNBits with fp16/bf16 activations, 1..64 rows (by default; ``nbits_mma_min_rows``):
the tensor-core GEMM ``gemm_mma_nbits4``, whose per-row sums do not depend on M (see
``matmul.MMA_MIN_ROWS``). Other activations, or rows below ``nbits_mma_min_rows``:

MatMulNBits, M <= 16 (decode and verify steps; capturable): a GEMV that dequantizes the
packed ``[N, blocks, blob]`` weight on the fly. A warp owns one output column n (two when
N is large, or a 1/wpr share of K when there are few columns); its lanes read consecutive
32-bit words of the packed rows (8 int4 values each, so a warp reads 128 contiguous bytes),
four words per lane per round with their scales and zero points loaded before any math,
then the matching activations of up to 16 rows. Accumulation in float32:
``y = sum over words of s * sum_k a_k * (q_k - z)``. Rows of at most 128 words (K <= 1024
at 4 bits) run on a persistent variant whose warps prefetch their next columns' words while
computing the current ones. 4-bit weights in blocks of a multiple of 32 (aligned) read 16-byte
chunks instead: ``nbits4_gemv16`` (a warp per column) or, for short rows (at most 64 chunks,
e.g. K = 896) with M <= 8 and enough columns, ``nbits4_gemv16_small_k``, where a few lanes
share a column and a warp covers several columns, so a column's sum is a few shuffles.
With fp16 activations and integer zero points both do their math on packed halves
(``nbits4_chunk_half2``, :data:`HALF2_GEMV`), which roughly halves the instructions per value.

MatMulNBits, 17..64 rows: the tensor-core GEMM (fp16/bf16, ``nbits_mma_min_rows``) or the
GEMV in pieces of 16 rows; both capturable.

MatMulNBits, more rows (prefill): the weight is dequantized once into the activation dtype
as ``[N, K]`` (cached per weight and provider, see :func:`dequant_cache`; made on an eager
run, never inside a capture) and multiplied with cuBLAS on the provider's handle, which a
graph capture records (the bias added by the GEMM itself). With the provider's ``cublas_in_graphs`` off it
is CuPy's matmul, which CuPy refuses inside a stream capture, so that case raises while
capturing.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import cupy
import numpy as np

from onnx_genrt.core.kernels import MS_DOMAIN, KernelContext, NodeInfo, TransposedWeight
from onnx_genrt.core.op_rules import (
    NBITS,
    check_index_range,
    matmul_nbits_dims,
    matmul_nbits_unsupported,
)

from ..cublas import GemmShape
from ..gemv_split import nbits4_small_k_split, small_k_blocks
from ._common import (
    BF16,
    DEVICE_COMMON,
    F16,
    CaptureUnsupported,
    capturing,
    contiguous,
    function,
    out,
    refuse_in_capture,
    scratch,
    sm_count,
    storage,
)
from ._registry import REGISTRY
from .matmul import (
    MMA_MAX_M,
    MMA_TILES,
    gated_rows,
    gemv_layout,
    mma_config,
    mma_max_splits,
    mma_norm_rows,
    norm_args,
    provider_cublas,
    sum_splits,
)

#: The constant weights each kernel prefetches into L2 before its GRID_WAIT() (the packed
#: weights and their scales; see matmul.PDL_WEIGHTS).
PDL_WEIGHTS = {
    name: ("B", "scales")
    for name in (
        "nbits_gemv", "nbits_gemv_stream", "nbits4_gemv16", "nbits4_gemv16_small_k",
        "gemm_mma_nbits4",
    )
}  # fmt: skip
#: Largest M that runs on the GEMV kernel.
GEMV_MAX_M = 16
#: Rows up to which MatMulNBits runs the GEMV in pieces of GEMV_MAX_M rows (capturable).
CHUNKED_GEMV_MAX_M = 64
#: Default of the CUDA provider's ``nbits_mma_min_rows``: rows from which 4-bit weights with
#: fp16/bf16 activations run on the tensor cores (``gemm_mma_nbits4``), up to MMA_MAX_M. From
#: one row, for the reason of ``matmul.MMA_MIN_ROWS`` (3: one row 28% faster on the 0.5B int4
#: shape, rows that part from alone at near ties).
NBITS_MMA_MIN_ROWS = 1
# Kernel variants, each a CUDA provider option (``CUDAProvider.OPTIONS``; the environment
# variable in brackets is its default):
# - packed rows of at most STREAM_MAX_WORDS 32-bit words (K <= 1024 at 4 bits) run on the
#   persistent, prefetching GEMV (``nbits_stream``, ONNX_GENRT_NBITS_STREAM), else the
#   one-round kernel;
# - 4-bit weights with blocks of a multiple of 32 run on ``nbits4_gemv16``, 16-byte loads
#   (``nbits_chunk16``, ONNX_GENRT_NBITS_CHUNK16), else the 32-bit-word kernels;
# - of those, rows of at most 64 chunks (K <= 2048) with M <= SMALL_K_MAX_M and enough columns
#   to fill the GPU run on ``nbits4_gemv16_small_k``, a few lanes a column, several columns a
#   warp, split by :func:`~onnx_genrt.providers.cuda.gemv_split.nbits4_small_k_split`
#   (``nbits_small_k``, ONNX_GENRT_NBITS_SMALL_K);
# - fp16 activations with integer zero points run the chunk16 GEMVs' math on packed halves,
#   ``nbits4_chunk_half2``: about half the instructions of float math, which bounds the lm_head
#   and the verify step, and the tensor-core GEMM's dequantization (``Nibbles4``, the same
#   bits as in float) (``nbits_half2``, ONNX_GENRT_NBITS_HALF2): a compile-time switch, so
#   each source exists in both forms (:func:`_source`).
STREAM_MAX_WORDS = 128
SMALL_K_MAX_M = 8
_NBITS = NBITS

#: The zero point of a block, shared by the GEMV and tensor-core sources.
_ZERO_AT = r"""
// Zero point of block blk of row n. zp_mode 0: 2^(bits-1); 1: packed uint8 (zrow bytes per
// row, low bits first); 2: one float per block (same type as the scales).
template <typename W, int BITS>
DEVI float zero_at(const unsigned char* zp_u8, const W* zp_f, int zp_mode, long long n, int nb,
                   int zrow, int blk) {
  if (zp_mode == 1) {
    const int per = 8 / BITS;
    const unsigned int byte = zp_u8[n * zrow + blk / per];
    return (float)((byte >> ((blk % per) * BITS)) & ((1u << BITS) - 1u));
  }
  if (zp_mode == 2) return ld(zp_f, n * nb + blk);
  return (float)(1 << (BITS - 1));
}

"""


#: Packed-half (f16x2) operations and ``is_half``, shared by the GEMV and tensor-core sources.
_HALF2_OPS = r"""
DEVI unsigned int and_or(unsigned int a, unsigned int b, unsigned int c) {
  unsigned int r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(a), "r"(b), "r"(c));  // (a & b) | c
  return r;
}
DEVI unsigned int hfma2(unsigned int a, unsigned int b, unsigned int c) {
  unsigned int r;
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
}
DEVI unsigned int hmul2(unsigned int a, unsigned int b) {
  unsigned int r;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
DEVI unsigned int byte_perm(unsigned int a, unsigned int b, unsigned int sel) {
  unsigned int r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}
DEVI unsigned int hsub2(unsigned int a, unsigned int b) {
  unsigned int r;
  asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
template <typename S> struct is_half { static constexpr bool value = false; };
template <> struct is_half<half_t> { static constexpr bool value = true; };

"""

_BODY = (
    DEVICE_COMMON
    + _ZERO_AT
    + _HALF2_OPS
    + r"""
// E = 32 / BITS activations of row pointer a from k0 as floats (zeros past K); vector
// loads when vec says the rows are 16-byte aligned.
template <int E>
DEVI void load_a(const float* a, int k0, int K, int vec, float* v) {
  if constexpr (E % 4 == 0) {
    if (vec && k0 + E <= K) {
#pragma unroll
      for (int e = 0; e < E; e += 4) {
        const float4 q = *reinterpret_cast<const float4*>(a + k0 + e);
        v[e] = q.x; v[e + 1] = q.y; v[e + 2] = q.z; v[e + 3] = q.w;
      }
      return;
    }
  }
#pragma unroll
  for (int e = 0; e < E; ++e) v[e] = k0 + e < K ? a[k0 + e] : 0.f;
}
template <int E, typename S>  // S: half_t or bf16_t
DEVI void load_a(const S* a, int k0, int K, int vec, float* v) {
  if constexpr (E % 8 == 0) {
    if (vec && k0 + E <= K) {
#pragma unroll
      for (int e = 0; e < E; e += 8) ld16(a + k0 + e, v + e);
      return;
    }
  }
#pragma unroll
  for (int e = 0; e < E; ++e) v[e] = k0 + e < K ? ld(a, k0 + e) : 0.f;
}

// One packed 32-bit word per column r (E = 32 / BITS values from k0, scale s[r], zero z[r])
// into the MT row sums of each column. q comes exactly from the float bits of 2^23 + q;
// integer zero points fold into that subtraction (zint), float ones are subtracted after.
template <typename S, int MT, int BITS, int NR>
DEVI void nbits_word(const unsigned int* q, const float* s, const float* z, int zint, int k0,
                     const S* __restrict__ A, int M, int K, int a_vec, float (*acc)[MT]) {
  constexpr int E = 32 / BITS;
  constexpr unsigned int MASK = (1u << BITS) - 1u;
  float qv[NR][E];
#pragma unroll
  for (int r = 0; r < NR; ++r) {
    const float off = zint ? 8388608.f + z[r] : 8388608.f;
    const float zf = zint ? 0.f : z[r];
#pragma unroll
    for (int e = 0; e < E; ++e)
      qv[r][e] = (__uint_as_float(((q[r] >> (e * BITS)) & MASK) | 0x4B000000u) - off) - zf;
  }
#pragma unroll
  for (int m = 0; m < MT; ++m) {
    if (m < M) {
      float a[E];
      load_a<E>(A + (long long)m * K, k0, K, a_vec, a);
#pragma unroll
      for (int r = 0; r < NR; ++r) {
        float d = 0.f;
#pragma unroll
        for (int e = 0; e < E; ++e) d = fmaf(a[e], qv[r][e], d);
        acc[r][m] = fmaf(s[r], d, acc[r][m]);
      }
    }
  }
}

// C[m, n] = sum_k A[m, k] * (q[n, k] - z[n, k / block]) * s[n, k / block] (+ bias[n]).
// block (32, 8): warp y owns columns NR * (blockIdx.x * (8 / wpr) + y / wpr) + [0, NR) and
// the (y % wpr)-th share of their 32-bit words. Each round a lane loads U words of each of
// its columns (and their scales and zero points) before any math, so a warp has
// NR * U * 128 bytes of weights in flight. MT >= M rows of A.
template <typename S, typename W, int MT, int BITS, int NR>
__global__ void __launch_bounds__(256) nbits_gemv(
    const S* __restrict__ A, const unsigned int* __restrict__ B, const W* __restrict__ scales,
    const unsigned char* __restrict__ zp_u8, const W* __restrict__ zp_f,
    const S* __restrict__ bias, S* __restrict__ C, int M, int K, int N, int nb, int block,
    int words, int zrow, int zp_mode, int has_bias, int wpr, int a_vec) {
  constexpr int E = 32 / BITS;
  constexpr int U = 4;
  __shared__ float red[8][NR][MT];
  const int lane = threadIdx.x, wy = threadIdx.y;
  const long long n0 = ((long long)blockIdx.x * (8 / wpr) + wy / wpr) * NR;
  const int share = wy % wpr;
  const int zint = zp_mode != 2;
  const int step = 32 * wpr;
  // The first round's weight words and scales into L2 while the previous kernel finishes.
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int w = share * 32 + lane + u * step;
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      const long long n = n0 + r;
      if (w < words && w * E < K && n < N) {
        pdl_prefetch(B + n * words + w);
        pdl_prefetch(scales + n * nb + (w * E) / block);
      }
    }
  }
  GRID_WAIT();
  float acc[NR][MT];
#pragma unroll
  for (int r = 0; r < NR; ++r)
#pragma unroll
    for (int m = 0; m < MT; ++m) acc[r][m] = 0.f;
  if (n0 < N) {
    for (int w0 = share * 32 + lane; w0 < words; w0 += U * step) {
      unsigned int q[U][NR];
      float s[U][NR], z[U][NR];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int w = w0 + u * step;
        const int blk = (w * E) / block;
#pragma unroll
        for (int r = 0; r < NR; ++r) {
          const long long n = n0 + r;
          const bool ok = w < words && w * E < K && n < N;
          q[u][r] = ok ? __ldg(B + n * words + w) : 0u;
          s[u][r] = ok ? ld(scales, n * nb + blk) : 0.f;
          z[u][r] = ok ? zero_at<W, BITS>(zp_u8, zp_f, zp_mode, n, nb, zrow, blk) : 0.f;
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int w = w0 + u * step;
        if (w < words && w * E < K)
          nbits_word<S, MT, BITS, NR>(q[u], s[u], z[u], zint, w * E, A, M, K, a_vec, acc);
      }
    }
  }
  GRID_LAUNCH_DEPENDENTS();
#pragma unroll
  for (int r = 0; r < NR; ++r)
#pragma unroll
    for (int m = 0; m < MT; ++m) acc[r][m] = warp_sum(acc[r][m]);
  if (wpr > 1) {
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < NR; ++r)
#pragma unroll
        for (int m = 0; m < MT; ++m) red[wy][r][m] = acc[r][m];
    }
    __syncthreads();
    if (share == 0 && lane == 0) {
      for (int p = 1; p < wpr; ++p) {
#pragma unroll
        for (int r = 0; r < NR; ++r)
#pragma unroll
          for (int m = 0; m < MT; ++m) acc[r][m] += red[wy + p][r][m];
      }
    }
  }
  if (share == 0 && lane == 0) {
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
}

// Rows that fit one round (words <= 32 * U): persistent warps. Warp j of the grid takes
// column groups j, j + W, ... (NR columns each) and issues the loads of its next group
// before the math of the current one, so memory and math overlap within every warp.
template <typename S, typename W, int MT, int BITS, int NR>
__global__ void __launch_bounds__(256) nbits_gemv_stream(
    const S* __restrict__ A, const unsigned int* __restrict__ B, const W* __restrict__ scales,
    const unsigned char* __restrict__ zp_u8, const W* __restrict__ zp_f,
    const S* __restrict__ bias, S* __restrict__ C, int M, int K, int N, int nb, int block,
    int words, int zrow, int zp_mode, int has_bias, int a_vec) {
  constexpr int E = 32 / BITS;
  constexpr int U = 4;
  const int lane = threadIdx.x;
  const long long nwarps = (long long)gridDim.x * blockDim.y;
  const long long groups = (N + NR - 1) / NR;
  const int zint = zp_mode != 2;
  long long g = (long long)blockIdx.x * blockDim.y + threadIdx.y;
  // The first group's weight words and scales into L2 while the previous kernel finishes.
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int w = lane + 32 * u;
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      const long long n = g * NR + r;
      if (g < groups && w < words && w * E < K && n < N) {
        pdl_prefetch(B + n * words + w);
        pdl_prefetch(scales + n * nb + (w * E) / block);
      }
    }
  }
  GRID_WAIT();
  unsigned int q[U][NR];
  float s[U][NR], z[U][NR];
  auto fetch = [&](long long gg) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int w = lane + 32 * u;
      const int blk = (w * E) / block;
#pragma unroll
      for (int r = 0; r < NR; ++r) {
        const long long n = gg * NR + r;
        const bool ok = w < words && w * E < K && n < N;
        q[u][r] = ok ? __ldg(B + n * words + w) : 0u;
        s[u][r] = ok ? ld(scales, n * nb + blk) : 0.f;
        z[u][r] = ok ? zero_at<W, BITS>(zp_u8, zp_f, zp_mode, n, nb, zrow, blk) : 0.f;
      }
    }
  };
  if (g < groups) fetch(g);
  for (; g < groups; g += nwarps) {
    unsigned int cq[U][NR];
    float cs[U][NR], cz[U][NR];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int r = 0; r < NR; ++r) { cq[u][r] = q[u][r]; cs[u][r] = s[u][r]; cz[u][r] = z[u][r]; }
    if (g + nwarps < groups) fetch(g + nwarps);
    float acc[NR][MT];
#pragma unroll
    for (int r = 0; r < NR; ++r)
#pragma unroll
      for (int m = 0; m < MT; ++m) acc[r][m] = 0.f;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int w = lane + 32 * u;
      if (w < words && w * E < K)
        nbits_word<S, MT, BITS, NR>(cq[u], cs[u], cz[u], zint, w * E, A, M, K, a_vec, acc);
    }
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      const long long n = g * NR + r;
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        const float v = warp_sum(acc[r][m]);
        if (lane == 0 && n < N && m < M) st(C, (long long)m * N + n, v + (has_bias ? ld(bias, n) : 0.f));
      }
    }
  }
  GRID_LAUNCH_DEPENDENTS();
}

// One 16-byte chunk (32 4-bit values from k0, one scale and zero) of each column r: its four
// words through nbits_word. A's rows are 16-byte aligned (the chunk16 kernels check).
template <typename S, int MT, int NR>
DEVI void nbits4_chunk(const uint4* q, const float* s, const float* z, int zint, int k0,
                       const S* __restrict__ A, int M, int K, float (*acc)[MT]) {
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    unsigned int qw[NR];
#pragma unroll
    for (int r = 0; r < NR; ++r)
      qw[r] = w == 0 ? q[r].x : w == 1 ? q[r].y : w == 2 ? q[r].z : q[r].w;
    nbits_word<S, MT, 4, NR>(qw, s, z, zint, k0 + 8 * w, A, M, K, 1, acc);
  }
}

// Packed-half math for fp16 activations and integer zero points (NBITS_HALF2): each f16x2
// of a chunk's 32 values is made exactly as (q - z) / 16 from the packed nibbles (or-ing a
// nibble under the exponent of 1024, then one fma), multiplied with the matching pair of
// activations, and 4 products are summed per half lane before each word's sum goes to
// float; 16 * s scales the chunk. The / 16 keeps every half-precision partial sum finite for
// activations up to about 17000 in magnitude. Pairs are (e, e + 4) of each 8-value word.
DEVI float half2_sum(unsigned int h) {
  half_t lo, hi;
  asm("mov.b32 {%0, %1}, %2;" : "=h"(lo), "=h"(hi) : "r"(h));
  return h2f(lo) + h2f(hi);
}
template <int MT, int NR>
DEVI void nbits4_chunk_half2(const uint4* q, const float* s, const float* z, int k0,
                             const half_t* __restrict__ A, int M, int K, float (*acc)[MT]) {
  constexpr unsigned int LO = 0x000F000Fu, HI = 0x00F000F0u, EXP = 0x64006400u;
  constexpr unsigned int SIXTEENTH = 0x2C002C00u, TWO56TH = 0x1C001C00u;  // 1/16, 1/256
  unsigned int d[NR][16];
#pragma unroll
  for (int r = 0; r < NR; ++r) {
    // (1024 + q) / 16 - (64 + z / 16) and (1024 + 16 q) / 256 - (4 + z / 16): (q - z) / 16
    const unsigned int c_lo = (unsigned int)f2h(-64.f - z[r] * 0.0625f) * 0x10001u;
    const unsigned int c_hi = (unsigned int)f2h(-4.f - z[r] * 0.0625f) * 0x10001u;
    const unsigned int words[4] = {q[r].x, q[r].y, q[r].z, q[r].w};
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const unsigned int x = words[w], y = x >> 8;
      d[r][4 * w] = hfma2(and_or(x, LO, EXP), SIXTEENTH, c_lo);      // values 0, 4
      d[r][4 * w + 1] = hfma2(and_or(x, HI, EXP), TWO56TH, c_hi);    // 1, 5
      d[r][4 * w + 2] = hfma2(and_or(y, LO, EXP), SIXTEENTH, c_lo);  // 2, 6
      d[r][4 * w + 3] = hfma2(and_or(y, HI, EXP), TWO56TH, c_hi);    // 3, 7
    }
  }
#pragma unroll
  for (int m = 0; m < MT; ++m) {
    if (m < M) {
      const uint4* a = reinterpret_cast<const uint4*>(A + (long long)m * K + k0);
      float cs[NR];
#pragma unroll
      for (int r = 0; r < NR; ++r) cs[r] = 0.f;
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        const uint4 v = a[w];  // values 8w .. 8w + 7 as pairs (0, 4), (1, 5), (2, 6), (3, 7)
        const unsigned int p0 = byte_perm(v.x, v.z, 0x5410), p1 = byte_perm(v.x, v.z, 0x7632);
        const unsigned int p2 = byte_perm(v.y, v.w, 0x5410), p3 = byte_perm(v.y, v.w, 0x7632);
#pragma unroll
        for (int r = 0; r < NR; ++r) {
          unsigned int h = hmul2(d[r][4 * w], p0);
          h = hfma2(d[r][4 * w + 1], p1, h);
          h = hfma2(d[r][4 * w + 2], p2, h);
          h = hfma2(d[r][4 * w + 3], p3, h);
          cs[r] += half2_sum(h);
        }
      }
#pragma unroll
      for (int r = 0; r < NR; ++r) acc[r][m] = fmaf(16.f * s[r], cs[r], acc[r][m]);
    }
  }
}


// One chunk of each column: packed-half math where it applies (fp16 activations), else
// nbits4_chunk.
template <typename S, int MT, int NR>
DEVI void nbits4_chunk_any(const uint4* q, const float* s, const float* z, int zint, int k0,
                           const S* __restrict__ A, int M, int K, float (*acc)[MT]) {
  if constexpr (NBITS_HALF2 && is_half<S>::value) {
    if (zint) {
      nbits4_chunk_half2<MT, NR>(q, s, z, k0, A, M, K, acc);
      return;
    }
  }
  nbits4_chunk<S, MT, NR>(q, s, z, zint, k0, A, M, K, acc);
}

// 4-bit weights in blocks of a multiple of 32, K a multiple of 32, rows 16-byte aligned:
// C[m, n] = sum_k A[m, k] * (q[n, k] - z) * s (+ bias). Block (32, 8), laid out as gemv_nk:
// warp y owns NR columns and the (y % wpc)-th share of their 16-byte chunks (32 values, one
// scale each); a lane loads U chunks of each column, with scales and zeros, before any math.
// NORM != 0 (both chunk16 kernels): the activations of a fused op, made by the block in
// shared memory after its first weight loads are issued (stage_act; NORM = 1: an RMS norm,
// 2: SiLU gating), as in matmul.gemv_nk. GATED = 1 (NR = 2, no bias): columns j and j + F of
// the N = 2F are a gate and its up column, and C [M, F] gets silu_times(gate, up), as in
// matmul.gemv_nk.
#define NORM_PARAMS                                                                           \
  const S *__restrict__ skip, const S *__restrict__ gamma, S *__restrict__ sum_out, float eps, \
      int norm_flags

template <typename S, typename W, int MT, int NR, int NORM, int GATED>
__global__ void __launch_bounds__(256) nbits4_gemv16(
    const S* __restrict__ A_in, const uint4* __restrict__ B, const W* __restrict__ scales,
    const unsigned char* __restrict__ zp_u8, const W* __restrict__ zp_f,
    const S* __restrict__ bias, S* __restrict__ C, int M, int K, int N, int nb, int block,
    int row_chunks, int zrow, int zp_mode, int has_bias, int wpc, NORM_PARAMS) {
  static_assert(!GATED || NR == 2, "a gated GEMV's warp holds one gate and one up column");
  constexpr int U = 2;
  __shared__ float red[8][NR][MT];
  const int lane = threadIdx.x, wy = threadIdx.y;
  const long long group = (long long)blockIdx.x * (8 / wpc) + wy / wpc;
  // column r of the warp's group: n0 + r * cs (GATED: the gate column and its up column)
  const long long n0 = GATED ? group : group * NR, cs = GATED ? N / 2 : 1;
  const long long n_end = GATED ? N / 2 : N;  // n0 + r * cs < N exactly where n0 < n_end
  const int share = wy % wpc;
  const int chunks = K / 32, step = 32 * wpc;
  const int zint = zp_mode != 2;
  // The first round of the block's loads (each column's first U * step chunks, and the line
  // of its first scales) into L2 while the previous kernel finishes.
  if (share == 0 && lane < NR && (GATED ? n0 < n_end : n0 + lane < N)) {
    pdl_prefetch_bytes(B + (n0 + lane * cs) * row_chunks, min(chunks, U * step) * 16u);
    pdl_prefetch(scales + (n0 + lane * cs) * nb);
  }
  GRID_WAIT();
  GRID_EARLY_LAUNCH();  // pdl_early_launch 1: the next kernel prefetches meanwhile
  float acc[NR][MT];
#pragma unroll
  for (int r = 0; r < NR; ++r)
#pragma unroll
    for (int m = 0; m < MT; ++m) acc[r][m] = 0.f;
  struct Chunks {
    uint4 q[U][NR];
    float s[U][NR], z[U][NR];
  };
  auto load = [&](int c0, Chunks& w) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + u * step;
      const int blk = (c * 32) / block;
#pragma unroll
      for (int r = 0; r < NR; ++r) {
        const long long n = n0 + r * cs;
        const bool ok = c < chunks && (GATED ? n0 < n_end : n < N);
        w.q[u][r] = ok ? __ldg(B + n * row_chunks + c) : make_uint4(0u, 0u, 0u, 0u);
        w.s[u][r] = ok ? ld(scales, n * nb + blk) : 0.f;
        w.z[u][r] = ok ? zero_at<W, 4>(zp_u8, zp_f, zp_mode, n, nb, zrow, blk) : 0.f;
      }
    }
  };
  auto math = [&](int c0, const Chunks& w, const S* A) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + u * step;
      if (c < chunks)
        nbits4_chunk_any<S, MT, NR>(w.q[u], w.s[u], w.z[u], zint, c * 32, A, M, K, acc);
    }
  };
  gemv_chunk_loop<NORM, MT, Chunks>(share * 32 + lane, chunks, U * step, load, math, A_in, skip,
                                     gamma, sum_out, eps, norm_flags, M, K);
  GRID_LAUNCH_DEPENDENTS();
  if constexpr (GATED)
    gemv_store_gated<S, MT>(acc, red, wy, wpc, lane, n0, N / 2, M, C);
  else
    gemv_store<S, NR, MT>(acc, red, wy, wpc, lane, n0, N, M, C, bias, has_bias);
}

// Rows of at most 64 chunks (K <= 2048; the split is gemv_split.nbits4_small_k_split): a warp
// per column would give each lane one or two chunks and then a 5-step warp_sum per column and
// row. Instead LPC lanes share a column and a warp holds 32 / LPC columns: lane sub = lane %
// LPC of column n takes chunks sub, sub + LPC, ... (CPL of them), so every load instruction
// reads LPC * 16 contiguous bytes of each column of the warp, and lanes of equal sub read the
// same activations (one L1 broadcast). All of a lane's weights, scales and zeros are loaded
// before the math; a column's sum then takes log2(LPC) shuffles. Block (32, 8), one column
// group a warp, no shared memory. GATED = 1 (no bias): of a warp's P = 16 / LPC pairs, slot
// s < P holds gate column j = warp * P + s and slot s + P its up column j + F (N = 2F); the
// up sums come down to the gate lanes by one shuffle, which store silu_times(gate, up) to C
// [M, F].
template <typename S, typename W, int MT, int LPC, int CPL, int NORM, int GATED>
__global__ void __launch_bounds__(256) nbits4_gemv16_small_k(
    const S* __restrict__ A_in, const uint4* __restrict__ B, const W* __restrict__ scales,
    const unsigned char* __restrict__ zp_u8, const W* __restrict__ zp_f,
    const S* __restrict__ bias, S* __restrict__ C, int M, int K, int N, int nb, int block,
    int row_chunks, int zrow, int zp_mode, int has_bias, NORM_PARAMS) {
  static_assert(LPC >= 1 && LPC <= 32 && (LPC & (LPC - 1)) == 0, "LPC: a power of 2 <= 32");
  static_assert(!GATED || LPC <= 16, "a gated warp holds at least one pair of columns");
  constexpr int P = 16 / LPC;  // GATED: pairs of columns a warp
  const int lane = threadIdx.x, sub = lane % LPC, slot = lane / LPC;
  const long long warp = (long long)blockIdx.x * 8 + threadIdx.y;
  const long long j = warp * P + slot % P;  // GATED: the pair of this lane's column
  const bool in_range = GATED ? j < N / 2 : warp * (32 / LPC) + slot < N;
  const long long n = GATED ? j + (slot < P ? 0 : N / 2) : warp * (32 / LPC) + slot;
  const int chunks = K / 32;
  // The column's weights (at most 64 chunks) and the line of its first scales into L2 while
  // the previous kernel finishes.
  if (sub == 0 && in_range) {
    pdl_prefetch_bytes(B + n * row_chunks, chunks * 16u);
    pdl_prefetch(scales + n * nb);
  }
  GRID_WAIT();
  GRID_EARLY_LAUNCH();  // pdl_early_launch 1: the next kernel prefetches meanwhile
  uint4 q[CPL][1];
  float s[CPL][1], z[CPL][1];
#pragma unroll
  for (int u = 0; u < CPL; ++u) {
    const int c = sub + u * LPC;
    const int blk = (c * 32) / block;
    const bool ok = c < chunks && in_range;
    q[u][0] = ok ? __ldg(B + n * row_chunks + c) : make_uint4(0u, 0u, 0u, 0u);
    s[u][0] = ok ? ld(scales, n * nb + blk) : 0.f;
    z[u][0] = ok ? zero_at<W, 4>(zp_u8, zp_f, zp_mode, n, nb, zrow, blk) : 0.f;
  }
  float acc[1][MT];
#pragma unroll
  for (int m = 0; m < MT; ++m) acc[0][m] = 0.f;
  const S* A = A_in;
  if constexpr (NORM != 0) {  // the loads above are in flight while the block stages
    extern __shared__ __align__(16) unsigned char stage_bytes[];
    S* act = reinterpret_cast<S*>(stage_bytes);
    stage_act<NORM, MT>(A_in, skip, gamma, sum_out, eps, norm_flags, M, K, act);
    A = act;
  }
  // zint as a constant in each copy: the integer-zero copy drops nbits_word's float-zero
  // subtraction (one add per value), which matters here as the math is near the load time.
  auto math = [&](const int zint) {
#pragma unroll
    for (int u = 0; u < CPL; ++u) {
      const int c = sub + u * LPC;
      if (c < chunks) nbits4_chunk_any<S, MT, 1>(q[u], s[u], z[u], zint, c * 32, A, M, K, acc);
    }
  };
  if (zp_mode == 2)
    math(0);
  else
    math(1);
  GRID_LAUNCH_DEPENDENTS();
  // Out-of-range columns (n >= N) summed zeros; they still shuffle, so the masks stay full.
#pragma unroll
  for (int m = 0; m < MT; ++m) acc[0][m] = warp_sum<LPC>(acc[0][m]);
  if constexpr (GATED) {
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      const float up = __shfl_down_sync(0xffffffffu, acc[0][m], P * LPC);
      if (sub == 0 && slot < P && in_range && m < M)
        st(C, (long long)m * (N / 2) + j, silu_times_stored<S>(acc[0][m], up));
    }
    return;
  }
  if (sub == 0 && n < N) {
    const float bv = has_bias ? ld(bias, n) : 0.f;
#pragma unroll
    for (int m = 0; m < MT; ++m)
      if (m < M) st(C, (long long)m * N + n, acc[0][m] + bv);
  }
}

// W[n, k] = (q - z) * s for the cuBLAS path; one thread per output element.
template <typename S, typename W, int BITS>
__global__ void nbits_dequant(const unsigned char* __restrict__ B, const W* __restrict__ scales,
                              const unsigned char* __restrict__ zp_u8, const W* __restrict__ zp_f,
                              S* __restrict__ out, int K, long long total, int nb, int block,
                              long long row_bytes, int zrow, int zp_mode) {
  GRID_WAIT();
  GRID_LAUNCH_DEPENDENTS();
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= total) return;
  const long long n = i / K;
  const int k = (int)(i - n * K);
  constexpr int per = 8 / BITS;
  const unsigned int byte = B[n * row_bytes + k / per];
  const float q = (float)((byte >> ((k % per) * BITS)) & ((1u << BITS) - 1u));
  const int blk = k / block;
  const float z = zero_at<W, BITS>(zp_u8, zp_f, zp_mode, n, nb, zrow, blk);
  st(out, i, (q - z) * ld(scales, n * nb + blk));
}

// GatherBlockQuantized, gather axis 0 of a 2-D packed table, blocks along the last axis.
// out[i, c] = (q[idx[i], c] - z) * s[idx[i], c / block]. An index outside [-rows, rows) (which
// the host checks on eager runs) gives a NaN row, so a captured step's logits turn non-finite
// instead of silently reading row 0 or zeros.
template <typename I, typename W, int BITS>
__global__ void gather_block_quant(const unsigned char* __restrict__ data,
                                   const I* __restrict__ idx, const W* __restrict__ scales,
                                   const unsigned char* __restrict__ zp, W* __restrict__ out,
                                   long long rows, int cols, int row_bytes, int nb, int block,
                                   int zrow, int has_zp, long long total) {
  GRID_WAIT();
  GRID_LAUNCH_DEPENDENTS();
  const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= total) return;
  const long long i = t / cols;
  const int c = (int)(t - i * cols);
  long long r = (long long)idx[i];
  if (r < 0) r += rows;
  if (r < 0 || r >= rows) { st(out, t, __int_as_float(0x7fc00000)); return; }
  constexpr int per = 8 / BITS;
  const unsigned int byte = data[r * row_bytes + c / per];
  const float q = (float)((byte >> ((c % per) * BITS)) & ((1u << BITS) - 1u));
  const int blk = c / block;
  float z = (float)(1 << (BITS - 1));
  if (has_zp) {
    const unsigned int zb = zp[r * zrow + blk / per];
    z = (float)((zb >> ((blk % per) * BITS)) & ((1u << BITS) - 1u));
  }
  st(out, t, (q - z) * ld(scales, r * nb + blk));
}
"""
)


#: The 4-bit tensor-core GEMM: ``mma_tiles`` (``matmul.MMA_TILES``) with a loader that
#: dequantizes. sm_80 or newer, so a source of its own.
_MMA4_SOURCE = (
    DEVICE_COMMON
    + _ZERO_AT
    + _HALF2_OPS
    + MMA_TILES
    + r"""
// 4-bit weights B [N, nb, block / 2] (value k of a block at byte k / 2, low nibble first),
// blocks of a multiple of 16 values: a lane's 16 values come from one 8-byte load, one scale
// and one zero point, each (q - z) * s rounded once to S. In float: q - z is exact and so is
// its product with a 16-bit scale, so one rounding to S. With NBITS_HALF2, fp16 and an
// integer zero point, the same value on packed halves: a byte's two nibbles or-ed under the
// exponent of 1024 (1024 + q exactly), minus 1024 + z (exact), times s (one rounding): the
// same bits in about half the instructions.
template <typename S, typename W>
struct Nibbles4 {
  const unsigned char* B;
  const W* scales;
  const unsigned char* zp_u8;
  const W* zp_f;
  int nb, block, zrow, zp_mode;
  DEVI void operator()(int n, int k, unsigned (&b)[8]) const {
    const int blk = k / block;
    const long long at = ((long long)n * nb + blk) * (block >> 1) + ((k - blk * block) >> 1);
    const uint2 q = *reinterpret_cast<const uint2*>(B + at);
    const float z = zero_at<W, 4>(zp_u8, zp_f, zp_mode, n, nb, zrow, blk);
    if constexpr (NBITS_HALF2 && is_half<S>::value && is_half<W>::value) {
      if (zp_mode != 2) {
        const unsigned int s2 = (unsigned int)scales[(long long)n * nb + blk] * 0x10001u;
        const unsigned int z2 = (unsigned int)f2h(1024.f + z) * 0x10001u;
        const unsigned int words[2] = {q.x, q.y}, highs[2] = {q.x >> 4, q.y >> 4};
#pragma unroll
        for (int i = 0; i < 8; ++i) {  // byte i & 3 of the word into half 0, its >> 4 into 1
          const unsigned int j = i & 3, sel = j | (j << 4) | ((4 + j) << 8) | ((4 + j) << 12);
          const unsigned int pair = byte_perm(words[i >> 2], highs[i >> 2], sel);
          b[i] = hmul2(hsub2(and_or(pair, 0x000F000Fu, 0x64006400u), z2), s2);
        }
        return;
      }
    }
    const float s = ld(scales, (long long)n * nb + blk);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const unsigned int byte = ((i < 4 ? q.x : q.y) >> (8 * (i & 3))) & 0xffu;
      b[i] = pack2((const S*)nullptr, ((float)(byte & 15u) - z) * s, ((float)(byte >> 4) - z) * s);
    }
  }
};

// C = A @ dequant(B)^T (+ bias) on the tensor cores (see mma_tiles and Nibbles4; GATED, no
// bias: C [M, N / 2], the gating; R > 0: A's prologue NORM made first, see mma_act).
template <typename S, typename W, int MT, int GATED, int NORM, int R>
__global__ void __launch_bounds__(256) gemm_mma_nbits4(
    const S* __restrict__ A, const unsigned char* __restrict__ B, const W* __restrict__ scales,
    const unsigned char* __restrict__ zp_u8, const W* __restrict__ zp_f,
    const S* __restrict__ bias, int has_bias, S* __restrict__ C, float* __restrict__ P, int M,
    int K, int N, int nb, int block, int zrow, int zp_mode, int k_per_split, int splits,
    const S* __restrict__ skip, const S* __restrict__ gamma, S* __restrict__ sum_out, float eps,
    int norm_flags) {
  if (threadIdx.x < 8) {  // mma_tiles' first round (512 values of each row) into L2
    const int kb = blockIdx.y * k_per_split, ke = min(K, kb + k_per_split);
    const long long n = mma_w_row<GATED>(threadIdx.x, N);
    if (kb < ke) {  // value k of row n at byte (n * nb * block + k) / 2 (see Nibbles4)
      pdl_prefetch_bytes(B + (n * nb * block + kb) / 2,
                         (unsigned int)(min(ke, kb + 512) - kb) / 2u);
      pdl_prefetch(scales + n * nb + kb / block);
    }
  }
  GRID_WAIT();
  const S* act = mma_act<NORM, R>(A, skip, gamma, sum_out, eps, norm_flags, M, K);
  const Nibbles4<S, W> load{B, scales, zp_u8, zp_f, nb, block, zrow, zp_mode};
  mma_tiles<S, MT, GATED>(act, load, has_bias ? bias : (const S*)nullptr, C, P, M, K, N,
                          k_per_split, splits);
}
"""
)


#: The kernels' source with NBITS_HALF2 off and on: made once, so a launch's kernel lookup
#: (``function``) hashes a string whose hash is kept, not a new 34 KB one each time.
_SOURCES = tuple(f"#define NBITS_HALF2 {h}\n" + _BODY for h in (0, 1))
_MMA4_SOURCES = tuple(f"#define NBITS_HALF2 {h}\n" + _MMA4_SOURCE for h in (0, 1))


def _source(ctx: KernelContext, sources: tuple[str, str] = _SOURCES) -> str:
    """The kernels' source (the GEMVs', or the tensor-core GEMM's with ``_MMA4_SOURCES``) in
    the form the provider's ``nbits_half2`` option asks for."""
    return sources[bool(ctx.option("nbits_half2", True))]


# ----------------------------------------------------------------------------- dequant cache


class DequantCache:
    """Dequantized ``[N, K]`` weights for the cuBLAS path, keyed on their sources' addresses.

    An entry holds its source arrays, so their addresses cannot be reused while it lives;
    entries assume the sources are not modified in place (they are initializers). One cache
    per provider (``dequant_cache``): the copies go with the provider that made them.
    """

    def __init__(self) -> None:
        self.builds = 0
        self._entries: dict[tuple, tuple[tuple, cupy.ndarray]] = {}

    def get(self, sources: tuple, params: tuple, build) -> cupy.ndarray:
        key = (tuple(0 if a is None else int(a.data.ptr) for a in sources), params)
        hit = self._entries.get(key)
        if hit is not None:
            return hit[1]
        value = build()
        self.builds += 1
        self._entries[key] = (sources, value)
        return value

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()


#: Each provider's dequantized weights, freed with the provider (and so with the session that
#: made it): one process-wide cache held every session's copies, and their sources, for good.
_DEQUANT: weakref.WeakKeyDictionary[Any, DequantCache] = weakref.WeakKeyDictionary()
#: Calls without a provider (kernels launched on their own, in tests).
_DEQUANT_NO_PROVIDER = DequantCache()


def dequant_cache(ctx: KernelContext) -> DequantCache:
    """The dequantized-weight cache of ``ctx``'s provider."""
    provider = ctx.provider
    if provider is None:
        return _DEQUANT_NO_PROVIDER
    cache = _DEQUANT.get(provider)
    if cache is None:
        cache = _DEQUANT[provider] = DequantCache()
    return cache


# ----------------------------------------------------------------------------- MatMulNBits


_nbits_check = matmul_nbits_unsupported


def gemv_wpr(n: int, words: int, sms: int) -> int:
    """Warps per output column (group): more when there are too few to fill the GPU."""
    wpr = 1
    while wpr < 8 and -(-n * wpr // 8) < 4 * sms and words >= 32 * 2 * wpr * 2:
        wpr *= 2
    return wpr


_REGS: dict[int, int] = {}


def stream_blocks(fn, groups: int, sms: int) -> int:
    """Blocks of the persistent GEMV: as many as fit on the GPU at once, at most one per
    8 column groups."""
    regs = _REGS.get(id(fn))
    if regs is None:  # a driver query, made once per kernel (the first call is eager)
        regs = _REGS[id(fn)] = max(1, int(getattr(fn, "num_regs", 64) or 64))
    per_sm = max(1, min(8, 65536 // (-(-regs // 8) * 8 * 256)))
    return max(1, min(-(-groups // 8), per_sm * sms))


def _zero_args(ctx: KernelContext, zp, scales, n: int, nb: int, bits: int):
    """(zp_u8, zp_f, zrow, zp_mode) kernel arguments for the zero points."""
    if zp is None:
        return scales, scales, 0, 0
    zp = contiguous(ctx, zp)
    if zp.dtype == np.uint8:
        zrow = zp.size // n if n else 0
        if zrow * n != zp.size or zrow * (8 // bits) < nb:
            raise ValueError(
                f"{ctx.node.describe()}: packed zero points {list(zp.shape)} do not fit "
                f"{n} rows of {nb} blocks"
            )
        return zp, scales, zrow, 1
    if zp.dtype != scales.dtype or zp.size != n * nb:
        raise ValueError(
            f"{ctx.node.describe()}: zero points {zp.dtype}{list(zp.shape)} must be uint8 or "
            f"{scales.dtype} [{n}, {nb}]"
        )
    return scales, zp, nb, 2


def _chunk16_fits(ctx: KernelContext, bits: int, block: int, k: int, row_bytes: int, b, a) -> bool:
    """Whether ``nbits4_gemv16`` applies: 4 bits, 16-byte chunks within one block, aligned."""
    return (
        ctx.option("nbits_chunk16", True)
        and bits == 4
        and block % 32 == 0
        and k % 32 == 0
        and row_bytes % 16 == 0
        and b.data.ptr % 16 == 0
        and a.data.ptr % 16 == 0
    )


@dataclass
class _NbitsCall:
    """One MatMulNBits call, checked, for the GEMV paths (M <= GEMV_MAX_M rows a launch)."""

    b: Any
    scales: Any
    zp_u8: Any
    zp_f: Any
    bias_arg: Any
    has_bias: bool
    k: int
    n: int
    nb: int
    blob: int
    block: int
    bits: int
    zrow: int
    zp_mode: int
    norm: Any
    s_type: str
    w_type: str


def nbits_mma_min_rows(ctx: KernelContext) -> int:
    """Rows from which 4-bit weights with fp16/bf16 activations run on the tensor cores (the
    CUDA provider's ``nbits_mma_min_rows``; 0: never)."""
    return int(ctx.option("nbits_mma_min_rows", NBITS_MMA_MIN_ROWS))


def _mma4_fits(ctx: KernelContext, call: _NbitsCall, a: Any, m: int) -> bool:
    """Whether ``gemm_mma_nbits4`` runs these ``m`` rows: 4 bits, fp16/bf16 activations and
    scales, blocks of a multiple of 16, K a multiple of 64, N of 8, aligned operands."""
    least = nbits_mma_min_rows(ctx)
    return (
        bool(least)
        and least <= m <= MMA_MAX_M
        and call.bits == 4
        and a.dtype in (F16, BF16)
        and call.s_type == call.w_type
        and call.block % 16 == 0
        and call.k % 64 == 0
        and call.n % 8 == 0
        and call.b.data.ptr % 8 == 0
        and a.data.ptr % 16 == 0
    )


def _nbits_mma(
    ctx: KernelContext, call: _NbitsCall, a: Any, y: Any, m: int, gated: bool = False
) -> None:
    """``y`` = the ``m`` rows of ``a`` times the 4-bit weight on the tensor cores; ``gated``:
    ``y`` [m, N / 2] gets the SiLU gating of the product's gate and up halves."""
    k, n = call.k, call.n
    mt, splits, k_per = mma_config(m, k, n, sm_count(), mma_max_splits(ctx, k))
    rows = mma_norm_rows(call.norm, a, m)  # the caller unfused a norm that does not fit
    partial = y if splits == 1 else scratch(ctx, splits * m * n * 4).view(np.float32)
    fused = call.norm.ON_THE_FLY if rows else 0
    extra, shared = norm_args(call.norm, a, y)
    name = f"gemm_mma_nbits4<{call.s_type}, {call.w_type}, {mt}, {int(gated)}, {fused}, {rows}>"
    fn = function(_source(ctx, _MMA4_SOURCES), name)
    args = (a, call.b, call.scales, call.zp_u8, call.zp_f, call.bias_arg)
    args += (np.int32(call.has_bias), y, partial, np.int32(m), np.int32(k), np.int32(n))
    args += (np.int32(call.nb), np.int32(call.block), np.int32(call.zrow))
    args += (np.int32(call.zp_mode), np.int32(k_per), np.int32(splits))
    fn((n // 8, splits), (256,), (*args, *extra), shared_mem=shared)
    if splits > 1:
        sum_splits(ctx, partial, y, splits, gated)


def _gemv_args(call: _NbitsCall, a: Any, y: Any, m: int) -> tuple:
    """The leading arguments every 4-bit GEMV kernel takes, in their order."""
    return (
        a,
        call.b,
        call.scales,
        call.zp_u8,
        call.zp_f,
        call.bias_arg,
        y,
        np.int32(m),
        np.int32(call.k),
        np.int32(call.n),
    )


def _nbits_gemv(
    ctx: KernelContext, call: _NbitsCall, a: Any, y: Any, m: int, gated: bool = False
) -> None:
    """``m`` <= GEMV_MAX_M rows of ``a`` into ``y`` on the GEMV kernels; ``gated`` (the
    chunk16 kernels only, no bias): ``y`` [m, N / 2] gets the SiLU gating of the product's
    gate and up halves."""
    if gated or _chunk16_fits(ctx, call.bits, call.block, call.k, call.nb * call.blob, call.b, a):
        args = _gemv_args(call, a, y, m)
        args += (
            np.int32(call.nb),
            np.int32(call.block),
            np.int32(call.nb * call.blob // 16),
            np.int32(call.zrow),
        )
        args += (np.int32(call.zp_mode), np.int32(call.has_bias))
        fused = call.norm.ON_THE_FLY if call.norm is not None else 0
        extra, shared = norm_args(call.norm, a, y)
        split = None
        if ctx.option("nbits_small_k", True) and m <= SMALL_K_MAX_M:
            split = nbits4_small_k_split(call.k // 32, call.n, sm_count())
        if split is not None:
            lpc, cpl = split
            mt = next(t for t in (1, 2, 4, 8) if t >= m)
            name = (
                f"nbits4_gemv16_small_k<{call.s_type}, {call.w_type}, {mt}, {lpc}, {cpl}, {fused}, "
                f"{int(gated)}>"
            )
            grid = (small_k_blocks(call.n, lpc),)
            function(_source(ctx), name)(grid, (32, 8), (*args, *extra), shared_mem=shared)
            return
        # gated: the warps a column gets as ungated (a column's sums then the same bits)
        mt, nr, wpc = gemv_layout(m, call.k // 32, call.n, sm_count())
        nr = 2 if gated else nr
        name = f"nbits4_gemv16<{call.s_type}, {call.w_type}, {mt}, {nr}, {fused}, {int(gated)}>"
        fn = function(_source(ctx), name)
        groups = call.n // 2 if gated else -(-call.n // nr)
        grid = (-(-groups * wpc // 8),)
        fn(grid, (32, 8), (*args, np.int32(wpc), *extra), shared_mem=shared)
        return
    if call.b.data.ptr % 4:
        refuse_in_capture(ctx, "copying a misaligned packed weight")
        call.b = call.b.copy()
    words = call.nb * call.blob // 4
    mt = next(t for t in (1, 2, 4, 8, 16) if t >= m)
    sms = sm_count()
    nr = 2 if call.n >= 16 * 8 * sms else 1  # columns per warp: more bytes in flight
    groups = -(-call.n // nr)
    wpr = gemv_wpr(groups, words, sms)
    vec_elems = 16 // a.dtype.itemsize
    a_vec = int(a.data.ptr % 16 == 0 and call.k % vec_elems == 0)
    args = _gemv_args(call, a, y, m)
    args += (np.int32(call.nb), np.int32(call.block), np.int32(words), np.int32(call.zrow))
    args += (np.int32(call.zp_mode), np.int32(call.has_bias))
    if ctx.option("nbits_stream", True) and words <= STREAM_MAX_WORDS:
        name = f"nbits_gemv_stream<{call.s_type}, {call.w_type}, {mt}, {call.bits}, {nr}>"
        fn = function(_source(ctx), name)
        fn((stream_blocks(fn, groups, sms),), (32, 8), (*args, np.int32(a_vec)))
        return
    fn = function(
        _source(ctx), f"nbits_gemv<{call.s_type}, {call.w_type}, {mt}, {call.bits}, {nr}>"
    )
    fn((-(-groups * wpr // 8),), (32, 8), (*args, np.int32(wpr), np.int32(a_vec)))


def _gated_rows_fit(ctx: KernelContext, a, b, bias, dims, m: int) -> bool:
    """Whether ``matmul_nbits(..., gated=True)`` takes these ``m`` rows: rows the ungated
    call runs on the 16-byte-chunk GEMVs or the tensor cores (up to CHUNKED_GEMV_MAX_M, as
    ``gated_rows`` allows), 4 bits, no bias, an even N (the tensor cores, whose gated tile
    takes 4 pairs, need N a multiple of 8 ungated too: ``_mma4_fits``)."""
    nb = -(-dims.k // dims.block)
    return (
        0 < m <= CHUNKED_GEMV_MAX_M
        and gated_rows(ctx, m, a.dtype, nbits_mma_min_rows(ctx), GEMV_MAX_M)
        and b.size > 0
        and bias is None
        and dims.n % 2 == 0
        and _chunk16_fits(ctx, dims.bits, dims.block, dims.k, nb * dims.block // 2, b, a)
    )


@REGISTRY.register("MatMulNBits", since=1, domain=MS_DOMAIN, check=_nbits_check)
def matmul_nbits(
    ctx: KernelContext,
    a,
    b,
    scales,
    zero_points=None,
    g_idx=None,
    bias=None,
    norm=None,
    gated: bool = False,
):
    """Y = A @ dequant(B)^T (+ bias); float32 accumulation; fp32 or fp16 A and scales.

    ``norm`` (a ``genrt.FusedNorm``): A is normalized first, inside the 16-byte-chunk
    GEMVs when they apply, else by the norm kernel before any other path. ``gated``: Y
    [..., N / 2] is the SiLU gating of the product's gate and up halves, made by the GEMV's
    store where ``_gated_rows_fit``; None (before anything runs) for other calls."""
    desc = ctx.node.describe()
    dims = matmul_nbits_dims(ctx.node, a.shape[-1], g_idx is not None)
    k, n, bits, block = dims.k, dims.n, dims.bits, dims.block
    if gated and not _gated_rows_fit(ctx, a, b, bias, dims, int(a.size // k) if k else 0):
        return None
    s_type, w_type = storage(ctx, a.dtype), storage(ctx, scales.dtype)
    y = out(ctx, 0, (*a.shape[:-1], n // 2 if gated else n), a.dtype)
    m = int(y.size // y.shape[-1]) if y.shape[-1] else 0
    nb = -(-k // block)
    blob = block * bits // 8
    if norm is not None:
        chunk16 = b.size and m <= GEMV_MAX_M and _chunk16_fits(ctx, bits, block, k, nb * blob, b, a)
        if not (y.size and chunk16 and norm.fits_on_the_fly(a)):
            a, norm = contiguous(ctx, norm.unfused()), None
    if y.size == 0:
        return y
    if b.size == 0:  # an omitted projection: zeros (+ bias)
        y2 = y.reshape(m, n)
        if bias is None:
            y2.fill(0)
        else:
            cupy.copyto(y2, bias.reshape(1, n))
        return y
    if b.dtype != np.uint8 or b.size != n * nb * blob:
        raise ValueError(f"{desc}: B {b.dtype}{list(b.shape)} is not uint8 [{n}, {nb}, {blob}]")
    if scales.size != n * nb:
        raise ValueError(f"{desc}: scales {list(scales.shape)} do not fit [{n}, {nb}]")
    if bias is not None and (bias.size != n or bias.dtype != a.dtype):
        raise ValueError(f"{desc}: bias must be {a.dtype} [{n}]")
    b, scales = contiguous(ctx, b), contiguous(ctx, scales)
    zp_u8, zp_f, zrow, zp_mode = _zero_args(ctx, zero_points, scales, n, nb, bits)
    bias_arg = contiguous(ctx, bias) if bias is not None else y
    if norm is None:  # the prologue reads the fused inputs itself
        a = contiguous(ctx, a)
    call = _NbitsCall(
        b, scales, zp_u8, zp_f, bias_arg, bias is not None, k, n, nb, blob, block, bits,
        zrow, zp_mode, norm, s_type, w_type,
    )  # fmt: skip
    mma = _mma4_fits(ctx, call, a, m)
    if mma and norm is not None and not mma_norm_rows(norm, a, m):
        a, call.norm = contiguous(ctx, norm.unfused()), None  # the prologue as its own kernel
        mma = _mma4_fits(ctx, call, a, m)
    if mma:
        _nbits_mma(ctx, call, a, y, m, gated)
        return y
    if m <= GEMV_MAX_M:
        _nbits_gemv(ctx, call, a, y, m, gated)
        return y
    if m <= CHUNKED_GEMV_MAX_M:
        # Pieces of GEMV_MAX_M rows through the GEMV: capturable, so a batched decode
        # step of up to CHUNKED_GEMV_MAX_M rows replays one graph (and runs the kernels of
        # steps of at most GEMV_MAX_M rows); the weight is read once per piece.
        a2, y2 = a.reshape(m, k), y.reshape(m, y.shape[-1])
        for r0 in range(0, m, GEMV_MAX_M):
            r1 = min(m, r0 + GEMV_MAX_M)
            _nbits_gemv(ctx, call, a2[r0:r1], y2[r0:r1], r1 - r0, gated)
        return y
    blas = provider_cublas(ctx)
    if blas is None and capturing(ctx):
        raise CaptureUnsupported(
            f"{desc}: MatMulNBits with M={m} > {CHUNKED_GEMV_MAX_M} needs cuBLAS on a "
            "dequantized weight, and with the CUDA provider's cublas_in_graphs off that is "
            "CuPy's, which refuses stream capture; this shape runs eagerly"
        )
    params = (k, n, bits, block, a.dtype.str)

    def build() -> cupy.ndarray:
        refuse_in_capture(
            ctx, f"dequantizing the 4-bit weight for M={m} rows (done on the first eager run)"
        )
        w = cupy.empty((n, k), a.dtype)
        fn = function(_source(ctx), f"nbits_dequant<{s_type}, {w_type}, {bits}>")
        total = n * k
        fn(
            (-(-total // 256),),
            (256,),
            (b, scales, zp_u8, zp_f, w, np.int32(k), np.int64(total), np.int32(nb))
            + (np.int32(block), np.int64(nb * blob), np.int32(zrow), np.int32(zp_mode)),
        )
        return w

    w = dequant_cache(ctx).get((b, scales, zero_points), params, build)
    y2 = y.reshape(m, n)
    if blas is not None:
        if bias is not None:  # the GEMM adds its products to the bias
            cupy.copyto(y2, bias.reshape(1, n))
        shape = GemmShape(m, k, n, transposed=True)
        blas.gemm(a, TransposedWeight(w), y, shape, accumulate=bias is not None, where=desc)
        return y
    cupy.matmul(a.reshape(m, k), w.T, out=y2)
    if bias is not None:
        y2 += bias.reshape(1, n)
    return y


# ----------------------------------------------------------------------------- GatherBlockQuantized


def _gbq_check(node: NodeInfo, _types: object) -> str | None:
    bits = int(node.attr("bits", 4))
    if bits not in _NBITS:
        return f"GatherBlockQuantized bits={bits} is not supported on CUDA"
    if int(node.attr("gather_axis", 0)) != 0:
        return "GatherBlockQuantized gather_axis != 0 is not supported on CUDA"
    if int(node.attr("quantize_axis", 1)) not in (1, -1):
        return "GatherBlockQuantized quantize_axis other than the last of 2-D data is not supported on CUDA"
    block = int(node.attr("block_size", 128))
    if block < 16 or block & (block - 1):
        return f"GatherBlockQuantized block_size={block} must be a power of 2 >= 16"
    return None


@REGISTRY.register("GatherBlockQuantized", since=1, domain=MS_DOMAIN, check=_gbq_check)
def gather_block_quantized(ctx: KernelContext, data, indices, scales, zero_points=None):
    """Rows of a uint8 block-quantized 2-D table, dequantized.

    Indices outside ``[-rows, rows)`` raise (IndexError naming the node and the index) when
    they are checked: always for host indices, and for device indices on eager runs (one
    min/max read-back). Inside a CUDA graph capture no read-back is possible, so a captured
    step writes NaN rows for such indices (the decoder's non-finite probe then raises).
    """
    desc = ctx.node.describe()
    reason = _gbq_check(ctx.node, ())
    if reason:
        raise NotImplementedError(f"{desc}: {reason}")
    bits = int(ctx.attr("bits", 4))
    block = int(ctx.attr("block_size", 128))
    if data.dtype != np.uint8 or data.ndim != 2:
        raise NotImplementedError(f"{desc}: only 2-D uint8 data runs on CUDA, got {data.dtype}")
    rows, row_bytes = int(data.shape[0]), int(data.shape[1])
    cols = row_bytes * (8 // bits)
    nb = -(-cols // block)
    if scales.ndim != 2 or int(scales.shape[0]) != rows or int(scales.shape[1]) < nb:
        raise ValueError(f"{desc}: scales {list(scales.shape)} do not fit [{rows}, {nb}]")
    nb = int(scales.shape[1])
    if not isinstance(indices, cupy.ndarray):
        check_index_range(ctx, np.asarray(indices), rows, "indices value")
        refuse_in_capture(ctx, "uploading host indices")
        indices = cupy.asarray(indices)
    elif indices.size and not capturing(ctx):
        ends = cupy.stack([indices.min(), indices.max()]).get()
        check_index_range(ctx, ends, rows, "indices value")
    if indices.dtype not in (np.int32, np.int64):
        raise TypeError(f"{desc}: indices must be int32 or int64")
    zrow, has_zp, zp = 0, 0, data
    if zero_points is not None:
        if zero_points.dtype != np.uint8 or int(zero_points.shape[0]) != rows:
            raise NotImplementedError(f"{desc}: zero points must be packed uint8 [{rows}, *]")
        zp, zrow, has_zp = contiguous(ctx, zero_points), int(zero_points.size // rows), 1
    y = out(ctx, 0, (*indices.shape, cols), scales.dtype)
    total = int(y.size)
    if total == 0:
        return y
    i_type = "int" if indices.dtype == np.int32 else "long long"
    fn = function(
        _source(ctx), f"gather_block_quant<{i_type}, {storage(ctx, scales.dtype)}, {bits}>"
    )
    args = (contiguous(ctx, data), contiguous(ctx, indices), contiguous(ctx, scales), zp, y)
    args += (np.int64(rows), np.int32(cols), np.int32(row_bytes), np.int32(nb))
    args += (np.int32(block), np.int32(zrow), np.int32(has_zp), np.int64(total))
    fn((-(-total // 256),), (256,), args)
    return y
