"""CUDA kernels: onnxruntime's skip (residual) normalizations and the com.microsoft RMS norm.

SkipSimplifiedLayerNormalization / SkipLayerNormalization add ``skip`` (and ``bias``) to the
input in float32, normalize that sum over the last axis and optionally write the sum itself
(output 3, ``input_skip_bias_sum``). One block per row; the sum is recomputed for the second
pass instead of staged, so any row width works. The ``mean`` output of the RMS variant is
zeros, as in onnxruntime.
"""

from __future__ import annotations

import numpy as np

from onnx_genrt.core.kernels import MS_DOMAIN, KernelContext

from ._common import DEVICE_COMMON, F32, contiguous, function, out, row_threads, storage
from ._registry import REGISTRY
from .normalization import _stash_check, simplified_layer_norm, staged_rms

REGISTRY.register("SimplifiedLayerNormalization", since=1, domain=MS_DOMAIN, check=_stash_check)(
    simplified_layer_norm
)

_SOURCE = (
    DEVICE_COMMON
    + r"""
template <typename S, typename W>
DEVI float skip_sum(const S* x, const S* skip, const W* bias, long long base, long long sbase,
                    long long j, int has_bias) {
  float h = ld(x, base + j) + ld(skip, sbase + j);
  if (has_bias) h += ld(bias, j);
  return h;
}

// One block per row of cols; skip has skip_rows rows (broadcast over the leading dims).
template <typename S, typename W>
__global__ void skip_norm_rows(const S* __restrict__ x, const S* __restrict__ skip,
                               const W* __restrict__ gamma, const W* __restrict__ beta,
                               const W* __restrict__ bias, S* __restrict__ y,
                               S* __restrict__ sum_out, float* __restrict__ mean_out,
                               float* __restrict__ inv_out, long long cols, long long skip_rows,
                               float eps, int rms, int has_beta, int has_bias, int want_sum,
                               int want_mean, int want_inv) {
  __shared__ float sh[33];
  GRID_WAIT();
  GRID_LAUNCH_DEPENDENTS();
  const long long row = blockIdx.x;
  const long long base = row * cols, sbase = (row % skip_rows) * cols;
  float s = 0.f, ss = 0.f;
  for (long long j = threadIdx.x; j < cols; j += blockDim.x) {
    const float h = skip_sum(x, skip, bias, base, sbase, j, has_bias);
    s += h;
    ss += h * h;
    if (want_sum) st(sum_out, base + j, h);
  }
  float mean = 0.f, var;
  if (rms) {
    var = block_sum(ss, sh) / (float)cols;
  } else {
    mean = block_sum(s, sh) / (float)cols;
    float dd = 0.f;
    for (long long j = threadIdx.x; j < cols; j += blockDim.x) {
      const float c = skip_sum(x, skip, bias, base, sbase, j, has_bias) - mean;
      dd += c * c;
    }
    var = block_sum(dd, sh) / (float)cols;
  }
  const float inv = rsqrtf(var + eps);
  for (long long j = threadIdx.x; j < cols; j += blockDim.x) {
    float v = (skip_sum(x, skip, bias, base, sbase, j, has_bias) - mean) * inv * ld(gamma, j);
    if (has_beta) v += ld(beta, j);
    st(y, base + j, v);
  }
  if (threadIdx.x == 0) {
    if (want_mean) mean_out[row] = mean;
    if (want_inv) inv_out[row] = inv;
  }
}

// RMS variant for rows of at most 4 * blockDim.x: one read of x and skip, kept in registers
// between the sum of squares and the scaling (same arithmetic, in the same order, as above).
template <typename S, typename W>
__global__ void skip_rms_rows_reg(const S* __restrict__ x, const S* __restrict__ skip,
                                  const W* __restrict__ gamma, const W* __restrict__ bias,
                                  S* __restrict__ y, S* __restrict__ sum_out,
                                  float* __restrict__ mean_out, float* __restrict__ inv_out,
                                  long long cols, long long skip_rows, float eps, int has_bias,
                                  int want_sum, int want_mean, int want_inv) {
  __shared__ float sh[33];
  GRID_WAIT();
  GRID_LAUNCH_DEPENDENTS();
  const long long row = blockIdx.x;
  const long long base = row * cols, sbase = (row % skip_rows) * cols;
  float h[4];
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const long long j = threadIdx.x + (long long)i * blockDim.x;
    h[i] = 0.f;
    if (j < cols) {
      h[i] = skip_sum(x, skip, bias, base, sbase, j, has_bias);
      ss += h[i] * h[i];
      if (want_sum) st(sum_out, base + j, h[i]);
    }
  }
  const float inv = rsqrtf(block_sum(ss, sh) / (float)cols + eps);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const long long j = threadIdx.x + (long long)i * blockDim.x;
    if (j < cols) st(y, base + j, (h[i] - 0.f) * inv * ld(gamma, j));
  }
  if (threadIdx.x == 0) {
    if (want_mean) mean_out[row] = 0.f;
    if (want_inv) inv_out[row] = inv;
  }
}
"""
)


