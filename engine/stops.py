"""Request inputs shared by ``generate`` and the scheduler: prompt ids, stop strings, and
the scan that cuts a stream of text at the first stop string."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from onnx_genrt.core.checks import check_int
from onnx_genrt.core.errors import InvalidInputError

if TYPE_CHECKING:
    from .model import Model
    from .tokenizer import TokenizerStream


def stop_strings(stop: str | Sequence[str]) -> tuple[str, ...]:
    """``stop`` as a tuple of non-empty strings (a lone string is one stop string)."""
    items = (stop,) if isinstance(stop, str) else stop
    if not isinstance(items, Sequence):
        raise InvalidInputError(f"stop must be a string or a sequence of strings, got {stop!r}")
    for item in items:
        if not isinstance(item, str) or not item:
            raise InvalidInputError(f"stop strings must be non-empty strings, got {item!r}")
    return tuple(items)


def prompt_ids(model: Model, prompt: str | Sequence[int]) -> list[int]:
    """The prompt's token ids: a string is encoded, a sequence must hold integer ids."""
    if isinstance(prompt, str):
        ids = model.tokenizer.encode(prompt)
        if not ids and prompt:
            raise InvalidInputError(
                f"the prompt {prompt[:40]!r} encodes to no tokens with the tokenizer of "
                f"{model.config.folder}"
            )
    elif isinstance(prompt, Sequence | np.ndarray) and not isinstance(prompt, bytes | bytearray):
        ids = [check_int(t, f"prompt token {i}", minimum=0) for i, t in enumerate(prompt)]
    else:
        raise InvalidInputError(
            f"prompt must be a string or a sequence of token ids, got {type(prompt).__name__}"
        )
    if not ids:
        raise InvalidInputError("the prompt is empty")
    vocab = model.config.vocab_size
    bad = [t for t in ids if t >= vocab]
    if bad:
        raise InvalidInputError(f"prompt token ids {bad[:5]} are outside the vocabulary of {vocab}")
    return ids


class StopScanner:
    """Decodes a row's tokens into text and cuts it at the first stop string.

    ``feed(tokens)`` returns the new text that is safe to show (up to a stop string, which
    is not included), the tokens fed, and the stop string hit (None if none). Text that
    could be the start of a stop string is held back until the next tokens tell; when the
    generation ends without a stop string, :meth:`flush` returns what was held back.
    ``text`` is everything decoded so far, cut at a stop string. Without a tokenizer the
    text stays empty and stop strings never match.
    """

    def __init__(self, decoder: TokenizerStream | None, stop: tuple[str, ...]) -> None:
        self.decoder, self.stop = decoder, stop
        self.text = ""
        self._shown = 0  # length of the text returned so far

    def feed(self, tokens: Sequence[int]) -> tuple[str, list[int], str | None]:
        """Decode ``tokens`` one by one; where one completes a stop string, the tokens
        returned end with it (a speculative step's tokens after it are not generated)."""
        tokens = [int(t) for t in tokens]
        if self.decoder is None:
            return "", tokens, None
        longest = max((len(s) for s in self.stop), default=0)
        for count, token in enumerate(tokens, 1):
            before = len(self.text)
            self.text += self.decoder.decode(token)
            # A stop string may straddle pieces: search from where one could start.
            start = max(0, before - longest + 1)
            hits = [(self.text.find(s, start), s) for s in self.stop]
            hits = [(at, s) for at, s in hits if at >= 0]
            if hits:
                cut, hit = min(hits)
                self.text = self.text[:cut]
                return self._show(cut), tokens[:count], hit
        return self._show(len(self.text) - self._held()), tokens, None

    def flush(self) -> str:
        """The text held back as a possible start of a stop string (the generation ended)."""
        return self._show(len(self.text))

    def _held(self) -> int:
        """Length of the longest end of the text that begins a stop string."""
        return max(
            (n for s in self.stop for n in range(len(s) - 1, 0, -1) if self.text.endswith(s[:n])),
            default=0,
        )

    def _show(self, end: int) -> str:
        piece = self.text[self._shown : end] if end > self._shown else ""
        self._shown = max(self._shown, end)
        return piece
