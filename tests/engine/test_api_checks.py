"""The entry points of engine/api.py: proposer sections, defaults and the context bound."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest

from onnx_genrt.core.errors import InvalidInputError, ModelLoadError
from onnx_genrt.engine import Model, generate, stream, warm_up
from onnx_genrt.engine.api import (
    DEFAULT_MAX_NEW_TOKENS,
    default_k,
    generate_batch,
    make_proposer,
)
from onnx_genrt.generate_cli import default_model_dir


@pytest.fixture
def model() -> Model:
    """The embedded model, fresh per test: tests replace its speculative sections."""
    return Model(default_model_dir())


def _with_speculative(model: Model, speculative: dict) -> Model:
    model.config = dataclasses.replace(model.config, speculative=speculative)
    model.proposers.clear()
    return model


def test_make_proposer_refuses_an_unknown_kind(model):
    with pytest.raises(InvalidInputError, match="unknown speculation kind 'beam'.*'mtp'"):
        make_proposer(model, "beam", 64)


@pytest.mark.parametrize(
    ("spec", "speculative", "message"),
    [
        ("mtp", {}, "speculative.json has no mtp section"),
        ("draft", {}, "speculative.json has no draft section"),
        ("draft", {"draft": {"path": "genai_config.json"}}, "draft.path: no model folder at"),
        ("draft", {"draft": {"path": "absent"}}, "draft.path: no model folder at"),
    ],
)
def test_a_proposer_the_model_folder_does_not_have_is_a_model_load_error(
    model, spec, speculative, message
):
    _with_speculative(model, speculative)
    with pytest.raises(ModelLoadError, match=message):
        generate(model, "def", 4, spec=spec)


@pytest.mark.parametrize("value", [0, 4097, True, 1.5, [300]])
def test_a_draft_vocabulary_outside_the_vocabulary_or_not_an_integer_is_refused(model, value):
    assert model.config.vocab_size == 4096
    mtp = {**model.config.speculative["mtp"], "draft_vocab": value}
    _with_speculative(model, {"mtp": mtp})
    with pytest.raises(ModelLoadError, match=r"speculative\.json: mtp\.draft_vocab must be"):
        make_proposer(model, "mtp", 64)


@pytest.fixture(scope="module")
def folder_copy(tmp_path_factory) -> Path:
    """A copy of the embedded model's folder (without its draft model) to put files in."""
    folder = tmp_path_factory.mktemp("model") / "default"
    shutil.copytree(default_model_dir(), folder, ignore=shutil.ignore_patterns("draft"))
    return folder


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, r"cannot read .*ranked\.json"),
        ("[1, 2,", r"cannot read .*ranked\.json"),
        ('{"ids": [1]}', r"ranked\.json must hold a non-empty JSON list of token ids"),
        ("[]", r"must hold a non-empty JSON list of token ids"),
        ("[1, 2.5]", r"must hold a non-empty JSON list of token ids"),
        ("[1, true]", r"must hold a non-empty JSON list of token ids"),
        ("[5, 4096]", r"lists token id 4096, outside 0\.\.4095"),
        ("[5, -1]", r"lists token id -1, outside"),
        ("[5, 7, 5]", r"lists a token id twice"),
    ],
)
def test_a_ranked_draft_vocabulary_file_is_checked(folder_copy, content, message):
    """``mtp.draft_vocab`` naming a file: each fault is a ModelLoadError naming the key, the
    file and what is wrong."""
    ranked = folder_copy / "ranked.json"
    ranked.unlink(missing_ok=True)
    if content is not None:
        ranked.write_text(content)
    model = Model(folder_copy)
    mtp = {**model.config.speculative["mtp"], "draft_vocab": "ranked.json"}
    _with_speculative(model, {"mtp": mtp})
    with pytest.raises(ModelLoadError, match=r"speculative\.json: mtp\.draft_vocab: .*" + message):
        make_proposer(model, "mtp", 64)


def test_a_draft_vocabulary_file_outside_the_model_folder_is_refused(folder_copy):
    (folder_copy.parent / "ranked.json").write_text("[1, 2]")
    model = Model(folder_copy)
    mtp = {**model.config.speculative["mtp"], "draft_vocab": "../ranked.json"}
    _with_speculative(model, {"mtp": mtp})
    with pytest.raises(ModelLoadError, match=r"mtp\.draft_vocab = '\.\./ranked\.json' .*outside"):
        make_proposer(model, "mtp", 64)


