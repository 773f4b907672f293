"""The grouped decode attention kernel of CUDA GroupQueryAttention (``gqa_decode``).

Decode and verify steps (up to ``FUSE_MAX_NEW`` new rows, the captured ones). One block takes
one (split, KV head, batch x new row) and computes all ``G`` query heads of the KV head's group
against each key it loads, so each K and V element is read from global memory once per split
rather than once per query head (``gqa_attn`` reads it G times). Two launches of one body:
``gqa_decode`` (a long KV cache: many splits, merged through global memory) and, on sm_90+
for a short cache, ``gqa_decode_cluster`` (``CLUSTER_SPLITS`` splits forming a thread-block
cluster; block 0 merges the others' partials from their shared memory: no counters and no
global round trip, and the same bits as ``gqa_decode`` over as many splits).
The tiling, split sizing and merge order are those of ``providers/cuda/grouped_decode.py``,
whose numpy mirror ``grouped_decode`` the CPU tests check against float64 attention.

* The group's query rows are loaded before the length is known, then rotated and scaled
  into shared memory. The new keys (rotated, rounded to the cache type) and values a block
  needs come from the inputs into shared memory, and the blocks of split 0 write their row
  into the cache: no block reads cache rows at or past the first new one, so the append
  needs no launch of its own (as in ``gqa_attn``). A window-sized cache
  (``sliding_window_cache``) is left to ``gqa_window_store`` after the launch.
* Each warp walks tiles of keys: a key's row comes in 16-byte loads to one lane (two or
  more for wide rows), which scores it against the G heads in shared memory; the warp keeps
  one online softmax per head and adds the value rows, 16 bytes a lane, with G sums per
  element.
* Splits: ``max(ceil(visible / splits), min_chunk)`` keys each, from the device-side
  length, so one graph serves every length. The partials merge in a fixed order: the warps
  in the block; then groups of ``MERGE_GROUP`` splits (the last block of each group to
  finish, per an atomic counter it sets back to zero); then the groups (the last group
  merger). A lone split or group writes the output directly.
* A length past the cache (unknown to the host) gives NaN rows and writes no key; a row
  with no visible key gets zeros. Softcap, causal (or not), local window, head sinks and
  smooth softmax are handled as in ``gqa_attn``.

``decode_call_problem`` says when a call has no instance (a group of more than MAX_GROUP
heads, rows that are not 16 x 2^k bytes, unaligned caches); the caller then runs the
many-split ``gqa_attn``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import cupy
import numpy as np

from onnx_genrt.core.kernels import KernelContext

from ..grouped_decode import (
    CLUSTER_SPLITS,
    DECODE_BLOCKS_PER_SM,
    DECODE_HEAD_GROUPS,
    DECODE_WARPS,
    MAX_DECODE_SPLITS,
    MERGE_GROUP,
    DecodeShape,
    decode_problem,
    decode_splits,
    head_groups,
    most_keys,
    same_cut_splits,
)
from ._common import DEVICE_COMMON, function, scratch, sm_count
from ._gqa_device import GQA_DEVICE
from .reduce import zeroed_counters

if TYPE_CHECKING:
    from .contrib_attention import _GqaCall

_SOURCE = (
    DEVICE_COMMON
    + GQA_DEVICE
    + f"""
#define GD_MERGE_GROUP {MERGE_GROUP}
#define GD_CLUSTER {CLUSTER_SPLITS}
"""
    + r"""
// Programmatic dependent launch: the kernel waits for the previous one before it touches
// memory. Where the common helpers do not define the macro, nothing to wait for.
#ifndef GRID_WAIT
#define GRID_WAIT() ((void)0)
#endif
#ifndef GRID_EARLY_LAUNCH
#define GRID_EARLY_LAUNCH() ((void)0)
#endif

