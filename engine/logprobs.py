"""Log-probabilities of the chosen tokens (OpenAI's ``logprobs``): the model's own
distribution, ``log_softmax`` of the raw logits in float64, before any penalty, bias,
temperature or truncation changes what is sampled (as vLLM reports by default)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from onnx_genrt.core.checks import check_int

#: Most alternatives a request may ask for at each position (OpenAI's chat limit).
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability and the ``top`` likeliest tokens at its
    position, (token id, log-probability) from the likeliest (ties: lower id first)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def check_top_logprobs(value: int | None) -> int | None:
    """``None`` (no log-probabilities) or how many alternatives each position lists."""
    if value is None:
        return None
    return check_int(value, "logprobs", minimum=0, maximum=MAX_TOP_LOGPROBS)


def token_logprob(logits: np.ndarray, token: int, top: int) -> TokenLogprob:
    """``token``'s log-probability under ``logits`` [vocab] and the ``top`` likeliest."""
    x = np.asarray(logits, np.float64).reshape(-1)
    peak = float(np.max(x))
    if not np.isfinite(peak):
        raise ValueError("non-finite logits have no log-probabilities")
    log_norm = peak + float(np.log(np.sum(np.exp(x - peak))))
    best: tuple[tuple[int, float], ...] = ()
    if top:
        ids = np.argpartition(-x, top - 1)[:top] if top < x.size else np.arange(x.size)
        ids = sorted(ids.tolist(), key=lambda i: (-x[i], i))
        best = tuple((int(i), float(x[i] - log_norm)) for i in ids)
    return TokenLogprob(int(token), float(x[token] - log_norm), best)
