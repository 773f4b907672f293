"""CUDA kernels for the MTP chain's bookkeeping ops (domain ``onnx_genrt``): one launch each
for what ``engine.mtp_chain`` otherwise spells out in a dozen small standard ops.

``MTPAccept``: after a verify step, the accepted draft count, the token and hidden row
there. ``MTPNextInputs``: the next verify step's start, ids, positions, mask and draft count.
Both run one block and read every input before any thread writes (outputs may alias inputs:
the chain advances its start and draft count in place).
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from onnx_genrt.core.kernels import GENRT_DOMAIN, KernelContext
from onnx_genrt.core.op_rules import mtp_accept_drafts

from ._common import DEVICE_COMMON, contiguous, function, out, storage
from ._registry import REGISTRY

_SOURCE = (
    DEVICE_COMMON
    + r"""
template <typename S, typename D>
__global__ void mtp_accept(const long long* __restrict__ ids,
                           const long long* __restrict__ argmax, const S* __restrict__ hidden,
                           const long long* __restrict__ count, long long* __restrict__ accepted,
                           long long* __restrict__ token, D* __restrict__ row, int k, int H) {
  __shared__ int acc;
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
