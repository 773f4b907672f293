"""CUDA kernels of the runtime's own ops (domain ``onnx_genrt``, declared in
``core.genrt_ops``): SiluMul, ArgMaxProb, the MTP chain's bookkeeping (MTPAccept,
MTPNextInputs) and the norm / SiluMul GEMV fusions (NormMatMul, NormMatMulNBits,
SiluMulMatMul, SiluMulMatMulNBits).

``MTPAccept``: after a verify step, the accepted draft count, the token and hidden row
there. ``MTPNextInputs``: the next verify step's start, ids, positions, mask and draft count.
Both run one block and read every input before any thread writes (outputs may alias inputs:
the chain advances its start and draft count in place); one launch each for what
``engine.mtp_chain`` otherwise spells out in a dozen small standard ops.

``NormMatMul(x, skip, gamma, W)`` and ``NormMatMulNBits(x, skip, gamma, B, scales, ...)``
compute ``MatMul(norm(x + skip), W)`` where ``norm`` is onnxruntime's (Skip)Simplified
LayerNormalization; outputs ``(y, sum, normed)``: ``sum`` = x + skip (the residual the next
layer reads; empty name when not wanted) and ``normed``, a planned buffer used only when the
fused kernel does not apply. See ``session.fusion.fuse_norm_matmul``.

On decode and verify steps (M <= 16, the GEMV kernels, activations of at most
``STAGE_MAX_BYTES``) each block of the GEMV (``gemv_nk`` and the 4-bit chunk16 GEMVs) makes
the activations in shared memory (``stage_act``: the norm with NORM = 1, SiLU gating with
NORM = 2) while its first weight loads are in flight. Other shapes run the norm or SiluMul
kernel into the planned buffer and then the plain matmul.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import cupy
import numpy as np
from onnx import TensorProto, helper

from onnx_genrt.core.kernels import GENRT_DOMAIN, MS_DOMAIN, KernelContext, NodeInfo
from onnx_genrt.core.op_rules import (
    fused_matmul_nbits_unsupported,
    fused_projection,
    mtp_accept_drafts,
    silu_mul_half,
)
from onnx_genrt.core.token_sampling import (
    PHILOX_M,
    PHILOX_ROUNDS,
    PHILOX_W,
    SAMPLE_STREAM,
    check_sample_shapes,
)

from ._common import (
    ARG_KEYS,
    BF16,
    DEVICE_COMMON,
    FLOAT_DTYPES,
    OPTIONS,
    contiguous,
    function,
    out,
    storage,
)
from ._gated_mlp import launch_gated_mlp, mlp_problem
from ._registry import REGISTRY
from .contrib_norm import skip_simplified_layer_norm
from .contrib_quant import matmul_nbits
from .elementwise import PREAMBLE, broadcast_shape
from .matmul import TransposedWeight, gated_gemv, matmul, transpose_weight
from .normalization import simplified_layer_norm
from .reduce import argmax_rows

_SOURCE = (
    DEVICE_COMMON
    + r"""
template <typename S, typename D>
__global__ void mtp_accept(const long long* __restrict__ ids,
                           const long long* __restrict__ argmax, const S* __restrict__ hidden,
                           const long long* __restrict__ count, long long* __restrict__ accepted,
                           long long* __restrict__ token, D* __restrict__ row, int k, int H) {
  __shared__ int acc;
  GRID_WAIT();
  GRID_LAUNCH_DEPENDENTS();
  if (threadIdx.x == 0) {
    const long long n = count[0];
    int a = 0;
    while (a < k && a < n && argmax[a] == ids[a + 1]) ++a;
    acc = a;
  }
  __syncthreads();
  const int a = acc;
  for (int j = threadIdx.x; j < H; j += blockDim.x) st(row, j, ld(hidden, (long long)a * H + j));
  if (threadIdx.x == 0) {
    accepted[0] = a;
    token[0] = argmax[a];
  }
}

