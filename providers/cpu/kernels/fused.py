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
