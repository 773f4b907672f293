"""What the step timers (``profile``, ``step-cost``) share: their flags, the model folder
they time and the owner their decoder runner is lent to."""

from __future__ import annotations

import argparse
from pathlib import Path

from onnx_genrt.cli_args import POSITIVE_INT, add_threads_argument
from onnx_genrt.generate_cli import add_provider_argument, provider_args


def add_step_arguments(p: argparse.ArgumentParser) -> None:
    """Model, providers, the CPU provider's threads, cached positions and timed steps."""
    p.add_argument("--model", type=Path, help="model folder (default: the embedded model)")
    add_provider_argument(p)
    add_threads_argument(p)
    p.add_argument(
        "--context", type=POSITIVE_INT, default=256, help="cached positions before each step"
    )
    p.add_argument("--steps", type=POSITIVE_INT, default=50, help="timed steps (default: 50)")


def step_providers(args: argparse.Namespace) -> list:
    """``--provider`` as the model's provider list, ``--threads`` (when given) going to the
    CPU one."""
    threads = getattr(args, "threads", None)
    return args.provider if threads is None else provider_args(args.provider, threads)


def model_folder(args: argparse.Namespace) -> Path:
    """``--model``, else the embedded model's folder."""
    if args.model is not None:
        return args.model
    from onnx_genrt.models import default_model_path

    return default_model_path()


class RunnerOwner:
    """Holds the decoder runner for a measurement (a model lends its runners to
    weak-referenceable owners, ``Model.acquire_runner``)."""
