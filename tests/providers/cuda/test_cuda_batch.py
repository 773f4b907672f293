"""Batched decoding on CUDA: every row equals its prompt decoded alone, bucket graphs replay."""

from __future__ import annotations

import numpy as np
import pytest

from .test_cuda_llm_kernels import _fixture

pytestmark = pytest.mark.gpu

TEXTS = ["    def __init__(self", "import os\n", "class Foo:", "def fib(n):", "x = [", "return"]


def _params(model, prompt, new):
    from onnx_genrt.engine import GeneratorParams

    params = GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + new)
    return params


def _with_joins(batch, texts: list[str], new: int) -> dict[str, list[int]]:
    """Each text's tokens after ``new`` more, eos ignored: texts join free rows between
    steps and leave as they finish."""
    model = batch.model
    queue = list(texts)
    owner, finished = {}, {}
    for _ in range(400):
        while queue and batch.free_rows():
            text = queue.pop(0)
            ids = model.tokenizer.encode(text)
            owner[batch.add(ids, _params(model, ids, new), ignore_eos=True)] = text
        for row in [r for r in batch.rows if batch.is_done(r)]:
            finished[owner.pop(row)] = batch.sequence(row)
            batch.remove(row)
        if not batch.rows and not queue:
            break
        if batch.rows:
            batch.step()
    return finished


@pytest.mark.parametrize(
    "grouped,most", [(1, 0), (0, 0), (1, 1)], ids=["grouped-cluster", "cluster-per-head", "plain"]
)
def test_embedded_model_rows_equal_alone_with_joins(cp, monkeypatch, grouped, most):
    """Six prompts through four rows on CUDA: rows join and leave between steps, every
    sequence equals the prompt generated alone on CUDA (and on the CPU), and the decode
    steps replay one graph per bucket with no fallback or invalidation; with decode
    attention as one cluster per KV head and row (the default), per query head, and, above
    one row (``attention_grouped_cluster_max_rows``), the grouped kernel's plain launch."""
    from onnx_genrt.engine import Model, generate
    from onnx_genrt.engine.batch import BatchGenerator
    from onnx_genrt.generate_cli import default_model_dir

    monkeypatch.setenv("ONNX_GENRT_ATTENTION_GROUPED_CLUSTER", str(grouped))
    monkeypatch.setenv("ONNX_GENRT_ATTENTION_GROUPED_CLUSTER_MAX_ROWS", str(most))
    cuda = Model(default_model_dir(), provider="cuda")
    assert cuda.session.main_provider.option("attention_grouped_cluster") == bool(grouped)
    cpu = Model(default_model_dir())
    alone = {t: generate(cuda, t, 40, ignore_eos=True).tokens for t in TEXTS}
    for t in TEXTS:
        assert alone[t] == generate(cpu, t, 40, ignore_eos=True).tokens, t
    batch = BatchGenerator(cuda, 4, 256)
    assert _with_joins(batch, TEXTS, 40) == alone
    stats = batch.graph_stats()["primary"]
    assert stats["fallbacks"] == 0 and stats["invalidations"] == 0, stats
    assert stats["replays"] > 40


