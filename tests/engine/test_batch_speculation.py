"""Speculation per row of a batch (prompt lookup): every row's output equals plain greedy
decoding of its prompt alone, token for token, while verify steps replay their graphs."""

from __future__ import annotations

import dataclasses
import threading

import pytest

from onnx_genrt.core.errors import InvalidInputError
from onnx_genrt.engine import Model, generate, generate_batch
from onnx_genrt.engine.batch import BatchGenerator
from onnx_genrt.engine.scheduler import Scheduler
from onnx_genrt.engine.speculative import PayoffPolicy
from onnx_genrt.generate_cli import default_model_dir

from .test_batch import _params, _run
from .test_greedy_parity import PROMPTS, _onnxruntime_genai

TEXTS = ["    def __init__(self", "import os\nimport sys\n", "class Foo:\n    def", "x = ["]
#: Prompt lookup, and the MTP head (the embedded model's; a random one on builder models).
KINDS = pytest.mark.parametrize("kind", ["ngram", "mtp"])


@pytest.fixture(scope="module")
def model() -> Model:
    return Model(default_model_dir())


@KINDS
def test_rows_equal_greedy_alone_in_fewer_steps(model, kind):
    """Four prompts of different lengths, 64 tokens each with 3 drafts a row: each row
    equals onnxruntime-genai generating its prompt alone; most steps verify, drafts are
    kept, and the verify graph of the bucket replays with no fallback."""
    prompts = [model.tokenizer.encode(t) for t in TEXTS]
    alone = [_onnxruntime_genai(model.folder, p, 64) for p in prompts]
    before = model.session.all_graph_stats().get("verify", {})
    results = generate_batch(model, prompts, 64, ignore_eos=True, spec=kind, k=3)
    assert [r.tokens for r in results] == alone
    spec = results[0].speculation
    assert spec["kind"] == kind and spec["k"] == 3
    assert spec["accepted"] > 32 and spec["verify_steps"] + spec["plain_steps"] < 63
    verify = model.session.all_graph_stats()["verify"]
    assert verify["replays"] - before.get("replays", 0) >= spec["verify_steps"] - 2
    assert verify["fallbacks"] == 0 and verify["invalidations"] == 0


def test_mtp_rows_draft_what_one_sequence_drafts(model):
    """The MTP head run once for all rows, from each row's own hidden state, proposes what
    it proposes for each prompt alone: the batch's drafts proposed and accepted match the
    single-sequence generator's over the same prompts (within 3%: a batched matmul may
    round a confidence differently). Measured equal here: 205 proposed, 183 accepted."""
    proposed = accepted = 0
    for text in TEXTS:
        alone = generate(model, text, 64, ignore_eos=True, spec="mtp", k=3).speculation
        proposed, accepted = proposed + alone["proposed"], accepted + alone["accepted"]
    batch = generate_batch(model, TEXTS, 64, ignore_eos=True, spec="mtp", k=3)[0].speculation
    assert abs(batch["proposed"] - proposed) <= 0.03 * proposed, (batch, proposed)
    assert abs(batch["accepted"] - accepted) <= 0.03 * accepted, (batch, accepted)
    assert batch["plain_steps"] == 0  # drafts from the first step on: the prompt's hidden state


@KINDS
def test_rows_match_onnxruntime_genai_alone(qwen2_dir, kind):
    """A random-weight builder model (position_ids): each row of a speculating batch equals
    onnxruntime-genai generating its prompt alone. Its random text repeats little: nearly
    every draft is refused, in steps that feed them all."""
    model = Model(qwen2_dir)
    batch = BatchGenerator(model, 4, 128)
    batch.speculate(kind, 3)
    rows = {batch.add(p, _params(model, p, 32), ignore_eos=True): p for p in PROMPTS}
    _run(batch)
    for row, prompt in rows.items():
        assert batch.sequence(row) == _onnxruntime_genai(qwen2_dir, prompt, 32), row
    assert batch.speculation.verify_steps > 0


