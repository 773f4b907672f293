"""``onnx-genrt bench --cold``: each run in a new process, ours beside onnxruntime-genai.

The child's greedy tokens must equal onnxruntime-genai's on the same files (min_length set to
the full length in both, as in the warm rows); the table reports every row's figures; a
child that fails names its row and the error's last line."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from onnx_genrt.cli import main
from onnx_genrt.core.errors import InvalidInputError
from onnx_genrt.tools import cold_start
from onnx_genrt.tools.llm_bench import bench_onnxruntime_genai

from ..llm_fixtures import TINY_QWEN2, build_qwen2

PROMPT = [5, 17, 99, 3, 250, 7, 11, 42]
NEW = 12


@pytest.fixture(scope="module")
def folder():
    return build_qwen2(TINY_QWEN2)


def _child(*argv: str) -> dict:
    proc = subprocess.run(
        cold_start.child_command(list(argv)),
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("spec", [None, "ngram"])
def test_a_cold_run_gives_onnxruntime_genais_greedy_tokens(folder, spec):
    want = bench_onnxruntime_genai(folder, PROMPT, NEW)()[2]
    argv = ["ours", str(folder), "--prompt", ",".join(map(str, PROMPT)), "--tokens", str(NEW)]
    ours = _child(*argv, *(["--spec", spec] if spec else []))
    assert ours["tokens"] == want
    genai = _child("genai", *argv[1:])
    assert genai["tokens"] == want
    for run in (ours, genai):
        assert run["load_s"] > 0 and run["first_token_s"] > 0 and run["decode_tok_s"] > 0
        assert run["main_at"] > 0 and run["import_s"] >= 0


def test_the_table_has_a_row_per_runtime_with_the_same_tokens(folder, capsys):
    argv = ["bench", "--cold", "--model", str(folder), "--tokens", "6", "--repeats", "1"]
    assert main([*argv, "--prompt-tokens", "5", "--spec", "ngram"]) == 0
    out = capsys.readouterr().out
    rows = re.findall(
        r"^(\S+(?:[ -]\S+)?)\s+((?:[\d.]+\s+){5}[\d.]+)\s+same tokens (\w+)$", out, re.M
    )
    labels = [label for label, _, _ in rows]
    assert labels == ["onnx-genrt[cpu]", "onnx-genrt[cpu,ngram]", "onnxruntime-genai"], out
    for _, values, same in rows:
        process, python, imported, load, first_ms, rate = map(float, values.split())
        assert process > python and process > load and first_ms > 0 and rate > 0
        assert same == "yes"


def test_a_failing_run_names_its_row(folder, tmp_path):
    broken = tmp_path / "m"
    broken.mkdir()
    with pytest.raises(
        InvalidInputError, match=r"the onnx-genrt\[cpu\] run failed: .*genai_config"
    ):
        cold_start._run_child(
            "onnx-genrt[cpu]", ["ours", str(broken), "--prompt", "1,2", "--tokens", "2"]
        )
