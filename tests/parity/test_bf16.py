"""bf16: the builder's bf16 model of the parity checkpoint on the CPU provider, against HF
transformers on the same bf16-rounded weights.

The reference is HF in float32 on the weights rounded to bf16 (what the bf16 model holds), so
what is left is the rounding of activations to bf16 between ops. Our logits must be no
farther from it than HF's own bf16 run is (times a small margin): both round every op's
output to bf16, in a different order. The builder's CUDA target is used because it writes
GroupQueryAttention for bf16 (its CPU target writes MultiHeadAttention).
"""

from __future__ import annotations

import numpy as np
import pytest

from ..llm_fixtures import TINY_QWEN2, build_qwen2
from .conftest import DECODE_STEPS, PROMPTS, engine_greedy, hf_forward, max_diff

#: How much farther from the float32 reference our bf16 logits may be than HF's bf16 run.
MARGIN = 1.5


@pytest.fixture(scope="module")
def bf16_model(hf_dir):
    from onnx_genrt.engine import Model

    return Model(build_qwen2(TINY_QWEN2, "bf16", target="cuda"))


@pytest.fixture(scope="module")
def hf_pair(hf_dir):
    """HF on the checkpoint: (float32 on bf16-rounded weights, bfloat16)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

    def load(dtype):
        return transformers.AutoModelForCausalLM.from_pretrained(
            hf_dir, dtype=dtype, attn_implementation="eager"
        ).eval()

    rounded = load(torch.float32)
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
    return rounded, load(torch.bfloat16)


def test_the_model_is_bf16(bf16_model):
    import onnx

    model = onnx.load(str(bf16_model.config.model_path), load_external_data=False)
    kinds = {o.name: o.type.tensor_type.elem_type for o in model.graph.output}
    assert kinds["hidden_states"] == onnx.TensorProto.BFLOAT16  # the logits come out float32
    weights = [i for i in model.graph.initializer if len(i.dims) == 2]
    assert weights and all(i.data_type == onnx.TensorProto.BFLOAT16 for i in weights)


@pytest.mark.parametrize("prompt", PROMPTS, ids=lambda p: f"p{len(p)}")
def test_logits_as_close_to_float32_as_hf_bf16(bf16_model, hf_pair, prompt):
    """Prefill and 12 greedy decode steps (teacher-forced into HF as one no-cache pass)."""
    import torch

    rounded, hf_bf16 = hf_pair
    ours, tokens = engine_greedy(bf16_model, prompt, DECODE_STEPS)
    seq = prompt + tokens[:-1]
    ref = hf_forward(rounded, seq)
    with torch.no_grad():
        out = hf_bf16(input_ids=torch.tensor([seq], dtype=torch.int64), use_cache=False)
    hf_err = float(np.abs(out.logits[0].float().numpy() - ref).max())
    our_err = max_diff(np.asarray(ours, np.float64), ref)
    assert np.isfinite(np.asarray(ours, np.float64)).all()
    assert our_err <= MARGIN * hf_err, (our_err, hf_err)
