"""CPU kernels: normalizations (Layer, RMS, Group, Instance, Batch; onnxruntime's
SimplifiedLayerNormalization in both domains)."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from onnx_genrt.core.kernels import MS_DOMAIN, ONNX_DOMAIN, KernelContext
from onnx_genrt.core.op_rules import normalize_axis

from ._native_rows import rms_native
from ._nn_common import (
    as_compute,
    layer_norm_rows,
    onnx_float_dtype,
    output_count,
    rms_norm_rows,
    rows_view,
    writable,
)
from ._registry import REGISTRY

_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)
_EMPTY = {_F32: np.empty(0, _F32), _F64: np.empty(0, _F64)}


def _stash_dtype(x: np.ndarray, stash_type: int) -> np.dtype:
    """Compute precision: float64 for double inputs or stash_type DOUBLE, else float32."""
    return _F64 if x.dtype == _F64 or stash_type == TensorProto.DOUBLE else _F32


def _param_row(
    p: np.ndarray | None, norm_shape: tuple[int, ...], cdt: np.dtype
) -> np.ndarray | None:
    """Scale/bias as a flat row over the normalized dims, or None when it broadcasts wider."""
    if p is None or p.ndim > len(norm_shape):
        return None
    try:
        full = np.broadcast_to(p, norm_shape)
    except ValueError:
        return None
    return writable(np.ascontiguousarray(full, dtype=cdt).reshape(-1))


def _normalize(
    ctx, x: np.ndarray, scale: np.ndarray, bias: np.ndarray | None, rms: bool
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """Shared body of LayerNormalization / RMSNormalization: (Y, mean, inv_std) in cdt."""
    axis = normalize_axis(int(ctx.attr("axis", -1)), x.ndim, ctx.node)
    eps = float(ctx.attr("epsilon", 1e-5))
    cdt = _stash_dtype(x, int(ctx.attr("stash_type", TensorProto.FLOAT)))
    rows, cols = rows_view(x, axis)
    norm_shape = x.shape[axis:]
    sc = _param_row(scale, norm_shape, cdt)
    bi = _param_row(bias, norm_shape, cdt) if bias is not None else _EMPTY[cdt]
    wide = sc is None or bi is None  # scale/bias broadcast over leading dims too
    if wide:
        sc, bi = np.ones(cols, cdt), _EMPTY[cdt]
    src = as_compute(x, cdt).reshape(rows, cols)
    buf = ctx.out(0, x.shape, x.dtype)
    use_buf = x.dtype == cdt and not wide and buf.flags.c_contiguous
    out = buf if use_buf else np.empty(x.shape, cdt)
    dst = out.reshape(rows, cols)
    mean, inv = np.empty(rows, cdt), np.empty(rows, cdt)
    if x.size and rms:
        rms_norm_rows(src, sc, cdt.type(eps), dst, inv)
    elif x.size:
        layer_norm_rows(src, sc, bi, cdt.type(eps), dst, mean, inv)
    if wide:
        out = out * scale.astype(cdt)
        if bias is not None:
            out += bias.astype(cdt)
    if out is not buf:
        buf[...] = out
    return buf, mean, inv


@REGISTRY.register("LayerNormalization", since=17)
def layer_norm_kernel(
    ctx, x: np.ndarray, scale: np.ndarray, bias: np.ndarray | None = None
) -> np.ndarray | tuple[np.ndarray, ...]:
    """LayerNormalization-17; Mean and InvStdDev outputs in the stash type."""
    y, mean, inv = _normalize(ctx, x, scale, bias, rms=False)
    n = output_count(ctx)
    if n == 1:
        return y
    axis = normalize_axis(int(ctx.attr("axis", -1)), x.ndim, ctx.node)
    stat_shape = x.shape[:axis] + (1,) * (x.ndim - axis)
    u = onnx_float_dtype(int(ctx.attr("stash_type", TensorProto.FLOAT)))
    stats = (mean.reshape(stat_shape).astype(u), inv.reshape(stat_shape).astype(u))
    return (y, *stats[: n - 1])


@REGISTRY.register("RMSNormalization", since=23)
def rms_norm_kernel(ctx, x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """RMSNormalization-23: x / sqrt(mean(x^2 over axis..) + eps) * scale."""
    return _normalize(ctx, x, scale, None, rms=True)[0]


def _channel_norm(x: np.ndarray, groups: int, eps: float, cdt: np.dtype) -> np.ndarray:
    """(N, C, ...) normalized over each of ``groups`` channel groups per sample, in cdt."""
    n = x.shape[0]
    rows = n * groups
    cols = x.size // rows if rows else 0
    src = as_compute(x, cdt).reshape(rows, cols)
    dst = np.empty_like(src)
    if x.size:
        mean, inv = np.empty(rows, cdt), np.empty(rows, cdt)
        layer_norm_rows(src, np.ones(cols, cdt), _EMPTY[cdt], cdt.type(eps), dst, mean, inv)
    return dst.reshape(x.shape)


def _channel_affine(
    y: np.ndarray, scale: np.ndarray, bias: np.ndarray, cdt: np.dtype
) -> np.ndarray:
    """y * scale[c] + bias[c] over axis 1 (in place)."""
    shape = (1, -1) + (1,) * (y.ndim - 2)
    y *= scale.astype(cdt).reshape(shape)
    y += bias.astype(cdt).reshape(shape)
    return y


@REGISTRY.register("GroupNormalization", since=18)
def group_norm_kernel(ctx, x: np.ndarray, scale: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """GroupNormalization-18 (per-group scale/bias) and -21 (per-channel)."""
    groups = int(ctx.attr("num_groups"))
    c = x.shape[1]
    if groups <= 0 or c % groups:
        raise ValueError(f"{ctx.node.describe()}: {c} channels not divisible into {groups} groups")
    cdt = _stash_dtype(x, int(ctx.attr("stash_type", TensorProto.FLOAT)))
    y = _channel_norm(x, groups, float(ctx.attr("epsilon", 1e-5)), cdt)
    if scale.size == groups and groups != c:
        scale, bias = np.repeat(scale, c // groups), np.repeat(bias, c // groups)
    return _channel_affine(y, scale, bias, cdt).astype(x.dtype, copy=False)


@REGISTRY.register("InstanceNormalization", since=1)
def instance_norm_kernel(ctx, x: np.ndarray, scale: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """InstanceNormalization: per-(sample, channel) normalization, per-channel affine."""
    cdt = _stash_dtype(x, TensorProto.FLOAT)
    y = _channel_norm(x, x.shape[1], float(ctx.attr("epsilon", 1e-5)), cdt)
    return _channel_affine(y, scale, bias, cdt).astype(x.dtype, copy=False)


@REGISTRY.register("BatchNormalization", since=1)
def batch_norm_kernel(
    ctx,
    x: np.ndarray,
    scale: np.ndarray,
    bias: np.ndarray,
    mean: np.ndarray,
    var: np.ndarray,
) -> np.ndarray | tuple[np.ndarray, ...]:
    """BatchNormalization with running statistics; training_mode (opset 14+) too."""
    eps = float(ctx.attr("epsilon", 1e-5))
    cdt = _stash_dtype(x, TensorProto.FLOAT)
    training = ctx.opset >= 14 and bool(ctx.attr("training_mode", 0))
    if not training and (output_count(ctx) > 1 or (ctx.opset < 7 and not ctx.attr("is_test", 0))):
        raise NotImplementedError(f"{ctx.node.describe()}: only inference-mode BatchNormalization")
    shape = (1, -1) + (1,) * (x.ndim - 2)
    xc = x.astype(cdt)
    if training:
        axes = (0, *range(2, x.ndim))
        use_mean, use_var = xc.mean(axis=axes), xc.var(axis=axes)
    else:
        use_mean, use_var = mean.astype(cdt), var.astype(cdt)
    mult = scale.astype(cdt) / np.sqrt(use_var + cdt.type(eps))
    y = (xc - use_mean.reshape(shape)) * mult.reshape(shape) + bias.astype(cdt).reshape(shape)
    y = y.astype(x.dtype, copy=False)
    if not training:
        return y
    momentum = cdt.type(ctx.attr("momentum", 0.9))
    run_mean = mean.astype(cdt) * momentum + use_mean * (1 - momentum)
    run_var = var.astype(cdt) * momentum + use_var * (1 - momentum)
    outs = (y, run_mean.astype(mean.dtype), run_var.astype(var.dtype))
    return outs[: output_count(ctx)] if output_count(ctx) > 1 else y


def _simplified_layer_norm(
    ctx: KernelContext, x: np.ndarray, scale: np.ndarray
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """RMS norm over axis.. (attrs axis, epsilon, stash_type); optional inv_std_var output."""
    y, _, inv = _normalize(ctx, x, scale, None, rms=True)
    if output_count(ctx) == 1:
        return y
    axis = int(ctx.attr("axis", -1)) % x.ndim
    stat_shape = x.shape[:axis] + (1,) * (x.ndim - axis)
    return y, inv.reshape(stat_shape).astype(_F32, copy=False)


def _bind_simplified_layer_norm(ctx: KernelContext, inputs, out):
    """Replay closure for the float32 RMS norm over the last axis with one output and a flat
    scale: the Numba row norm on prebuilt views. None (the generic call) for anything else."""
    x, scale = inputs[0], inputs[1]
    if isinstance(out, tuple) or output_count(ctx) != 1 or not x.size:
        return None
    if x.dtype != _F32 or out.dtype != _F32 or out.shape != x.shape:
        return None
    if not (x.flags.c_contiguous and out.flags.c_contiguous):
        return None
    stash = int(ctx.attr("stash_type", TensorProto.FLOAT))
    if normalize_axis(int(ctx.attr("axis", -1)), x.ndim, ctx.node) != x.ndim - 1 or (
        _stash_dtype(x, stash) != _F32
    ):
        return None
    cols = x.shape[-1]
    if scale.dtype != _F32 or scale.shape != (cols,):
        return None
    g = writable(np.ascontiguousarray(scale))
    eps = _F32.type(float(ctx.attr("epsilon", 1e-5)))
    rows = x.size // cols
    x2, y2, inv = x.reshape(rows, cols), out.reshape(rows, cols), np.empty(rows, _F32)

    def run() -> None:
        rms_norm_rows(x2, g, eps, y2, inv)

    run.native = rms_native(x2, g, eps, y2, inv, run)  # type: ignore[attr-defined]
    return run


# onnxruntime registers SimplifiedLayerNormalization in the ONNX domain; models use that one.
for _domain in (ONNX_DOMAIN, MS_DOMAIN):
    REGISTRY.register(
        "SimplifiedLayerNormalization",
        since=1,
        domain=_domain,
        bind=_bind_simplified_layer_norm,
    )(_simplified_layer_norm)
