"""End of sequence inside accepted drafts: speculation stops where greedy stops.

Each test first runs speculation without an end-of-sequence token and finds a generated
token that was *accepted as a draft* (and not generated earlier); that token is then made
the model's end-of-sequence id. Greedy stops right after it, and so must speculation, even
though the verify step that accepts it holds more accepted drafts and a bonus token after it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import pytest

from onnx_genrt.core.errors import InvalidInputError
from onnx_genrt.engine import Generator, GeneratorParams, Model, SpeculativeGenerator, generate
from onnx_genrt.engine.api import make_generator
from onnx_genrt.generate_cli import default_model_dir

NEW_TOKENS = 48
# The embedded trained model: its MTP head and draft model agree with it often, and its
# Python repeats itself, so every proposer gets drafts accepted.
PROMPTS = [
    "class Foo:\n    def __init__(self",
    "import os\n\ndef main(",
    "def f(x):\n    return x\n\ndef g(x):\n    return x\n\ndef h(",  # n-gram drafts
]


@pytest.fixture(scope="module")
def model() -> Model:
    return Model(default_model_dir())


def _accepted_draft_positions(model: Model, prompt: list[int], spec: str) -> tuple[list, list]:
    """Tokens of an eos-free speculative run, and the positions of those that were
    accepted drafts."""
    params = GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + NEW_TOKENS)
    gen = make_generator(model, params, spec, k=4)
    assert isinstance(gen, SpeculativeGenerator)
    gen.eos = set()
    gen.append_tokens(prompt)
    positions = []
    while not gen.is_done():
        steps = len(gen.spec.accepted_lengths)
        start = len(gen.tokens)
        gen.generate_next_token()
        if len(gen.spec.accepted_lengths) > steps:
            positions += range(start, start + gen.spec.accepted_lengths[-1])
    tokens = gen.get_sequence()
    gen.close()
    return tokens, positions


def _eos_inside_accepted_drafts(model: Model, spec: str) -> tuple[list[int], int, int]:
    """(prompt, eos id, its position): an accepted draft's token, first generated there,
    with accepted drafts after it in the same step (or a bonus token)."""
    for text in PROMPTS:
        prompt = model.tokenizer.encode(text)
        tokens, positions = _accepted_draft_positions(model, prompt, spec)
        for pos in positions:
            if tokens[pos] not in tokens[len(prompt) : pos] and pos < len(tokens) - 1:
                return prompt, tokens[pos], pos
    pytest.fail(f"no prompt had an accepted {spec} draft to make the end-of-sequence token")


@contextlib.contextmanager
def _eos(model: Model, eos: int) -> Iterator[None]:
    """Make ``eos`` the model's only end-of-sequence id for the block."""
    saved = model.config
    model.config = dataclasses.replace(saved, eos_token_ids=(eos,))
    try:
        yield
    finally:
        model.config = saved


@pytest.mark.parametrize("spec", ["mtp", "draft", "ngram"])
def test_eos_among_accepted_drafts_ends_where_greedy_ends(model, spec):
    prompt, eos, pos = _eos_inside_accepted_drafts(model, spec)
    with _eos(model, eos):
        greedy = generate(model, prompt, NEW_TOKENS)
        result = generate(model, prompt, NEW_TOKENS, spec=spec, k=4)
    assert greedy.stop_reason == "eos"
    assert len(greedy.tokens) == pos + 1 and greedy.tokens[-1] == eos
    assert result.tokens == greedy.tokens
    assert result.stop_reason == "eos"
    assert result.new_tokens == greedy.new_tokens
    assert result.text == greedy.text


@pytest.mark.parametrize("spec", ["mtp", "draft", "ngram"])
def test_generator_is_done_at_an_accepted_eos_draft(model, spec):
    """The step API: the step that accepts the eos draft ends with it, the generator is
    done, and another step is refused."""
    prompt, eos, pos = _eos_inside_accepted_drafts(model, spec)
    with _eos(model, eos):
        params = GeneratorParams(model)
        params.set_search_options(max_length=len(prompt) + NEW_TOKENS)
        reference = Generator(model, params)
        gen = make_generator(model, params, spec, k=4)
    for g in (reference, gen):
        g.append_tokens(prompt)
        while not g.is_done():
            g.generate_next_token()
    assert gen.get_next_tokens()[-1] == eos
    assert gen.get_sequence() == reference.get_sequence()
    assert len(gen.get_sequence()) == pos + 1
    with pytest.raises(InvalidInputError, match="generation is done"):
        gen.generate_next_token()
