"""CUDA kernels: com.microsoft GroupQueryAttention and RotaryEmbedding.

GroupQueryAttention runs on a shared past/present KV cache ``[B, kv_heads, capacity, D]``:
the new keys (rotated) and values are written in place at positions
``[past, past + S)`` and the past buffers themselves are returned as the present outputs.
Every length comes from ``seqlens_k`` *in device memory* (``total = seqlens_k[b] + 1``,
``past = total - S``), read inside the kernels, so one captured graph stays valid while the
cache grows. ``total_sequence_length`` is only checked when its value is known on the host
(a host array or a host-shadowed constant); it is never synchronized on.

Three launches per call, all capturable (no cuBLAS, no allocation, no host sync):

1. ``gqa_append``: rotate the new keys, write keys and values into the cache.
2. ``gqa_attn``: one block per (split, query head, batch x query row). The query row is
   rotated and scaled into shared memory; the block walks its share of the visible keys
   (causal by absolute position, local window) in tiles of 128 with an online softmax.
   The share is ``ceil(visible / splits)`` keys computed from the device-side length, so
   every split has work at any length. With one split the block writes the output itself.
3. ``gqa_combine`` (splits > 1 or a head sink): merges the splits' partial sums.

Concat mode (a past shorter than the total, or no past at all) is refused.
"""

from __future__ import annotations

import math

import cupy
import numpy as np

from onnx_genrt.core.kernels import MS_DOMAIN, KernelContext, NodeInfo

from ._common import (
    DEVICE_COMMON,
    contiguous,
    function,
    out,
    refuse_in_capture,
    scratch,
    sm_count,
    storage,
)
from ._registry import REGISTRY

#: Threads of the attention block (one key per thread per tile).
_ATTN_THREADS = 128
#: Fewest keys a split takes before fewer splits are used.
_MIN_CHUNK = 64
#: Most splits of one query row's keys.
_MAX_SPLITS = 64

