"""The flash-attention prompt kernel of CUDA GroupQueryAttention (``flash_attn``).

A prompt's attention on the tensor cores without a score matrix in memory: a block takes
``block_rows(D)`` query rows of one head of one batch entry (4 warps of one or two 16-row
tiles: ``flash_tiling.WARP_TILES``; a K tile read from shared memory serves both), stages its
rows rotated into shared memory and keeps them in registers as mma.m16n8k16 A fragments,
then walks the key tiles of ``BLOCK_K`` cache rows its rows can see. K and V tiles come into
shared memory by cp.async, double buffered (the next tile loads while this one is used).
Per tile each warp computes S = Q K^T (ldmatrix from padded rows, no bank conflicts), scales
it, caps it (softcap), masks it only where the tile is partly visible to its rows, updates a
base-2 online softmax per row in fp32 registers (running max and sum, the output rescaled),
and adds P V with P rounded to the input type straight from the score registers. Warps skip
tiles none of their rows sees; the grid runs the query tiles with the most keys first.

Lengths come from ``seqlens`` in device memory as in ``gqa_attn`` (``total = seqlens[b] +
1``, ``past = total - min(total, S)``), so the launch is capturable and one graph serves
every length: a length past the cache writes NaN rows, a row with no visible key zeros. The
new keys and values are in the cache already (``gqa_append``). fp16 and bf16, head sizes 64
and 128 (``flash_attention_problem`` says why a call is refused, and the caller then runs the
other kernels). The tiling is mirrored in numpy by ``providers/cuda/flash_tiling.py``, whose
CPU tests check its bounds and order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import cupy
import numpy as np

from onnx_genrt.core.kernels import KernelContext

from ..flash_tiling import BLOCK_K, HEAD_SIZES, WARP_TILES, WARPS, block_rows
from ..launch import Kernel
from ._common import BF16, CP_ASYNC, DEVICE_COMMON, F16, function
from ._gqa_device import GQA_DEVICE
from .matmul import MMA_TILES

if TYPE_CHECKING:
    from .contrib_attention import _GqaCall

#: Shared-memory row padding (elements): rows of D + 8 put the 8 rows an ldmatrix phase
#: reads in 8 different bank groups.
PAD = 8
#: Dynamic shared memory a kernel may take without opting in.
_SHARED_DEFAULT = 48 << 10

_SOURCE = (
    DEVICE_COMMON
    + CP_ASYNC
    + GQA_DEVICE
    + MMA_TILES
    + f"""
#define FA_BK {BLOCK_K}
#define FA_WARPS {WARPS}
#define FA_PAD {PAD}
"""
    + r"""
#define FA_LOG2E 1.4426950408889634f

// Four 8x8 matrices of 16-bit values from shared memory: lane l gives the address of row
// l % 8 of matrix l / 8 and gets row l / 4, columns 2 (l % 4) and + 1 of each (trans: row
// and column swapped, i.e. rows 2 (l % 4) and + 1 of column l / 4).
DEVI void ldsm4(unsigned (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p))
               : "memory");
}
DEVI void ldsm4_t(unsigned (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p))
               : "memory");
}
DEVI float fa_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Keys [lo, hi] a query at cache row `row` sees among t cached rows (none when hi < lo).
DEVI int fa_hi(int row, int t, int causal) { return causal ? min(row, t - 1) : t - 1; }
DEVI int fa_lo(int row, int window, int causal) {
  return (causal && window > 0) ? max(0, row - window + 1) : 0;
}

// Cache rows k0 .. k0 + FA_BK - 1 of K and V into shared memory (rows of D + FA_PAD), rows
// at or past t zero-filled (never read).
template <typename S, int D>
DEVI void fa_load_tile(S* sk, S* sv, const S* K, const S* V, int k0, int t, int tid) {
  constexpr int CH = D / 8;  // 16-byte chunks per row
#pragma unroll
  for (int c = tid; c < FA_BK * CH; c += 32 * FA_WARPS) {
    const int r = c / CH, col = (c % CH) * 8;
    const bool ok = k0 + r < t;
    const long long src = (long long)(ok ? k0 + r : 0) * D + col;
    cp_async16(sk + r * (D + FA_PAD) + col, K + src, ok);
    cp_async16(sv + r * (D + FA_PAD) + col, V + src, ok);
  }
}

