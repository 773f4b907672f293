"""pytest-benchmark: greedy decode, onnx-genrt against onnxruntime-genai and a plain
onnxruntime loop on the same model files, in one run.

``pytest tests/bench --benchmark-enable`` times them; the normal test run executes each
body once and checks each runtime's greedy tokens against onnxruntime-genai's, computed in a
fixture (so the check does not depend on which tests ran before).
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import time

import pytest

from onnx_genrt.core.errors import InvalidInputError
from onnx_genrt.tools.llm_bench import (
    bench_onnxruntime_genai,
    bench_onnxruntime_genai_ngram,
    bench_onnxruntime_loop,
    bench_ours,
    reference_in_child,
)

from ..llm_fixtures import TINY_QWEN2, build_qwen2

PROMPT = [5, 17, 99, 3, 250, 7, 11, 42]
NEW = 32


@pytest.fixture(scope="module")
def folder():
    return build_qwen2(TINY_QWEN2)


RUNTIMES = {
    "onnx-genrt": lambda f: bench_ours(f, PROMPT, NEW, "cpu", None, 4, True),
    "onnx-genrt-ngram": lambda f: bench_ours(f, PROMPT, NEW, "cpu", "ngram", 4, True),
    "onnx-genrt-serial": lambda f: bench_ours(f, PROMPT, NEW, "cpu", None, 4, True, False),
    "onnxruntime-genai": lambda f: bench_onnxruntime_genai(f, PROMPT, NEW),
    "onnxruntime-genai-ngram": lambda f: bench_onnxruntime_genai_ngram(f, PROMPT, NEW),
    "onnxruntime-loop": lambda f: bench_onnxruntime_loop(f, PROMPT, NEW),
}


@pytest.fixture(scope="module")
def reference_tokens(folder) -> list[int]:
    """Greedy tokens of onnxruntime-genai, computed once whatever the order of the tests."""
    return bench_onnxruntime_genai(folder, PROMPT, NEW)()[2]


@pytest.mark.benchmark(group="greedy-tiny-qwen2-32-tokens")
@pytest.mark.parametrize("runtime", list(RUNTIMES))
def test_greedy_decode(benchmark, folder, runtime, reference_tokens):
    once = RUNTIMES[runtime](folder)
    once()  # warm-up: compile, plan, capture
    _, _, tokens, extra = benchmark(once)
    benchmark.extra_info["new_tokens"] = NEW
    assert len(tokens) == len(PROMPT) + NEW
    assert tokens == reference_tokens, f"{runtime} and onnxruntime-genai disagree"


def test_roofline_counts_each_matmul_weight_once():
    """The roofline's bytes per token: every MatMul weight of the embedded model, from the
    loaded arrays themselves (the tied lm_head counted once)."""
    import onnx
    from onnx import numpy_helper

    from onnx_genrt.generate_cli import default_model_dir
    from onnx_genrt.tools.llm_bench import weight_bytes_per_token

    path = default_model_dir() / "model.onnx"
    model = onnx.load(str(path))
    arrays = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    names = {n.input[1] for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in arrays}
    assert names
    assert weight_bytes_per_token(path) == sum(arrays[n].nbytes for n in names)


def test_rows_are_timed_round_robin_after_one_warm_up_each():
    """Each case warms up once, then the timed runs alternate between the cases, and each
    row is the median of its own runs."""
    from onnx_genrt.tools.llm_bench import _interleaved

    calls: list[str] = []

    def case(name: str, speeds: list[float]):
        runs = iter([0.0, *speeds])  # the warm-up's figure is thrown away

        def once():
            calls.append(name)
            return 0.001, next(runs), [1, 2], {}

        return once

    rows = _interleaved([("a", case("a", [10, 30, 20])), ("b", case("b", [5, 1, 3]))], 3)
    assert calls == ["a", "b", "a", "b", "a", "b", "a", "b"]
    assert [(r.runtime, r.decode_tok_s) for r in rows] == [("a", 20), ("b", 3)]
    # the spread: (fastest - slowest) / median, shown in the table next to the median
    assert [r.decode_spread for r in rows] == pytest.approx([(30 - 10) / 20, (5 - 1) / 3])
    from onnx_genrt.tools.llm_bench import format_rows

    header, row_a, row_b = format_rows(rows).splitlines()
    assert "spread" in header.split()
    assert "100.0%" in row_a.split() and "133.3%" in row_b.split()


@pytest.mark.parametrize("specs", [[], ["mtp"], ["ngram:2"], ["mtp", "ngram"]])
def test_onnxruntime_genai_speculation_is_a_row_beside_its_counterpart(specs, monkeypatch):
    """onnxruntime-genai's own n-gram speculation runs as a reference row when ``--spec``
    asks for n-grams, and our n-gram row names its speed against it."""
    from onnx_genrt.cli import main
    from onnx_genrt.tools import llm_bench

    labels: list[str] = []

    def fake_reference(label, *_args):
        labels.append(label)
        speed = {"onnxruntime-genai ngram": 400.0}.get(label, 200.0)
        return lambda: (0.001, speed, list(PROMPT), {})

    def fake_ours(*args):
        spec = args[4]
        extra = {}
        if spec:
            extra = {"speculation": {"kind": spec, "k": 4, "acceptance_rate": 0.5}}
            extra["speculation"]["mean_accepted_length"] = 1.0
        return lambda: (0.001, 500.0 if spec else 300.0, list(PROMPT), extra)

    monkeypatch.setattr(llm_bench, "reference_in_child", fake_reference)
    monkeypatch.setattr(llm_bench, "bench_ours", fake_ours)
    monkeypatch.setattr(llm_bench, "cpu_roofline", lambda *a: "")
    argv = ["bench", "--provider", "cpu", "--repeats", "1", "--tokens", "4"]
    argv += [a for spec in specs for a in ("--spec", spec)]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    wants_ngram = any(spec.startswith("ngram") for spec in specs)
    assert ("onnxruntime-genai ngram" in labels) == wants_ngram
    assert {"onnxruntime-genai", "onnxruntime loop"} <= set(labels)
    rows = {line.split("  ")[0].strip(): line for line in out.getvalue().splitlines()}
    if wants_ngram:
        ngram_row = next(v for k, v in rows.items() if ",ngram" in k)
        assert "1.25x onnxruntime-genai ngram" in ngram_row  # 500 / 400
    for label, line in rows.items():
        if ",mtp" in label:
            assert "onnxruntime-genai ngram" not in line


@pytest.mark.parametrize(
    ("entry", "want"), [("mtp", ("mtp", None)), ("mtp:3", ("mtp", 3)), ("ngram:2", ("ngram", 2))]
)
def test_spec_entries_name_a_kind_and_maybe_its_drafts(entry, want):
    from onnx_genrt.tools.llm_bench import _spec_entry

    assert _spec_entry(entry, None) == want


@pytest.mark.parametrize("entry", ["beam", "mtp:0", "mtp:x"])
def test_bad_spec_entries_say_what_is_wrong(entry):
    from onnx_genrt.tools.llm_bench import _spec_entry

    with pytest.raises(InvalidInputError, match="--spec"):
        _spec_entry(entry, None)


EMBEDDED_NEW = 48
SPECULATIVE = [None, "mtp", "draft", "ngram"]


@pytest.fixture(scope="module")
def embedded():
    """The embedded model's folder, the bench prompt, and a plain onnxruntime greedy loop's
    tokens for it (computed once, whatever the order of the tests)."""
    from onnx_genrt.engine.tokenizer import Tokenizer
    from onnx_genrt.generate_cli import default_model_dir

    folder = default_model_dir()
    prompt = list(Tokenizer(folder).encode("    def __init__(self"))
    return folder, prompt, bench_onnxruntime_loop(folder, prompt, EMBEDDED_NEW)()[2]


def test_bench_rows_need_distinct_labels():
    from onnx_genrt.tools.llm_bench import _interleaved

    def case():
        raise AssertionError("must not run")

    with pytest.raises(ValueError, match="given twice: a"):
        _interleaved([("a", case), ("b", case), ("a", case)], repeats=1)


def test_bench_refuses_a_spec_given_twice(capsys):
    from onnx_genrt.cli import EXIT_USAGE, main

    argv = ["bench", "--provider", "cpu", "--spec", "mtp", "--spec", "mtp", "--no-reference"]
    assert main(argv) == EXIT_USAGE
    assert "--spec: each entry once" in capsys.readouterr().err


@pytest.mark.benchmark(group="speculative-embedded-48-tokens")
@pytest.mark.parametrize("spec", SPECULATIVE, ids=lambda s: s or "greedy")
def test_speculative_decode_embedded_model(benchmark, spec, embedded):
    """Greedy against each proposer on the embedded trained model (its MTP head, its draft
    model, prompt lookup), k from its speculative.json; all give onnxruntime's greedy tokens."""
    folder, prompt, reference = embedded
    once = bench_ours(folder, prompt, EMBEDDED_NEW, "cpu", spec, None, True)
    once()  # warm-up: compile, plan, capture
    _, _, tokens, extra = benchmark(once)
    benchmark.extra_info["new_tokens"] = EMBEDDED_NEW
    if extra.get("speculation"):
        benchmark.extra_info["mean_accepted"] = extra["speculation"]["mean_accepted_length"]
    assert tokens == reference, f"{spec or 'greedy'} and an onnxruntime greedy loop disagree"


