"""The OpenAI request and response shapes: parse and check request bodies, build responses.

Requests are checked field by field; an unknown field, a value of the wrong type or out
of range, or a feature this server does not have (tools, best_of) is an
:class:`APIError` with status 400 naming the field (``param``), never ignored.

``logprobs`` are those of the model's own distribution (``log_softmax`` of the raw logits),
before penalties, ``logit_bias``, temperature or ``top_p`` shape what is sampled, as vLLM
reports them by default. A log-probability of minus infinity is written as -9999.0 (JSON has
no infinity).
"""

from __future__ import annotations

import itertools
import json
import math
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from onnx_genrt.engine.logprobs import MAX_TOP_LOGPROBS

if TYPE_CHECKING:
    from onnx_genrt.engine.logprobs import TokenLogprob

#: Fields both endpoints accept.
COMMON_FIELDS = (
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "n",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "user",
)
#: Fields OpenAI defines that this server accepts only at their neutral value, which
#: changes nothing: a request asking for more is refused rather than served without it.
NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "suffix": (None, ""),
    "best_of": (None, 1),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "parallel_tool_calls": (None, False, True),
    "response_format": (None, {"type": "text"}),
}
COMPLETION_FIELDS = (*COMMON_FIELDS, "prompt", "logprobs", "echo")
CHAT_FIELDS = (*COMMON_FIELDS, "messages", "max_completion_tokens", "logprobs", "top_logprobs")
#: Most alternatives per position of completions' ``logprobs`` (OpenAI's limit; chat's
#: ``top_logprobs``: the engine's MAX_TOP_LOGPROBS, 20).
MAX_COMPLETION_LOGPROBS = 5
#: What a log-probability of minus infinity is written as.
LOGPROB_FLOOR = -9999.0
#: OpenAI allows at most four stop sequences.
MAX_STOP = 4
#: Most answers (``n``) one request may ask for; each takes a row of the batch.
MAX_N = 16


