"""CUDA kernels: com.microsoft GroupQueryAttention and RotaryEmbedding.

GroupQueryAttention runs on a shared past/present KV cache ``[B, kv_heads, capacity, D]``:
the new keys (rotated) and values are written in place at positions
``[past, past + S)`` and the past buffers themselves are returned as the present outputs.
Every length comes from ``seqlens_k`` *in device memory* (``total = seqlens_k[b] + 1``,
``past = total - S``), read inside the kernels, so one captured graph stays valid while the
cache grows. ``total_sequence_length`` is checked against the cache's capacity when its
value is known on the host (a host array or a host-shadowed constant). When it is not (the
engine keeps it on the device), a length past the capacity is caught on the device: the
attention writes NaN rows, which the engine's non-finite probe turns into an error, and no
key is written past the buffer. (Reading the length back on every eager run instead cost a
host sync per layer, which nearly doubled the prefill: docs/performance.md.)

One launch per call for up to ``FUSE_MAX_NEW`` new tokens (decode, verify: the steps that
are captured), two for longer prompts; all capturable (no cuBLAS, no allocation, no host
sync). The attention kernel has one block per (split, query head, batch x query row):

* The query row is loaded before the length is known, then rotated and scaled into shared
  memory. With up to ``FUSE_MAX_NEW`` new tokens the new keys are rotated there too (read
  from the input, rounded to the cache type) and the blocks of split 0 of each group's
  first head write their own row into the cache; no block reads cache rows at or past
  ``past``, so the append needs no launch of its own. Longer prompts run ``gqa_append``
  first and read every key from the cache.
* Each warp keeps an online softmax over its keys (no block barrier per tile); the warps
  merge at the end.
* A split takes ``max(ceil(visible / splits), min_chunk)`` keys, computed from the
  device-side length, so the grid, sized once, serves every length of a captured graph:
  a short sequence has one split with work, a long one spreads over all of them.
* Merging the splits: decode / verify on sm_90+ (``gqa_attn_cluster``) uses 8 splits that
  form a thread-block cluster; each block publishes its partial in shared memory and block
  0 merges them through distributed shared memory after a cluster barrier (no global
  round trip). Otherwise (``gqa_attn``: prompts, older GPUs) up to 64 splits: a lone split
  writes the output directly, else the last split to finish (an atomic counter per row,
  which it sets back to zero) merges the partials from global memory. Both merge in a
  fixed order (deterministic).

Decode / verify on sm_90+ over a cache of at most the provider's ``attention_cluster_max_keys``
positions runs, with the provider's ``attention_grouped_cluster`` on (the default), the
grouped decode kernel's cluster launch instead of ``gqa_attn_cluster`` (``_gqa_decode``: one 8-block cluster per KV head and
row, each key read once for the group's query heads; the same arithmetic at any batch size).
Over a longer cache, or (with that option off) with more query rows (a batch's rows times new
tokens) than its ``attention_cluster_max_rows``, decode / verify run the grouped decode
kernel's plain launch (one block per split, KV head and row, splits sized from the capacity
and the SM count, merged in two fixed-order levels). Calls it has no instance for (more than
8 query heads per KV head, rows that are not 16 x 2^k bytes) keep ``gqa_attn_cluster`` or the
many-split ``gqa_attn``, as do long caches with the provider's ``attention_grouped_decode``
off.

Concat mode (a past shorter than the total, or no past at all) is refused.

``sliding_window_cache=1`` (a window-sized cache, onnxruntime's layout: see
``core.op_rules.windowed_cache_length``): the cached tokens sit at rows ``[0, L(past))`` and
the new ones follow. With up to ``FUSE_MAX_NEW`` new tokens the attention kernel reads the
new keys from the inputs only, and ``gqa_window_store`` then compacts the cache and stores
them (lengths read on the device: capturable). Longer prompts append first and must fit the
cache; one that would overflow it is refused when the host knows ``total_sequence_length``,
else its output rows are NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import cupy
import numpy as np

from onnx_genrt.core.kernels import MS_DOMAIN, KernelContext, NodeInfo
from onnx_genrt.core.op_rules import (
    gqa_attribute_problem,
    gqa_input_problem,
    gqa_shapes,
    rotary_layout,
    rotary_problem,
    windowed_cache_length,
)

from ..attention_gemm import attend_rows, rotate_rows
from ..grouped_decode import CLUSTER_SPLITS
from ._common import (
    DEVICE_COMMON,
    F16,
    F32,
    capturing,
    contiguous,
    function,
    out,
    refuse_in_capture,
    scratch,
    sm_count,
    storage,
)
from ._flash import flash_attend, flash_attention_problem
from ._gqa_decode import (
    call_same_cut_splits,
    decode_attend,
    decode_call_problem,
    decode_split_count,
)
from ._gqa_device import GQA_DEVICE
from ._registry import REGISTRY
from .reduce import zeroed_counters

#: Warps of the attention block (each scores 32 keys at a time).
ATTN_WARPS = 4
#: Blocks per SM the attention kernel's registers must allow (launch bounds).
ATTN_MIN_BLOCKS = 8
#: Fewest keys a split takes before fewer splits are used.
MIN_CHUNK = 128
#: Most splits of one query row's keys (the merge reads them in one warp: at most 64).
MAX_SPLITS = 64
#: Shared memory the merging block stages the splits' partial sums in.
STAGE_BYTES = 16 << 10
#: Most new tokens whose keys gqa_attn appends itself (no gqa_append launch).
FUSE_MAX_NEW = 16
#: Default of the CUDA provider's ``attention_gemm_min_rows``: new rows (a prompt) from which
#: GroupQueryAttention runs as matrix products on eager runs (``providers/cuda/attention_gemm``).
ATTENTION_GEMM_MIN_ROWS = 512
#: Default of the CUDA provider's ``attention_flash_min_rows``: new rows (a prompt of more than
#: FUSE_MAX_NEW) from which fp16/bf16 GroupQueryAttention runs the tensor-core flash kernel
#: (``_flash``). One full query tile: shorter prompts after a long past have too few blocks
#: (one per head and 64 rows) and are left to ``gqa_attn``'s key splits.
ATTENTION_FLASH_MIN_ROWS = 64
#: Decode / verify (up to FUSE_MAX_NEW new tokens) on sm_90+: the 8 splits of a (row, head)
#: form a thread-block cluster and merge through distributed shared memory (no counter, no
#: global round trips); False: the many-split kernel with a last-block-done merge.
CLUSTER = True
#: Fewest keys a split of the cluster kernel takes.
CLUSTER_MIN_CHUNK = 64
#: Default of the CUDA provider's ``attention_cluster_max_keys``: the KV capacity up to which
#: decode / verify use the 8-split cluster kernel (0: any capacity). Above it the grouped
#: decode kernel (or, where it has no instance, the many-split kernel) spreads a long cache
#: over many blocks per row: with 8 splits, each block of a 30000-token cache walks 3750 keys
#: one after another. On the H200 (0.5B shape, 32768-position cache, docs/performance.md
#: 2026-12-04) the many-split kernel decoded 1150 / 893 / 647 tok/s after 256 / 8192 / 30000
#: tokens against the cluster's 1191 / 735 / 351; a 4096-position cache keeps the cluster.
ATTENTION_CLUSTER_MAX_KEYS = 4096
#: Default of the CUDA provider's ``attention_cluster_max_rows``: query rows (batch x new
#: tokens) up to which decode / verify keep the cluster kernel on a short cache (0: any). It
#: launches 8 blocks per query row and head, so its cost grows with the rows (H100, 0.5B
#: shape, 96 cached positions, us per layer: 10.8 / 12.4 / 20.5 / 36.3 at 1 / 8 / 16 / 32
#: rows) while the grouped decode kernel's stays near 15.6: with 8, 32 streams decode 19.5k
#: instead of 14.9k tok/s (docs/performance.md, 2026-12-05). Off by default: the two kernels
#: round differently, so a row's tokens would depend on how many rows share its step (a
#: batched row against the prompt alone, a verify step of more than 8 tokens against plain
#: decoding), and greedy batching and speculation promise the same tokens.
ATTENTION_CLUSTER_MAX_ROWS = 0
#: Default of the CUDA provider's ``attention_grouped_cluster``: decode / verify on a short
#: cache (sm_90+) run the grouped decode kernel as one 8-block cluster per (KV head, row)
#: (``gqa_decode_cluster``: each key read once for the group's query heads, 7x fewer blocks than
#: ``gqa_attn_cluster`` on the 0.5B shape), the same arithmetic at every batch size. On the
#: H200 (0.5B fp16, docs/performance.md, session 26), with two sets of warps sharing a group's
#: heads at one row (``attention_decode_head_groups``), 1 stream 1221.6 against the per-head
#: kernel's 1202.3 tok/s and 32 streams 19749.5 against 15085.8, the same tokens.
ATTENTION_GROUPED_CLUSTER = True
#: Default of the CUDA provider's ``attention_grouped_cluster_max_rows``: query rows up to
#: which that cluster launch is used (0: any). Above, ``gqa_decode`` runs over the fewest
#: splits that cut every length's keys as the cluster's 8 splits do (``same_cut_splits``):
#: the same bits with fewer blocks (a short cache leaves most of a cluster's 8 blocks idle,
#: holding their SM slots until the cluster's merge; at 32 rows its attention grew from 15
#: to 33 us a layer between 32 and 160 cached positions). H100, 0.5B, 128 tokens, one call
#: (docs/performance.md, session 29): 32 streams int4 23093.5 -> 26292.1 tok/s, fp16
#: 20886.2 -> 24395.8; 1 and 4 streams even (2 gave 4 streams no gain).
ATTENTION_GROUPED_CLUSTER_MAX_ROWS = 8
#: Decode / verify over a cache longer than ``attention_cluster_max_keys``: the grouped decode
#: kernel (``_gqa_decode``) where it has an instance; False: the many-split ``gqa_attn`` (for
#: measurement; the provider's ``attention_grouped_decode`` turns it off per provider).
GROUPED_DECODE = True
#: Dynamic shared memory a block may take without opting in.
_SHARED_MAX = 48 << 10

_SOURCE = (
    DEVICE_COMMON
    + GQA_DEVICE
    + r"""
