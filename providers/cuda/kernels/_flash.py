"""The flash-attention prompt kernel of CUDA GroupQueryAttention (``flash_attn``).

A prompt's attention on the tensor cores without a score matrix in memory: a block takes
``BLOCK_Q`` query rows of one head of one batch entry (4 warps of 16 rows), stages its
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

from ..flash_tiling import BLOCK_K, BLOCK_Q, HEAD_SIZES, WARPS
from ._common import BF16, DEVICE_COMMON, F16, function
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
    + GQA_DEVICE
    + MMA_TILES
    + f"""
#define FA_BQ {BLOCK_Q}
#define FA_BK {BLOCK_K}
#define FA_WARPS {WARPS}
#define FA_PAD {PAD}
"""
    + r"""
#define FA_LOG2E 1.4426950408889634f

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

// Per warp: the online softmax of its two rows per lane (g and g + 8 of its 16; lane =
// 4 g + c) and its output accumulators, mma C layout: o[n][0..1] row g, features 8 n + 2 c,
// + 1; o[n][2..3] row g + 8.
template <int D>
struct FaState {
  float o[D / 8][4];
  float m[2];  // running max, base 2 (-inf: nothing seen)
  float l[2];  // this lane's part of the running sum (the quad adds them at the end)
};

// The scores' scaling: x * scale2 (base 2), or with a softcap cap_out * tanh(x * cap_in)
// (softcap * tanh(scale x / softcap), base 2).
struct FaScale {
  float scale2, cap_in, cap_out;
  bool capped;
};

// One key tile for one warp: S = Q K^T from shared memory, scaled, capped, masked (MASK),
// softmax update, O += P V. qf: the warp's Q fragments; sk / sv: the tile; k0 its first
// cache row; lo / hi: key bounds of the lane's rows g and g + 8.
template <typename S, int D, bool MASK>
DEVI void fa_tile(FaState<D>& st, const unsigned (&qf)[D / 16][4], const S* sk, const S* sv,
                  int k0, const int (&lo)[2], const int (&hi)[2], const FaScale& sc, int lane) {
  constexpr int LD = D + FA_PAD;
  const int c = lane & 3;
  float s[FA_BK / 8][4];
#pragma unroll
  for (int n = 0; n < FA_BK / 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[n][e] = 0.f;
  // S: n-tiles of 8 keys in pairs (one ldmatrix.x4 gives both halves of the k16 step for two
  // n-tiles: keys 16 np + (l % 8) + 8 (l / 16), features 16 kk + 8 ((l / 8) % 2)).
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
    for (int np = 0; np < FA_BK / 16; ++np) {
      unsigned kb[4];
      ldsm4(kb, sk + (16 * np + (lane & 7) + 8 * (lane >> 4)) * LD + 16 * kk + 8 * ((lane >> 3) & 1));
      Mma<S>::run(s[2 * np], qf[kk][0], qf[kk][1], qf[kk][2], qf[kk][3], kb[0], kb[1]);
      Mma<S>::run(s[2 * np + 1], qf[kk][0], qf[kk][1], qf[kk][2], qf[kk][3], kb[2], kb[3]);
    }
  }
  // Scale (base 2), softcap, mask; the rows' maxima over the quad.
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
    const float m_new = fmaxf(st.m[r], mx[r]);
    use[r] = m_new == neg_inf() ? 0.f : m_new;
    alpha[r] = fa_exp2(st.m[r] - use[r]);  // 0 while nothing was seen
    st.m[r] = m_new;
    st.l[r] *= alpha[r];
  }
#pragma unroll
  for (int n = 0; n < D / 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) st.o[n][e] *= alpha[e >> 1];
  // P = 2^(S - max): the C fragments of two n-tiles are the A fragment of one k16 step.
  unsigned pa[FA_BK / 16][4];
