"""``onnx-genrt serve`` refusals: one line on stderr naming the flag or file, and the
documented exit code (2: usage, 3: model)."""

from __future__ import annotations

import socket
import subprocess
import sys

from .conftest import HOST


def serve(*flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "onnx_genrt", "serve", "--host", HOST, *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )


def one_line(proc: subprocess.CompletedProcess[str], code: int, *needles: str) -> None:
    assert proc.returncode == code, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_a_taken_port_is_a_usage_error():
    with socket.socket() as taken:
        taken.bind((HOST, 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        one_line(serve("--port", str(port)), 2, f"--port {port}", "cannot listen")


def test_a_missing_model_folder_is_a_model_error(tmp_path):
    one_line(serve("--port", "0", "--model", str(tmp_path / "nope")), 3, "nope")


def test_bad_flags_are_usage_errors():
    one_line(serve("--max-batch", "0"), 2, "--max-batch", ">= 1")
    one_line(serve("--port", "-1"), 2, "--port")
    # past 65535 the socket layer would listen on the port modulo 65536, elsewhere than asked
    one_line(serve("--port", "99999"), 2, "--port", "from 0 to 65535", "99999")


def test_the_flags_default_to_the_engines_limits():
    """``--max-batch`` and ``--max-queue`` default to the scheduler's own defaults, which
    ``create_app`` and the Ray deployment take too."""
    import argparse
    import inspect

    from onnx_genrt.engine.scheduler import DEFAULT_MAX_BATCH, DEFAULT_MAX_QUEUE, Scheduler
    from onnx_genrt.serve import cli, ray_deployment
    from onnx_genrt.serve.app import create_app

    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve"])
    assert (args.max_batch, args.max_queue) == (DEFAULT_MAX_BATCH, DEFAULT_MAX_QUEUE)
    for fn in (Scheduler.__init__, create_app, ray_deployment.deployment):
        params = inspect.signature(fn).parameters
        assert params["max_batch"].default == DEFAULT_MAX_BATCH, fn
        assert params["max_queue"].default == DEFAULT_MAX_QUEUE, fn
