"""CPU kernels for the runtime's own ops (domain ``onnx_genrt``, declared in core.genrt_ops)."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from onnx_genrt.core.dtypes import is_float_dtype
from onnx_genrt.core.kernels import GENRT_DOMAIN, KernelContext
from onnx_genrt.core.op_rules import mtp_accept_drafts, silu_mul_half
from onnx_genrt.core.token_sampling import check_sample_shapes

from ._native_rows import silu_halves_native
from ._native_small import argmax_prob_native, mtp_accept_native, nonfinite_native
from ._nn_common import compute_dtype
from ._prompt_threads import row_parts
from ._registry import REGISTRY
from ._sampling import sample_rows
from .elementwise import as_rows, sigmoid_into, silu_mul_halves, silu_mul_rows
from .matmul import TiledWeight, matmul_kernel, packed_call, packed_shape, prepack_weight


def split_halves(ctx: KernelContext, g: np.ndarray, u: np.ndarray | None):
    """(gate, up): the two inputs, or the two halves of the last axis of one (``split=1``)."""
    if u is not None:
        return g, u
    half = silu_mul_half(ctx.node, g.shape)
    return g[..., :half], g[..., half:]


def silu_mul(ctx: KernelContext, g: np.ndarray, u: np.ndarray | None = None) -> np.ndarray:
    """``g * sigmoid(g) * u``, the gated-MLP activation, in the same order of operations as
    the Sigmoid/Mul/Mul it replaces (float16 computes in float32 and rounds once). With one
    input and ``split=1``, g and u are its two halves (a fused gate/up projection)."""
    whole = g if u is None else None
    g, u = split_halves(ctx, g, u)
    if g.dtype != u.dtype or not is_float_dtype(g.dtype):
        raise TypeError(
            f"{ctx.node.describe()}: SiluMul needs two equal float dtypes, got {g.dtype} and {u.dtype}"
        )
    shape = np.broadcast_shapes(g.shape, u.shape)
    y = ctx.out(0, shape, g.dtype)
    cdt = compute_dtype(g.dtype)
    f32 = g.dtype == np.float32 and u.dtype == np.float32 and shape == g.shape == u.shape
    if f32 and y.flags.c_contiguous and y.size:
        if whole is not None and whole.flags.c_contiguous:
            gu, half, y2 = as_rows(whole), g.shape[-1], as_rows(y)
            row_parts(gu.shape[0], gu.size,
                      lambda r0, r1: silu_mul_halves(gu[r0:r1], half, y2[r0:r1]))  # fmt: skip
        else:
            silu_mul_rows(as_rows(g), as_rows(u), as_rows(y))
        return y
    gw = g.astype(cdt)
    s = np.empty(g.shape, cdt)
    sigmoid_into(gw, s)
    s *= gw
    np.multiply(s, u, out=y, casting="unsafe")
    return y


def _bind_silu_mul(ctx: KernelContext, inputs, out):
    """Replay closure for float32 into a contiguous output: the kernel's one Numba pass on
    2-D views made once. None (the generic call) otherwise."""
    g, u = split_halves(ctx, inputs[0], inputs[1] if len(inputs) > 1 else None)
    if not isinstance(out, np.ndarray) or out.dtype != np.float32 or g.dtype != np.float32:
        return None
    if u.dtype != g.dtype or out.shape != g.shape or u.shape != g.shape:
        return None
    if not out.flags.c_contiguous or not out.size:  # g and u may be strided halves
        return None
    y2 = as_rows(out)
    whole = inputs[0]
    split = len(inputs) < 2 or inputs[1] is None
    if split and whole.flags.c_contiguous:  # the halves of one contiguous input
        gu, half = as_rows(whole), g.shape[-1]

        def run_halves() -> None:
            silu_mul_halves(gu, half, y2)

        run_halves.native = silu_halves_native(gu, half, y2, run_halves)  # type: ignore[attr-defined]
        return run_halves
    g2, u2 = as_rows(g), as_rows(u)
    if not (np.shares_memory(g2, g) and np.shares_memory(u2, u)):
        return None  # a copy made now would not see later writes

    def run() -> None:
        silu_mul_rows(g2, u2, y2)

    return run


REGISTRY.register("SiluMul", since=1, domain=GENRT_DOMAIN, bind=_bind_silu_mul)(silu_mul)


def argmax_prob(ctx: KernelContext, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(ArgMax, max of Softmax) over the last axis, keepdims=0: first index of the largest
    value and its probability ``1 / sum(exp(x - max))``, as the ArgMax, Softmax and ReduceMax
    it replaces compute them."""
    if x.ndim == 0 or not is_float_dtype(x.dtype):
        raise TypeError(f"{ctx.node.describe()}: needs a float tensor of rank >= 1, got {x.dtype}")
    idx = ctx.out(0, x.shape[:-1], np.int64)
    prob = ctx.out(1, x.shape[:-1], x.dtype)
    if x.shape[-1] == 0:
        raise ValueError(f"{ctx.node.describe()}: empty last axis")
    cdt = compute_dtype(x.dtype)
    xs = x.astype(cdt, copy=False)
    idx[...] = np.argmax(xs, axis=-1)
    top = np.max(xs, axis=-1, keepdims=True)
    total = np.exp(xs - top).sum(axis=-1)
    np.divide(1.0, total, out=prob, casting="unsafe")
    return idx, prob