def _speculating_batch(model: Model, new: int, kind: str) -> tuple[BatchGenerator, dict[int, str]]:
    batch = BatchGenerator(model, 4, 128)
    batch.speculate(kind, 3)
    rows = {}
    for text in TEXTS:
        ids = model.tokenizer.encode(text)
        rows[batch.add(ids, _params(model, ids, new))] = text
    return batch, rows


@KINDS
def test_end_of_sequence_inside_kept_drafts(model, monkeypatch, kind):
    """An end-of-sequence id that a step keeps as a draft with more tokens after it (found
    in a run without one): each row stops right after it, as it does alone."""
    monkeypatch.setattr(model, "config", dataclasses.replace(model.config, eos_token_ids=()))
    batch, rows = _speculating_batch(model, 48, kind)
    found = None
    while found is None and not all(batch.is_done(r) for r in rows):
        for row, kept in batch.step().items():
            prompt = batch.rows[row].prompt_length
            earlier = batch.sequence(row)[prompt : -len(kept)]  # generated before this step
            if len(kept) > 1 and kept[0] not in earlier:
                found = kept[0]
    assert found is not None, "no step kept a draft with tokens after it"
    monkeypatch.setattr(model, "config", dataclasses.replace(model.config, eos_token_ids=(found,)))
    batch, rows = _speculating_batch(model, 48, kind)
    _run(batch)
    ended = 0
    for row, text in rows.items():
        want = generate(model, text, 48).tokens
        assert batch.sequence(row) == want, text
        ended += batch.ended_by_eos(row)
    assert ended >= 1


@KINDS
def test_min_length_masks_an_early_end_of_sequence(model, monkeypatch, kind):
    """An end-of-sequence id greedy decoding makes early, with min_length 20 tokens past
    each prompt: a verify step keeps the tokens before a masked one, a plain step picks it
    from the logits, and each row equals its prompt generated alone with the same
    options."""
    free = generate(model, TEXTS[0], 8, ignore_eos=True)
    eos = free.tokens[free.prompt_tokens + 2]
    monkeypatch.setattr(model, "config", dataclasses.replace(model.config, eos_token_ids=(eos,)))
    batch = BatchGenerator(model, 4, 128)
    batch.speculate(kind, 3)
    rows = {}
    for text in TEXTS:
        ids = model.tokenizer.encode(text)
        rows[batch.add(ids, _params(model, ids, 40, min_length=len(ids) + 20))] = ids
    _run(batch)
    for row, ids in rows.items():
        assert batch.sequence(row) == generate(model, ids, 40, min_length=len(ids) + 20).tokens
    assert batch.speculation.verify_steps > 0


@KINDS
def test_each_row_stops_at_its_own_max_length(model, kind):
    """Rows of 5, 17 and 40 new tokens: none overshoots in a step that keeps drafts."""
    batch = BatchGenerator(model, 4, 128)
    batch.speculate(kind, 3)
    rows = {}
    for text, new in zip(TEXTS, (5, 17, 40), strict=False):
        ids = model.tokenizer.encode(text)
        rows[batch.add(ids, _params(model, ids, new), ignore_eos=True)] = (text, new)
    _run(batch)
    for row, (text, new) in rows.items():
        assert batch.sequence(row) == generate(model, text, new, ignore_eos=True).tokens


@pytest.mark.parametrize(
    "options",
    [{"do_sample": True, "top_k": 1, "seed": 3}, {"repetition_penalty": 1.3}],
    ids=["sampling-top-k-1", "repetition-penalty"],
)
@KINDS
def test_rows_verified_on_their_logits_equal_alone(model, options, kind):
    """Rows that do not take the raw argmax go through their drafts on the verify step's
    logits: sampling with top_k=1 (one token possible) and greedy with a repetition penalty
    (of the text so far, drafts included) give exactly the prompt generated alone."""
    batch = BatchGenerator(model, 4, 128)
    batch.speculate(kind, 3)
    rows = {}
    for text in TEXTS:
        ids = model.tokenizer.encode(text)
        rows[batch.add(ids, _params(model, ids, 40, **options), ignore_eos=True)] = text
    _run(batch)
    for row, text in rows.items():
        assert batch.sequence(row) == generate(model, text, 40, ignore_eos=True, **options).tokens
    assert batch.speculation.verify_steps > 0 and batch.speculation.accepted > 0


