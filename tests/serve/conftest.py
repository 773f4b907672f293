"""A real ``onnx-genrt serve`` process on 127.0.0.1 for the serving tests, stopped by
SIGTERM (its exit code must be 0), and an in-process reference model."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from onnx_genrt.engine import Model, generate
from onnx_genrt.models import default_model_path

HOST = "127.0.0.1"
MODEL_NAME = "default"
#: Seconds a server gets to become healthy, and to exit after SIGTERM.
START_TIMEOUT = 120.0
STOP_TIMEOUT = 60.0


def free_port() -> int:
    """A port nothing listens on now (the kernel's pick for port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


class ServerProcess:
    """``python -m onnx_genrt serve`` as a subprocess; ``url`` once healthy."""

    def __init__(self, *flags: str, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.log = log
        command = [sys.executable, "-m", "onnx_genrt", "serve", "--host", HOST]
        command += ["--port", str(self.port), *flags]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(log, "wb") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(
                    f"the server exited with {self.process.returncode}:\n{self.output()}"
                )
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.process.kill()
        raise AssertionError(
            f"the server was not healthy within {START_TIMEOUT} s:\n{self.output()}"
        )

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def terminate(self) -> None:
        """Send SIGTERM (once)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def stop(self) -> int:
        """SIGTERM, then the exit code (killed after STOP_TIMEOUT s)."""
        self.terminate()
        try:
            return self.process.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)
            raise AssertionError(
                f"no exit within {STOP_TIMEOUT} s of SIGTERM:\n{self.output()}"
            ) from None


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The embedded model served with 8 rows; must exit 0 on SIGTERM."""
    proc = ServerProcess("--max-batch", "8", log=tmp_path_factory.mktemp("serve") / "server.log")
    yield proc
    code = proc.stop()
    assert code == 0, f"exit code {code} after SIGTERM:\n{proc.output()}"


@pytest.fixture
def small_server(tmp_path: Path) -> Iterator[ServerProcess]:
    """One row and a queue of one: the second waiting request is refused."""
    proc = ServerProcess("--max-batch", "1", "--max-queue", "1", log=tmp_path / "server.log")
    yield proc
    code = proc.stop()
    assert code == 0, f"exit code {code} after SIGTERM:\n{proc.output()}"


@pytest.fixture
def impatient_server(tmp_path: Path) -> Iterator[ServerProcess]:
    """One row and a grace period of 0.2 s: SIGTERM cancels long requests."""
    proc = ServerProcess("--max-batch", "1", "--grace-period", "0.2", log=tmp_path / "server.log")
    yield proc
    code = proc.stop()
    assert code == 0, f"exit code {code} after SIGTERM:\n{proc.output()}"


@pytest.fixture(scope="module")
def reference_model() -> Model:
    return Model(default_model_path())


@pytest.fixture(scope="module")
def reference(reference_model: Model):
    """Greedy text of a prompt generated alone, in-process (cached per prompt and length)."""
    cache: dict[tuple[str, int], str] = {}

    def text(prompt: str, max_new_tokens: int) -> str:
        key = (prompt, max_new_tokens)
        if key not in cache:
            cache[key] = generate(reference_model, prompt, max_new_tokens=max_new_tokens).text
        return cache[key]

    return text
