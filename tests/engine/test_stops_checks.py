"""engine/stops.py: prompt ids checked when a call is made, and no text held back for nothing."""

from __future__ import annotations

import re

import pytest

from onnx_genrt.core.errors import InvalidInputError
from onnx_genrt.engine import Model, Tokenizer, generate, stream
from onnx_genrt.engine.stops import StopScanner
from onnx_genrt.generate_cli import default_model_dir


@pytest.fixture(scope="module")
def model(qwen2_dir) -> Model:
    return Model(qwen2_dir)


def test_prompt_ids_past_the_vocabulary_are_refused_by_the_call(model):
    """``stream`` refuses them when called, before any iteration; the message lists five."""
    vocab = model.config.vocab_size
    message = f"prompt token ids {list(range(vocab, vocab + 5))} are outside the vocabulary"
    with pytest.raises(InvalidInputError, match=re.escape(message)):
        stream(model, [1, *range(vocab, vocab + 6)], 4)
    with pytest.raises(InvalidInputError, match=re.escape(f"prompt token ids [{vocab}]")):
        stream(model, [1, vocab], 4)
    assert generate(model, [1, vocab - 1], 2, ignore_eos=True).new_tokens == 2


def test_a_prompt_that_encodes_to_no_tokens_is_named(model, qwen2_dir):
    """The fixture's small tokenizer has no token for a space: the message shows the
    prompt's first 40 characters and the folder."""
    assert model.tokenizer.encode(" ") == []
    message = f"the prompt {' ' * 40!r} encodes to no tokens with the tokenizer of {qwen2_dir}"
    with pytest.raises(InvalidInputError, match=re.escape(message)):
        generate(model, " " * 50, 4)


def test_text_is_held_back_only_while_it_may_begin_a_stop_string():
    """Each piece shows everything decoded so far except an end that begins a stop string
    (here one character long): the reference is the decoded text itself."""
    tokenizer = Tokenizer(default_model_dir())
    ids = tokenizer.encode("def add(a, b):\n    return a + b")
    scanner = StopScanner(tokenizer.create_stream(), ("+-",))
    shown, held = "", 0
    for i, token in enumerate(ids):
        shown += scanner.feed([token])[0]
        text = tokenizer.decode(ids[: i + 1])
        held += text.endswith("+")
        assert shown == (text[:-1] if text.endswith("+") else text), (i, shown)
    assert held == 1  # a piece ended with the one character that begins the stop string
