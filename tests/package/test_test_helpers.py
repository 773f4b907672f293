"""Test helpers import no command-line or developer-tool module, checked with the ast module.

A helper is a module of ``tests/`` that is not a test file (``conftest.py``, ``models.py``,
``llm_fixtures.py``, ``ops/op_tester.py``, ...), or a module of the installed provider test
kit (``onnx_genrt/testing/``) that is not a test file. They build models and sessions from the
layers below the command line; a helper that imports ``generate_cli`` or a bench ties every
test using it to that command (the embedded model's folder is
``onnx_genrt.models.default_model_path()``). Tests of the commands themselves may import them.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def helper_files(repo: Path) -> list[Path]:
    """The helper modules of tests/ (the plugin distributions in tests/plugins excluded) and
    of the provider test kit."""
    files = [
        p
        for p in sorted((repo / "tests").rglob("*.py"))
        if not p.name.startswith("test_") and "plugins" not in p.relative_to(repo).parts
    ]
    kit = sorted((repo / "onnx_genrt" / "testing").glob("*.py"))
    return files + [p for p in kit if not p.name.startswith("test_")]


def is_command_or_tool(module: str) -> bool:
    """A command-line module (``cli``, ``cli_args``, ``__main__``, ``*_cli``, ``demo``) or a
    developer tool (anything of ``onnx_genrt.tools``) of the ``onnx_genrt`` package."""
    parts = module.split(".")
    if len(parts) < 2 or parts[0] != "onnx_genrt":
        return False
    name = parts[1]
    return name in {"cli", "cli_args", "__main__", "demo", "tools"} or name.endswith("_cli")


def imported_modules(path: Path) -> Iterator[tuple[int, str]]:
    """``(line, dotted name)`` of every absolute import in ``path``, inside functions too
    (``from X import y`` gives ``X.y``: y may be a module)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            for alias in node.names:
                yield node.lineno, f"{node.module}.{alias.name}"


def command_imports(repo: Path) -> list[str]:
    """``file:line: module`` for each helper import of a command or tool module."""
    return [
        f"{path.relative_to(repo)}:{line}: {module}"
        for path in helper_files(repo)
        for line, module in sorted(imported_modules(path))
        if is_command_or_tool(module)
    ]


def test_test_helpers_import_no_command_or_tool_module():
    wrong = command_imports(REPO)
    assert not wrong, (
        "test helpers import command-line or developer-tool modules (use the layers below, "
        "e.g. onnx_genrt.models.default_model_path):\n" + "\n".join(wrong)
    )


def test_the_scan_sees_helpers_and_flags_commands(tmp_path):
    """The rule is only as good as the scan: it finds the helpers, and a helper importing a
    command, at module level or inside a function, is reported."""
    names = {str(p.relative_to(REPO)) for p in helper_files(REPO)}
    assert {"tests/conftest.py", "tests/models.py", "tests/ops/op_tester.py"} <= names
    assert "onnx_genrt/testing/plugin.py" in names
    assert not any(n.startswith("tests/plugins/") for n in names)
    assert not is_command_or_tool("onnx_genrt.engine.model")
    assert not is_command_or_tool("onnx_genrt.conformance")
    (tmp_path / "tests").mkdir()
    (tmp_path / "onnx_genrt" / "testing").mkdir(parents=True)
    (tmp_path / "tests" / "test_ok.py").write_text("from onnx_genrt.generate_cli import x\n")
    (tmp_path / "tests" / "helper.py").write_text(
        "from onnx_genrt import generate_cli\n"
        "def f():\n    from onnx_genrt.tools.dispatch_bench import elementwise_chain\n"
        "import onnx_genrt.tools.step_profile\nfrom onnx_genrt.models import default_model_path\n"
        "from onnx_genrt import tools\n"
    )
    assert command_imports(tmp_path) == [
        "tests/helper.py:1: onnx_genrt.generate_cli",
        "tests/helper.py:3: onnx_genrt.tools.dispatch_bench.elementwise_chain",
        "tests/helper.py:4: onnx_genrt.tools.step_profile",
        "tests/helper.py:6: onnx_genrt.tools",
    ]