// How a warp lays out a tile (grouped_decode.DecodeShape): V elements per 16-byte load; LK
// lanes score one key (KL loads each), TK keys a tile; FS lanes load one value row, KS rows
// per warp load, VL loads a tile; QP floats per query piece in shared memory (padded: the LK
// pieces of a head sit in different banks).
template <typename S, int D>
struct DecodeShape {
  static constexpr int V = 16 / (int)sizeof(S);
  static constexpr int LK = D * (int)sizeof(S) > 128 ? D * (int)sizeof(S) / 128 : 1;
  static constexpr int TK = 32 / LK;
  static constexpr int KL = D / LK / V;
  static constexpr int FS = D / V;
  static constexpr int KS = 32 / FS;
  static constexpr int VL = TK / KS;
  static constexpr int QP = D / LK + 4;
  static_assert(FS >= 1 && FS <= 32 && 32 % FS == 0, "rows of 16 x 2^k bytes, at most 512");
  static_assert(KL >= 1 && VL >= 1, "a key's loads and a tile's value loads");
};

// The V values of a 16-byte word of S.
DEVI void unpack16(const float*, uint4 w, float (&v)[4]) {
  v[0] = __uint_as_float(w.x);
  v[1] = __uint_as_float(w.y);
  v[2] = __uint_as_float(w.z);
  v[3] = __uint_as_float(w.w);
}
template <typename S>  // half_t or bf16_t
DEVI void unpack16(const S* p, uint4 w, float (&v)[8]) {
  unpack2(p, w.x, v[0], v[1]);
  unpack2(p, w.y, v[2], v[3]);
  unpack2(p, w.z, v[4], v[5]);
  unpack2(p, w.w, v[6], v[7]);
}
DEVI uint4 zero16() { return make_uint4(0u, 0u, 0u, 0u); }

// 16 bytes at p: from global memory (MIX = false) or from either global or shared memory.
template <bool MIX>
DEVI uint4 load16(const void* p) {
  if constexpr (MIX) return *reinterpret_cast<const uint4*>(p);
  else return __ldg(reinterpret_cast<const uint4*>(p));
}

// One warp tile: keys [k0, min(k0 + TK, k_end)) of the row; cache rows from K / Vc, rows at or
// past `base` from kn / vn (shared memory; MIX: the tile has some). Updates the warp's online
// softmax of each head j: running max m[j] (the same in every lane), this lane's share of the
// denominator l[j], and acc[j][v]: the value sums of features fslot * V + v for the keys of
// this lane's value rows.
template <typename S, int D, int G, bool MIX>
DEVI void decode_tile(const float* q_sh, const S* K, const S* Vc, const S* kn, const S* vn,
                      int base, int k0, int k_end, float softcap, int lane, float (&m)[G],
                      float (&l)[G], float (&acc)[G][DecodeShape<S, D>::V]) {
  using SH = DecodeShape<S, D>;
  constexpr int V = SH::V, LK = SH::LK, KL = SH::KL, FS = SH::FS, KS = SH::KS, VL = SH::VL,
                QP = SH::QP;
  const int sub = lane % LK, key = k0 + lane / LK;
  const bool ok = key < k_end;
  // Every load of the tile first: this lane's piece of its key, then its value rows.
  uint4 kr[KL], vr[VL];
  {
    const S* kp = (MIX && key >= base) ? kn + (long long)(key - base) * D
                                       : K + (long long)key * D;
    kp += sub * (D / LK);
#pragma unroll
    for (int u = 0; u < KL; ++u) kr[u] = ok ? load16<MIX>(kp + u * V) : zero16();
  }
#pragma unroll
  for (int it = 0; it < VL; ++it) {
    const int vk = k0 + it * KS + lane / FS;
    const S* vp = (MIX && vk >= base) ? vn + (long long)(vk - base) * D : Vc + (long long)vk * D;
    vr[it] = vk < k_end ? load16<MIX>(vp + (lane % FS) * V) : zero16();
  }
  float s[G];
#pragma unroll
  for (int j = 0; j < G; ++j) s[j] = 0.f;
  const float* qs = q_sh + sub * QP;
#pragma unroll
  for (int u = 0; u < KL; ++u) {
    float kf[V];
    unpack16((const S*)nullptr, kr[u], kf);
#pragma unroll
    for (int j = 0; j < G; ++j) {
#pragma unroll
      for (int c = 0; c < V; c += 4) {
        const float4 qq = *reinterpret_cast<const float4*>(qs + j * LK * QP + u * V + c);
        s[j] += qq.x * kf[c] + qq.y * kf[c + 1] + qq.z * kf[c + 2] + qq.w * kf[c + 3];
      }
    }
  }
#pragma unroll
  for (int j = 0; j < G; ++j) {
#pragma unroll
    for (int o = LK / 2; o > 0; o >>= 1) s[j] += __shfl_xor_sync(0xffffffffu, s[j], o);
    if (softcap > 0.f) s[j] = softcap * tanhf(s[j] / softcap);
    if (!ok) s[j] = neg_inf();
    const float m_new = fmaxf(m[j], warp_max(s[j]));
    const float p = (ok && m_new != neg_inf()) ? expf(s[j] - m_new) : 0.f;
    const float alpha = m[j] == neg_inf() ? 0.f : expf(m[j] - m_new);
    l[j] = l[j] * alpha + (sub == 0 ? p : 0.f);
#pragma unroll
    for (int v = 0; v < V; ++v) acc[j][v] *= alpha;
    m[j] = m_new;
    s[j] = p;  // the key's weight, in each of its LK lanes
  }
#pragma unroll
  for (int it = 0; it < VL; ++it) {
    const int src = (it * KS + lane / FS) * LK;  // a lane of the value row's key
    float vf[V];
    unpack16((const S*)nullptr, vr[it], vf);
#pragma unroll
    for (int j = 0; j < G; ++j) {
      const float w = __shfl_sync(0xffffffffu, s[j], src);
#pragma unroll
      for (int v = 0; v < V; ++v) acc[j][v] += w * vf[v];
    }
  }
}

