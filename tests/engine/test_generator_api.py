"""The Generator API, sampling filters and the errors users hit."""

from __future__ import annotations

import math
import shutil

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from onnx_genrt.core.errors import InvalidInputError, ModelLoadError, NonFiniteError
from onnx_genrt.core.graph_slots import DeviceGraphSlot
from onnx_genrt.engine import Generator, GeneratorParams, Model, generate
from onnx_genrt.engine.config import SearchOptions
from onnx_genrt.engine.sampling import distribution, penalize_repetition

from ..llm_fixtures import greedy_generator

_greedy = greedy_generator


def test_rewind_then_regenerate_reproduces_the_sequence(qwen2_dir):
    model = Model(qwen2_dir)
    prompt = [11, 22, 33, 44]
    gen = _greedy(model, prompt, 20)
    full = gen.get_sequence()
    gen.rewind_to(len(prompt) + 5)
    assert gen.get_sequence() == full[: len(prompt) + 5]
    while not gen.is_done():
        gen.generate_next_token()
    assert gen.get_sequence() == full


def test_append_tokens_continues_a_conversation(qwen2_dir):
    model = Model(qwen2_dir)
    a = _greedy(model, [1, 2, 3], 5).get_sequence()
    params = GeneratorParams(model)
    params.set_search_options(max_length=len(a) + 6)
    gen = Generator(model, params)
    gen.eos = set()
    gen.append_tokens([1, 2, 3])
    for _ in range(5):
        gen.generate_next_token()
    gen.append_tokens([7, 8])
    gen.generate_next_token()
    ref = _greedy(model, [*a, 7, 8], 1).get_sequence()
    assert gen.get_sequence() == ref


def test_a_prompt_appended_in_pieces_equals_it_appended_at_once(qwen2_dir):
    """Two appends in a row (no token generated between them) feed each token once."""
    model = Model(qwen2_dir)
    prompt = [11, 22, 33, 44, 55]
    whole = _greedy(model, prompt, 6).get_sequence()
    params = GeneratorParams(model)
    params.set_search_options(max_length=len(whole))
    with Generator(model, params) as gen:
        gen.eos = set()
        gen.append_tokens(prompt[:3])
        gen.append_tokens(prompt[3:])
        while not gen.is_done():
            gen.generate_next_token()
        assert gen.get_sequence() == whole


@pytest.mark.parametrize("penalty", [1.0, 1.5])
def test_greedy_stops_at_end_of_sequence_from_min_length_on(qwen2_dir, penalty):
    """Past min_length greedy may pick an end-of-sequence token and stops there; before
    min_length it is ruled out. Plain greedy (the device argmax) and the penalty path."""
    model = Model(qwen2_dir)
    prompt = [5, 17, 99]

    def run(eos, min_length=0):
        params = GeneratorParams(model)
        params.set_search_options(
            max_length=len(prompt) + 24, repetition_penalty=penalty, min_length=min_length
        )
        with Generator(model, params) as gen:
            gen.eos = set(eos)
            gen.append_tokens(prompt)
            while not gen.is_done():
                gen.generate_next_token()
            return gen.get_sequence()

    free = run(())
    eos = free[len(prompt) + 5]
    first = free.index(eos, len(prompt))
    assert run([eos]) == free[: first + 1]
    # eos is allowed once the sequence before it holds min_length tokens (first of them)
    assert run([eos], min_length=first) == free[: first + 1]
    assert run([eos], min_length=first + 1)[first] != eos
    masked = run([eos], min_length=first + 3)
    assert len(masked) > first + 1 and eos not in masked[len(prompt) : first + 3]


def test_rewinding_to_zero_then_a_new_prompt_equals_a_fresh_generation(qwen2_dir):
    model = Model(qwen2_dir)
    fresh = _greedy(model, [8, 9, 10], 6).get_sequence()
    params = GeneratorParams(model)
    params.set_search_options(max_length=len(fresh))
    with Generator(model, params) as gen:
        gen.eos = set()
        gen.append_tokens([1, 2, 3, 4])
        gen.generate_next_token()
        gen.generate_next_token()
        gen.rewind_to(0)
        gen.append_tokens([8, 9, 10])
        while not gen.is_done():
            gen.generate_next_token()
        assert gen.get_sequence() == fresh


