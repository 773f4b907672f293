"""Every option, argument and config value is checked where it enters, naming it."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from onnx_genrt.core.errors import InvalidInputError, ModelLoadError
from onnx_genrt.engine import Generator, GeneratorParams, Model, generate
from onnx_genrt.engine.config import load_config
from onnx_genrt.engine.speculative import SpeculativeGenerator
from onnx_genrt.engine.tokenizer import Tokenizer
from onnx_genrt.generate_cli import default_model_dir
from onnx_genrt.providers.cpu.provider import host_memory_bytes


@pytest.fixture(scope="module")
def model() -> Model:
    return Model(default_model_dir())


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """A writable copy of the embedded model's folder."""
    target = tmp_path / "model"
    shutil.copytree(default_model_dir(), target)
    return target


def _edit_config(folder: Path, edit) -> None:
    path = folder / "genai_config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))


BAD_SEARCH_OPTIONS = [
    ({"max_length": 12.7}, "max_length must be an integer"),
    ({"max_length": 0}, "max_length must be an integer >= 1, got 0"),
    ({"max_length": True}, "max_length must be an integer"),
    ({"min_length": -1}, "min_length"),
    ({"repetition_penalty": math.nan}, "repetition_penalty (1 = off) must be a finite number"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"do_sample": True, "temperature": math.nan}, "temperature (sampling) must be a finite"),
    ({"do_sample": True, "temperature": 0.0}, "temperature (sampling)"),
    ({"temperature": math.inf}, "temperature must be a finite number"),
    ({"do_sample": "yes"}, "do_sample must be true or false"),
    ({"seed": "abc"}, "seed must be an integer >= 0, got 'abc'"),
    ({"seed": -1}, "seed must be an integer >= 0, got -1"),
    ({"seed": 1.5}, "seed must be an integer"),
    ({"top_k": -2}, "top_k (0 = off) must be an integer >= 0"),
    ({"top_k": 2.5}, "top_k"),
    ({"top_p": 0.0}, "top_p must be a finite number > 0.0 and <= 1.0"),
    ({"top_p": math.nan}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"min_p": 1.0}, "min_p must be in [0, 1)"),
    ({"min_p": -0.1}, "min_p"),
]


@pytest.mark.parametrize(("options", "message"), BAD_SEARCH_OPTIONS)
def test_set_search_options_refuses_bad_values(model, options, message):
    params = GeneratorParams(model)
    before = params.search
    with pytest.raises(InvalidInputError) as info:
        params.set_search_options(**options)
    assert message in str(info.value)
    assert params.search == before  # a refused call changes nothing


def test_valid_boundary_values_are_accepted_and_normalized(model):
    params = GeneratorParams(model)
    params.set_search_options(
        max_length=np.int64(16), seed=0, top_p=1.0, min_p=0.0, temperature=0.0, top_k=0
    )
    assert params.search.max_length == 16 and type(params.search.max_length) is int
    params.set_search_options(do_sample=True, temperature=1e-3, seed=2**40)
    assert params.search.seed == 2**40


def test_sampled_generation_with_a_large_seed_is_reproducible(model):
    """numpy's own generator is the reference: the same seed gives the same tokens."""
    a = generate(model, "def", 6, do_sample=True, seed=2**40, temperature=0.8)
    b = generate(model, "def", 6, do_sample=True, seed=2**40, temperature=0.8)
    assert a.tokens == b.tokens


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1, got 0"),
        ({"max_new_tokens": -1}, "max_new_tokens must be an integer >= 1, got -1"),
        ({"max_new_tokens": 2.5}, "max_new_tokens must be an integer"),
        ({"spec": "ngram", "k": -2}, "k (drafts per speculative step) must be an integer >= 1"),
        ({"spec": "ngram", "k": 0}, "k (drafts per speculative step) must be an integer >= 1"),
        ({"spec": "ngram", "k": 1.5}, "k (drafts per speculative step)"),
        ({"k": 3}, "k=3 needs a speculation kind"),
        ({"spec": "beam"}, "unknown speculation kind 'beam'"),
        ({"stop": ("",)}, "stop strings must be non-empty strings, got ''"),
        ({"stop": (1,)}, "stop strings must be non-empty strings, got 1"),
        ({"stop": 7}, "stop must be a string or a sequence of strings"),
        ({"ignore_eos": "no"}, "ignore_eos must be true or false"),
        ({"seed": "abc", "do_sample": True}, "seed must be an integer >= 0, got 'abc'"),
        ({"bogus": 1}, "unknown search options ['bogus']"),
    ],
)
def test_generate_refuses_bad_arguments(model, kwargs, message):
    kwargs = {"max_new_tokens": 4, **kwargs}
    with pytest.raises(InvalidInputError) as info:
        generate(model, "def", **kwargs)
    assert message in str(info.value)


