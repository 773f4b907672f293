"""pytest-benchmark on CUDA: graphed greedy against eager greedy and each proposer (MTP, draft
model, prompt lookup) on the embedded trained model, in one run.

``pytest tests/providers/cuda/test_cuda_bench.py --benchmark-enable`` times them; the normal GPU lane
executes each body once and checks that every row gives graphed greedy's tokens and that the
graphed rows replayed their graphs without falling back. ``onnx-genrt bench --provider cuda``
gives the same rows as a table, and the 0.5B-shaped rows (``scripts/gpu_llm_bench.sh``).

Marked ``gpu``: skipped without a usable GPU, failed instead when ONNX_GENRT_REQUIRE_GPU=1.
"""

from __future__ import annotations

import pytest

from onnx_genrt.tools.llm_bench import bench_ours

pytestmark = pytest.mark.gpu

NEW = 128
#: (row id, proposer, graphs)
ROWS = [
    ("greedy", None, True),
    ("greedy-eager", None, False),
    ("mtp", "mtp", True),
    ("draft", "draft", True),
    ("ngram", "ngram", True),
]
_tokens: dict[str, list[int]] = {}


@pytest.fixture(scope="module")
def embedded():
    from onnx_genrt.engine.tokenizer import Tokenizer
    from onnx_genrt.generate_cli import default_model_dir

    folder = default_model_dir()
    return folder, list(Tokenizer(folder).encode("    def __init__(self"))


@pytest.mark.benchmark(group="cuda-embedded-128-tokens")
@pytest.mark.parametrize(("row", "spec", "graphs"), ROWS, ids=[r[0] for r in ROWS])
def test_cuda_decode_embedded_model(benchmark, cp, embedded, row, spec, graphs):
    folder, prompt = embedded
    once = bench_ours(folder, prompt, NEW, "cuda", spec, None, graphs)
    once()  # warm-up: compile, plan, capture
    _, tok_s, tokens, extra = benchmark(once)
    benchmark.extra_info.update(new_tokens=NEW, decode_tokens_per_second=tok_s)
    if extra.get("speculation"):
        benchmark.extra_info["mean_accepted"] = extra["speculation"]["mean_accepted_length"]
    assert len(tokens) == len(prompt) + NEW
    slots = {
        f"{who}/{slot}": st for who, per in extra["graph_stats"].items() for slot, st in per.items()
    }
    if graphs:
        assert all(st["fallbacks"] == 0 for st in slots.values()), slots
        assert slots["target/primary" if spec is None else "target/verify"]["replays"] > 0, slots
    _tokens[row] = tokens
    for other, seq in _tokens.items():
        assert seq == tokens, f"{row} and {other} disagree"