def test_draft_vocabularies_from_one_token_to_the_whole_keep_greedy_output(model):
    greedy = generate(model, "for i in", 12, ignore_eos=True).tokens
    for size in (1, 4096):
        mtp = {**model.config.speculative["mtp"], "draft_vocab": size}
        _with_speculative(model, {"mtp": mtp})
        assert generate(model, "for i in", 12, spec="mtp", ignore_eos=True).tokens == greedy


def test_speculative_json_k_is_a_positive_integer(model):
    mtp = model.config.speculative["mtp"]
    _with_speculative(model, {"mtp": {**mtp, "k": 1}})
    assert default_k(model, "mtp") == 1
    res = generate(model, "def f(x):", 8, spec="mtp", ignore_eos=True)
    assert res.speculation["k"] == 1
    _with_speculative(model, {"mtp": {**mtp, "k": 2.0}})  # JSON writers put 2.0
    assert default_k(model, "mtp") == 2
    for bad in (0, True, "3", 2.5):
        _with_speculative(model, {"mtp": {**mtp, "k": bad}})
        with pytest.raises(ModelLoadError, match=r"speculative\.json: mtp\.k must be an integer"):
            default_k(model, "mtp")


def test_every_entry_point_makes_the_same_default_number_of_tokens(qwen2_dir):
    model = Model(qwen2_dir)
    prompt = [5, 17, 99]
    one = generate(model, prompt, ignore_eos=True)
    assert one.new_tokens == DEFAULT_MAX_NEW_TOKENS
    out = []
    assert "".join(stream(model, prompt, ignore_eos=True, result=out)) == one.text
    assert out[0].tokens == one.tokens
    batch = generate_batch(model, [prompt, [1, 2]], ignore_eos=True)
    assert batch[0].tokens == one.tokens and batch[1].new_tokens == DEFAULT_MAX_NEW_TOKENS


def test_a_generation_may_fill_the_context_and_no_more(qwen2_dir):
    """A prompt plus max_new_tokens equal to the context length runs to the last position,
    alone or as the longest row of a batch (each row equals its prompt generated alone)."""
    model = Model(qwen2_dir)
    context = model.config.context_length
    prompt = [(7 * i) % 500 + 1 for i in range(context - 3)]
    alone = generate(model, prompt, 3, ignore_eos=True)
    assert len(alone.tokens) == context
    rows = generate(model, [prompt, [1, 2]], 3, ignore_eos=True)
    assert rows[0].tokens == alone.tokens
    assert rows[1].tokens == generate(model, [1, 2], 3, ignore_eos=True).tokens
    for too_long in (prompt + [1], [prompt + [1], [1, 2]]):
        with pytest.raises(InvalidInputError, match=f"context length of {context}"):
            generate(model, too_long, 3)


def test_generate_batch_checks_max_new_tokens(qwen2_dir):
    model = Model(qwen2_dir)
    with pytest.raises(InvalidInputError, match="max_new_tokens must be an integer >= 1, got 0"):
        generate_batch(model, [[5, 17], [1, 2]], 0)
    rows = generate_batch(model, [[5, 17], [1, 2]], 1, ignore_eos=True)
    assert [r.tokens for r in rows] == [
        generate(model, p, 1, ignore_eos=True).tokens for p in ([5, 17], [1, 2])
    ]


def test_decode_speed_counts_the_tokens_after_the_first(qwen2_dir):
    """The first new token comes from the prefill, so a decode rate counts the others."""
    model = Model(qwen2_dir)
    res = generate(model, [5, 17, 99], 9, ignore_eos=True)
    assert res.decode_seconds > 0
    assert res.decode_tokens_per_second == pytest.approx(8 / res.decode_seconds)
    one = dataclasses.replace(res, tokens=res.tokens[:4])  # a single new token: no decode
    assert one.new_tokens == 1 and one.decode_tokens_per_second == 0.0
    two = dataclasses.replace(res, tokens=res.tokens[:5])
    assert two.decode_tokens_per_second == pytest.approx(1 / res.decode_seconds)
    assert dataclasses.replace(res, decode_seconds=0.0).decode_tokens_per_second == 0.0


def test_warm_up_needs_room_for_a_prompt_and_a_token(qwen2_dir):
    model = Model(qwen2_dir)
    with pytest.raises(InvalidInputError, match="max_length must be an integer >= 2, got 1"):
        warm_up(model, 1)
    assert warm_up(model, 2) > 0
    assert model.session.all_graph_stats()["primary"]["captures"] == 1
