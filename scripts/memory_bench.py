"""Peak resident memory of a generation and the cost of importing the engine, in fresh
processes, beside onnxruntime-genai on the same model folder.

Rows (each a new process, timed round-robin, median of ``--repeats``):

- ``generate``: ``onnx-genrt generate --model DIR --prompt P --max-new-tokens N --ignore-eos``;
- ``onnxruntime-genai``: the same folder, prompt and token count through its Python API;
- ``import baseline``: a process that imports what ``generate`` imports before it reads a
  model (the engine, onnx, the CPU provider's kernel modules and numba) and nothing else;
- ``import onnx_genrt.engine``: ``-X importtime``'s cumulative figure, and that process's peak.

Peak resident memory is ``ru_maxrss`` of each child (``os.wait4``). A child starts with the
peak of the process it was forked from, so this script stays small (the fixture is built in
a child too) and refuses a row that does not rise above its own peak. The target of issue 18 is
``generate`` <= 1.5 x (weights file + import baseline). Without ``--model`` the script builds
(once, cached) the ~52M-parameter int4 builder model of ``tests/llm_fixtures.py``
(``MEMORY_QWEN2``), which needs the test extras.

Where scipy is installed (the test extras bring it; the package alone does not), numba imports
``scipy.linalg`` and its OpenBLAS on its first compiled call (to offer ``np.dot`` in compiled
code, which onnx-genrt's kernels do not use): about 13 MiB of ``generate``'s peak that the
import baseline does not pay. The script says which environment it measured; run it with the
interpreter of an environment made by README's first command (``--no-genai``, with
``--model``) for the figure a user of that command gets.

    python scripts/memory_bench.py [--model DIR] [--tokens 64] [--repeats 5]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import resource
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROMPT = "def fib(n):"

GENAI = """
import sys, onnxruntime_genai as og
model = og.Model(sys.argv[1])
ids = og.Tokenizer(model).encode(sys.argv[2])
params = og.GeneratorParams(model)
total = len(ids) + int(sys.argv[3])
params.set_search_options(max_length=total, min_length=total)
gen = og.Generator(model, params)
gen.append_tokens(ids)
while not gen.is_done():
    gen.generate_next_token()
assert len(gen.get_sequence(0)) == total
"""
BASELINE = "import onnx_genrt.engine, onnx, onnx_genrt.providers.cpu.kernels"


def peak_mib(cmd: list[str]) -> float:
    """Run ``cmd``; its peak resident memory in MiB (it must succeed)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    err = proc.stderr.read().decode() if proc.stderr else ""
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:4])} ... failed ({proc.returncode}):\n{err[-2000:]}")
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if usage.ru_maxrss <= own:  # the child never rose above what it inherited
        raise SystemExit(f"{' '.join(cmd[:4])} ...: its peak is hidden by this script's own")
    return usage.ru_maxrss / 1024  # KiB on Linux


def fixture_folder() -> Path:
    """The ~52M int4 fixture, built (once) in a child so that this process stays small."""
    code = "from tests.llm_fixtures import memory_model; print(memory_model())"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    return Path(done.stdout.strip().splitlines()[-1])


def engine_import_seconds() -> float:
    """``-X importtime``'s cumulative time of ``onnx_genrt.engine`` in a new process."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import onnx_genrt.engine"],
        capture_output=True,
        text=True,
        check=True,
    )
    for line in done.stderr.splitlines():
        fields = [f.strip() for f in line.split("|")]
        if len(fields) == 3 and fields[2] == "onnx_genrt.engine":
            return int(fields[1]) / 1e6
    raise SystemExit("no importtime line for onnx_genrt.engine")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, help="model folder (default: the ~52M int4 fixture)")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-genai", action="store_true", help="skip onnxruntime-genai")
    args = p.parse_args()
    folder = args.model or fixture_folder()
    weights = sum(f.stat().st_size for f in folder.iterdir() if f.name.startswith("model.onnx"))
    cli = str(Path(sys.executable).with_name("onnx-genrt"))
    rows = {
        "generate": [cli, "generate", "--model", str(folder), "--prompt", PROMPT]
        + ["--max-new-tokens", str(args.tokens), "--ignore-eos"],
        "import baseline": [sys.executable, "-c", BASELINE],
        "import onnx_genrt.engine": [sys.executable, "-c", "import onnx_genrt.engine"],
    }
    if not args.no_genai:
        rows["onnxruntime-genai"] = [sys.executable, "-c", GENAI, str(folder), PROMPT]
        rows["onnxruntime-genai"].append(str(args.tokens))
    peaks: dict[str, list[float]] = {name: [] for name in rows}
    seconds: list[float] = []
    for _ in range(args.repeats):  # round-robin: a busy moment hits every row alike
        for name, cmd in rows.items():
            peaks[name].append(peak_mib(cmd))
        seconds.append(engine_import_seconds())
    median = {name: statistics.median(values) for name, values in peaks.items()}
    print(f"model: {folder} (weights {weights / 2**20:.1f} MiB), {args.tokens} new tokens")
    scipy = importlib.util.find_spec("scipy") is not None
    print(
        f"environment: {sys.prefix}; scipy "
        + ("installed: numba imports scipy.linalg on its first call" if scipy else "absent")
    )
    print(f"{'row':28s} {'peak RSS MiB (median)':>22s}  all runs")
    for name, values in peaks.items():
        print(f"{name:28s} {median[name]:22.1f}  {', '.join(f'{v:.0f}' for v in values)}")
    budget = 1.5 * (weights / 2**20 + median["import baseline"])
    print(
        f"generate / (weights + import baseline) = "
        f"{median['generate'] / (weights / 2**20 + median['import baseline']):.2f} "
        f"(target <= 1.5, that is <= {budget:.0f} MiB)"
    )
    print(
        f"import onnx_genrt.engine: {statistics.median(seconds):.3f} s median "
        f"({', '.join(f'{s:.3f}' for s in seconds)}; target <= 0.5 s)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