// New keys (rotated) and values into the cache at their absolute positions.
// grid (B * S, kvh); k_new / v_new rows of k_row / v_row elements, head h at h * D.
template <typename S, typename C>
__global__ void gqa_append(const S* __restrict__ k_new, long long k_row,
                           const S* __restrict__ v_new, long long v_row,
                           S* __restrict__ kc, S* __restrict__ vc, const int* __restrict__ seqlens,
                           const C* __restrict__ cos_c, const C* __restrict__ sin_c, int max_pos,
                           int S_len, int kvh, int D, int cap, int rot, int interleaved,
                           int rotary, int window, int wcache) {
  GRID_WAIT();
  GRID_LAUNCH_DEPENDENTS();
  const int b = blockIdx.x / S_len, i = blockIdx.x % S_len, h = blockIdx.y;
  const int total = seqlens[b] + 1;
  const int n_new = min(max(total, 0), S_len);
  if (i >= n_new) return;
  const int pos = total - n_new + i;
  // A window-sized cache holds the recent tokens from row 0 (gqa_attn refuses an overflow).
  const int at = wcache ? window_rows(total - n_new, cap, window) + i : pos;
  if (pos < 0 || at < 0 || at >= cap) return;  // a bad length must never write out of bounds
  const long long row = (long long)b * S_len + i;
  const S* kx = k_new + row * k_row + (long long)h * D;
  const S* vx = v_new + row * v_row + (long long)h * D;
  const long long dst = (((long long)b * kvh + h) * cap + at) * D;
  store_kv_row(kc + dst, vc + dst, kx, vx, D, pos, max_pos, rotary, rot, interleaved, cos_c, sin_c,
               (int)threadIdx.x, (int)blockDim.x);
}

DEVI float dot4(const float* q, float4 v) {
  return q[0] * v.x + q[1] * v.y + q[2] * v.z + q[3] * v.w;
}
// q . the eight 16-bit values of S (half_t or bf16_t; k only picks the type) in v.
template <typename S>
DEVI float dot8(const float* q, uint4 v, const S* k) {
  const unsigned int w[4] = {v.x, v.y, v.z, v.w};
  float s = 0.f;
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    float a, b;
    unpack2(k, w[u], a, b);
    s += q[2 * u] * a + q[2 * u + 1] * b;
  }
  return s;
}

// q . k over D; vec: k rows are 16-byte aligned. Four vector loads are issued per batch.
DEVI float dot_row(const float* q, const float* k, int D, int vec) {
  float s = 0.f;
  if (vec) {
    const float4* k4 = reinterpret_cast<const float4*>(k);
    const int n = D >> 2;
    int j = 0;
    for (; j + 4 <= n; j += 4) {
      float4 v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) v[u] = k4[j + u];
#pragma unroll
      for (int u = 0; u < 4; ++u) s += dot4(q + 4 * (j + u), v[u]);
    }
    for (; j < n; ++j) s += dot4(q + 4 * j, k4[j]);
  } else {
    for (int j = 0; j < D; ++j) s += q[j] * k[j];
  }
  return s;
}
template <typename S>  // half_t or bf16_t
DEVI float dot_row(const float* q, const S* k, int D, int vec) {
  float s = 0.f;
  if (vec) {
    const uint4* k8 = reinterpret_cast<const uint4*>(k);
    const int n = D >> 3;
    int j = 0;
    for (; j + 4 <= n; j += 4) {
      uint4 v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) v[u] = k8[j + u];
#pragma unroll
      for (int u = 0; u < 4; ++u) s += dot8(q + 8 * (j + u), v[u], k);
    }
    for (; j < n; ++j) s += dot8(q + 8 * j, k8[j], k);
  } else {
    for (int j = 0; j < D; ++j) s += q[j] * ld(k, j);
  }
  return s;
}

// Two consecutive elements at even index i (vec: one 8- or 4-byte load).
DEVI void ld2(const float* p, long long i, int vec, float& a, float& b) {
  if (vec) {
    const float2 v = *reinterpret_cast<const float2*>(p + i);
    a = v.x;
    b = v.y;
  } else {
    a = p[i];
    b = p[i + 1];
  }
}
template <typename S>  // half_t or bf16_t
DEVI void ld2(const S* p, long long i, int vec, float& a, float& b) {
  if (vec) {
    unpack2(p, *reinterpret_cast<const unsigned int*>(p + i), a, b);
  } else {
    a = ld(p, i);
    b = ld(p, i + 1);
  }
}

