"""``onnx-genrt --version``: the installed distribution's version and the provider API."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata

import onnx_genrt
from onnx_genrt.core import PROVIDER_API_VERSION


def test_version_prints_the_distribution_version_and_the_provider_api():
    # The console script's own interpreter, as a user runs it (python -m onnx_genrt).
    done = subprocess.run(
        [sys.executable, "-m", "onnx_genrt", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    major, minor = PROVIDER_API_VERSION
    expected = f"onnx-genrt {metadata.version('onnx-genrt')} (provider API {major}.{minor})"
    assert done.stdout == expected + "\n"
    assert done.stderr == ""


def test_package_version_is_the_distribution_version():
    """pyproject.toml reads its version from ``onnx_genrt.__version__``: one place to bump."""
    assert onnx_genrt.__version__ == metadata.version("onnx-genrt")
