"""warm_up: the first generation after it replays graphs from its first step, same tokens."""

from __future__ import annotations

import pytest

from onnx_genrt.engine import Model, generate, warm_up
from onnx_genrt.generate_cli import default_model_dir

PROMPT = "    def __init__(self"


@pytest.mark.parametrize("spec", [None, "mtp"])
def test_first_generation_after_warm_up_only_replays(spec):
    cold = generate(Model(default_model_dir()), PROMPT, 32, spec=spec)
    model = Model(default_model_dir())
    assert warm_up(model, 6 + 32, spec, prompt_length=6) > 0
    slot = "verify" if spec else "primary"
    before = model.session.all_graph_stats()[slot]
    assert before["captures"] == 1
    chain_before = {}
    if spec:
        (proposer,) = model.proposers.values()
        chain_before = proposer.graph_stats()["draft(after verify)"]
        assert chain_before["captures"] == 1
        # The drafts after the prompt run once a generation: captured by the second pass.
        first_before = proposer.graph_stats()["draft"]
        assert first_before["captures"] == 1
    result = generate(model, PROMPT, 32, spec=spec)
    after = result.graph_stats["target"][slot]
    assert result.tokens == cold.tokens  # the warm-up leaves nothing behind in the cache
    assert after["captures"] == 1 and after["eager_runs"] == before["eager_runs"]
    assert after["replays"] > before["replays"]
    if spec:
        chain = result.graph_stats["proposer"]["draft(after verify)"]
        assert chain["captures"] == 1 and chain["eager_runs"] == chain_before["eager_runs"]
        first = result.graph_stats["proposer"]["draft"]
        assert first["captures"] == 1 and first["replays"] == first_before["replays"] + 1
