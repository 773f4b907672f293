"""CPU kernels for the runtime's own fused ops (domain ``onnx_genrt``, see session.fusion)."""

from __future__ import annotations

import numpy as np

from onnx_genrt.core.kernels import KernelContext

from ._nn_common import compute_dtype
from ._registry import REGISTRY
from .elementwise import _sigmoid_into


def split_halves(ctx: KernelContext, g: np.ndarray, u: np.ndarray | None):
    """(gate, up): the two inputs, or the two halves of the last axis of one (``split=1``)."""
    if u is not None:
        return g, u
    if not ctx.attr("split", 0) or g.shape[-1] % 2:
        raise ValueError(
            f"{ctx.node.describe()}: one input needs split=1 and an even last dimension, "
            f"got {list(g.shape)}"
        )
    half = g.shape[-1] // 2
    return g[..., :half], g[..., half:]


@REGISTRY.register("SiluMul", since=1, domain="onnx_genrt")
def silu_mul(ctx: KernelContext, g: np.ndarray, u: np.ndarray | None = None) -> np.ndarray:
    """``g * sigmoid(g) * u``, the gated-MLP activation, in the same order of operations as
    the Sigmoid/Mul/Mul it replaces (float16 computes in float32 and rounds once). With one
    input and ``split=1``, g and u are its two halves (a fused gate/up projection)."""
    g, u = split_halves(ctx, g, u)
    if g.dtype != u.dtype or g.dtype.kind != "f":
        raise TypeError(
            f"{ctx.node.describe()}: SiluMul needs two equal float dtypes, got {g.dtype} and {u.dtype}"
        )
    shape = np.broadcast_shapes(g.shape, u.shape)
    y = ctx.out(0, shape, g.dtype)
    cdt = compute_dtype(g.dtype)
    if cdt == g.dtype and shape == g.shape and y.flags.c_contiguous and g.flags.c_contiguous:
        _sigmoid_into(g, y)
        y *= g
        y *= u
        return y
    gw = g.astype(cdt)
    s = np.empty(g.shape, cdt)
    _sigmoid_into(gw, s)
    s *= gw
    np.multiply(s, u, out=y, casting="unsafe")
    return y


def _bind_silu_mul(ctx: KernelContext, inputs, out):
    """Replay closure for the contiguous float32 case: three in-place ufunc calls on views
    made once. None (the generic call) for anything else."""
    g, u = split_halves(ctx, inputs[0], inputs[1] if len(inputs) > 1 else None)
    if not isinstance(out, np.ndarray) or out.dtype != np.float32 or g.dtype != np.float32:
        return None
    if u.dtype != g.dtype or out.shape != g.shape or u.shape != g.shape:
        return None
    if not (out.flags.c_contiguous and g.flags.c_contiguous):
        return None

    def run() -> None:
        _sigmoid_into(g, out)
        np.multiply(out, g, out=out)
        np.multiply(out, u, out=out)

    return run


silu_mul.bind = _bind_silu_mul  # type: ignore[attr-defined]


@REGISTRY.register("ArgMaxProb", since=1, domain="onnx_genrt")
def argmax_prob(ctx: KernelContext, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(ArgMax, max of Softmax) over the last axis, keepdims=0: first index of the largest
    value and its probability ``1 / sum(exp(x - max))``, as the ArgMax, Softmax and ReduceMax
    it replaces compute them."""
    if x.ndim == 0 or x.dtype.kind != "f":
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
