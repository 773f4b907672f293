"""Batched decoding: every row equals its prompt generated alone, with bucket graphs."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from onnx_genrt.core.errors import ConcurrentUseError, InvalidInputError
from onnx_genrt.engine import GeneratorParams, Model, generate, generate_batch
from onnx_genrt.engine.batch import BatchGenerator, buckets
from onnx_genrt.generate_cli import default_model_dir
from onnx_genrt.providers.cpu.kernels.contrib_attention import general_path_steps

from .test_greedy_parity import PROMPTS, _onnxruntime_genai

TEXTS = ["    def __init__(self", "import os\n", "class Foo:", "def fib(n):", "x = [", "return"]


@pytest.fixture(scope="module")
def model() -> Model:
    return Model(default_model_dir())


def _params(model: Model, prompt: list[int], new: int, **search) -> GeneratorParams:
    params = GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + new, **search)
    return params


def _run(batch: BatchGenerator, limit: int = 1000) -> None:
    for _ in range(limit):
        if all(batch.is_done(r) for r in batch.rows):
            return
        batch.step()
    raise AssertionError("the batch did not finish")


def test_buckets():
    assert buckets(1) == (1,)
    assert buckets(8) == (1, 2, 4, 8)
    assert buckets(6) == (1, 2, 4, 6)
    assert buckets(40) == (1, 2, 4, 8, 16, 32, 40)  # past 16 rows: pieces of 16
    assert buckets(5, max_graph_rows=2) == (1, 2, 4, 5)


def test_steps_larger_than_a_graph_run_as_pieces(model):
    """With graphs of at most 2 rows, a 5-row step replays three graphs (rows 0-1, 2-3,
    4) side by side; every row still equals its prompt generated alone."""
    alone = {t: generate(model, t, 12, ignore_eos=True).tokens for t in TEXTS[:5]}
    batch = BatchGenerator(model, 5, 128, max_graph_rows=2)
    rows = {}
    for text in TEXTS[:5]:
        ids = model.tokenizer.encode(text)
        rows[batch.add(ids, _params(model, ids, 12), ignore_eos=True)] = text
    before = batch.graph_stats()["primary"]
    _run(batch)
    for row, text in rows.items():
        assert batch.sequence(row) == alone[text], text
    after = batch.graph_stats()["primary"]
    assert after["captures"] - before["captures"] == 3  # one graph per piece
    assert after["fallbacks"] == 0 and after["invalidations"] == 0
    assert after["replays"] - before["replays"] >= 3 * 8


def test_rows_match_onnxruntime_genai_alone(qwen2_dir):
    """A builder model with position_ids: each row of one batch equals onnxruntime-genai
    generating that prompt alone, and the bucket's graph replays."""
    model = Model(qwen2_dir)
    batch = BatchGenerator(model, 4, 128)
    rows = {batch.add(p, _params(model, p, 24), ignore_eos=True): p for p in PROMPTS}
    _run(batch)
    for row, prompt in rows.items():
        assert batch.sequence(row) == _onnxruntime_genai(qwen2_dir, prompt, 24), row
    primary = batch.graph_stats()["primary"]
    assert primary["captures"] == 1 and primary["replays"] >= 20
    assert primary["fallbacks"] == 0 and primary["invalidations"] == 0