#pragma unroll
  for (int j = 0; j < FA_BK / 16; ++j) {
    float p[2][4];
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        p[h][e] = fa_exp2(s[2 * j + h][e] - use[e >> 1]);
        st.l[e >> 1] += p[h][e];
      }
    pa[j][0] = pack2((const S*)nullptr, p[0][0], p[0][1]);
    pa[j][1] = pack2((const S*)nullptr, p[0][2], p[0][3]);
    pa[j][2] = pack2((const S*)nullptr, p[1][0], p[1][1]);
    pa[j][3] = pack2((const S*)nullptr, p[1][2], p[1][3]);
  }
  // O += P V: V rows are keys, so its B fragments come transposed (keys 16 j + (l % 8) +
  // 8 ((l / 8) % 2), features 16 dp + 8 (l / 16)).
#pragma unroll
  for (int j = 0; j < FA_BK / 16; ++j) {
#pragma unroll
    for (int dp = 0; dp < D / 16; ++dp) {
      unsigned vb[4];
      ldsm4_t(vb, sv + (16 * j + (lane & 7) + 8 * ((lane >> 3) & 1)) * LD + 16 * dp + 8 * (lane >> 4));
      Mma<S>::run(st.o[2 * dp], pa[j][0], pa[j][1], pa[j][2], pa[j][3], vb[0], vb[1]);
      Mma<S>::run(st.o[2 * dp + 1], pa[j][0], pa[j][1], pa[j][2], pa[j][3], vb[2], vb[3]);
    }
  }
}

