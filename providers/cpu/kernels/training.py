"""CPU kernels: the ai.onnx.preview.training optimizers Adagrad, Momentum and Adam (one
step over any number of tensors, in float64)."""

from __future__ import annotations

import math

import numpy as np

from onnx_genrt.core.kernels import KernelContext, NodeInfo

from ._registry import REGISTRY

Array = np.ndarray
TRAINING = "ai.onnx.preview.training"


def _groups(ctx: KernelContext, tensors: tuple[Array, ...], groups: int) -> list[list[Array]]:
    """Split X1..Xn, G1..Gn, (V1..Vn, ...) into ``groups`` lists of n matching shapes."""
    if not tensors or len(tensors) % groups:
        raise ValueError(
            f"{ctx.node.describe()}: after R and T, needs {groups} equal groups of tensors, "
            f"got {len(tensors)}"
        )
    n = len(tensors) // groups
    out = [[t.astype(np.float64) for t in tensors[g * n : (g + 1) * n]] for g in range(groups)]
    for i in range(n):
        if len({group[i].shape for group in out}) != 1:
            raise ValueError(
                f"{ctx.node.describe()}: tensor {i + 1} differs in shape across groups"
            )
    return out


def _scalar(value: Array) -> float:
    return float(np.asarray(value, np.float64).reshape(-1)[0])


def _result(tensors: tuple[Array, ...], new: list[list[Array]]) -> tuple[Array, ...]:
    dtypes = [t.dtype for t in tensors]
    flat = [a for group in new for a in group]
    return tuple(a.astype(dtypes[i % len(dtypes)]) for i, a in enumerate(flat))


@REGISTRY.register("Adagrad", since=1, domain=TRAINING)
def adagrad(ctx: KernelContext, r: Array, t: Array, *tensors: Array) -> tuple[Array, ...]:
    """X -= r * G' / (sqrt(H + G'^2) + epsilon), G' = G + norm_coefficient * X,
    r = R / (1 + T * decay_factor); returns the new X's, then the new H's."""
    xs, gs, hs = _groups(ctx, tensors, 3)
    rate = _scalar(r) / (1.0 + _scalar(t) * float(ctx.attr("decay_factor", 0.0)))
    eps, norm = float(ctx.attr("epsilon", 0.0)), float(ctx.attr("norm_coefficient", 0.0))
    new_x, new_h = [], []
    for x, g, h in zip(xs, gs, hs, strict=True):
        g_reg = norm * x + g
        h_new = h + g_reg * g_reg
        new_x.append(x - rate * g_reg / (np.sqrt(h_new) + eps))
        new_h.append(h_new)
    return _result(tensors, [new_x, new_h])


def _momentum_check(node: NodeInfo, _types: object = ()) -> str | None:
    mode = node.attr("mode")
    if mode not in ("standard", "nesterov"):
        return f"Momentum mode={mode!r} is not 'standard' or 'nesterov'"
    return None


@REGISTRY.register("Momentum", since=1, domain=TRAINING, check=_momentum_check)
def momentum(ctx: KernelContext, r: Array, t: Array, *tensors: Array) -> tuple[Array, ...]:
    """V = alpha * V + beta' * G' (beta' = 1 on the first step, T = 0); standard:
    X -= R * V, nesterov: X -= R * (G' + alpha * V). Returns the new X's, then V's."""
    xs, gs, vs = _groups(ctx, tensors, 3)
    alpha, beta = float(ctx.attr("alpha")), float(ctx.attr("beta"))
    norm = float(ctx.attr("norm_coefficient"))
    rate = _scalar(r)
    beta_now = beta if _scalar(t) > 0 else 1.0
    nesterov = ctx.attr("mode") == "nesterov"
    new_x, new_v = [], []
    for x, g, v in zip(xs, gs, vs, strict=True):
        g_reg = norm * x + g
        v_new = alpha * v + beta_now * g_reg
        step = g_reg + alpha * v_new if nesterov else v_new
        new_x.append(x - rate * step)
        new_v.append(v_new)
    return _result(tensors, [new_x, new_v])


@REGISTRY.register("Adam", since=1, domain=TRAINING)
def adam(ctx: KernelContext, r: Array, t: Array, *tensors: Array) -> tuple[Array, ...]:
    """Adam with bias correction from step T on (none at T = 0), L2 term norm_coefficient and
    decay norm_coefficient_post. Returns the new X's, then V's, then H's."""
    xs, gs, vs, hs = _groups(ctx, tensors, 4)
    alpha, beta = float(ctx.attr("alpha", 0.9)), float(ctx.attr("beta", 0.999))
    eps = float(ctx.attr("epsilon", 1e-6))
    norm, post = (
        float(ctx.attr("norm_coefficient", 0.0)),
        float(ctx.attr("norm_coefficient_post", 0.0)),
    )
    step = _scalar(t)
    rate = _scalar(r)
    if step > 0:
        rate *= math.sqrt(1.0 - beta**step) / (1.0 - alpha**step)
    new_x, new_v, new_h = [], [], []
    for x, g, v, h in zip(xs, gs, vs, hs, strict=True):
        g_reg = norm * x + g
        v_new = alpha * v + (1.0 - alpha) * g_reg
        h_new = beta * h + (1.0 - beta) * g_reg * g_reg
        x_new = x - rate * v_new / (np.sqrt(h_new) + eps)
        new_x.append((1.0 - post) * x_new)
        new_v.append(v_new)
        new_h.append(h_new)
    return _result(tensors, [new_x, new_v, new_h])