@pytest.mark.parametrize(
    "look_ahead,graph_prefill",
    [(False, False), (True, False), (True, True)],
    ids=["plain", "look-ahead", "look-ahead-graphed-prompts"],
)
def test_rows_join_and_leave_between_steps(model, look_ahead, graph_prefill):
    """Continuous batching: a row added after others started, and a row freed and taken by
    a new prompt, still equal their prompts generated alone; changing buckets (1, 2, 4)
    captures each bucket once and never invalidates. Every attention call of the batch,
    free rows of a bucket included, runs the CPU's prebuilt step, never its general path.
    With look-ahead (each step queued, fed the device argmax, before the one before it is
    read: on by default on a GPU) steps are taken from the queued ones between joins; with
    graphed prompts (also a GPU's default) each row's prompt replays its own padded graphs."""
    alone = {t: generate(model, t, 20, ignore_eos=True).tokens for t in TEXTS}
    batch = BatchGenerator(model, 4, 128)
    batch.look_ahead, batch.graph_prefill = look_ahead, graph_prefill
    verify_before = copy.deepcopy(model.session.graph_stats("verify"))  # a live object
    before = batch.graph_stats()["primary"]
    general_before = general_path_steps()
    ids = {t: model.tokenizer.encode(t) for t in TEXTS}
    owner: dict[int, str] = {}

    def add(text: str) -> None:
        owner[batch.add(ids[text], _params(model, ids[text], 20), ignore_eos=True)] = text

    add(TEXTS[0])
    for _ in range(3):
        batch.step()
    add(TEXTS[1])
    add(TEXTS[2])
    for _ in range(2):
        batch.step()
    first = min(owner)
    assert (
        batch.sequence(first)[: len(alone[TEXTS[0]])]
        == alone[TEXTS[0]][: len(batch.sequence(first))]
    )
    batch.remove(first)  # row 0 frees; the next prompt takes it
    del owner[first]
    add(TEXTS[3])
    add(TEXTS[4])
    finished = {}
    for _ in range(200):
        for row in [r for r in batch.rows if batch.is_done(r)]:
            finished[owner.pop(row)] = batch.sequence(row)
            batch.remove(row)
            if TEXTS[5] not in finished and TEXTS[5] not in owner.values():
                add(TEXTS[5])
        if not batch.rows:
            break
        batch.step()
    assert set(finished) == set(TEXTS[1:])
    for text, tokens in finished.items():
        assert tokens == alone[text], text
    stats = batch.graph_stats()["primary"]
    assert stats["invalidations"] == before["invalidations"]
    assert stats["fallbacks"] == before["fallbacks"]
    assert stats["captures"] - before["captures"] <= len(buckets(4))  # one per bucket
    assert general_path_steps() == general_before
    assert (batch.steps_ahead > 0) == look_ahead, batch.steps_ahead
    prompts = model.session.graph_stats("verify")
    assert (prompts.eager_runs + prompts.replays > verify_before.eager_runs) == graph_prefill
    assert prompts.invalidations == verify_before.invalidations


def test_sampled_rows_follow_their_own_seeds(model):
    """Two rows with the same prompt and seed sample the same text; another seed differs;
    a sampled row equals the same request generated alone."""
    prompt = model.tokenizer.encode("def ")
    opts = dict(do_sample=True, temperature=1.5, top_k=40, seed=7)
    alone = generate(model, prompt, 24, ignore_eos=True, **opts).tokens
    batch = BatchGenerator(model, 4, 128)
    a = batch.add(prompt, _params(model, prompt, 24, **opts), ignore_eos=True)
    b = batch.add(prompt, _params(model, prompt, 24, **{**opts, "seed": 8}), ignore_eos=True)
    c = batch.add(prompt, _params(model, prompt, 24, **opts), ignore_eos=True)
    _run(batch)
    assert batch.sequence(a) == batch.sequence(c) == alone
    assert batch.sequence(b) != batch.sequence(a)


def test_end_of_sequence_ends_one_row(model):
    """A row that reaches its end-of-sequence token stops; the others go on."""
    batch = BatchGenerator(model, 2, 256)
    for text in ("import os\n", "class Foo:"):
        prompt = model.tokenizer.encode(text)
        batch.add(prompt, _params(model, prompt, 200))
    _run(batch)
    for row, text in zip(sorted(batch.rows), ("import os\n", "class Foo:"), strict=True):
        ref = generate(model, text, 200)
        assert batch.sequence(row) == ref.tokens
        assert batch.ended_by_eos(row) == (ref.stop_reason == "eos")


