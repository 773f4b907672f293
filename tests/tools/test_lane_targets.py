"""The GPU lane's target table reads the lane's own log formats: bench rows as
``onnx-genrt bench`` prints them, step costs as ``onnx-genrt step-cost`` prints them, and the
real logs of an H200 lane run (tests/tools/data/lane_logs)."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from onnx_genrt.cli import main
from onnx_genrt.tools import lane_targets, step_cost, step_profile
from onnx_genrt.tools.llm_bench import BenchRow, format_rows
from onnx_genrt.tools.step_profile import NodeTime

LOGS = Path(__file__).parent / "data" / "lane_logs"


def _by_name(folder: Path) -> dict[str, lane_targets.Target]:
    return {t.name: t for t in lane_targets.targets(folder)}


def test_bench_rows_read_back_what_the_bench_prints():
    rows = [
        BenchRow("onnx-genrt[cuda]", 1.77, 1133.0),
        BenchRow("onnx-genrt[cuda,32 streams,serial]", 56.71, 12690.3, decode_spread=0.034),
        BenchRow("onnx-genrt[cuda,eager prompts]", 15.66, 1132.9),
    ]
    parsed = lane_targets.bench_rows(format_rows(rows))
    assert parsed == {r.runtime: (r.prefill_ms, r.decode_tok_s) for r in rows}


def test_step_ratios_read_back_what_step_cost_prints(monkeypatch, capsys, tmp_path):
    measured = {"decode": 0.8, "verify": 1.2, "ratio": 1.5, "replays_primary": 51,
                "replays_verify": 104, "verify+mtp": 2.0,
                "notes": ("programmatic launch: on (with L2 weight prefetch)",)}  # fmt: skip
    monkeypatch.setattr(step_cost, "measure", lambda *a: measured)
    monkeypatch.setattr(step_cost, "model_folder", lambda a: tmp_path)
    step_cost.run(argparse.Namespace(provider=["cuda"], threads=None, k=4, context=256, steps=10))
    assert lane_targets.step_ratios(capsys.readouterr().out) == (1.5, 2.5)


def test_a_real_lane_run_gives_each_target_its_figure():
    got = _by_name(LOGS)
    fp16 = got["0.5B fp16 graphed greedy, tok/s"]
    assert (fp16.figure, fp16.met) == (1133.0, False)
    assert "HF static+cudagraphs 653.2" in fp16.anchor
    assert got["0.5B int4 verify (M=5) / decode"].figure == 1.27
    assert got["0.5B fp16 verify + MTP chain / decode"].figure == 2.16
    streams = got["0.5B fp16 32 streams / 1 stream"]
    assert streams.figure == pytest.approx(15723.3 / 1140.6) and streams.met is False
    assert "25.0x" in streams.anchor  # HF's 8083.4 at 32 over 322.8 at 1
    prefill = got["0.5B fp16 prefill 32 tokens, ms"]
    assert (prefill.figure, prefill.met) == (1.77, True)
    assert got["0.5B fp16 prefill 512 tokens, ms"].figure == 4.16
    long = got["decode after 30000 tokens / after 256"]
    assert long.figure == pytest.approx(100 * 351.4 / 1191.0)  # the default rows only
    assert got["prefill 8192 tokens, ms"].figure == 39.17
    assert got["embedded model MTP / graphed greedy"].figure == pytest.approx(16978.3 / 8996.9)


def test_missing_logs_are_not_measured_and_the_report_counts(tmp_path):
    shutil.copy(LOGS / "step-int4.txt", tmp_path)
    got = _by_name(tmp_path)
    assert got["0.5B fp16 graphed greedy, tok/s"].met is None
    assert got["0.5B int4 verify (M=5) / decode"].met is False
    text = lane_targets.report(tmp_path)
    assert "not measured" in text
    assert text.splitlines()[-1].startswith(f"0 of {len(got)} targets met; {len(got) - 2}")


def test_long_context_rows_keep_settings_and_hf_apart():
    text = "\n".join(
        [
            "== 8192 prompt tokens, 64 new, default",
            "onnx-genrt[cuda]                  39.17         734.9    0.1%   -   -  yes  x",
            "== 8192 prompt tokens, 64 new, ONNX_GENRT_ATTENTION_CLUSTER_MAX_KEYS=1",
            "onnx-genrt[cuda]                  39.10         893.3    0.2%   -   -  yes  x",
            "== HF transformers (sdpa), 8192 prompt tokens",
            "config                decode tok/s   TTFT ms    ids  notes",
            "eager-dynamic                 30.2     35.10    ref  not compiled",
            "static+cudagraphs            503.6     30.73   same  graphs 1",
            "roofline                    4351.9                   988.1 MB",
        ]
    )
    ours, hf = lane_targets.long_rows(text)
    assert ours == {(8192, "default"): (39.17, 734.9),
                    (8192, "ONNX_GENRT_ATTENTION_CLUSTER_MAX_KEYS=1"): (39.10, 893.3)}  # fmt: skip
    assert hf == {8192: 30.73}


def test_the_command_prints_the_table_and_refuses_a_missing_folder(tmp_path, capsys):
    assert main(["lane-targets", str(LOGS)]) == 0
    assert "0.5B fp16 graphed greedy, tok/s" in capsys.readouterr().out
    assert main(["lane-targets", str(tmp_path / "nowhere")]) != 0
    err = capsys.readouterr().err
    assert "is not a folder" in err and "Traceback" not in err


def test_scale_rows_give_the_share_of_the_bandwidth_floor(tmp_path):
    """``scripts/gpu_scale_bench.sh``'s logs (the bench table and its roofline line, as
    ``onnx-genrt bench --provider cuda`` prints them) become one scale row each."""
    table = format_rows([BenchRow("onnx-genrt[cuda]", 3.1, 870.0)])
    roof = "roofline: 3087.0 MB of matmul weights read per decode token; at 4300 GB/s the ceiling is 1393 tok/s"
    (tmp_path / "bench-1.5b-fp16.txt").write_text(f"{table}\n{roof}\n")
    (tmp_path / "bench-7b-int4.txt").write_text("bench 7b int4 failed\n")
    (tmp_path / "bench-fp16.txt").write_text(table)  # the 0.5B lane log: not a scale row
    rows = lane_targets.scale_rows(tmp_path)
    assert len(rows) == 2
    assert rows[0].startswith("1.5b fp16 graphed greedy") and "870.0 tok/s" in rows[0]
    assert "62% of the floor (3087.0 MB a token, 1393 tok/s)" in rows[0]
    assert rows[1].startswith("7b int4 graphed greedy") and "not measured" in rows[1]
    report = lane_targets.report(tmp_path)
    assert report.splitlines()[-3].startswith("scale (issue 19")


def test_a_draft_vocab_step_cost_adds_its_own_chain_row(tmp_path):
    folder = tmp_path / "logs"
    shutil.copytree(LOGS, folder)
    assert not any("draft vocab" in name for name in _by_name(folder))  # none without the log
    (folder / "step-fp16-draft.txt").write_text(
        "draft vocab 32768\n"
        "qwen05b-fp16: decode (M=1) 0.800 ms, verify (M=5) 0.990 ms, verify/decode 1.24x "
        "(replays primary 51, verify 104)\n"
        "qwen05b-fp16: verify + MTP chain of 4 1.240 ms (1.55x decode)\n"
    )
    row = _by_name(folder)["0.5B fp16 verify + MTP chain, 32768-id draft vocab / decode"]
    assert (row.figure, row.met) == (1.55, True)
    assert _by_name(folder)["0.5B fp16 verify + MTP chain / decode"].figure == 2.16  # unchanged


#: The head of an ``onnx-genrt profile`` log (its format: onnx_genrt/tools/step_profile.py).
PROFILE = """step 2.900 ms | graph replay alone 2.800 ms | sum of 123 nodes timed alone 3.100 ms
op                                 nodes       ms  share  us/node
GroupQueryAttention                   24    1.891  61.0%     78.8
NormMatMul                            48    0.636  20.5%     13.2
MatMul                                24    0.279   9.0%     11.6
SiluMulMatMul                         24    0.200   6.5%      8.3
top 3 nodes:
  100.0 us  GroupQueryAttention          layer.0.attn
