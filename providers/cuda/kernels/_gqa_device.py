"""Device helpers of the GroupQueryAttention kernels (``contrib_attention``'s and the flash
prompt kernel's, ``_flash``): rotary embedding of a head row, storing and staging new K / V
rows, and the rows a window-sized KV cache holds. Appended after ``_common.DEVICE_COMMON``
(they use its ``ld`` and ``st``)."""

GQA_DEVICE = r"""
// Rotation of feature d < rot: it mixes with feature `partner` through cos / sin entry j.
DEVI void rope_index(int d, int rot, int interleaved, int& j, int& partner, float& sign) {
  const int half = rot >> 1;
  if (interleaved) { j = d >> 1; partner = d ^ 1; sign = (d & 1) ? 1.f : -1.f; }
  else if (d < half) { j = d; partner = d + half; sign = -1.f; }
  else { j = d - half; partner = d - half; sign = 1.f; }
}
DEVI int rope_partner(int d, int rot, int interleaved) {
  int j, partner;
  float sign;
  rope_index(d, rot, interleaved, j, partner, sign);
  return partner;
}
// Rotated feature d < rot from its value v and its partner's value pv.
template <typename C>
DEVI float rope_mix(float v, float pv, int d, int rot, int interleaved, const C* cs, const C* sn) {
  int j, partner;
  float sign;
  rope_index(d, rot, interleaved, j, partner, sign);
  return v * ld(cs, j) + sign * pv * ld(sn, j);
}
// Element d of the rotated head row x (rot leading features rotated, the rest copied).
// cs / sn point at the position's cos / sin row of rot / 2 values.
template <typename S, typename C>
DEVI float rope_elem(const S* x, int d, int rot, int interleaved, const C* cs, const C* sn) {
  const float v = ld(x, d);
  if (d >= rot) return v;
  return rope_mix(v, ld(x, rope_partner(d, rot, interleaved)), d, rot, interleaved, cs, sn);
}

// Thread-block clusters (sm_90+): a barrier of every thread of the cluster's blocks (shared
// memory written before it is visible to the cluster after it), and loads of the float (or
// four floats, 16-byte aligned) at p, this block's shared memory, in block `rank`.
DEVI void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::
                   : "memory");
}
DEVI unsigned int cluster_addr(const float* p, unsigned int rank) {
  const unsigned int a = (unsigned int)__cvta_generic_to_shared(p);
  unsigned int r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(rank));
  return r;
}
DEVI float ld_cluster(const float* p, unsigned int rank) {
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(cluster_addr(p, rank)) : "memory");
  return v;
}
DEVI float4 ld_cluster4(const float* p, unsigned int rank) {
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(cluster_addr(p, rank))
               : "memory");
  return v;
}

DEVI int clampi(int v, int lo, int hi) { return v < lo ? lo : (v > hi ? hi : v); }

// One new token's K row (rotated at position pos, clamped to the table) and V row, stored at
// kd[0, D) and vd[0, D) by threads tid, tid + T, ...
template <typename S, typename C, typename O>
DEVI void store_kv_row(O* kd, O* vd, const S* kx, const S* vx, int D, int pos, int max_pos,
                       int rotary, int rot, int interleaved, const C* cos_c, const C* sin_c,
                       int tid, int T) {
  const long long at = (long long)clampi(pos, 0, max_pos - 1) * (rot >> 1);
  for (int d = tid; d < D; d += T) {
    st(kd, d, rotary ? rope_elem(kx, d, rot, interleaved, cos_c + at, sin_c + at) : ld(kx, d));
    st(vd, d, ld(vx, d));
  }
}

// New rows j0.. of a step (rows row0 + j of k_new / v_new from column col, positions
// past + j) into kn / vn ([rows][D], shared memory), n elements, by threads tid, tid + T, ...
template <typename S, typename C>
DEVI void stage_new_rows(S* kn, S* vn, const S* k_new, const S* v_new, long long row0,
                         long long k_row, long long v_row, long long col, int j0, int n, int D,
                         int past, int max_pos, int rotary, int rot, int interleaved,
                         const C* cos_c, const C* sin_c, int tid, int T) {
  const int half = rot >> 1;
#pragma unroll 4
  for (int e = tid; e < n; e += T) {
    const int j = j0 + e / D, d = e % D;
    const long long r = row0 + j;
    const S* kx = k_new + r * k_row + col;
    const long long at = (long long)clampi(past + j, 0, max_pos - 1) * half;
    const float kv = rotary ? rope_elem(kx, d, rot, interleaved, cos_c + at, sin_c + at)
                            : ld(kx, d);
    st(kn, (long long)j * D + d, kv);
    st(vn, (long long)j * D + d, ld(v_new + r * v_row + col, d));
  }
}

// Rows of a window-sized cache (sliding_window_cache=1) holding tokens after `total` tokens:
// total until the cache is full, then compacted in blocks of cap - window + 1 rows
// (core.op_rules.windowed_cache_length; cap >= window >= 1, checked on the host).
DEVI int window_rows(int total, int cap, int window) {
  if (total <= cap) return total;
  const int block = cap - window + 1;
  return total - block * ((total - cap + block - 1) / block);
}
"""
