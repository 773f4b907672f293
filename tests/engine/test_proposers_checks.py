"""Proposers' defaults, refusals and edges: prompt lookup against a brute-force n-gram search,
the MTP proposer's errors, chain hooks and graph labels, the draft model near its cache end."""

from __future__ import annotations

import numpy as np
import pytest

from onnx_genrt.core.errors import InvalidInputError, ModelLoadError
from onnx_genrt.engine.proposers import MTPProposer, PromptLookupProposer
from onnx_genrt.session import InferenceSession


def _lookup(tokens: list[int], k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Brute force: the longest suffix (max_ngram down to min_ngram) seen earlier; continue
    its latest earlier occurrence by up to k tokens."""
    last = len(tokens)
    for n in range(max_ngram, min_ngram - 1, -1):
        if n > last - 1:
            continue
        suffix = tokens[last - n :]
        for start in range(last - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                follow = tokens[start + n : start + n + k]
                if follow:
                    return follow
                break
    return []


def test_prompt_lookup_defaults_match_a_brute_force_search():
    """The default proposer (3-grams down to 1-grams) drafts what the brute-force search
    finds, on random texts over a small alphabet (where 4-, 3- and 2-gram matches differ)."""
    rng = np.random.default_rng(0)
    proposer = PromptLookupProposer()
    differs = {2: 0, 4: 0}
    for _ in range(300):
        tokens = rng.integers(0, 3, int(rng.integers(2, 30))).tolist()
        k = int(rng.integers(1, 6))
        want = _lookup(tokens, k, 3, 1)
        assert proposer.propose(tokens, None, k) == want
        for other in differs:
            differs[other] += _lookup(tokens, k, other, 1) != want
    assert all(differs.values()), "the texts tell the default 3 from 2 and 4"


def test_prompt_lookup_of_a_growing_text_matches_a_brute_force_search():
    """As a generation calls it: the text grows a few tokens at a time (its index extended),
    and is sometimes cut back or rewritten (indexed again), as a list or an array."""
    rng = np.random.default_rng(1)
    proposer = PromptLookupProposer()
    tokens = rng.integers(0, 4, 3).tolist()
    rebuilt = 0
    for _ in range(600):
        if rng.random() < 0.05 and len(tokens) > 2:  # a rewind
            tokens = tokens[: int(rng.integers(1, len(tokens)))]
            rebuilt += 1
        elif rng.random() < 0.03:  # the same length, another token inside
            tokens[int(rng.integers(0, len(tokens)))] = 9
            rebuilt += 1
        k = int(rng.integers(1, 6))
        given = np.array(tokens) if rng.random() < 0.2 else list(tokens)
        assert proposer.propose(given, None, k) == _lookup(tokens, k, 3, 1)
        tokens += rng.integers(0, 4, int(rng.integers(1, 4))).tolist()
        if len(tokens) > 200:
            tokens = tokens[:20]
    assert rebuilt > 10


def _tiny_head():
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [
            helper.make_node("Gather", ["embed", "input_ids"], ["emb"]),
            helper.make_node("Add", ["hidden_states", "emb"], ["mtp_hidden_states"]),
            helper.make_node("MatMul", ["mtp_hidden_states", "lm_head"], ["logits"]),
        ],
        "tiny_mtp",
        [
            helper.make_tensor_value_info("hidden_states", TensorProto.FLOAT, [1, 1, 4]),
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, 1]),
        ],
        [
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 1, 6]),
            helper.make_tensor_value_info("mtp_hidden_states", TensorProto.FLOAT, [1, 1, 4]),
        ],
        [
            numpy_helper.from_array(rng.standard_normal((6, 4)).astype(np.float32), "embed"),
            numpy_helper.from_array(rng.standard_normal((4, 6)).astype(np.float32), "lm_head"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def test_mtp_proposer_refuses_a_missing_hidden_state_and_a_device_fed_step_without_next():
    proposer = MTPProposer(_tiny_head(), InferenceSession)
    with pytest.raises(ModelLoadError, match="needs the target model's hidden states"):
        proposer.propose([1, 2], None, 2)
    with pytest.raises(InvalidInputError, match="fed on the device needs the chain's next"):
        proposer.chain_hook(None, 2, None, None, next_inputs=False)


@pytest.mark.parametrize("k", [1, 3])
def test_draft_model_drafts_its_greedy_tokens_up_to_its_cache_length_exactly(qwen2_dir, k):
    """k drafts that end exactly at the draft runner's cache length are proposed, and they
    are the draft model's own greedy continuation (a plain Generator); with one token more
    in the text they would not fit: none then."""
    from onnx_genrt.engine import DraftModelProposer, Generator, GeneratorParams, Model

    draft = Model(qwen2_dir / "draft")
    proposer = DraftModelProposer(draft, 8)
    length = proposer.runner.max_length  # the pooled cache: at least 256 positions
    prompt = np.random.default_rng(k).integers(0, 250, length - k).tolist()
    params = GeneratorParams(draft)
    params.set_search_options(max_length=length)
    greedy = Generator(draft, params)
    greedy.eos = set()
    greedy.append_tokens(prompt)
    while not greedy.is_done():
        greedy.generate_next_token()
    want = list(greedy.get_sequence())[len(prompt) :]
    assert len(want) == k
    try:
        assert proposer.propose(prompt, None, k) == want
        assert proposer.propose([*prompt, want[0]], None, k) == []
    finally:
        proposer.close()


def test_draft_model_feeds_only_the_tokens_accepted_since_its_last_call(qwen2_dir):
    """After a first proposal, the next call keeps the common prefix in the draft cache and
    feeds only the new tokens; its drafts still equal a fresh proposer's."""
    from onnx_genrt.engine import DraftModelProposer, Model

    draft = Model(qwen2_dir / "draft")
    prompt, k = [5, 17, 99, 3, 250, 7], 3
    proposer = DraftModelProposer(draft, 64)
    fed: list[list[int]] = []
    forward = proposer.runner.forward

    def recording(tokens, *args, **kwargs):
        fed.append(list(tokens))
        return forward(tokens, *args, **kwargs)

    proposer.runner.forward = recording
    try:
        first = proposer.propose(prompt, None, k)
        assert len(fed) == 1 + (k - 1)  # the prompt, then one step per further draft
        fed.clear()
        text = [*prompt, first[0], 42]  # one draft accepted, then a correction
        second = proposer.propose(text, None, k)
        assert fed[0] == [42]  # the accepted draft is in the cache already
        again = proposer.propose(text, None, k)  # the same text: its drafts are in the cache
        once = proposer.propose([*text, 7], None, 1)
        fed.clear()
        assert proposer.propose([*text, 7], None, 1) == once and fed == []  # logits kept
    finally:
        proposer.close()
    for got in (second, again):
        fresh = DraftModelProposer(draft, 64)
        try:
            assert got == fresh.propose(text, None, k)
        finally:
            fresh.close()


def test_mtp_confident_keeps_drafts_up_to_the_first_below_min_confidence():
    """Drafts at exactly ``min_confidence`` are kept (as MTPNextInputs counts them,
    confidence >= min_confidence); the first below it ends the list."""
    rng = np.random.default_rng(0)
    for _ in range(50):
        threshold = float(np.float32(rng.uniform(0.2, 0.8)))
        confs = rng.choice([threshold, threshold / 2, min(1.0, threshold * 1.2)], 4)
        confs = confs.astype(np.float32)
        drafts = rng.integers(0, 100, 4)
        proposer = MTPProposer(_tiny_head(), InferenceSession, min_confidence=threshold)
        want = []
        for token, p in zip(drafts.tolist(), confs.tolist(), strict=True):
            if not p >= threshold:
                break
            want.append(token)
        assert proposer.confident(drafts, confs) == want


def test_a_host_fed_chain_hook_needs_its_start(qwen2_dir):
    from onnx_genrt.engine import Model
    from onnx_genrt.session import load_model

    model = Model(qwen2_dir)
    head = load_model(qwen2_dir / "mtp" / "model.onnx")
    proposer = MTPProposer(head, model.session_from_proto)
    owner = proposer  # any object the pool can hold weakly
    runner = model.acquire_runner(owner, 64)
    try:
        with pytest.raises(InvalidInputError, match="host-fed verify step needs its start"):
            proposer.chain_hook(runner, 2, 1, None, next_inputs=False)
    finally:
        model.release_runner(owner)


def test_mtp_proposer_drafts_from_the_pending_token_as_a_float64_chain():
    """``propose`` feeds the head the hidden row and the pending (last) token; its drafts
    equal the head's chain computed in float64."""
    import onnx.numpy_helper as nh

    head = _tiny_head()
    w = {i.name: nh.to_array(i).astype(np.float64) for i in head.graph.initializer}
    proposer = MTPProposer(head, InferenceSession)
    rng = np.random.default_rng(0)
    for _ in range(10):
        hidden = rng.standard_normal((1, 1, 4)).astype(np.float32)
        tokens = rng.integers(0, 6, 3).tolist()
        h, token, want = hidden.reshape(-1).astype(np.float64), tokens[-1], []
        for _step in range(3):
            h = h + w["embed"][token]
            token = int(np.argmax(h @ w["lm_head"]))
            want.append(token)
        assert proposer.propose(tokens, hidden, 3) == want


def test_mtp_graph_stats_name_each_chain_by_its_k_once_there_are_two():
    """One chain's slot keeps its plain name; once a longer chain exists each is labelled
    with its k. Each label's runs (eager, captured, replayed) are that chain's proposals."""
    proposer = MTPProposer(_tiny_head(), InferenceSession)
    hidden = np.zeros((1, 1, 4), np.float32)

    def runs(stats: dict) -> int:
        return stats["eager_runs"] + stats["captures"] + stats["replays"]

    for _ in range(3):
        proposer.propose([1, 2], hidden, 2)
    stats = proposer.graph_stats()
    assert list(stats) == ["draft"] and runs(stats["draft"]) == 3
    proposer.propose([1, 2], hidden, 3)  # longer than the chain built: a second chain
    stats = proposer.graph_stats()
    assert sorted(stats) == ["draft(k=2)", "draft(k=3)"]
    assert (runs(stats["draft(k=2)"]), runs(stats["draft(k=3)"])) == (3, 1)


def test_no_chain_hook_for_a_runner_without_a_device_argmax(qwen2_dir):
    """A verify step whose runner has no argmax output (a session without the decode heads)
    gets no chain hook: the drafts then come from the host. A runner with it gets one."""
    from onnx_genrt.engine import Model
    from onnx_genrt.engine.decoder import DecoderRunner
    from onnx_genrt.session import load_model

    model = Model(qwen2_dir)
    head = load_model(qwen2_dir / "mtp" / "model.onnx")
    plain = InferenceSession(load_model(model.config.model_path, folder=model.folder))
    without = DecoderRunner(plain, model.config, 32)
    with_heads = DecoderRunner(model.session, model.config, 32)
    assert without.step_buffers(3).hidden is not None and without.step_buffers(3).argmax is None
    proposer = MTPProposer(head, model.session_from_proto)
    assert proposer.chain_hook(without, 2, 1, 0, next_inputs=False) is None
    assert callable(proposer.chain_hook(with_heads, 2, 1, 0, next_inputs=False))


def test_draft_model_near_its_cache_end_narrows_a_wider_catch_up(qwen2_dir):
    """A catch-up width kept from a larger k would run past the draft cache's end: there the
    width falls back to the current k + 1, and the drafts still equal the draft model's own
    greedy continuation (a plain Generator)."""
    from onnx_genrt.engine import DraftModelProposer, Generator, GeneratorParams, Model

    draft = Model(qwen2_dir / "draft")

    def greedy(prompt: list[int], max_length: int) -> list[int]:
        params = GeneratorParams(draft)
        params.set_search_options(max_length=max_length)
        with Generator(draft, params) as gen:
            gen.eos = set()
            gen.append_tokens(prompt)
            while not gen.is_done():
                gen.generate_next_token()
            return list(gen.get_sequence())[len(prompt) :]

    proposer = DraftModelProposer(draft, 8)
    length = proposer.runner.max_length
    prompt = np.random.default_rng(5).integers(0, 250, length - 5).tolist()
    try:
        first = proposer.propose(prompt, None, 4)  # catch-up width 5 from now on
        assert first == greedy(prompt, length - 1)
        # Three drafts are in the cache (positions up to length - 3); all four accepted, one
        # more draft asked: width 5 at position length - 2 would pass the end, 2 fits.
        text = [*prompt, *first]
        assert proposer.propose(text, None, 1) == greedy(text, length)
    finally:
        proposer.close()