def test_a_lone_stop_string_is_one_stop_string(model):
    """Reference: the text generated without stops, cut before the stop string's first use."""
    full = generate(model, "def", 12).text
    stop = full[2:4]
    assert stop and stop in full
    cut = generate(model, "def", 12, stop=stop)
    assert cut.text == full[: full.index(stop)]
    assert cut.stop_reason == f"stop string {stop!r}"


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ("ab\ud800c", "lone surrogate '\\ud800' at index 2"),
        ([1, 2.5], "prompt token 1 must be an integer"),
        ([1, -3], "prompt token 1 must be an integer >= 0, got -3"),
        ([], "the prompt is empty"),
        (b"def", "prompt must be a string or a sequence of token ids"),
    ],
)
def test_generate_refuses_bad_prompts(model, prompt, message):
    with pytest.raises(InvalidInputError) as info:
        generate(model, prompt, 4)
    assert message in str(info.value)


def test_tokenizer_refuses_lone_surrogates(model):
    with pytest.raises(InvalidInputError, match="lone surrogate"):
        model.tokenizer.encode("x\udfff")
    assert model.tokenizer.encode("x") == generate(model, "x", 1).tokens[:1]


def test_generator_refuses_fractional_token_ids_and_rewind_lengths(model):
    params = GeneratorParams(model)
    params.set_search_options(max_length=16)
    with Generator(model, params) as gen:
        with pytest.raises(InvalidInputError, match="token id 1 must be an integer"):
            gen.append_tokens([5, 6.7])
        gen.append_tokens([5, 6])
        with pytest.raises(InvalidInputError, match="rewind length must be an integer"):
            gen.rewind_to(1.5)


def test_generator_refuses_an_empty_append_and_one_past_max_length(model):
    params = GeneratorParams(model)
    params.set_search_options(max_length=8)
    with Generator(model, params) as gen:
        with pytest.raises(InvalidInputError, match="append_tokens needs at least one token"):
            gen.append_tokens([])
        assert gen.get_sequence() == []
        vocab = model.config.vocab_size
        for bad in (-1, vocab):
            with pytest.raises(InvalidInputError, match=rf"\[{bad}\] are outside the vocabulary"):
                gen.append_tokens([3, bad])
        gen.append_tokens([0, vocab - 1])  # both ends of the vocabulary are tokens
        gen.rewind_to(0)
        gen.append_tokens([5, 6, 7, 8, 9])
        with pytest.raises(InvalidInputError, match="9 tokens exceed max_length 8"):
            gen.append_tokens([1, 2, 3, 4])
        assert gen.get_sequence() == [5, 6, 7, 8, 9]
        gen.append_tokens([1, 2, 3])  # exactly max_length: accepted, and generation is done
        assert gen.get_sequence() == [5, 6, 7, 8, 9, 1, 2, 3] and gen.is_done()


