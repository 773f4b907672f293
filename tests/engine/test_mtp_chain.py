"""The MTP chain run on a verify step's outputs: its acceptance count and its drafts against
a plain reference (a Python count, and the standalone chain fed the selected row)."""

from __future__ import annotations

import numpy as np
import pytest

from onnx_genrt.engine.mtp_chain import (
    ACCEPTED,
    CONFIDENCES,
    DRAFT_COUNT,
    DRAFTS,
    VERIFY_ARGMAX,
    VERIFY_HIDDEN,
    VERIFY_IDS,
    after_verify,
    unroll_mtp_head,
)
from onnx_genrt.generate_cli import default_model_dir
from onnx_genrt.session import InferenceSession, load_model


def _accepted(ids: np.ndarray, argmax: np.ndarray, n: int) -> int:
    count = 0
    while count < n and argmax[count] == ids[count + 1]:
        count += 1
    return count


def _provider(fused: bool):
    """The CPU provider (fused MTPAccept / MTPNextInputs kernels) or one without them
    (their standard-op bodies run)."""
    from tests.models import standard_ops_cpu

    return "cpu" if fused else standard_ops_cpu()


def _genrt_ops(session: InferenceSession) -> set[str]:
    return {p.op for p in session.placement() if p.op.startswith("onnx_genrt::")}


@pytest.fixture(scope="module", params=[False, True], ids=["body", "MTPAccept"])
def sessions(request):
    head = load_model(default_model_dir() / "mtp" / "model.onnx")
    k = 4
    chain = unroll_mtp_head(head, k)
    model = after_verify(chain, k)
    assert "MTPAccept" in {n.op_type for n in model.graph.node}
    session = InferenceSession(model, [_provider(request.param)], cpu_fallback=False)
    assert ("onnx_genrt::MTPAccept" in _genrt_ops(session)) == request.param
    return k, InferenceSession(chain), session


