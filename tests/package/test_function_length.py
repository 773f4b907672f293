"""No function of the installed source is longer than ``MAX_LINES`` lines (kernel source held
in string constants is not a function): a longer one is split along its seams, or listed here
with the reason. Checked with the ast module."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SOURCES = ("core", "session", "engine", "providers", "onnx_genrt")
MAX_LINES = 120


def long_functions(repo: Path, limit: int) -> list[str]:
    """``path:line name (N lines)`` for each function or method over ``limit`` lines."""
    found = []
    for root in SOURCES:
        for path in sorted((repo / root).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > limit:
                        where = path.relative_to(repo)
                        found.append(f"{where}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_is_longer_than_the_limit():
    assert long_functions(REPO, MAX_LINES) == []


def test_the_scan_finds_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(130))
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "m.py").write_text(f"class C:\n  def f(self):\n{body}\n")
    assert long_functions(tmp_path, MAX_LINES) == ["core/m.py:2 f (131 lines)"]
