"""Turn logits into the next token: greedy, or sampled with the usual filters."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from onnx_genrt.core.checks import check_bool, check_float, check_int
from onnx_genrt.core.errors import InvalidInputError, OnnxGenrtError

if TYPE_CHECKING:
    from .config import SearchOptions


def validate(
    options: SearchOptions,
    *,
    error: type[OnnxGenrtError] = InvalidInputError,
    where: str = "search option ",
    from_json: bool = False,
) -> SearchOptions:
    """``options`` with every value checked for type, range and finiteness (the option's
    name, prefixed by ``where``, is in the message) and converted to plain Python types.
    ``from_json``: whole-number floats count as integers (JSON writers put 1e9 or 64.0)."""

    def name(option: str) -> str:
        return f"{where}{option}"

    def integer(value: object, label: str, **kwargs: Any) -> int:
        return check_int(value, label, integral_floats=from_json, **kwargs)

    seed = options.seed
    if seed is not None:
        seed = integer(seed, name("seed"), minimum=0, error=error)
    do_sample = check_bool(options.do_sample, name("do_sample"), error=error)
    checked = dataclasses.replace(
        options,
        max_length=integer(options.max_length, name("max_length"), minimum=1, error=error),
        min_length=integer(options.min_length, name("min_length"), minimum=0, error=error),
        do_sample=do_sample,
        temperature=check_float(
            options.temperature,
            name("temperature") + (" (sampling)" if do_sample else ""),
            minimum=0.0,
            open_min=do_sample,
            error=error,
        ),
        top_k=integer(options.top_k, name("top_k") + " (0 = off)", minimum=0, error=error),
        top_p=check_float(
            options.top_p, name("top_p"), minimum=0.0, maximum=1.0, open_min=True, error=error
        ),
        min_p=check_float(options.min_p, name("min_p"), minimum=0.0, error=error),
        repetition_penalty=check_float(
            options.repetition_penalty,
            name("repetition_penalty") + " (1 = off)",
            minimum=0.0,
            open_min=True,
            error=error,
        ),
        presence_penalty=check_float(
            options.presence_penalty,
            name("presence_penalty") + " (0 = off)",
            minimum=-2.0,
            maximum=2.0,
            error=error,
        ),
        frequency_penalty=check_float(
            options.frequency_penalty,
            name("frequency_penalty") + " (0 = off)",
            minimum=-2.0,
            maximum=2.0,
            error=error,
        ),
        logit_bias=_logit_bias(options.logit_bias, name("logit_bias"), error),
        seed=seed,
        batch_size=integer(options.batch_size, name("batch_size"), minimum=1, error=error),
    )
    if checked.min_p >= 1.0:
        raise error(f"{name('min_p')} must be in [0, 1), got {checked.min_p}")
    return checked


def _logit_bias(
    value: Any, label: str, error: type[OnnxGenrtError]
) -> tuple[tuple[int, float], ...]:
    """``{token id: bias}`` (or (id, bias) pairs) as sorted pairs; ids >= 0, biases in
    [-100, 100]."""
    pairs = value.items() if isinstance(value, Mapping) else value
    try:
        items = [(token, bias) for token, bias in pairs]
    except (TypeError, ValueError):
        raise error(f"{label} must map token ids to biases, got {value!r}") from None
    checked = {
        check_int(token, f"{label} token id", minimum=0, error=error): check_float(
            bias, f"{label}[{token}]", minimum=-100.0, maximum=100.0, error=error
        )
        for token, bias in items
    }
    return tuple(sorted(checked.items()))


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


#: Largest tokens taken first when top_p looks for the smallest prefix of the descending
#: distribution that reaches its mass (then 8x more, up to the whole vocabulary).
TOP_P_FIRST = 256


def descending_prefix(p: np.ndarray, mass: float) -> tuple[np.ndarray, np.ndarray]:
    """(indices, cumulative): ``p``'s indices by descending value, ties by index (a stable
    argsort of ``-p``), and their running sum, far enough to reach ``mass`` (or all of them).

    The largest values are found by partition first, so a large vocabulary is sorted only
    where top_p looks; the prefix is the one a full sort gives, with the same sums."""
    n = p.size
    k = TOP_P_FIRST
    while k < n:
        kth = np.partition(p, n - k)[n - k]
        candidates = np.flatnonzero(p >= kth)  # every tie of the k-th value, by index
        order = candidates[np.argsort(-p[candidates], kind="stable")]
        cumulative = np.cumsum(p[order])
        if cumulative[-1] >= mass:
            return order, cumulative
        k *= 8
    order = np.argsort(-p, kind="stable")
    return order, np.cumsum(p[order])


def distribution(logits: np.ndarray, options: SearchOptions) -> np.ndarray:
    """The sampling distribution (float64, sums to 1) after temperature, top-k, top-p, min-p."""
    p = np.array(logits, dtype=np.float64)
    p /= options.temperature
    p -= p.max()
    np.exp(p, out=p)
    p /= p.sum()
    keep = None
    if options.top_k and options.top_k < p.size:
        kth = np.partition(p, -options.top_k)[-options.top_k]
        keep = p >= kth
    if options.top_p < 1.0:
        order, cumulative = descending_prefix(p, options.top_p)
        # Keep the smallest prefix whose mass reaches top_p (the token crossing it included).
        cut = int(np.searchsorted(cumulative, options.top_p, side="left")) + 1
        mask = np.zeros(p.shape, bool)
        mask[order[:cut]] = True
        keep = mask if keep is None else keep & mask
    if options.min_p > 0.0:
        mask = p >= options.min_p * p.max()
        keep = mask if keep is None else keep & mask
    if keep is not None:
        p[~keep] = 0.0
    p /= p.sum()
    return p


def draw(p: np.ndarray, rng: np.random.Generator) -> int:
    """An index drawn from the distribution ``p`` (non-negative, summing to 1): what
    ``rng.choice(p.size, p=p)`` returns, from the same one uniform draw, without its checks
    of ``p`` (a vocabulary-sized pass each)."""
    cdf = np.cumsum(p)
    cdf /= cdf[-1]
    return int(cdf.searchsorted(rng.random(), side="right"))


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
    return draw(distribution(logits, options), rng)


def penalize_presence_frequency(
    logits: np.ndarray, generated: Sequence[int], presence: float, frequency: float
) -> np.ndarray:
    """OpenAI's additive penalties: each token's logit minus ``frequency`` times its count in
    ``generated`` and ``presence`` once if it occurs there."""
    if (presence == 0.0 and frequency == 0.0) or not len(generated):
        return logits
    out = np.array(logits, dtype=np.float32, copy=True)
    ids, counts = np.unique(np.asarray(generated, dtype=np.int64), return_counts=True)
    inside = (ids >= 0) & (ids < out.shape[-1])
    out[ids[inside]] -= (frequency * counts[inside] + presence).astype(np.float32)
    return out


def masked_logits(
    logits: np.ndarray,
    history: Sequence[int],
    options: SearchOptions,
    eos: set[int],
    prompt_length: int = 0,
) -> np.ndarray:
    """One row's logits after the repetition penalty (over ``history``), the presence and
    frequency penalties (over what follows its first ``prompt_length`` tokens), the logit
    bias and, before ``min_length``, with end-of-sequence tokens ruled out (as
    onnxruntime-genai does)."""
    logits = penalize_repetition(logits, history, options.repetition_penalty)
    logits = penalize_presence_frequency(
        logits, history[prompt_length:], options.presence_penalty, options.frequency_penalty
    )
    if options.logit_bias:
        logits = np.array(logits, dtype=np.float32, copy=True)
        for token, bias in options.logit_bias:
            if token < logits.shape[-1]:
                logits[token] += bias
    if eos and len(history) < options.min_length:
        logits = np.array(logits, dtype=np.float32, copy=True)
        logits[[t for t in eos if t < logits.shape[-1]]] = -np.inf
    return logits


def plain_greedy(options: SearchOptions) -> bool:
    """Whether the next token is the argmax of the raw logits (no sampling, no penalty)."""
    return (
        not options.do_sample
        and options.repetition_penalty == 1.0
        and options.presence_penalty == 0.0
        and options.frequency_penalty == 0.0
        and not options.logit_bias
    )


def choose(
    argmax: int | None,
    logits: Callable[[], np.ndarray],
    history: Sequence[int],
    options: SearchOptions,
    eos: set[int],
    rng: np.random.Generator,
    prompt_length: int = 0,
) -> int:
    """The next token of a row whose device argmax is ``argmax`` (None when not computed):
    that argmax when plain greedy allows it, else picked from ``logits()`` (read only
    then) after :func:`masked_logits`."""
    masked = argmax in eos and len(history) < options.min_length
    if plain_greedy(options) and argmax is not None and not masked:
        return argmax
    return pick(masked_logits(logits(), history, options, eos, prompt_length), options, rng, ())
