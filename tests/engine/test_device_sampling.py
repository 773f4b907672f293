"""Tokens drawn on the device in batched steps (``BatchGenerator.device_sampling``,
``engine/device_sampler.py``) on the CPU provider: each drawn token is
``core.token_sampling``'s rule applied to the logits the model gives for that sequence
teacher-forced in one eager run; a row draws the same tokens in any batch; greedy and
host-sampled rows beside it are unchanged."""

from __future__ import annotations

import numpy as np
import pytest

from onnx_genrt.core.token_sampling import gumbel_scores, sample_tokens
from onnx_genrt.engine import Model
from onnx_genrt.engine.batch import BatchGenerator
from onnx_genrt.engine.model import GeneratorParams
from onnx_genrt.generate_cli import default_model_dir

TEXTS = ["def fib(n):", "import sys", "class A:"]
NEW = 12


@pytest.fixture(scope="module")
def model() -> Model:
    return Model(default_model_dir())


def _params(model: Model, ids: list[int], **search) -> GeneratorParams:
    params = GeneratorParams(model)
    params.set_search_options(max_length=len(ids) + NEW + 1, **search)
    return params


def _run(model: Model, rows: list[tuple[str, dict]], device: bool = True, look_ahead: bool = False):
    batch = BatchGenerator(model, 4, 64)
    batch.device_sampling = device
    batch.look_ahead = look_ahead
    index = []
    for text, search in rows:
        ids = model.tokenizer.encode(text)
        index.append(batch.add(ids, _params(model, ids, **search), ignore_eos=True))
    for _ in range(NEW):
        batch.step()
    return batch, [batch.sequence(i) for i in index]


def _forced_logits(model: Model, seq: list[int]) -> np.ndarray:
    cfg = model.config
    feeds = {
        "input_ids": np.array([seq], np.int64),
        "attention_mask": np.ones((1, len(seq)), np.int64),
    }
    for i in range(cfg.num_layers):
        empty = np.zeros((1, cfg.num_kv_heads, 0, cfg.head_size), np.float32)
        feeds[cfg.io.past_key % i] = empty
        feeds[cfg.io.past_value % i] = empty
    return model.session.run([cfg.io.logits], feeds)[0][0]


HOT = dict(do_sample=True, temperature=1.5, top_k=0, seed=11)


def test_drawn_tokens_follow_the_rule_on_the_teacher_forced_logits(model):
    """Rows of top_k 0 (the whole vocabulary) and 5 (the model's default is 50)."""
    batch, seqs = _run(model, [(TEXTS[0], HOT), (TEXTS[1], {**HOT, "seed": 12, "top_k": 5})])
    assert batch.runner._sampler is not None
    for seq, seed, k in zip(seqs, (11, 12), (0, 5), strict=True):
        logits = _forced_logits(model, seq)
        prompt = len(seq) - NEW
        for pos in range(prompt + 1, len(seq)):  # the first token is the prompt's (host)
            row = logits[pos - 1][None]
            args = (np.float32([1.5]), np.int64([seed]), np.int64([pos]), np.int64([k]))
            if k:
                assert seq[pos] in np.argsort(-row[0])[:k]
            want = int(sample_tokens(row, *args)[0])
            if seq[pos] != want:  # only where two scores tie to float32 rounding
                scores = np.sort(gumbel_scores(row, *args)[0])
                assert scores[-1] - scores[-2] <= 1e-4 * abs(scores[-1]), (pos, seq[pos], want)


def test_a_row_draws_the_same_tokens_in_any_batch(model):
    _, alone = _run(model, [(TEXTS[1], HOT)])
    _, batched = _run(model, [(TEXTS[0], {**HOT, "seed": 5}), (TEXTS[1], HOT),
                              (TEXTS[2], dict(do_sample=False))])  # fmt: skip
    assert batched[1] == alone[0]