def test_prompt_longer_than_the_context_is_refused(qwen2_dir):
    model = Model(qwen2_dir)
    ctx = model.config.context_length
    with pytest.raises(InvalidInputError, match=f"exceeds the model's context length of {ctx}"):
        generate(model, [1] * (ctx - 10), max_new_tokens=20)
    params = GeneratorParams(model)
    with pytest.raises(InvalidInputError, match="exceeds the model's context length"):
        params.set_search_options(max_length=ctx + 1)
    params.set_search_options(max_length=ctx)  # the whole context is usable
    with Generator(model, params) as gen:
        gen.eos = set()
        gen.append_tokens([1] * (ctx - 2))
        while not gen.is_done():
            gen.generate_next_token()
        assert len(gen.get_sequence()) == ctx


def test_kv_caches_are_pooled_by_power_of_two_capacity(qwen2_dir):
    """A request for ``length`` positions gets the next power of two, at least 256 and at
    most the context length; a cache whose owner is gone is handed to the next request of
    its capacity, rewound."""
    model = Model(qwen2_dir)
    ctx = model.config.context_length
    assert ctx == 512  # the cases below straddle 256 and the context

    class Owner:
        pass

    lengths = [1, 2, 200, 256, 257, 500, 10_000]
    owners = [Owner() for _ in lengths]
    runners = [model.acquire_runner(o, n) for o, n in zip(owners, lengths, strict=True)]
    want = [min(ctx, max(256, 2 ** math.ceil(math.log2(n)))) for n in lengths]
    assert [r.max_length for r in runners] == want == [256] * 4 + [512] * 3
    assert len({id(r) for r in runners}) == len(lengths)  # every owner alive: a cache each
    runners[4].cache.length = 7
    del owners[4]
    holder = Owner()
    again = model.acquire_runner(holder, 300)
    assert again is runners[4] and again.cache.length == 0
    assert model.acquire_runner(Owner(), 300) not in runners  # the others are held


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"temperature": 0.0, "do_sample": True},
            r"temperature \(sampling\) must be a finite number > 0",
        ),
        ({"top_p": 0.0}, "top_p must be a finite number > 0.0 and <= 1.0"),
        ({"top_k": -1}, r"top_k \(0 = off\) must be an integer >= 0"),
        ({"min_p": 1.5}, "min_p must be in"),
        (
            {"repetition_penalty": 0.0},
            r"repetition_penalty \(1 = off\) must be a finite number > 0",
        ),
        ({"beams": 4}, "unknown search options"),
    ],
)
def test_bad_search_options_are_named(qwen2_dir, options, message):
    params = GeneratorParams(Model(qwen2_dir))
    with pytest.raises(InvalidInputError, match=message):
        params.set_search_options(**options)


def test_empty_prompts_are_refused_and_say_which_kind(qwen2_dir):
    model = Model(qwen2_dir)
    with pytest.raises(InvalidInputError, match="the prompt is empty"):
        next(generate(model, [], max_new_tokens=4))
    text = "hello world"
    if model.tokenizer.encode(text):  # the tiny fixture's tokenizer knows no whole words
        pytest.skip("this fixture's tokenizer encodes the probe text")
    with pytest.raises(InvalidInputError, match="'hello world' encodes to no tokens"):
        next(generate(model, text, max_new_tokens=4))


def test_token_outside_vocabulary_is_refused(qwen2_dir):
    model = Model(qwen2_dir)
    gen = Generator(model, GeneratorParams(model))
    with pytest.raises(InvalidInputError, match=r"outside the vocabulary of 512"):
        gen.append_tokens([1, 99999])


def test_non_finite_logits_raise_instead_of_producing_text(qwen2_dir, tmp_path):
    folder = tmp_path / "nan_model"
    shutil.copytree(qwen2_dir, folder, symlinks=True)
    model_proto = onnx.load(str(folder / "model.onnx"))
    for init in model_proto.graph.initializer:
        if "final_norm" in init.name:
            arr = numpy_helper.to_array(init).copy()
            arr[0] = np.nan
            init.CopyFrom(numpy_helper.from_array(arr, init.name))
    onnx.save_model(
        model_proto,
        str(folder / "model.onnx"),
        save_as_external_data=True,
        location="model.onnx.data",
    )
    with pytest.raises(NonFiniteError, match="non-finite logits"):
        generate(Model(folder), [1, 2, 3], max_new_tokens=4)


