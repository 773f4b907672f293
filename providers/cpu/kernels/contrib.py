"""CPU kernels: onnxruntime's com.microsoft contrib ops.

Attention ops live in ``contrib_attention``, normalizations in ``contrib_norm`` and
quantized ops in ``contrib_quant``; importing this module registers them all. The GELU
family is here. Float16/bfloat16 inputs compute in float32 and are cast back once.
"""

from __future__ import annotations

import numpy as np

from onnx_genrt.core.kernels import MS_DOMAIN, KernelContext

from . import contrib_attention, contrib_norm, contrib_quant  # noqa: F401  (register on import)
from ._nn_common import compute_dtype
from ._registry import REGISTRY
from .elementwise import _gelu_loop, sigmoid_into


def _work(x: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """x (+ bias) as a fresh C-contiguous array of the compute dtype."""
    cdt = compute_dtype(x.dtype)
    if bias is None:
        return np.array(x, dtype=cdt, order="C")
    return np.add(x, bias, dtype=cdt, order="C")


def _gelu(ctx: KernelContext, x: np.ndarray, bias: np.ndarray | None, tanh: bool) -> np.ndarray:
    """Gelu of x (+ bias): exact (erf) or the tanh approximation, in place on a work copy."""
    h = _work(x, bias)
    flat = h.reshape(-1)
    _gelu_loop(flat, flat, tanh)
    out = ctx.out(0, h.shape, x.dtype)
    out[...] = h
    return out


@REGISTRY.register("FastGelu", since=1, domain=MS_DOMAIN)
def fast_gelu(ctx: KernelContext, x: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """0.5 * h * (1 + tanh(sqrt(2/pi) * (h + 0.044715 h^3))), h = x + bias."""
    return _gelu(ctx, x, bias, tanh=True)


@REGISTRY.register("BiasGelu", since=1, domain=MS_DOMAIN)
def bias_gelu(ctx: KernelContext, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Exact Gelu of a + b."""
    return _gelu(ctx, a, b, tanh=False)


@REGISTRY.register("Gelu", since=1, domain=MS_DOMAIN)
def gelu_ms(ctx: KernelContext, x: np.ndarray) -> np.ndarray:
    """Exact Gelu: 0.5 * x * (1 + erf(x / sqrt(2)))."""
    return _gelu(ctx, x, None, tanh=False)


@REGISTRY.register("QuickGelu", since=1, domain=MS_DOMAIN)
def quick_gelu(ctx: KernelContext, x: np.ndarray) -> np.ndarray:
    """x * sigmoid(alpha * x), alpha defaulting to 1.702."""
    alpha = float(ctx.attr("alpha", 1.702))
    h = _work(x)
    y = np.empty_like(h)
    with np.errstate(over="ignore"):
        sigmoid_into(h, y, alpha)
    y *= h
    out = ctx.out(0, x.shape, x.dtype)
    out[...] = y
    return out