def test_generator_refuses_steps_without_a_prompt_or_after_the_end(model):
    params = GeneratorParams(model)
    params.set_search_options(max_length=6)
    with Generator(model, params) as gen:
        gen.eos = set()
        with pytest.raises(InvalidInputError, match="append_tokens first: there is no prompt"):
            gen.generate_next_token()
        gen.append_tokens([5, 6, 7, 8])
        while not gen.is_done():
            gen.generate_next_token()
        done = gen.get_sequence()
        assert len(done) == 6
        with pytest.raises(InvalidInputError, match="generation is done"):
            gen.generate_next_token()
        assert gen.get_sequence() == done


def test_generator_refuses_rewinds_outside_the_sequence_and_other_sequence_indices(model):
    params = GeneratorParams(model)
    params.set_search_options(max_length=12)
    with Generator(model, params) as gen:
        gen.append_tokens([5, 6, 7])
        for length in (-1, 4):
            with pytest.raises(InvalidInputError, match=f"cannot rewind to {length}: the sequence"):
                gen.rewind_to(length)
        assert gen.get_sequence() == [5, 6, 7]
        with pytest.raises(IndexError, match="a single sequence"):
            gen.get_sequence(1)
        gen.rewind_to(3)  # both ends are valid lengths
        gen.rewind_to(0)
        assert gen.get_sequence() == []


def test_speculative_generator_refuses_k_below_one(model):
    from onnx_genrt.engine.proposers import PromptLookupProposer

    params = GeneratorParams(model)
    params.set_search_options(max_length=16)
    with pytest.raises(InvalidInputError, match="k \\(drafts per speculative step\\)"):
        SpeculativeGenerator(model, params, PromptLookupProposer(), k=0)


# -- genai_config.json ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: c["search"].update(max_length=12.7), "search.max_length must be an integer"),
        (lambda c: c["search"].update(repetition_penalty="x"), "search.repetition_penalty"),
        (lambda c: c["search"].update(top_p=2), "search.top_p must be a finite number"),
        (lambda c: c["search"].update(do_sample="true"), "search.do_sample must be true or"),
        (lambda c: c.update(search=[]), "search must be an object, got list"),
        (lambda c: c["model"].update(context_length=-5), "model.context_length must be an"),
        (lambda c: c["model"].update(context_length=12.5), "model.context_length"),
        (lambda c: c["model"].update(vocab_size="4096"), "model.vocab_size must be an integer"),
        (lambda c: c["model"].update(eos_token_id=[0, 99999]), "model.eos_token_id must be"),
        (lambda c: c["model"].update(eos_token_id=-1), "eos_token_id must be an integer >= 0"),
        (
            lambda c: (c["model"].pop("context_length"), c["search"].pop("max_length")),
            "model.context_length is missing (and search.max_length too)",
        ),
        (lambda c: c["model"].update(bos_token_id=-1), "model.bos_token_id must be"),
        (lambda c: c["model"]["decoder"].update(num_hidden_layers=0), "num_hidden_layers"),
        (lambda c: c["model"]["decoder"].update(head_size=None), "model.decoder.head_size"),
        (lambda c: c["model"]["decoder"].update(inputs=[1]), "decoder.inputs must be an object"),
        (lambda c: c["model"].update(decoder="x"), "model.decoder must be an object"),
        (lambda c: c["model"]["decoder"].update(filename=123), "model.decoder.filename must"),
        (lambda c: c["model"]["decoder"].pop("hidden_size"), "missing key 'hidden_size'"),
        (
            lambda c: c["model"]["decoder"]["inputs"].update(past_key_names="past.key"),
            "inputs.past_key_names must contain %d once",
        ),
        (
            lambda c: c["model"]["decoder"]["outputs"].update(logits=5),
            "model.decoder.outputs.logits must be a non-empty name, got 5",
        ),
    ],
)
def test_config_values_are_checked(folder, edit, message):
    _edit_config(folder, edit)
    with pytest.raises(ModelLoadError) as info:
        load_config(folder)
    assert message in str(info.value)
    assert "genai_config.json" in str(info.value)


