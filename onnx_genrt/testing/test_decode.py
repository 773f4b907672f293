"""A greedy decode of the embedded model on the provider under test (then its fallbacks),
token-identical to the CPU provider, with the provider's graph parts replaying."""

from __future__ import annotations

import pytest

from .plugin import KitTarget

PROMPT = "The quick brown fox"
NEW_TOKENS = 12


def _decode(providers: list) -> tuple[list[int], dict]:
    from onnx_genrt.engine.api import generate
    from onnx_genrt.engine.model import Model
    from onnx_genrt.models import default_model_path

    model = Model(default_model_path(), providers)
    placed = {p.provider for p in model.session.placement()}
    result = generate(model, PROMPT, NEW_TOKENS, do_sample=False, ignore_eos=True)
    return list(result.tokens), {"placed": placed, **result.graph_stats["target"]}


def test_greedy_decode_matches_cpu_and_replays(genrt_target: KitTarget):
    tokens, stats = _decode(genrt_target.stack())
    if genrt_target.name not in stats["placed"]:
        pytest.skip(f"{genrt_target.name!r} claims no node of the embedded model")
    reference, _ = _decode(["cpu"])
    assert tokens == reference, (
        f"greedy tokens on {genrt_target.stack()} differ from the CPU provider's:\n"
        f"  got      {tokens}\n  expected {reference}"
    )
    primary = stats["primary"]
    assert primary["fallbacks"] == 0, f"PRIMARY fell back: {primary['fallback_reasons']}"
    assert primary["captures"] >= 1 and primary["replays"] >= NEW_TOKENS - 4, primary
    replays = primary["provider_replays"].get(genrt_target.name, 0)
    assert replays >= primary["replays"], (
        f"{genrt_target.name!r} replayed {replays} graph parts in {primary['replays']} "
        "PRIMARY replays"
    )
