"""The provider test kit (onnx_genrt.testing) and ``onnx-genrt check-provider``: the
example plugin passes it with CPU fallback, deliberately broken providers fail it with a
message naming what went wrong, and docs/plugins.md quotes and runs the example."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from onnx_genrt.cli import main as cli_main
from onnx_genrt.core.hookspecs import hookimpl
from onnx_genrt.core.kernels import KernelRegistry
from onnx_genrt.core.registry import ProviderSpec, get_registry, reset_registry
from onnx_genrt.providers.cpu.kernels import REGISTRY
from onnx_genrt.providers.cpu.provider import CPUProvider
from onnx_genrt.testing import parse_providers
from onnx_genrt.testing.runner import run_kit

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "tests/plugins/example_provider"
DOC = ROOT / "docs/plugins.md"
SUMMARY = re.compile(r"^(\d+) passed, (\d+) failed, (\d+) skipped$")


class WrongAdd(CPUProvider):
    """Add and Relu only; Add is off by 1e-2."""

    name = "wrong-add"
    _only = KernelRegistry()

    @property
    def kernels(self) -> KernelRegistry:
        if not len(self._only):
            self._only.register("Add", since=7)(lambda ctx, a, b: np.add(a, b) + 1e-2)
            self._only.add(REGISTRY.lookup("", "Relu", 21))
        return self._only


class NoReplay(CPUProvider):
    """Captures, then replays nothing: bound outputs keep the captured step's values."""

    name = "no-replay"

    def graph_replay(self, slot, part) -> None:
        pass


class _Broken:
    @hookimpl
    def register_providers(self, register):
        register(ProviderSpec("wrong-add", factory=WrongAdd, api_version=(1, 0)))
        register(ProviderSpec("no-replay", factory=NoReplay, api_version=(1, 0)))


@pytest.fixture
def broken_providers():
    reset_registry()
    get_registry().register_plugin(_Broken(), name="broken-kit-test")
    yield
    reset_registry()


def _last_line(text: str) -> re.Match:
    match = SUMMARY.match(text.strip().splitlines()[-1])
    assert match, f"last line is not 'N passed, M failed, K skipped':\n{text[-2000:]}"
    return match


def test_parse_providers():
    assert parse_providers("a, b,c") == ["a", "b", "c"]
    assert parse_providers(["a,b", "c"]) == ["a", "b", "c"]
    assert parse_providers(None) == ["cpu"]
    with pytest.raises(ValueError, match="twice"):
        parse_providers("a,cpu,a")


STACKS_TEST = """
def test_stack(genrt_provider, genrt_stack, genrt_providers):
    expected = genrt_providers[genrt_providers.index(genrt_provider):]
    assert genrt_stack == expected
    print("STACK", genrt_provider, ",".join(genrt_stack))
"""