"""


def test_an_unmet_target_names_its_profile_or_says_none_was_written(tmp_path):
    folder = tmp_path / "logs"
    shutil.copytree(LOGS, folder)
    (folder / "profile-long-30000.txt").write_text(PROFILE)
    (folder / "profile-long-8192.txt").write_text(
        "Traceback ...\nprofile failed or timed out (exit 124)\n"
    )
    got = _by_name(folder)
    assert (
        "where the time goes: profile-long-30000.txt (step 2.900 ms, replay 2.800 ms; "
        "GroupQueryAttention 61.0% (24 nodes), NormMatMul 20.5% (48 nodes), MatMul 9.0% (24 nodes))"
    ) in got["decode after 30000 tokens / after 256"].line()
    assert "profile-long-8192.txt (no profile in it: profile failed or timed out (exit 124))" in got[
        "decode after 8192 tokens / after 256"].line()  # fmt: skip
    assert "no step profile (profile-prefill-30000.txt not written)" in got[
        "prefill 30000 tokens, ms"].line()  # fmt: skip
    assert "profile" not in got["0.5B fp16 prefill 512 tokens, ms"].line()  # met: no pointer


def test_the_profile_summary_reads_what_profile_prints():
    """``profile_summary`` against ``onnx-genrt profile``'s own report of known node times."""
    nodes = [NodeTime("MatMul", f"m{i}", 0.5) for i in range(4)]
    nodes += [NodeTime("GroupQueryAttention", "a0", 1.0), NodeTime("Add", "x", 0.25)]
    text = step_profile.report({"step_ms": 3.5, "replay_ms": 3.25, "nodes": nodes}, top=2)
    assert lane_targets.profile_summary(text, ops=2) == (
        "step 3.500 ms, replay 3.250 ms; MatMul 61.5% (4 nodes), GroupQueryAttention 30.8% (1 nodes)"
    )


