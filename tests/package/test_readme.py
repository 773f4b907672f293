"""The documentation's Python blocks run verbatim, and the README starts with the two commands
CI runs.

A fenced ``python`` block runs when the line before it is ``<!-- runnable -->``; in README.md
every Python block must be marked. Each block runs on its own, in a fresh namespace, from a
scratch directory, with the embedded model (a few tokens, so the whole file takes seconds).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RUNNABLE = "<!-- runnable -->"
#: A block that talks to ``onnx-genrt serve`` on 127.0.0.1:8000: the test starts one on a free
#: port and points the block's address there (the only change to its text).
RUNNABLE_WITH_SERVER = "<!-- runnable with a server -->"
SERVER_ADDRESS = "127.0.0.1:8000"
_FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```\s*$", re.M | re.S)


@dataclass(frozen=True)
class Block:
    """One fenced code block of a Markdown file."""

    file: Path
    line: int
    language: str
    code: str
    runnable: bool
    needs_server: bool = False

    @property
    def id(self) -> str:
        return f"{self.file.relative_to(REPO)}:{self.line}"


def code_blocks(path: Path) -> list[Block]:
    """The fenced blocks of ``path``, with their first line and whether they are marked."""
    text = path.read_text(encoding="utf-8")
    blocks = []
    for match in _FENCE.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        line = text.count("\n", 0, match.start()) + 1
        marked = before in (RUNNABLE, RUNNABLE_WITH_SERVER)
        server = before == RUNNABLE_WITH_SERVER
        blocks.append(Block(path, line, match.group(1), match.group(2), marked, server))
    return blocks


def _documents() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def _runnable() -> list[Block]:
    return [b for doc in _documents() for b in code_blocks(doc) if b.runnable]


def test_every_readme_python_block_is_runnable():
    blocks = [b for b in code_blocks(REPO / "README.md") if b.language == "python"]
    assert blocks, "README.md has no Python example"
    unmarked = [b.id for b in blocks if not b.runnable]
    assert not unmarked, f"README Python blocks must run: mark them {RUNNABLE!r}: {unmarked}"


def test_only_python_blocks_are_marked_runnable():
    wrong = [b.id for b in _runnable() if b.language != "python"]
    assert not wrong, f"{RUNNABLE} marks a block that is not Python: {wrong}"


@pytest.mark.parametrize("block", _runnable(), ids=lambda b: b.id)
def test_block_runs_verbatim(block, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    text = block.code
    server = None
    if block.needs_server:
        from tests.serve.conftest import ServerProcess

        assert SERVER_ADDRESS in text, f"{block.id} is marked for a server but names none"
        server = ServerProcess("--max-batch", "2", log=tmp_path / "server.log")
        text = text.replace(SERVER_ADDRESS, f"127.0.0.1:{server.port}")
    try:
        code = compile(text, f"{block.id} (```python block)", "exec")
        exec(code, {"__name__": "__readme__"})  # running the documentation is the test
    finally:
        if server is not None:
            assert server.stop() == 0, server.output()


def test_readme_starts_with_the_two_ci_commands():
    """First block: a virtual environment, the package without test extras, the main job;
    second line: the test extras and the tests. `.ci/run` runs these very lines."""
    first = code_blocks(REPO / "README.md")[0]
    assert first.language == "bash"
    lines = first.code.strip().splitlines()
    assert len(lines) == 2, lines
    setup, tests = lines
    assert re.search(r"-m venv \S+ && \. \S+/bin/activate && ", setup), setup
    assert re.search(r"pip install -e \.( |$)", setup), "command 1 installs `.` only"
    assert "[test]" not in setup
    assert setup.endswith('onnx-genrt generate --prompt "    def __init__(self" --spec mtp --stats')
    assert re.search(r"""pip install -e "\.\[test\]" && python -m pytest$""", tests), tests


_PATH = re.compile(r"^[\w.-]+(/[\w.*-]+)*/([\w.-]+\.(py|sh|md|toml|json|onnx)|)$")


def cited_paths(path: Path) -> set[str]:
    """Repository paths a Markdown file cites in backticks (``core/x.py``, ``tests/ops/``),
    words of cited commands included."""
    words = (
        w for span in re.findall(r"`([^`\n]+)`", path.read_text("utf-8")) for w in span.split()
    )
    return {w for w in words if "/" in w and not w.startswith(("/", ".", "~")) and _PATH.match(w)}


@pytest.mark.parametrize(
    "doc",
    [
        "NOTES.md",
        "docs/architecture.md",
        "docs/performance.md",
        "docs/plugins.md",
        "docs/deploy.md",
        "docs/mutation.md",
        "tests/README.md",
    ],
)
def test_documents_cite_only_files_in_the_repository(doc):
    cited = cited_paths(REPO / doc)
    assert len(cited) >= 3, f"the path scan found too little in {doc}: {cited}"
    missing = sorted(p for p in cited if not any(REPO.glob(p.rstrip("/"))))
    assert not missing, f"{doc} cites files that are not in the repository: {missing}"


_OPTIONS = r"""
import json
from onnx_genrt.providers.cpu.provider import CPUProvider
from onnx_genrt.providers.cuda.provider import CUDAProvider
print(json.dumps([[p.name, o.name, o.default, o.env] for p in (CPUProvider, CUDAProvider)
                  for o in p.OPTIONS]))
"""


def test_readme_options_table_lists_every_provider_option():
    """Each built-in provider option is a row of README's "Provider options" table with its
    default and environment variable (the CUDA provider read with CuPy stubbed)."""
    from tests.cuda_stub import run_with_cupy_stub

    text = (REPO / "README.md").read_text(encoding="utf-8")
    rows = {
        (m.group(1), m.group(2)): m.group(3)
        for m in re.finditer(r"^\| (\w+) \| `(\w+)` \| ([^|]*) \|", text, re.M)
    }
    options = run_with_cupy_stub(_OPTIONS)
    assert len(options) >= 10
    for provider, name, default, env in options:
        cell = rows.get((provider, name))
        assert cell is not None, f"README.md lists no {provider} option {name!r}"
        if env:
            assert f"(`{env}`)" in cell, (provider, name, cell)
        if isinstance(default, bool):
            assert cell.startswith("true" if default else "false"), (provider, name, cell)
        elif isinstance(default, int):
            assert cell.startswith(str(default)), (provider, name, cell)