// Online softmax of one warp over keys [k0, k1) of rows Kb / Vb (row index key - off): each lane
// scores one key of every 32, then the warp adds the weighted value rows, lane l holding
// features 64 c + 2 l, + 1 of acc[c]. RB value rows are loaded before they are used.
template <typename S, int NC, int W>
DEVI void attend(const float* q_sh, const S* Kb, const S* Vb, int off, int k0, int k1, int D,
                 int vec_k, int vec_v, float softcap, int lane, int warp, float& m, float& l,
                 float (&acc)[NC][2]) {
  constexpr int RB = NC == 1 ? 16 : (NC == 2 ? 8 : 4);
  for (int base = k0 + warp * 32; base < k1; base += W * 32) {
    const int key = base + lane;
    float s = neg_inf();
    if (key < k1) {
      s = dot_row(q_sh, Kb + (long long)(key - off) * D, D, vec_k);
      if (softcap > 0.f) s = softcap * tanhf(s / softcap);
    }
    const float m_new = fmaxf(m, warp_max(s));
    const float pr = (key < k1 && m_new != neg_inf()) ? expf(s - m_new) : 0.f;
    const float alpha = (m == neg_inf()) ? 0.f : expf(m - m_new);
    l = l * alpha + warp_sum(pr);
    m = m_new;
#pragma unroll
    for (int c = 0; c < NC; ++c) { acc[c][0] *= alpha; acc[c][1] *= alpha; }
    const int n_t = min(32, k1 - base);
    const S* Vt = Vb + (long long)(base - off) * D + 2 * lane;
    int j = 0;
    for (; j + RB <= n_t; j += RB) {
      float va[RB][NC], vb[RB][NC];
#pragma unroll
      for (int u = 0; u < RB; ++u)
#pragma unroll
        for (int c = 0; c < NC; ++c) {
          va[u][c] = vb[u][c] = 0.f;
          if (64 * c + 2 * lane < D) ld2(Vt, (long long)(j + u) * D + 64 * c, vec_v, va[u][c], vb[u][c]);
        }
#pragma unroll
      for (int u = 0; u < RB; ++u) {
        const float w = __shfl_sync(0xffffffffu, pr, j + u);
#pragma unroll
        for (int c = 0; c < NC; ++c) { acc[c][0] += w * va[u][c]; acc[c][1] += w * vb[u][c]; }
      }
    }
    for (; j < n_t; ++j) {
      const float w = __shfl_sync(0xffffffffu, pr, j);
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        if (64 * c + 2 * lane < D) {
          float va, vb;
          ld2(Vt, (long long)j * D + 64 * c, vec_v, va, vb);
          acc[c][0] += w * va;
          acc[c][1] += w * vb;
        }
      }
    }
  }
}

// Attention of one query row and head over one split of its visible keys; the splits merge
// inside the same launch (see gqa_body). grid (splits, H, B * S); block 32 * W threads;
// NC = ceil(D / 64) feature chunks per lane.
//
// Lengths come from seqlens in device memory: total = seqlens[b] + 1, n_new = min(total, S),
// past = total - n_new, row i at position past + i. A split takes
// chunk = max(ceil(visible / splits), min_chunk) keys, so short sequences use one split
// while long ones spread over all of them; without clusters, splits past the keys return at
// once and a lone split writes the output directly.
//
// fuse = 1 (S <= 16): the new keys (rotated) and values are not in the cache yet. Each block
// reads the ones it needs from k_new / v_new into shared memory (rounded to the cache type,
// as a cache read would give them), and the blocks of split 0 and each group's first head
// write their own row into the cache. No block reads cache rows >= past, so nothing races.
// fuse = 0: gqa_append ran before; every key comes from the cache.
//
// part (no clusters): per (row, head, split) ps floats (ps = D + 2 rounded up to 4): D sums
// relative to the split's max, the max, the denominator. counters: one per (row, head), zero
// at entry and left zero. The merging block stages the partials in shared memory
// (splits * ps floats; with clusters, each block's own partial: ps floats).
#define GQA_PARAMS                                                                           \
  const S *__restrict__ q, long long q_row, const S *__restrict__ k_new, long long k_row,     \
      const S *__restrict__ v_new, long long v_row, S *__restrict__ kc, S *__restrict__ vc,   \
      const int *__restrict__ seqlens, const C *__restrict__ cos_c,                           \
      const C *__restrict__ sin_c, int max_pos, const S *__restrict__ sinks,                  \
      S *__restrict__ out, float *__restrict__ part, int *__restrict__ counters, int S_len,   \
      int H, int kvh, int D, int cap, int rot, int interleaved, int rotary, float scale,      \
      float softcap, int window, int causal, int splits, int min_chunk, int fuse,             \
      int sink_mode, int vec, int wcache
#define GQA_ARGS                                                                             \
  q, q_row, k_new, k_row, v_new, v_row, kc, vc, seqlens, cos_c, sin_c, max_pos, sinks, out,  \
      part, counters, S_len, H, kvh, D, cap, rot, interleaved, rotary, scale, softcap,        \
      window, causal, splits, min_chunk, fuse, sink_mode, vec, wcache

