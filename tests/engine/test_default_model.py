"""The embedded trained model: Python-like text, and speculation equal to greedy."""

from __future__ import annotations

import pytest

from onnx_genrt.cli import main as cli_main
from onnx_genrt.engine import Model, generate, stream
from onnx_genrt.generate_cli import default_model_dir

PROMPTS = ["class Foo:\n    def __init__(self", "import os\n\ndef main(", "for i in range(", "def "]


@pytest.fixture(scope="module")
def model() -> Model:
    return Model(default_model_dir())


def _looks_like_python(text: str) -> bool:
    indented = "\n    " in text
    return indented and any(word in text for word in ("return", "self", "def ", "if "))


def test_greedy_text_looks_like_python(model):
    """Greedy text from a tiny model can loop on one prompt; most prompts must read as Python."""
    prompts = ["    def __init__(self", "import os\n\ndef main(", "def main():\n", *PROMPTS[2:3]]
    texts = [generate(model, p, max_new_tokens=64).text for p in prompts]
    assert _looks_like_python(texts[0]), texts[0]  # the README's prompt
    assert sum(map(_looks_like_python, texts)) >= 3, texts


@pytest.mark.parametrize("spec", ["mtp", "draft", "ngram"])
def test_speculation_on_the_embedded_model_equals_greedy(model, spec):
    for prompt in PROMPTS:
        greedy = generate(model, prompt, max_new_tokens=48)
        fast = generate(model, prompt, max_new_tokens=48, spec=spec, k=4)
        assert fast.tokens == greedy.tokens, (spec, prompt)
        assert fast.speculation["proposed"] > 0


def test_mtp_replays_both_slots_over_256_tokens(model):
    res = generate(
        model, "class Foo:\n    def __init__(self", max_new_tokens=256, spec="mtp", min_length=266
    )
    target = res.graph_stats["target"]
    for slot in ("primary", "verify"):
        assert target[slot]["replays"] > 0, target
        assert target[slot]["invalidations"] <= 1, target
        assert target[slot]["fallbacks"] == 0, target
    assert res.graph_stats["proposer"]["draft"]["replays"] > 0
    assert res.speculation["acceptance_rate"] > 0.2, res.speculation


def test_generate_cli_streams_text(capsys):
    assert (
        cli_main(
            ["generate", "--prompt", "def add(a, b):", "--max-new-tokens", "16", "--spec", "mtp"]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.startswith("def add(a, b):") and len(out) > len("def add(a, b):")


@pytest.mark.parametrize(
    "text", ["    def __init__(self):\n", "s = 'é∑😀 ünïcode'\n", "a\u00a0b\tc"]
)
def test_streamed_text_equals_decoding_all_ids(model, text):
    """Token by token (multi-byte characters split across tokens) the stream emits exactly
    what decoding every id at once gives."""
    ids = model.tokenizer.encode(text)
    stream = model.tokenizer.create_stream()
    pieces = [stream.decode(t) for t in ids]
    assert "".join(pieces) == model.tokenizer.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)


@pytest.mark.parametrize("k", [1, 4])
def test_pipelined_mtp_equals_greedy(model, k, monkeypatch):
    """The next verify queued with inputs the MTP chain wrote on the device (a GPU's
    default, forced here on the CPU) changes no token: with eos, eos masked before
    min_length, and near max_length."""
    from onnx_genrt.engine.speculative import SpeculativeGenerator
    from tests.llm_fixtures import spy_device_fed_launches

    launched = spy_device_fed_launches(monkeypatch)
    monkeypatch.setattr(SpeculativeGenerator, "pipeline", True)
    for prompt in PROMPTS:
        greedy = generate(model, prompt, max_new_tokens=40, ignore_eos=True)
        fast = generate(model, prompt, max_new_tokens=40, spec="mtp", k=k, ignore_eos=True)
        assert fast.tokens == greedy.tokens, prompt
        new = greedy.tokens[greedy.prompt_tokens :]
        eos = new[10]
        first = new.index(eos)
        for min_length in (0, greedy.prompt_tokens + first + 4):
            want = _with_eos(model, prompt, eos, min_length, None)
            assert _with_eos(model, prompt, eos, min_length, k) == want, (prompt, min_length)
    assert any(launched), "no verify step was fed on the device"


def _with_eos(model, prompt, eos, min_length, k):
    from onnx_genrt.engine import GeneratorParams
    from onnx_genrt.engine.api import make_generator

    ids = model.tokenizer.encode(prompt)
    params = GeneratorParams(model)
    params.set_search_options(max_length=len(ids) + 40, min_length=min_length)
    with make_generator(model, params, None if k is None else "mtp", k or 4) as gen:
        gen.eos = {eos}
        gen.append_tokens(ids)
        while not gen.is_done():
            gen.generate_next_token()
        return gen.get_sequence()


def test_streamed_pieces_are_the_decoded_tokens_and_a_stop_string_cuts_there(model):
    prompt = model.tokenizer.encode("import os\n\ndef main(")
    full = generate(model, prompt, max_new_tokens=24, ignore_eos=True)
    assert full.new_tokens == 24 and full.stop_reason == "max_new_tokens"
    new_ids = full.tokens[len(prompt) :]
    assert full.text == model.tokenizer.decode(new_ids)  # decoded at once, not streamed
    pieces = list(stream(model, prompt, 24, ignore_eos=True))
    assert len(pieces) > 1 and "".join(pieces) == full.text
    # A stop string that first appears mid-way: the text ends before it, and generation
    # stops at the token that completes it.
    cut = next(
        c
        for c in range(len(full.text) // 3, len(full.text) - 4)
        if full.text.index(full.text[c : c + 4]) == c
    )
    stop = full.text[cut : cut + 4]
    completes = next(
        j for j in range(1, len(new_ids) + 1) if stop in model.tokenizer.decode(new_ids[:j])
    )
    out: list = []
    pieces = list(stream(model, prompt, 24, ignore_eos=True, stop=(stop,), result=out))
    (res,) = out
    assert res.text == "".join(pieces) == full.text[:cut]
    assert res.stop_reason == f"stop string {stop!r}"
    assert res.tokens == full.tokens[: len(prompt) + completes]


@pytest.mark.parametrize("spec", [None, "mtp", "ngram"])
def test_generate_decodes_its_text_once_the_same_as_the_stream(model, spec):
    """``generate`` (no stop strings) decodes the text when the loop ends, not token by
    token: the same text as the streamed pieces, and as decoding the new ids, whether the
    run ends at max_new_tokens or at eos, with or without speculation."""
    for prompt, ignore_eos in (("import os\n\ndef main(", True), ("x = [", False)):
        full = generate(model, prompt, max_new_tokens=48, spec=spec, ignore_eos=ignore_eos)
        new_ids = full.tokens[full.prompt_tokens :]
        assert full.text == model.tokenizer.decode(new_ids), (prompt, spec)
        pieces = list(stream(model, prompt, 48, spec=spec, ignore_eos=ignore_eos))
        assert "".join(pieces) == full.text, (prompt, spec)
