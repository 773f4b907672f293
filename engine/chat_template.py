"""Chat templates: check a conversation and render it with the model's Jinja template.

The template comes from ``tokenizer_config.json`` (``chat_template``) and is rendered in
Jinja's immutable sandbox with the names Hugging Face templates expect: ``messages``,
``add_generation_prompt``, the special tokens (``bos_token``, ``eos_token``, ...), the
``raise_exception`` and ``strftime_now`` functions and a ``tojson`` filter that does not
HTML-escape.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any, NoReturn

from onnx_genrt.core.errors import InvalidInputError, ModelLoadError

#: Roles a message may have (OpenAI's chat roles; ``developer`` is not among them).
ROLES = ("system", "user", "assistant", "tool")
#: Optional string fields a message may carry besides ``role`` and ``content``.
OPTIONAL_MESSAGE_FIELDS = ("name", "tool_call_id")
#: tokenizer_config.json entries passed to the template under their own names.
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token")


class TemplateRefusal(Exception):
    """Raised by ``raise_exception`` inside a template: the template refuses the messages."""


def check_messages(messages: Any) -> list[dict[str, str]]:
    """``messages`` as a list of ``{role, content}`` dicts with str content, or an
    InvalidInputError naming the message and field at fault."""
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        raise InvalidInputError(
            f"messages must be a list of {{'role', 'content'}} objects, got "
            f"{type(messages).__name__}"
        )
    if not messages:
        raise InvalidInputError("messages is empty; give at least one message")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidInputError(
                f"messages[{i}] must be an object with 'role' and 'content', got "
                f"{type(message).__name__}"
            )
        unknown = sorted(set(message) - {"role", "content", *OPTIONAL_MESSAGE_FIELDS})
        if unknown:
            raise InvalidInputError(
                f"messages[{i}] has unsupported fields {unknown}; a message has 'role', "
                f"'content' and optionally {list(OPTIONAL_MESSAGE_FIELDS)}"
            )
        role = message.get("role")
        if role not in ROLES:
            raise InvalidInputError(
                f"messages[{i}].role must be one of {list(ROLES)}, got {role!r}"
            )
        content = message.get("content")
        if not isinstance(content, str):
            raise InvalidInputError(
                f"messages[{i}].content must be a string, got {type(content).__name__} "
                "(content parts and tool calls are not supported)"
            )
        for key in OPTIONAL_MESSAGE_FIELDS:
            if key in message and not isinstance(message[key], str):
                raise InvalidInputError(f"messages[{i}].{key} must be a string")
        checked.append(dict(message))
    return checked


def render_chat(
    template: str,
    messages: Any,
    *,
    add_generation_prompt: bool = True,
    config: Mapping[str, Any] | None = None,
    source: str = "tokenizer_config.json",
) -> str:
    """Render ``messages`` (checked first) with ``template``.

    ``config`` is the tokenizer config whose special tokens the template sees; ``source``
    names the template's file in errors. A template that does not compile or fails while
    rendering is a ModelLoadError; one that calls ``raise_exception`` refuses the messages
    (InvalidInputError).
    """
    checked = check_messages(messages)
    compiled = _compile(template, source)
    tokens = {name: _token_text((config or {}).get(name)) for name in SPECIAL_TOKENS}
    try:
        return compiled.render(
            messages=checked, add_generation_prompt=bool(add_generation_prompt), **tokens
        )
    except TemplateRefusal as exc:
        raise InvalidInputError(
            f"the chat template in {source} refused the messages: {exc}"
        ) from None
    except Exception as exc:  # a template bug (undefined call, sandbox violation, type error)
        raise ModelLoadError(
            f"the chat template in {source} failed to render: {type(exc).__name__}: {exc}; "
            "fix chat_template there"
        ) from None


def _token_text(value: Any) -> str:
    """A special token as text: tokenizer configs hold a string or an AddedToken dict."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _raise_exception(message: str) -> NoReturn:
    raise TemplateRefusal(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """JSON without HTML escaping (Jinja's own ``tojson`` escapes ``<``, ``>``, ``&``, ``'``)."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile(template: str, source: str):
    try:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as exc:  # pragma: no cover - jinja2 is a dependency
        raise ModelLoadError("rendering a chat template needs the 'jinja2' package") from exc
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ModelLoadError(
            f"the chat template in {source} does not compile: {exc.message} (template line "
            f"{exc.lineno}); fix chat_template there"
        ) from None
