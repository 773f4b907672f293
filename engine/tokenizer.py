"""HF ``tokenizers`` wrapper: encode, decode, streaming decode and chat templates."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from onnx_genrt.core.errors import InvalidInputError, ModelLoadError
from onnx_genrt.core.paths import resolve_inside

from .chat_template import render_chat
from .config import read_json_object


class Tokenizer:
    """Loads ``tokenizer.json`` (and ``tokenizer_config.json`` when present) from a folder."""

    def __init__(self, folder: str | Path) -> None:
        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError as exc:  # pragma: no cover - tokenizers is a dependency
            raise ModelLoadError(
                "the 'tokenizers' package is needed to read tokenizer.json"
            ) from exc
        folder = Path(folder)
        path = resolve_inside(folder, "tokenizer.json", "tokenizer.json")
        if not path.is_file():
            raise ModelLoadError(f"no tokenizer.json in {folder}")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as exc:
            raise ModelLoadError(f"{path} cannot be read: {exc}") from None
        self.config: dict[str, Any] = read_json_object(folder, "tokenizer_config.json") or {}
        self._config_path = folder / "tokenizer_config.json"
        #: ``token_text`` per id, kept (log-probabilities name every token they list).
        self._token_texts = functools.lru_cache(maxsize=65536)(self._one_token_text)

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, which must be a str of valid Unicode (no lone surrogates)."""
        if not isinstance(text, str):
            raise InvalidInputError(f"text to encode must be a str, got {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidInputError(
                f"the text has a lone surrogate {text[exc.start]!r} at index {exc.start}; "
                "it cannot be encoded as UTF-8 (decode input bytes with errors='replace')"
            ) from None
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token: int) -> str:
        """One token id's text, special tokens included (cached per id)."""
        return self._token_texts(int(token))

    def _one_token_text(self, token: int) -> str:
        return self._tok.decode([token], skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def create_stream(self) -> TokenizerStream:
        return TokenizerStream(self)

    @property
    def chat_template(self) -> str | None:
        """The ``chat_template`` of tokenizer_config.json (None when absent)."""
        template = self.config.get("chat_template")
        if template is not None and not isinstance(template, str):
            raise ModelLoadError(
                f"{self._config_path}: chat_template must be a string, got "
                f"{type(template).__name__} (named templates are not supported)"
            )
        return template

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """Render ``messages`` with the model's chat template in Jinja's sandbox (see
        :mod:`onnx_genrt.engine.chat_template`); errors name tokenizer_config.json."""
        template = self.chat_template
        if not template:
            raise ModelLoadError(
                f"{self._config_path} has no chat_template; add one to chat with this model"
            )
        return render_chat(
            template,
            messages,
            add_generation_prompt=add_generation_prompt,
            config=self.config,
            source=str(self._config_path),
        )


class TokenizerStream:
    """Decode one token at a time, emitting only complete characters.

    Uses ``tokenizers``' own incremental ``DecodeStream``, which decodes a short window of
    recent ids per step (decoding the whole sequence each step costs O(length) per token).
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        from tokenizers.decoders import DecodeStream

        self._hf = tokenizer._tok
        self._stream = DecodeStream(skip_special_tokens=True)

    def decode(self, token: int) -> str:
        return self._stream.step(self._hf, int(token)) or ""