class APIError(Exception):
    """An error answered with an OpenAI-style body ``{"error": {message, type, param, code}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message = status, message
        self.type, self.param, self.code = type, param, code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_field(param: str, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code=code)


@dataclass(frozen=True)
class GenerationRequest:
    """A checked completion or chat request."""

    chat: bool
    model: str
    #: Completions: the prompt text or token ids; chat: the checked messages.
    prompt: str | list[int] | None
    messages: list[dict[str, str]] | None
    max_tokens: int | None
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    #: Answers (choices) to generate for the prompt, each in its own row.
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    #: (token id, bias) pairs added to the logits before every pick.
    logit_bias: tuple[tuple[int, float], ...] = ()
    #: Alternatives listed with each token's log-probability; None: no log-probabilities.
    logprobs: int | None = None
    #: Completions: the answer begins with the prompt (and, with ``logprobs``, so do its
    #: log-probabilities: none for the first token, the model's for each after it).
    echo: bool = False

    def search_options(self, index: int = 0) -> dict[str, Any]:
        """The engine's search options of answer ``index``: temperature 0 is greedy, above 0
        samples (with a ``seed``, answer i samples from ``seed + i``); the presence and
        frequency penalties apply either way."""
        penalties = {
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "logit_bias": self.logit_bias,
        }
        if self.temperature == 0:
            return {"do_sample": False, **penalties}
        return {
            "do_sample": True,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": None if self.seed is None else self.seed + index,
            **penalties,
        }


def parse_request(body: Any, *, chat: bool) -> GenerationRequest:
    """Check a request body of ``/v1/chat/completions`` (``chat``) or ``/v1/completions``."""
    if not isinstance(body, Mapping):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    allowed = CHAT_FIELDS if chat else COMPLETION_FIELDS
    for name in body:
        if name in NEUTRAL_VALUES:
            if not _neutral(body[name], NEUTRAL_VALUES[name]):
                raise bad_field(
                    name,
                    f"is not supported by this server (only {_neutral_text(name)} is accepted)",
                    "unsupported_parameter",
                )
        elif name not in allowed:
            raise bad_field(name, "unknown field", "unknown_parameter")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_field("model", "required: the name of the model (see /v1/models)")
    n = body.get("n")
    if n is None:
        n = 1
    if _not_int(n) or not 1 <= n <= MAX_N:
        raise bad_field("n", f"must be an integer in [1, {MAX_N}], got {n!r}")
    if chat:
        from onnx_genrt.core.errors import InvalidInputError
        from onnx_genrt.engine.chat_template import check_messages

        try:
            messages = check_messages(body.get("messages"))
        except InvalidInputError as exc:
            raise bad_field("messages", str(exc)) from None
        prompt = None
        max_tokens = _optional_int(body, "max_tokens", 1)
        alias = _optional_int(body, "max_completion_tokens", 1)
        if max_tokens is not None and alias is not None and max_tokens != alias:
            raise bad_field("max_completion_tokens", "differs from max_tokens; give one")
        max_tokens = max_tokens if max_tokens is not None else alias
    else:
        messages = None
        prompt = _prompt(body.get("prompt"))
        # 0 with echo: the prompt scored, nothing generated
        max_tokens = _optional_int(body, "max_tokens", 0 if body.get("echo") is True else 1)
        if max_tokens is None:
            max_tokens = 16  # OpenAI's default for completions
    stream = body.get("stream")
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad_field("stream", f"must be true or false, got {stream!r}")
    return GenerationRequest(
        chat=chat,
        model=model,
        prompt=prompt,
        messages=messages,
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0, low_open=False),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
        seed=_optional_int(body, "seed", 0),
        stop=_stop(body.get("stop")),
        stream=stream,
        include_usage=_include_usage(body.get("stream_options"), stream),
        n=n,
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0, low_open=False),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0, low_open=False),
        logit_bias=_logit_bias(body.get("logit_bias")),
        logprobs=_logprobs(body, chat),
        echo=_flag(body, "echo"),
    )


def _flag(body: Mapping[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad_field(name, f"must be true or false, got {value!r}")
    return value


def _neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    """Whether ``value`` is one of ``neutral``, type included (``False`` is not ``0``)."""
    return any(type(value) is type(n) and value == n for n in neutral)


def _neutral_text(name: str) -> str:
    return " or ".join(json.dumps(n) for n in NEUTRAL_VALUES[name])


def _not_int(value: Any) -> bool:
    return isinstance(value, bool) or not isinstance(value, int)


def _optional_int(body: Mapping[str, Any], name: str, minimum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if _not_int(value) or value < minimum:
        raise bad_field(name, f"must be an integer >= {minimum}, got {value!r}")
    return value


def _number(
    body: Mapping[str, Any], name: str, default: float, low: float, high: float, *, low_open: bool
) -> float:
    value = body.get(name)
    if value is None:
        return default
    ok = (
        not isinstance(value, bool)
        and isinstance(value, int | float)
        and math.isfinite(value)
        and (value > low if low_open else value >= low)
        and value <= high
    )
    if not ok:
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise bad_field(name, f"must be a number in {interval}, got {value!r}")
    return float(value)


def _prompt(value: Any) -> str | list[int]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]  # a batch of one prompt
    if isinstance(value, str):
        if not value:
            raise bad_field("prompt", "is empty")
        return value
    if isinstance(value, list) and value and all(not _not_int(t) and t >= 0 for t in value):
        return list(value)
    raise bad_field(
        "prompt",
        "must be a non-empty string or a list of token ids (one prompt per request; "
        "send several requests for several prompts)",
    )


def _logprobs(body: Mapping[str, Any], chat: bool) -> int | None:
    """Chat: ``logprobs`` true, with ``top_logprobs`` (0-20) alternatives; completions:
    ``logprobs`` (0-5) alternatives. None: no log-probabilities."""
    value = body.get("logprobs")
    if not chat:
        if value is None:
            return None
        if _not_int(value) or not 0 <= value <= MAX_COMPLETION_LOGPROBS:
            raise bad_field(
                "logprobs",
                f"must be an integer in [0, {MAX_COMPLETION_LOGPROBS}] (alternatives per "
                f"token), got {value!r}",
            )
        return value
    if value is not None and not isinstance(value, bool):
        raise bad_field("logprobs", f"must be true or false, got {value!r}")
    top = body.get("top_logprobs")
    if top is not None and (_not_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS):
        raise bad_field(
            "top_logprobs", f"must be an integer in [0, {MAX_TOP_LOGPROBS}], got {top!r}"
        )
    if not value:
        if top:
            raise bad_field("top_logprobs", "needs logprobs: true")
        return None
    return top or 0


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``{"token id": bias}`` (ids as JSON keys, biases in [-100, 100])."""
    if value is None:
        return ()
    if not isinstance(value, Mapping):
        raise bad_field("logit_bias", f"must map token ids to biases, got {value!r}")
    pairs = []
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isdigit()):
            raise bad_field("logit_bias", f"keys must be token ids, got {key!r}")
        if (
            isinstance(bias, bool)
            or not isinstance(bias, int | float)
            or not math.isfinite(bias)
            or not -100 <= bias <= 100
        ):
            raise bad_field("logit_bias", f"biases must be numbers in [-100, 100], got {bias!r}")
        pairs.append((int(key), float(bias)))
    return tuple(sorted(pairs))


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if (
        not isinstance(items, list)
        or len(items) > MAX_STOP
        or not all(isinstance(s, str) and s for s in items)
    ):
        raise bad_field(
            "stop", f"must be a non-empty string or a list of at most {MAX_STOP} of them"
        )
    return tuple(items)