// Where the partials a merge reads live: global memory written by other blocks of this
// launch (read past L1), this block's shared memory, or the shared memory of the cluster's
// blocks (partial k in block k, at the same offset).
enum { PART_GLOBAL = 0, PART_SHARED = 1, PART_CLUSTER = 2 };
// Float `off` of partial k: partials [k][G][PS] from src, or (PART_CLUSTER) [G][PS] in block k.
template <int SRC>
DEVI float ld_part(const float* src, int k, long long stride, int off) {
  if constexpr (SRC == PART_CLUSTER) return ld_cluster(src + off, k);
  else if constexpr (SRC == PART_SHARED) return src[k * stride + off];
  else return __ldcg(src + k * stride + off);
}
template <int SRC>
DEVI float4 ld_part4(const float* src, int k, long long stride, int off) {
  if constexpr (SRC == PART_CLUSTER) return ld_cluster4(src + off, k);
  else if constexpr (SRC == PART_SHARED)
    return *reinterpret_cast<const float4*>(src + k * stride + off);
  else return __ldcg(reinterpret_cast<const float4*>(src + k * stride + off));
}

// n <= 32 partials of one (row, KV head), src[k] = [G][D + 4] floats (sums relative to the max
// at D, the denominator at D + 1; where SRC says), merged in order k = 0, 1, ...: into the partial dst (global memory), or when
// `final` into the output rows out[(orow + j) * D + d], with head h0 + j's sink. Every thread
// of the block calls it; wsh [G][32] weights, msh / lsh [G] in shared memory.
template <int SRC, typename S, int D, int G, int W>
DEVI void decode_merge(const float* src, int n, bool final, float* dst, S* out, long long orow,
                       const S* sinks, int sink_mode, int h0, float* wsh, float* msh,
                       float* lsh) {
  constexpr int PS = D + 4, T = 32 * W, D4 = D / 4;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  for (int j = warp; j < G; j += W) {
    float sink = neg_inf();
    if (final && sink_mode) sink = sink_mode == 1 ? ld(sinks, h0 + j) : 0.f;
    const long long stride = (long long)G * PS;
    float mk = neg_inf(), lk = 0.f;
    if (lane < n) {
      mk = ld_part<SRC>(src, lane, stride, j * PS + D);
      lk = ld_part<SRC>(src, lane, stride, j * PS + D + 1);
    }
    const float mx = warp_max(fmaxf(mk, sink));
    const float w = mk == neg_inf() ? 0.f : expf(mk - mx);
    float den = warp_sum(w * lk);
    if (sink_mode && final && mx != neg_inf()) den += expf(sink - mx);
    wsh[j * 32 + lane] = w;
    if (lane == 0) {
      msh[j] = mx;
      lsh[j] = den;
    }
  }
  __syncthreads();
  for (int e = tid; e < G * D4; e += T) {
    const int j = e / D4, d = (e % D4) * 4;
    float o[4] = {0.f, 0.f, 0.f, 0.f};
    for (int k0 = 0; k0 < n; k0 += 8) {
      float4 x[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        x[u] = k0 + u < n ? ld_part4<SRC>(src, k0 + u, (long long)G * PS, j * PS + d)
                          : make_float4(0.f, 0.f, 0.f, 0.f);
      }
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        if (k0 + u < n) {
          const float w = wsh[j * 32 + k0 + u];
          o[0] += w * x[u].x;
          o[1] += w * x[u].y;
          o[2] += w * x[u].z;
          o[3] += w * x[u].w;
        }
      }
    }
    if (final) {
      const float den = lsh[j];
#pragma unroll
      for (int c = 0; c < 4; ++c) st(out, (orow + j) * D + d + c, den > 0.f ? o[c] / den : 0.f);
    } else {
      *reinterpret_cast<float4*>(dst + (long long)j * PS + d) = make_float4(o[0], o[1], o[2], o[3]);
      if (d == 0) {
        dst[(long long)j * PS + D] = msh[j];
        dst[(long long)j * PS + D + 1] = lsh[j];
      }
    }
  }
}

