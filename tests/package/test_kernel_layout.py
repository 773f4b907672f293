"""The kernel packages mirror each other: every kernel module is listed where its registry is
built (``KERNEL_MODULES``), every listed module registers ops, and an op both providers
run is defined in a module of the same name in each. The CUDA package is imported with
CuPy replaced by a stub in a child process, so this runs without a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest

import onnx_genrt.providers.cpu.kernels as cpu_kernels
from tests.cuda_stub import run_with_cupy_stub

_LAYOUT = """
import importlib, json
pkg = importlib.import_module(f"onnx_genrt.providers.{sys.argv[1]}.kernels")
homes = {}
for (domain, op), defs in pkg.REGISTRY._defs.items():
    homes[domain + "::" + op] = sorted({d.fn.__module__.rsplit(".", 1)[-1] for d in defs})
print(json.dumps({
    "listed": [m.__name__.rsplit(".", 1)[-1] for m in pkg.KERNEL_MODULES],
    "homes": homes,
}))
"""


def _layout(provider: str) -> dict:
    return run_with_cupy_stub(_LAYOUT, provider)


@pytest.fixture(scope="module")
def layouts() -> dict[str, dict]:
    return {p: _layout(p) for p in ("cpu", "cuda")}


@pytest.mark.parametrize("provider", ["cpu", "cuda"])
def test_every_kernel_module_is_listed_and_registers(layouts, provider):
    folder = Path(cpu_kernels.__file__).parent.parent.parent / provider / "kernels"
    files = {p.stem for p in folder.glob("*.py") if not p.stem.startswith("_")}
    listed = layouts[provider]["listed"]
    assert sorted(listed) == sorted(files), "list each kernel module in KERNEL_MODULES"
    registering = {m for homes in layouts[provider]["homes"].values() for m in homes}
    assert set(listed) - registering == set(), "a listed module registers no kernel"
    assert registering - set(listed) == set(), "kernels defined outside the listed modules"


def test_an_op_of_both_providers_lives_in_modules_of_the_same_name(layouts):
    cpu, cuda = layouts["cpu"]["homes"], layouts["cuda"]["homes"]
    shared = sorted(set(cpu) & set(cuda))
    assert len(shared) > 40  # the LLM ops: a sanity floor, not a target
    apart = {op: (cpu[op], cuda[op]) for op in shared if cpu[op] != cuda[op]}
    assert apart == {}


def test_the_runtime_ops_have_one_module_per_provider(layouts):
    for provider, layout in layouts.items():
        homes = {tuple(h) for op, h in layout["homes"].items() if op.startswith("onnx_genrt::")}
        assert homes == {("genrt",)}, provider