__global__ void mtp_next_inputs(const long long* accepted, const long long* start,
                                const long long* token, const long long* drafts,
                                const float* conf, long long* next_start, long long* next_ids,
                                long long* next_count, long long* next_pos,
                                long long* next_mask, int k, int L, float min_conf,
                                int want_pos, int want_mask) {
  GRID_WAIT();
  GRID_LAUNCH_DEPENDENTS();
  const long long begin = start[0] + accepted[0] + 1;
  const long long tok = token[0];
  __syncthreads();  // every thread has read start before next_start (maybe the same) changes
  if (want_mask)
    for (int j = threadIdx.x; j < L; j += blockDim.x) next_mask[j] = j < begin + k + 1 ? 1 : 0;
  for (int j = threadIdx.x; j <= k; j += blockDim.x) {
    next_ids[j] = j == 0 ? tok : drafts[j - 1];
    if (want_pos) next_pos[j] = begin + j;
  }
  if (threadIdx.x == 0) {
    int c = 0;
    while (c < k && !(conf[c] < min_conf)) ++c;
    next_count[0] = c;
    next_start[0] = begin;
  }
}
"""
)


@REGISTRY.register("MTPAccept", since=1, domain=GENRT_DOMAIN)
def mtp_accept(ctx: KernelContext, ids, argmax, hidden, count):
    """(accepted [1], token [1, 1], hidden row [1, 1, H] as ``to``); see the CPU kernel."""
    k = mtp_accept_drafts(ctx.node, ids.shape, argmax.shape, hidden.shape)
    dtype = helper.tensor_dtype_to_np_dtype(int(ctx.attr("to", TensorProto.FLOAT)))
    size = int(hidden.shape[-1])
    accepted = out(ctx, 0, (1,), np.int64)
    token = out(ctx, 1, (1, 1), np.int64)
    row = out(ctx, 2, (1, 1, size), dtype)
    name = f"mtp_accept<{storage(ctx, hidden.dtype)}, {storage(ctx, np.dtype(dtype))}>"
    args = (contiguous(ctx, ids), contiguous(ctx, argmax), contiguous(ctx, hidden))
    args += (contiguous(ctx, count), accepted, token, row, np.int32(k), np.int32(size))
    function(_SOURCE, name)((1,), (256,), args)
    return accepted, token, row


@REGISTRY.register("MTPNextInputs", since=1, domain=GENRT_DOMAIN)
def mtp_next_inputs(ctx: KernelContext, accepted, start, token, drafts, confidences):
    """(start, ids, draft count[, positions[, mask]]) of the next verify step."""
    k = int(drafts.shape[-1])
    names = ctx.node.output_names
    if confidences.dtype != np.float32:
        raise TypeError(f"{ctx.node.describe()}: confidences must be float32")
    next_start = out(ctx, 0, (1,), np.int64)
    next_ids = out(ctx, 1, (1, k + 1), np.int64)
    next_count = out(ctx, 2, (1,), np.int64)
    want_pos = len(names) > 3 and bool(names[3])
    want_mask = len(names) > 4 and bool(names[4])
    pos = out(ctx, 3, (1, k + 1), np.int64) if want_pos else next_ids
    length = int(ctx.attr("mask_length", 0))
    if want_mask and length <= 0:
        raise ValueError(f"{ctx.node.describe()}: the attention mask output needs mask_length")
    mask = out(ctx, 4, (1, length), np.int64) if want_mask else next_ids
    args = (contiguous(ctx, accepted), contiguous(ctx, start), contiguous(ctx, token))
    args += (contiguous(ctx, drafts), contiguous(ctx, confidences))
    args += (next_start, next_ids, next_count, pos, mask, np.int32(k), np.int32(length))
    args += (np.float32(float(ctx.attr("min_confidence", 0.0))), np.int32(want_pos))
    args += (np.int32(want_mask),)
    function(_SOURCE, "mtp_next_inputs")((1,), (256,), args)
    results = [next_start, next_ids, next_count]
    if len(names) > 3:
        results.append(pos)
    if len(names) > 4:
        results.append(mask)
    return tuple(results)


# ----------------------------------------------------------------------------- ArgMaxProb


@REGISTRY.register("ArgMaxProb", since=1, domain=GENRT_DOMAIN)
def argmax_prob(ctx: KernelContext, x: cupy.ndarray) -> tuple[cupy.ndarray, cupy.ndarray]:
    """(ArgMax, max of Softmax) over the last axis, keepdims=0: a draft and its probability
    in one launch (see ``session.fusion.fuse_argmax_prob``)."""
    if x.ndim == 0 or x.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{ctx.node.describe()}: needs a float32/float16/bfloat16 tensor of rank >= 1, "
            f"got {x.dtype}"
        )
    idx = out(ctx, 0, x.shape[:-1], np.int64)
    prob = out(ctx, 1, x.shape[:-1], x.dtype)
    argmax_rows(ctx, x, idx, prob=prob)
    return idx, prob


# ----------------------------------------------------------------------------- SampleTokens

_SAMPLE_SOURCE = (
    DEVICE_COMMON
    + ARG_KEYS
    + f"""
#define PHILOX_M0 {PHILOX_M[0]:#x}u
#define PHILOX_M1 {PHILOX_M[1]:#x}u
#define PHILOX_W0 {PHILOX_W[0]:#x}u
#define PHILOX_W1 {PHILOX_W[1]:#x}u
#define PHILOX_ROUNDS {PHILOX_ROUNDS}
#define SAMPLE_STREAM {SAMPLE_STREAM:#x}u
"""
    + r"""