def test_steps_queued_ahead_draw_the_same_tokens(model):
    """Where reads are async (a GPU) a step of greedy and device-drawn rows is queued before
    the last one is read back, fed the tokens the device chose and drawing at the next
    offsets: the same tokens as step by step. A host-sampled row (top-p) keeps the batch
    from looking ahead."""
    rows = [(TEXTS[0], dict(do_sample=False)), (TEXTS[1], HOT),
            (TEXTS[2], {**HOT, "top_k": 5, "seed": 4})]  # fmt: skip
    plain = _run(model, rows)[1]
    batch, ahead = _run(model, rows, look_ahead=True)
    assert ahead == plain
    assert batch.steps_ahead == NEW - 1  # every step but the first was queued ahead
    host = (TEXTS[2], dict(do_sample=True, temperature=0.9, top_p=0.8, seed=3))
    batch, ahead = _run(model, [*rows[:2], host], look_ahead=True)
    assert batch.steps_ahead == 0 and ahead == _run(model, [*rows[:2], host])[1]


def test_greedy_and_host_sampled_rows_beside_drawn_ones_are_unchanged(model):
    host = dict(do_sample=True, temperature=0.9, top_p=0.8, seed=3)  # top-p: the host sampler
    greedy = dict(do_sample=False)
    _, plain = _run(model, [(TEXTS[0], greedy), (TEXTS[2], host)], device=False)
    _, mixed = _run(model, [(TEXTS[0], greedy), (TEXTS[2], host), (TEXTS[1], HOT)])
    assert mixed[:2] == plain


def test_the_scheduler_draws_on_the_device_when_asked(model):
    """``Scheduler(device_sampling=True)`` (``onnx-genrt serve --device-sampling``): a
    sampled request gets the tokens the batch draws on the device for it, whatever runs
    beside it; without the option, the host's draws (other tokens for the seed)."""
    from onnx_genrt.engine.scheduler import Scheduler

    _, (want,) = _run(model, [(TEXTS[1], HOT)])
    prompt = model.tokenizer.encode(TEXTS[1])
    got = {}
    for device in (True, False):
        with Scheduler(model, max_batch=4, max_length=64, device_sampling=device) as s:
            other = s.submit(TEXTS[0], max_new_tokens=NEW, ignore_eos=True, **{**HOT, "seed": 2})
            handle = s.submit(prompt, max_new_tokens=NEW + 1, ignore_eos=True, **HOT)
            got[device] = list(handle.result(timeout=60).token_ids)
            other.result(timeout=60)
    assert prompt + got[True] == want
    assert got[False] != got[True]


def test_by_default_rows_draw_on_the_device_only_where_reads_are_async(model, monkeypatch):
    """``device_sampling`` None (the default): the host sampler on the CPU, whose reads are
    synchronous; the device draws where they are asynchronous (a GPU: faster, see
    docs/performance.md), here by telling the CPU's device io its reads are."""
    from onnx_genrt.session.device_io import DeviceIO

    assert BatchGenerator.device_sampling is None
    rows = [(TEXTS[0], HOT)]
    host = _run(model, rows, device=False)[1]
    device = _run(model, rows, device=True)[1]
    assert host != device  # one seed, two samplers
    assert _run(model, rows, device=None)[1] == host
    monkeypatch.setattr(DeviceIO, "reads_async", property(lambda self: True))
    assert _run(model, rows, device=None)[1] == device


@pytest.mark.parametrize(
    "search",
    [HOT, {**HOT, "top_k": 5, "seed": 4}],
    ids=["all", "top-k"],
)
def test_a_single_sequence_draws_what_a_batch_row_draws(model, monkeypatch, search):
    """``Generator.device_sampling``: a seed gives the same tokens through ``generate`` as
    through a batch (or the server) drawing on the device, the host drawing the token after
    the prompt in both; and the host sampler's tokens when off (the default on the CPU)."""
    from onnx_genrt.engine import generate
    from onnx_genrt.engine.generator import Generator

    rows = [(TEXTS[1], search)]
    batch_device = _run(model, rows, device=True)[1][0]
    batch_host = _run(model, rows, device=False)[1][0]
    assert batch_device != batch_host

    def alone() -> list[int]:
        return generate(model, TEXTS[1], NEW + 1, ignore_eos=True, **search).tokens

    assert alone() == batch_host
    monkeypatch.setattr(Generator, "device_sampling", True)
    assert alone() == batch_device