#define DECODE_PARAMS                                                                         \
  const S *__restrict__ q, long long q_row, const S *__restrict__ k_new, long long k_row,     \
      const S *__restrict__ v_new, long long v_row, S *__restrict__ kc, S *__restrict__ vc,   \
      const int *__restrict__ seqlens, const C *__restrict__ cos_c,                           \
      const C *__restrict__ sin_c, int max_pos, const S *__restrict__ sinks,                  \
      S *__restrict__ out, float *__restrict__ part, float *__restrict__ part2,               \
      int *__restrict__ counters, int S_len, int H, int kvh, int cap, int rot,                \
      int interleaved, int rotary, float scale, float softcap, int window, int causal,        \
      int splits, int min_chunk, int sink_mode, int wcache, int groups_max
#define DECODE_ARGS                                                                           \
  q, q_row, k_new, k_row, v_new, v_row, kc, vc, seqlens, cos_c, sin_c, max_pos, sinks, out,   \
      part, part2, counters, S_len, H, kvh, cap, rot, interleaved, rotary, scale, softcap,    \
      window, causal, splits, min_chunk, sink_mode, wcache, groups_max

// grid (splits, kvh, B * S); block 32 * W threads. part: per (row, KV head, split) a partial
// [G][D + 4] floats; part2: per (row, KV head, group) one; counters: groups_max per (row, KV
// head) for the groups, then one per (row, KV head); zero at entry and left zero.
// Lengths as in gqa_attn: total = seqlens[b] + 1, n_new = min(total, S), past = total - n_new,
// row i at position past + i (cache row base + i: base = past, or a window-sized cache's kept
// rows).
// HG head groups (block 32 * W * HG threads): warp w + W * hg walks the tiles of logical warp
// w for the group's heads [hg * GH, (hg + 1) * GH) only (GH = ceil(G / HG); padding heads past
// G are computed from zero queries and dropped), so each head's arithmetic, tiles and merge
// order are those of HG = 1: the same bits, with less serial work per warp where few blocks
// run (one row).
// CL (cluster launch, sm_90+): the splits (CL of them) of one (row, KV head) form a cluster;
// each block leaves its partial in its own shared memory and block 0 merges the n_act of
// them through distributed shared memory, in the order and with the arithmetic of a lone
// merge group (so the same bits as the launch of CL splits without clusters); part, part2
// and counters are unused.
template <typename S, typename C, int D, int G, int W, int HG, int CL>
DEVI void decode_body(DECODE_PARAMS) {
  using SH = DecodeShape<S, D>;
  constexpr int WT = W * HG, T = 32 * WT;  // warps and threads of the block
  constexpr int LK = SH::LK, TK = SH::TK, QP = SH::QP, V = SH::V, FS = SH::FS;
  constexpr int PS = D + 4, QE = (G * D + T - 1) / T, GH = (G + HG - 1) / HG, GP = GH * HG;
  extern __shared__ __align__(16) unsigned char smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int lw = warp % W, j0 = (warp / W) * GH;  // logical warp, first head of its group
  const int split = blockIdx.x, g = blockIdx.y, bi = blockIdx.z;
  const int b = bi / S_len, i = bi % S_len;
  const int total = seqlens[b] + 1;
  // The group's query heads do not depend on the length: their loads overlap the length's.
  const S* qx = q + (long long)bi * q_row + (long long)g * G * D;
  float qv[QE], qp[QE];
#pragma unroll
  for (int u = 0; u < QE; ++u) {
    const int e = tid + u * T, d = e % D;
    qv[u] = qp[u] = 0.f;
    if (e < G * D) {
      qv[u] = ld(qx, e);
      if (rotary && d < rot) qp[u] = ld(qx, e - d + rope_partner(d, rot, interleaved));
    }
  }
  const int n_new = min(max(total, 0), S_len);
  const int past = total - n_new;
  const int pos = past + i;
  const int base = wcache ? window_rows(past, cap, window) : past;
  const int row = base + i;
  const int t = wcache ? base + n_new : min(total, cap);
  const int hi = causal ? min(row, t - 1) : t - 1;
  const int lo = (causal && window > 0) ? max(0, row - window + 1) : 0;
  const int n_vis = max(hi - lo + 1, 0);
  const int chunk = max((n_vis + splits - 1) / splits, min_chunk);
  const int n_act = (n_vis + chunk - 1) / chunk;
  const int half = rot >> 1;
  const long long orow = (long long)bi * H + (long long)g * G;  // the group's first head

  if (!wcache && split == 0 && i < n_new && pos >= 0 && pos < cap) {
    const S* kx = k_new + (long long)bi * k_row + (long long)g * D;
    const S* vx = v_new + (long long)bi * v_row + (long long)g * D;
    const long long dst = (((long long)b * kvh + g) * cap + pos) * D;
    store_kv_row(kc + dst, vc + dst, kx, vx, D, pos, max_pos, rotary, rot, interleaved, cos_c,
                 sin_c, tid, T);
  }
  if (!wcache && total > cap) {
    // A length past the cache, which the host could not check: NaN, never attention over a
    // clamped window (and no key written past the buffer, above).
    if (split == 0)
      for (int e = tid; e < G * D; e += T) st(out, orow * D + e, __int_as_float(0x7fc00000));
    return;
  }
  if (n_act == 0) {  // no visible key (a bad length): zeros, never garbage
    if (split == 0)
      for (int e = tid; e < G * D; e += T) st(out, orow * D + e, 0.f);
    return;
  }
  if (split >= n_act) {
    if constexpr (CL > 0) {
      if (n_act > 1) {  // block 0 merges the others' partials from their shared memory
        cluster_sync();
        cluster_sync();
      }
    }
    return;
  }
  const int k_begin = lo + split * chunk;
  const int k_end = min(k_begin + chunk, hi + 1);

  // Shared memory: new K / V rows [S_len][D] and the query heads [GP][LK][QP]; after the tiles
  // the warps' partials [W][G][PS] over them; then the merge weights and a flag; with CL, the
  // block's partial [G][PS] (16-byte aligned) after them.
  const int stage_b = 2 * S_len * D * (int)sizeof(S);
  const int main_b = max(stage_b + GP * LK * QP * 4, W * G * PS * 4);
  S* kn = reinterpret_cast<S*>(smem);
  S* vn = kn + (long long)S_len * D;
  float* q_sh = reinterpret_cast<float*>(smem + stage_b);
  float* wp = reinterpret_cast<float*>(smem);
  float* wsh = reinterpret_cast<float*>(smem + main_b);  // [G][32]
  float* msh = wsh + G * 32;
  float* lsh = msh + G;
  int* flag = reinterpret_cast<int*>(lsh + G);
  float* mine = reinterpret_cast<float*>(
      smem + ((main_b + (G * 32 + 2 * G + 1) * 4 + 15) & ~15));

  const int p = clampi(pos, 0, max_pos - 1);
#pragma unroll
  for (int u = 0; u < QE; ++u) {
    const int e = tid + u * T;
    if (e < G * D) {
      const int j = e / D, d = e % D;
      const float v = (rotary && d < rot)
                          ? rope_mix(qv[u], qp[u], d, rot, interleaved, cos_c + (long long)p * half,
                                     sin_c + (long long)p * half)
                          : qv[u];
      q_sh[(j * LK + d / (D / LK)) * QP + d % (D / LK)] = v * scale;
    }
  }
  if constexpr (GP > G) {  // padding heads score zero queries (their results are dropped)
    for (int e = tid; e < (GP - G) * LK * QP; e += T) q_sh[G * LK * QP + e] = 0.f;
  }
  const int k_mid = max(k_begin, min(base, k_end));  // cache rows | new rows
  if (k_mid < k_end) {  // new rows j0..: rows base + j, positions past + j, into shared memory
    stage_new_rows(kn, vn, k_new, v_new, (long long)b * S_len, k_row, v_row, (long long)g * D,
                   k_mid - base, (k_end - k_mid) * D, D, past, max_pos, rotary, rot, interleaved,
                   cos_c, sin_c, tid, T);
  }
  __syncthreads();

  const S* K = kc + ((long long)b * kvh + g) * cap * D;
  const S* Vc = vc + ((long long)b * kvh + g) * cap * D;
  float m[GH], l[GH], acc[GH][V];
#pragma unroll
  for (int j = 0; j < GH; ++j) {
    m[j] = neg_inf();
    l[j] = 0.f;
#pragma unroll
    for (int v = 0; v < V; ++v) acc[j][v] = 0.f;
  }
  const float* qg = q_sh + j0 * LK * QP;  // this warp's heads
  for (int k0 = k_begin + lw * TK; k0 < k_end; k0 += W * TK) {
    if (k0 + TK <= base)
      decode_tile<S, D, GH, false>(qg, K, Vc, kn, vn, base, k0, k_end, softcap, lane, m, l, acc);
    else
      decode_tile<S, D, GH, true>(qg, K, Vc, kn, vn, base, k0, k_end, softcap, lane, m, l, acc);
  }
  // The warp's partial: denominators over the lanes, value sums over the lanes of a feature.
#pragma unroll
  for (int j = 0; j < GH; ++j) {
    l[j] = warp_sum(l[j]);
#pragma unroll
    for (int v = 0; v < V; ++v)
#pragma unroll
      for (int o = FS; o < 32; o <<= 1) acc[j][v] += __shfl_xor_sync(0xffffffffu, acc[j][v], o);
  }
  __syncthreads();  // every warp is done with the query heads and new rows: wp goes over them
  if (lane < FS) {
#pragma unroll
    for (int j = 0; j < GH; ++j) {
      if (j0 + j >= G) break;
      float* dst = wp + (lw * G + j0 + j) * PS + lane * V;
#pragma unroll
      for (int c = 0; c < V; c += 4)
        *reinterpret_cast<float4*>(dst + c) =
            make_float4(acc[j][c], acc[j][c + 1], acc[j][c + 2], acc[j][c + 3]);
    }
  }
  if (lane == 0) {
#pragma unroll
    for (int j = 0; j < GH; ++j) {
      if (j0 + j >= G) break;
      wp[(lw * G + j0 + j) * PS + D] = m[j];
      wp[(lw * G + j0 + j) * PS + D + 1] = l[j];
    }
  }
  __syncthreads();
  const int h0 = g * G;
  const long long pair = (long long)bi * kvh + g;
  if (n_act == 1) {
    decode_merge<PART_SHARED, S, D, G, WT>(wp, W, true, nullptr, out, orow, sinks, sink_mode, h0,
                                          wsh, msh, lsh);
    return;
  }
  if constexpr (CL > 0) {
    decode_merge<PART_SHARED, S, D, G, WT>(wp, W, false, mine, out, orow, sinks, sink_mode, h0,
                                          wsh, msh, lsh);
    cluster_sync();
    if (split == 0)
      decode_merge<PART_CLUSTER, S, D, G, WT>(mine, n_act, true, nullptr, out, orow, sinks,
                                             sink_mode, h0, wsh, msh, lsh);
    cluster_sync();  // every block's partial stays until block 0 has read it
    return;
  }
  decode_merge<PART_SHARED, S, D, G, WT>(wp, W, false, part + (pair * splits + split) * G * PS,
                                        out, orow, sinks, sink_mode, h0, wsh, msh, lsh);
  __threadfence();
  __syncthreads();
  const int grp = split / GD_MERGE_GROUP;
  const int members = min(GD_MERGE_GROUP, n_act - grp * GD_MERGE_GROUP);
  const int n_groups = (n_act + GD_MERGE_GROUP - 1) / GD_MERGE_GROUP;
  if (tid == 0) {
    int* c = counters + pair * groups_max + grp;
    const int last = atomicAdd(c, 1) == members - 1;
    if (last) *c = 0;  // every member has counted: ready for the next launch
    *flag = last;
  }
  __syncthreads();
  if (!*flag) return;
  __threadfence();
  const float* first = part + (pair * splits + grp * GD_MERGE_GROUP) * G * PS;
  if (n_groups == 1) {
    decode_merge<PART_GLOBAL, S, D, G, WT>(first, members, true, nullptr, out, orow, sinks,
                                          sink_mode, h0, wsh, msh, lsh);
    return;
  }
  float* gpart = part2 + pair * groups_max * G * PS;
  decode_merge<PART_GLOBAL, S, D, G, WT>(first, members, false, gpart + (long long)grp * G * PS,
                                        out, orow, sinks, sink_mode, h0, wsh, msh, lsh);
  __threadfence();
  __syncthreads();
  if (tid == 0) {
    int* c = counters + (long long)gridDim.z * kvh * groups_max + pair;
    const int last = atomicAdd(c, 1) == n_groups - 1;
    if (last) *c = 0;
    *flag = last;
  }
  __syncthreads();
  if (!*flag) return;
  __threadfence();
  decode_merge<PART_GLOBAL, S, D, G, WT>(gpart, n_groups, true, nullptr, out, orow, sinks,
                                        sink_mode, h0, wsh, msh, lsh);
}