// Philox4x32-10 of counter (c0, c1, c2, c3) under key (k0, k1) into w (core.token_sampling).
DEVI void philox4x32(unsigned int (&w)[4], unsigned int c0, unsigned int c1, unsigned int c2,
                     unsigned int c3, unsigned int k0, unsigned int k1) {
#pragma unroll
  for (int r = 0; r < PHILOX_ROUNDS; ++r) {
    if (r) { k0 += PHILOX_W0; k1 += PHILOX_W1; }
    const unsigned int h0 = __umulhi(PHILOX_M0, c0), l0 = PHILOX_M0 * c0;
    const unsigned int h1 = __umulhi(PHILOX_M1, c2), l1 = PHILOX_M1 * c2;
    c0 = h1 ^ c1 ^ k0; c1 = l1; c2 = h0 ^ c3 ^ k1; c3 = l0;
  }
  w[0] = c0; w[1] = c1; w[2] = c2; w[3] = c3;
}

// The order key of a float for selection: unsigned-comparable, -0 as +0, NaN lowest (-inf).
DEVI unsigned int select_key(float v) {
  const unsigned int u = __float_as_uint(v);
  if (v != v) return 0x007fffffu;  // NaN counts as -inf
  return v == 0.f ? 0x80000000u : ((u & 0x80000000u) ? ~u : (u | 0x80000000u));
}

// The key of the k-th largest value of row xr (0 < k < cols), or a lower key with the same
// entries at or above it: a radix select, 8 bits a pass from the top, each pass a histogram in
// shared memory of the values that share the prefix (the lanes of a warp with one bin add
// once: most logits share their top bits), done once every value of the chosen bin is among
// the k largest (the prefix then bounds them).
template <typename S>
DEVI unsigned int kth_key(const S* xr, long long cols, long long k, unsigned int* hist,
                          unsigned int* pick) {
  unsigned int prefix = 0u, mask = 0u;
  long long left = k;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = threadIdx.x; b < 256; b += blockDim.x) hist[b] = 0u;
    __syncthreads();
    for (long long c0 = 0; c0 < cols; c0 += blockDim.x) {  // whole warps: match_any
      const long long c = c0 + threadIdx.x;
      const unsigned int key = c < cols ? select_key(ld(xr, c)) : 0u;
      const bool in = c < cols && (key & mask) == prefix;
      const unsigned int bin = in ? (key >> shift) & 255u : 256u;
      const unsigned int peers = __match_any_sync(0xffffffffu, bin);
      if (in && (int)(threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd(&hist[bin], __popc(peers));
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      long long above = 0;
      int b = 255;
      for (; b > 0 && above + hist[b] < left; --b) above += hist[b];
      pick[0] = (unsigned int)b;
      pick[1] = (unsigned int)(left - above);
      pick[2] = hist[b];
    }
    __syncthreads();
    prefix |= pick[0] << shift;
    mask |= 255u << shift;
    left = pick[1];
    const bool whole = pick[2] == pick[1];  // the bin's every value is kept
    __syncthreads();
    if (whole) break;
  }
  return prefix;
}