def _wants(ctx: KernelContext, index: int) -> bool:
    names = ctx.node.output_names
    return index < len(names) and bool(names[index])


def _skip_norm(ctx: KernelContext, x, skip, gamma, beta, bias, rms: bool):
    desc = ctx.node.describe()
    if x.ndim < 1:
        raise ValueError(f"{desc}: input must have rank >= 1")
    cols = int(x.shape[-1])
    rows = int(x.size // cols) if cols else 0
    if skip.dtype != x.dtype:
        raise TypeError(f"{desc}: skip dtype {skip.dtype} differs from input {x.dtype}")
    if cols and (skip.shape[-1] != cols or skip.size == 0 or rows % (skip.size // cols)):
        raise ValueError(
            f"{desc}: skip shape {list(skip.shape)} does not fit input {list(x.shape)}"
        )
    skip_rows = max(1, int(skip.size // cols)) if cols else 1
    for what, p in (("gamma", gamma), ("beta", beta), ("bias", bias)):
        if p is not None and p.size != cols:
            raise ValueError(f"{desc}: {what} has {p.size} elements, expected {cols}")
    n_out = max(1, len(ctx.node.output_names))
    stat = tuple(x.shape[:-1]) + (1,)
    y = out(ctx, 0, x.shape, x.dtype)
    mean = out(ctx, 1, stat, F32) if _wants(ctx, 1) else y
    inv = out(ctx, 2, stat, F32) if _wants(ctx, 2) else y
    total = out(ctx, 3, x.shape, x.dtype) if _wants(ctx, 3) else y
    if rows and cols:
        s_x, s_w = storage(ctx, x.dtype), storage(ctx, gamma.dtype)
        for p in (beta, bias):
            if p is not None and p.dtype != gamma.dtype:
                raise TypeError(f"{desc}: beta/bias dtype must match gamma ({gamma.dtype})")
        g = contiguous(ctx, gamma)
        bt = contiguous(ctx, beta) if beta is not None else g
        bs = contiguous(ctx, bias) if bias is not None else g
        eps = float(ctx.attr("epsilon", 1e-12))
        plain = rms and beta is None and bias is None and not (_wants(ctx, 1) or _wants(ctx, 2))
        if plain and staged_rms(ctx, x, skip, gamma, y, total if _wants(ctx, 3) else None, eps):
            return y if n_out == 1 else (y, mean, inv, total)[:n_out]
        threads = row_threads(cols)
        if rms and beta is None and cols <= 4 * threads:
            fn = function(_SOURCE, f"skip_rms_rows_reg<{s_x}, {s_w}>")
            args = (contiguous(ctx, x), contiguous(ctx, skip), g, bs, y, total, mean, inv)
            args += (np.int64(cols), np.int64(skip_rows))
            args += (np.float32(float(ctx.attr("epsilon", 1e-12))), np.int32(bias is not None))
            args += (np.int32(_wants(ctx, 3)), np.int32(_wants(ctx, 1)), np.int32(_wants(ctx, 2)))
            fn((rows,), (threads,), args)
            return y if n_out == 1 else (y, mean, inv, total)[:n_out]
        fn = function(_SOURCE, f"skip_norm_rows<{s_x}, {s_w}>")
        args = (contiguous(ctx, x), contiguous(ctx, skip), g, bt, bs, y, total, mean, inv)
        args += (
            np.int64(cols),
            np.int64(skip_rows),
            np.float32(float(ctx.attr("epsilon", 1e-12))),
            np.int32(rms),
            np.int32(beta is not None),
            np.int32(bias is not None),
            np.int32(_wants(ctx, 3)),
            np.int32(_wants(ctx, 1)),
            np.int32(_wants(ctx, 2)),
        )
        fn((rows,), (row_threads(cols),), args)
    if n_out == 1:
        return y
    return (y, mean, inv, total)[:n_out]


@REGISTRY.register("SkipSimplifiedLayerNormalization", since=1, domain=MS_DOMAIN)
def skip_simplified_layer_norm(ctx: KernelContext, x, skip, gamma, bias=None):
    """RMS norm of x + skip (+ bias); outputs (y, mean=0, inv_std_var, input_skip_bias_sum)."""
    return _skip_norm(ctx, x, skip, gamma, None, bias, rms=True)


@REGISTRY.register("SkipLayerNormalization", since=1, domain=MS_DOMAIN)
def skip_layer_norm(ctx: KernelContext, x, skip, gamma, beta=None, bias=None):
    """LayerNorm of x + skip (+ bias) with gamma (and beta) over the last axis."""
    return _skip_norm(ctx, x, skip, gamma, beta, bias, rms=False)