@pytest.mark.benchmark(group="streams-embedded-4x48-tokens")
@pytest.mark.parametrize("spec", [None, "ngram", "mtp"], ids=lambda s: s or "plain")
def test_four_streams_speculating_per_row(benchmark, spec, embedded):
    """Four rows of the bench prompt decoded together, plainly or speculating per row (by
    prompt lookup, by the MTP head); every row gives onnxruntime's greedy tokens."""
    from onnx_genrt.tools.llm_bench import bench_batch

    folder, prompt, reference = embedded
    once = bench_batch(folder, [prompt] * 4, EMBEDDED_NEW, "cpu", spec=spec)
    once()  # warm-up: compile, plan, capture
    _, _, tokens, extra = benchmark(once)
    benchmark.extra_info["new_tokens"] = 4 * EMBEDDED_NEW
    if extra.get("speculation"):
        benchmark.extra_info["mean_accepted"] = extra["speculation"]["mean_accepted_length"]
        assert extra["speculation"]["verify_steps"] > 0
    assert tokens == reference, f"row 0 ({spec or 'plain'}) and an onnxruntime greedy loop disagree"


def test_host_wait_profile_reports_each_kind(capsys):
    """scripts/host_wait_profile.py: one line per kind with steps and the time waited."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "host_wait_profile.py"
    spec = importlib.util.spec_from_file_location("host_wait_profile", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--provider", "cpu", "--spec", "none", "--spec", "ngram", "--tokens", "16"])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["none", "ngram"]
    assert all("waiting on the device" in line for line in lines)


def test_graph_prompt_rows_set_and_restore_the_generator_default(folder, reference_tokens):
    """``--compare-eager-prompts`` runs (``graph_prompts``) give the same tokens, and the
    generator's default is back after each call, also when forced on here (the CPU)."""
    from onnx_genrt.engine import Generator

    for graph_prompts in (True, False):
        once = bench_ours(folder, PROMPT, NEW, "cpu", None, 4, True, graph_prompts=graph_prompts)
        assert once()[2] == reference_tokens
        assert Generator.graph_prefill is None