template <typename S, typename C, int D, int G, int W, int HG, int MB>
__global__ void __launch_bounds__(32 * W * HG, MB) gqa_decode(DECODE_PARAMS) {
  GRID_WAIT();
  GRID_EARLY_LAUNCH();
  decode_body<S, C, D, G, W, HG, 0>(DECODE_ARGS);
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// grid (GD_CLUSTER, kvh, B * S) in clusters of the splits of one (row, KV head).
template <typename S, typename C, int D, int G, int W, int HG, int MB>
__global__ void __cluster_dims__(GD_CLUSTER, 1, 1) __launch_bounds__(32 * W * HG, MB)
    gqa_decode_cluster(DECODE_PARAMS) {
  GRID_WAIT();
  GRID_EARLY_LAUNCH();
  decode_body<S, C, D, G, W, HG, GD_CLUSTER>(DECODE_ARGS);
}
#endif
"""
)


def decode_template_args(s_type: str, c_type: str, head_size: int, group: int, hg: int = 1) -> str:
    """The template arguments of the ``gqa_decode`` instance for the activation and rotary
    cache storage types, a head size, a group size and its head groups ``hg`` (blocks of
    more than one group ask for one block per SM: up to 128 registers a thread)."""
    per_sm = DECODE_BLOCKS_PER_SM if hg == 1 else 1
    return f"{s_type}, {c_type}, {head_size}, {group}, {DECODE_WARPS}, {hg}, {per_sm}"


def decode_shared_bytes(
    new: int,
    head_size: int,
    itemsize: int,
    group: int,
    cluster: bool = False,
    hg: int = 1,
) -> int:
    """Dynamic shared memory of one block (the kernel's layout): the new rows and the query
    heads (padded to a multiple of the head groups ``hg``), or the warps' partials over them; then
    the merge weights and the flag; in a cluster launch, the block's partial after them
    (16-byte aligned)."""
    shape = DecodeShape(head_size, itemsize)
    stage = 2 * new * head_size * itemsize
    padded = -(-group // hg) * hg
    query = padded * shape.lanes_per_key * (head_size // shape.lanes_per_key + 4) * 4
    warps = DECODE_WARPS * group * (head_size + 4) * 4
    size = max(stage + query, warps) + (group * 32 + 2 * group + 1) * 4
    if cluster:
        size = -(-size // 16) * 16 + group * (head_size + 4) * 4
    return size


def decode_call_problem(call: _GqaCall) -> str | None:
    """Why ``gqa_decode`` cannot take a decode / verify call, or None."""
    reason = decode_problem(call.head_size, call.dtype.itemsize, call.heads // call.kv_heads)
    if reason is None and (call.past_key.data.ptr % 16 or call.past_value.data.ptr % 16):
        reason = "grouped decode needs 16-byte aligned KV caches"
    return reason


def decode_split_count(call: _GqaCall, fixed: int = 0) -> int:
    """The launch's splits per (KV head, row): ``fixed`` when positive (at most
    MAX_DECODE_SPLITS), else ``decode_splits`` for this GPU."""
    if fixed > 0:
        return min(fixed, MAX_DECODE_SPLITS)
    shape = DecodeShape(call.head_size, call.dtype.itemsize)
    rows = call.batch * call.new * call.kv_heads
    keys = most_keys(call.cap, call.new, call.window, bool(call.causal), bool(call.wcache))
    return decode_splits(rows, keys, sm_count(), shape.min_chunk)


def call_same_cut_splits(call: _GqaCall, splits: int) -> int:
    """``same_cut_splits`` for a decode / verify call: the fewest splits of its launch that
    give every length the chunks of ``splits`` splits (the same bits)."""
    min_chunk = DecodeShape(call.head_size, call.dtype.itemsize).min_chunk
    keys = most_keys(call.cap, call.new, call.window, bool(call.causal), bool(call.wcache))
    return same_cut_splits(keys, splits, min_chunk)


def decode_attend(
    ctx: KernelContext, call: _GqaCall, y: cupy.ndarray, splits: int, cluster: bool = False
) -> None:
    """Launch ``gqa_decode`` for a decode / verify call (``decode_call_problem`` must be None)
    over ``splits`` splits; it appends the new keys and values itself. ``cluster`` (sm_90+):
    ``gqa_decode_cluster``, CLUSTER_SPLITS splits merged through distributed shared memory
    (``splits`` is ignored), the same bits as ``gqa_decode`` over CLUSTER_SPLITS splits."""
    d, group = call.head_size, call.heads // call.kv_heads
    rows = call.batch * call.new * call.kv_heads
    if cluster:
        splits = CLUSTER_SPLITS
    groups_max = -(-splits // MERGE_GROUP)
    part = part2 = y  # placeholders: a lone split or a cluster writes the output
    counters = call.seqlens
    if splits > 1 and not cluster:
        floats = group * (d + 4)
        buf = scratch(ctx, rows * (splits + groups_max) * floats * 4).view(np.float32)
        part, part2 = buf[: rows * splits * floats], buf[rows * splits * floats :]
        counters = zeroed_counters(ctx, rows * (groups_max + 1))
    name = "gqa_decode_cluster" if cluster else "gqa_decode"
    forced = int(ctx.option("attention_decode_head_groups", DECODE_HEAD_GROUPS))
    hg = head_groups(group, splits * rows, sm_count(), forced)
    args = decode_template_args(call.s_type, call.c_type, d, group, hg)
    kernel = function(_SOURCE, f"{name}<{args}>")
    kernel(
        (splits, call.kv_heads, call.batch * call.new),
        (32 * DECODE_WARPS * hg,),
        (
            call.query,
            np.int64(call.q_row),
            call.k_src,
            np.int64(call.k_row),
            call.v_src,
            np.int64(call.v_row),
            call.past_key,
            call.past_value,
            call.seqlens,
            call.cos,
            call.sin,
            np.int32(call.max_pos),
            call.sinks,
            y,
            part,
            part2,
            counters,
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
            np.int32(splits),
            np.int32(DecodeShape(d, call.dtype.itemsize).min_chunk),
            np.int32(call.sink_mode),
            np.int32(call.wcache),
            np.int32(groups_max),
        ),
        shared_mem=decode_shared_bytes(call.new, d, call.dtype.itemsize, group, cluster, hg),
    )
