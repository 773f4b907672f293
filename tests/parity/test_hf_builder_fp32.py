"""HF transformers against our engine on the builder's fp32 model of the same checkpoint."""

from __future__ import annotations

import pytest

from .conftest import (
    DECODE_STEPS,
    NEW_TOKENS,
    PROMPTS,
    engine_generate,
    engine_greedy,
    max_diff,
    ort_forced,
)

TOL = 1e-4


@pytest.mark.parametrize("prompt", PROMPTS, ids=lambda p: f"p{len(p)}")
def test_prefill_and_decode_logits_match_hf(fp32_model, hf_greedy, prompt):
    ref = hf_greedy[tuple(prompt)]
    logits, tokens = engine_greedy(fp32_model, prompt, DECODE_STEPS)
    p = len(prompt)
    assert tokens == ref.new[: DECODE_STEPS + 1]
    prefill = max_diff(logits[:p], ref.prefill_logits)
    # Row p-1 (the prefill's last) and the 12 decode steps against HF's cached decoding.
    decode = max_diff(logits[p - 1 :], ref.step_logits[: DECODE_STEPS + 1])
    assert prefill <= TOL and decode <= TOL, (prefill, decode)


@pytest.mark.parametrize("prompt", PROMPTS, ids=lambda p: f"p{len(p)}")
def test_greedy_tokens_match_hf_for_64_tokens(fp32_model, hf_greedy, prompt):
    ref = hf_greedy[tuple(prompt)]
    assert len(set(ref.new)) > 4, "degenerate fixture: greedy text repeats one token"
    assert engine_generate(fp32_model, prompt, NEW_TOKENS) == ref.new


def test_all_positions_match_onnxruntime(fp32_model, fp32_dir, hf_greedy):
    """Every prefill row and 12 decode steps against onnxruntime on the same file."""
    prompt = PROMPTS[0]
    logits, tokens = engine_greedy(fp32_model, prompt, DECODE_STEPS)
    ref = ort_forced(fp32_dir, prompt, tokens[:DECODE_STEPS])
    assert max_diff(logits, ref) <= TOL
