"""Verify-step cost against decode-step cost: graphed M=1 (PRIMARY) and M=k+1 (VERIFY).

The ratio projects speculative speed-up: with mean accepted length a, a speculative step
emits a+1 tokens for one verify plus the proposer's cost, against a+1 decode steps.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from onnx_genrt.cli_args import POSITIVE_INT
from onnx_genrt.core.graph_slots import DeviceGraphSlot

from .step_options import RunnerOwner, add_step_arguments, model_folder, step_providers


def timed_steps(
    runner: Any,
    context: int,
    slot: DeviceGraphSlot,
    width: int,
    steps: int,
    warm: int = 3,
    after: Any = None,
) -> list[float]:
    """Seconds of ``steps`` steps of ``width`` rows in ``slot`` after ``context`` cached
    positions (rewound before each), each with its ids read back as a step does; the first
    ``warm`` (the capture among them) are run but not timed."""
    tokens = list(range(7, 7 + width))
    times = []
    for i in range(steps + warm):
        runner.rewind_to(context)
        start = time.perf_counter()
        _ = runner.forward(tokens, slot, width, after=after).tokens
        if i >= warm:
            times.append(time.perf_counter() - start)
    return times


def measure(folder: Path, provider: Any, k: int, context: int, steps: int) -> dict[str, Any]:
    """Median ms of a decode step, a verify step and (with an MTP head) a verify step with
    the MTP chain queued after it, each including its read-back; ``notes``: what the main
    provider says of itself (``status_notes``, e.g. whether programmatic launch is on)."""
    from onnx_genrt.engine import Model
    from onnx_genrt.engine.api import make_proposer

    model = Model(folder, provider)
    owner = RunnerOwner()
    runner = model.acquire_runner(owner, context + k + 2)
    runner.forward(list(range(1, context + 1)), None)
    cases = [
        ("decode", DeviceGraphSlot.PRIMARY, 1, None),
        ("verify", DeviceGraphSlot.VERIFY, k + 1, None),
    ]
    if model.config.speculative.get("mtp"):
        proposer = make_proposer(model, "mtp", context + k + 2)
        hook = proposer.chain_hook(runner, k, k, context)
        if hook is not None:
            cases.append(("verify+mtp", DeviceGraphSlot.VERIFY, k + 1, hook))
    times = {
        name: timed_steps(runner, context, slot, width, steps, after=hook)
        for name, slot, width, hook in cases
    }
    stats = model.session.all_graph_stats()
    out: dict[str, Any] = {name: statistics.median(v) * 1e3 for name, v in times.items()}
    out["ratio"] = out["verify"] / out["decode"]
    out["replays_primary"] = stats["primary"]["replays"]
    out["replays_verify"] = stats["verify"]["replays"]
    out["notes"] = model.session.main_provider.status_notes()
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The step flags, then the drafts per verify step."""
    add_step_arguments(p)
    p.add_argument("-k", type=POSITIVE_INT, default=4, help="drafts per verify step (default: 4)")


def run(a: argparse.Namespace) -> int:
    """``onnx-genrt step-cost``: measure, print the two lines."""
    folder = model_folder(a)
    r = measure(folder, step_providers(a), a.k, a.context, a.steps)
    print(
        f"{folder.name}: decode (M=1) {r['decode']:.3f} ms, verify (M={a.k + 1}) {r['verify']:.3f} ms, "
        f"verify/decode {r['ratio']:.2f}x (replays primary {r['replays_primary']}, verify {r['replays_verify']})"
    )
    if r["notes"]:
        print(f"{folder.name}: {'; '.join(r['notes'])}")
    if "verify+mtp" in r:
        print(
            f"{folder.name}: verify + MTP chain of {a.k} {r['verify+mtp']:.3f} ms "
            f"({r['verify+mtp'] / r['decode']:.2f}x decode)"
        )
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "step-cost",
        help="verify step (M=k+1) against decode step (M=1), graphed: what speculation can gain",
        description=__doc__,
    )
    add_arguments(p)
    p.set_defaults(func=run)
