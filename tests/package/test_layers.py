"""The layer rules (docs/architecture.md), checked on the source tree with the ast module.

core <- providers, core <- session <- engine <- the CLI package (``onnx_genrt/``): a layer
imports only itself and the layers below it. Every import counts, including the ones inside
functions and ``importlib.import_module("onnx_genrt....")`` calls with a literal name.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

#: Source folder -> the package it installs as (pyproject.toml's package-dir).
SOURCE_ROOTS = {
    "core": "onnx_genrt.core",
    "providers": "onnx_genrt.providers",
    "session": "onnx_genrt.session",
    "engine": "onnx_genrt.engine",
    "onnx_genrt": "onnx_genrt",
}

#: Layer -> the layers it may import (itself included). ``models`` is the embedded-model data.
ALLOWED = {
    "core": {"core"},
    "providers": {"core", "providers"},
    "session": {"core", "session"},
    "engine": {"core", "session", "engine", "models"},
    "cli": {"core", "providers", "session", "engine", "models", "cli"},
}


@dataclass(frozen=True)
class Import:
    """One import of an ``onnx_genrt`` module: who imports what, and where."""

    source: str  # the importing file, relative to the repository
    line: int
    importer: str  # the importing module's dotted name
    target: str  # the imported name, dotted (for ``from X import y``: X.y)


def layer_of(module: str) -> str:
    """``onnx_genrt.session.plan`` -> ``session``; modules of the CLI package -> ``cli``."""
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in {"core", "providers", "session", "engine", "models"}:
        return parts[1]
    return "cli"


def _module_name(path: Path, folder: Path, package: str) -> tuple[str, bool]:
    parts = list(path.relative_to(folder).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    if is_package:
        parts.pop()
    return ".".join([package, *parts]), is_package


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _dynamic_import(node: ast.Call) -> str | None:
    """The literal module name of ``importlib.import_module("...")`` / ``__import__("...")``."""
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    if name not in {"import_module", "__import__"} or not node.args:
        return None
    first = node.args[0]
    return first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else None


def project_imports(repo: Path) -> Iterator[Import]:
    """Every import of an ``onnx_genrt`` module made by the project's source files."""
    for folder_name, package in SOURCE_ROOTS.items():
        folder = repo / folder_name
        for path in sorted(folder.rglob("*.py")):
            module, is_package = _module_name(path, folder, package)
            source = str(path.relative_to(repo))
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), source)):
                if isinstance(node, ast.Import):
                    targets = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom):
                    # ``from X import y``: y may be a module (``from .. import session``).
                    base = _resolve(node, module, is_package)
                    targets = [base if a.name == "*" else f"{base}.{a.name}" for a in node.names]
                elif isinstance(node, ast.Call):
                    targets = [t for t in [_dynamic_import(node)] if t]
                else:
                    continue
                for target in targets:
                    if target == "onnx_genrt" or target.startswith("onnx_genrt."):
                        yield Import(source, node.lineno, module, target)


def wrong_way_imports(repo: Path) -> list[str]:
    """``file:line: layer -> layer (module)`` for each import the layer rules forbid."""
    return [
        f"{imp.source}:{imp.line}: {layer_of(imp.importer)} imports {imp.target}"
        for imp in project_imports(repo)
        if layer_of(imp.target) not in ALLOWED[layer_of(imp.importer)]
    ]


@pytest.mark.parametrize("layer", ["core", "providers", "session", "engine"])
def test_no_layer_imports_upwards(layer):
    wrong = [w for w in wrong_way_imports(REPO) if w.split(": ")[1].startswith(layer + " ")]
    assert not wrong, "imports against the layer rules (docs/architecture.md):\n" + "\n".join(wrong)


def test_the_scanner_sees_the_project_imports():
    """The rules are only as good as the scan: it must find the imports that do exist."""
    found = {(layer_of(i.importer), layer_of(i.target)) for i in project_imports(REPO)}
    assert {("session", "core"), ("engine", "session"), ("providers", "core")} <= found
    assert {("cli", "engine"), ("engine", "core")} <= found


def test_wrong_way_imports_of_every_form_are_reported(tmp_path):
    """Relative, absolute, function-level and importlib imports against the rules are caught."""
    for folder in SOURCE_ROOTS:
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "core" / "bad.py").write_text(
        "from ..session import plan\n"
        "def f():\n"
        "    import onnx_genrt.engine.model\n"
        "    import importlib\n"
        "    importlib.import_module('onnx_genrt.providers.cpu')\n"
    )
    (tmp_path / "providers" / "cpu").mkdir()
    (tmp_path / "providers" / "cpu" / "__init__.py").write_text("from ...engine import api\n")
    (tmp_path / "session" / "ok.py").write_text(
        "from ..core import errors\nfrom . import plan\nfrom .. import core\n"
    )
    (tmp_path / "engine" / "bad.py").write_text(
        "from onnx_genrt import generate_cli\nfrom .. import providers\n"
    )
    assert wrong_way_imports(tmp_path) == [
        "core/bad.py:1: core imports onnx_genrt.session.plan",
        "core/bad.py:3: core imports onnx_genrt.engine.model",
        "core/bad.py:5: core imports onnx_genrt.providers.cpu",
        "providers/cpu/__init__.py:1: providers imports onnx_genrt.engine.api",
        "engine/bad.py:1: engine imports onnx_genrt.generate_cli",
        "engine/bad.py:2: engine imports onnx_genrt.providers",
    ]


def _executor_reaches(repo: Path) -> list[str]:
    """Engine code that imports ``session.executor`` or reads an ``.executor`` attribute."""
    found = [
        f"{imp.source}:{imp.line}: imports {imp.target}"
        for imp in project_imports(repo)
        if layer_of(imp.importer) == "engine"
        and imp.target.startswith("onnx_genrt.session.executor")
    ]
    for path in sorted((repo / "engine").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr == "executor":
                found.append(f"{path.relative_to(repo)}:{node.lineno}: .executor")
    return found


def test_engine_uses_only_the_public_session_api():
    reaches = _executor_reaches(REPO)
    assert not reaches, "engine code past InferenceSession:\n" + "\n".join(reaches)