def test_refusals(model):
    batch = BatchGenerator(model, 1, 64)
    prompt = model.tokenizer.encode("x")
    with pytest.raises(InvalidInputError, match="max_length 100 exceeds the batch's max_length 64"):
        batch.add(prompt, _params(model, prompt, 99))
    with pytest.raises(InvalidInputError, match="outside the vocabulary"):
        batch.add([model.config.vocab_size], _params(model, [1], 4))
    batch.add(prompt, _params(model, prompt, 4))
    with pytest.raises(InvalidInputError, match="all 1 rows are in use"):
        batch.add(prompt, _params(model, prompt, 4))
    with pytest.raises(InvalidInputError, match="row 3 is not in use"):
        batch.remove(3)


def test_second_thread_is_refused(model):
    batch = BatchGenerator(model, 1, 64)
    prompt = model.tokenizer.encode("x")
    batch.add(prompt, _params(model, prompt, 8))
    with batch._user, pytest.raises(ConcurrentUseError):  # as if another thread were inside
        import threading

        errors = []
        thread = threading.Thread(target=lambda: _catch(batch.step, errors))
        thread.start()
        thread.join()
        raise errors[0]


def _catch(fn, errors: list) -> None:
    try:
        fn()
    except Exception as exc:
        errors.append(exc)


def test_batched_logits_equal_single_row_logits(model):
    """The logits a row gets in a batched step equal (to float32 rounding) the logits of the
    same position computed alone: rows never see each other's cache."""
    texts = ["def fib(n):", "import sys"]
    batch = BatchGenerator(model, 2, 64)
    rows = [
        batch.add(model.tokenizer.encode(t), _params(model, model.tokenizer.encode(t), 8))
        for t in texts
    ]
    tokens = np.array([batch.sequence(r)[-1] for r in rows])
    lengths = np.array([len(batch.sequence(r)) - 1 for r in rows])
    _, logits = batch.runner.step_rows(tokens, lengths, None, read_logits=True)
    for row in rows:
        seq = batch.sequence(row)
        single = model.session.run(
            ["logits"],
            {
                "input_ids": np.array([seq], np.int64),
                "attention_mask": np.ones((1, len(seq)), np.int64),
                **_empty_past(model),
            },
        )[0][0, -1]
        np.testing.assert_allclose(logits[row], single, rtol=1e-4, atol=1e-4)


def _empty_past(model: Model) -> dict[str, np.ndarray]:
    cfg = model.config
    shape = (1, cfg.num_kv_heads, 0, cfg.head_size)
    feeds = {}
    for i in range(cfg.num_layers):
        feeds[cfg.io.past_key % i] = np.zeros(shape, np.float32)
        feeds[cfg.io.past_value % i] = np.zeros(shape, np.float32)
    return feeds


def test_generate_with_a_list_of_prompts(model, monkeypatch):
    """generate(model, [prompts]) decodes them as one batch; each result equals the prompt
    generated alone (text, tokens, stop reason), stop strings and end of sequence per row;
    without stop strings the text is the same whether it is decoded when a row ends or, with
    steps queued ahead (a GPU), token by token between steps."""
    texts = ["def fib(n):", "import os\n", "class Foo:"]
    results = generate(model, texts, 60, stop=("return",))
    assert isinstance(results, list) and len(results) == len(texts)
    for text, result in zip(texts, results, strict=True):
        alone = generate(model, text, 60, stop=("return",))
        assert (result.text, result.tokens, result.stop_reason) == (
            alone.text,
            alone.tokens,
            alone.stop_reason,
        ), text
    assert any("stop string" in r.stop_reason for r in results)
    # Without stop strings each row's text is decoded when the row ends: the same text.
    plain = generate(model, texts, 24)
    monkeypatch.setattr(BatchGenerator, "look_ahead", True)
    ahead = generate(model, texts, 24)
    for text, result, queued in zip(texts, plain, ahead, strict=True):
        alone = generate(model, text, 24)
        assert (result.text, result.tokens) == (alone.text, alone.tokens), text
        assert (queued.text, queued.tokens) == (alone.text, alone.tokens), text
        assert result.text == model.tokenizer.decode(result.tokens[-result.new_tokens :])
    with pytest.raises(
        InvalidInputError, match="a batch speculates by prompt lookup or an MTP head"
    ):
        generate(model, texts, 8, spec="draft")