def test_missing_config_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="no genai_config.json"):
        Model(tmp_path)


def _reference_distribution(logits, temperature, top_k, top_p, min_p):
    """Independent float64 reference of the filters, written the slow, obvious way."""
    z = np.asarray(logits, np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = sorted(range(len(p)), key=lambda i: (-p[i], i))
    allowed = set(range(len(p)))
    if top_k:
        allowed &= set(order[:top_k]) | {i for i in range(len(p)) if p[i] == p[order[top_k - 1]]}
    if top_p < 1.0:
        kept, mass = set(), 0.0
        for i in order:
            kept.add(i)
            mass += p[i]
            if mass >= top_p:
                break
        allowed &= kept
    if min_p:
        allowed &= {i for i in range(len(p)) if p[i] >= min_p * p.max()}
    q = np.array([p[i] if i in allowed else 0.0 for i in range(len(p))])
    return q / q.sum()


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "min_p"),
    [
        (1.0, 0, 1.0, 0.0),
        (0.7, 5, 1.0, 0.0),
        (1.3, 0, 0.8, 0.0),
        (1.0, 0, 1.0, 0.1),
        (0.9, 8, 0.9, 0.05),
    ],
)
def test_sampling_filters_match_a_float64_reference(temperature, top_k, top_p, min_p):
    logits = np.random.default_rng(5).standard_normal(40).astype(np.float32) * 3
    options = SearchOptions(
        do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p
    )
    np.testing.assert_allclose(
        distribution(logits, options),
        _reference_distribution(logits, temperature, top_k, top_p, min_p),
        atol=1e-12,
    )


def test_top_k_at_or_past_the_vocabulary_keeps_every_token():
    """top_k >= vocabulary size filters nothing (found by a mutation run: ``and`` -> ``or``
    in the top-k guard went unnoticed)."""
    logits = np.random.default_rng(6).standard_normal(40).astype(np.float32) * 3
    for top_k in (40, 41, 1000):
        options = SearchOptions(do_sample=True, temperature=0.8, top_k=top_k, top_p=0.9)
        np.testing.assert_allclose(
            distribution(logits, options),
            _reference_distribution(logits, 0.8, 0, 0.9, 0.0),
            atol=1e-12,
        )


def test_top_p_of_one_keeps_even_the_least_likely_tokens():
    """top_p = 1 is off: tokens whose probability is below float64 rounding of the
    cumulative sum stay candidates (found by a mutation run: ``<`` -> ``<=``)."""
    logits = np.array([50.0, 0.0, 0.0, -50.0, 10.0], np.float32)
    options = SearchOptions(do_sample=True, temperature=1.0, top_p=1.0)
    got = distribution(logits, options)
    want = _reference_distribution(logits, 1.0, 0, 1.0, 0.0)
    assert (want > 0).all()
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=0)


def test_repetition_penalty_follows_ctrl():
    logits = np.array([2.0, -2.0, 1.0, 0.5], np.float32)
    out = penalize_repetition(logits, [0, 1], 2.0)
    np.testing.assert_allclose(out, [1.0, -4.0, 1.0, 0.5])


def test_repetition_penalty_on_logits_between_minus_one_and_one():
    """The sign decides divide or multiply, also for small logits (found by a mutation run:
    the sign test moved to 1 or -1 went unnoticed with logits of +-2 only)."""
    logits = np.array([0.5, -0.5, 0.25, -0.75, 0.0, 3.0], np.float32)
    seen = [0, 1, 2, 3, 4, 2]
    want = [v / 1.5 if v > 0 else v * 1.5 for v in logits.astype(np.float64)]
    want[5] = 3.0  # not seen: unchanged
    np.testing.assert_allclose(penalize_repetition(logits, seen, 1.5), want, rtol=1e-6)


def test_generate_counts_max_new_tokens_and_replays_decode_steps(qwen2_dir):
    """(Streaming and stop strings: test_default_model.py, with a real tokenizer.)"""
    model = Model(qwen2_dir)
    res = generate(model, [5, 17, 99], max_new_tokens=16, ignore_eos=True)
    assert res.new_tokens == 16 and res.stop_reason == "max_new_tokens"
    assert res.graph_stats["target"]["primary"]["replays"] > 0


