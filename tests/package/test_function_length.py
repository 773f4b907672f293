"""No function of the installed package is over MAX_LINES lines (decorators, signature,
docstring and body together), read with the ast module; the only exceptions are functions
that are generated kernel source, each listed in ALLOWED with its reason.

The walk starts from the package as Python imports it (``onnx_genrt`` and the sub-packages
pyproject.toml maps from other folders, found with ``importlib``), so a new source folder is
walked without being named here. Kernel source kept in string constants is no function and
is not counted. A function past the limit is split along its seams (checks, layout,
launches) instead of being listed here."""

from __future__ import annotations

import ast
import importlib.util
import tomllib
from collections.abc import Iterable, Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

MAX_LINES = 120

#: "module:qualified name" -> why the function may be longer: generated kernel source only
#: (a function whose body is the text of a kernel it emits), never hand-written logic.
ALLOWED: dict[str, str] = {}


def installed_packages() -> list[str]:
    """The packages pyproject.toml installs from a folder of their own (its package-dir)."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    return sorted(config["tool"]["setuptools"]["package-dir"])


def package_sources(packages: Iterable[str]) -> dict[str, Path]:
    """Dotted module name -> file of every module under the packages, where Python imports
    them from (a sub-package inside another's folder is named once)."""
    sources: dict[str, Path] = {}
    for package in packages:
        spec = importlib.util.find_spec(package)
        assert spec and spec.submodule_search_locations, f"{package} is not an installed package"
        for folder in map(Path, spec.submodule_search_locations):
            for path in sorted(folder.rglob("*.py")):
                parts = path.relative_to(folder).with_suffix("").parts
                name = ".".join((package, *parts)).removesuffix(".__init__")
                sources.setdefault(name, path)
    return sources


def functions(path: Path) -> Iterator[tuple[str, int]]:
    """(qualified name, line count) of every function in ``path``, methods and nested
    functions included."""

    def walk(node: ast.AST, prefix: str) -> Iterator[tuple[str, int]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                name = f"{prefix}{child.name}"
                yield name, child.end_lineno - first + 1
                yield from walk(child, f"{name}.<locals>.")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.")
            else:
                yield from walk(child, prefix)

    yield from walk(ast.parse(path.read_text(encoding="utf-8"), str(path)), "")


def long_functions(sources: dict[str, Path], limit: int = MAX_LINES) -> dict[str, int]:
    """``module:function`` -> line count of every function over ``limit`` lines."""
    return {
        f"{module}:{name}": lines
        for module, path in sources.items()
        for name, lines in functions(path)
        if lines > limit
    }


def test_the_walk_covers_every_layer_of_the_installed_package():
    """Every ``.py`` file of pyproject.toml's source folders, found by their paths, is
    walked, whichever import path reaches it."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    folders = config["tool"]["setuptools"]["package-dir"].values()
    on_disk = {p.resolve() for folder in folders for p in (REPO / folder).rglob("*.py")}
    walked = {p.resolve() for p in package_sources(installed_packages()).values()}
    assert walked == on_disk, sorted(map(str, walked ^ on_disk))
    assert len(walked) > 100 and "onnx_genrt.tools.llm_bench" in package_sources(["onnx_genrt"])


def test_no_function_is_over_the_limit_outside_generated_kernel_source():
    found = long_functions(package_sources(installed_packages()))
    over = {name: n for name, n in found.items() if name not in ALLOWED}
    assert not over, (
        f"functions over {MAX_LINES} lines (split them along their seams):\n"
        + "\n".join(f"  {name}: {n} lines" for name, n in sorted(over.items()))
    )


def test_every_allowed_function_still_exists_and_needs_its_exception():
    stale = set(ALLOWED) - set(long_functions(package_sources(installed_packages())))
    assert not stale, f"ALLOWED lists functions that are gone or short enough now: {stale}"


def test_the_scan_counts_decorators_nested_functions_and_methods(tmp_path):
    """The counter on a small file, against line counts known by construction; a kernel
    source string of 200 lines at module level counts as no function."""
    body = "\n".join(f"    x{i} = {i}" for i in range(119))
    kernel = "\n".join(f"  k{i} += 1;" for i in range(200))
    source = (
        f'KERNEL = r"""\n{kernel}\n"""\n\n'
        f"@decorator\ndef long():\n{body}\n\n"  # 1 + 1 + 119 = 121 lines
        f"def short():\n{body}\n\n"  # 120 lines: at the limit, allowed
        "class Holder:\n    def method(self):\n"
        + "\n".join(f"        y{i} = {i}" for i in range(130))
        + "\n\ndef outer():\n    def inner():\n"
        + "\n".join(f"        z{i} = {i}" for i in range(125))
        + "\n"
    )
    (tmp_path / "mod.py").write_text(source, encoding="utf-8")
    assert long_functions({"pkg.mod": tmp_path / "mod.py"}) == {
        "pkg.mod:long": 121,
        "pkg.mod:Holder.method": 131,
        "pkg.mod:outer": 127,
        "pkg.mod:outer.<locals>.inner": 126,
    }