def test_chunked_prefill_between_decode_steps(model):
    """A long prompt prefilled 7 tokens at a time while another row decodes: both equal
    their prompts generated alone, and the decoding row made progress meanwhile."""
    long_text = "import os\nimport sys\n\n\nclass Foo(object):\n    def __init__(self, x):\n"
    texts = ["def fib(n):", long_text]
    alone = {t: generate(model, t, 16, ignore_eos=True).tokens for t in texts}
    batch = BatchGenerator(model, 2, 256)
    ids = {t: model.tokenizer.encode(t) for t in texts}
    assert len(ids[long_text]) > 21
    # The prefilling row below the decoding one: decode steps run it as a dummy row.
    long = batch.add(ids[long_text], _params(model, ids[long_text], 16), ignore_eos=True, chunk=7)
    short = batch.add(ids[texts[0]], _params(model, ids[texts[0]], 16), ignore_eos=True)
    assert long < short
    assert batch.prefilling(long) and not batch.prefilling(short)
    steps_while_prefilling = 0
    while batch.prefilling(long):
        batch.prefill_step(7)
        batch.step()
        steps_while_prefilling += 1
    assert steps_while_prefilling >= 3
    # The row's cache holds exactly what a prefill of the whole prompt alone writes.
    from onnx_genrt.engine.decoder import DecoderRunner

    alone_runner = DecoderRunner(model.session, model.config, 256)
    alone_runner.forward(ids[long_text], None)
    n = len(ids[long_text])
    for mine, ref in zip(
        batch.runner.cache.keys + batch.runner.cache.values,
        alone_runner.cache.keys + alone_runner.cache.values,
        strict=True,
    ):
        np.testing.assert_allclose(mine[long, :, :n], ref[0, :, :n], rtol=1e-5, atol=1e-5)
    assert len(batch.sequence(short)) > len(ids[texts[0]]) + 3  # it decoded meanwhile
    _run(batch)
    assert batch.sequence(short) == alone[texts[0]]
    assert batch.sequence(long) == alone[long_text]


def test_device_argmax_ids_outside_the_vocabulary_raise():
    from onnx_genrt.core.errors import KernelError
    from onnx_genrt.engine.decoder import check_token_ids

    check_token_ids(np.array([0, 4095]), 4096, "a step")
    with pytest.raises(KernelError, match=r"token ids \[-1, 4096\] outside the vocabulary of 4096"):
        check_token_ids(np.array([3, -1, 4096]), 4096, "a step")


