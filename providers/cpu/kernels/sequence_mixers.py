"""CPU kernels: the stateful sequence mixers of linear-attention and state-space models --
CausalConvWithState (Mamba / Gated DeltaNet's causal depthwise conv) and LinearAttention
(linear, gated, delta and gated-delta recurrences). numpy in float64."""

from __future__ import annotations

import math

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from onnx_genrt.core.kernels import KernelContext, NodeInfo

from ._registry import REGISTRY

Array = np.ndarray
_CONV_ACTIVATIONS = ("none", "silu", "swish")
_UPDATE_RULES = ("linear", "gated", "delta", "gated_delta")


def _conv_check(node: NodeInfo, _types: object = ()) -> str | None:
    act = node.attr("activation", "none")
    if act not in _CONV_ACTIVATIONS:
        return (
            f"CausalConvWithState activation={act!r} is not one of {', '.join(_CONV_ACTIVATIONS)}"
        )
    return None


@REGISTRY.register("CausalConvWithState", since=27, check=_conv_check)
def causal_conv_with_state(
    ctx: KernelContext,
    x: Array,
    weight: Array,
    bias: Array | None = None,
    past_state: Array | None = None,
) -> tuple[Array, Array]:
    """Depthwise causal conv of x [B, C, L] with weight [C, 1, K] over the past K - 1
    positions (past_state, zeros when absent) and x; returns (output, present_state)."""
    if x.ndim != 3 or weight.ndim != 3 or weight.shape[:2] != (x.shape[1], 1):
        raise ValueError(
            f"{ctx.node.describe()}: input {list(x.shape)} must be [B, C, L] and weight "
            f"{list(weight.shape)} [C, 1, K]"
        )
    batch, channels, _ = x.shape
    k = weight.shape[2]
    state_shape = (batch, channels, k - 1)
    if past_state is None:
        past = np.zeros(state_shape)
    elif past_state.shape != state_shape:
        raise ValueError(
            f"{ctx.node.describe()}: past_state {list(past_state.shape)} must be "
            f"{list(state_shape)}"
        )
    else:
        past = past_state.astype(np.float64)
    full = np.concatenate([past, x.astype(np.float64)], axis=2)
    windows = sliding_window_view(full, k, axis=2)  # [B, C, L, K]
    y = np.einsum("bclk,ck->bcl", windows, weight[:, 0].astype(np.float64))
    if bias is not None:
        y += bias.astype(np.float64)[None, :, None]
    if ctx.attr("activation", "none") != "none":
        y = y / (1.0 + np.exp(-y))
    present = full[:, :, full.shape[2] - (k - 1) :]
    return y.astype(x.dtype), present.astype(x.dtype)


def _linear_attention_check(node: NodeInfo, _types: object = ()) -> str | None:
    rule = node.attr("update_rule", "gated_delta")
    if rule not in _UPDATE_RULES:
        return f"LinearAttention update_rule={rule!r} is not one of {', '.join(_UPDATE_RULES)}"
    q_heads, kv_heads = node.attr("q_num_heads"), node.attr("kv_num_heads")
    if not q_heads or not kv_heads or q_heads % kv_heads:
        return (
            f"LinearAttention q_num_heads={q_heads} must be a positive multiple of "
            f"kv_num_heads={kv_heads}"
        )
    return None


def _per_head(ctx: KernelContext, name: str, value: Array, shape: tuple[int, int, int], dk: int):
    """decay/beta [B, T, H] or [B, T, 1] as [B, T, H, 1]; decay [B, T, H*Dk] as [B, T, H, Dk]."""
    b, t, h = shape
    if value.shape == (b, t, h * dk) and name == "decay":
        return value.astype(np.float64).reshape(b, t, h, dk)
    if value.shape in ((b, t, h), (b, t, 1)):
        return np.broadcast_to(value.astype(np.float64)[..., None], (b, t, h, 1))
    raise ValueError(
        f"{ctx.node.describe()}: {name} {list(value.shape)} must be [{b}, {t}, {h}]"
        + (f" or [{b}, {t}, {h * dk}]" if name == "decay" else f" or [{b}, {t}, 1]")
    )


@REGISTRY.register("LinearAttention", since=27, check=_linear_attention_check)
def linear_attention(
    ctx: KernelContext,
    query: Array,
    key: Array,
    value: Array,
    past_state: Array | None = None,
    decay: Array | None = None,
    beta: Array | None = None,
) -> tuple[Array, Array]:
    """Recurrent linear attention, token by token: state S [B, Hkv, Dk, Dv] updated by the
    node's update_rule, output scale * q^T S per query head (GQA shares kv heads)."""
    hq, hkv = int(ctx.attr("q_num_heads")), int(ctx.attr("kv_num_heads"))
    b, t = query.shape[:2]
    if query.ndim != 3 or key.shape[:2] != (b, t) or value.shape[:2] != (b, t):
        raise ValueError(f"{ctx.node.describe()}: query, key, value must be [B, T, heads*dim]")
    if query.shape[2] % hq or key.shape[2] % hkv or value.shape[2] % hkv:
        raise ValueError(f"{ctx.node.describe()}: hidden sizes do not divide by the head counts")
    dk, dv = key.shape[2] // hkv, value.shape[2] // hkv
    if query.shape[2] // hq != dk:
        raise ValueError(f"{ctx.node.describe()}: query head size differs from key head size")
    rule = ctx.attr("update_rule", "gated_delta")
    gated, delta = rule in ("gated", "gated_delta"), rule in ("delta", "gated_delta")
    if gated and decay is None:
        raise ValueError(f"{ctx.node.describe()}: update_rule {rule!r} needs the decay input")
    if delta and beta is None:
        raise ValueError(f"{ctx.node.describe()}: update_rule {rule!r} needs the beta input")
    scale = float(ctx.attr("scale", 0.0)) or 1.0 / math.sqrt(dk)
    q = query.astype(np.float64).reshape(b, t, hkv, hq // hkv, dk)
    k = key.astype(np.float64).reshape(b, t, hkv, dk)
    v = value.astype(np.float64).reshape(b, t, hkv, dv)
    g = _per_head(ctx, "decay", decay, (b, t, hkv), dk) if gated else None
    bt = _per_head(ctx, "beta", beta, (b, t, hkv), dk) if delta else None
    if past_state is None:
        state = np.zeros((b, hkv, dk, dv))
    elif past_state.shape != (b, hkv, dk, dv):
        raise ValueError(
            f"{ctx.node.describe()}: past_state {list(past_state.shape)} must be "
            f"[{b}, {hkv}, {dk}, {dv}]"
        )
    else:
        state = past_state.astype(np.float64)
    out = np.empty((b, t, hkv, hq // hkv, dv))
    for i in range(t):
        if g is not None:
            state = np.exp(g[:, i])[..., None] * state  # per head or per key row
        kv = k[:, i]
        if bt is not None:
            recalled = np.einsum("bhkv,bhk->bhv", state, kv)
            update = bt[:, i] * (v[:, i] - recalled)
        else:
            update = v[:, i]
        state = state + np.einsum("bhk,bhv->bhkv", kv, update)
        out[:, i] = scale * np.einsum("bhgk,bhkv->bhgv", q[:, i], state)
    return out.reshape(b, t, hq * dv).astype(query.dtype), state.astype(query.dtype)
