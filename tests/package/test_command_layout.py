"""Commands, developer tools and scripts live where docs/architecture.md ("Where new code
goes") says, checked with the ast module:

- every module of the command-line package (``onnx_genrt/*.py``) and of its developer tools
  (``onnx_genrt/tools/``) is reached by imports from ``onnx_genrt/cli.py``: what is installed
  there is an ``onnx-genrt`` command or part of one;
- no installed module runs as ``python -m`` except the command line itself;
- every file of ``scripts/`` (not installed) is listed in ``scripts/README.md``.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = "onnx_genrt"
#: The command line's entry module and the modules that run without it.
ENTRY = "onnx_genrt.cli"
NOT_REACHED_BY_DESIGN = {
    "onnx_genrt": "the package itself (its version)",
    "onnx_genrt.__main__": "python -m onnx_genrt: calls cli.main",
}
#: The package's source folders (pyproject.toml's package-dir) and the modules in them that
#: may run as ``python -m``.
SOURCE_FOLDERS = ("core", "session", "engine", "providers", "onnx_genrt")
RUN_AS_MAIN = {"onnx_genrt/__main__.py", "onnx_genrt/cli.py"}


def command_modules(root: Path) -> dict[str, Path]:
    """Dotted name -> file of every module that must be reached from the command line:
    ``onnx_genrt/*.py`` and ``onnx_genrt/tools/**/*.py``."""
    package = root / PACKAGE
    files = [*package.glob("*.py"), *(package / "tools").rglob("*.py")]
    return {_dotted(path, root): path for path in sorted(files)}


def _dotted(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(path: Path, module: str) -> Iterator[str]:
    """Dotted names ``path`` imports, in functions too, relative imports resolved
    (``from X import y`` gives ``X`` and ``X.y``: y may be a module)."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")
                keep = len(parts) - node.level + (1 if is_package else 0)
                base = ".".join([*parts[:keep], *([base] if base else [])])
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def reached_from(entry: str, modules: dict[str, Path]) -> set[str]:
    """The modules of ``modules`` that importing ``entry`` and calling its functions can
    import (a module's parent packages come with it)."""
    seen: set[str] = set()
    todo = [entry]
    while todo:
        name = todo.pop()
        if name in seen or name not in modules:
            continue
        seen.add(name)
        for imported in imported_names(modules[name], name):
            parts = imported.split(".")
            todo.extend(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return seen


def unreached(root: Path) -> list[str]:
    modules = command_modules(root)
    reached = reached_from(ENTRY, modules)
    return sorted(set(modules) - reached - set(NOT_REACHED_BY_DESIGN))


def runs_as_main(root: Path) -> list[str]:
    """Source files with an ``if __name__ == "__main__":`` block, outside RUN_AS_MAIN."""
    found = []
    for folder in SOURCE_FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            relative = path.relative_to(root).as_posix()
            if relative in RUN_AS_MAIN:
                continue
            tree = ast.parse(path.read_text(encoding="utf-8"), relative)
            found += [
                f"{relative}:{node.lineno}"
                for node in tree.body
                if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)
            ]
    return found


def unlisted_scripts(root: Path) -> list[str]:
    """Files of ``scripts/`` that ``scripts/README.md`` does not name in backticks."""
    readme = root / "scripts" / "README.md"
    named = {
        w for span in re.findall(r"`([^`\n]+)`", readme.read_text("utf-8")) for w in span.split()
    }
    named |= {Path(w).name for w in named}
    files = [p.name for p in sorted((root / "scripts").iterdir()) if p.is_file()]
    return [f for f in files if f != "README.md" and f not in named]


def test_every_command_and_tool_module_is_reached_from_the_command_line():
    missing = unreached(REPO)
    assert not missing, (
        "modules of onnx_genrt/ or onnx_genrt/tools/ that no onnx-genrt command imports: make "
        "them a command (add_parser in cli.build_parser) or move them to scripts/:\n  "
        + "\n  ".join(missing)
    )


def test_only_the_command_line_runs_as_a_module():
    found = runs_as_main(REPO)
    assert not found, (
        "installed modules with a __main__ block (the one door is onnx-genrt / python -m "
        "onnx_genrt; a one-off job is a script in scripts/):\n  " + "\n  ".join(found)
    )


def test_every_script_is_listed_in_the_scripts_readme():
    missing = unlisted_scripts(REPO)
    assert not missing, f"scripts/README.md does not list: {missing}"


def test_the_scans_see_what_they_check(tmp_path):
    """Each scan on a small tree: a tool nobody imports, a helper reached through a relative
    import inside a function, a __main__ block outside the command line, a script left out
    of the README."""
    tools = tmp_path / "onnx_genrt" / "tools"
    tools.mkdir(parents=True)
    (tmp_path / "onnx_genrt" / "__init__.py").write_text("")
    (tmp_path / "onnx_genrt" / "__main__.py").write_text("from .cli import main\n")
    (tmp_path / "onnx_genrt" / "cli.py").write_text(
        "def build():\n    from onnx_genrt.tools import used\n"
        'if __name__ == "__main__":\n    build()\n'
    )
    (tools / "__init__.py").write_text("")
    (tools / "used.py").write_text("def f():\n    from . import helper\n")
    (tools / "helper.py").write_text("X = 1\n")
    (tools / "stray.py").write_text('if __name__ == "__main__":\n    print(1)\n')
    (tmp_path / "onnx_genrt" / "orphan_cli.py").write_text("from .tools import helper\n")
    for folder in SOURCE_FOLDERS[:-1]:
        (tmp_path / folder).mkdir()
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "README.md").write_text("`listed.py --flag` and `sub/deep.sh`\n")
    for name in ("listed.py", "deep.sh", "forgotten.py"):
        (tmp_path / "scripts" / name).write_text("")

    assert reached_from(ENTRY, command_modules(tmp_path)) == {
        "onnx_genrt",
        "onnx_genrt.cli",
        "onnx_genrt.tools",
        "onnx_genrt.tools.used",
        "onnx_genrt.tools.helper",
    }
    assert unreached(tmp_path) == ["onnx_genrt.orphan_cli", "onnx_genrt.tools.stray"]
    assert runs_as_main(tmp_path) == ["onnx_genrt/tools/stray.py:1"]
    assert unlisted_scripts(tmp_path) == ["forgotten.py"]
