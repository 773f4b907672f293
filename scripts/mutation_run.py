"""Mutation testing for one module at a time (run by hand, outside CI).

Each mutant changes one thing in the module's syntax tree: a comparison operator, ``and``/``or``,
an integer constant by one, a returned boolean negated, or an ``if`` guard that raises removed.
The chosen pytest selection runs once per mutant; a mutant whose run passes *survived* (no
test noticed the change). The module's file is restored after every mutant and on any exit,
Ctrl-C included.

Example:
    .venv/bin/python scripts/mutation_run.py engine/sampling.py -- tests/engine/test_speculative.py
"""

from __future__ import annotations

import argparse
import ast
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

#: One replacement per comparison: the boundary (< and <=) or the negation (== and !=).
COMPARE_SWAPS: dict[type[ast.cmpop], type[ast.cmpop]] = {
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
}
SYMBOLS = {
    ast.Lt: "<",
    ast.LtE: "<=",
    ast.Gt: ">",
    ast.GtE: ">=",
    ast.Eq: "==",
    ast.NotEq: "!=",
    ast.In: "in",
    ast.NotIn: "not in",
    ast.Is: "is",
    ast.IsNot: "is not",
}
PYTEST_RC_PASSED, PYTEST_RC_FAILED, PYTEST_RC_NO_TESTS = 0, 1, 5


@dataclass(frozen=True)
class Mutation:
    """One change: the ``index``-th node of ``ast.walk`` order, rewritten by ``apply``."""

    index: int
    line: int
    description: str
    apply: Callable[[ast.AST], ast.AST | None]


def _is_boolean_expr(node: ast.expr) -> bool:
    if isinstance(node, (ast.Compare, ast.BoolOp)):
        return True
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return True
    if isinstance(node, ast.Constant) and isinstance(node.value, bool):
        return True
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in {"bool", "any", "all", "isinstance"}
    )


def _has_raise(body: list[ast.stmt]) -> bool:
    return any(isinstance(stmt, ast.Raise) for stmt in body)


def _annotation_nodes(tree: ast.AST) -> set[int]:
    """ids of nodes inside annotations (changing ``tuple[int, int]`` is not a mutation)."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        annotations = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            annotations.append(node.returns)
            args = node.args
            for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
                if arg is not None:
                    annotations.append(arg.annotation)
        elif isinstance(node, ast.AnnAssign):
            annotations.append(node.annotation)
        for annotation in annotations:
            if annotation is not None:
                inside.update(id(sub) for sub in ast.walk(annotation))
    return inside


def find_mutations(tree: ast.AST) -> Iterator[Mutation]:
    """Every mutation of ``tree``, in a stable order (the same tree gives the same list)."""
    skip = _annotation_nodes(tree)
    for index, node in enumerate(ast.walk(tree)):
        if id(node) in skip:
            continue
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Compare):
            for position, op in enumerate(node.ops):
                swap = COMPARE_SWAPS[type(op)]
                yield Mutation(
                    index,
                    line,
                    f"{SYMBOLS[type(op)]} -> {SYMBOLS[swap]}",
                    lambda n, p=position, s=swap: _replace_op(n, p, s),
                )
        elif isinstance(node, ast.BoolOp):
            other = ast.Or if isinstance(node.op, ast.And) else ast.And
            names = {ast.And: "and", ast.Or: "or"}
            yield Mutation(
                index,
                line,
                f"{names[type(node.op)]} -> {names[other]}",
                lambda n, o=other: _set(n, op=o()),
            )
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, int)
            and not isinstance(node.value, bool)
        ):
            for delta in (1, -1):
                yield Mutation(
                    index,
                    line,
                    f"{node.value} -> {node.value + delta}",
                    lambda n, d=delta: _set(n, value=n.value + d),
                )
        elif isinstance(node, ast.Return) and node.value is not None:
            if _is_boolean_expr(node.value):
                yield Mutation(
                    index,
                    line,
                    "return X -> return not X",
                    lambda n: _set(n, value=ast.UnaryOp(op=ast.Not(), operand=n.value)),
                )
        elif isinstance(node, ast.If) and _has_raise(node.body):
            yield Mutation(index, line, "if-guard that raises removed", _drop_if)


def _set(node: ast.AST, **fields: object) -> ast.AST:
    for name, value in fields.items():
        setattr(node, name, value)
    return node


def _replace_op(node: ast.Compare, position: int, swap: type[ast.cmpop]) -> ast.AST:
    node.ops[position] = swap()
    return node


def _drop_if(node: ast.If) -> ast.AST:
    """The guard's ``else`` (if any) runs unconditionally; without one, nothing runs."""
    if node.orelse:
        return ast.If(test=ast.Constant(False), body=node.body, orelse=node.orelse)
    return ast.Pass()


