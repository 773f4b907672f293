"""Speculative decoding: token-identical to greedy, both slots replaying, sampling exact."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats as scipy_stats

from onnx_genrt.engine import (
    DraftModelProposer,
    Generator,
    GeneratorParams,
    Model,
    MTPProposer,
    PromptLookupProposer,
    SpeculativeGenerator,
)
from onnx_genrt.engine.config import SearchOptions
from onnx_genrt.session import load_model

PROMPTS = [
    [5, 17, 99, 3, 250, 7, 5, 17, 99],
    [1, 2, 3, 4, 1, 2, 3, 4, 1, 2],
    [300, 12],
    [42, 7, 42, 7, 42],
    [9, 8, 7, 6, 5, 4, 3, 2, 1],
    [100, 200, 300, 400, 500, 100, 200],
]


def _run(gen, prompt):
    gen.eos = set()
    gen.append_tokens(prompt)
    while not gen.is_done():
        gen.generate_next_token()
    return gen.get_sequence()


def _mtp(model: Model) -> MTPProposer:
    head = load_model(model.folder / "mtp" / "model.onnx")
    return MTPProposer(head, model.session_from_proto)


def _params(model, prompt, new=48, **search):
    params = GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + new, **search)
    return params


def _proposer(kind: str, folder, max_length: int):
    if kind == "ngram":
        return PromptLookupProposer()
    if kind == "mtp":
        return _mtp(Model(folder))
    if kind == "draft":
        return DraftModelProposer(Model(folder / "draft"), max_length)
    if kind == "self-draft":  # the target as its own draft: every draft is accepted
        return DraftModelProposer(Model(folder), max_length)
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["ngram", "mtp", "draft", "self-draft"])
@pytest.mark.parametrize("k", [1, 4])
def test_speculative_output_is_token_identical_to_greedy(qwen2_dir, kind, k):
    model = Model(qwen2_dir)
    for prompt in PROMPTS:
        greedy = _run(Generator(model, _params(model, prompt)), prompt)
        params = _params(model, prompt)
        spec = SpeculativeGenerator(
            model, params, _proposer(kind, qwen2_dir, params.search.max_length), k=k
        )
        assert _run(spec, prompt) == greedy, (kind, prompt)
    if kind == "self-draft":
        assert spec.spec.acceptance_rate == 1.0
        assert spec.spec.verify_steps < 48 / k + 2


@pytest.mark.parametrize("kind", ["ngram", "draft"])
def test_pipelining_asked_of_proposers_without_a_device_chain_equals_greedy(
    qwen2_dir, kind, monkeypatch
):
    """A GPU pipelines verify steps by default; n-gram and draft-model proposers have no
    device chain, so nothing is queued and the text stays greedy (found by a mutation run:
    ``chain_hook is not None and`` -> ``or`` went unnoticed on the CPU)."""
    monkeypatch.setattr(SpeculativeGenerator, "pipeline", True)
    model = Model(qwen2_dir)
    for prompt in PROMPTS[:3]:
        greedy = _run(Generator(model, _params(model, prompt)), prompt)
        params = _params(model, prompt)
        proposer = _proposer(kind, qwen2_dir, params.search.max_length)
        spec = SpeculativeGenerator(model, params, proposer, k=3)
        assert _run(spec, prompt) == greedy, (kind, prompt)
        assert spec.spec.verify_steps > 0


@pytest.mark.parametrize("kind", ["ngram", "mtp"])
def test_speculation_with_a_repetition_penalty_equals_greedy(qwen2_dir, kind):
    """Greedy with a repetition penalty accepts drafts on the host from penalised logits;
    the text equals plain greedy with the same penalty (found by a mutation run: accepting
    every draft there went unnoticed)."""
    model = Model(qwen2_dir)
    proposed = 0
    for prompt in PROMPTS:
        greedy = _run(Generator(model, _params(model, prompt, repetition_penalty=1.3)), prompt)
        params = _params(model, prompt, repetition_penalty=1.3)
        proposer = _proposer(kind, qwen2_dir, params.search.max_length)
        spec = SpeculativeGenerator(model, params, proposer, k=3)
        assert _run(spec, prompt) == greedy, (kind, prompt)
        proposed += spec.spec.proposed
    assert proposed > 0  # drafts were checked on the host


def test_both_slots_replay_over_256_tokens_with_bounded_invalidations(qwen2_dir):
    model = Model(qwen2_dir)
    prompt = [5, 17, 99, 3, 250, 7, 5, 17, 99, 3]
    params = _params(model, prompt, new=256)
    spec = SpeculativeGenerator(model, params, PromptLookupProposer(), k=4)
    _run(spec, prompt)
    stats = spec.graph_stats()
    assert spec.spec.verify_steps > 0 and spec.spec.plain_steps > 0
    for slot in ("primary", "verify"):
        assert stats[slot]["replays"] > 0, stats
        assert stats[slot]["invalidations"] == 0, stats
        assert stats[slot]["fallbacks"] == 0, stats
        assert stats[slot]["captures"] == 1, stats


def test_mtp_head_runs_graphed_in_its_own_slot(qwen2_dir):
    """Greedy MTP: after the first proposal the chain runs on the verify step's outputs
    (graphed in DRAFT on the target's provider), so drafts come back with the verify."""
    model = Model(qwen2_dir)
    prompt = PROMPTS[0]
    params = _params(model, prompt, new=64)
    proposer = _mtp(model)
    calls = []
    standalone = proposer.propose
    proposer.propose = lambda *a: calls.append(1) or standalone(*a)
    spec = SpeculativeGenerator(model, params, proposer, k=3)
    greedy = _run(Generator(model, _params(model, prompt, new=64)), prompt)
    assert _run(spec, prompt) == greedy
    after = proposer.graph_stats()["draft(after verify)"]
    assert after["replays"] > 0 and after["invalidations"] == 0 and after["fallbacks"] == 0
    assert after["replays"] >= spec.spec.verify_steps - 3
    assert len(calls) <= 1 + spec.spec.plain_steps  # the first proposal and plain steps only


def test_rejected_drafts_are_rewound_not_kept(qwen2_dir):
    """A proposer that is always wrong: every step rejects, and the text stays greedy."""

    class Wrong(PromptLookupProposer):
        def propose(self, tokens, hidden, k):
            return [(tokens[-1] + 1 + i) % 512 for i in range(k)]

    model = Model(qwen2_dir)
    prompt = PROMPTS[2]
    greedy = _run(Generator(model, _params(model, prompt)), prompt)
    spec = SpeculativeGenerator(model, _params(model, prompt), Wrong(), k=4)
    assert _run(spec, prompt) == greedy
    assert spec.spec.verify_steps > 0


@pytest.mark.parametrize("k", [1, 3])
def test_speculation_stats_account_for_every_token_and_draft(qwen2_dir, k):
    """Counts checked against the run itself: each token after the prompt comes from the
    first step, a plain step, or a verify step (its accepted drafts plus one); ``proposed``
    is what the proposer returned (found by a mutation run: the counters' start values and
    the rate's formula were unchecked)."""
    returned: list[int] = []

    class Counting(PromptLookupProposer):
        def propose(self, tokens, hidden, k):
            drafts = super().propose(tokens, hidden, k)
            returned.append(len(drafts[:k]))
            return drafts

    model = Model(qwen2_dir)
    accepted = 0
    for prompt in PROMPTS:
        returned.clear()
        params = _params(model, prompt, new=40)
        spec = SpeculativeGenerator(model, params, Counting(), k=k)
        out = _run(spec, prompt)
        stats = spec.spec
        new_tokens = len(out) - len(prompt)
        assert new_tokens == 1 + stats.plain_steps + stats.verify_steps + stats.accepted
        assert stats.accepted == sum(stats.accepted_lengths)
        assert len(stats.accepted_lengths) == stats.verify_steps
        assert stats.proposed == sum(returned)
        # A plain step follows an empty proposal, or ends the run when no draft fits.
        assert returned.count(0) <= stats.plain_steps <= returned.count(0) + 1
        assert all(0 <= n <= k for n in stats.accepted_lengths)
        rate = stats.accepted / stats.proposed if stats.proposed else 0.0
        summary = stats.as_dict()
        assert summary["verify_steps"] == stats.verify_steps
        assert summary["plain_steps"] == stats.plain_steps
        assert summary["proposed"] == stats.proposed and summary["accepted"] == stats.accepted
        assert summary["acceptance_rate"] == pytest.approx(rate, abs=1e-4)
        mean = float(np.mean(stats.accepted_lengths)) if stats.accepted_lengths else 0.0
        assert summary["mean_accepted_length"] == pytest.approx(mean, abs=1e-3)
        accepted += stats.accepted
    assert accepted > 0  # some n-gram drafts were right, so the counts were exercised


def test_stepping_before_a_prompt_is_refused(qwen2_dir):
    """No prompt yet: a clear error, from plain and speculative generators alike (found by a
    mutation run: removing the speculative check went unnoticed)."""
    from onnx_genrt.core.errors import InvalidInputError

    model = Model(qwen2_dir)
    for gen in (
        Generator(model, _params(model, [1])),
        SpeculativeGenerator(model, _params(model, [1]), PromptLookupProposer(), k=2),
    ):
        with gen, pytest.raises(InvalidInputError, match="append_tokens first"):
            gen.generate_next_token()


def test_rejection_rule_preserves_the_target_distribution():
    """Accept a fixed draft with prob p(d), else resample from p without d: the emitted
    token must follow p exactly. Chi-square over 40k draws."""
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(12).astype(np.float32) * 2
    options = SearchOptions(do_sample=True, temperature=0.8, top_k=0, top_p=1.0)

    from onnx_genrt.engine.sampling import distribution
    from onnx_genrt.engine.speculative import accept_draft

    draw = np.random.default_rng(1)

    p = distribution(logits, options)
    draft = int(np.argsort(p)[len(p) // 2])  # a middling draft: accepted sometimes
    counts = np.zeros(p.size)
    accepted = 0
    for _ in range(40_000):
        token, ok = accept_draft(logits, draft, options, draw)
        counts[token] += 1
        accepted += ok
        assert not ok or token == draft
    expected = p * counts.sum()
    chi2, pvalue = scipy_stats.chisquare(counts, expected)
    assert pvalue > 1e-3, (chi2, pvalue)
    # The draft is accepted with probability p(draft), so speculation saves steps (a rule
    # that always resampled would keep the distribution too: found by a mutation run).
    assert scipy_stats.binomtest(accepted, 40_000, p[draft]).pvalue > 1e-3


def test_sampled_speculation_is_seeded_and_valid(qwen2_dir):
    model = Model(qwen2_dir)
    prompt = PROMPTS[1]
    outs = []
    for _ in range(2):
        params = _params(model, prompt, new=32, do_sample=True, temperature=0.9, top_k=50, seed=7)
        spec = SpeculativeGenerator(model, params, PromptLookupProposer(), k=3)
        outs.append(_run(spec, prompt))
    assert outs[0] == outs[1]
    assert len(outs[0]) == len(prompt) + 32


@pytest.mark.parametrize("k", [1, 3])
def test_unrolled_mtp_chain_equals_running_the_head_k_times(qwen2_dir, k):
    """The chain graph, run by onnxruntime, against the head run k times by onnxruntime."""
    import onnxruntime as ort

    from onnx_genrt.engine.mtp_chain import unroll_mtp_head

    head = load_model(qwen2_dir / "mtp" / "model.onnx")
    chain = ort.InferenceSession(unroll_mtp_head(head, k).SerializeToString())
    single = ort.InferenceSession(head.SerializeToString())
    rng = np.random.default_rng(k)
    hidden = rng.standard_normal((1, 1, 64)).astype(np.float32)
    token = np.array([[17]], np.int64)
    drafts, confs = chain.run(None, {"hidden_states": hidden, "input_ids": token})
    for i in range(k):
        logits, hidden = single.run(None, {"hidden_states": hidden, "input_ids": token})
        p = np.exp(logits[0, 0].astype(np.float64) - logits[0, 0].max())
        p /= p.sum()
        token = np.array([[int(np.argmax(logits[0, 0]))]], np.int64)
        assert drafts[0, i] == token[0, 0]
        np.testing.assert_allclose(confs[0, i], p.max(), rtol=1e-5)


def test_draft_model_graphs_survive_generation_ends_and_reuse(qwen2_dir):
    """Near max_length fewer drafts fit; the draft model still catches up at one width, so its
    VERIFY graph is captured once across generations (no new binding, no recapture)."""
    from onnx_genrt.engine import generate

    model = Model(qwen2_dir)
    for prompt in PROMPTS[:3]:
        res = generate(model, prompt, max_new_tokens=40, spec="draft", k=4, ignore_eos=True)
    for slot, stats in res.graph_stats["proposer"].items():
        assert stats["captures"] == 1 and stats["invalidations"] == 0, (slot, stats)
    for slot, stats in res.graph_stats["target"].items():
        assert stats["captures"] == 1 and stats["invalidations"] == 0, (slot, stats)


def test_drafts_per_step_come_from_the_call_then_speculative_json_then_four():
    """The embedded model's speculative.json asks for k=3 MTP drafts; a call's k wins; other
    kinds (and models without a k) get 4; a bad k names the file."""
    import copy
    import dataclasses

    from onnx_genrt.core.errors import ModelLoadError
    from onnx_genrt.engine.api import default_k, generate
    from onnx_genrt.generate_cli import default_model_dir

    model = Model(default_model_dir(), ["cpu"])
    assert default_k(model, "mtp") == 3 and default_k(model, "mtp", 2) == 2
    assert default_k(model, "ngram") == 4 and default_k(model, "draft") == 4
    res = generate(model, "def f(x):", max_new_tokens=12, spec="mtp", ignore_eos=True)
    assert res.speculation["k"] == 3
    speculative = copy.deepcopy(model.config.speculative)
    speculative["mtp"]["k"] = 0
    model.config = dataclasses.replace(model.config, speculative=speculative)
    with pytest.raises(ModelLoadError, match=r"speculative\.json: mtp\.k"):
        default_k(model, "mtp")