@pytest.mark.parametrize("seed", range(8))
def test_after_verify_counts_the_accepted_run_and_drafts_from_its_row(sessions, seed):
    k, plain, fused = sessions
    rng = np.random.default_rng(seed)
    hidden_size = int(plain.input_spec("hidden_states").shape[-1])
    argmax = rng.integers(0, 50, (1, k + 1)).astype(np.int64)
    n_drafts = int(rng.integers(0, k + 1))
    matches = int(rng.integers(0, k + 1))
    ids = rng.integers(50, 100, (1, k + 1)).astype(np.int64)  # no accidental matches
    ids[0, 1 : matches + 1] = argmax[0, :matches]
    ids[0, n_drafts + 1 :] = argmax[0, n_drafts:k]  # padding that happens to match
    hidden = rng.standard_normal((1, k + 1, hidden_size)).astype(np.float32)
    drafts, confs, count = fused.run(
        [DRAFTS, CONFIDENCES, ACCEPTED],
        {
            VERIFY_IDS: ids,
            VERIFY_ARGMAX: argmax,
            VERIFY_HIDDEN: hidden,
            DRAFT_COUNT: np.array([n_drafts], np.int64),
        },
    )
    want = _accepted(ids[0], argmax[0], n_drafts)
    assert int(count[0]) == want == min(matches, n_drafts)
    ref_drafts, ref_confs = plain.run(
        [DRAFTS, CONFIDENCES],
        {"hidden_states": hidden[:, want : want + 1], "input_ids": argmax[:, want : want + 1]},
    )
    np.testing.assert_array_equal(drafts, ref_drafts)
    np.testing.assert_allclose(confs, ref_confs, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("seed", range(6))
def test_next_inputs_fused_and_standard_agree_with_python(seed):
    """``with_next_inputs``' MTPNextInputs node, fused and as its body: the next start,
    ids, positions, mask and confident-draft count, against a Python reference."""
    from onnx_genrt.engine.mtp_chain import (
        NEXT_COUNT,
        NEXT_IDS,
        NEXT_MASK,
        NEXT_POSITIONS,
        NEXT_START,
        VERIFY_START,
        with_next_inputs,
    )
    from tests.models import mtp_chain_case

    k, length, min_conf = 4, 48, 0.3
    chain, feeds = mtp_chain_case(seed, k)
    names = [ACCEPTED, DRAFTS, CONFIDENCES, NEXT_START, NEXT_IDS, NEXT_COUNT, NEXT_POSITIONS]
    names.append(NEXT_MASK)
    results = []
    model = with_next_inputs(after_verify(chain, k), k, min_conf, length, True)
    for fused in (False, True):
        session = InferenceSession(model, [_provider(fused)], cpu_fallback=False)
        assert ("onnx_genrt::MTPNextInputs" in _genrt_ops(session)) == fused
        results.append(dict(zip(names, session.run(names, feeds), strict=True)))
    standard, fused_out = results
    for name in names:
        if name == CONFIDENCES:  # ArgMaxProb against Softmax + ReduceMax (no fusion): an ulp
            np.testing.assert_allclose(fused_out[name], standard[name], rtol=1e-6, err_msg=name)
        else:
            np.testing.assert_array_equal(fused_out[name], standard[name], err_msg=name)
    accepted = int(standard[ACCEPTED][0])
    begin = int(feeds[VERIFY_START][0]) + accepted + 1
    assert int(standard[NEXT_START][0]) == begin
    assert standard[NEXT_IDS][0, 0] == feeds[VERIFY_ARGMAX][0, accepted]
    np.testing.assert_array_equal(standard[NEXT_IDS][0, 1:], standard[DRAFTS][0])
    np.testing.assert_array_equal(standard[NEXT_POSITIONS][0], np.arange(begin, begin + k + 1))
    np.testing.assert_array_equal(standard[NEXT_MASK][0], np.arange(length) < begin + k + 1)
    low = standard[CONFIDENCES][0] < min_conf
    assert int(standard[NEXT_COUNT][0]) == (int(np.argmax(low)) if low.any() else k)


def test_draft_vocabulary_cuts_the_head_lm_head_and_keeps_output_identical():
    """A draft vocabulary (speculative.json ``mtp.draft_vocab``) drafts only from the first
    ids: every draft is below it, the chain's lm_head weight is that many columns, and
    speculative output still equals greedy."""
    import dataclasses

    from onnx_genrt.core.errors import ModelLoadError
    from onnx_genrt.engine import Model, generate
    from onnx_genrt.engine.api import make_proposer
    from onnx_genrt.engine.mtp_chain import restrict_draft_vocab

    head = load_model(default_model_dir() / "mtp" / "model.onnx")
    chain = InferenceSession(unroll_mtp_head(restrict_draft_vocab(head, 300), 4))
    rng = np.random.default_rng(0)
    for _ in range(5):
        drafts, _confs = chain.run(
            [DRAFTS, CONFIDENCES],
            {
                "hidden_states": rng.standard_normal((1, 1, 256)).astype(np.float32),
                "input_ids": rng.integers(0, 4096, (1, 1)),
            },
        )
        assert (drafts < 300).all()
    weights = [v for v in chain.plan.constants.values() if v.ndim == 2 and v.shape[-1] == 300]
    assert weights, "the sliced lm_head weight is folded to 300 columns"

    model = Model(default_model_dir(), ["cpu"])
    spec = {
        **model.config.speculative,
        "mtp": {**model.config.speculative["mtp"], "draft_vocab": 1024},
    }
    model.config = dataclasses.replace(model.config, speculative=spec)
    prompt = "class Foo:\n"
    want = generate(model, prompt, max_new_tokens=40, ignore_eos=True).tokens
    got = generate(model, prompt, max_new_tokens=40, ignore_eos=True, spec="mtp")
    assert got.tokens == want and got.speculation["verify_steps"] > 0
    bad = {**spec, "mtp": {**spec["mtp"], "draft_vocab": 0}}
    model.config = dataclasses.replace(model.config, speculative=bad)
    model.proposers.clear()
    with pytest.raises(ModelLoadError, match=r"mtp\.draft_vocab"):
        make_proposer(model, "mtp", 64)


def test_a_ranked_draft_vocabulary_drafts_its_ids_and_keeps_output_identical(tmp_path):
    """A ranked draft vocabulary (a JSON list of ids named by ``mtp.draft_vocab``): the
    chain's lm_head is folded to those columns, every draft is one of those ids (mapped
    back from the column), drafts equal an independent numpy reading of the same chain, and
    speculative output equals greedy."""
    import json
    import shutil

    from onnx_genrt.engine import Model, generate
    from onnx_genrt.engine.mtp_chain import restrict_draft_vocab

    ids = np.random.default_rng(1).permutation(4096)[:300]
    head = load_model(default_model_dir() / "mtp" / "model.onnx")
    full = InferenceSession(unroll_mtp_head(head, 1))
    ranked = InferenceSession(unroll_mtp_head(restrict_draft_vocab(head, ids), 3, draft_ids=ids))
    weights = [v for v in ranked.plan.constants.values() if v.ndim == 2 and v.shape[-1] == 300]
    assert weights, "the lm_head weight is folded to the 300 ranked columns"
    one = InferenceSession(unroll_mtp_head(restrict_draft_vocab(head, ids), 1, draft_ids=ids))
    rng = np.random.default_rng(2)
    for _ in range(5):
        feeds = {
            "hidden_states": rng.standard_normal((1, 1, 256)).astype(np.float32),
            "input_ids": rng.integers(0, 4096, (1, 1)),
        }
        (drafts,) = ranked.run([DRAFTS], feeds)
        assert set(drafts.reshape(-1).tolist()) <= set(ids.tolist())
        # the first draft: the ranked id whose full-vocabulary logit is highest
        (logits,) = InferenceSession(head).run(["logits"], feeds)
        assert drafts[0, 0] == ids[np.argmax(logits.reshape(-1)[ids])]
        assert one.run([DRAFTS], feeds)[0][0, 0] == drafts[0, 0]
        assert full.run([DRAFTS], feeds)[0].shape == (1, 1)

    folder = tmp_path / "model"
    shutil.copytree(default_model_dir(), folder, ignore=shutil.ignore_patterns("draft"))
    (folder / "mtp" / "draft_vocab.json").write_text(json.dumps(ids.tolist()))
    spec = json.loads((folder / "speculative.json").read_text())
    spec["mtp"]["draft_vocab"] = "mtp/draft_vocab.json"
    spec.pop("draft")
    (folder / "speculative.json").write_text(json.dumps(spec))
    model = Model(folder, ["cpu"])
    prompt = "class Foo:\n"
    want = generate(model, prompt, max_new_tokens=40, ignore_eos=True).tokens
    got = generate(model, prompt, max_new_tokens=40, ignore_eos=True, spec="mtp")
    assert got.tokens == want and got.speculation["verify_steps"] > 0


@pytest.mark.parametrize("pipeline", [False, True], ids=["host-fed", "pipelined"])
def test_speculative_mtp_without_the_fused_mtp_ops_equals_greedy(pipeline, monkeypatch):
    """On a provider without MTPAccept / MTPNextInputs kernels the chain runs their bodies
    (no CPU fallback needed) and speculative MTP output stays token-identical to greedy,
    host-fed (MTPAccept) and pipelined (MTPNextInputs writing the next verify's inputs)."""
    from onnx_genrt.engine import Model, generate
    from onnx_genrt.engine.speculative import SpeculativeGenerator
    from tests.models import standard_ops_cpu

    monkeypatch.setattr(SpeculativeGenerator, "pipeline", pipeline)
    model = Model(default_model_dir(), [standard_ops_cpu()])
    for prompt in ("class Foo:\n    def __init__(self", "for i in range("):
        greedy = generate(model, prompt, max_new_tokens=40, ignore_eos=True)
        fast = generate(model, prompt, max_new_tokens=40, spec="mtp", k=4, ignore_eos=True)
        assert fast.tokens == greedy.tokens, prompt
        assert fast.speculation["verify_steps"] > 0
    after = [s for p in model.proposers.values() for s in getattr(p, "_after_sessions", [])]
    assert after, "the chain ran on the verify step's outputs"
    for session in after:
        assert session.get_providers() == ["cpu-standard"]
        assert _genrt_ops(session) == set()
        nodes = {p.node.split("/")[1] for p in session.placement() if "/" in p.node}
        assert "MTPAccept" in nodes and ("MTPNextInputs" in nodes) == pipeline, nodes