@pytest.mark.parametrize("gpu_defaults", [False, True], ids=["cpu-defaults", "gpu-defaults"])
def test_generator_with_batch_size_holds_several_sequences(model, monkeypatch, gpu_defaults):
    """``batch_size`` in the search options: ``Generator`` holds that many sequences (prompts
    of different lengths), each equal to its prompt generated alone; a sequence that ends
    early gets the pad token while the others go on. The same with a GPU's defaults forced
    (steps queued ahead, prompts as graphed chunks)."""
    from onnx_genrt.engine import Generator
    from onnx_genrt.engine.batch import SequencesGenerator

    if gpu_defaults:
        monkeypatch.setattr(BatchGenerator, "look_ahead", True)
        monkeypatch.setattr(BatchGenerator, "graph_prefill", True)

    prompts = [model.tokenizer.encode(t) for t in TEXTS[:3]]
    alone = [generate(model, p, 12).tokens for p in prompts]  # prompt and 12 new tokens
    params = GeneratorParams(model)
    params.set_search_options(max_length=max(map(len, prompts)) + 12, batch_size=3)
    with Generator(model, params) as gen:
        assert isinstance(gen, SequencesGenerator)
        ahead_before = gen._batch.steps_ahead  # a pooled batch: its count so far
        gen.append_tokens(prompts)
        assert [gen.get_sequence(i) for i in range(3)] == prompts
        steps = []
        while not gen.is_done():
            gen.generate_next_token()
            steps.append(gen.get_next_tokens())
        sequences = [gen.get_sequence(i) for i in range(3)]
        assert (gen._batch.steps_ahead > ahead_before) == gpu_defaults
    for i, (prompt, want) in enumerate(zip(prompts, alone, strict=True)):
        # each row runs to the shared max_length; its first 12 new tokens are generate()'s
        assert want[: len(prompt)] == prompt and sequences[i][: len(want)] == want
        assert [s[i] for s in steps][: len(sequences[i]) - len(prompt)] == sequences[i][
            len(prompt) :
        ]
    assert len(steps) == max(map(len, sequences)) - min(map(len, prompts))
    assert len(set(map(len, prompts))) > 1
    first_done = max(range(3), key=lambda i: len(prompts[i]))  # least room to max_length
    assert steps[-1][first_done] == gen.pad_token_id  # done before the last step: padded


def test_generator_with_batch_size_refusals(model):
    from onnx_genrt.engine import Generator, make_generator

    params = GeneratorParams(model)
    with pytest.raises(InvalidInputError, match=r"search option batch_size must be .*>= 1"):
        params.set_search_options(batch_size=0)
    params.set_search_options(max_length=32, batch_size=2)
    gen = Generator(model, params)
    with pytest.raises(InvalidInputError, match="append_tokens first"):
        gen.generate_next_token()
    with pytest.raises(InvalidInputError, match="batch_size is 2, got 1"):
        gen.append_tokens([[1, 2, 3]])
    gen.append_tokens([[1, 2, 3], [4, 5]])
    with pytest.raises(InvalidInputError, match="takes its prompts once"):
        gen.append_tokens([[1], [2]])
    gen.close()
    with pytest.raises(InvalidInputError, match="closed"):
        gen.generate_next_token()
    with pytest.raises(InvalidInputError, match="speculative decoding runs one at a time"):
        make_generator(model, params, "ngram")
    bad = GeneratorParams(model)
    bad.set_search_options(max_length=32, batch_size=2)
    gen = Generator(model, bad)
    with pytest.raises(InvalidInputError, match="outside the vocabulary"):
        gen.append_tokens([[1, 2], [model.config.vocab_size]])
    gen.append_tokens([[1, 2], [3]])  # the failed call left no row behind
    gen.close()


@pytest.mark.parametrize("rows", [1, 3])
def test_a_step_queued_for_finished_rows_is_not_reused_by_new_ones(model, rows):
    """Look-ahead queues each next step for the rows that ran; when those rows finish and
    new prompts take the same rows (the same set of rows, so the queued step would fit), the
    new rows' first steps are their own, not the queued one fed the old rows' tokens. The
    same through ``generate_batch``, whose batch comes back from the model's pool."""
    batch = BatchGenerator(model, rows, 128)
    batch.look_ahead = True
    for texts in (TEXTS[:rows], TEXTS[rows : 2 * rows]):
        added = {}
        for text in texts:
            ids = model.tokenizer.encode(text)
            added[batch.add(ids, _params(model, ids, 9), ignore_eos=True)] = text
        _run(batch)
        assert batch.steps_ahead > 0
        for row, text in added.items():
            assert batch.sequence(row) == generate(model, text, 9, ignore_eos=True).tokens, text
            batch.remove(row)
    prompts = [model.tokenizer.encode(t) for t in TEXTS[:rows]]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(BatchGenerator, "look_ahead", True)
        for _ in range(2):
            results = generate_batch(model, prompts, 9, ignore_eos=True)
            for result, text in zip(results, TEXTS[:rows], strict=True):
                assert result.tokens == generate(model, text, 9, ignore_eos=True).tokens, text
