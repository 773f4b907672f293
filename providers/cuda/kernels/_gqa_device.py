"""Device helpers of the GroupQueryAttention kernels (``contrib_attention``'s and the flash
prompt kernel's, ``_flash``): rotary embedding of a head row, and the rows a window-sized KV
cache holds. Appended after ``_common.DEVICE_COMMON`` (they use its ``ld``)."""

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

DEVI int clampi(int v, int lo, int hi) { return v < lo ? lo : (v > hi ? hi : v); }

// Rows of a window-sized cache (sliding_window_cache=1) holding tokens after `total` tokens:
// total until the cache is full, then compacted in blocks of cap - window + 1 rows
// (core.op_rules.windowed_cache_length; cap >= window >= 1, checked on the host).
DEVI int window_rows(int total, int cap, int window) {
  if (total <= cap) return total;
  const int block = cap - window + 1;
  return total - block * ((total - cap + block - 1) / block);
}
"""
