"""BatchGenerator and SequencesGenerator at their edges: option bounds, prompts that leave no
room, chunked prefill above the decoding rows, step pieces beside whole-step graphs, end of
sequence and padding (against onnxruntime-genai), prefills that compute every prompt row."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest

from onnx_genrt.core.errors import InvalidInputError
from onnx_genrt.engine import Generator, GeneratorParams, Model, generate
from onnx_genrt.engine.batch import BatchGenerator, SequencesGenerator, buckets
from onnx_genrt.generate_cli import default_model_dir

from .test_decoder_checks import _edited_copy
from .test_greedy_parity import _onnxruntime_genai

#: Two prompts of the builder fixture and the end-of-sequence id the first one reaches at
#: its third greedy token (and the second not in its first nine).
PROMPTS = [[5, 17, 99], [3, 8, 40]]
EOS = 262


@pytest.fixture(scope="module")
def model() -> Model:
    return Model(default_model_dir())


def _params(model: Model, max_length: int, **search) -> GeneratorParams:
    params = GeneratorParams(model)
    params.set_search_options(max_length=max_length, **search)
    return params


def _alone(model: Model, prompt: list[int], new: int, **kwargs) -> list[int]:
    return generate(model, prompt, new, **kwargs).tokens


def _with_config(source: Path, target: Path, **model_keys) -> Path:
    """A copy of the decoder folder whose genai_config.json ``model`` section has
    ``model_keys`` set (a value of None removes the key)."""
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("draft", "mtp", "spec*"))
    path = target / "genai_config.json"
    config = json.loads(path.read_text())
    for key, value in model_keys.items():
        if value is None:
            config["model"].pop(key, None)
        else:
            config["model"][key] = value
    path.write_text(json.dumps(config, indent=2))
    return target


def test_buckets_list_each_step_size_once():
    assert buckets(32) == (1, 2, 4, 8, 16, 32)
    assert buckets(4, max_graph_rows=2) == (1, 2, 4)


def test_batch_options_are_checked_at_their_bounds(model):
    with pytest.raises(InvalidInputError, match="max_batch must be an integer >= 1, got 0"):
        BatchGenerator(model, 0)
    with pytest.raises(InvalidInputError, match="max_graph_rows must be an integer >= 1, got 0"):
        BatchGenerator(model, 2, max_graph_rows=0)
    context = model.config.context_length
    for length in (1, context + 1):
        with pytest.raises(InvalidInputError, match=f"max_length must be .*got {length}"):
            BatchGenerator(model, 1, length)
    # The smallest batch: a one-token prompt and its one new token.
    prompt = model.tokenizer.encode("x")[:1]
    batch = BatchGenerator(model, 1, 2)
    row = batch.add(prompt, _params(model, 2), ignore_eos=True)
    assert batch.is_done(row)
    assert batch.sequence(row) == _alone(model, prompt, 1, ignore_eos=True)


def test_graphs_of_one_row(model):
    """max_graph_rows=1: a step of two rows replays two one-row graphs; each row equals its
    prompt generated alone."""
    texts = ["def fib(n):", "import os\n"]
    batch = BatchGenerator(model, 2, 64, max_graph_rows=1)
    rows = {}
    for text in texts:
        ids = model.tokenizer.encode(text)
        rows[batch.add(ids, _params(model, len(ids) + 8), ignore_eos=True)] = ids
    while not all(batch.is_done(r) for r in rows):
        batch.step()
    for row, ids in rows.items():
        assert batch.sequence(row) == _alone(model, ids, 8, ignore_eos=True)


def test_a_prompt_must_leave_room_for_a_token(model):
    """``add`` picks the prompt's first token, so the prompt must be shorter than its
    max_length; one token shorter gives exactly that token (as generated alone)."""
    prompt = model.tokenizer.encode("import os\nimport sys\n")
    n = len(prompt)
    batch = BatchGenerator(model, 1, n)
    with pytest.raises(
        InvalidInputError, match=f"a prompt of {n} tokens leaves no room below max_length {n}"
    ):
        batch.add(prompt, _params(model, n))
    assert not batch.rows
    row = batch.add(prompt[:-1], _params(model, n), ignore_eos=True)
    assert batch.is_done(row) and batch.step() == {}
    assert batch.sequence(row) == _alone(model, prompt[:-1], 1, ignore_eos=True)
    # The batched Generator refuses it too, and keeps no row.
    params = _params(model, n, batch_size=2)
    with Generator(model, params) as gen, pytest.raises(InvalidInputError, match="no room"):
        gen.append_tokens([prompt[:-1], prompt])
    assert gen.get_sequence(0) == []  # no row was kept


def test_prompt_token_ids_are_checked(model):
    vocab = model.config.vocab_size
    batch = BatchGenerator(model, 1, 64)
    with pytest.raises(InvalidInputError, match="token id 1 must be an integer >= 0, got -1"):
        batch.add([5, -1, 7], _params(model, 16))
    bad = [vocab, vocab + 1, vocab + 2, vocab + 3, vocab + 4]
    with pytest.raises(
        InvalidInputError,
        match=rf"token ids \[{', '.join(map(str, bad))}\] are outside the vocabulary of {vocab}$",
    ):
        batch.add([1, *bad, vocab + 5], _params(model, 16))
    assert not batch.rows
    # 0 (here the bos and eos id) and vocab - 1 are ids like any other.
    prompt = [0, *model.tokenizer.encode("def f(x):"), vocab - 1]
    row = batch.add(prompt, _params(model, len(prompt) + 6), ignore_eos=True)
    while not batch.is_done(row):
        batch.step()
    assert batch.sequence(row) == _alone(model, prompt, 6, ignore_eos=True)


def test_a_row_prefilling_above_the_decoding_rows(model):
    """A prompt prefilled one token per call in row 1 while row 0 decodes alone (its steps
    run one row): the prefilling row is neither done nor ended, although its prompt ends in
    the end-of-sequence id; both rows equal their prompts generated alone."""
    eos = model.config.eos_token_ids[0]
    short = model.tokenizer.encode("class Foo:")
    long = [*model.tokenizer.encode("import os\n"), eos]
    batch = BatchGenerator(model, 2, 128)
    first = batch.add(short, _params(model, len(short) + 24), ignore_eos=True)
    with pytest.raises(InvalidInputError, match="prefill chunk must be an integer >= 1, got 0"):
        batch.add(long, _params(model, len(long) + 8), chunk=0)
    assert list(batch.rows) == [first]
    second = batch.add(long, _params(model, len(long) + 8), chunk=1)
    assert (first, second) == (0, 1)
    with pytest.raises(InvalidInputError, match="prefill chunk must be an integer >= 1, got 0"):
        batch.prefill_step(0)
    calls = 0
    while batch.prefilling(second):
        assert not batch.is_done(second) and not batch.ended_by_eos(second)
        assert batch.bucket() == 1
        assert set(batch.step()) == {first}
        done = batch.prefill_step(1)
        calls += 1
        assert done == (None if batch.prefilling(second) else second)
    assert calls == len(long) - 1  # add fed the first token
    while not all(batch.is_done(r) for r in batch.rows):
        batch.step()
    assert batch.sequence(first) == _alone(model, short, 24, ignore_eos=True)
    ref = generate(model, long, 8)
    assert batch.sequence(second) == ref.tokens
    assert batch.ended_by_eos(second) == (ref.stop_reason == "eos")


def test_step_pieces_and_the_whole_step_graph_take_turns(model):
    """With graphs of at most 2 rows, 3 rows run as two pieces (rows 0-1, row 2) and, once
    row 2 leaves, 2 rows as one graph; a new prompt in row 2 brings the pieces back. The
    rows 0-1 graph is the same one both ways: two captures in all, never an invalidation,
    and every row equals its prompt generated alone."""
    texts = ["def fib(n):", "import os\n", "class Foo:", "x = ["]
    ids = [model.tokenizer.encode(t) for t in texts]
    news = [20, 20, 3, 4]
    batch = BatchGenerator(model, 3, 128, max_graph_rows=2)
    before = _primary_counts(batch)

    def add(k: int) -> int:
        return batch.add(ids[k], _params(model, len(ids[k]) + news[k]), ignore_eos=True)

    rows = [add(0), add(1), add(2)]
    sizes = []

    def step() -> None:
        sizes.append(batch.bucket())
        batch.step()

    while not batch.is_done(rows[2]):
        step()
    finished = {2: batch.sequence(rows[2])}
    batch.remove(rows[2])
    step()
    step()
    assert add(3) == rows[2]
    while not all(batch.is_done(r) for r in batch.rows):
        step()
    finished |= {k: batch.sequence(rows[k]) for k in (0, 1)} | {3: batch.sequence(rows[2])}
    assert sizes[0] == 3 and 2 in sizes and sizes[-1] == 3  # pieces, whole, pieces
    after = _primary_counts(batch)
    for k, tokens in finished.items():
        assert tokens == _alone(model, ids[k], news[k], ignore_eos=True), texts[k]
    assert after["captures"] - before["captures"] == 2
    assert after["invalidations"] == before["invalidations"]
    assert after["fallbacks"] == before["fallbacks"]


def _primary_counts(batch: BatchGenerator) -> dict[str, int]:
    """Slot PRIMARY's counters on the batch's session (zeros before its first capture)."""
    stats = batch.graph_stats().get("primary", {})
    return {key: stats.get(key, 0) for key in ("captures", "invalidations", "fallbacks")}


@pytest.fixture(scope="module")
def eos_dir(qwen2_dir, tmp_path_factory) -> Path:
    """The builder fixture with end-of-sequence id ``EOS`` and pad id 7."""
    return _with_config(
        qwen2_dir, tmp_path_factory.mktemp("eos") / "m", eos_token_id=EOS, pad_token_id=7
    )


def _og_steps(folder: Path, prompts: list[list[int]], max_length: int) -> tuple[list, list]:
    """onnxruntime-genai's get_next_tokens after each step of a batch (prompts of one
    length), and its sequences."""
    og = pytest.importorskip("onnxruntime_genai")
    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=max_length, batch_size=len(prompts))
    gen = og.Generator(model, params)
    assert not gen.is_done()
    gen.append_tokens(np.array(prompts, np.int32))
    steps = []
    while not gen.is_done():
        gen.generate_next_token()
        steps.append([int(t) for t in gen.get_next_tokens()])
    return steps, [[int(t) for t in gen.get_sequence(i)] for i in range(len(prompts))]


def _our_steps(model: Model, prompts: list[list[int]], max_length: int) -> tuple[list, list]:
    params = _params(model, max_length, batch_size=len(prompts))
    steps = []
    with Generator(model, params) as gen:
        assert isinstance(gen, SequencesGenerator) and not gen.is_done()
        gen.append_tokens(prompts)
        while not gen.is_done():
            gen.generate_next_token()
            steps.append(gen.get_next_tokens())
        with pytest.raises(InvalidInputError, match="generation is done"):
            gen.generate_next_token()
    assert gen.is_done()  # closed
    return steps, [gen.get_sequence(i) for i in range(len(prompts))]


@pytest.mark.parametrize("max_length", [4, 12])
def test_sequences_end_and_pad_like_onnxruntime_genai(eos_dir, max_length):
    """Batched Generator calls against onnxruntime-genai on one folder: the same tokens per
    step, the pad id (genai_config's) for a sequence ended by end of sequence, and the same
    number of steps (one when the prompts leave room for one token)."""
    ours, sequences = _our_steps(Model(eos_dir), PROMPTS, max_length)
    steps, og_sequences = _og_steps(eos_dir, PROMPTS, max_length)
    assert ours == steps
    if max_length == 12:
        assert 7 in [s[0] for s in steps] and EOS in [s[0] for s in steps]
    for mine, theirs in zip(sequences, og_sequences, strict=True):
        # onnxruntime-genai pads an ended sequence to max_length; ours ends at its eos
        assert theirs[: len(mine)] == mine and set(theirs[len(mine) :]) <= {7}


def test_a_batch_row_ends_at_end_of_sequence(eos_dir):
    """The row that reaches ``EOS`` stops there and reads as ended; the other goes on to
    max_length; each equals its prompt generated alone."""
    model = Model(eos_dir)
    batch = BatchGenerator(model, 2, 64)
    rows = [batch.add(p, _params(model, len(p) + 9)) for p in PROMPTS]
    while not all(batch.is_done(r) for r in rows):
        batch.step()
    refs = [generate(model, p, 9) for p in PROMPTS]
    assert [r.stop_reason for r in refs] == ["eos", "max_new_tokens"]
    for row, ref in zip(rows, refs, strict=True):
        assert batch.sequence(row) == ref.tokens
        assert batch.ended_by_eos(row) == (ref.stop_reason == "eos")


def test_pad_id_without_one_in_the_config(qwen2_dir, tmp_path):
    """With neither pad_token_id nor eos_token_id, an ended sequence is padded with 0
    (onnxruntime-genai's default pad id); here the longer prompt reaches max_length first."""
    folder = _with_config(qwen2_dir, tmp_path / "m", eos_token_id=None, pad_token_id=None)
    model = Model(folder)
    assert model.config.eos_token_ids == () and model.config.pad_token_id is None
    steps, sequences = _our_steps(model, [[5, 17, 99], [3, 8]], 6)
    assert [s[0] for s in steps] == [*sequences[0][3:], 0]
    assert [s[1] for s in steps] == sequences[1][2:]


def test_sequence_index_bounds(model):
    params = _params(model, 16, batch_size=2)
    with Generator(model, params) as gen:
        gen.append_tokens([[1, 2, 3], [4, 5]])
        assert gen.get_sequence(1) == [4, 5]
        for bad in (-1, 2):
            with pytest.raises(InvalidInputError, match=f"sequence index must be .*got {bad}"):
                gen.get_sequence(bad)


def _logits_for_every_row(graph: onnx.GraphProto) -> None:
    """Logits as ``raw + raw * 0``: not row by row, so a prefill computes every prompt row."""
    lm_head = next(n for n in graph.node if "logits" in n.output)
    lm_head.output[0] = "raw_logits"
    graph.initializer.append(onnx.helper.make_tensor("zero", onnx.TensorProto.FLOAT, [], [0.0]))
    graph.node.extend(
        [
            onnx.helper.make_node("Mul", ["raw_logits", "zero"], ["no_logits"]),
            onnx.helper.make_node("Add", ["raw_logits", "no_logits"], ["logits"]),
        ]
    )


def test_rows_of_a_model_whose_prefill_computes_every_row(qwen2_dir, tmp_path):
    """A prefill that returns every prompt row's argmax and logits: the first token comes
    from the last row, greedy and with a repetition penalty (the logits path), as
    onnxruntime-genai generates each prompt alone on the same folder."""
    folder = _edited_copy(qwen2_dir, tmp_path / "m", _logits_for_every_row)
    model = Model(folder)
    batch = BatchGenerator(model, 2, 64)
    assert not batch.runner.prefill_last_row
    options = [{}, {"repetition_penalty": 1.5}]
    rows = [
        batch.add(p, _params(model, len(p) + 8, **o), ignore_eos=True)
        for p, o in zip(PROMPTS, options, strict=True)
    ]
    while not all(batch.is_done(r) for r in rows):
        batch.step()
    for row, prompt, opts in zip(rows, PROMPTS, options, strict=True):
        assert batch.sequence(row) == _onnxruntime_genai(folder, prompt, 8, **opts), opts


@pytest.mark.parametrize("look_ahead", [False, True], ids=["plain", "look-ahead"])
@pytest.mark.parametrize("graph_rows", [64, 1], ids=["one-graph", "one-row-pieces"])
def test_min_length_reads_only_the_masked_rows_logits(eos_dir, monkeypatch, graph_rows, look_ahead):
    """Greedy rows with a min_length take the device argmax; only a row whose argmax is end
    of sequence before its min_length reads its logits (its own row, from the right piece),
    and each row still equals its prompt generated alone with that min_length. With
    look-ahead, the step whose masked pick needs the logits the queued step overwrote runs
    again (one graph of rows; pieces never look ahead)."""
    from onnx_genrt.engine.decoder import DecoderRunner

    model = Model(eos_dir)
    wide, row_reads = [], []
    launch_rows, row_logits = DecoderRunner.launch_rows, DecoderRunner.row_logits

    def spy_step(self, tokens, lengths, slot, read_logits=False, **kwargs):
        wide.append(read_logits)
        return launch_rows(self, tokens, lengths, slot, read_logits, **kwargs)

    def spy_row(self, rows, row):
        row_reads.append((rows, row))
        return row_logits(self, rows, row)

    monkeypatch.setattr(DecoderRunner, "launch_rows", spy_step)
    monkeypatch.setattr(DecoderRunner, "row_logits", spy_row)
    prompts = [PROMPTS[1], PROMPTS[0]]  # the prompt that meets EOS in row 1
    batch = BatchGenerator(model, 2, 64, max_graph_rows=graph_rows)
    batch.look_ahead = look_ahead
    rows = [batch.add(p, _params(model, len(p) + 9, min_length=len(p) + 6)) for p in prompts]
    while not all(batch.is_done(r) for r in rows):
        batch.step()
    assert (batch.steps_ahead > 0) == (look_ahead and graph_rows > 1), batch.steps_ahead
    assert wide and not any(wide)
    assert row_reads and {r for _, r in row_reads} == ({1} if graph_rows > 1 else {0})
    for row, prompt in zip(rows, prompts, strict=True):
        ref = generate(model, prompt, 9, min_length=len(prompt) + 6)
        assert batch.sequence(row) == ref.tokens
    assert generate(model, prompts[1], 9).stop_reason == "eos"  # without min_length: EOS


def test_a_prompt_that_fails_its_prefill_leaves_its_row_free(qwen2_dir, tmp_path):
    """``add`` whose prefill raises (a NaN embedding row in the prompt) frees the row it
    took: the next prompt takes that row and decodes as onnxruntime-genai does, with no
    prefilling row left behind."""
    from onnx_genrt.core.errors import NonFiniteError

    from ..llm_fixtures import nan_token_copy

    bad = 42
    folder = nan_token_copy(qwen2_dir, tmp_path / "nan", bad)
    model = Model(folder)
    batch = BatchGenerator(model, 2, 32)
    with pytest.raises(NonFiniteError):
        batch.add([5, bad, 7], _params(model, 12))
    assert batch.free_rows() == 2 and not batch.rows
    prompt = PROMPTS[1]
    assert bad not in prompt
    row = batch.add(prompt, _params(model, 12), ignore_eos=True)
    while not batch.is_done(row):
        batch.step()
    assert row == 0
    assert batch.sequence(row) == _onnxruntime_genai(folder, prompt, 12 - len(prompt))


def test_a_pick_other_than_the_argmax_drops_the_queued_step(model, monkeypatch):
    """The step queued ahead was fed each row's device argmax: when a row's pick is another
    token, the queued step is not used and the rows equal the run without look-ahead."""
    vocab = model.config.vocab_size
    pick = BatchGenerator._pick

    def departing(row, argmax, logits):
        token = pick(row, argmax, logits)
        return (token + 1) % vocab if len(row.tokens) in (6, 9) else token

    monkeypatch.setattr(BatchGenerator, "_pick", staticmethod(departing))
    runs = {}
    for look_ahead in (False, True):
        batch = BatchGenerator(model, 2, 32)
        batch.look_ahead = look_ahead
        rows = [batch.add(p, _params(model, 16), ignore_eos=True) for p in PROMPTS]
        while not all(batch.is_done(r) for r in rows):
            batch.step()
        runs[look_ahead] = [batch.sequence(r) for r in rows]
        assert (batch.steps_ahead > 0) == look_ahead
    assert runs[True] == runs[False]
