"""``onnx-genrt bench --cold``: the first generation in a new process, ours beside
onnxruntime-genai's.

Each run starts a new Python process (:func:`child_command`) that imports
the runtime, loads the model and generates once; rows take turns, ``--repeats`` rounds, and
the table gives each figure's median. What a user of the README's command pays shows here:
imports, kernel compilation or cache loading, speculation's set-up and graph capture inside
the first generation. The warm rows of ``onnx-genrt bench`` hide all of it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

#: Seconds one cold run may take before the bench gives up on it.
RUN_TIMEOUT_S = 600.0


def _child_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="onnx-genrt bench --cold (one run)",
        description="One cold generation (used by `onnx-genrt bench --cold`); prints a JSON line.",
    )
    p.add_argument("runtime", choices=["ours", "genai"])
    p.add_argument("folder", type=Path)
    p.add_argument("--prompt", required=True, help="token ids, comma-separated")
    p.add_argument("--tokens", type=int, required=True, help="new tokens")
    p.add_argument("--provider", default="cpu", help="ours: a comma-separated priority list")
    p.add_argument("--threads", type=int, default=None, help="ours: CPU provider threads")
    p.add_argument("--spec", default=None, help="ours: a speculation kind")
    p.add_argument("-k", type=int, default=None, help="ours: drafts per step")
    return p.parse_args(argv)


def _ours(a: argparse.Namespace, prompt: list[int]) -> dict[str, Any]:
    start = time.perf_counter()
    from onnx_genrt.engine import Model, generate
    from onnx_genrt.generate_cli import provider_args

    imported = time.perf_counter()
    model = Model(a.folder, provider_args(a.provider.split(","), a.threads))
    loaded = time.perf_counter()
    # min_length = the full length: eos is ruled out, as in the warm rows
    res = generate(model, prompt, a.tokens, spec=a.spec, k=a.k, min_length=len(prompt) + a.tokens)
    done = time.perf_counter()
    return {
        "import_s": imported - start,
        "load_s": loaded - imported,
        "first_token_s": res.prefill_seconds,
        "decode_tok_s": res.decode_tokens_per_second,
        "generate_s": done - loaded,
        "tokens": [int(t) for t in res.tokens],
    }


def _genai(a: argparse.Namespace, prompt: list[int]) -> dict[str, Any]:
    start = time.perf_counter()
    import onnxruntime_genai as og

    imported = time.perf_counter()
    model = og.Model(str(a.folder))
    loaded = time.perf_counter()
    params = og.GeneratorParams(model)
    total = len(prompt) + a.tokens
    params.set_search_options(max_length=total, min_length=total, do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(prompt)
    gen.generate_next_token()
    first = time.perf_counter()
    while not gen.is_done():
        gen.generate_next_token()
    done = time.perf_counter()
    tokens = [int(t) for t in gen.get_sequence(0)]
    decoded = len(tokens) - len(prompt) - 1
    return {
        "import_s": imported - start,
        "load_s": loaded - imported,
        "first_token_s": first - loaded,
        "decode_tok_s": decoded / (done - first) if done > first else 0.0,
        "generate_s": done - loaded,
        "tokens": tokens,
    }


def child_main(argv: list[str] | None = None) -> int:
    """One cold run in this (new) process; prints its figures as one JSON line, with the
    wall-clock time it started at (``main_at``: the parent takes the interpreter's start-up
    from it). Nothing of the runtimes is imported before."""
    main_at = time.time()
    a = _child_args(argv)
    prompt = [int(t) for t in a.prompt.split(",")]
    data = (_ours if a.runtime == "ours" else _genai)(a, prompt)
    print(json.dumps({**data, "main_at": main_at}), flush=True)
    return 0


def _cold_rows(args: argparse.Namespace, folder: Path, prompt: list[int], new: int):
    """(label, child argv) per row: ours per provider, per ``--spec``, then genai."""
    from .llm_bench import _spec_entry

    common = [str(folder), "--prompt", ",".join(map(str, prompt)), "--tokens", str(new)]
    rows = []
    for names in args.provider:
        tag = ",".join(names)
        ours = ["ours", *common, "--provider", tag]
        if args.threads:
            ours += ["--threads", str(args.threads)]
        rows.append((f"onnx-genrt[{tag}]", ours))
        for entry in args.spec or []:
            kind, k = _spec_entry(entry, args.k)
            extra = ["--spec", kind] + (["-k", str(k)] if k else [])
            rows.append((f"onnx-genrt[{tag},{entry}]", ours + extra))
    if not args.no_reference:
        rows.append(("onnxruntime-genai", ["genai", *common]))
    return rows


def child_command(argv: list[str]) -> list[str]:
    """The command line of one cold run: a new interpreter calling :func:`child_main`."""
    code = "import sys; from onnx_genrt.tools.cold_start import child_main; sys.exit(child_main())"
    return [sys.executable, "-c", code, *argv]


def _run_child(label: str, argv: list[str]) -> dict[str, Any]:
    from onnx_genrt.core.errors import InvalidInputError

    spawned = time.time()
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            child_command(argv),
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        raise InvalidInputError(f"--cold: {label} took over {RUN_TIMEOUT_S:.0f} s") from None
    wall = time.perf_counter() - start
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise InvalidInputError(f"--cold: the {label} run failed: {last}")
    data = json.loads(lines[-1])
    data["process_s"] = wall
    data["start_s"] = data.pop("main_at") - spawned  # the interpreter's start-up
    return data


def run_cold(args: argparse.Namespace, folder: Path, prompt: list[int], new: int) -> int:
    """The ``--cold`` table: rows in turn, ``args.repeats`` new processes each."""
    rows = _cold_rows(args, folder, prompt, new)
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _ in rows}
    for round_ in range(args.repeats):
        for label, argv in rows:
            print(f"  cold run {round_ + 1}/{args.repeats}: {label}", file=sys.stderr, flush=True)
            runs[label].append(_run_child(label, argv))
    print(format_cold(runs))
    return 0


def format_cold(runs: dict[str, list[dict[str, Any]]]) -> str:
    """One line per row: the medians of the process's wall time, the interpreter's start-up,
    the runtime's import, model load, the first generation's first token and decode rate,
    and whether its tokens equal the first row's."""
    cols = ("process s", "python s", "import s", "load s", "first token ms", "decode tok/s")
    lines = [f"{'runtime (new process each run)':<34}" + "".join(f"{c:>15}" for c in cols)]
    base = next(iter(runs.values()))[0]["tokens"] if runs else []
    for label, results in runs.items():

        def med(key: str, results: list[dict[str, Any]] = results) -> float:
            return statistics.median(r[key] for r in results)

        same = "yes" if results[0]["tokens"] == base else "NO"
        values = (
            med("process_s"),
            med("start_s"),
            med("import_s"),
            med("load_s"),
            med("first_token_s") * 1e3,
            med("decode_tok_s"),
        )
        lines.append(
            f"{label:<34}" + "".join(f"{v:>15.2f}" for v in values) + f"   same tokens {same}"
        )
    return "\n".join(lines)
