"""scripts/gpu_kernel_times.py's table: Nsight Compute's CSV grouped by kernel per step."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_kernel_times.py"
HEADER = (
    '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
    '"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"'
)


def _module():
    spec = importlib.util.spec_from_file_location("gpu_kernel_times", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _row(i: int, kernel: str, unit: str, value: str) -> str:
    return (
        f'"{i}","1","python3","h","{kernel}","1","13","(128, 1, 1)","(132, 1, 1)","0","9.0",'
        f'"Command line profiler metrics","gpu__time_duration.sum","{unit}","{value}"'
    )


def test_kernels_are_grouped_per_step_with_units_and_the_time_outside_them(tmp_path, capsys):
    gemv = "void gemv_norm<__half, 4>(const __half *, __half *, int)"
    attn = "gqa_decode<__half, 64, 7>(const __half *, float)"
    lines = ["==PROF== Connected to process 1", HEADER]
    # two steps: the GEMV twice a step (5 us, 5000 ns), attention once (1 us, 0.001 ms)
    for i, (kernel, unit, value) in enumerate(
        [(gemv, "usecond", "5"), (gemv, "nsecond", "5,000"), (attn, "msecond", "0.001")] * 2
    ):
        lines.append(_row(i, kernel, unit, value))
    path = tmp_path / "ncu.csv"
    path.write_text("\n".join(lines) + "\n")
    _module().table(path, steps=2, wall_ms=0.02)
    out = capsys.readouterr().out.splitlines()
    assert out[1].split() == ["gemv_norm<__half,", "4>", "2.0", "10.0", "90.9%"]
    assert out[2].split() == ["gqa_decode<__half,", "64,", "7>", "1.0", "1.0", "9.1%"]
    assert (
        out[-1] == "kernels: 3 launches, 11.0 us a step; step 20.0 us: 9.0 us (45%) outside kernels"
    )


def test_a_file_without_ncu_csv_is_refused_by_name(tmp_path):
    path = tmp_path / "empty.csv"
    path.write_text("==PROF== No kernels were profiled.\n")
    with pytest.raises(SystemExit, match="empty.csv: no ncu CSV header"):
        _module().table(path, steps=1, wall_ms=None)


@pytest.mark.parametrize("slot", ["primary", "verify"])
def test_run_times_the_replayed_step_on_the_cpu_provider(slot, capsys):
    from onnx_genrt.models import default_model_path

    line = _module().run(default_model_path(), slot, steps=2, k=3, context=8, provider="cpu")
    width = 1 if slot == "primary" else 4
    assert line.startswith(f"default {slot} (M={width}): ")
    assert "fallbacks 0" in line and " replays " in line
    assert int(line.split("replays ")[1].split(",")[0]) >= 15  # 20 replays after the capture
    assert capsys.readouterr().out.strip() == line
