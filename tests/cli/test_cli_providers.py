"""Provider lists on the command line (``--provider a,b``) and ``onnx-genrt inspect``."""

from __future__ import annotations

import onnx
import pytest

from onnx_genrt.cli import main as cli_main
from onnx_genrt.core.hookspecs import hookimpl
from onnx_genrt.core.kernels import KernelRegistry
from onnx_genrt.core.registry import ProviderSpec, get_registry, reset_registry
from onnx_genrt.providers.cpu.kernels import REGISTRY
from onnx_genrt.providers.cpu.provider import CPUProvider

from ..models import mlp


class ReluOnly(CPUProvider):
    name = "relu-only"

    @property
    def kernels(self) -> KernelRegistry:
        reg = KernelRegistry()
        reg.add(REGISTRY.lookup("", "Relu", 21))
        return reg


class _Plugin:
    @hookimpl
    def register_providers(self, register):
        register(ProviderSpec("relu-only", factory=ReluOnly, api_version=(1, 0)))


@pytest.fixture
def relu_only():
    reset_registry()
    get_registry().register_plugin(_Plugin(), name="relu-only-plugin")
    yield
    reset_registry()


@pytest.fixture
def mlp_file(tmp_path):
    path = tmp_path / "mlp.onnx"
    onnx.save_model(mlp(hidden=8), str(path))
    return path


def _table(out: str) -> dict[str, str]:
    """node -> provider, from inspect's table."""
    rows = {}
    for line in out.splitlines()[1:]:
        if not line.strip():
            break
        cells = line.split()
        rows[cells[0]] = cells[2]
    return rows


def test_inspect_shows_each_node_on_the_first_provider_that_takes_it(relu_only, mlp_file, capsys):
    assert cli_main(["inspect", "--model", str(mlp_file), "--provider", "relu-only,cpu"]) == 0
    out = capsys.readouterr().out
    where = _table(out)
    assert where["relu"] == "relu-only"
    assert {n: p for n, p in where.items() if n != "relu"} == {
        n: "cpu"
        for n in ("mm1/MatMulAdd", "mm2", "scale", "residual")  # mm1 took its bias
    }
    assert "steps: cpu 4, relu-only 1" in out
    assert "segments: 3 (cpu:1 | relu-only:1 | cpu:3)" in out


def test_inspect_without_fallback_names_the_node_no_provider_takes(relu_only, mlp_file, capsys):
    code = cli_main(
        ["inspect", "--model", str(mlp_file), "--provider", "relu-only", "--no-fallback"]
    )
    assert code == 3
    assert "'mm1' (ai.onnx::MatMul" in capsys.readouterr().err


def test_demo_runs_on_a_provider_list(relu_only, capsys):
    assert cli_main(["demo", "--provider", "relu-only,cpu", "--steps", "4"]) == 0
    assert "provider: relu-only,cpu" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--provider", "cpu", "--provider", "cuda"], "--provider given twice"),
        (["--provider", "cpu,,cuda"], "must be a provider name or a comma-separated list"),
        (["--provider", "cpu,cpu"], "names a provider twice"),
    ],
)
def test_a_bad_provider_list_is_one_line_and_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        cli_main(["generate", "--prompt", "x", *argv])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_generate_takes_a_provider_list(relu_only, capsys):
    code = cli_main(
        [
            "generate",
            "--prompt",
            "import os",
            "--max-new-tokens",
            "4",
            "--provider",
            "relu-only,cpu",
            "--json",
        ]
    )
    assert code == 0
    assert '"text"' in capsys.readouterr().out


def test_conformance_runs_the_provider_under_test_with_its_fallback(relu_only, capsys):
    assert cli_main(["conformance", "--provider", "relu-only,cpu", "--op", "Relu"]) == 0
    out = capsys.readouterr().out
    # test_relu runs its node on relu-only; the expanded form (Max) places nothing there.
    assert out.strip().splitlines()[-1] == "1 passed, 0 failed, 1 skipped"
    assert "on provider 'relu-only,cpu'" in out
