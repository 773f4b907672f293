"""StopScanner against the reference cut: the whole decoded text up to the first stop
string (``str.find``); streamed pieces never show text past that cut."""

from __future__ import annotations

import pytest

from onnx_genrt.engine import Model, Tokenizer, generate
from onnx_genrt.engine.stops import StopScanner
from onnx_genrt.generate_cli import default_model_dir


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(default_model_dir())


@pytest.fixture(scope="module")
def tokens(tokenizer: Tokenizer) -> list[int]:
    result = generate(Model(default_model_dir()), "def add(a, b):", 40, ignore_eos=True)
    return result.tokens[result.prompt_tokens :]


def scan(
    tokenizer: Tokenizer, tokens: list[int], stop: tuple[str, ...]
) -> tuple[list[str], str | None]:
    scanner = StopScanner(tokenizer.create_stream(), stop)
    pieces = []
    for token in tokens:
        piece, _, hit = scanner.feed([token])
        pieces.append(piece)
        if hit is not None:
            return pieces, hit
    return [*pieces, scanner.flush()], None


def reference_cut(text: str, stop: tuple[str, ...]) -> str:
    found = [text.find(s) for s in stop if s in text]
    return text[: min(found)] if found else text


def test_every_stop_inside_the_text_cuts_it_exactly(tokenizer, tokens):
    """Stops of 2-6 characters at every offset: many start inside a token and end in a
    later one; the pieces shown add up to the reference cut, never past it."""
    text = tokenizer.decode(tokens)
    checked = 0
    for length in (2, 3, 6):
        for at in range(0, len(text) - length):
            stop = (text[at : at + length],)
            pieces, hit = scan(tokenizer, tokens, stop)
            expected = reference_cut(text, stop)
            assert "".join(pieces) == expected, (stop, pieces)
            assert hit == stop[0]
            checked += 1
    assert checked > 100


@pytest.mark.parametrize("stop", [("zzz",), ("\n\n\n\n\n\n\n\n",), ("(a, b):\nQQ", "QQ")])
def test_a_stop_that_never_completes_holds_back_then_flushes(tokenizer, tokens, stop):
    pieces, hit = scan(tokenizer, tokens, stop)
    assert hit is None
    assert "".join(pieces) == tokenizer.decode(tokens)


def test_a_partial_stop_at_the_end_of_a_piece_is_held_back(tokenizer):
    ids = tokenizer.encode("abc de")
    scanner = StopScanner(tokenizer.create_stream(), (" dex",))
    shown = "".join(scanner.feed([t])[0] for t in ids)
    assert shown == "abc" and scanner.text == "abc de"  # " de" could still become " dex"
    assert scanner.flush() == " de"


@pytest.mark.parametrize("group", [2, 4, 7])
def test_tokens_after_the_stop_in_one_feed_are_not_returned(tokenizer, tokens, group):
    """A speculative step feeds several tokens at once: the tokens returned end with the
    one that completes the stop string, as feeding them one at a time ends."""
    text = tokenizer.decode(tokens)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    one = StopScanner(tokenizer.create_stream(), (stop,))
    taken = []
    for token in tokens:
        _, kept, hit = one.feed([token])
        taken += kept
        if hit:
            break
    grouped = StopScanner(tokenizer.create_stream(), (stop,))
    got = []
    for start in range(0, len(tokens), group):
        _, kept, hit = grouped.feed(tokens[start : start + group])
        got += kept
        if hit:
            break
    assert hit == stop and got == taken and grouped.text == one.text


@pytest.mark.parametrize("spec", ["mtp", "ngram"])
def test_speculative_generation_stops_where_plain_generation_stops(spec):
    """Text, tokens and stop reason of a generation with a stop string: the same with
    speculation (whose steps hold tokens past the stop) as without."""
    model = Model(default_model_dir())
    for prompt in ("class Foo:\n    def", "import os\nimport sys\n"):
        text = generate(model, prompt, 40).text
        stop = text[len(text) // 2 : len(text) // 2 + 3]
        plain = generate(model, prompt, 40, stop=stop)
        fast = generate(model, prompt, 40, stop=stop, spec=spec, k=3)
        assert (fast.text, fast.tokens, fast.stop_reason) == (
            plain.text,
            plain.tokens,
            plain.stop_reason,
        )
        assert plain.stop_reason == f"stop string {stop!r}"