def _bind_argmax_prob(ctx: KernelContext, inputs, out):
    """Replay closure for float32 rows: per row numpy's argmax and the same exp-sum as the
    kernel, on views and a scratch row made once."""
    (x,) = inputs
    if not isinstance(out, tuple) or len(out) != 2 or x.dtype != np.float32 or x.ndim == 0:
        return None
    idx, prob = out
    if not (x.flags.c_contiguous and idx.flags.c_contiguous and prob.flags.c_contiguous):
        return None
    if prob.dtype != np.float32 or idx.dtype != np.int64 or not x.size:
        return None
    n = x.shape[-1]
    rows = x.size // n
    if idx.size != rows or prob.size != rows:
        return None
    x2, i1, p1, scratch = (
        x.reshape(rows, n),
        idx.reshape(rows),
        prob.reshape(rows),
        np.empty(n, np.float32),
    )
    one = np.float32(1.0)

    def run() -> None:
        for r in range(rows):
            row = x2[r]
            best = row.argmax()
            i1[r] = best
            np.subtract(row, row[best], out=scratch)
            np.exp(scratch, out=scratch)
            p1[r] = one / scratch.sum()

    run.native = argmax_prob_native(x, idx, prob, run)  # type: ignore[attr-defined]
    return run


REGISTRY.register("ArgMaxProb", since=1, domain=GENRT_DOMAIN, bind=_bind_argmax_prob)(argmax_prob)


def nonfinite(ctx: KernelContext, x: np.ndarray) -> np.ndarray:
    """``ReduceSum(x - x)``: 0 when every element of x is finite, else NaN (``core.genrt_ops``);
    tested directly, no ``x - x`` written."""
    y = ctx.out(0, (), x.dtype)
    y[...] = 0 if np.isfinite(x).all() else np.nan
    return y


def _bind_nonfinite(ctx: KernelContext, inputs, out):
    """Replay closure: the same test on the bound buffers (a native loop for float32)."""
    (x,) = inputs
    if not isinstance(out, np.ndarray) or out.size != 1 or out.dtype != x.dtype:
        return None
    flat = out.reshape(1)
    nan = out.dtype.type(np.nan)
    zero = out.dtype.type(0)

    def run() -> None:
        flat[0] = zero if np.isfinite(x).all() else nan

    run.native = nonfinite_native(x, flat, run)  # type: ignore[attr-defined]
    return run


REGISTRY.register("NonFinite", since=1, domain=GENRT_DOMAIN, bind=_bind_nonfinite)(nonfinite)