def test_device_sampled_rows_draw_the_same_in_any_batch(cp):
    """``BatchGenerator.device_sampling`` on CUDA (SampleTokens after each step): a sampled
    row (temperature 1.5, top_k 0 or 5) draws the same tokens alone and beside other rows,
    a top-k row only among its step's k largest logits, and a greedy row beside them keeps
    its tokens alone."""
    from onnx_genrt.engine import Model
    from onnx_genrt.engine.batch import BatchGenerator
    from onnx_genrt.engine.model import GeneratorParams
    from onnx_genrt.generate_cli import default_model_dir

    model = Model(default_model_dir(), provider="cuda")
    hot = dict(do_sample=True, temperature=1.5, top_k=0, seed=21)

    def run(rows):
        batch = BatchGenerator(model, 4, 96)
        batch.device_sampling = True
        index = []
        for text, search in rows:
            ids = model.tokenizer.encode(text)
            params = GeneratorParams(model)
            params.set_search_options(max_length=len(ids) + 25, **search)
            index.append(batch.add(ids, params, ignore_eos=True))
        for _ in range(24):
            batch.step()
        sampled = any(search.get("do_sample") for _, search in rows)
        assert (batch.runner._sampler is not None) == sampled  # drawn on the device
        return [batch.sequence(i) for i in index]

    greedy = dict(do_sample=False)
    alone = run([(TEXTS[1], hot)])[0]
    alone_k = run([(TEXTS[2], {**hot, "top_k": 5, "seed": 4})])[0]
    alone_greedy = run([(TEXTS[0], greedy)])[0]
    mixed = run([(TEXTS[0], greedy), (TEXTS[1], hot), (TEXTS[2], {**hot, "top_k": 5, "seed": 4})])
    assert mixed == [alone_greedy, alone, alone_k]
    assert len(set(alone[-24:])) > 3  # it samples: not one repeated token


@pytest.mark.parametrize("name", ["qwen2-fp32", "qwen2-int4"])
def test_builder_model_row_matches_reference(cp, name):
    """The fixture's reference greedy tokens (the CPU provider's) come out of row 2 of a
    batch of 4 whose other rows decode random prompts of other lengths."""
    from onnx_genrt.engine import Model
    from onnx_genrt.engine.batch import BatchGenerator

    folder = _fixture(name)
    ref = np.load(folder / "reference.npz")
    prompt, tokens = ref["prompt"].tolist(), ref["tokens"].tolist()
    model = Model(folder, provider="cuda")
    rng = np.random.default_rng(0)
    batch = BatchGenerator(model, 4, 256)
    rows = []
    for i in range(4):
        ids = prompt if i == 2 else rng.integers(1, model.config.vocab_size, 3 + 5 * i).tolist()
        rows.append(batch.add(ids, _params(model, ids, len(tokens)), ignore_eos=True))
    while not all(batch.is_done(r) for r in rows):
        batch.step()
    assert batch.sequence(rows[2])[len(prompt) :] == tokens
    stats = batch.graph_stats()["primary"]
    assert stats["captures"] == 1 and stats["fallbacks"] == 0, stats


def test_new_rows_never_take_a_step_queued_for_finished_ones(cp):
    """A GPU's default look-ahead queues each next step before reading the last; when the
    rows finish and new prompts take the same rows (one row, then again through the model's
    pooled batch of ``generate_batch``), every new row still equals its prompt alone."""
    from onnx_genrt.engine import Model, generate, generate_batch
    from onnx_genrt.engine.batch import BatchGenerator
    from onnx_genrt.generate_cli import default_model_dir

    cuda = Model(default_model_dir(), provider="cuda")
    alone = {t: generate(cuda, t, 12, ignore_eos=True).tokens for t in TEXTS}
    batch = BatchGenerator(cuda, 1, 128)
    for text in TEXTS[:3]:
        ids = cuda.tokenizer.encode(text)
        row = batch.add(ids, _params(cuda, ids, 12), ignore_eos=True)
        while not batch.is_done(row):
            batch.step()
        assert batch.sequence(row) == alone[text], text
        batch.remove(row)
    assert batch.steps_ahead > 0  # the look-ahead is on by default on a GPU
    prompts = [cuda.tokenizer.encode(t) for t in TEXTS[:4]]
    for _ in range(2):
        results = generate_batch(cuda, prompts, 12, ignore_eos=True)
        assert [r.tokens for r in results] == [alone[t] for t in TEXTS[:4]]