def _include_usage(value: Any, stream: bool) -> bool:
    if value is None:
        return False
    if not stream:
        raise bad_field("stream_options", "is only allowed with stream=true")
    if not isinstance(value, Mapping) or set(value) - {"include_usage"}:
        raise bad_field("stream_options", "must be {'include_usage': true|false}")
    include = value.get("include_usage", False)
    if not isinstance(include, bool):
        raise bad_field("stream_options", "include_usage must be true or false")
    return include


# -- responses ------------------------------------------------------------------------
def new_id(chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def logprobs_body(
    request: GenerationRequest,
    entries: Sequence[TokenLogprob],
    token_text: Callable[[int], str],
    offset: int = 0,
) -> dict[str, Any]:
    """A choice's ``logprobs`` for ``entries`` (its tokens in order): chat's ``content``
    list, or the completions' parallel lists, whose ``text_offset`` counts from ``offset``
    (the characters of the answer before these tokens) and whose ``top_logprobs`` hold the
    likeliest tokens and the chosen one."""
    if request.chat:
        content = [
            {
                **_token_entry(e.token, e.logprob, token_text),
                "top_logprobs": [_token_entry(t, lp, token_text) for t, lp in e.top],
            }
            for e in entries
        ]
        return {"content": content, "refusal": None}
    tokens = [token_text(e.token) for e in entries]
    return {
        "tokens": tokens,
        "token_logprobs": [_finite(e.logprob) for e in entries],
        "top_logprobs": [
            {token_text(t): _finite(lp) for t, lp in (*e.top, (e.token, e.logprob))}
            for e in entries
        ],
        "text_offset": list(itertools.accumulate((len(t) for t in tokens), initial=offset))[:-1],
    }


def echoed_logprobs_body(
    request: GenerationRequest,
    first_token: int,
    prompt: Sequence[TokenLogprob],
    answer: Sequence[TokenLogprob],
    token_text: Callable[[int], str],
) -> dict[str, Any]:
    """A completion's ``logprobs`` with the prompt echoed: the prompt's first token (no
    log-probability, as OpenAI gives it: null), the rest of the prompt's, then the
    answer's, offsets counted from the prompt's start."""
    first = token_text(first_token)
    head = logprobs_body(request, prompt, token_text, len(first))
    tail = logprobs_body(request, answer, token_text, len(first) + sum(map(len, head["tokens"])))
    return {
        "tokens": [first, *head["tokens"], *tail["tokens"]],
        "token_logprobs": [None, *head["token_logprobs"], *tail["token_logprobs"]],
        "top_logprobs": [None, *head["top_logprobs"], *tail["top_logprobs"]],
        "text_offset": [0, *head["text_offset"], *tail["text_offset"]],
    }


def _token_entry(token: int, logprob: float, token_text: Callable[[int], str]) -> dict[str, Any]:
    text = token_text(token)
    return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}


