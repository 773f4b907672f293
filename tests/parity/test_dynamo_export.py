"""torch.onnx dynamo exports of the HF checkpoint: our session against onnxruntime and HF.

The exports are no-cache forwards (``input_ids -> logits`` over the whole sequence), so
greedy decoding here re-runs the full sequence each step.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from onnx_genrt.session import InferenceSession

from .conftest import NEW_TOKENS, PROMPTS, hf_forward, max_diff

TOL = 1e-4
FUSED = {"Attention", "RMSNormalization", "RotaryEmbedding"}


@pytest.fixture(scope="module")
def sessions(dynamo_onnx):
    import onnxruntime as ort

    ours = InferenceSession(dynamo_onnx, providers=["cpu"])
    ref = ort.InferenceSession(str(dynamo_onnx), providers=["CPUExecutionProvider"])
    return ours, ref


def _logits(session, ids: list[int]) -> np.ndarray:
    return session.run(None, {"input_ids": np.array([ids], np.int64)})[0][0]


def _greedy(session, prompt: list[int], new: int) -> list[int]:
    ids = list(prompt)
    for _ in range(new):
        ids.append(int(np.argmax(_logits(session, ids)[-1])))
    return ids[len(prompt) :]


def test_exported_ops(dynamo_onnx):
    """Opset 23 uses the fused standard ops; opset 18 has none of them (decomposed)."""
    model = onnx.load(dynamo_onnx)
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    ops = {n.op_type for n in model.graph.node}
    assert {n.domain for n in model.graph.node} <= {"", "ai.onnx"}
    if opset >= 23:
        assert ops >= FUSED, sorted(ops)
    else:
        assert not FUSED & ops and {"Softmax", "ReduceMean"} <= ops, sorted(ops)


@pytest.mark.parametrize("which", ["prompt+64", "one-token"])
def test_logits_match_onnxruntime_and_hf(sessions, hf_model, hf_greedy, which):
    ids = hf_greedy[tuple(PROMPTS[0])].sequence if which == "prompt+64" else [300]
    ours = _logits(sessions[0], ids)
    vs_ort = max_diff(ours, _logits(sessions[1], ids))
    vs_hf = max_diff(ours, hf_forward(hf_model, ids))
    assert vs_ort <= TOL and vs_hf <= TOL, (vs_ort, vs_hf)


@pytest.mark.parametrize("prompt", PROMPTS[:2], ids=lambda p: f"p{len(p)}")
def test_greedy_64_tokens_match_onnxruntime(sessions, hf_greedy, prompt):
    ours = _greedy(sessions[0], prompt, NEW_TOKENS)
    assert ours == _greedy(sessions[1], prompt, NEW_TOKENS)
    assert ours == hf_greedy[tuple(prompt)].new  # the same weights as the HF checkpoint
