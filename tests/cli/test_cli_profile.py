"""``onnx-genrt profile`` and ``onnx-genrt step-cost``: the step tools as commands."""

from __future__ import annotations

import re

import onnx
import pytest

from onnx_genrt.cli import main
from onnx_genrt.engine.decode_heads import add_decode_heads
from onnx_genrt.models import default_model_path


def test_profile_lists_the_models_ops_and_nodes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profile", "--steps", "3", "--top", "4", "--context", "16"]) == 0
    text = capsys.readouterr().out
    head = re.match(
        r"step ([\d.]+) ms \| graph replay alone ([\d.]+) ms \| sum of (\d+) nodes", text
    )
    assert head and float(head[1]) > 0 and float(head[2]) > 0, text
    model = onnx.load(str(default_model_path() / "model.onnx"), load_external_data=False)
    own = {n.name for n in model.graph.node}
    # the engine's argmax and non-finite probe, appended to the model it runs
    names = {n.name for n in add_decode_heads(model, "logits").graph.node}
    assert own < names
    top = re.findall(r"^\s+[\d.]+ us\s+(\S+)\s+(\S+)$", text, re.M)
    assert len(top) == 4
    for op, name in top:  # a model node, or one the planner fused from a model node
        fused_from = (name.split("/fused")[0], name.rsplit("/", 1)[0])  # ".../MatMulAdd"
        assert name in names or any(n in names for n in fused_from), (op, name)
    assert "MatMul" in {op for op, _ in top}


def test_step_cost_reports_both_slots_replaying(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["step-cost", "-k", "2", "--steps", "4", "--context", "16"]) == 0
    text = capsys.readouterr().out
    found = re.search(
        r"decode \(M=1\) [\d.]+ ms, verify \(M=3\) [\d.]+ ms.*replays primary (\d+), verify (\d+)",
        text,
    )
    assert found and int(found[1]) >= 4 and int(found[2]) >= 4, text


@pytest.mark.parametrize("argv", [["profile", "--width", "0"], ["step-cost", "-k", "-1"]])
def test_bad_flags_are_one_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "must be an integer >= 1" in capsys.readouterr().err


def test_profile_mtp_needs_a_verify_width(capsys: pytest.CaptureFixture[str]) -> None:
    """--mtp times a verify step and the chain after it: one token wide is a usage error,
    one line naming both flags, before any model is loaded."""
    assert main(["profile", "--mtp", "--width", "1", "--steps", "1", "--context", "4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--mtp needs --width k+1 >= 2, got --width 1" in err, err


@pytest.mark.parametrize("command", ["profile", "step-cost"])
def test_step_tools_take_the_cpu_threads(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    """--threads goes to the CPU provider (its worker pool), as in generate and bench."""
    from onnx_genrt.providers.cpu.kernels import _worker_pool as wp

    before = wp.pool_threads()
    try:
        for threads in (1, 2):
            assert main([command, "--threads", str(threads), "--steps", "2", "--context", "8"]) == 0
            assert wp.pool_threads() == threads
    finally:
        wp.set_pool_threads(before)
    assert "ms" in capsys.readouterr().out


def test_profile_rows_times_a_batched_step(capsys: pytest.CaptureFixture[str]) -> None:
    """--rows N: a continuous batch's decode step of N rows, graphed (replaying its bucket
    graph) and node by node eagerly (every node of the model's step is timed)."""
    assert main(["profile", "--rows", "3", "--steps", "3", "--top", "2", "--context", "8"]) == 0
    text = capsys.readouterr().out
    head = re.match(
        r"step ([\d.]+) ms \| graph replay alone ([\d.]+) ms \| sum of (\d+) nodes", text
    )
    assert head and float(head[2]) > 0, text  # nan when no bucket graph was captured
    model = onnx.load(str(default_model_path() / "model.onnx"), load_external_data=False)
    attention = sum(n.op_type == "GroupQueryAttention" for n in model.graph.node)
    assert re.search(rf"^GroupQueryAttention\s+{attention}\s", text, re.M), text
    assert int(head[3]) >= len(model.graph.node) // 2, text


def test_profile_rows_refuses_a_width(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profile", "--rows", "2", "--width", "3", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--rows times one-token decode steps" in err, err