_SOURCE = (
    DEVICE_COMMON
    + r"""
// Element d of the rotated head row x (rot leading features rotated, the rest copied).
// cs / sn point at the position's cos / sin row of rot / 2 values.
template <typename S, typename C>
DEVI float rope_elem(const S* x, int d, int rot, int interleaved, const C* cs, const C* sn) {
  const float v = ld(x, d);
  if (d >= rot) return v;
  const int half = rot >> 1;
  int j, partner;
  float sign;
  if (interleaved) { j = d >> 1; partner = d ^ 1; sign = (d & 1) ? 1.f : -1.f; }
  else if (d < half) { j = d; partner = d + half; sign = -1.f; }
  else { j = d - half; partner = d - half; sign = 1.f; }
  return v * ld(cs, j) + sign * ld(x, partner) * ld(sn, j);
}

DEVI int clampi(int v, int lo, int hi) { return v < lo ? lo : (v > hi ? hi : v); }

// Keys [lo, hi] that query row i (of S new rows) of batch b may see; false when none.
DEVI bool visible_keys(const int* seqlens, int b, int i, int S, int cap, int causal, int window,
                       int& pos, int& lo, int& hi) {
  const int total = seqlens[b] + 1;
  const int n_new = min(max(total, 0), S);
  const int past = total - n_new;
  pos = past + i;
  const int t = min(total, cap);
  hi = causal ? min(pos, t - 1) : t - 1;
  lo = (causal && window > 0) ? max(0, pos - window + 1) : 0;
  return hi >= lo;
}

// New keys (rotated) and values into the cache at their absolute positions.
// grid (B * S, kvh); k_new / v_new rows of k_row / v_row elements, head h at h * D.
template <typename S, typename C>
__global__ void gqa_append(const S* __restrict__ k_new, long long k_row,
                           const S* __restrict__ v_new, long long v_row,
                           S* __restrict__ kc, S* __restrict__ vc, const int* __restrict__ seqlens,
                           const C* __restrict__ cos_c, const C* __restrict__ sin_c, int max_pos,
                           int S_len, int kvh, int D, int cap, int rot, int interleaved,
                           int rotary) {
  const int b = blockIdx.x / S_len, i = blockIdx.x % S_len, h = blockIdx.y;
  const int total = seqlens[b] + 1;
  const int n_new = min(max(total, 0), S_len);
  if (i >= n_new) return;
  const int pos = total - n_new + i;
  if (pos < 0 || pos >= cap) return;  // a bad length must never write out of bounds
  const long long row = (long long)b * S_len + i;
  const S* kx = k_new + row * k_row + (long long)h * D;
  const S* vx = v_new + row * v_row + (long long)h * D;
  const long long dst = (((long long)b * kvh + h) * cap + pos) * D;
  const int half = rot >> 1;
  const int p = clampi(pos, 0, max_pos - 1);
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    const float kv = rotary ? rope_elem(kx, d, rot, interleaved, cos_c + (long long)p * half,
                                        sin_c + (long long)p * half)
                            : ld(kx, d);
    st(kc, dst + d, kv);
    st(vc, dst + d, ld(vx, d));
  }
}

DEVI float dot4(const float* q, float4 v) {
  return q[0] * v.x + q[1] * v.y + q[2] * v.z + q[3] * v.w;
}
DEVI float dot8(const float* q, uint4 v) {
  const unsigned int w[4] = {v.x, v.y, v.z, v.w};
  float s = 0.f;
#pragma unroll
  for (int u = 0; u < 4; ++u)
    s += q[2 * u] * h2f((half_t)(w[u] & 0xffffu)) + q[2 * u + 1] * h2f((half_t)(w[u] >> 16));
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
DEVI float dot_row(const float* q, const half_t* k, int D, int vec) {
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
      for (int u = 0; u < 4; ++u) s += dot8(q + 8 * (j + u), v[u]);
    }
    for (; j < n; ++j) s += dot8(q + 8 * j, k8[j]);
  } else {
    for (int j = 0; j < D; ++j) s += q[j] * h2f(k[j]);
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
DEVI void ld2(const half_t* p, long long i, int vec, float& a, float& b) {
  if (vec) {
    const unsigned int v = *reinterpret_cast<const unsigned int*>(p + i);
    a = h2f((half_t)(v & 0xffffu));
    b = h2f((half_t)(v >> 16));
  } else {
    a = h2f(p[i]);
    b = h2f(p[i + 1]);
  }
}

// grid (splits, H, B * S); block 128 threads. Shared: q[D], p[128], red[33], o[groups * D].
// part (splits > 1 or direct == 0): per (row, head, split) D sums then max and denominator.
template <typename S, typename C>
__global__ void __launch_bounds__(128) gqa_attn(
    const S* __restrict__ q, long long q_row, const S* __restrict__ kc,
    const S* __restrict__ vc, const int* __restrict__ seqlens, const C* __restrict__ cos_c,
    const C* __restrict__ sin_c, int max_pos, S* __restrict__ out, float* __restrict__ part,
    int S_len, int H, int kvh, int D, int cap, int rot, int interleaved, int rotary,
    float scale, float softcap, int window, int causal, int splits, int direct, int vec) {
  extern __shared__ float sm[];
  float* q_sh = sm;
  float* p_sh = q_sh + D;
  float* red = p_sh + 128;
  float* o_sh = red + 33;
  const int tid = threadIdx.x;
  const int split = blockIdx.x, h = blockIdx.y, bi = blockIdx.z;
  const int b = bi / S_len, i = bi % S_len;
  int pos, lo, hi;
  const bool any = visible_keys(seqlens, b, i, S_len, cap, causal, window, pos, lo, hi);
  const int n_vis = any ? hi - lo + 1 : 0;
  int chunk = (n_vis + splits - 1) / splits;
  chunk = max(chunk, 64);
  const int k_begin = lo + split * chunk;
  const int k_end = min(k_begin + chunk, hi + 1);

  const S* qx = q + (long long)bi * q_row + (long long)h * D;
  const int half = rot >> 1;
  const int p = clampi(pos, 0, max_pos - 1);
  for (int d = tid; d < D; d += blockDim.x) {
    const float v = rotary ? rope_elem(qx, d, rot, interleaved, cos_c + (long long)p * half,
                                       sin_c + (long long)p * half)
                           : ld(qx, d);
    q_sh[d] = v * scale;
  }
  __syncthreads();

  const int g = h / (H / kvh);
  const S* K = kc + ((long long)b * kvh + g) * cap * D;
  const S* V = vc + ((long long)b * kvh + g) * cap * D;
  const int pairs = D >> 1;
  const int groups = 128 / pairs;
  const int grp = tid / pairs, dp = tid % pairs;
  const bool active = grp < groups;
  float m = neg_inf(), l = 0.f, acc0 = 0.f, acc1 = 0.f;
  for (int t0 = k_begin; t0 < k_end; t0 += 128) {
    const int key = t0 + tid;
    float s = neg_inf();
    if (key < k_end) {
      s = dot_row(q_sh, K + (long long)key * D, D, vec);
      if (softcap > 0.f) s = softcap * tanhf(s / softcap);
    }
    const float m_new = fmaxf(m, block_max(s, red));
    const float pr = (key < k_end && m_new != neg_inf()) ? expf(s - m_new) : 0.f;
    p_sh[tid] = pr;
    const float tsum = block_sum(pr, red);  // its barriers publish p_sh
    const float alpha = (m == neg_inf()) ? 0.f : expf(m - m_new);
    l = l * alpha + tsum;
    acc0 *= alpha;
    acc1 *= alpha;
    m = m_new;
    const int n_t = min(128, k_end - t0);
    if (active) {
      const S* Vt = V + (long long)t0 * D + 2 * dp;
      int j = grp;
      for (; j + 3 * groups < n_t; j += 4 * groups) {  // four rows of V in flight
        float w[4], va[4], vb[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          w[u] = p_sh[j + u * groups];
          ld2(Vt, (long long)(j + u * groups) * D, vec, va[u], vb[u]);
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          acc0 += w[u] * va[u];
          acc1 += w[u] * vb[u];
        }
      }
      for (; j < n_t; j += groups) {
        float va, vb;
        ld2(Vt, (long long)j * D, vec, va, vb);
        acc0 += p_sh[j] * va;
        acc1 += p_sh[j] * vb;
      }
    }
  }
  if (active) { o_sh[grp * D + 2 * dp] = acc0; o_sh[grp * D + 2 * dp + 1] = acc1; }
  __syncthreads();
  const long long row = (long long)bi * H + h;
  for (int d = tid; d < D; d += blockDim.x) {
    float o = 0.f;
    for (int gg = 0; gg < groups; ++gg) o += o_sh[gg * D + d];
    if (direct) {
      st(out, row * D + d, l > 0.f ? o / l : 0.f);
    } else {
      part[(row * splits + split) * (D + 2) + d] = o;
    }
  }
  if (!direct && tid == 0) {
    part[(row * splits + split) * (D + 2) + D] = m;
    part[(row * splits + split) * (D + 2) + D + 1] = l;
  }
}

// One block per (batch x query row, head): merge the splits (at most 64) and a head sink.
// sink_mode: 0 none, 1 sinks[h], 2 a zero sink (smooth softmax). The first warp reads the
// splits' maxima and denominators in parallel; then every thread sums its features.
template <typename S>
__global__ void gqa_combine(const float* __restrict__ part, const S* __restrict__ sinks,
                            S* __restrict__ out, int H, int D, int splits, int sink_mode) {
  __shared__ float w_sh[64];
  __shared__ float l_sh;
  const long long row = blockIdx.x;
  const int h = (int)(row % H);
  const float* P = part + row * splits * (D + 2);
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    const float sink = sink_mode == 1 ? ld(sinks, h) : (sink_mode == 2 ? 0.f : neg_inf());
    const bool in0 = lane < splits, in1 = lane + 32 < splits;
    const float m0 = in0 ? P[lane * (D + 2) + D] : neg_inf();
    const float m1 = in1 ? P[(lane + 32) * (D + 2) + D] : neg_inf();
    const float l0 = in0 ? P[lane * (D + 2) + D + 1] : 0.f;
    const float l1 = in1 ? P[(lane + 32) * (D + 2) + D + 1] : 0.f;
    const float M = warp_max(fmaxf(fmaxf(m0, m1), sink));
    const float w0 = m0 != neg_inf() ? expf(m0 - M) : 0.f;
    const float w1 = m1 != neg_inf() ? expf(m1 - M) : 0.f;
    if (in0) w_sh[lane] = w0;
    if (in1) w_sh[lane + 32] = w1;
    const float L = warp_sum(w0 * l0 + w1 * l1);
    if (lane == 0) l_sh = L + ((sink_mode && M != neg_inf()) ? expf(sink - M) : 0.f);
  }
  __syncthreads();
  const float L = l_sh;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float o = 0.f;
#pragma unroll 4
    for (int s = 0; s < splits; ++s) o += w_sh[s] * P[s * (D + 2) + d];
    st(out, row * D + d, L > 0.f ? o / L : 0.f);
  }
}

// com.microsoft RotaryEmbedding. grid: rows (B*N*S); bnsh: x is (B, N, S, Dh), else (B, S, N*Dh).
template <typename S, typename C>
__global__ void rotary_rows(const S* __restrict__ x, S* __restrict__ y,
                            const long long* __restrict__ pos_ids, int single,
                            const C* __restrict__ cos_c, const C* __restrict__ sin_c, int max_pos,
                            int N, int S_len, int Dh, int rot, int interleaved, int bnsh) {
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
    if value is None:
        return None
    if not isinstance(value, cupy.ndarray):
        arr = np.asarray(value).reshape(-1)
        return int(arr[0]) if arr.size else None
    shadow = getattr(ctx.provider, "host_shadow", None)
    host = shadow(value) if shadow is not None else None
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

_REFUSED_INPUTS = {
    9: "position_ids",
    10: "attention_bias",
    12: "k_scale",
    13: "v_scale",
    14: "q_norm_weight",
    15: "k_norm_weight",
    16: "query_seqlens",
}


def _gqa_check(node: NodeInfo, _types: object) -> str | None:
    names = node.input_names
    for i, what in _REFUSED_INPUTS.items():
        if i < len(names) and names[i]:
            return f"GroupQueryAttention input {what!r} is not supported on CUDA"
    if len(names) < 5 or not names[3] or not names[4]:
        return (
            "GroupQueryAttention without past_key/past_value (concat mode) is not supported on CUDA"
        )
    if (len(node.output_names) > 3 and node.output_names[3]) or node.attr("qk_output", 0):
        return "GroupQueryAttention output_qk / qk_output is not supported"
    if node.attr("sliding_window_cache", 0):
        return "GroupQueryAttention sliding_window_cache=1 is not supported"
    for a in ("k_quant_type", "v_quant_type"):
        if node.attr(a, "NONE") != "NONE":
            return f"GroupQueryAttention {a}={node.attr(a)!r} (quantized KV cache) is not supported"
    if node.attr("causal", 1) not in (0, 1):
        return f"GroupQueryAttention causal={node.attr('causal')} must be 0 or 1"
    if not node.attr("causal", 1) and node.attr("local_window_size", -1) != -1:
        return "GroupQueryAttention local_window_size needs causal=1"
    return None


def gqa_splits(rows: int, cap: int, sms: int) -> int:
    """Splits of each query row's keys: enough blocks to fill the GPU, each >= 64 keys."""
    target = 16 * sms
    if rows >= target:
        return 1
    return max(1, min(_MAX_SPLITS, -(-target // rows), -(-cap // _MIN_CHUNK)))


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
    if past_key is None or past_value is None:
        raise NotImplementedError(
            f"{desc}: concat mode (no past_key/past_value) is not supported on CUDA; bind the "
            "KV cache as both past and present"
        )
    if seqlens_k is None:
        raise ValueError(f"{desc}: seqlens_k is required")
    heads, kvh = int(ctx.attr("num_heads")), int(ctx.attr("kv_num_heads"))
    if heads <= 0 or kvh <= 0 or heads % kvh:
        raise ValueError(f"{desc}: num_heads {heads} must be a positive multiple of {kvh}")
    if query.ndim != 3:
        raise ValueError(f"{desc}: query must be (B, S, width), got {list(query.shape)}")
    b, s, width = (int(d) for d in query.shape)
    dtype = query.dtype
    s_type = storage(ctx, dtype)
    query = contiguous(ctx, query)
    if key is None:
        if value is not None or width % (heads + 2 * kvh):
            raise ValueError(f"{desc}: packed QKV width {width} does not fit {heads}+2*{kvh}")
        d = width // (heads + 2 * kvh)
        flat = query.reshape(-1)
        q_row = k_row = v_row = width
        k_src, v_src = flat[heads * d :], flat[(heads + kvh) * d :]
    else:
        if value is None or width % heads:
            raise ValueError(f"{desc}: query width {width} not divisible by {heads} heads")
        d = width // heads
        if tuple(key.shape) != (b, s, kvh * d) or tuple(value.shape) != tuple(key.shape):
            raise ValueError(
                f"{desc}: key/value shapes {list(key.shape)}, {list(value.shape)} != "
                f"{[b, s, kvh * d]}"
            )
        if key.dtype != dtype or value.dtype != dtype:
            raise TypeError(f"{desc}: query, key and value dtypes differ")
        q_row, k_row, v_row = width, kvh * d, kvh * d
        k_src, v_src = contiguous(ctx, key), contiguous(ctx, value)
    if d % 2 or d > 256:
        raise NotImplementedError(f"{desc}: head size {d} must be even and at most 256 on CUDA")
    for name, past in (("past_key", past_key), ("past_value", past_value)):
        if (
            past.ndim != 4
            or tuple(past.shape[:2]) != (b, kvh)
            or int(past.shape[3]) != d
            or past.dtype != dtype
        ):
            raise ValueError(
                f"{desc}: {name} {list(past.shape)} {past.dtype} does not fit "
                f"[{b}, {kvh}, *, {d}] {dtype}"
            )
        if not past.flags.c_contiguous:
            raise ValueError(f"{desc}: {name} must be C-contiguous (it is written in place)")
    if past_key.shape != past_value.shape:
        raise ValueError(f"{desc}: past_key and past_value shapes differ")
    cap = int(past_key.shape[2])
    total_len = _host_scalar(ctx, total_sequence_length)
    if total_len is not None and total_len > cap:
        raise NotImplementedError(
            f"{desc}: total_sequence_length {total_len} exceeds the past buffer of {cap} "
            "(concat mode is not supported on CUDA)"
        )
    seqlens = _device(ctx, seqlens_k, "seqlens_k")
    if seqlens.dtype != np.int32 or seqlens.size != b:
        raise ValueError(
            f"{desc}: seqlens_k must be int32 [{b}], got {seqlens.dtype}{seqlens.shape}"
        )
    seqlens = contiguous(ctx, seqlens)

    rotary = bool(ctx.attr("do_rotary", 0))
    interleaved = int(bool(ctx.attr("rotary_interleaved", 0)))
    if rotary:
        if cos_cache is None or sin_cache is None:
            raise ValueError(f"{desc}: do_rotary needs cos_cache and sin_cache")
        cos_c = contiguous(ctx, _device(ctx, cos_cache, "cos_cache"))
        sin_c = contiguous(ctx, _device(ctx, sin_cache, "sin_cache"))
        if cos_c.ndim != 2 or cos_c.shape != sin_c.shape or cos_c.dtype != sin_c.dtype:
            raise ValueError(f"{desc}: cos/sin caches {cos_c.shape}, {sin_c.shape} differ")
        rot, max_pos = 2 * int(cos_c.shape[1]), int(cos_c.shape[0])
        if rot > d or max_pos < 1:
            raise ValueError(f"{desc}: rotary dim {rot} exceeds head size {d}")
        c_type = storage(ctx, cos_c.dtype)
    else:
        cos_c = sin_c = query  # unused
        rot, max_pos, c_type = 0, 1, s_type
    scale = ctx.attr("scale")
    scale = 1.0 / math.sqrt(d) if scale is None or float(scale) == 0.0 else float(scale)
    softcap = float(ctx.attr("softcap", 0.0))
    window = int(ctx.attr("local_window_size", -1))
    causal = int(bool(ctx.attr("causal", 1)))
    sink_mode = 0
    sinks = query
    if head_sink is not None:
        sinks = contiguous(ctx, _device(ctx, head_sink, "head_sink"))
        if sinks.size != heads or sinks.dtype != dtype:
            raise ValueError(f"{desc}: head_sink must be [{heads}] {dtype}")
        sink_mode = 1
    elif int(ctx.attr("smooth_softmax", -1)) == 1:
        sink_mode = 2

    y = out(ctx, 0, (b, s, heads * d), dtype)
    if y.size == 0:
        return y, past_key, past_value
    append = function(_SOURCE, f"gqa_append<{s_type}, {c_type}>")
    append(
        (b * s, kvh),
        (min(256, max(32, -(-d // 32) * 32)),),
        (
            k_src,
            np.int64(k_row),
            v_src,
            np.int64(v_row),
            past_key,
            past_value,
            seqlens,
            cos_c,
            sin_c,
            np.int32(max_pos),
            np.int32(s),
            np.int32(kvh),
            np.int32(d),
            np.int32(cap),
            np.int32(rot),
            np.int32(interleaved),
            np.int32(rotary),
        ),
    )
    rows = b * s * heads
    splits = gqa_splits(rows, cap, sm_count())
    direct = int(splits == 1 and sink_mode == 0)
    part = y
    if not direct:
        part = scratch(ctx, rows * splits * (d + 2) * 4).view(np.float32)
    vec = int(
        _aligned(past_key, 16) and _aligned(past_value, 16) and (d * dtype.itemsize) % 16 == 0
    )
    pairs = d // 2
    groups = _ATTN_THREADS // pairs
    shared = (d + _ATTN_THREADS + 33 + groups * d) * 4
    attn = function(_SOURCE, f"gqa_attn<{s_type}, {c_type}>")
    attn(
        (splits, heads, b * s),
        (_ATTN_THREADS,),
        (
            query,
            np.int64(q_row),
            past_key,
            past_value,
            seqlens,
            cos_c,
            sin_c,
            np.int32(max_pos),
            y,
            part,
            np.int32(s),
            np.int32(heads),
            np.int32(kvh),
            np.int32(d),
            np.int32(cap),
            np.int32(rot),
            np.int32(interleaved),
            np.int32(rotary),
            np.float32(scale),
            np.float32(softcap),
            np.int32(window),
            np.int32(causal),
            np.int32(splits),
            np.int32(direct),
            np.int32(vec),
        ),
        shared_mem=shared,
    )
    if not direct:
        combine = function(_SOURCE, f"gqa_combine<{s_type}>")
        combine(
            (rows,),
            (min(256, max(32, -(-d // 32) * 32)),),
            (part, sinks, y, np.int32(heads), np.int32(d), np.int32(splits), np.int32(sink_mode)),
        )
    return y, past_key, past_value


# ----------------------------------------------------------------------------- RotaryEmbedding


def _rotary_check(node: NodeInfo, _types: object) -> str | None:
    if node.attr("is_packed_batching", 0):
        return "RotaryEmbedding is_packed_batching=1 is not supported"
    return None


@REGISTRY.register("RotaryEmbedding", since=1, domain=MS_DOMAIN, check=_rotary_check)
def rotary_embedding_ms(ctx: KernelContext, x, position_ids, cos_cache, sin_cache):
    """com.microsoft RotaryEmbedding on (B, S, hidden) or (B, N, S, H); positions on device.

    Positions outside the cos/sin cache are clamped (checking them would need a sync).
    """
    desc = ctx.node.describe()
    half = int(cos_cache.shape[1])
    if x.ndim == 4:
        b, n, s, dh = (int(v) for v in x.shape)
        bnsh = 1
    elif x.ndim == 3:
        b, s, hidden = (int(v) for v in x.shape)
        n = int(ctx.attr("num_heads", 0)) or hidden // (2 * half)
        if n <= 0 or hidden % n:
            raise ValueError(f"{desc}: hidden {hidden} not divisible by {n} heads")
        dh, bnsh = hidden // n, 0
    else:
        raise ValueError(f"{desc}: input must be 3-D or 4-D, got {list(x.shape)}")
    rot = int(ctx.attr("rotary_embedding_dim", 0)) or dh
    if rot != 2 * half or rot > dh:
        raise ValueError(f"{desc}: rotary dim {rot} vs cos cache {list(cos_cache.shape)}")
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
