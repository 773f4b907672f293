"""The wheel holds every source module: pyproject.toml's package list cannot drop a sub-package.

An editable install imports from the source folders, so a sub-package missing from
``[tool.setuptools] packages`` only shows in a built wheel; this test builds one from a copy
of the working tree (so parallel runs and the tree itself stay untouched).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

#: Source folder -> where its modules land in the wheel (pyproject.toml's package-dir).
SOURCE_ROOTS = {
    "core": "onnx_genrt/core",
    "providers": "onnx_genrt/providers",
    "session": "onnx_genrt/session",
    "engine": "onnx_genrt/engine",
    "onnx_genrt": "onnx_genrt",
}

_NOT_SOURCE = shutil.ignore_patterns(
    ".git",
    ".venv",
    "build",
    "dist",
    "*.egg-info",
    "__pycache__",
    ".*cache",
    ".benchmarks",
    ".whl",
    ".gpu_fixtures",
)


def expected_modules(repo: Path) -> set[str]:
    """Every ``.py`` file of the source folders, as its path inside the wheel."""
    expected = set()
    for folder, target in SOURCE_ROOTS.items():
        for path in (repo / folder).rglob("*.py"):
            if "__pycache__" not in path.parts:
                expected.add(f"{target}/{path.relative_to(repo / folder).as_posix()}")
    return expected


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory) -> set[str]:
    work = tmp_path_factory.mktemp("wheel")
    tree = work / "tree"
    shutil.copytree(REPO, tree, ignore=_NOT_SOURCE, symlinks=True)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(tree), "--no-deps", "--no-build-isolation"]
        + ["--quiet", "-w", str(work / "dist")],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (wheel,) = (work / "dist").glob("onnx_genrt-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        return set(archive.namelist())


def test_every_source_module_is_in_the_wheel(wheel_names):
    expected = expected_modules(REPO)
    assert any(name.startswith("onnx_genrt/providers/cuda/kernels/") for name in expected)
    missing = sorted(expected - wheel_names)
    assert not missing, (
        "modules missing from the wheel; add their packages to pyproject.toml's "
        "[tool.setuptools] packages:\n" + "\n".join(missing)
    )


def test_the_wheel_carries_the_embedded_model(wheel_names):
    default = REPO / "onnx_genrt" / "models" / "default"
    shipped = {
        f"onnx_genrt/models/default/{p.relative_to(default).as_posix()}"
        for p in default.rglob("*")
        if p.is_file()
    }
    assert shipped and not sorted(shipped - wheel_names)