// Per warp: the online softmax of its rows and its output accumulators, per 16-row tile mt
// two rows per lane (g and g + 8; lane = 4 g + c), mma C layout: o[mt][n][0..1] row g,
// features 8 n + 2 c, + 1; o[mt][n][2..3] row g + 8.
template <int D, int MT>
struct FaState {
  float o[MT][D / 8][4];
  float m[MT][2];  // running max, base 2 (-inf: nothing seen)
  float l[MT][2];  // this lane's part of the running sum (the quad adds them at the end)
};

// The scores' scaling: x * scale2 (base 2), or with a softcap cap_out * tanh(x * cap_in)
// (softcap * tanh(scale x / softcap), base 2).
struct FaScale {
  float scale2, cap_in, cap_out;
  bool capped;
};

// Softmax update of one 16-row tile's scores s (scaled, capped, masked here; -inf where
// masked) and their P as the A fragments of the four k16 steps of P V.
template <typename S, int D, bool MASK>
DEVI void fa_softmax(float (&s)[FA_BK / 8][4], float (&o)[D / 8][4], float (&m)[2],
                     float (&l)[2], unsigned (&pa)[FA_BK / 16][4], int k0, const int (&lo)[2],
                     const int (&hi)[2], const FaScale& sc, int c) {
  float mx[2] = {neg_inf(), neg_inf()};
#pragma unroll
  for (int n = 0; n < FA_BK / 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float x = sc.capped ? sc.cap_out * tanhf(s[n][e] * sc.cap_in) : s[n][e] * sc.scale2;
      if (MASK) {
        const int key = k0 + 8 * n + 2 * c + (e & 1), r = e >> 1;
        if (key < lo[r] || key > hi[r]) x = neg_inf();
      }
      s[n][e] = x;
      mx[e >> 1] = fmaxf(mx[e >> 1], x);
    }
  float alpha[2], use[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
    const float m_new = fmaxf(m[r], mx[r]);
    use[r] = m_new == neg_inf() ? 0.f : m_new;
    alpha[r] = fa_exp2(m[r] - use[r]);  // 0 while nothing was seen
    m[r] = m_new;
    l[r] *= alpha[r];
  }
#pragma unroll
  for (int n = 0; n < D / 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[n][e] *= alpha[e >> 1];
  // P = 2^(S - max): the C fragments of two n-tiles are the A fragment of one k16 step.
#pragma unroll
  for (int j = 0; j < FA_BK / 16; ++j) {
    float p[2][4];
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        p[h][e] = fa_exp2(s[2 * j + h][e] - use[e >> 1]);
        l[e >> 1] += p[h][e];
      }
    pa[j][0] = pack2((const S*)nullptr, p[0][0], p[0][1]);
    pa[j][1] = pack2((const S*)nullptr, p[0][2], p[0][3]);
    pa[j][2] = pack2((const S*)nullptr, p[1][0], p[1][1]);
    pa[j][3] = pack2((const S*)nullptr, p[1][2], p[1][3]);
  }
}

// One key tile for one warp: S = Q K^T from shared memory for each of its MT row tiles (one
// ldmatrix of K serves them all), the softmax update, O += P V. qf: the warp's Q fragments;
// sk / sv: the tile; k0 its first cache row; lo / hi: key bounds of the lane's rows.
template <typename S, int D, int MT, bool MASK>
DEVI void fa_tile(FaState<D, MT>& st, const unsigned (&qf)[MT][D / 16][4], const S* sk,
                  const S* sv, int k0, const int (&lo)[MT][2], const int (&hi)[MT][2],
                  const FaScale& sc, int lane) {
  constexpr int LD = D + FA_PAD;
  float s[MT][FA_BK / 8][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int n = 0; n < FA_BK / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[mt][n][e] = 0.f;
  // S: n-tiles of 8 keys in pairs (one ldmatrix.x4 gives both halves of the k16 step for two
  // n-tiles: keys 16 np + (l % 8) + 8 (l / 16), features 16 kk + 8 ((l / 8) % 2)).
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
    for (int np = 0; np < FA_BK / 16; ++np) {
      unsigned kb[4];
      ldsm4(kb, sk + (16 * np + (lane & 7) + 8 * (lane >> 4)) * LD + 16 * kk + 8 * ((lane >> 3) & 1));
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const unsigned(&a)[4] = qf[mt][kk];
        Mma<S>::run(s[mt][2 * np], a[0], a[1], a[2], a[3], kb[0], kb[1]);
        Mma<S>::run(s[mt][2 * np + 1], a[0], a[1], a[2], a[3], kb[2], kb[3]);
      }
    }
  }
  unsigned pa[MT][FA_BK / 16][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
    fa_softmax<S, D, MASK>(s[mt], st.o[mt], st.m[mt], st.l[mt], pa[mt], k0, lo[mt], hi[mt], sc,
                           lane & 3);
  // O += P V: V rows are keys, so its B fragments come transposed (keys 16 j + (l % 8) +
  // 8 ((l / 8) % 2), features 16 dp + 8 (l / 16)).
#pragma unroll
  for (int j = 0; j < FA_BK / 16; ++j) {
#pragma unroll
    for (int dp = 0; dp < D / 16; ++dp) {
      unsigned vb[4];
      ldsm4_t(vb, sv + (16 * j + (lane & 7) + 8 * ((lane >> 3) & 1)) * LD + 16 * dp + 8 * (lane >> 4));
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const unsigned(&a)[4] = pa[mt][j];
        Mma<S>::run(st.o[mt][2 * dp], a[0], a[1], a[2], a[3], vb[0], vb[1]);
        Mma<S>::run(st.o[mt][2 * dp + 1], a[0], a[1], a[2], a[3], vb[2], vb[3]);
      }
    }
  }
}

