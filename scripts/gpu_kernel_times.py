"""Where a graphed decode (or verify) step's time goes, kernel by kernel, on the GPU.

Two modes:

  run DIR [--slot primary|verify] [--steps N] [-k K] [--provider P]
      loads DIR (on CUDA by default), captures the step, times it (median wall time with its
      read-back, ``onnx-genrt step-cost``'s loop), then replays N more steps, on CUDA between
      cudaProfilerStart / Stop. Under Nsight
      Compute with ``--profile-from-start off`` only those N steps' kernels are profiled.
  table CSV --steps N [--wall-ms MS]
      reads ncu's CSV (``--csv --metrics gpu__time_duration.sum``) and prints each kernel's
      launches and microseconds per step, largest first, their sum per step, and (given the
      step's wall time) the share of the step that no kernel covers: launch gaps and waits.

scripts/gpu_kernel_profile.sh runs both for the lane's 0.5B builds. ncu runs each kernel alone
(serialized, caches and clocks left as they are: ``--cache-control none --clock-control
none``), so a kernel's time here is its own, without the overlap programmatic launch gives.
"""

from __future__ import annotations

import argparse
import csv
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

_UNITS = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}


def run(
    folder: Path, slot_name: str, steps: int, k: int, context: int, provider: str = "cuda"
) -> str:
    """Time the step, then replay ``steps`` more between the CUDA profiler's start and stop
    (on ``cuda``); returns the timing line it prints."""
    from onnx_genrt.core.graph_slots import DeviceGraphSlot
    from onnx_genrt.engine import Model
    from onnx_genrt.tools.step_cost import timed_steps
    from onnx_genrt.tools.step_options import RunnerOwner

    slot = DeviceGraphSlot.PRIMARY if slot_name == "primary" else DeviceGraphSlot.VERIFY
    width = 1 if slot is DeviceGraphSlot.PRIMARY else k + 1
    model = Model(folder, [provider])
    runner = model.acquire_runner(RunnerOwner(), context + width + 2)
    runner.forward(list(range(1, context + 1)), None)
    times = timed_steps(runner, context, slot, width, steps=15, warm=5)
    stats = model.session.all_graph_stats()[slot.value]
    notes = "; ".join(model.session.main_provider.status_notes())
    line = (
        f"{folder.name} {slot_name} (M={width}): {statistics.median(times) * 1e3:.3f} ms a step "
        f"with its read-back (median of {len(times)}), replays {stats['replays']}, "
        f"fallbacks {stats.get('fallbacks', 0)}"
    ) + (f"; {notes}" if notes else "")
    print(line, flush=True)
    profiler = None
    if provider == "cuda":
        import cupy

        profiler = cupy.cuda.profiler
        cupy.cuda.runtime.deviceSynchronize()
        profiler.start()
    timed_steps(runner, context, slot, width, steps, warm=0)
    if profiler is not None:
        cupy.cuda.runtime.deviceSynchronize()
        profiler.stop()
    return line


def _short(name: str) -> str:
    """A kernel's name without its argument list and return type (templates kept)."""
    name = re.sub(r"^void\s+", "", name.strip())
    depth = 0
    for i, ch in enumerate(name):
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0:
            return name[:i]
    return name


def table(path: Path, steps: int, wall_ms: float | None) -> None:
    """Per-kernel launches and µs per step from ncu's CSV."""
    rows = path.read_text(errors="replace").splitlines()
    start = next((i for i, r in enumerate(rows) if r.startswith('"ID"')), None)
    if start is None:
        sys.exit(f'{path}: no ncu CSV header ("ID",...) found')
    us: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for rec in csv.DictReader(rows[start:]):
        if rec.get("Metric Name") != "gpu__time_duration.sum":
            continue
        value = float(rec["Metric Value"].replace(",", ""))
        name = _short(rec["Kernel Name"])
        us[name] += value * _UNITS.get(rec["Metric Unit"], 1.0)
        count[name] += 1
    if not us:
        sys.exit(f"{path}: no gpu__time_duration.sum rows")
    total = sum(us.values()) / steps
    launches = sum(count.values()) / steps
    print(f"{'kernel':<60} {'per step':>8} {'us/step':>9} {'share':>6}")
    for name in sorted(us, key=us.get, reverse=True):
        per = us[name] / steps
        print(f"{name[:60]:<60} {count[name] / steps:8.1f} {per:9.1f} {per / total:6.1%}")
    line = f"kernels: {launches:.0f} launches, {total:.1f} us a step"
    if wall_ms:
        gap = wall_ms * 1e3 - total
        line += f"; step {wall_ms * 1e3:.1f} us: {gap:.1f} us ({gap / (wall_ms * 1e3):.0%}) outside kernels"
    print(line)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="mode", required=True)
    r = sub.add_parser("run", help="time the step, then replay --steps steps for the profiler")
    r.add_argument("folder", type=Path)
    r.add_argument("--slot", choices=("primary", "verify"), default="primary")
    r.add_argument("--steps", type=int, default=5)
    r.add_argument("-k", type=int, default=4, help="drafts of a verify step (M=k+1)")
    r.add_argument("--context", type=int, default=32, help="cached tokens before the step")
    r.add_argument("--provider", default="cuda", help="the provider (default: cuda)")
    t = sub.add_parser("table", help="per-kernel table from ncu's CSV")
    t.add_argument("csv", type=Path)
    t.add_argument("--steps", type=int, required=True)
    t.add_argument("--wall-ms", type=float, help="the step's wall time, from `run`")
    a = p.parse_args(argv)
    if a.mode == "run":
        run(a.folder, a.slot, a.steps, a.k, a.context, a.provider)
    else:
        table(a.csv, a.steps, a.wall_ms)
    return 0


if __name__ == "__main__":
    sys.exit(main())
