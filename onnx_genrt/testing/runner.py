"""``onnx-genrt check-provider``: run the kit through ``pytest.main`` and tally it."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from . import OPTION, parse_providers

#: The pytest plugin's entry-point name (``-p`` loads it when autoloading is off).
PLUGIN = "onnx_genrt"


@dataclass(eq=False)
class Tally:
    """A pytest plugin counting outcomes: a test counts once, as failed if any phase failed."""

    outcomes: dict[str, str] = field(default_factory=dict)

    def pytest_runtest_logreport(self, report: Any) -> None:
        previous = self.outcomes.get(report.nodeid)
        if previous == "failed":
            return
        if report.failed:
            self.outcomes[report.nodeid] = "failed"
        elif report.skipped:
            self.outcomes[report.nodeid] = "skipped"
        elif report.when == "call":
            self.outcomes[report.nodeid] = "passed"

    def pytest_collectreport(self, report: Any) -> None:
        if report.failed:
            self.outcomes[f"collect:{report.nodeid}"] = "failed"

    def count(self, outcome: str) -> int:
        return sum(o == outcome for o in self.outcomes.values())

    def summary_line(self) -> str:
        return (
            f"{self.count('passed')} passed, {self.count('failed')} failed, "
            f"{self.count('skipped')} skipped"
        )


def pytest_args(providers: Sequence[str], extra: Sequence[str] = ()) -> list[str]:
    """The pytest command line that runs the kit on ``providers``."""
    load = ["-p", PLUGIN] if os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD") else []
    return [
        "--pyargs",
        "onnx_genrt.testing",
        *load,
        "-p",
        "no:cacheprovider",
        OPTION,
        ",".join(providers),
        *extra,
    ]


def run_kit(providers: Sequence[str], extra: Sequence[str] = ()) -> tuple[int, Tally]:
    """Run the kit in this process; pytest's exit code and the tally."""
    import pytest

    tally = Tally()
    code = pytest.main(pytest_args(providers, extra), plugins=[tally])
    return int(code), tally


def add_parser(sub: Any) -> None:
    """The ``check-provider`` subcommand."""
    p = sub.add_parser(
        "check-provider",
        help="run the provider test kit against the CPU provider and independent references",
        description=(
            "Test an execution provider: ONNX's node tests for the ops it claims, graph "
            "slot lifecycle on a small model, memory and transfer, and a greedy decode of "
            "the embedded model token-identical to the CPU provider. PROVIDERS is the "
            "provider under test, then its fallbacks (e.g. 'mine,cpu'); nodes it does not "
            "claim run on them. Runs 'pytest --pyargs onnx_genrt.testing --provider "
            "PROVIDERS'; the last line is 'N passed, M failed, K skipped'; exit 0 when "
            "nothing failed. Needs pytest."
        ),
    )
    p.add_argument("providers", metavar="PROVIDERS", help="NAME[,FALLBACK...], e.g. mine,cpu")
    p.add_argument("-k", dest="keyword", default=None, help="only tests matching this expression")
    p.add_argument("-v", dest="verbose", action="store_true", help="one line per test")
    p.add_argument("-x", dest="exitfirst", action="store_true", help="stop at the first failure")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    try:
        import pytest  # noqa: F401
    except ImportError:
        print(
            "onnx-genrt check-provider: pytest is not installed (pip install pytest)",
            file=sys.stderr,
        )
        return 2
    from .plugin import KitTarget

    try:
        names = parse_providers(args.providers)
    except ValueError as exc:
        print(f"onnx-genrt check-provider: error: {exc}", file=sys.stderr)
        return 2
    reason = KitTarget(names[0], tuple(names[1:])).unavailable_reason()
    if reason:
        print(f"onnx-genrt check-provider: error: {reason}", file=sys.stderr)
        return 2
    extra = ["-q", "-rfE"] if not args.verbose else ["-v", "-rfE"]
    if args.keyword:
        extra += ["-k", args.keyword]
    if args.exitfirst:
        extra.append("-x")
    code, tally = run_kit(names, extra)
    failed = tally.count("failed")
    if code not in (0, 1) and not failed:  # usage error, internal error, nothing collected
        print(f"onnx-genrt check-provider: pytest stopped with exit code {code}", file=sys.stderr)
        failed = 1
    print(tally.summary_line())
    return 0 if failed == 0 and code == 0 else 1
