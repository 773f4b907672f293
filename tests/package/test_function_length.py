"""No function of the package is over MAX_LINES lines (decorators, signature, docstring and
body together), read with the ast module; the only exceptions are functions that are
generated kernel source, each listed in ALLOWED with its reason.

A function past the limit is split along its seams (checks, layout, launches) instead of
being listed here."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

#: The package's source folders (pyproject.toml's package-dir).
SOURCE_FOLDERS = ("core", "session", "engine", "providers", "onnx_genrt")

MAX_LINES = 120

#: "path:qualified name" -> why the function may be longer: generated kernel source only
#: (a function whose body is the text of a kernel it emits), never hand-written logic.
ALLOWED: dict[str, str] = {}


def functions(path: Path, root: Path) -> Iterator[tuple[str, int, int]]:
    """(``path:qualified.name``, first line, line count) of every function in ``path``."""
    relative = path.relative_to(root).as_posix()

    def walk(node: ast.AST, prefix: str) -> Iterator[tuple[str, int, int]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                name = f"{prefix}{child.name}"
                yield f"{relative}:{name}", first, child.end_lineno - first + 1
                yield from walk(child, f"{name}.<locals>.")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.")
            else:
                yield from walk(child, prefix)

    yield from walk(ast.parse(path.read_text(encoding="utf-8")), "")


def long_functions(root: Path, limit: int = MAX_LINES) -> dict[str, int]:
    """Every function of the source folders under ``root`` over ``limit`` lines."""
    found = {}
    for folder in SOURCE_FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            for name, _, lines in functions(path, root):
                if lines > limit:
                    found[name] = lines
    return found


def test_no_function_is_over_the_limit_outside_generated_kernel_source():
    over = {name: n for name, n in long_functions(REPO).items() if name not in ALLOWED}
    assert not over, (
        f"functions over {MAX_LINES} lines (split them along their seams):\n"
        + "\n".join(f"  {name}: {n} lines" for name, n in sorted(over.items()))
    )


def test_every_allowed_function_still_exists_and_needs_its_exception():
    stale = set(ALLOWED) - set(long_functions(REPO))
    assert not stale, f"ALLOWED lists functions that are gone or short enough now: {stale}"


def test_the_scan_counts_decorators_nested_functions_and_methods(tmp_path):
    """The counter on a small tree, against line counts known by construction."""
    body = "\n".join(f"    x{i} = {i}" for i in range(119))
    source = (
        f"@decorator\ndef long():\n{body}\n\n"  # 1 + 1 + 119 = 121 lines
        f"def short():\n{body}\n\n"  # 120 lines: at the limit, allowed
        "class Holder:\n    def method(self):\n"
        + "\n".join(f"        y{i} = {i}" for i in range(130))
        + "\n\ndef outer():\n    def inner():\n"
        + "\n".join(f"        z{i} = {i}" for i in range(125))
        + "\n"
    )
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "mod.py").write_text(source, encoding="utf-8")
    assert long_functions(tmp_path) == {
        "core/mod.py:long": 121,
        "core/mod.py:Holder.method": 131,
        "core/mod.py:outer": 127,
        "core/mod.py:outer.<locals>.inner": 126,
    }