// The body of gqa_attn (CL = 0) and gqa_attn_cluster (CL = cluster size = splits): the
// splits of one (row, head) merge through a last-block-done counter and global memory, or
// (CL > 0) through the cluster's shared memory: every block of the cluster, with keys or
// not, publishes its partial and waits at a cluster barrier; block 0 merges.
template <typename S, typename C, int NC, int W, int CL>
DEVI void gqa_body(GQA_PARAMS) {
  constexpr int T = 32 * W, QE = (256 + T - 1) / T;
  extern __shared__ __align__(16) unsigned char smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int split = blockIdx.x, h = blockIdx.y, bi = blockIdx.z;
  const int b = bi / S_len, i = bi % S_len;
  const int G = H / kvh, g = h / G;
  const int total = seqlens[b] + 1;
  // The query row does not depend on the length: its loads overlap the length's.
  const S* qx = q + (long long)bi * q_row + (long long)h * D;
  float qv[QE], qp[QE];
#pragma unroll
  for (int u = 0; u < QE; ++u) {
    const int d = tid + u * T;
    qv[u] = qp[u] = 0.f;
    if (d < D) {
      qv[u] = ld(qx, d);
      if (rotary && d < rot) qp[u] = ld(qx, rope_partner(d, rot, interleaved));
    }
  }
  const int n_new = min(max(total, 0), S_len);
  const int past = total - n_new;
  const int pos = past + i;
  // Keys by cache row: position p sits at row p, or with a window-sized cache (wcache) the
  // `base` cached tokens sit at rows [0, base) and the new ones follow (rows base + j, read
  // from k_new / v_new: they may not fit before gqa_window_store compacts). The masks only
  // depend on distances, so rows stand for positions; rotary uses the positions.
  const int base = wcache ? window_rows(past, cap, window) : past;
  const int row = base + i;
  const int t = wcache ? base + n_new : min(total, cap);
  const int hi = causal ? min(row, t - 1) : t - 1;
  const int lo = (causal && window > 0) ? max(0, row - window + 1) : 0;
  const int n_vis = max(hi - lo + 1, 0);
  const int chunk = max((n_vis + splits - 1) / splits, min_chunk);
  const int n_act = (n_vis + chunk - 1) / chunk;
  const int half = rot >> 1;
  const long long orow = (long long)bi * H + h;

  if (fuse && !wcache && split == 0 && h % G == 0 && i < n_new && pos >= 0 && pos < cap) {
    const S* kx = k_new + (long long)bi * k_row + (long long)g * D;
    const S* vx = v_new + (long long)bi * v_row + (long long)g * D;
    const long long dst = (((long long)b * kvh + g) * cap + pos) * D;
    store_kv_row(kc + dst, vc + dst, kx, vx, D, pos, max_pos, rotary, rot, interleaved, cos_c,
                 sin_c, tid, T);
  }
  if (!wcache && total > cap) {
    // A length past the cache, which the host could not check (the length lives in device
    // memory): NaN, never attention over a clamped window. Uniform over a cluster (one row).
    if (split == 0)
      for (int d = tid; d < D; d += T) st(out, orow * D + d, __int_as_float(0x7fc00000));
    return;
  }
  if (CL == 0 && wcache && !fuse && t > cap) {
    // More than FUSE_MAX_NEW new tokens that overflow a window-sized cache: gqa_append could
    // not store them all. NaN, never a silent wrong answer (the host refuses it when it knows
    // total_sequence_length).
    if (split == 0)
      for (int d = tid; d < D; d += T) st(out, orow * D + d, __int_as_float(0x7fc00000));
    return;
  }
  if (CL == 0 && n_act == 0) {  // no visible key (a bad length): zeros, never garbage
    if (split == 0)
      for (int d = tid; d < D; d += T) st(out, orow * D + d, 0.f);
    return;
  }
  if (CL == 0 && split >= n_act) return;
  const bool work = split < n_act;  // always true without clusters
  const int k_begin = lo + split * chunk;
  const int k_end = work ? min(k_begin + chunk, hi + 1) : k_begin;
  const int k_mid = fuse ? max(k_begin, min(base, k_end)) : k_end;  // cache | new rows

  const int nsh = fuse ? S_len : 0;
  const int ps = (D + 5) & ~3;
  S* kn = reinterpret_cast<S*>(smem);
  S* vn = kn + (long long)nsh * D;
  float* q_sh = reinterpret_cast<float*>(smem + ((2 * nsh * D * (int)sizeof(S) + 15) & ~15));
  float* o_sh = q_sh + D;    // [W][D]
  float* wm = o_sh + W * D;  // [W]
  float* wl = wm + W;        // [W]
  float* wsh = wl + W;       // [64] split weights, then the denominator
  int* flag = reinterpret_cast<int*>(wsh + 65);
  const int stage_at = (int)(reinterpret_cast<unsigned char*>(wsh + 68) - smem);
  float* stage = reinterpret_cast<float*>(smem + ((stage_at + 15) & ~15));  // [splits][ps]

  const S* K = kc + ((long long)b * kvh + g) * cap * D;
  const S* V = vc + ((long long)b * kvh + g) * cap * D;
  const int p = clampi(pos, 0, max_pos - 1);
#pragma unroll
  for (int u = 0; u < QE; ++u) {
    const int d = tid + u * T;
    if (d < D) {
      const float v = (rotary && d < rot)
                          ? rope_mix(qv[u], qp[u], d, rot, interleaved, cos_c + (long long)p * half,
                                     sin_c + (long long)p * half)
                          : qv[u];
      q_sh[d] = v * scale;
    }
  }
  if (k_mid < k_end) {  // new rows j0..j1-1 (rows base + j, positions past + j) into smem
    stage_new_rows(kn, vn, k_new, v_new, (long long)b * S_len, k_row, v_row, (long long)g * D,
                   k_mid - base, (k_end - k_mid) * D, D, past, max_pos, rotary, rot, interleaved,
                   cos_c, sin_c, tid, T);
  }
  __syncthreads();

  float m = neg_inf(), l = 0.f, acc[NC][2];
#pragma unroll
  for (int c = 0; c < NC; ++c) acc[c][0] = acc[c][1] = 0.f;
  attend<S, NC, W>(q_sh, K, V, 0, k_begin, k_mid, D, vec, vec, softcap, lane, warp, m, l, acc);
  if (k_mid < k_end)
    attend<S, NC, W>(q_sh, kn, vn, base, k_mid, k_end, D, (D * (int)sizeof(S)) % 16 == 0, 1,
                     softcap, lane, warp, m, l, acc);

  // Merge the warps: max M, denominator L, sums o relative to M.
  if (lane == 0) { wm[warp] = m; wl[warp] = l; }
#pragma unroll
  for (int c = 0; c < NC; ++c) {
    const int d = 64 * c + 2 * lane;
    if (d < D) { o_sh[warp * D + d] = acc[c][0]; o_sh[warp * D + d + 1] = acc[c][1]; }
  }
  __syncthreads();
  float M = neg_inf();
#pragma unroll
  for (int w = 0; w < W; ++w) M = fmaxf(M, wm[w]);
  float sw[W], L = 0.f;
#pragma unroll
  for (int w = 0; w < W; ++w) {
    sw[w] = wm[w] == neg_inf() ? 0.f : expf(wm[w] - M);
    L += wl[w] * sw[w];
  }
  const float sink = sink_mode == 1 ? ld(sinks, h) : (sink_mode == 2 ? 0.f : neg_inf());

  if constexpr (CL > 0) {
    float* mine = stage;  // this block's partial: D sums relative to M, M, L
    for (int d = tid; d < D; d += T) {
      float o = 0.f;
#pragma unroll
      for (int w = 0; w < W; ++w) o += o_sh[w * D + d] * sw[w];
      mine[d] = o;
    }
    if (tid == 0) { mine[D] = M; mine[D + 1] = L; }
    cluster_sync();
    if (split == 0) {
      float mr[CL], wr[CL], Mx = sink, Lt = 0.f;
#pragma unroll
      for (int r = 0; r < CL; ++r) {
        mr[r] = ld_cluster(mine + D, r);
        wr[r] = ld_cluster(mine + D + 1, r);  // the denominator for now
        Mx = fmaxf(Mx, mr[r]);
      }
#pragma unroll
      for (int r = 0; r < CL; ++r) {
        const float w = mr[r] == neg_inf() ? 0.f : expf(mr[r] - Mx);
        Lt += w * wr[r];
        wr[r] = w;
      }
      if (sink_mode && Mx != neg_inf()) Lt += expf(sink - Mx);
      for (int d = tid; d < D; d += T) {
        float o = 0.f;
#pragma unroll
        for (int r = 0; r < CL; ++r) o += wr[r] * ld_cluster(mine + d, r);
        st(out, orow * D + d, Lt > 0.f ? o / Lt : 0.f);
      }
    }
    cluster_sync();  // every block's shared memory stays until block 0 has read it
    return;
  }

  if (n_act == 1) {
    float f = 1.f;
    if (sink_mode) {
      const float M2 = fmaxf(M, sink);
      f = M == neg_inf() ? 0.f : expf(M - M2);
      L = L * f + (M2 == neg_inf() ? 0.f : expf(sink - M2));
    }
    for (int d = tid; d < D; d += T) {
      float o = 0.f;
#pragma unroll
      for (int w = 0; w < W; ++w) o += o_sh[w * D + d] * sw[w];
      st(out, orow * D + d, L > 0.f ? o * f / L : 0.f);
    }
    return;
  }

  float* P = part + orow * splits * ps;
  for (int d = tid; d < D; d += T) {
    float o = 0.f;
#pragma unroll
    for (int w = 0; w < W; ++w) o += o_sh[w * D + d] * sw[w];
    P[split * ps + d] = o;
  }
  if (tid == 0) { P[split * ps + D] = M; P[split * ps + D + 1] = L; }
  __threadfence();
  __syncthreads();
  if (tid == 0) {
    const int last = atomicAdd(counters + orow, 1) == n_act - 1;
    if (last) counters[orow] = 0;  // every split has counted: ready for the next launch
    *flag = last;
  }
  __syncthreads();
  if (!*flag) return;
  __threadfence();
  // The last split merges all n_act splits in a fixed order, and the head sink: the partials
  // into shared memory first (16-byte loads, all in flight at once).
  {
    const float4* src = reinterpret_cast<const float4*>(P);
    float4* dst = reinterpret_cast<float4*>(stage);
    const int n4 = n_act * ps / 4;
#pragma unroll 4
    for (int e = tid; e < n4; e += T) dst[e] = __ldcg(src + e);
  }
  __syncthreads();
  if (warp == 0) {
    const bool in0 = lane < n_act, in1 = lane + 32 < n_act;
    const float m0 = in0 ? stage[lane * ps + D] : neg_inf();
    const float m1 = in1 ? stage[(lane + 32) * ps + D] : neg_inf();
    const float l0 = in0 ? stage[lane * ps + D + 1] : 0.f;
    const float l1 = in1 ? stage[(lane + 32) * ps + D + 1] : 0.f;
    const float Mx = warp_max(fmaxf(fmaxf(m0, m1), sink));
    const float w0 = m0 != neg_inf() ? expf(m0 - Mx) : 0.f;
    const float w1 = m1 != neg_inf() ? expf(m1 - Mx) : 0.f;
    wsh[lane] = w0;
    wsh[lane + 32] = w1;
    const float Ls = warp_sum(w0 * l0 + w1 * l1);
    if (lane == 0) wsh[64] = Ls + ((sink_mode && Mx != neg_inf()) ? expf(sink - Mx) : 0.f);
  }
  __syncthreads();
  const float Lt = wsh[64];
  for (int d = tid; d < D; d += T) {
    float o = 0.f;
    for (int s = 0; s < n_act; ++s) o += wsh[s] * stage[s * ps + d];
    st(out, orow * D + d, Lt > 0.f ? o / Lt : 0.f);
  }
}