// The block's query rows [q0, q0 + BQ) of head h, rotated at positions past + i and rounded
// to S, into shared memory (rows of D + FA_PAD); rows at or past S_len are zeros.
template <typename S, typename C, int D, int BQ>
DEVI void fa_load_queries(S* sq, const S* __restrict__ q, long long q_row, int b, int h, int q0,
                          int S_len, int past, const C* __restrict__ cos_c,
                          const C* __restrict__ sin_c, int max_pos, int rot, int interleaved,
                          int rotary, int tid) {
  const int half = rot >> 1;
  for (int e = tid; e < BQ * D; e += 32 * FA_WARPS) {
    const int r = e / D, d = e % D, i = q0 + r;
    float v = 0.f;
    if (i < S_len) {
      const S* qx = q + ((long long)b * S_len + i) * q_row + (long long)h * D;
      const int p = clampi(past + i, 0, max_pos - 1);
      v = rotary ? rope_elem(qx, d, rot, interleaved, cos_c + (long long)p * half,
                             sin_c + (long long)p * half)
                 : ld(qx, d);
    }
    st(sq, (long long)r * (D + FA_PAD) + d, v);
  }
}

// grid (H, ceil(S / BQ), B) with BQ = FA_WARPS * 16 MT query rows a block, block 32 FA_WARPS
// threads; dynamic shared memory 4 FA_BK (D + FA_PAD) values of S (K and V tiles, two
// stages; the query rows are staged in stage 1 before the loop: BQ <= 2 FA_BK). y [B, S,
// H * D]. sink_mode: 0 none, 1 head_sink, 2 smooth softmax (a zero sink).
template <typename S, typename C, int D, int MT, int MB>
__global__ void __launch_bounds__(32 * FA_WARPS, MB)
    flash_attn(const S* __restrict__ q, long long q_row, const S* __restrict__ kc,
               const S* __restrict__ vc, const int* __restrict__ seqlens,
               const C* __restrict__ cos_c, const C* __restrict__ sin_c, int max_pos,
               const S* __restrict__ sinks, S* __restrict__ y, int S_len, int H, int kvh,
               int cap, int rot, int interleaved, int rotary, float scale, float softcap,
               int window, int causal, int sink_mode, int wcache) {
  constexpr int LD = D + FA_PAD, TILE = FA_BK * LD, WR = 16 * MT, BQ = FA_WARPS * WR;
  static_assert(BQ <= 2 * FA_BK, "the query rows are staged in one stage of K and V tiles");
  extern __shared__ __align__(16) unsigned char fa_smem[];
  GRID_WAIT();
  GRID_LAUNCH_DEPENDENTS();
  S* sm = reinterpret_cast<S*>(fa_smem);  // stage st: K at 2 st TILE, V at (2 st + 1) TILE
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int h = blockIdx.x, b = blockIdx.z;
  const int q0 = (gridDim.y - 1 - blockIdx.y) * BQ;  // the most keys first
  const int g = h / (H / kvh);
  const int total = seqlens[b] + 1;
  const int n_new = min(max(total, 0), S_len);
  const int past = total - n_new;
  const int base = wcache ? window_rows(past, cap, window) : past;
  const int t = wcache ? base + n_new : min(total, cap);
  const int rows = min(BQ, S_len - q0);
  const long long out0 = ((long long)b * S_len + q0) * H + h;  // (row q0, head h) of y

  if (wcache ? t > cap : total > cap) {
    // A length past the cache, which the host could not check: NaN, never attention over
    // a clamped window (gqa_attn does the same).
    for (int e = tid; e < rows * D; e += 32 * FA_WARPS)
      st(y, (out0 + (long long)(e / D) * H) * D + e % D, __int_as_float(0x7fc00000));
    return;
  }
  const S* K = kc + ((long long)b * kvh + g) * cap * D;
  const S* V = vc + ((long long)b * kvh + g) * cap * D;
  const int first = base + q0, last = first + rows - 1;
  const int lo_b = fa_lo(first, window, causal), hi_b = fa_hi(last, t, causal);
  const int kt0 = lo_b / FA_BK;
  const int n_tiles = hi_b < lo_b ? 0 : hi_b / FA_BK - kt0 + 1;
  if (n_tiles > 0) fa_load_tile<S, D>(sm, sm + TILE, K, V, kt0 * FA_BK, t, tid);
  cp_async_commit();
  fa_load_queries<S, C, D, BQ>(sm + 2 * TILE, q, q_row, b, h, q0, S_len, past, cos_c, sin_c,
                               max_pos, rot, interleaved, rotary, tid);
  __syncthreads();
  // The warp's Q fragments (rows WR warp + 16 mt + (l % 8) + 8 ((l / 8) % 2), features
  // 16 kk + 8 (l / 16)): a0 rows 0-7, a1 rows 8-15, a2 / a3 the next 8 features.
  unsigned qf[MT][D / 16][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
      ldsm4(qf[mt][kk], sm + 2 * TILE +
                            (WR * warp + 16 * mt + (lane & 7) + 8 * ((lane >> 3) & 1)) * LD +
                            16 * kk + 8 * (lane >> 4));
  __syncthreads();  // stage 1 is free for the next tile

  FaState<D, MT> st;
  int lo[MT][2], hi[MT][2];
  const int wr = WR * warp;  // the warp's first row in the block
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) st.o[mt][n][e] = 0.f;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = first + wr + 16 * mt + (lane >> 2) + 8 * r;  // the lane's cache rows
      st.m[mt][r] = neg_inf();
      st.l[mt][r] = 0.f;
      lo[mt][r] = fa_lo(row, window, causal);
      hi[mt][r] = fa_hi(row, t, causal);
    }
  }
  const bool active = wr < rows;  // a warp past the rows idles
  const int w_first = first + wr, w_last = first + min(wr + WR - 1, rows - 1);
  const int w_lo_first = fa_lo(w_first, window, causal), w_hi_first = fa_hi(w_first, t, causal);
  const int w_lo_last = fa_lo(w_last, window, causal), w_hi_last = fa_hi(w_last, t, causal);
  FaScale sc;
  sc.capped = softcap > 0.f;
  sc.scale2 = scale * FA_LOG2E;
  sc.cap_in = sc.capped ? scale / softcap : 0.f;
  sc.cap_out = softcap * FA_LOG2E;

  for (int j = 0; j < n_tiles; ++j) {
    if (j + 1 < n_tiles) {
      const int nxt = (j + 1) & 1;
      fa_load_tile<S, D>(sm + 2 * nxt * TILE, sm + (2 * nxt + 1) * TILE, K, V,
                         (kt0 + j + 1) * FA_BK, t, tid);
    }
    cp_async_commit();
    cp_async_wait1();  // tile j has landed (tile j + 1 may still be in flight)
    __syncthreads();
    const int k0 = (kt0 + j) * FA_BK, k1 = k0 + FA_BK - 1;
    const S* sk = sm + 2 * (j & 1) * TILE;
    const S* sv = sk + TILE;
    if (active && k0 <= w_hi_last && k1 >= w_lo_first) {
      if (k0 >= w_lo_last && k1 <= w_hi_first)
        fa_tile<S, D, MT, false>(st, qf, sk, sv, k0, lo, hi, sc, lane);
      else
        fa_tile<S, D, MT, true>(st, qf, sk, sv, k0, lo, hi, sc, lane);
    }
    __syncthreads();  // every warp is done with stage j & 1 before tile j + 2 lands there
  }
  if (!active) return;

  // Finish: the quad's sums, the sink's share, O / L (zeros for rows that saw no key).
  const float sink2 = sink_mode == 1 ? ld(sinks, h) * FA_LOG2E : 0.f;
  const int c = lane & 3;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float l = st.l[mt][r];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      float keep = 1.f;
      if (sink_mode) {
        const float top = fmaxf(st.m[mt][r], sink2);
        keep = st.m[mt][r] == neg_inf() ? 0.f : fa_exp2(st.m[mt][r] - top);
        l = l * keep + (top == neg_inf() ? 0.f : fa_exp2(sink2 - top));
      }
      const float f = l > 0.f ? keep / l : 0.f;
      const int i = wr + 16 * mt + (lane >> 2) + 8 * r;  // row in the block
      if (i < rows) {
        S* yr = y + (out0 + (long long)i * H) * D;
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
          const float* o = st.o[mt][n] + 2 * r;
          *reinterpret_cast<unsigned*>(yr + 8 * n + 2 * c) =
              pack2((const S*)nullptr, o[0] * f, o[1] * f);
        }
      }
    }
  }
}
"""
)


#: Blocks per SM the kernel's launch bounds ask for (at most 255 registers a thread).
MIN_BLOCKS = 2


def flash_template_args(s_type: str, c_type: str, head_size: int) -> str:
    """The template arguments of the ``flash_attn`` instance for the activation and rotary
    cache storage types and a head size of HEAD_SIZES."""
    return f"{s_type}, {c_type}, {head_size}, {WARP_TILES[head_size]}, {MIN_BLOCKS}"


def flash_shared_bytes(head_size: int, itemsize: int) -> int:
    """Dynamic shared memory of one block: K and V tiles, two stages, padded rows."""
    return 4 * BLOCK_K * (head_size + PAD) * itemsize


def flash_attention_problem(call: _GqaCall, y: cupy.ndarray, cc_major: int) -> str | None:
    """Why ``flash_attn`` cannot take the call (the caller then runs the other kernels), or
    None: fp16 or bf16, a head size of HEAD_SIZES, 16-byte aligned buffers, sm_80 or newer."""
    if call.dtype not in (F16, BF16):
        return f"flash attention takes float16 and bfloat16, not {call.dtype}"
    if call.head_size not in HEAD_SIZES:
        return f"flash attention has head sizes {HEAD_SIZES}, not {call.head_size}"
    if cc_major < 8:
        return f"flash attention needs sm_80 or newer (mma.m16n8k16), not sm_{cc_major}x"
    for what, arr in (("past_key", call.past_key), ("past_value", call.past_value), ("y", y)):
        if arr.data.ptr % 16:
            return f"flash attention needs 16-byte aligned buffers ({what} is not)"
    return None


#: Kernels whose shared-memory limit was raised (``_raise_shared_limit``).
_RAISED: set[int] = set()


def flash_attend(ctx: KernelContext, call: _GqaCall, y: cupy.ndarray) -> None:
    """Launch ``flash_attn`` for the call (``flash_attention_problem`` must be None); the new
    keys and values are already in the cache."""
    d = call.head_size
    kernel = function(_SOURCE, f"flash_attn<{flash_template_args(call.s_type, call.c_type, d)}>")
    shared = flash_shared_bytes(d, call.dtype.itemsize)
    if shared > _SHARED_DEFAULT:
        _raise_shared_limit(kernel, shared)
    grid = (call.heads, -(-call.new // block_rows(d)), call.batch)
    kernel(
        grid,
        (32 * WARPS,),
        (
            call.query,
            np.int64(call.q_row),
            call.past_key,
            call.past_value,
            call.seqlens,
            call.cos,
            call.sin,
            np.int32(call.max_pos),
            call.sinks,
            y,
            np.int32(call.new),
            np.int32(call.heads),
            np.int32(call.kv_heads),
            np.int32(call.cap),
            np.int32(call.rot),
            np.int32(call.interleaved),
            np.int32(call.rotary),
            np.float32(call.scale),
            np.float32(call.softcap),
            np.int32(call.window),
            np.int32(call.causal),
            np.int32(call.sink_mode),
            np.int32(call.wcache),
        ),
        shared_mem=shared,
    )


def _raise_shared_limit(kernel: Kernel, shared: int) -> None:
    """Let ``kernel`` take ``shared`` bytes of dynamic shared memory (above the default 48 KiB
    it must opt in; a function attribute, which may be set while a stream captures). Kernels
    stay in ``function``'s cache, so their ids stay theirs."""
    if id(kernel) not in _RAISED:
        kernel.raw.max_dynamic_shared_size_bytes = shared
        _RAISED.add(id(kernel))