class _Rewriter(ast.NodeTransformer):
    def __init__(self, mutation: Mutation, order: dict[int, int]):
        self.mutation = mutation
        self.order = order

    def visit(self, node: ast.AST) -> ast.AST | None:
        if self.order.get(id(node)) == self.mutation.index:
            return self.mutation.apply(node)
        return self.generic_visit(node)


def mutant_source(source: str, mutation: Mutation) -> str:
    """The module's source with ``mutation`` applied (formatting normalised by ast.unparse)."""
    tree = ast.parse(source)
    order = {id(node): i for i, node in enumerate(ast.walk(tree))}
    mutated = _Rewriter(mutation, order).visit(tree)
    return ast.unparse(ast.fix_missing_locations(mutated))


class RestoringFile:
    """Holds a module's original bytes and writes them back on exit, error or signal."""

    def __init__(self, path: Path):
        self.path = path
        self.original = path.read_bytes()
        self.stat = path.stat()

    def write(self, text: str) -> None:
        self.path.write_text(text)
        _drop_bytecode(self.path)

    def restore(self) -> None:
        self.path.write_bytes(self.original)
        os.utime(self.path, ns=(self.stat.st_atime_ns, self.stat.st_mtime_ns))
        _drop_bytecode(self.path)

    def __enter__(self) -> RestoringFile:
        signal.signal(signal.SIGTERM, _raise_interrupt)
        signal.signal(signal.SIGHUP, _raise_interrupt)
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _drop_bytecode(path: Path) -> None:
    """Remove cached bytecode so a mutant of equal size and mtime is never run stale."""
    for cached in (path.parent / "__pycache__").glob(f"{path.stem}.*.pyc"):
        cached.unlink(missing_ok=True)


def run_tests(python: str, selection: list[str], timeout: float) -> tuple[str, float]:
    """('passed' | 'failed' | 'timeout' | 'error <rc>', seconds) for one pytest run."""
    command = [python, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *selection]
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    start = time.monotonic()
    try:
        done = subprocess.run(
            command, env=env, timeout=timeout, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired:
        return "timeout", time.monotonic() - start
    seconds = time.monotonic() - start
    if done.returncode == PYTEST_RC_PASSED:
        return "passed", seconds
    if done.returncode == PYTEST_RC_FAILED:
        return "failed", seconds
    return f"error {done.returncode}", seconds


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Everything after -- goes to pytest (pick a narrow, fast selection).",
    )
    parser.add_argument("module", type=Path, help="the .py file to mutate, e.g. engine/sampling.py")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per mutant run")
    parser.add_argument("--lines", help="only mutate lines FIRST-LAST (e.g. 80-140)")
    parser.add_argument("--start", type=int, default=1, help="resume at mutant number N")
    parser.add_argument("--list", action="store_true", help="print the mutants and stop")
    parser.add_argument("--python", default=sys.executable, help="interpreter that runs pytest")
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    args.pytest_args = argv[split + 1 :]
    if not args.module.is_file() or args.module.suffix != ".py":
        parser.error(f"module {args.module} is not a .py file")
    if not args.pytest_args and not args.list:
        parser.error("give a pytest selection after --, e.g. -- tests/engine/test_speculative.py")
    return args


def _line_filter(spec: str | None) -> Callable[[int], bool]:
    if spec is None:
        return lambda line: True
    first, _, last = spec.partition("-")
    low, high = int(first), int(last or first)
    return lambda line: low <= line <= high


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    source = args.module.read_text()
    wanted = _line_filter(args.lines)
    mutations = [m for m in find_mutations(ast.parse(source)) if wanted(m.line)]
    if args.list:
        for m in mutations:
            print(f"{args.module}:{m.line}: {m.description}")
        return 0
    started = time.monotonic()
    status, seconds = run_tests(args.python, args.pytest_args, args.timeout)
    if status != "passed":
        print(f"the selection does not pass on the unmutated module ({status}); fix that first")
        return 2
    print(f"baseline passed in {seconds:.1f}s; {len(mutations)} mutants", flush=True)
    counts: dict[str, int] = {}
    survivors: list[str] = []
    with RestoringFile(args.module) as target:
        for number, mutation in enumerate(mutations, 1):
            if number < args.start:
                continue
            target.write(mutant_source(source, mutation))
            status, seconds = run_tests(args.python, args.pytest_args, args.timeout)
            target.restore()
            outcome = "survived" if status == "passed" else "killed"
            counts[outcome] = counts.get(outcome, 0) + 1
            where = f"{args.module}:{mutation.line}: {mutation.description}"
            print(f"[{number}/{len(mutations)}] {outcome:8} {status:9} {seconds:5.1f}s {where}")
            if outcome == "survived":
                survivors.append(where)
    minutes = (time.monotonic() - started) / 60
    print(
        f"\n{len(mutations) - args.start + 1} mutants: {counts.get('killed', 0)} killed, "
        f"{counts.get('survived', 0)} survived ({minutes:.1f} min)"
    )
    if survivors:
        print("survivors:")
        print("\n".join(survivors))
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