// grid (splits, H, B * S); block 32 * W threads, at least MB blocks per SM (registers).
template <typename S, typename C, int NC, int W, int MB>
__global__ void __launch_bounds__(32 * W, MB) gqa_attn(GQA_PARAMS) {
  GRID_WAIT();
  GRID_LAUNCH_DEPENDENTS();
  gqa_body<S, C, NC, W, 0>(GQA_ARGS);
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// grid (8, H, B * S) in clusters of the 8 splits of one (row, head) (sm_90 and later).
template <typename S, typename C, int NC, int W, int MB>
__global__ void __cluster_dims__(8, 1, 1) __launch_bounds__(32 * W, MB)
    gqa_attn_cluster(GQA_PARAMS) {
  GRID_WAIT();
  GRID_LAUNCH_DEPENDENTS();
  gqa_body<S, C, NC, W, 8>(GQA_ARGS);
}
#endif

// A window-sized cache (sliding_window_cache=1) after a fused gqa_attn: of its `base` cached
// tokens and the n_new new ones, the last window_rows(total) stay, from row 0 in order: the
// cached rows that stay move to the front (row by row, in order: a row's source is never
// overwritten before it is read), then the new keys (rotated at their positions) and values
// follow. grid (B, kvh).
template <typename S, typename C>
__global__ void gqa_window_store(const S* __restrict__ k_new, long long k_row,
                                 const S* __restrict__ v_new, long long v_row, S* __restrict__ kc,
                                 S* __restrict__ vc, const int* __restrict__ seqlens,
                                 const C* __restrict__ cos_c, const C* __restrict__ sin_c,
                                 int max_pos, int S_len, int kvh, int D, int cap, int rot,
                                 int interleaved, int rotary, int window) {
  GRID_WAIT();
  GRID_LAUNCH_DEPENDENTS();
  const int b = blockIdx.x, h = blockIdx.y;
  const int total = seqlens[b] + 1;
  if (total < 1) return;  // a bad length must never write out of bounds
  const int n_new = min(total, S_len);
  const int past = total - n_new;
  const int base = window_rows(past, cap, window);
  const int drop = base + n_new - window_rows(total, cap, window);
  S* K = kc + ((long long)b * kvh + h) * cap * D;
  S* V = vc + ((long long)b * kvh + h) * cap * D;
  if (drop > 0) {
    for (int r = 0; r + drop < base; ++r) {
      for (int d = threadIdx.x; d < D; d += blockDim.x) {
        const long long src = (long long)(r + drop) * D + d;
        K[(long long)r * D + d] = K[src];
        V[(long long)r * D + d] = V[src];
      }
      __syncthreads();
    }
  }
  for (int j = 0; j < n_new; ++j) {
    const int r = base + j - drop;
    if (r < 0 || r >= cap) continue;
    const long long row = (long long)b * S_len + j;
    const S* kx = k_new + row * k_row + (long long)h * D;
    const S* vx = v_new + row * v_row + (long long)h * D;
    store_kv_row(K + (long long)r * D, V + (long long)r * D, kx, vx, D, past + j, max_pos, rotary,
                 rot, interleaved, cos_c, sin_c, (int)threadIdx.x, (int)blockDim.x);
  }
}

// com.microsoft RotaryEmbedding. grid: rows (B*N*S); bnsh: x is (B, N, S, Dh), else (B, S, N*Dh).
template <typename S, typename C>
__global__ void rotary_rows(const S* __restrict__ x, S* __restrict__ y,
                            const long long* __restrict__ pos_ids, int single,
                            const C* __restrict__ cos_c, const C* __restrict__ sin_c, int max_pos,
                            int N, int S_len, int Dh, int rot, int interleaved, int bnsh) {
  GRID_WAIT();
  GRID_LAUNCH_DEPENDENTS();
  const long long row = blockIdx.x;
  int b, s;
  if (bnsh) { b = (int)(row / ((long long)N * S_len)); s = (int)(row % S_len); }
  else { b = (int)(row / ((long long)S_len * N)); s = (int)((row / N) % S_len); }
  const long long pid = single ? pos_ids[0] + s : pos_ids[(long long)b * S_len + s];
  const int p = (int)(pid < 0 ? 0 : (pid >= max_pos ? max_pos - 1 : pid));
  const int half = rot >> 1;
  const S* xr = x + row * Dh;
  for (int d = threadIdx.x; d < Dh; d += blockDim.x)
    st(y, row * Dh + d, rope_elem(xr, d, rot, interleaved, cos_c + (long long)p * half,
                                  sin_c + (long long)p * half));
}
"""
)


# ----------------------------------------------------------------------------- helpers


def _host_scalar(ctx: KernelContext, value) -> int | None:
    """The value of a small integer tensor when it is known on the host (never syncs)."""
    host = ctx.host_value(value)
    if host is None or host.size == 0:
        return None
    return int(host.reshape(-1)[0])


def _device(ctx: KernelContext, x, what: str):
    """``x`` as a device array (a host array is uploaded eagerly, refused in capture)."""
    if isinstance(x, cupy.ndarray):
        return x
    refuse_in_capture(ctx, f"uploading host {what}")
    return cupy.asarray(np.asarray(x))


def _aligned(arr: cupy.ndarray, nbytes: int) -> bool:
    return arr.data.ptr % nbytes == 0


# ----------------------------------------------------------------------------- GQA

_REFUSED_INPUTS = (
    "position_ids",
    "attention_bias",
    "k_scale",
    "v_scale",
    "q_norm_weight",
    "k_norm_weight",
    "query_seqlens",
)


def _gqa_check(node: NodeInfo, _types: object) -> str | None:
    return gqa_input_problem(node, _REFUSED_INPUTS, " on CUDA") or gqa_attribute_problem(node)


def gqa_splits(rows: int, cap: int, sms: int, most: int = MAX_SPLITS) -> int:
    """Splits of each query row's keys: enough blocks to fill the GPU, each >= MIN_CHUNK
    keys, at most ``most`` (whose partials fit the merging block's shared memory) and
    MAX_SPLITS."""
    target = 16 * sms
    if rows >= target:
        return 1
    most = min(MAX_SPLITS, most)
    return max(1, min(most, -(-target // rows), -(-cap // MIN_CHUNK)))


def _up16(n: int) -> int:
    return -(-n // 16) * 16


_CC_MAJOR: dict[int, int] = {}


def _cc_major() -> int:
    """Compute capability major of the current device (9 for Hopper)."""
    dev = cupy.cuda.runtime.getDevice()
    if dev not in _CC_MAJOR:
        _CC_MAJOR[dev] = int(cupy.cuda.Device(dev).compute_capability) // 10
    return _CC_MAJOR[dev]


@dataclass
class _GqaCall:
    """One GroupQueryAttention call, checked and laid out for the kernels."""

    query: cupy.ndarray  # contiguous
    q_row: int  # elements between query rows (K and V follow inside it when packed)
    k_src: cupy.ndarray
    k_row: int
    v_src: cupy.ndarray
    v_row: int
    past_key: cupy.ndarray
    past_value: cupy.ndarray
    seqlens: cupy.ndarray  # int32 [B] on the device
    cos: cupy.ndarray  # the rotary caches (the query where rotary is off: unused)
    sin: cupy.ndarray
    max_pos: int
    rot: int  # rotary dimension (0: off)
    rotary: int
    interleaved: int
    sinks: cupy.ndarray  # head_sink (the query where none: unused)
    sink_mode: int  # 0 none, 1 head_sink, 2 smooth softmax
    batch: int
    new: int  # new tokens per sequence
    heads: int
    kv_heads: int
    head_size: int
    cap: int  # rows of the cache
    window: int
    wcache: int  # 1: a window-sized cache (sliding_window_cache)
    scale: float
    softcap: float
    causal: int
    s_type: str  # C storage types of the activations and of the rotary caches
    c_type: str

    @property
    def dtype(self) -> np.dtype:
        return self.query.dtype


@REGISTRY.register("GroupQueryAttention", since=1, domain=MS_DOMAIN, check=_gqa_check)
def group_query_attention(
    ctx: KernelContext,
    query,
    key=None,
    value=None,
    past_key=None,
    past_value=None,
    seqlens_k=None,
    total_sequence_length=None,
    cos_cache=None,
    sin_cache=None,
    position_ids=None,
    attention_bias=None,
    head_sink=None,
    *rest,
):
    """GQA on a shared past/present cache with rotary, causal mask, window, softcap, sinks."""
    desc = ctx.node.describe()
    reason = _gqa_check(ctx.node, ())
    if reason or position_ids is not None or attention_bias is not None:
        raise NotImplementedError(f"{desc}: {reason or 'position_ids / attention_bias'}")
    if any(r is not None for r in rest):
        raise NotImplementedError(f"{desc}: quantized KV, QK norm or query_seqlens inputs")
    if _gqa_concat_mode(ctx, past_key, past_value, total_sequence_length):
        past_key, past_value = _gqa_concat_present(
            ctx, total_sequence_length, query, key, value, past_key, past_value, seqlens_k,
            cos_cache, sin_cache, head_sink,
        )  # fmt: skip
    call = _gqa_call(ctx, query, key, value, past_key, past_value, seqlens_k,
                     total_sequence_length, cos_cache, sin_cache, head_sink)  # fmt: skip
    y = out(ctx, 0, (call.batch, call.new, call.heads * call.head_size), call.dtype)
    if y.size == 0:
        return y, past_key, past_value
    fuse = call.new <= FUSE_MAX_NEW
    if fuse:
        _gqa_attend(ctx, call, y, True)
    else:
        _gqa_append(call)
        _gqa_attend_prompt(ctx, call, y)
    if call.wcache and fuse:  # the new rows were kept out of the cache: compact, then store them
        _gqa_window_store(call)
    return y, past_key, past_value


def _gqa_concat_mode(ctx: KernelContext, past_key, past_value, total_sequence_length) -> bool:
    """Whether the call has no shared cache to write in place: no past, or (without a
    window-sized cache) a past shorter than total_sequence_length."""
    if past_key is None or past_value is None:
        return True
    if ctx.attr("sliding_window_cache", 0):
        return False
    total = _host_scalar(ctx, total_sequence_length)
    return total is not None and total > int(past_key.shape[2])


def _gqa_concat_present(
    ctx: KernelContext, total_sequence_length, *inputs
) -> tuple[cupy.ndarray, cupy.ndarray]:
    """Concat mode: new present buffers of max(past, total_sequence_length) rows holding
    each entry's cached tokens (rows from seqlens_k + 1 on zeroed, as the CPU provider and
    onnxruntime leave them), which the shared-cache kernels then write in place. Not
    captured: the buffers' length follows a host value. ``inputs``: query, key, value,
    past_key, past_value, seqlens_k, cos_cache, sin_cache, head_sink (``gqa_shapes``'s)."""
    desc = ctx.node.describe()
    query, _, _, past_key, past_value, seqlens_k = inputs[:6]
    refuse_in_capture(ctx, "concat mode (a present buffer sized by total_sequence_length)")
    total = _host_scalar(ctx, total_sequence_length)
    if total is None:
        total = int(np.asarray(cupy.asnumpy(total_sequence_length)).reshape(-1)[0])
    geom = gqa_shapes(ctx.node, *inputs)
    cap = 0 if past_key is None else int(past_key.shape[2])
    length = max(cap, total)
    lens = _device(ctx, seqlens_k, "seqlens_k").astype(np.int64).reshape(-1, 1, 1, 1)
    need = int(lens.max()) + 1 if lens.size else 0
    if need > length:
        raise ValueError(f"{desc}: seqlens_k needs {need} rows, present has {length}")
    keep = cupy.arange(length).reshape(1, 1, -1, 1) <= lens
    presents = []
    for index, past in ((1, past_key), (2, past_value)):
        shape = (geom.batch, geom.kv_heads, length, geom.head_size)
        present = out(ctx, index, shape, query.dtype)
        present.fill(0)
        if past is not None:
            if past.dtype != query.dtype:
                raise ValueError(
                    f"{desc}: past dtype {past.dtype} differs from query's {query.dtype}"
                )
            present[:, :, :cap] = past
            cupy.copyto(present, 0, where=~keep)  # past rows past each entry's total
        presents.append(present)
    return presents[0], presents[1]


def _gqa_call(
    ctx: KernelContext,
    query,
    key,
    value,
    past_key,
    past_value,
    seqlens_k,
    total_sequence_length,
    cos_cache,
    sin_cache,
    head_sink,
) -> _GqaCall:
    """The call's geometry and device inputs, every check done (in the kernels' order)."""
    desc = ctx.node.describe()
    geom = gqa_shapes(ctx.node, query, key, value, past_key, past_value, seqlens_k,
                      cos_cache, sin_cache, head_sink)  # fmt: skip
    b, s, width = (int(d) for d in query.shape)
    heads, kvh, d = geom.heads, geom.kv_heads, geom.head_size
    dtype = query.dtype
    s_type = storage(ctx, dtype)
    query = contiguous(ctx, query)
    if geom.packed:
        flat = query.reshape(-1)
        q_row = k_row = v_row = width
        k_src, v_src = flat[heads * d :], flat[(heads + kvh) * d :]
    else:
        if key.dtype != dtype or value.dtype != dtype:
            raise TypeError(f"{desc}: query, key and value dtypes differ")
        q_row, k_row, v_row = width, kvh * d, kvh * d
        k_src, v_src = contiguous(ctx, key), contiguous(ctx, value)
    if d % 2 or d > 256:
        raise NotImplementedError(f"{desc}: head size {d} must be even and at most 256 on CUDA")
    cap, window, wcache = _gqa_cache(ctx, past_key, past_value, dtype, s, total_sequence_length)
    seqlens = _device(ctx, seqlens_k, "seqlens_k")
    if seqlens.dtype != np.int32:
        raise ValueError(
            f"{desc}: seqlens_k must be int32 [{b}], got {seqlens.dtype}{seqlens.shape}"
        )
    seqlens = contiguous(ctx, seqlens)
    rotary = bool(ctx.attr("do_rotary", 0))
    interleaved = int(bool(ctx.attr("rotary_interleaved", 0)))
    if rotary:
        cos_c = contiguous(ctx, _device(ctx, cos_cache, "cos_cache"))
        sin_c = contiguous(ctx, _device(ctx, sin_cache, "sin_cache"))
        if cos_c.dtype != sin_c.dtype:
            raise ValueError(f"{desc}: cos/sin caches differ in dtype")
        rot, max_pos = geom.rotary_dim, int(cos_c.shape[0])
        c_type = storage(ctx, cos_c.dtype)
    else:
        cos_c = sin_c = query  # unused
        rot, max_pos, c_type = 0, 1, s_type
    scale = ctx.attr("scale")
    scale = 1.0 / math.sqrt(d) if scale is None or float(scale) == 0.0 else float(scale)
    sinks, sink_mode = _gqa_sinks(ctx, head_sink, query, heads)
    return _GqaCall(
        query=query,
        q_row=q_row,
        k_src=k_src,
        k_row=k_row,
        v_src=v_src,
        v_row=v_row,
        past_key=past_key,
        past_value=past_value,
        seqlens=seqlens,
        cos=cos_c,
        sin=sin_c,
        max_pos=max_pos,
        rot=rot,
        rotary=int(rotary),
        interleaved=interleaved,
        sinks=sinks,
        sink_mode=sink_mode,
        batch=b,
        new=s,
        heads=heads,
        kv_heads=kvh,
        head_size=d,
        cap=cap,
        window=window,
        wcache=wcache,
        scale=scale,
        softcap=float(ctx.attr("softcap", 0.0)),
        causal=int(bool(ctx.attr("causal", 1))),
        s_type=s_type,
        c_type=c_type,
    )


def _gqa_cache(
    ctx: KernelContext, past_key, past_value, dtype: np.dtype, s: int, total_sequence_length
) -> tuple[int, int, int]:
    """(capacity, window, window-sized cache) of the KV cache, checked against the call."""
    desc = ctx.node.describe()
    for name, past in (("past_key", past_key), ("past_value", past_value)):
        if past.dtype != dtype:
            raise ValueError(f"{desc}: {name} dtype {past.dtype} differs from query's {dtype}")
        if not past.flags.c_contiguous:
            raise ValueError(f"{desc}: {name} must be C-contiguous (it is written in place)")
    cap = int(past_key.shape[2])
    total_len = _host_scalar(ctx, total_sequence_length)
    window = int(ctx.attr("local_window_size", -1))
    wcache = int(bool(ctx.attr("sliding_window_cache", 0)))
    if wcache:
        try:
            windowed_cache_length(0, cap, window)
        except ValueError as err:
            raise ValueError(f"{desc}: {err}") from None
        if s > FUSE_MAX_NEW and total_len is not None and total_len > cap:
            raise NotImplementedError(
                f"{desc}: {s} new tokens that overflow the window-sized cache of {cap} rows "
                f"(total_sequence_length {total_len}) are not supported on CUDA; feed at most "
                f"{FUSE_MAX_NEW} tokens per call once the cache is full"
            )
    return cap, window, wcache


def _gqa_sinks(ctx: KernelContext, head_sink, query, heads: int) -> tuple[cupy.ndarray, int]:
    """(the sink logits, sink mode): 1 with head_sink, 2 with smooth_softmax, else 0."""
    if head_sink is not None:
        sinks = contiguous(ctx, _device(ctx, head_sink, "head_sink"))
        if sinks.dtype != query.dtype:
            raise ValueError(f"{ctx.node.describe()}: head_sink must be [{heads}] {query.dtype}")
        return sinks, 1
    return query, 2 if int(ctx.attr("smooth_softmax", -1)) == 1 else 0


def _kv_block(call: _GqaCall) -> tuple[int]:
    """Threads of a block writing one (row, kv head) of the cache."""
    return (min(256, max(32, -(-call.head_size // 32) * 32)),)


def _kv_args(call: _GqaCall) -> tuple:
    """The arguments ``gqa_append`` and ``gqa_window_store`` share, in their order."""
    return (
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
        np.int32(call.new),
        np.int32(call.kv_heads),
        np.int32(call.head_size),
        np.int32(call.cap),
        np.int32(call.rot),
        np.int32(call.interleaved),
        np.int32(call.rotary),
        np.int32(call.window),
    )


def _gqa_append(call: _GqaCall) -> None:
    """Write the new keys (rotated) and values into the cache (prompts over FUSE_MAX_NEW)."""
    append = function(_SOURCE, f"gqa_append<{call.s_type}, {call.c_type}>")
    grid = (call.batch * call.new, call.kv_heads)
    append(grid, _kv_block(call), (*_kv_args(call), np.int32(call.wcache)))


def _gqa_window_store(call: _GqaCall) -> None:
    """Compact a window-sized cache and store the new rows (after a fused attention)."""
    store = function(_SOURCE, f"gqa_window_store<{call.s_type}, {call.c_type}>")
    store((call.batch, call.kv_heads), _kv_block(call), _kv_args(call))


def _gqa_attend_prompt(ctx: KernelContext, call: _GqaCall, y: cupy.ndarray) -> None:
    """A prompt's attention, its keys and values appended: the flash kernel where it takes
    the call, else matrix products (eager, long prompts), else ``gqa_attn``."""
    if _flash_fits(ctx, call, y):
        flash_attend(ctx, call, y)
    elif _gemm_attention_fits(ctx, call):
        _gqa_attend_gemm(ctx, call, y)
    else:
        _gqa_attend(ctx, call, y, False)


def attention_flash_min_rows(ctx: KernelContext) -> int:
    """New rows from which a prompt's attention runs the flash kernel (the CUDA provider's
    ``attention_flash_min_rows``; 0: never)."""
    return int(ctx.option("attention_flash_min_rows", ATTENTION_FLASH_MIN_ROWS))


def _flash_fits(ctx: KernelContext, call: _GqaCall, y: cupy.ndarray) -> bool:
    """Whether ``flash_attend`` takes a prompt (more than FUSE_MAX_NEW new rows): at least
    ``attention_flash_min_rows`` of them and nothing ``flash_attention_problem`` refuses."""
    least = attention_flash_min_rows(ctx)
    if not least or call.new < least:
        return False
    return flash_attention_problem(call, y, _cc_major()) is None


def attention_gemm_min_rows(ctx: KernelContext) -> int:
    """New rows from which a prompt's attention runs as matrix products (the CUDA provider's
    ``attention_gemm_min_rows``; 0: never)."""
    return int(ctx.option("attention_gemm_min_rows", ATTENTION_GEMM_MIN_ROWS))


def _gemm_attention_fits(ctx: KernelContext, call: _GqaCall) -> bool:
    """Whether ``_gqa_attend_gemm`` takes the call: a long prompt on an eager run, fp32 or
    fp16, no sinks, a full-length cache."""
    least = attention_gemm_min_rows(ctx)
    return (
        bool(least)
        and call.new >= least
        and not capturing(ctx)
        and call.sink_mode == 0
        and not call.wcache
        and call.dtype in (F32, F16)
        and call.cos.dtype in (F32, F16)
    )


def _gqa_attend_gemm(ctx: KernelContext, call: _GqaCall, y: cupy.ndarray) -> None:
    """A long prompt's attention as matrix products (``attention_gemm``; cuBLAS, so eager
    only), the new keys and values already in the cache (``_gqa_append``)."""
    b, s, heads, d = call.batch, call.new, call.heads, call.head_size
    lens = ctx.host_value(call.seqlens)
    if lens is None:
        lens = cupy.asnumpy(call.seqlens)  # one sync per layer: small against a long prompt
    lens = np.asarray(lens).reshape(-1)
    query = call.query.reshape(-1)[: b * s * call.q_row].reshape(b, s, call.q_row)
    q_all = query[:, :, : heads * d].reshape(b, s, heads, d)
    y4 = y.reshape(b, s, heads, d)
    for i in range(b):
        total = int(lens[i]) + 1
        past = total - s
        if past < 0 or total > call.cap:
            raise ValueError(
                f"{ctx.node.describe()}: seqlens_k gives entry {i} {total} positions for {s} new "
                f"tokens in a cache of {call.cap}"
            )
        q = q_all[i].astype(np.float32)  # [S, heads, D]
        if call.rotary:
            pos = cupy.clip(cupy.arange(past, total), 0, call.max_pos - 1)
            cos, sin = call.cos[pos].astype(np.float32), call.sin[pos].astype(np.float32)
            q = rotate_rows(cupy, q, cos, sin, call.rot, bool(call.interleaved))
        q = cupy.ascontiguousarray((q * np.float32(call.scale)).transpose(1, 0, 2))
        keys = call.past_key[i, :, :total].astype(np.float32)
        values = call.past_value[i, :, :total].astype(np.float32)
        att = attend_rows(
            cupy, q, keys, values, past,
            softcap=call.softcap, window=call.window, causal=bool(call.causal),
        )  # fmt: skip
        y4[i] = att.transpose(1, 0, 2).astype(y.dtype)


def _short_cache(ctx: KernelContext, call: _GqaCall) -> bool:
    """Whether the cache has at most the provider's ``attention_cluster_max_keys`` positions
    (0: any), which decode / verify leave to the 8-split kernels."""
    most = int(ctx.option("attention_cluster_max_keys", ATTENTION_CLUSTER_MAX_KEYS))
    return most == 0 or call.cap <= most


def _cluster_fits(ctx: KernelContext, call: _GqaCall, fuse: bool) -> bool:
    """Whether the cluster kernel takes a decode / verify call: sm_90+, and a cache of at most
    the provider's ``attention_cluster_max_keys`` positions (0: any)."""
    return bool(fuse and CLUSTER and _cc_major() >= 9 and _short_cache(ctx, call))


def _many_rows(ctx: KernelContext, call: _GqaCall) -> bool:
    """Whether the call has more query rows (batch x new tokens) than the provider's
    ``attention_cluster_max_rows`` (0: never), which the cluster kernel serves well."""
    most = int(ctx.option("attention_cluster_max_rows", ATTENTION_CLUSTER_MAX_ROWS))
    return most > 0 and call.batch * call.new > most


def _grouped_cluster_fits(ctx: KernelContext, call: _GqaCall, fuse: bool) -> bool:
    """Whether a decode / verify call the cluster kernel would take runs the grouped decode
    kernel's cluster launch instead: the provider's ``attention_grouped_cluster`` on and an
    instance for the call (``decode_call_problem``)."""
    on = bool(ctx.option("attention_grouped_cluster", ATTENTION_GROUPED_CLUSTER))
    return on and _cluster_fits(ctx, call, fuse) and decode_call_problem(call) is None


def _grouped_decode_fits(ctx: KernelContext, call: _GqaCall) -> bool:
    """Whether the grouped decode kernel takes a decode / verify call: a cache longer than
    ``attention_cluster_max_keys`` or more query rows than ``attention_cluster_max_rows``,
    the kernel on (GROUPED_DECODE and the provider's ``attention_grouped_decode``) and an
    instance for the call (``decode_call_problem``)."""
    on = GROUPED_DECODE and bool(ctx.option("attention_grouped_decode", False))
    wanted = not _short_cache(ctx, call) or _many_rows(ctx, call)
    return on and wanted and decode_call_problem(call) is None


def _gqa_attend(ctx: KernelContext, call: _GqaCall, y: cupy.ndarray, fuse: bool) -> None:
    """The attention launch: splits of each query row's keys, merged in a cluster or by
    the last split to finish; decode / verify over a long cache: the grouped decode kernel,
    and on a short one its cluster launch (``attention_grouped_cluster``), or above
    ``attention_grouped_cluster_max_rows`` query rows its plain launch cut as the cluster's
    splits are (the same bits)."""
    if fuse and _grouped_cluster_fits(ctx, call, fuse):
        most = int(
            ctx.option("attention_grouped_cluster_max_rows", ATTENTION_GROUPED_CLUSTER_MAX_ROWS)
        )
        if most > 0 and call.batch * call.new > most:
            decode_attend(ctx, call, y, call_same_cut_splits(call, CLUSTER_SPLITS))
        else:
            decode_attend(ctx, call, y, CLUSTER_SPLITS, cluster=True)
        return
    if fuse and _grouped_decode_fits(ctx, call):
        fixed = int(ctx.option("attention_decode_splits", 0))
        decode_attend(ctx, call, y, decode_split_count(call, fixed))
        return
    b, s, heads, d = call.batch, call.new, call.heads, call.head_size
    rows = b * s * heads
    warps = ATTN_WARPS
    new_rows = 2 * (s if fuse else 0) * d * call.dtype.itemsize
    shared = _up16(_up16(new_rows) + (d + warps * d + 2 * warps + 68) * 4)
    ps = -(-(d + 2) // 4) * 4  # floats per partial: D sums, max, denominator, padding
    part, counts = y, call.seqlens  # placeholders: no global merge
    cluster = _cluster_fits(ctx, call, fuse)
    if cluster:
        kernel, splits, min_chunk = "gqa_attn_cluster", 8, CLUSTER_MIN_CHUNK
        shared += ps * 4
    else:
        kernel, min_chunk = "gqa_attn", MIN_CHUNK
        stage = min(STAGE_BYTES, _SHARED_MAX - shared)
        splits = gqa_splits(rows, call.cap, sm_count(), max(1, stage // (4 * ps)))
        if splits > 1:
            part = scratch(ctx, rows * splits * ps * 4).view(np.float32)
            counts = zeroed_counters(ctx, rows)
            shared += splits * ps * 4
    past_key, past_value = call.past_key, call.past_value
    vec = int(
        _aligned(past_key, 16) and _aligned(past_value, 16) and (d * call.dtype.itemsize) % 16 == 0
    )
    name = f"{kernel}<{call.s_type}, {call.c_type}, {-(-d // 64)}, {warps}, {ATTN_MIN_BLOCKS}>"
    attn = function(_SOURCE, name)
    attn(
        (splits, heads, b * s),
        (32 * warps,),
        (
            call.query,
            np.int64(call.q_row),
            call.k_src,
            np.int64(call.k_row),
            call.v_src,
            np.int64(call.v_row),
            past_key,
            past_value,
            call.seqlens,
            call.cos,
            call.sin,
            np.int32(call.max_pos),
            call.sinks,
            y,
            part,
            counts,
            np.int32(s),
            np.int32(heads),
            np.int32(call.kv_heads),
            np.int32(d),
            np.int32(call.cap),
            np.int32(call.rot),
            np.int32(call.interleaved),
            np.int32(call.rotary),
            np.float32(call.scale),
            np.float32(call.softcap),
            np.int32(call.window),
            np.int32(call.causal),
            np.int32(splits),
            np.int32(min_chunk),
            np.int32(int(fuse)),
            np.int32(call.sink_mode),
            np.int32(vec),
            np.int32(call.wcache),
        ),
        shared_mem=shared,
    )


# ----------------------------------------------------------------------------- RotaryEmbedding


@REGISTRY.register("RotaryEmbedding", since=1, domain=MS_DOMAIN, check=rotary_problem)
def rotary_embedding_ms(ctx: KernelContext, x, position_ids, cos_cache, sin_cache):
    """com.microsoft RotaryEmbedding on (B, S, hidden) or (B, N, S, H); positions on device.

    Positions outside the cos/sin cache are clamped (checking them would need a sync).
    """
    desc = ctx.node.describe()
    lay = rotary_layout(ctx.node, x.shape, cos_cache.shape)
    b, n, s, dh, rot, bnsh = (
        lay.batch,
        lay.heads,
        lay.seq,
        lay.head_size,
        lay.rotary_dim,
        int(lay.bnsh),
    )
    pos = contiguous(ctx, _device(ctx, position_ids, "position_ids"))
    if pos.dtype != np.int64:
        raise TypeError(f"{desc}: position_ids must be int64")
    single = int(pos.size == 1)
    if not single and pos.size != b * s:
        raise ValueError(f"{desc}: position_ids {list(pos.shape)} do not fit ({b}, {s})")
    cos_c = contiguous(ctx, _device(ctx, cos_cache, "cos_cache"))
    sin_c = contiguous(ctx, _device(ctx, sin_cache, "sin_cache"))
    y = out(ctx, 0, x.shape, x.dtype)
    rows = b * n * s
    if rows == 0 or dh == 0:
        return y
    fn = function(_SOURCE, f"rotary_rows<{storage(ctx, x.dtype)}, {storage(ctx, cos_c.dtype)}>")
    fn(
        (rows,),
        (min(256, max(32, -(-dh // 32) * 32)),),
        (
            contiguous(ctx, x),
            y,
            pos,
            np.int32(single),
            cos_c,
            sin_c,
            np.int32(cos_c.shape[0]),
            np.int32(n),
            np.int32(s),
            np.int32(dh),
            np.int32(rot),
            np.int32(int(bool(ctx.attr("interleaved", 0)))),
            np.int32(bnsh),
        ),
    )
    return y