@pytest.mark.parametrize("kind", ["ngram", "mtp"])
@pytest.mark.parametrize("joins", [False, True])
def test_speculating_rows_equal_alone(cp, joins, kind):
    """Speculation per row on CUDA, by prompt lookup or the MTP head (its chain over the
    rows): verify steps of 4 rows x 4 tokens, each row at its own length; every sequence
    equals the prompt generated alone on CUDA, drafts are kept, and the verify graph replays
    with no fallback or invalidation. With ``joins`` rows join and leave between steps (six
    prompts through four rows)."""
    from onnx_genrt.engine import Model, generate
    from onnx_genrt.engine.batch import BatchGenerator
    from onnx_genrt.generate_cli import default_model_dir

    cuda = Model(default_model_dir(), provider="cuda")
    texts = TEXTS if joins else TEXTS[:4]
    alone = {t: generate(cuda, t, 48, ignore_eos=True).tokens for t in texts}
    batch = BatchGenerator(cuda, 4, 256)
    batch.speculate(kind, 3)
    assert _with_joins(batch, texts, 48) == alone
    assert batch.speculation.verify_steps > 0 and batch.speculation.accepted > 0
    stats = batch.graph_stats()["verify"]
    assert stats["fallbacks"] == 0 and stats["invalidations"] == 0, stats
    assert stats["replays"] > 0


def test_a_single_sequence_draws_on_the_device_by_default(cp):
    """``Generator.device_sampling`` left at None on CUDA (reads are async) draws on the
    device: ``generate`` with a seed gives a batch row's device-drawn tokens, not the host
    sampler's."""
    from onnx_genrt.engine import Model, generate
    from onnx_genrt.engine.batch import BatchGenerator
    from onnx_genrt.engine.generator import Generator
    from onnx_genrt.engine.model import GeneratorParams
    from onnx_genrt.generate_cli import default_model_dir

    model = Model(default_model_dir(), provider="cuda")
    search = dict(do_sample=True, temperature=1.5, top_k=5, seed=4)
    ids = model.tokenizer.encode(TEXTS[1])

    def batch_row(device: bool) -> list[int]:
        batch = BatchGenerator(model, 2, 96)
        batch.device_sampling = device
        params = GeneratorParams(model)
        params.set_search_options(max_length=len(ids) + 25, **search)
        row = batch.add(ids, params, ignore_eos=True)
        for _ in range(24):
            batch.step()
        return batch.sequence(row)

    assert Generator.device_sampling is None
    device, host = batch_row(True), batch_row(False)
    assert device != host
    alone = generate(model, TEXTS[1], 25, ignore_eos=True, **search).tokens
    assert alone == device


def test_half_precision_rows_and_verify_steps_keep_one_rows_bits(cp):
    """On a bf16 model (tensor-core and GEMV kernels), each row of a batched decode step
    and each position of a verify step gets the logits of the one-row decode step bit for
    bit: the chosen tokens' log-probabilities equal those of each prompt alone exactly,
    in a batch of 8 plain rows and in one that verifies prompt-lookup drafts."""
    from onnx_genrt.engine import Model, generate, generate_batch

    model = Model(_fixture("qwen2-bf16"), provider="cuda")
    rng = np.random.default_rng(5)
    vocab = model.config.vocab_size
    prompts = [rng.integers(1, vocab, n).tolist() for n in (3, 8, 17, 32)]
    prompts += [p * 4 for p in prompts]  # repeats: prompt lookup proposes drafts

    def bits(result):
        return result.tokens, [t.logprob for t in result.logprobs]

    alone = [bits(generate(model, p, 24, ignore_eos=True, logprobs=1)) for p in prompts]
    plain = generate_batch(model, prompts, 24, ignore_eos=True, logprobs=1)
    assert [bits(r) for r in plain] == alone
    spec = generate_batch(model, prompts, 24, ignore_eos=True, logprobs=1, spec="ngram", k=3)
    assert spec[0].speculation["verify_steps"] > 0 and spec[0].speculation["proposed"] > 0
    assert [bits(r) for r in spec] == alone
