"""CPU kernels for detection models: NonMaxSuppression (greedy, per batch and class) and
RoiAlign (bilinear sampling, average or max per bin)."""

from __future__ import annotations

import numpy as np

from onnx_genrt.core.kernels import KernelContext, NodeInfo

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


def _roi_align_check(node: NodeInfo, _types: object = ()) -> str | None:
    mode = node.attr("mode", "avg")
    if mode not in ("avg", "max"):
        return f"RoiAlign mode={mode!r} is not 'avg' or 'max'"
    ctm = node.attr("coordinate_transformation_mode", "half_pixel")
    if ctm not in ("half_pixel", "output_half_pixel"):
        return f"RoiAlign coordinate_transformation_mode={ctm!r} is not supported"
    return None


def _roi_samples(start: float, bin_size: float, bins: int, grid: int, limit: int):
    """Per (bin, sample): low index, high index, low weight, high weight, valid mask."""
    pos = start + (np.arange(bins)[:, None] + (np.arange(grid)[None, :] + 0.5) / grid) * bin_size
    valid = (pos >= -1.0) & (pos <= limit)
    pos = np.clip(pos, 0.0, None)
    low = np.floor(pos).astype(np.int64)
    at_edge = low >= limit - 1
    low = np.where(at_edge, limit - 1, low)
    high = np.where(at_edge, limit - 1, low + 1)
    frac = np.where(at_edge, 0.0, pos - low)
    return low, high, 1.0 - frac, frac, valid


@REGISTRY.register("RoiAlign", since=10, check=_roi_align_check)
def roi_align(ctx: KernelContext, x: Array, rois: Array, batch_indices: Array) -> Array:
    """Average (or max) of bilinear samples over each bin of each region [x1, y1, x2, y2]
    (scaled by spatial_scale) of image batch_indices[r]; output [R, C, out_h, out_w]."""
    if x.ndim != 4 or rois.ndim != 2 or rois.shape[1] != 4:
        raise ValueError(
            f"{ctx.node.describe()}: X {list(x.shape)} must be [N, C, H, W] and rois "
            f"{list(rois.shape)} [R, 4]"
        )
    idx = batch_indices.astype(np.int64).reshape(-1)
    if idx.shape != (rois.shape[0],) or (idx.size and (idx.min() < 0 or idx.max() >= x.shape[0])):
        raise ValueError(
            f"{ctx.node.describe()}: batch_indices must be {rois.shape[0]} values in "
            f"[0, {x.shape[0]})"
        )
    out_h, out_w = int(ctx.attr("output_height", 1)), int(ctx.attr("output_width", 1))
    ratio = int(ctx.attr("sampling_ratio", 0))
    scale = float(ctx.attr("spatial_scale", 1.0))
    default_ctm = "half_pixel" if ctx.opset >= 16 else "output_half_pixel"
    half_pixel = ctx.attr("coordinate_transformation_mode", default_ctm) == "half_pixel"
    use_max = ctx.attr("mode", "avg") == "max"
    height, width = x.shape[2:]
    xf = x.astype(np.float64)
    out = np.zeros((rois.shape[0], x.shape[1], out_h, out_w))
    for r, roi in enumerate(rois.astype(np.float64)):
        offset = 0.5 if half_pixel else 0.0
        x1, y1, x2, y2 = roi * scale - offset
        roi_w, roi_h = x2 - x1, y2 - y1
        if not half_pixel:
            roi_w, roi_h = max(roi_w, 1.0), max(roi_h, 1.0)
        grid_h = ratio if ratio > 0 else int(np.ceil(roi_h / out_h))
        grid_w = ratio if ratio > 0 else int(np.ceil(roi_w / out_w))
        grid_h, grid_w = max(grid_h, 1), max(grid_w, 1)
        yl, yh, wyl, wyh, vy = _roi_samples(y1, roi_h / out_h, out_h, grid_h, height)
        xl, xh, wxl, wxh, vx = _roi_samples(x1, roi_w / out_w, out_w, grid_w, width)
        img = xf[idx[r]]  # [C, H, W]
        terms = []
        for ys, wy in ((yl, wyl), (yh, wyh)):
            for xs, wx in ((xl, wxl), (xh, wxh)):
                vals = img[:, ys[:, :, None, None], xs[None, None, :, :]]  # [C, oh, gh, ow, gw]
                weight = (wy * vy)[:, :, None, None] * (wx * vx)[None, None, :, :]
                terms.append(vals * weight)
        stacked = np.stack(terms)  # [4, C, oh, gh, ow, gw]
        if use_max:
            out[r] = stacked.max(axis=0).max(axis=(2, 4))
        else:
            out[r] = stacked.sum(axis=0).sum(axis=(2, 4)) / (grid_h * grid_w)
    return out.astype(x.dtype)