@pytest.mark.parametrize(
    ("speculative", "message"),
    [
        ({"mtp": {"inputs": [1]}}, "mtp.inputs must be an object, got list"),
        ({"mtp": {"outputs": {"logits": None}}}, "mtp.outputs.logits must be a non-empty name"),
        ({"mtp": {"outputs": {"logits": ""}}}, "mtp.outputs.logits must be a non-empty name"),
        ({"draft": {"inputs": {"input_ids": 5}}}, "draft.inputs.input_ids must be a non-empty"),
        ({"mtp": []}, "section 'mtp' must be an object"),
    ],
)
def test_speculative_sections_are_checked(folder, speculative, message):
    (folder / "speculative.json").write_text(json.dumps(speculative))
    with pytest.raises(ModelLoadError) as info:
        load_config(folder)
    assert message in str(info.value) and "speculative.json" in str(info.value)


def test_config_accepts_whole_number_floats(folder):
    """JSON writers put 1e9 or 2048.0 for integers; those values are whole, so they load."""
    _edit_config(folder, lambda c: c["model"].update(context_length=2048.0))
    _edit_config(folder, lambda c: c["search"].update(max_length=64.0, top_k=5.0))
    config = load_config(folder)
    assert config.context_length == 2048 and type(config.context_length) is int
    assert (config.search.max_length, config.search.top_k) == (64, 5)


def test_eos_ids_up_to_the_last_vocabulary_entry_load(folder):
    """Token ids run from 0 to vocab_size - 1: both ends are ids; vocab_size is not."""
    vocab = load_config(folder).vocab_size
    _edit_config(folder, lambda c: c["model"].update(eos_token_id=[0, vocab - 1]))
    assert load_config(folder).eos_token_ids == (0, vocab - 1)
    _edit_config(folder, lambda c: c["model"].update(eos_token_id=vocab))
    with pytest.raises(
        ModelLoadError, match=rf"eos_token_id must be .*<= {vocab - 1}, got {vocab}"
    ):
        load_config(folder)


def test_corrupt_tokenizer_config_is_a_model_load_error(folder):
    (folder / "tokenizer_config.json").write_text('{"chat_template": ')
    with pytest.raises(ModelLoadError, match="tokenizer_config.json is not valid JSON"):
        Tokenizer(folder)
    (folder / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(ModelLoadError, match="expected a JSON object, got list"):
        Tokenizer(folder)


# -- sizes before allocating ---------------------------------------------------------------


def test_a_kv_cache_larger_than_memory_is_refused_before_allocating(folder):
    """context_length 1e9 and no search.max_length: the default max_length is the context."""

    def edit(config):
        config["model"]["context_length"] = 1e9
        config["search"].pop("max_length")

    _edit_config(folder, edit)
    model = Model(folder)
    cfg = model.config
    need = 2 * cfg.num_layers * cfg.num_kv_heads * 10**9 * cfg.head_size * 4  # float32
    assert need > host_memory_bytes()
    with pytest.raises(InvalidInputError) as info:
        Generator(model, GeneratorParams(model))
    text = str(info.value)
    assert f"needs {need} bytes" in text and "lower max_length" in text
    # A generation that asks for little still runs on the same model.
    assert generate(model, "def", 3).new_tokens == 3


def test_stream_checks_its_arguments_when_called(model):
    """No iteration needed: a bad argument is refused by the call itself."""
    from onnx_genrt.engine import stream

    with pytest.raises(InvalidInputError, match="max_new_tokens"):
        stream(model, "def", 0)
    with pytest.raises(InvalidInputError, match="top_p"):
        stream(model, "def", 4, top_p=math.nan)
    pieces = stream(model, "def", 4)
    assert "".join(pieces) == generate(model, "def", 4).text


@pytest.mark.parametrize("threads", [0, -1, 1.5, "2"])
def test_the_cpu_threads_option_is_checked(threads):
    from onnx_genrt.session.inference_session import resolve_providers

    with pytest.raises(InvalidInputError, match="CPU provider option threads must be an integer"):
        resolve_providers([("cpu", {"threads": threads})])