def mtp_accept(
    ctx: KernelContext, ids: np.ndarray, argmax: np.ndarray, hidden: np.ndarray, count
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """After a verify step of width k + 1: (accepted [1], token [1, 1], hidden [1, 1, H]).
    ``accepted`` counts the leading drafts (``ids[1:]``, the first ``count`` of them real)
    equal to the target's argmax; token and hidden are the argmax and hidden row there
    (hidden cast to the ``to`` attribute's type). See ``core.genrt_ops``."""
    k = mtp_accept_drafts(ctx.node, ids.shape, argmax.shape, hidden.shape)
    ok = (argmax[0, :k] == ids[0, 1:]) & (np.arange(k) < int(count.reshape(-1)[0]))
    acc = k if ok.all() else int(np.argmin(ok))
    dtype = helper.tensor_dtype_to_np_dtype(int(ctx.attr("to", TensorProto.FLOAT)))
    accepted = ctx.out(0, (1,), np.int64)
    token = ctx.out(1, (1, 1), np.int64)
    row = ctx.out(2, (1, 1, hidden.shape[-1]), dtype)
    accepted[0] = acc
    token[0, 0] = argmax[0, acc]
    row[...] = hidden[:, acc : acc + 1]
    return accepted, token, row


def _bind_mtp_accept(ctx: KernelContext, inputs, out):
    """Replay closure: the compare loop over at most k drafts and one row copy, on views
    made once (the shapes were checked when the graph was recorded)."""
    ids, argmax, hidden, count = inputs
    k = mtp_accept_drafts(ctx.node, ids.shape, argmax.shape, hidden.shape)
    accepted, token, row = out
    ids1, top1, count1 = ids.reshape(-1), argmax.reshape(-1), count.reshape(-1)
    rows, dst = hidden.reshape(-1, hidden.shape[-1]), row.reshape(-1)

    def run() -> None:
        limit = min(k, int(count1[0]))
        acc = 0
        while acc < limit and top1[acc] == ids1[acc + 1]:
            acc += 1
        accepted[0] = acc
        token[0, 0] = top1[acc]
        np.copyto(dst, rows[acc], casting="unsafe")

    run.native = mtp_accept_native(  # type: ignore[attr-defined]
        ids1, top1, count1, k, accepted.reshape(-1), token.reshape(-1), rows, dst, run
    )
    return run


REGISTRY.register("MTPAccept", since=1, domain=GENRT_DOMAIN, bind=_bind_mtp_accept)(mtp_accept)


@REGISTRY.register("MTPNextInputs", since=1, domain=GENRT_DOMAIN)
def mtp_next_inputs(ctx: KernelContext, accepted, start, token, drafts, confidences):
    """The next verify step's inputs after an MTP chain: (start [1], ids [1, k+1], draft
    count [1], positions [1, k+1], attention mask [1, L]); see
    ``core.genrt_ops``. Outputs may alias inputs (``start``)."""
    k = drafts.shape[-1]
    names = ctx.node.output_names
    begin = int(start.reshape(-1)[0]) + int(accepted.reshape(-1)[0]) + 1
    low = confidences.reshape(-1) < float(ctx.attr("min_confidence", 0.0))
    count = int(np.argmax(low)) if low.any() else k
    next_start = ctx.out(0, (1,), np.int64)
    next_ids = ctx.out(1, (1, k + 1), np.int64)
    next_count = ctx.out(2, (1,), np.int64)
    next_start[0], next_count[0] = begin, count
    next_ids[0, 0] = token.reshape(-1)[0]
    next_ids[0, 1:] = drafts.reshape(-1)
    results = [next_start, next_ids, next_count]
    if len(names) > 3 and names[3]:
        pos = ctx.out(3, (1, k + 1), np.int64)
        pos[0] = np.arange(begin, begin + k + 1)
        results.append(pos)
    elif len(names) > 3:
        results.append(next_ids)
    if len(names) > 4 and names[4]:
        length = int(ctx.attr("mask_length", 0))
        mask = ctx.out(4, (1, length), np.int64)
        mask[0] = np.arange(length) < begin + k + 1
        results.append(mask)
    return tuple(results)


def matmul_add(ctx, a: np.ndarray, w: np.ndarray | TiledWeight, bias: np.ndarray) -> np.ndarray:
    """onnx_genrt MatMulAdd: ``MatMul(a, w) + bias`` rounded as the two ops round it. A
    float32 weight arrives tiled: the skinny kernel adds the bias to each float32 sum as the
    Add would (BLAS, for non-contiguous rows, adds it afterwards)."""
    if isinstance(w, TiledWeight) and a.dtype == np.float32 and bias.dtype == np.float32:
        out = ctx.out(0, packed_shape(ctx, a, w), np.float32)
        packed_call(a, w, out, np.ascontiguousarray(bias))()
        return out
    product = matmul_kernel(ctx, a, w)
    shape = np.broadcast_shapes(product.shape, bias.shape)
    out = ctx.out(0, shape, product.dtype)
    np.add(product, bias, out=out)
    return out


def _bind_matmul_add(ctx, inputs, out: np.ndarray):
    """Replay closure for a float32 MatMulAdd on a tiled weight: one prebound skinny or BLAS
    call with the bias; None (the generic call) otherwise."""
    a, w, bias = inputs
    if not isinstance(w, TiledWeight) or not (a.dtype == bias.dtype == out.dtype == np.float32):
        return None
    if not bias.flags.c_contiguous or out.shape != packed_shape(ctx, a, w):
        return None
    return packed_call(a, w, out, bias)


REGISTRY.register(
    "MatMulAdd", since=1, domain=GENRT_DOMAIN, prepack=prepack_weight, bind=_bind_matmul_add
)(matmul_add)


def sample_tokens(ctx: KernelContext, logits, temperature, seed, offset, top_k=None) -> np.ndarray:
    """A token per row from ``softmax(logits / temperature)`` (``core.token_sampling``):
    Gumbel-max with Philox4x32-10 noise, within each row's top_k; temperature <= 0 gives
    the argmax."""
    shapes = [("temperature", temperature.shape), ("seed", seed.shape), ("offset", offset.shape)]
    if top_k is not None:
        shapes.append(("top_k", top_k.shape))
    rows = check_sample_shapes(ctx.node.describe(), logits.shape, *shapes)
    tokens = ctx.out(0, logits.shape[:-1], np.int64)
    if rows:
        x = np.ascontiguousarray(logits, np.float32).reshape(rows, logits.shape[-1])
        sample_rows(
            x,
            np.ascontiguousarray(temperature, np.float32).reshape(rows),
            np.ascontiguousarray(seed, np.int64).reshape(rows),
            np.ascontiguousarray(offset, np.int64).reshape(rows),
            np.zeros(rows, np.int64)
            if top_k is None
            else np.ascontiguousarray(top_k, np.int64).reshape(rows),
            tokens.reshape(rows),
        )
    return tokens


REGISTRY.register("SampleTokens", since=1, domain=GENRT_DOMAIN)(sample_tokens)