STUB = """#!/usr/bin/env bash
echo "$*" >>"$STUB_LOG"
case "$*" in *"onnx_genrt profile"*) echo "step 1.000 ms | graph replay alone 0.900 ms";; esac
exit 0
"""


def test_the_lane_scripts_write_every_profile_the_table_names(tmp_path):
    """Run ``scripts/gpu_llm_bench.sh`` and ``scripts/gpu_profiles.sh`` with a stand-in for
    Python (every command succeeds; ``onnx-genrt profile`` prints a line): between them they
    write each step profile that a target of the table names, under that name, and every
    profile the new script writes ran ``onnx-genrt profile`` on CUDA."""
    root = Path(__file__).resolve().parents[2]
    work = tmp_path / "repo"
    shutil.copytree(root / "scripts", work / "scripts")
    (work / ".whl").mkdir()
    (work / ".whl" / "onnxruntime_genai-0.0.0-py3-none-any.whl").write_bytes(b"")
    stub = tmp_path / "python"
    stub.write_text(STUB)
    stub.chmod(0o755)
    out = tmp_path / "out"
    env = {
        **os.environ,
        "PYTHON": str(stub),
        "OUT": str(out),
        "GPU_BENCH_DIR": str(tmp_path / "bench"),
        "STUB_LOG": str(tmp_path / "calls.txt"),
        "HF_BENCH_TIMEOUT": "5",
    }
    for script in ("gpu_llm_bench.sh", "gpu_profiles.sh"):
        done = subprocess.run(["bash", f"scripts/{script}"], cwd=work, env=env,
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    wanted = {t.profile for t in lane_targets.targets(LOGS) if t.profile}
    written = {p.name for p in out.glob("profile-*.txt")}
    assert wanted <= written, sorted(wanted - written)
    profiles = [c for c in (tmp_path / "calls.txt").read_text().splitlines()
                if c.startswith("-m onnx_genrt profile --model")]  # fmt: skip
    for flags in ("--rows 32 --context 96", "--width 5 --mtp", "--width 30000 --context 1",
                  "--context 8192 --steps 10"):  # fmt: skip
        assert any(flags in c and "--provider cuda" in c for c in profiles), flags
    assert "profile failed" not in "".join(p.read_text() for p in out.glob("profile-*.txt"))


def test_stream_rows_unlike_alone_count_the_batched_rows_that_say_no(tmp_path):
    """Issue 17's batched rows must give the single sequence's tokens: the target counts the
    ``N streams`` rows whose "same tokens" column says NO (not --compare-serial's rows)."""
    old = _by_name(LOGS)["0.5B fp16 stream rows unlike alone"]  # a run whose rows all parted
    assert (old.figure, old.met) == (4, False) and "of 4 batched rows" in old.anchor
    same, other = [5, 6, 7], [5, 6, 8]  # the bench compares each row's tokens with row 0's
    rows = [
        BenchRow("onnx-genrt[cuda]", 1.48, 1098.0, same),
        BenchRow("onnx-genrt[cuda,1 streams]", 3.2, 1093.9, same),
        BenchRow("onnx-genrt[cuda,4 streams]", 12.07, 4305.5, same),
        BenchRow("onnx-genrt[cuda,32 streams]", 86.39, 25649.0, other),
        BenchRow("onnx-genrt[cuda,32 streams,serial]", 86.0, 20000.0, other),
    ]
    (tmp_path / "bench-int4.txt").write_text(format_rows(rows))
    assert lane_targets.stream_rows_parting(format_rows(rows)) == (1, 3)
    got = _by_name(tmp_path)
    int4 = got["0.5B int4 stream rows unlike alone"]
    assert (int4.figure, int4.met) == (1, False)
    assert got["0.5B fp16 stream rows unlike alone"].figure is None  # no bench log
    rows[3] = BenchRow("onnx-genrt[cuda,32 streams]", 86.39, 25649.0, same)
    (tmp_path / "bench-int4.txt").write_text(format_rows(rows))
    assert _by_name(tmp_path)["0.5B int4 stream rows unlike alone"].met is True
