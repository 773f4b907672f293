"""Turn logits into the next token: greedy, or sampled with the usual filters."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from onnx_genrt.core.errors import InvalidInputError, NonFiniteError

from .config import SearchOptions


def validate(options: SearchOptions) -> None:
    """Reject option values that make no sense, naming the option."""
    if options.max_length < 1:
        raise InvalidInputError(f"max_length must be >= 1, got {options.max_length}")
    if options.do_sample and options.temperature <= 0:
        raise InvalidInputError(f"temperature must be > 0 when sampling, got {options.temperature}")
    if options.top_k < 0:
        raise InvalidInputError(f"top_k must be >= 0 (0 = off), got {options.top_k}")
    if not 0.0 < options.top_p <= 1.0:
        raise InvalidInputError(f"top_p must be in (0, 1], got {options.top_p}")
    if not 0.0 <= options.min_p < 1.0:
        raise InvalidInputError(f"min_p must be in [0, 1), got {options.min_p}")
    if options.repetition_penalty <= 0:
        raise InvalidInputError(
            f"repetition_penalty must be > 0 (1 = off), got {options.repetition_penalty}"
        )


def check_finite(logits: np.ndarray, where: str = "") -> None:
    if not np.isfinite(logits).all():
        raise NonFiniteError(f"non-finite logits{' ' + where if where else ''}")


def penalize_repetition(logits: np.ndarray, previous: Sequence[int], penalty: float) -> np.ndarray:
    """CTRL-style penalty: divide positive and multiply negative logits of seen tokens."""
    if penalty == 1.0 or not len(previous):
        return logits
    out = np.array(logits, dtype=np.float32, copy=True)
    seen = np.unique(np.asarray(previous, dtype=np.int64))
    seen = seen[(seen >= 0) & (seen < out.shape[-1])]
    vals = out[seen]
    out[seen] = np.where(vals > 0, vals / penalty, vals * penalty)
    return out


def distribution(logits: np.ndarray, options: SearchOptions) -> np.ndarray:
    """The sampling distribution (float64, sums to 1) after temperature, top-k, top-p, min-p."""
    x = np.asarray(logits, dtype=np.float64) / options.temperature
    x = x - x.max()
    p = np.exp(x)
    p /= p.sum()
    keep = np.ones(p.shape, bool)
    if options.top_k and options.top_k < p.size:
        kth = np.partition(p, -options.top_k)[-options.top_k]
        keep &= p >= kth
    if options.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        cumulative = np.cumsum(p[order])
        # Keep the smallest prefix whose mass reaches top_p (the token crossing it included).
        cut = int(np.searchsorted(cumulative, options.top_p, side="left")) + 1
        mask = np.zeros(p.shape, bool)
        mask[order[:cut]] = True
        keep &= mask
    if options.min_p > 0.0:
        keep &= p >= options.min_p * p.max()
    p = np.where(keep, p, 0.0)
    return p / p.sum()


def pick(
    logits: np.ndarray,
    options: SearchOptions,
    rng: np.random.Generator,
    previous: Sequence[int] = (),
) -> int:
    """Next token from one row of logits."""
    logits = penalize_repetition(logits, previous, options.repetition_penalty)
    if not options.do_sample:
        return int(np.argmax(logits))  # an all -inf row picks index 0, like np.argmax
    p = distribution(logits, options)
    return int(rng.choice(p.size, p=p))