def test_ini_gives_the_providers_when_the_command_line_does_not(pytester):
    """``genrt_providers`` in the ini file is the default of ``--provider``: one test per
    name, each falling back on the names after it; ``--provider`` overrides it."""
    pytester.makeini("[pytest]\ngenrt_providers = example,cpu\n")
    pytester.makepyfile(test_stacks=STACKS_TEST)
    result = pytester.runpytest("-s", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*STACK example example,cpu*", "*STACK cpu cpu*"])
    result = pytester.runpytest("-s", "-p", "no:cacheprovider", "--provider", "cpu")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*STACK cpu cpu*"])
    pytester.makeini("[pytest]\ngenrt_providers = a,cpu,a\n")
    result = pytester.runpytest("-p", "no:cacheprovider")
    assert result.ret != pytest.ExitCode.OK
    result.stdout.fnmatch_lines(
        ["*ini genrt_providers: provider list 'a,cpu,a' names a provider twice*"]
    )


def test_cpu_subset_passes(capsys):
    code, tally = run_kit(
        ["cpu"],
        ["-q", "-k", "test_add_bcast or test_relu or test_softmax_axis or slot or transfer"],
    )
    out = capsys.readouterr().out
    assert code == 0 and tally.count("failed") == 0, out[-3000:]
    assert tally.count("passed") >= 60, tally.summary_line()


def test_kernel_with_wrong_values_fails_the_kit(broken_providers, capsys):
    code, tally = run_kit(["wrong-add", "cpu"], ["-q", "-k", "test_add or slot"])
    out = capsys.readouterr().out
    assert code == 1
    assert tally.count("failed") >= 5, tally.summary_line()
    assert "test_add [Add] on wrong-add: output 0 (sum): " in out and "values differ" in out
    assert "bound output differs from numpy float64" in out


def test_replay_that_does_nothing_fails_the_kit(broken_providers, capsys):
    code, tally = run_kit(["no-replay"], ["-q", "-k", "test_slots"])
    out = capsys.readouterr().out
    assert code == 1 and tally.count("failed") >= 3, tally.summary_line()
    assert "slot primary: bound output differs from numpy float64" in out


def test_check_provider_names_an_unknown_provider(capsys):
    assert cli_main(["check-provider", "tpu,cpu"]) == 2
    err = capsys.readouterr().err
    assert "no provider named 'tpu' is registered" in err


def test_check_provider_without_pytest_says_so_in_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "pytest", None)  # import pytest now raises ImportError
    assert cli_main(["check-provider", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["onnx-genrt check-provider: pytest is not installed (pip install pytest)"]


def test_check_provider_help_explains_it(capsys):
    with pytest.raises(SystemExit):
        cli_main(["check-provider", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "provider under test, then its fallbacks" in out
    assert "N passed, M failed, K skipped" in out


@pytest.fixture(scope="module")
def example_site(tmp_path_factory) -> Path:
    """The example plugin installed into a temporary target (as a user's pip would)."""
    target = tmp_path_factory.mktemp("example-site")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(EXAMPLE)],
        capture_output=True, text=True,
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return target


def test_example_plugin_passes_check_provider_with_cpu_fallback(example_site):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(example_site), str(ROOT)])}
    done = subprocess.run(
        [sys.executable, "-m", "onnx_genrt", "check-provider", "example,cpu", "-v"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=600,
    )  # fmt: skip
    passed, failed, _ = map(int, _last_line(done.stdout).groups())
    assert done.returncode == 0 and failed == 0, done.stdout[-4000:] + done.stderr[-2000:]
    passing = set(re.findall(r"::(\S+) PASSED", done.stdout))
    # Its five ops' node cases, the lifecycle in all three slots, transfers, the decode.
    for case in (
        "test_add_bcast",
        "test_mul",
        "test_matmul_2d",
        "test_relu",
        "test_softmax_axis_1",
    ):
        assert f"test_node_case[{case}]" in passing, case
    for slot in ("primary", "verify", "draft"):
        assert f"test_capture_then_replay_with_new_inputs[{slot}]" in passing, slot
        assert f"test_two_sessions_on_one_provider_displace_each_other[{slot}]" in passing, slot
    assert "test_slots_side_by_side" in passing
    assert {"test_read_later_sees_the_values_queued_before_it[float32]",
            "test_read_later_sees_the_values_queued_before_it[float64]"} <= passing  # fmt: skip
    assert "test_greedy_decode_matches_cpu_and_replays" in passing
    assert passed >= 45


def _doc_block(marker: str) -> str:
    text = DOC.read_text()
    start = text.index(f"<!-- {marker} -->")
    body = text[start:].split("```", 2)[1]
    return body.split("\n", 1)[1]


def test_doc_quotes_the_example_plugin_exactly():
    source = (EXAMPLE / "src/onnx_genrt_example_provider/__init__.py").read_text()
    assert _doc_block("example-provider") == source
    assert _doc_block("example-pyproject") == (EXAMPLE / "pyproject.toml").read_text()


def test_doc_benchmark_example_prints_a_row_per_provider(broken_providers, tmp_path, capsys):
    """The doc's benchmark test, run with two providers: one row each, both correct."""
    get_registry().register_plugin(_CpuTwin(), name="cpu-twin")
    (tmp_path / "test_speed.py").write_text(_doc_block("benchmark-example"))
    code = pytest.main(
        [str(tmp_path / "test_speed.py"), "-p", "no:cacheprovider", "--provider", "cpu-twin,cpu",
         "--benchmark-enable", "--benchmark-min-rounds=2", "--benchmark-max-time=0.01",
         "--benchmark-warmup=off", "--rootdir", str(tmp_path)]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out[-3000:]
    assert re.search(r"^test_matmul_speed\[cpu-twin\]\s", out, re.M), out[-3000:]
    assert re.search(r"^test_matmul_speed\[cpu\]\s", out, re.M), out[-3000:]


class _CpuTwin:
    @hookimpl
    def register_providers(self, register):
        class Twin(CPUProvider):
            name = "cpu-twin"

        register(ProviderSpec("cpu-twin", factory=Twin, api_version=(1, 0)))


@pytest.mark.slow
def test_full_cpu_kit_passes():
    done = subprocess.run(
        [sys.executable, "-m", "onnx_genrt", "check-provider", "cpu"],
        capture_output=True, text=True, cwd=ROOT, timeout=3000,
    )  # fmt: skip
    passed, failed, _ = map(int, _last_line(done.stdout).groups())
    assert done.returncode == 0 and failed == 0, done.stdout[-4000:]
    assert passed >= 500
