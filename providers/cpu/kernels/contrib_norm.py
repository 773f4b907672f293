"""CPU kernels: onnxruntime's skip layer normalizations (com.microsoft)."""

from __future__ import annotations

import numpy as np

from onnx_genrt.core.kernels import MS_DOMAIN, KernelContext

from ._native_rows import skip_rms_native
from ._nn_common import (
    compute_dtype,
    layer_norm_rows,
    output_count,
    rms_norm_rows,
    writable,
)
from ._prompt_threads import row_parts
from ._registry import REGISTRY

_F32 = np.dtype(np.float32)
_EMPTY = np.empty(0, _F32)


def _skip_sum(x: np.ndarray, skip: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    """x + skip (+ bias) in the compute dtype; skip may be (1, S, H) or (S, H)."""
    cdt = compute_dtype(x.dtype)
    h = np.add(x, skip, dtype=cdt)
    if h.shape != x.shape:
        raise ValueError(f"skip shape {skip.shape} does not broadcast to input {x.shape}")
    if bias is not None:
        h += bias.astype(cdt, copy=False)
    return h


def _skip_norm(
    ctx: KernelContext,
    x: np.ndarray,
    skip: np.ndarray,
    gamma: np.ndarray,
    beta: np.ndarray | None,
    bias: np.ndarray | None,
    rms: bool,
) -> np.ndarray | tuple[np.ndarray, ...]:
    """Shared body: (output, mean, inv_std_var, input_skip_bias_sum), trimmed to the outputs."""
    h = _skip_sum(x, skip, bias)
    cols = x.shape[-1]
    rows = h.size // cols if cols else 0
    cdt = h.dtype
    eps = cdt.type(float(ctx.attr("epsilon", 1e-12)))
    src = h.reshape(rows, cols)
    y = ctx.out(0, x.shape, x.dtype)
    direct = y.dtype == cdt and y.flags.c_contiguous
    dst = y.reshape(rows, cols) if direct else np.empty_like(src)
    mean, inv = np.zeros(rows, cdt), np.empty(rows, cdt)
    g = writable(np.ascontiguousarray(gamma, dtype=cdt).reshape(-1))
    if rows and rms:

        def norm(r0: int, r1: int) -> None:
            rms_norm_rows(src[r0:r1], g, eps, dst[r0:r1], inv[r0:r1])

        row_parts(rows, src.size, norm)
    elif rows:
        bt = _EMPTY.astype(cdt) if beta is None else np.ascontiguousarray(beta, cdt).reshape(-1)
        layer_norm_rows(src, g, bt, eps, dst, mean, inv)
    if not direct:
        y[...] = dst.reshape(x.shape)
    n = output_count(ctx)
    if n == 1:
        return y
    stat = x.shape[:-1] + (1,)
    outs = [y, mean.reshape(stat).astype(_F32), inv.reshape(stat).astype(_F32)]
    if n > 3:
        total = ctx.out(3, x.shape, x.dtype)
        total[...] = h
        outs.append(total)
    return tuple(outs[:n])


def skip_simplified_layer_norm(
    ctx: KernelContext,
    x: np.ndarray,
    skip: np.ndarray,
    gamma: np.ndarray,
    bias: np.ndarray | None = None,
) -> np.ndarray | tuple[np.ndarray, ...]:
    """RMS norm of x + skip (+ bias); mean output is zeros (unused), as in onnxruntime."""
    return _skip_norm(ctx, x, skip, gamma, None, bias, rms=True)


def _bind_skip_rms(ctx: KernelContext, inputs, out):
    """Replay closure for a float32 SkipSimplifiedLayerNormalization with no bias and outputs
    y (and the sum as output 3): the add and the Numba row norm on prebuilt views, no
    allocation. None (the generic call) for anything else."""
    x, skip, gamma, *rest = inputs
    outs = out if isinstance(out, tuple) else (out,)
    y, total = outs[0], (outs[3] if len(outs) > 3 else None)
    names = list(ctx.node.output_names) + [""] * 4
    if any(names[1:3]) or (rest and rest[0] is not None):  # mean / inv_std read, or a bias
        return None
    arrays = [a for a in (x, skip, y, total) if a is not None]
    if any(a.dtype != _F32 or not a.flags.c_contiguous for a in arrays) or skip.shape != x.shape:
        return None
    if y.shape != x.shape or (total is not None and total.shape != x.shape) or not x.size:
        return None
    cols = x.shape[-1]
    rows = x.size // cols
    h = (total if total is not None else np.empty(x.shape, _F32)).reshape(rows, cols)
    g = writable(np.ascontiguousarray(gamma, dtype=_F32).reshape(-1))
    eps = _F32.type(float(ctx.attr("epsilon", 1e-12)))
    x2, s2, y2, inv = (
        x.reshape(rows, cols),
        skip.reshape(rows, cols),
        y.reshape(rows, cols),
        np.empty(rows, _F32),
    )

    def run() -> None:
        np.add(x2, s2, out=h)
        rms_norm_rows(h, g, eps, y2, inv)

    run.native = skip_rms_native(x2, s2, h, g, eps, y2, inv, run)  # type: ignore[attr-defined]
    return run


REGISTRY.register(
    "SkipSimplifiedLayerNormalization", since=1, domain=MS_DOMAIN, bind=_bind_skip_rms
)(skip_simplified_layer_norm)


@REGISTRY.register("SkipLayerNormalization", since=1, domain=MS_DOMAIN)
def skip_layer_norm(
    ctx: KernelContext,
    x: np.ndarray,
    skip: np.ndarray,
    gamma: np.ndarray,
    beta: np.ndarray | None = None,
    bias: np.ndarray | None = None,
) -> np.ndarray | tuple[np.ndarray, ...]:
    """LayerNorm of x + skip (+ bias) with gamma (and beta) over the last axis."""
    return _skip_norm(ctx, x, skip, gamma, beta, bias, rms=False)