def test_closed_generators_hand_their_cache_and_graphs_to_the_next(qwen2_dir):
    """A finished generation returns its KV cache even while something still references the
    generator (a cycle, a kept traceback): the next one reuses the cache and the graph."""
    model = Model(qwen2_dir)
    kept = []
    for prompt in ([5, 6, 7], [8, 9], [10, 11, 12, 13]):
        params = GeneratorParams(model)
        params.set_search_options(max_length=len(prompt) + 12)
        with Generator(model, params) as gen:
            gen.eos = set()
            gen.append_tokens(prompt)
            while not gen.is_done():
                gen.generate_next_token()
        kept.append(gen)  # still alive
        generate(model, prompt, max_new_tokens=8, spec="ngram", k=2)
    assert len({id(g.runner) for g in kept}) == 1
    assert len(model._runners) == 1
    stats = model.session.graph_stats(DeviceGraphSlot.PRIMARY)
    assert stats.captures == 1 and stats.invalidations == 0, stats
    assert kept[0].get_sequence()[:3] == [5, 6, 7]
    with pytest.raises(InvalidInputError, match="closed"):
        kept[0].generate_next_token()


def _look_ahead_run(model, prompt, new, look_ahead, eos=(), min_length=0, edits=None, **search):
    """The sequence after ``new`` tokens (greedy, or drawn on the device with ``search``),
    the next step queued ahead or not."""
    params = GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + new, min_length=min_length, **search)
    with Generator(model, params) as gen:
        gen.look_ahead = look_ahead
        gen.device_sampling = True
        gen.eos = set(eos)
        gen.append_tokens(prompt)
        steps = queued = 0
        while not gen.is_done():
            gen.generate_next_token()
            steps += 1
            queued += gen._ahead is not None
            if edits and steps in edits:
                edits[steps](gen)
            # the cache holds every token but the pending one, plus at most the queued step
            assert gen.runner.cache.length - (len(gen.tokens) - 1) in (0, 1)
        assert (queued > 0) == (look_ahead and steps > 2), (queued, steps)
        if look_ahead and not eos and not edits:
            # every step queues the next one while another token will follow, but the
            # first (its logits come from the prompt's run) and the last
            assert queued == steps - 2, (queued, steps)
        return gen.get_sequence()


def _check_look_ahead(model, prompt, **search) -> list[int]:
    """The sequence with the next step queued ahead equals the one stepped one at a time:
    plainly, through eos, eos masked before min_length, max_length, rewind and appended
    text. Returns the plain sequence."""

    def run(look_ahead, **kw):
        return _look_ahead_run(model, prompt, 24, look_ahead, **kw, **search)

    plain = run(False)
    assert run(True) == plain
    eos = plain[len(prompt) + 6]
    first = plain.index(eos, len(prompt))
    stopped = run(True, eos=[eos])
    assert stopped == plain[: first + 1] == run(False, eos=[eos])
    masked = run(True, eos=[eos], min_length=first + 3)
    assert masked == run(False, eos=[eos], min_length=first + 3)
    assert len(masked) > len(stopped)

    def rewind(gen):
        gen.rewind_to(len(gen.tokens) - 3)

    def append(gen):
        gen.append_tokens([7, 8])

    edits = {4: rewind, 9: append}
    assert run(True, edits=dict(edits)) == run(False, edits=dict(edits))
    return plain


@pytest.mark.parametrize("prompt", [[5, 17, 99], [1, 2, 3, 4, 1, 2], [300]])
def test_look_ahead_greedy_equals_plain_greedy(qwen2_dir, prompt):
    """The next step queued on the device argmax (a GPU's default) changes no token."""
    _check_look_ahead(Model(qwen2_dir), prompt)


@pytest.mark.parametrize("top_k", [0, 5])
def test_look_ahead_device_draws_equal_step_by_step_draws(qwen2_dir, top_k):
    """Tokens drawn on the device (``device_sampling``) with the next step queued ahead, fed
    the drawn token on the device and drawing at the next token's offset (a GPU's default),
    are the tokens drawn step by step (before min_length the host draws)."""
    prompt = [5, 17, 99]
    search = dict(do_sample=True, temperature=1.5, top_k=top_k, seed=7)
    plain = _check_look_ahead(Model(qwen2_dir), prompt, **search)
    assert len(set(plain[len(prompt) :])) > 5  # it samples
