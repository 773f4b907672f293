"""CPU kernels for detection models: NonMaxSuppression (greedy, per batch and class)."""

from __future__ import annotations

import numpy as np

from onnx_genrt.core.kernels import KernelContext

from ._registry import REGISTRY

Array = np.ndarray


def _scalar(value: Array | None, default: float) -> float:
    return default if value is None or value.size == 0 else float(value.reshape(-1)[0])


def _corners(ctx: KernelContext, boxes: Array) -> Array:
    """Boxes as [y1, x1, y2, x2] with y1 <= y2 and x1 <= x2 (float64)."""
    b = boxes.astype(np.float64)
    if int(ctx.attr("center_point_box", 0)):
        xc, yc, w, h = b[..., 0], b[..., 1], b[..., 2], b[..., 3]
        return np.stack([yc - h / 2, xc - w / 2, yc + h / 2, xc + w / 2], axis=-1)
    y = np.sort(b[..., [0, 2]], axis=-1)
    x = np.sort(b[..., [1, 3]], axis=-1)
    return np.stack([y[..., 0], x[..., 0], y[..., 1], x[..., 1]], axis=-1)


def _iou(box: Array, others: Array) -> Array:
    """Intersection over union of one [4] box with [M, 4] boxes (0 where the union is 0)."""
    top = np.maximum(box[0], others[:, 0])
    left = np.maximum(box[1], others[:, 1])
    bottom = np.minimum(box[2], others[:, 2])
    right = np.minimum(box[3], others[:, 3])
    inter = np.clip(bottom - top, 0, None) * np.clip(right - left, 0, None)
    area = (box[2] - box[0]) * (box[3] - box[1])
    areas = (others[:, 2] - others[:, 0]) * (others[:, 3] - others[:, 1])
    union = area + areas - inter
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(union > 0, inter / union, 0.0)


@REGISTRY.register("NonMaxSuppression", since=10)
def non_max_suppression(
    ctx: KernelContext,
    boxes: Array,
    scores: Array,
    max_output: Array | None = None,
    iou_threshold: Array | None = None,
    score_threshold: Array | None = None,
) -> Array:
    """Indices [K, 3] (batch, class, box) kept by greedy suppression: highest score first
    (lower index on ties), dropping boxes whose IoU with a kept one exceeds iou_threshold,
    at most max_output_boxes_per_class per class, only scores above score_threshold."""
    if boxes.ndim != 3 or boxes.shape[2] != 4 or scores.ndim != 3:
        raise ValueError(
            f"{ctx.node.describe()}: boxes {list(boxes.shape)} must be [B, N, 4] and scores "
            f"{list(scores.shape)} [B, C, N]"
        )
    if scores.shape[0] != boxes.shape[0] or scores.shape[2] != boxes.shape[1]:
        raise ValueError(f"{ctx.node.describe()}: boxes and scores disagree on B or N")
    limit = int(_scalar(max_output, 0))
    iou_max = _scalar(iou_threshold, 0.0)
    if not 0.0 <= iou_max <= 1.0:
        raise ValueError(f"{ctx.node.describe()}: iou_threshold {iou_max} must be in [0, 1]")
    min_score = _scalar(score_threshold, -np.inf)
    corners = _corners(ctx, boxes)
    picked: list[tuple[int, int, int]] = []
    for b in range(scores.shape[0]):
        for c in range(scores.shape[1]):
            s = scores[b, c].astype(np.float64)
            order = [i for i in np.argsort(-s, kind="stable") if s[i] > min_score]
            kept: list[int] = []
            for i in order:
                if len(kept) >= limit:
                    break
                if kept and np.any(_iou(corners[b, i], corners[b, kept]) > iou_max):
                    continue
                kept.append(int(i))
            picked += [(b, c, i) for i in kept]
    return np.array(picked, np.int64).reshape(-1, 3)