@KINDS
def test_sampled_speculating_rows_follow_their_own_seeds(model, kind):
    """Sampled rows (temperature 0.7, top_k 20) speculate: two rows with the same prompt and
    seed give the same text, in this batch and the next; another seed gives another."""
    ids = model.tokenizer.encode(TEXTS[1])
    opts = {"do_sample": True, "temperature": 0.7, "top_k": 20}
    texts = []
    for _ in range(2):
        batch = BatchGenerator(model, 4, 128)
        batch.speculate(kind, 3)
        rows = [
            batch.add(ids, _params(model, ids, 40, seed=seed, **opts), ignore_eos=True)
            for seed in (11, 12, 11)
        ]
        _run(batch)
        texts.append([batch.sequence(r) for r in rows])
        assert batch.speculation.verify_steps > 0
    assert texts[0] == texts[1]
    first, other, same = texts[0]
    assert first == same and first != other and len(first) == len(ids) + 40


@KINDS
def test_scheduler_with_chunked_prompts_equals_each_served_alone(model, kind):
    """Continuous batching with speculation: 12 requests from 3 threads through 4 rows,
    prompts prefilled 3 tokens a step beside verify steps of the others: every text equals
    generate() alone."""
    texts = [t * 3 for t in TEXTS]  # longer prompts: several chunks each
    alone = {t: generate(model, t, 32) for t in texts}
    results: list[tuple[str, object]] = []
    with Scheduler(model, max_batch=4, prefill_chunk=3, spec=kind, k=3) as sched:

        def client(k: int) -> None:
            for j in range(4):
                text = texts[(k + j) % len(texts)]
                results.append((text, sched.submit(text, max_new_tokens=32).result(120)))

        threads = [threading.Thread(target=client, args=(k,)) for k in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(240)
        metrics = sched.metrics()
    assert len(results) == 12
    for text, result in results:
        assert result.token_ids == alone[text].tokens[alone[text].prompt_tokens :], text
        assert result.text == alone[text].text
    assert metrics.speculation["verify_steps"] > 0 and metrics.speculation["accepted"] > 0
    assert metrics.tokens_generated == sum(r.completion_tokens for _, r in results)
    assert metrics.graph_stats["verify"]["fallbacks"] == 0


@KINDS
def test_stop_strings_end_rows_where_they_end_alone(model, kind):
    """A stop string completed inside a step's kept drafts: the row's text, tokens and stop
    reason are those of the prompt generated alone, through generate_batch and through the
    scheduler (usage counts no token past the stop)."""
    full = {t: generate(model, t, 40).text for t in TEXTS}
    stops = {t: full[t][len(full[t]) // 2 : len(full[t]) // 2 + 3] for t in TEXTS}
    every = list(stops.values())
    alone = {t: generate(model, t, 40, stop=every) for t in TEXTS}
    batched = generate_batch(model, TEXTS, 40, stop=every, spec=kind)
    for text, result in zip(TEXTS, batched, strict=True):
        want = alone[text]
        assert (result.text, result.tokens, result.stop_reason) == (
            want.text,
            want.tokens,
            want.stop_reason,
        )
    with Scheduler(model, max_batch=4, spec=kind, k=3) as sched:
        handles = {t: sched.submit(t, max_new_tokens=40, stop=every) for t in TEXTS}
        served = {t: h.result(60) for t, h in handles.items()}
    for text, result in served.items():
        want = alone[text]
        assert result.text == want.text
        assert result.token_ids == want.tokens[want.prompt_tokens :]
        assert result.finish_reason == (
            "stop" if want.stop_reason != "max_new_tokens" else "length"
        )
    assert any(r.stop_reason.startswith("stop string") for r in alone.values())


def test_auto_stops_verifying_when_plain_steps_give_more_tokens():
    """A batch's plain step adds a token a row: 8 rows in 2 ms (4000 tok/s) beat verify
    steps adding 12 tokens in 4 ms (3000 tok/s), so ``auto`` settles on plain steps."""
    policy = PayoffPolicy(window=4, probe=8, skip=0)
    decisions = []
    for _ in range(48):
        verify = policy.speculate()
        decisions.append(verify)
        policy.record(verify, 12 if verify else 8, 0.004 if verify else 0.002)
    assert policy.pays() is False and sum(decisions[8:]) <= 40 // 8 + 1


@pytest.mark.parametrize(
    ("spec", "k", "message"),
    [
        ("draft", None, "prompt lookup or an MTP head: spec='draft'"),
        ("beam", 2, "prompt lookup or an MTP head: spec='beam'"),
        ("ngram", 0, "k \\(drafts per row\\) must be an integer >= 1, got 0"),
        (None, 3, "k=3 needs a speculation kind"),
    ],
)
def test_bad_speculation_options_are_refused(model, spec, k, message):
    with pytest.raises(InvalidInputError, match=message):
        generate_batch(model, TEXTS[:2], 4, spec=spec, k=k)
    with pytest.raises(InvalidInputError, match=message):
        Scheduler(model, spec=spec, k=k)


def test_mtp_on_a_model_without_a_head_is_refused():
    """A model folder with no MTP head: spec='mtp' fails before any row runs, naming the
    folder's speculative.json."""
    from onnx_genrt.core.errors import ModelLoadError
    from tests.llm_fixtures import DRAFT_QWEN2, build_qwen2

    plain = Model(build_qwen2(DRAFT_QWEN2, seed=3))
    with pytest.raises(ModelLoadError, match="speculative.json has no mtp section"):
        generate_batch(plain, [[1, 2, 3], [4, 5]], 4, spec="mtp")
    with pytest.raises(ModelLoadError, match="speculative.json has no mtp section"):
        Scheduler(plain, spec="mtp")
    assert generate_batch(plain, [[1, 2, 3], [4, 5]], 4, spec="auto")[0].speculation["k"] == 4


@KINDS
def test_steps_too_wide_to_verify_look_ahead_and_equal_alone(model, kind, monkeypatch):
    """Four rows of 4 tokens exceed graphs of 8 rows: every step is plain, and with look-ahead
    forced on (as on a GPU) each is queued before the last is read, the rows still equal
    their prompts alone; two rows verify again (8 rows of tokens)."""
    monkeypatch.setattr(BatchGenerator, "look_ahead", True)
    batch = BatchGenerator(model, 4, 128, max_graph_rows=8)
    batch.speculate(kind, 3)
    rows = {}
    for text in TEXTS:
        ids = model.tokenizer.encode(text)
        rows[batch.add(ids, _params(model, ids, 24), ignore_eos=True)] = text
    _run(batch)
    for row, text in rows.items():
        assert batch.sequence(row) == generate(model, text, 24, ignore_eos=True).tokens
    assert batch.steps_ahead > 0 and batch.speculation.verify_steps == 0
    batch.clear()
    batch.speculate(kind, 3)
    pair = {}
    for text in TEXTS[:2]:
        ids = model.tokenizer.encode(text)
        pair[batch.add(ids, _params(model, ids, 24), ignore_eos=True)] = text
    _run(batch)
    for row, text in pair.items():
        assert batch.sequence(row) == generate(model, text, 24, ignore_eos=True).tokens
    assert batch.speculation.verify_steps > 0