// SampleTokens: per row, the first largest Gumbel score logits / t - log(-log(u)) over the
// entries at or above the row's top_k floor (the logits alone where t <= 0; NaN never wins);
// one block per row, one Philox call per four vocabulary entries.
template <typename S>
__global__ void sample_tokens_rows(const S* __restrict__ x, const float* __restrict__ temp,
                                   const long long* __restrict__ seed,
                                   const long long* __restrict__ offset,
                                   const long long* __restrict__ top_k, int with_top_k,
                                   long long* __restrict__ tokens, long long cols) {
  __shared__ unsigned long long shk[32];
  __shared__ unsigned int hist[256];
  __shared__ unsigned int pick[3];
  GRID_WAIT();
  GRID_LAUNCH_DEPENDENTS();
  const long long r = blockIdx.x;
  const S* xr = x + r * cols;
  const float t = temp[r];
  const bool hot = t > 0.f;
  const long long k = with_top_k ? top_k[r] : 0;
  // Entries whose key is below the floor's are out (a -inf floor keeps every entry).
  const unsigned int floor = (hot && k > 0 && k < cols) ? kth_key(xr, cols, k, hist, pick)
                                                        : 0u;
  const unsigned long long s = (unsigned long long)seed[r], o = (unsigned long long)offset[r];
  const unsigned int k0 = (unsigned int)s, k1 = (unsigned int)(s >> 32);
  const unsigned int c1 = (unsigned int)o, c2 = (unsigned int)(o >> 32);
  unsigned long long best = 0ull;
  const long long blocks = (cols + 3) >> 2;
  for (long long b = threadIdx.x; b < blocks; b += blockDim.x) {
    float xs[4];
    bool kept = false;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const long long v = b * 4 + j;
      xs[j] = v < cols ? ld(xr, v) : 0.f;
      kept = kept || (v < cols && !(xs[j] == xs[j] && select_key(xs[j]) < floor));
    }
    if (!kept) continue;  // every entry below the top-k floor: no noise to draw
    unsigned int w[4] = {0u, 0u, 0u, 0u};
    if (hot) philox4x32(w, (unsigned int)b, c1, c2, SAMPLE_STREAM, k0, k1);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const long long v = b * 4 + j;
      if (v < cols) {
        float score = xs[j];
        if (hot) {
          if (score == score && select_key(score) < floor) continue;
          const float u = ((float)(w[j] >> 9) * 2.f + 1.f) * 5.9604644775390625e-8f;  // 2^-24
          score = score / t - logf(-logf(u));
        }
        if (score != score) score = __int_as_float(0xff800000);  // NaN: -inf, never the pick
        best = kmax(best, arg_key(score, v, 0));
      }
    }
  }
  best = block_kmax(best, shk);
  if (threadIdx.x == 0) tokens[r] = arg_index(best, 0);
}
"""
)


@REGISTRY.register("SampleTokens", since=1, domain=GENRT_DOMAIN)
def sample_tokens(
    ctx: KernelContext,
    logits: cupy.ndarray,
    temperature: cupy.ndarray,
    seed: cupy.ndarray,
    offset: cupy.ndarray,
    top_k: cupy.ndarray | None = None,
) -> cupy.ndarray:
    """A token per row from ``softmax(logits / temperature)`` (``core.token_sampling``):
    Gumbel-max with Philox4x32-10 noise within each row's top_k (a radix select) in one
    launch, one block per row."""
    desc = ctx.node.describe()
    if logits.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{desc}: logits must be float32/float16/bfloat16, got {logits.dtype}")
    named = [("temperature", temperature, np.float32), ("seed", seed, np.int64),
             ("offset", offset, np.int64)]  # fmt: skip
    if top_k is not None:
        named.append(("top_k", top_k, np.int64))
    rows = check_sample_shapes(desc, logits.shape, *((n, v.shape) for n, v, _ in named))
    for name, value, dtype in named:
        if value.dtype != dtype:
            raise TypeError(f"{desc}: {name} must be {np.dtype(dtype)}, got {value.dtype}")
    tokens = out(ctx, 0, logits.shape[:-1], np.int64)
    if rows:
        cols = int(logits.shape[-1])
        fn = function(_SAMPLE_SOURCE, f"sample_tokens_rows<{storage(ctx, logits.dtype)}>")
        fn(
            (rows,),
            (1024,),
            (
                contiguous(ctx, logits),
                contiguous(ctx, temperature),
                contiguous(ctx, seed),
                contiguous(ctx, offset),
                contiguous(ctx, top_k) if top_k is not None else seed,  # unread without it
                np.int32(top_k is not None),
                tokens,
                np.int64(cols),
            ),
        )
    return tokens


# ----------------------------------------------------------------------------- SiluMul

_SILU_MUL = cupy.ElementwiseKernel(
    "T g, T u",
    "T y",
    "typedef GenrtAcc<T>::type A; const A v = (A)g; "
    "const A s = (A)1 / ((A)1 + genrt_math_exp(-v)); y = (T)((v * s) * (A)u);",
    "genrt_silu_mul",
    preamble=PREAMBLE,
    options=OPTIONS,
)


@REGISTRY.register("SiluMul", since=1, domain=GENRT_DOMAIN)
def silu_mul(ctx: KernelContext, g: cupy.ndarray, u: cupy.ndarray | None = None) -> cupy.ndarray:
    """The runtime's fused gated-MLP activation: ``g * sigmoid(g) * u`` in one launch; with
    one input and ``split=1``, g and u are the halves of its last axis."""
    if u is None:
        half = silu_mul_half(ctx.node, g.shape)
        g, u = g[..., :half], g[..., half:]
    if g.dtype != u.dtype or (g.dtype.kind != "f" and g.dtype != BF16):
        raise TypeError(
            f"{ctx.node.describe()}: SiluMul needs two equal float dtypes, got "
            f"{g.dtype} and {u.dtype}"
        )
    y = out(ctx, 0, broadcast_shape(g, u), g.dtype)
    if y.size:
        _SILU_MUL(g, u, y)
    return y


# ----------------------------------------------------------------------------- norm / SiluMul GEMV fusions

#: Shared memory a GEMV block may stage activations in (48 KiB without opting in, less
#: the kernels' own reduction buffers).
STAGE_MAX_BYTES = 46 << 10


def stage_bytes(a: cupy.ndarray) -> int:
    """Shared memory for the M x K activations of ``a`` (the launch's dynamic share)."""
    return int(a.size) * a.dtype.itemsize


def _stageable(a: cupy.ndarray, *inputs: cupy.ndarray | None) -> bool:
    """Whether ``stage_act`` can read ``inputs`` in 16-byte vectors and ``a`` fits."""
    rows_whole = a.ndim > 0 and (a.shape[-1] * a.dtype.itemsize) % 16 == 0
    aligned = all(t is None or t.data.ptr % 16 == 0 for t in inputs)
    return rows_whole and aligned and stage_bytes(a) <= STAGE_MAX_BYTES


#: Default of the CUDA provider's ``prologue_max_rows``: a verify step of 5 rows on the 0.5B
#: shape ran faster with the norm as its own kernel (docs/performance.md).
PROLOGUE_MAX_ROWS = 2


def _rows(a: cupy.ndarray) -> int:
    """M: the rows of ``a`` with its leading dims folded (the last one is K)."""
    return a.size // a.shape[-1] if a.ndim and a.shape[-1] else 0


def prologue_max_rows(ctx: KernelContext) -> int:
    """Rows up to which a GEMV makes its fused norm or SiluMul in shared memory (the CUDA
    provider's ``prologue_max_rows``); more rows run the prologue as its own kernel."""
    return int(ctx.option("prologue_max_rows", PROLOGUE_MAX_ROWS))


@dataclass
class FusedNorm:
    """The norm a GEMV kernel applies to its activations in shared memory (``gemv_nk`` and
    the 4-bit chunk16 GEMVs with NORM = 1), and the unfused way for other shapes."""

    ON_THE_FLY = 1  # the GEMVs' NORM template value
    skip: cupy.ndarray | None
    gamma: cupy.ndarray
    sum_out: cupy.ndarray | None
    eps: float
    unfused: Callable[[], cupy.ndarray]
    max_rows: int = PROLOGUE_MAX_ROWS
    stage_bytes = staticmethod(stage_bytes)

    def fits_on_the_fly(self, x: cupy.ndarray) -> bool:
        """Whether the GEMV's blocks can stage the normalized rows of ``x`` (at most
        ``max_rows`` of them)."""
        return (
            _rows(x) <= self.max_rows
            and self.gamma.dtype == x.dtype
            and (self.skip is None or (self.skip.shape == x.shape and self.skip.dtype == x.dtype))
            and x.flags.c_contiguous
            and _stageable(x, x, self.skip, self.gamma, self.sum_out)
        )

    def kernel_args(self, x: cupy.ndarray) -> tuple:
        """(skip, gamma, sum_out, eps, flags) as the NORM = 1 kernels take them."""
        flags = (self.skip is not None) | (2 * (self.sum_out is not None))
        skip = self.skip if self.skip is not None else x
        total = self.sum_out if self.sum_out is not None else x
        return (skip, self.gamma, total, np.float32(self.eps), np.int32(flags))


def _outputs(ctx: KernelContext, y, total, normed):
    return (y, total if total is not None else y, normed)[: max(1, len(ctx.node.output_names))]


def _prepare(ctx: KernelContext, x, skip, gamma) -> tuple[FusedNorm, cupy.ndarray]:
    """The fused norm of one call, and its ``normed`` output buffer."""
    desc = ctx.node.describe()
    k = int(x.shape[-1])
    if gamma.size != k:
        raise ValueError(f"{desc}: gamma has {gamma.size} elements, the rows have {k}")
    names = ctx.node.output_names
    want_sum = len(names) > 1 and bool(names[1])
    if want_sum and skip is None:
        raise ValueError(f"{desc}: a sum output needs a skip input")
    total = out(ctx, 1, x.shape, x.dtype) if want_sum else None
    eps = float(ctx.attr("epsilon", 1e-5))
    gamma_dtype = gamma.dtype
    normed = out(ctx, 2, x.shape, x.dtype if skip is not None else gamma_dtype)

    def unfused() -> cupy.ndarray:
        sub_planned = [normed, None, None, total]
        if skip is not None:
            node = _norm_node(ctx, "SkipSimplifiedLayerNormalization", MS_DOMAIN, eps, want_sum)
            sub = KernelContext(node, ctx.provider, sub_planned)
            return _first(skip_simplified_layer_norm(sub, x, skip, gamma))
        node = _norm_node(ctx, "SimplifiedLayerNormalization", "", eps, False)
        return _first(
            simplified_layer_norm(KernelContext(node, ctx.provider, sub_planned), x, gamma)
        )

    fused = FusedNorm(
        contiguous(ctx, skip) if skip is not None else None,
        contiguous(ctx, gamma),
        total,
        eps,
        unfused,
        prologue_max_rows(ctx),
    )
    return fused, normed


def _activations(ctx: KernelContext, x, fused: FusedNorm):
    """(x, the norm for the GEMV to apply) or, when the norm changes the dtype (a gamma of
    another type), (the normalized activations, None)."""
    if fused.gamma.dtype != x.dtype:
        return fused.unfused(), None
    return contiguous(ctx, x), fused


def _projection_ctx(ctx: KernelContext) -> KernelContext:
    """The context the projection's own kernel expects (its node, output 0's buffer)."""
    return KernelContext(fused_projection(ctx.node), ctx.provider, ctx.planned[:1], ctx.state)


def _first(result):
    return result[0] if isinstance(result, tuple | list) else result


def _norm_node(ctx: KernelContext, op: str, domain: str, eps: float, want_sum: bool) -> NodeInfo:
    outputs = ("normed",) if not want_sum else ("normed", "", "", "sum")
    return NodeInfo(
        op, f"{ctx.node.name}/norm", domain, 1, {"epsilon": eps, "axis": -1}, (), outputs
    )


def _weight_prepack(provider, node: NodeInfo, index: int, host: np.ndarray):
    """The fused MatMul's weight (input 3) prepacked as MatMul's input 1 is."""
    return transpose_weight(provider, node, 1, host) if index == 3 else None


@REGISTRY.register("NormMatMul", since=1, domain=GENRT_DOMAIN, prepack=_weight_prepack)
def norm_matmul(ctx: KernelContext, x, skip, gamma, w):
    """MatMul(RMSNorm(x (+ skip)) * gamma, W); outputs (y, x + skip, normed)."""
    fused, normed = _prepare(ctx, x, skip, gamma)
    a, norm = _activations(ctx, x, fused)
    y = matmul(_projection_ctx(ctx), a, w, norm=norm)
    return _outputs(ctx, y, fused.sum_out, normed)


@REGISTRY.register(
    "NormMatMulNBits", since=1, domain=GENRT_DOMAIN, check=fused_matmul_nbits_unsupported
)
def norm_matmul_nbits(
    ctx: KernelContext, x, skip, gamma, b, scales, zero_points=None, g_idx=None, bias=None
):
    """MatMulNBits(RMSNorm(x (+ skip)) * gamma, B); outputs (y, x + skip, normed)."""
    fused, normed = _prepare(ctx, x, skip, gamma)
    a, norm = _activations(ctx, x, fused)
    y = matmul_nbits(_projection_ctx(ctx), a, b, scales, zero_points, g_idx, bias, norm=norm)
    return _outputs(ctx, y, fused.sum_out, normed)


def _gated_projection(ctx: KernelContext, x, skip, gamma, project: Callable) -> tuple:
    """(y, x + skip, normed, gate_up) of NormMatMul(NBits)SiluMul. ``project(pctx, a, norm,
    gated)`` runs the projection: gated, its GEMV writes the activations (None where it does
    not take the rows; gate_up then unused); else the projection into the planned gate_up
    buffer, then the SiluMul kernel."""
    fused, normed = _prepare(ctx, x, skip, gamma)
    a, norm = _activations(ctx, x, fused)
    y = project(_projection_ctx(ctx), a, norm, True)
    proj = KernelContext(fused_projection(ctx.node), ctx.provider, ctx.planned[3:4], ctx.state)
    if y is not None:
        names = ctx.node.output_names
        wanted = len(names) > 3 and bool(names[3])
        gate_up = out(proj, 0, (*y.shape[:-1], 2 * y.shape[-1]), y.dtype) if wanted else y
    else:
        gate_up = project(proj, a, norm, False)
        node = NodeInfo(
            "SiluMul", f"{ctx.node.name}/silu", GENRT_DOMAIN, 1, {"split": 1}, (), ("y",)
        )
        y = silu_mul(KernelContext(node, ctx.provider, ctx.planned[:1]), gate_up)
    gated = (y, fused.sum_out if fused.sum_out is not None else y, normed, gate_up)
    return gated[: max(1, len(ctx.node.output_names))]


@REGISTRY.register("NormMatMulSiluMul", since=1, domain=GENRT_DOMAIN, prepack=_weight_prepack)
def norm_matmul_silu_mul(ctx: KernelContext, x, skip, gamma, w):
    """SiluMul(split=1) of NormMatMul: outputs (y, x + skip, normed, gate_up); gated on
    ``gemv_nk`` (``gated_gemv``) where it takes the rows."""

    def project(pctx: KernelContext, a, norm, gated: bool):
        if not gated:
            return matmul(pctx, a, w, norm=norm)
        return gated_gemv(pctx, a, w, norm) if isinstance(w, TransposedWeight) else None

    return _gated_projection(ctx, x, skip, gamma, project)


@REGISTRY.register(
    "NormMatMulNBitsSiluMul", since=1, domain=GENRT_DOMAIN, check=fused_matmul_nbits_unsupported
)
def norm_matmul_nbits_silu_mul(
    ctx: KernelContext, x, skip, gamma, b, scales, zero_points=None, g_idx=None, bias=None
):
    """SiluMul(split=1) of NormMatMulNBits: outputs (y, x + skip, normed, gate_up); gated on
    the 16-byte-chunk 4-bit GEMVs where they take the rows."""

    def project(pctx: KernelContext, a, norm, gated: bool):
        weights = (b, scales, zero_points, g_idx, bias)
        return matmul_nbits(pctx, a, *weights, norm=norm, gated=gated)

    return _gated_projection(ctx, x, skip, gamma, project)


@dataclass
class FusedSilu:
    """The gated-MLP activation ``g * sigmoid(g) * u`` a GEMV kernel makes in shared
    memory (NORM = 2); ``g`` holds both halves when ``u`` is None (``split=1``)."""

    ON_THE_FLY = 2
    g: cupy.ndarray
    u: cupy.ndarray | None
    unfused: Callable[[], cupy.ndarray]
    max_rows: int = PROLOGUE_MAX_ROWS
    stage_bytes = staticmethod(stage_bytes)

    def fits_on_the_fly(self, a: cupy.ndarray) -> bool:
        """Whether the GEMV's blocks can stage ``a`` (the M x K view of the activations, at
        most ``max_rows`` rows)."""
        return (
            _rows(a) <= self.max_rows
            and self.g.flags.c_contiguous
            and (self.u is None or (self.u.flags.c_contiguous and self.u.dtype == self.g.dtype))
            and _stageable(a, self.g, self.u)
        )

    def kernel_args(self, a: cupy.ndarray) -> tuple:
        """(u, unused, unused, unused, flags): A_in is ``g``; flags & 4 says split."""
        u = self.u if self.u is not None else self.g
        return (u, self.g, self.g, np.float32(0.0), np.int32(4 if self.u is None else 0))


def _prepare_silu(ctx: KernelContext, g, u) -> tuple[FusedSilu, cupy.ndarray, cupy.ndarray]:
    """(the fused activation, the activations' shape as a view of g, its ``act`` output)."""
    desc = ctx.node.describe()
    if u is None:
        view = g[..., : silu_mul_half(ctx.node, g.shape)]
    else:
        if u.shape != g.shape or u.dtype != g.dtype:
            raise ValueError(f"{desc}: gate {list(g.shape)} and up {list(u.shape)} differ")
        view = g
    act = out(ctx, 1, view.shape, g.dtype)

    def unfused() -> cupy.ndarray:
        node = NodeInfo(
            "SiluMul", f"{ctx.node.name}/silu", GENRT_DOMAIN, 1, {"split": 1}, (), ("act",)
        )
        return silu_mul(KernelContext(node, ctx.provider, [act]), g, u)

    return FusedSilu(g, u, unfused, prologue_max_rows(ctx)), view, act


def _silu_weight_prepack(provider, node: NodeInfo, index: int, host: np.ndarray):
    """The fused MatMul's weight (input 2) prepacked as MatMul's input 1 is."""
    return transpose_weight(provider, node, 1, host) if index == 2 else None


#: The widest K at which a float-weight GEMV makes the SiLU activations itself; above it the
#: SiluMul kernel runs first (every block of the GEMV re-makes all K activations, and a float
#: weight row is too short a load to hide that). Fusing won at K=768 and lost at K=4864 on the
#: H200 (docs/performance.md); the threshold between the two is not tuned. 4-bit GEMVs always
#: fuse.
SILU_FLOAT_GEMV_MAX_K = 2048


@REGISTRY.register("SiluMulMatMul", since=1, domain=GENRT_DOMAIN, prepack=_silu_weight_prepack)
def silu_mul_matmul(ctx: KernelContext, g, u, w):
    """MatMul(g * sigmoid(g) * u, W) (g holding both halves with split=1); outputs (y, act).
    The GEMV makes the activations itself up to ``SILU_FLOAT_GEMV_MAX_K``."""
    fused, view, act = _prepare_silu(ctx, g, u)
    if view.shape[-1] > SILU_FLOAT_GEMV_MAX_K:
        y = matmul(_projection_ctx(ctx), fused.unfused(), w)
    else:
        y = matmul(_projection_ctx(ctx), view, w, norm=fused)
    return (y, act)[: max(1, len(ctx.node.output_names))]


@REGISTRY.register(
    "SiluMulMatMulNBits", since=1, domain=GENRT_DOMAIN, check=fused_matmul_nbits_unsupported
)
def silu_mul_matmul_nbits(
    ctx: KernelContext, g, u, b, scales, zero_points=None, g_idx=None, bias=None
):
    """MatMulNBits(g * sigmoid(g) * u, B); outputs (y, act)."""
    fused, view, act = _prepare_silu(ctx, g, u)
    y = matmul_nbits(_projection_ctx(ctx), view, b, scales, zero_points, g_idx, bias, norm=fused)
    return (y, act)[: max(1, len(ctx.node.output_names))]


# -- NormGatedMLP: a layer's MLP half as one cooperative grid (_gated_mlp) -------------------


def _mlp_prepack(provider, node: NodeInfo, index: int, host: np.ndarray):
    """Both projections' weights (inputs 3 and 4) prepacked as MatMul's input 1 is."""
    return transpose_weight(provider, node, 1, host) if index in (3, 4) else None


@REGISTRY.register("NormGatedMLP", since=1, domain=GENRT_DOMAIN, prepack=_mlp_prepack)
def norm_gated_mlp(ctx: KernelContext, x, skip, gamma, wgu, wd):
    """(y, x + skip, gate_up, act, normed): one cooperative grid where ``mlp_problem`` takes
    the call (gate_up and normed then only planned), else NormMatMul and SiluMulMatMul."""
    names = ctx.node.output_names
    want_sum = len(names) > 1 and bool(names[1])
    if want_sum and skip is None:
        raise ValueError(f"{ctx.node.describe()}: a sum output needs a skip input")
    eps = float(ctx.attr("epsilon", 1e-5))
    if mlp_problem(x, skip, gamma, wgu, wd) is not None:
        return _mlp_unfused(ctx, x, skip, gamma, wgu, wd, want_sum, eps)
    lead, f = tuple(x.shape[:-1]), int(wd.shape[0])
    y = out(ctx, 0, (*lead, int(wd.shape[1])), x.dtype)
    total = out(ctx, 1, x.shape, x.dtype) if want_sum else None
    gate_up = out(ctx, 2, (*lead, 2 * f), x.dtype)
    act = out(ctx, 3, (*lead, f), x.dtype)
    normed = out(ctx, 4, x.shape, x.dtype)
    launch_gated_mlp(ctx, x, skip, gamma, wgu, wd, (y, total, act), eps)
    return _mlp_outputs(names, y, total, gate_up, act, normed)


def _mlp_outputs(names, y, total, gate_up, act, normed) -> tuple:
    """The node's outputs, as many as it names (an unnamed sum gets y as a placeholder)."""
    return (y, total if total is not None else y, gate_up, act, normed)[: max(1, len(names))]


def _mlp_unfused(ctx: KernelContext, x, skip, gamma, wgu, wd, want_sum: bool, eps: float):
    """NormMatMul into the planned gate/up buffer (output 2), then SiluMulMatMul into y, its
    activations in the planned ``act`` buffer (output 3)."""
    opset = ctx.attr("projection_opset", 1)
    planned = list(ctx.planned) + [None] * (5 - len(ctx.planned))
    norm_node = NodeInfo(
        "NormMatMul",
        f"{ctx.node.name}/NormMatMul",
        GENRT_DOMAIN,
        1,
        {"epsilon": eps, "projection_opset": opset},
        ("x", "skip", "gamma", "W"),
        ("gate_up", "sum" if want_sum else "", "normed"),
    )
    norm_ctx = KernelContext(norm_node, ctx.provider, [planned[2], planned[1], planned[4]])
    gate_up, total, normed = norm_matmul(norm_ctx, x, skip, gamma, wgu)
    silu_node = NodeInfo(
        "SiluMulMatMul",
        f"{ctx.node.name}/SiluMulMatMul",
        GENRT_DOMAIN,
        1,
        {"split": 1, "projection_opset": opset},
        ("g", "", "W"),
        ("y", "act"),
    )
    silu_ctx = KernelContext(silu_node, ctx.provider, [planned[0], planned[3]])
    y, act = silu_mul_matmul(silu_ctx, gate_up, None, wd)
    total = total if want_sum else None
    return _mlp_outputs(ctx.node.output_names, y, total, gate_up, act, normed)
