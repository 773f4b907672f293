"""argparse value types that check a flag's range and finiteness where it is parsed.

A bad value makes argparse report ``argument FLAG: <message>`` (exit code 2, usage)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def int_at_least(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An integer flag of at least ``minimum`` (and, given, at most ``maximum``)."""
    bound = f">= {minimum}" if maximum is None else f"from {minimum} to {maximum}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"must be an integer {bound}, got {value}")
        return value

    parse.__name__ = f"integer {bound}"
    return parse


def finite_float(minimum: float | None = None, above: bool = False) -> Callable[[str], float]:
    """A finite number flag; with ``minimum``, at least it (strictly above it when ``above``)."""
    bound = "" if minimum is None else f" {'>' if above else '>='} {minimum:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        too_low = minimum is not None and (value <= minimum if above else value < minimum)
        if not math.isfinite(value) or too_low:
            raise argparse.ArgumentTypeError(f"must be a finite number{bound}, got {text}")
        return value

    parse.__name__ = f"finite number{bound}"
    return parse


POSITIVE_INT = int_at_least(1)
NON_NEGATIVE_INT = int_at_least(0)
FINITE = finite_float()
NON_NEGATIVE = finite_float(0.0)
POSITIVE = finite_float(0.0, above=True)


def positive_int_list(text: str) -> list[int]:
    """``--streams 1,4,8``: distinct positive integers, in the order given."""
    values = [POSITIVE_INT(part.strip()) for part in text.split(",")]
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"names a value twice: {text!r}")
    return values


positive_int_list.__name__ = "list of positive integers"


def provider_list(text: str) -> list[str]:
    """``--provider a,b``: providers in priority order (the CPU provider is the fallback)."""
    names = [n.strip() for n in text.split(",")]
    if not text.strip() or any(not n for n in names):
        raise argparse.ArgumentTypeError(
            f"must be a provider name or a comma-separated list such as cuda,cpu, got {text!r}"
        )
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"names a provider twice: {text!r}")
    return names


provider_list.__name__ = "provider list"


class Once(argparse.Action):
    """A flag that may be given once: a second one is an error, not a silent override."""

    def __call__(self, parser, namespace, values, option_string=None):  # type: ignore[override]
        if getattr(namespace, f"_{self.dest}_seen", False):
            parser.error(
                f"{option_string} given twice; give several providers once, separated by "
                "commas (for example --provider cuda,cpu)"
            )
        setattr(namespace, f"_{self.dest}_seen", True)
        setattr(namespace, self.dest, values)


def add_threads_argument(p: argparse.ArgumentParser) -> None:
    """``--threads N``: the CPU provider's threads (default: its own, one per physical core)."""
    from onnx_genrt.providers.cpu.cores import physical_cores

    p.add_argument(
        "--threads",
        type=POSITIVE_INT,
        default=None,
        help="CPU provider threads (default: one per physical core this process may use, "
        f"{physical_cores()} here); a core busy with other work costs about its share of a "
        "step: the calling thread waits for it only a bounded time",
    )