@pytest.mark.parametrize("label", ["onnxruntime-genai", "onnxruntime loop"])
def test_reference_rows_run_in_a_child_stopped_between_runs(folder, reference_tokens, label):
    """The bench's reference rows run in their own process, with the thread count given,
    and that process is stopped (state T) between its runs, so its spinning intra-op threads
    never share the cores with the next row."""
    import multiprocessing
    import sys

    if sys.platform == "win32":
        pytest.skip("SIGSTOP is POSIX")
    before = {p.pid for p in multiprocessing.active_children()}
    once = reference_in_child(label, folder, PROMPT, NEW, 1)
    (child,) = [p for p in multiprocessing.active_children() if p.pid not in before]

    def state() -> str:
        """The child's state once settled (a stop signal lands asynchronously)."""
        for _ in range(100):
            with open(f"/proc/{child.pid}/stat") as f:
                now = f.read().rsplit(")", 1)[1].split()[0]
            if now == "T":
                break
            time.sleep(0.01)
        return now

    try:
        assert state() == "T"
        for _ in range(2):
            assert once()[2] == reference_tokens
            assert state() == "T"
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.join(5)


def test_a_reference_that_fails_to_build_raises_in_the_parent(tmp_path):
    with pytest.raises(RuntimeError, match="onnxruntime loop"):
        reference_in_child("onnxruntime loop", tmp_path, PROMPT, NEW, 1)


def test_cpu_roofline_line_reads_the_weights_bytes(monkeypatch):
    """The CPU roofline: a plain read of the weight bytes (dot products, measured), the
    ceiling it gives, and each shown row's weight GB/s against it."""
    from onnx_genrt.tools import llm_bench

    gb_s = llm_bench.read_gb_s(8 << 20, 2, repeats=2)
    assert 0.5 < gb_s < 2000
    monkeypatch.setattr(llm_bench, "read_gb_s", lambda nbytes, threads: 40.0)
    rows = [
        llm_bench.BenchRow("onnx-genrt[cpu,2t]", 1.0, 200.0),
        llm_bench.BenchRow("onnx-genrt[cpu,2t,mtp]", 1.0, 300.0),
        llm_bench.BenchRow("onnxruntime-genai", 1.0, 100.0),
    ]
    line = llm_bench.cpu_roofline(100_000_000, 2, rows)
    assert "100.0 MB of matmul weights" in line and "runs at 40.0 GB/s" in line
    assert "a ceiling of 400 tok/s" in line
    assert "onnx-genrt[cpu,2t] 20.0 GB/s (50% of the plain read)" in line
    assert "onnxruntime-genai 10.0 GB/s (25% of the plain read)" in line
    assert "mtp" not in line
