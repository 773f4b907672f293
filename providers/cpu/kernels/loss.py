"""CPU kernels: NegativeLogLikelihoodLoss and SoftmaxCrossEntropyLoss (numpy, float64)."""

from __future__ import annotations

import numpy as np

from onnx_genrt.core.kernels import KernelContext, NodeInfo

from ._nn_common import output_count
from ._registry import REGISTRY

Array = np.ndarray
_REDUCTIONS = ("none", "sum", "mean")


def _loss_check(node: NodeInfo, _types: object = ()) -> str | None:
    reduction = node.attr("reduction", "mean")
    if reduction not in _REDUCTIONS:
        return f"{node.op_type} reduction={reduction!r} is not one of {', '.join(_REDUCTIONS)}"
    return None


def _nll(ctx: KernelContext, log_prob: Array, target: Array, weight: Array | None) -> Array:
    """Weighted negative log-likelihood of ``target`` classes (axis 1 of ``log_prob``),
    reduced as the node says; float64 in, float64 out."""
    if log_prob.ndim < 2 or target.shape != (log_prob.shape[0], *log_prob.shape[2:]):
        raise ValueError(
            f"{ctx.node.describe()}: target shape {list(target.shape)} must be input shape "
            f"{list(log_prob.shape)} without its class axis 1"
        )
    if target.dtype.kind not in "iu":
        raise ValueError(f"{ctx.node.describe()}: target must be an integer tensor")
    classes = log_prob.shape[1]
    ignore = ctx.attr("ignore_index")
    keep = np.ones(target.shape, bool) if ignore is None else target != int(ignore)
    bad = keep & ((target < 0) | (target >= classes))
    if bad.any():
        raise ValueError(
            f"{ctx.node.describe()}: target holds class {int(target[bad][0])} outside "
            f"[0, {classes}) (and not ignore_index {ignore})"
        )
    safe = np.where(keep, target, 0).astype(np.int64)
    picked = np.take_along_axis(log_prob, safe[:, None], axis=1)[:, 0]
    w = np.ones(classes) if weight is None else weight.astype(np.float64)
    if weight is not None and weight.shape != (classes,):
        raise ValueError(
            f"{ctx.node.describe()}: weight has shape {list(weight.shape)}, expected [{classes}]"
        )
    wt = np.where(keep, w[safe], 0.0)
    loss = -picked * wt
    reduction = ctx.attr("reduction", "mean")
    if reduction == "none":
        return loss
    if reduction == "sum":
        return np.asarray(loss.sum())
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.asarray(loss.sum() / wt.sum())


@REGISTRY.register("NegativeLogLikelihoodLoss", since=12, check=_loss_check)
def negative_log_likelihood_loss(
    ctx: KernelContext, x: Array, target: Array, weight: Array | None = None
) -> Array:
    """-x[n, target[n, ...], ...] * weight[target], reduced by none / sum / weighted mean."""
    loss = _nll(ctx, x.astype(np.float64), target, weight)
    return np.array(loss, dtype=x.dtype)


@REGISTRY.register("SoftmaxCrossEntropyLoss", since=12, check=_loss_check)
def softmax_cross_entropy_loss(
    ctx: KernelContext, scores: Array, labels: Array, weights: Array | None = None
) -> Array | tuple[Array, Array]:
    """NegativeLogLikelihoodLoss of log_softmax(scores) over the class axis 1; the second,
    optional output is that log-probability tensor."""
    s = scores.astype(np.float64)
    shifted = s - s.max(axis=1, keepdims=True)
    log_prob = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    loss = np.array(_nll(ctx, log_prob, labels, weights), dtype=scores.dtype)
    if output_count(ctx) < 2 or not ctx.node.output_names[1]:
        return loss
    return loss, np.ascontiguousarray(log_prob, dtype=scores.dtype)
