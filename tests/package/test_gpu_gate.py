"""``ONNX_GENRT_REQUIRE_GPU=1`` turns every GPU test into a failure when no GPU is usable.

The root conftest is run by pytest's ``pytester`` on a small generated test file, with the
GPU probe patched to say "no GPU" (or "a GPU"), with and without the variable.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

import onnx_genrt.providers.cuda.plugin as cuda_plugin

TESTS = Path(__file__).resolve().parents[1]
GENERATED = """
import pytest

@pytest.fixture
def skipping_fixture():
    pytest.skip("fixture data is absent")

@pytest.mark.gpu
def test_gpu_plain():
    pass

@pytest.mark.gpu
def test_gpu_with_skipping_fixture(skipping_fixture):
    pass

@pytest.mark.gpu
def test_gpu_skipping_in_body():
    pytest.skip("model files are absent")

class TestMarkedClass:
    pytestmark = pytest.mark.gpu

    def test_in_class(self):
        pass

def test_cpu():
    pass
"""
GPU_TESTS = 4
#: The generated tests need no installed pytest plugin (nor one from another checkout).
ISOLATED = ("-p", "no:onnx_genrt")


@pytest.fixture
def gate(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeconftest((TESTS / "conftest.py").read_text().replace("pytest_plugins", "_p"))
    pytester.makeini("[pytest]\nmarkers =\n    gpu: needs a GPU\n")
    pytester.makepyfile(test_generated=GENERATED)
    return pytester


def _no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cuda_plugin, "cuda_unavailable_reason", lambda: "no CUDA here (test)")


def test_without_the_variable_gpu_tests_skip_without_a_gpu(gate, monkeypatch):
    _no_gpu(monkeypatch)
    monkeypatch.delenv("ONNX_GENRT_REQUIRE_GPU", raising=False)
    result = gate.runpytest(*ISOLATED, "-rs")
    result.assert_outcomes(passed=1, skipped=GPU_TESTS)
    result.stdout.fnmatch_lines(["*no GPU: no CUDA here (test)*"])


@pytest.mark.parametrize("value", ["0", ""])
def test_other_values_do_not_require_a_gpu(gate, monkeypatch, value):
    _no_gpu(monkeypatch)
    monkeypatch.setenv("ONNX_GENRT_REQUIRE_GPU", value)
    gate.runpytest(*ISOLATED).assert_outcomes(passed=1, skipped=GPU_TESTS)


def test_with_the_variable_every_gpu_test_fails_without_a_gpu(gate, monkeypatch):
    _no_gpu(monkeypatch)
    monkeypatch.setenv("ONNX_GENRT_REQUIRE_GPU", "1")
    result = gate.runpytest(*ISOLATED)
    result.assert_outcomes(passed=1, errors=GPU_TESTS)  # failed at setup: nothing skips
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        ["*ONNX_GENRT_REQUIRE_GPU=1 but no GPU is usable: no CUDA here (test)*"]
    )


def test_with_the_variable_and_a_gpu_the_tests_run(gate, monkeypatch):
    monkeypatch.setattr(cuda_plugin, "cuda_unavailable_reason", lambda: None)
    monkeypatch.setenv("ONNX_GENRT_REQUIRE_GPU", "1")
    # with a GPU, skips inside the tests are their own business
    gate.runpytest(*ISOLATED).assert_outcomes(passed=3, skipped=2)


def _llm_kernels_module():
    path = TESTS / "providers" / "cuda" / "test_cuda_llm_kernels.py"
    spec = importlib.util.spec_from_file_location("_gate_cuda_llm_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_missing_whole_model_fixtures_fail_when_a_gpu_is_required(monkeypatch, tmp_path):
    module = _llm_kernels_module()
    monkeypatch.setattr(module, "FIXTURES", tmp_path / ".gpu_fixtures")
    monkeypatch.delenv("ONNX_GENRT_REQUIRE_GPU", raising=False)
    with pytest.raises(pytest.skip.Exception, match="is absent"):
        module._fixture("qwen2-fp32")
    monkeypatch.setenv("ONNX_GENRT_REQUIRE_GPU", "1")
    with pytest.raises((pytest.fail.Exception, pytest.skip.Exception)) as outcome:
        module._fixture("qwen2-fp32")
    assert outcome.type is pytest.fail.Exception, "skipped although a GPU run was required"
    assert outcome.match("ONNX_GENRT_REQUIRE_GPU=1: .* is absent")