// The block's query rows [q0, q0 + FA_BQ) of head h, rotated at positions past + i and
// rounded to S, into shared memory (rows of D + FA_PAD); rows at or past S_len are zeros.
template <typename S, typename C, int D>
DEVI void fa_load_queries(S* sq, const S* __restrict__ q, long long q_row, int b, int h, int q0,
                          int S_len, int past, const C* __restrict__ cos_c,
                          const C* __restrict__ sin_c, int max_pos, int rot, int interleaved,
                          int rotary, int tid) {
  const int half = rot >> 1;
  for (int e = tid; e < FA_BQ * D; e += 32 * FA_WARPS) {
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

// grid (H, ceil(S / FA_BQ), B), block 32 * FA_WARPS threads; dynamic shared memory
// 4 FA_BK (D + FA_PAD) values of S (K and V tiles, two stages; the query rows are staged in
// stage 1's K tile before the loop). y [B, S, H * D]. sink_mode: 0 none, 1 head_sink, 2
// smooth softmax (a zero sink).
template <typename S, typename C, int D, int MB>
__global__ void __launch_bounds__(32 * FA_WARPS, MB)
    flash_attn(const S* __restrict__ q, long long q_row, const S* __restrict__ kc,
               const S* __restrict__ vc, const int* __restrict__ seqlens,
               const C* __restrict__ cos_c, const C* __restrict__ sin_c, int max_pos,
               const S* __restrict__ sinks, S* __restrict__ y, int S_len, int H, int kvh,
               int cap, int rot, int interleaved, int rotary, float scale, float softcap,
               int window, int causal, int sink_mode, int wcache) {
  constexpr int LD = D + FA_PAD, TILE = FA_BK * LD;
  extern __shared__ __align__(16) unsigned char fa_smem[];
  S* sm = reinterpret_cast<S*>(fa_smem);  // stage st: K at 2 st TILE, V at (2 st + 1) TILE
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int h = blockIdx.x, b = blockIdx.z;
  const int q0 = (gridDim.y - 1 - blockIdx.y) * FA_BQ;  // the most keys first
  const int g = h / (H / kvh);
  const int total = seqlens[b] + 1;
  const int n_new = min(max(total, 0), S_len);
  const int past = total - n_new;
  const int base = wcache ? window_rows(past, cap, window) : past;
  const int t = wcache ? base + n_new : min(total, cap);
  const int rows = min(FA_BQ, S_len - q0);
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
  fa_load_queries<S, C, D>(sm + 2 * TILE, q, q_row, b, h, q0, S_len, past, cos_c, sin_c,
                           max_pos, rot, interleaved, rotary, tid);
  __syncthreads();
  // The warp's Q fragments (rows 16 warp + (l % 8) + 8 ((l / 8) % 2), features 16 kk +
  // 8 (l / 16)): a0 rows 0-7, a1 rows 8-15, a2 / a3 the next 8 features.
  unsigned qf[D / 16][4];
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
    ldsm4(qf[kk], sm + 2 * TILE + (16 * warp + (lane & 7) + 8 * ((lane >> 3) & 1)) * LD +
                      16 * kk + 8 * (lane >> 4));
  __syncthreads();  // stage 1 is free for the next tile

  FaState<D> st;
#pragma unroll
  for (int n = 0; n < D / 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) st.o[n][e] = 0.f;
  st.m[0] = st.m[1] = neg_inf();
  st.l[0] = st.l[1] = 0.f;
  const int wr = 16 * warp;                       // the warp's first row in the block
  const bool active = wr < rows;                  // a warp past the rows idles
  const int w_first = first + wr, w_last = first + min(wr + 15, rows - 1);
  const int w_lo_first = fa_lo(w_first, window, causal), w_hi_first = fa_hi(w_first, t, causal);
  const int w_lo_last = fa_lo(w_last, window, causal), w_hi_last = fa_hi(w_last, t, causal);
  const int rg = w_first + (lane >> 2);
  const int lo[2] = {fa_lo(rg, window, causal), fa_lo(rg + 8, window, causal)};
  const int hi[2] = {fa_hi(rg, t, causal), fa_hi(rg + 8, t, causal)};
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
        fa_tile<S, D, false>(st, qf, sk, sv, k0, lo, hi, sc, lane);
      else
        fa_tile<S, D, true>(st, qf, sk, sv, k0, lo, hi, sc, lane);
    }
    __syncthreads();  // every warp is done with stage j & 1 before tile j + 2 lands there
  }
  if (!active) return;

  // Finish: the quad's sums, the sink's share, O / L (zeros for rows that saw no key).
  const float sink2 = sink_mode == 1 ? ld(sinks, h) * FA_LOG2E : 0.f;
  float f[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float l = st.l[r];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    float scale_o = 1.f;
    if (sink_mode) {
      const float top = fmaxf(st.m[r], sink2);
      scale_o = st.m[r] == neg_inf() ? 0.f : fa_exp2(st.m[r] - top);
      l = l * scale_o + (top == neg_inf() ? 0.f : fa_exp2(sink2 - top));
    }
    f[r] = l > 0.f ? scale_o / l : 0.f;
  }
  const int c = lane & 3;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int i = wr + (lane >> 2) + 8 * r;  // row in the block
    if (i < rows) {
      S* yr = y + (out0 + (long long)i * H) * D;
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        const unsigned w = pack2((const S*)nullptr, st.o[n][2 * r] * f[r], st.o[n][2 * r + 1] * f[r]);
        *reinterpret_cast<unsigned*>(yr + 8 * n + 2 * c) = w;
      }
    }
  }
}
"""
)


def flash_min_blocks(head_size: int) -> int:
    """Blocks per SM the kernel's launch bounds ask for (registers: its accumulators grow
    with the head size)."""
    return 3 if head_size <= 64 else 2


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
    d, blocks = call.head_size, flash_min_blocks(call.head_size)
    kernel = function(_SOURCE, f"flash_attn<{call.s_type}, {call.c_type}, {d}, {blocks}>")
    shared = flash_shared_bytes(d, call.dtype.itemsize)
    if shared > _SHARED_DEFAULT:
        _raise_shared_limit(kernel, shared)
    grid = (call.heads, -(-call.new // BLOCK_Q), call.batch)
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


def _raise_shared_limit(kernel: cupy.RawKernel, shared: int) -> None:
    """Let ``kernel`` take ``shared`` bytes of dynamic shared memory (above the default 48 KiB
    it must opt in; a function attribute, which may be set while a stream captures). Kernels
    stay in ``function``'s cache, so their ids stay theirs."""
    if id(kernel) not in _RAISED:
        kernel.max_dynamic_shared_size_bytes = shared
        _RAISED.add(id(kernel))
