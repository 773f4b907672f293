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

    ``feed(tokens)`` returns the new text (up to a stop string, which is not included),
    the tokens fed, and the stop string hit (None if none). Without a tokenizer the text
    stays empty and stop strings never match.
    """

    def __init__(self, decoder: TokenizerStream | None, stop: tuple[str, ...]) -> None:
        self.decoder, self.stop = decoder, stop
        self.text = ""

    def feed(self, tokens: Sequence[int]) -> tuple[str, list[int], str | None]:
        tokens = [int(t) for t in tokens]
        if self.decoder is None:
            return "", tokens, None
        piece = "".join(self.decoder.decode(t) for t in tokens)
        before = len(self.text)
        self.text += piece
        # A stop string may straddle pieces: search from where one could start.
        start = max(0, before - max((len(s) for s in self.stop), default=0) + 1)
        hits = [(self.text.find(s, start), s) for s in self.stop]
        hits = [(at, s) for at, s in hits if at >= 0]
        if not hits:
            return piece, tokens, None
        cut, hit = min(hits)
        self.text = self.text[:cut]
        return self.text[before:] if cut > before else "", tokens, hit