def _finite(logprob: float) -> float:
    return logprob if logprob > LOGPROB_FLOOR else LOGPROB_FLOOR


def completion_body(
    request: GenerationRequest,
    response_id: str,
    created: int,
    answers: list[tuple[str, str]],
    prompt_tokens: int,
    completion_tokens: int,
    logprobs: Sequence[dict[str, Any] | None] = (),
) -> dict[str, Any]:
    """A whole (non-streamed) response of either endpoint: one choice per (text, finish
    reason) of ``answers``, with its ``logprobs_body`` where given; ``completion_tokens``
    counts them all."""
    choices = []
    for index, (text, finish_reason) in enumerate(answers):
        probs = logprobs[index] if index < len(logprobs) else None
        if request.chat:
            choice = {
                "index": index,
                "message": {"role": "assistant", "content": text},
                "logprobs": probs,
                "finish_reason": finish_reason,
            }
        else:
            choice = {
                "index": index,
                "text": text,
                "logprobs": probs,
                "finish_reason": finish_reason,
            }
        choices.append(choice)
    return {
        "id": response_id,
        "object": "chat.completion" if request.chat else "text_completion",
        "created": created,
        "model": request.model,
        "choices": choices,
        "usage": usage(prompt_tokens, completion_tokens),
    }


def chunk_body(
    request: GenerationRequest,
    response_id: str,
    created: int,
    *,
    text: str | None = None,
    role: bool = False,
    finish_reason: str | None = None,
    usage_counts: dict[str, int] | None = None,
    index: int = 0,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One streamed chunk of answer ``index``: a piece of text (with its tokens'
    ``logprobs_body``), the role (chat's first chunk), the finish reason (last chunk), or,
    with ``usage_counts``, the usage chunk (no choices)."""
    if usage_counts is not None:
        choices: list[dict[str, Any]] = []
    elif request.chat:
        delta: dict[str, str] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choices = [
            {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        ]
    else:
        choices = [
            {
                "index": index,
                "text": text or "",
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
        ]
    body: dict[str, Any] = {
        "id": response_id,
        "object": "chat.completion.chunk" if request.chat else "text_completion",
        "created": created,
        "model": request.model,
        "choices": choices,
    }
    if request.include_usage:
        body["usage"] = usage_counts
    return body


def sse(body: dict[str, Any]) -> str:
    """One server-sent event carrying ``body`` as JSON."""
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


class TextChunks:
    """The server-sent events of one streamed answer's text pieces, from a template made
    once per answer: ``event(text)`` gives what ``sse(chunk_body(..., text=text))`` gives,
    at the cost of encoding the text alone."""

    def __init__(
        self, request: GenerationRequest, response_id: str, created: int, index: int = 0
    ) -> None:
        marker = uuid.uuid4().hex  # a string JSON writes as is, found nowhere else
        whole = sse(chunk_body(request, response_id, created, text=marker, index=index))
        self._head, self._tail = whole.split(f'"{marker}"')

    def event(self, text: str) -> str:
        return f"{self._head}{json.dumps(text, ensure_ascii=False)}{self._tail}"


def now() -> int:
    return int(time.time())
