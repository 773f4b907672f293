"""The command line in real processes: a user error is one line on stderr and a documented
exit code, never a traceback; a closed stdout ends quietly; --debug shows the traceback."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from onnx_genrt.cli import (
    EXIT_BROKEN_PIPE,
    EXIT_INTERNAL,
    EXIT_MODEL,
    EXIT_RUNTIME,
    EXIT_USAGE,
    exit_code,
)
from onnx_genrt.core.errors import (
    InvalidInputError,
    KernelError,
    ModelLoadError,
    NonFiniteError,
    ProviderUnavailableError,
    UnknownProviderError,
    UnsupportedOpError,
)
from onnx_genrt.generate_cli import default_model_dir

GENERATE = ["generate", "--prompt", "def f(", "--max-new-tokens", "2"]


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "onnx_genrt", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _one_line_error(proc: subprocess.CompletedProcess[str], code: int, *needles: str) -> str:
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize(
    ("flags", "needles"),
    [
        (["--threads", "0"], ["argument --threads", "integer >= 1, got 0"]),
        (["--threads", "two"], ["argument --threads", "must be an integer, got 'two'"]),
        (["-k", "0", "--spec", "ngram"], ["argument -k", "integer >= 1, got 0"]),
        (["--do-sample", "--temperature", "nan"], ["argument --temperature", "finite", "nan"]),
        (["--top-p", "inf"], ["argument --top-p", "finite"]),
        (["--seed", "-1"], ["argument --seed", "integer >= 0, got -1"]),
        (["--max-new-tokens", "0"], ["argument --max-new-tokens", "integer >= 1, got 0"]),
        (["--spec", "beam"], ["argument --spec", "invalid choice: 'beam'"]),
    ],
)
def test_bad_flags_are_one_line_usage_errors(flags, needles):
    _one_line_error(_cli(*GENERATE, *flags), EXIT_USAGE, "onnx-genrt generate: error:", *needles)


@pytest.mark.parametrize(
    ("flags", "needles"),
    [
        (["--do-sample", "--temperature", "0"], ["search option temperature (sampling)"]),
        (["--top-p", "1.5"], ["search option top_p", "got 1.5"]),
        (["-k", "3"], ["k=3 needs a speculation kind"]),
    ],
)
def test_option_values_the_engine_refuses_are_usage_errors(flags, needles):
    _one_line_error(_cli(*GENERATE, *flags), EXIT_USAGE, *needles)


def test_unknown_flags_and_commands_are_one_line(tmp_path):
    _one_line_error(_cli(*GENERATE, "--frobnicate"), EXIT_USAGE, "unrecognized arguments")
    _one_line_error(_cli("frobnicate"), EXIT_USAGE, "invalid choice: 'frobnicate'")
    _one_line_error(_cli("demo", "--steps", "0"), EXIT_USAGE, "argument --steps")
    _one_line_error(_cli("conformance", "--timeout", "-1"), EXIT_USAGE, "argument --timeout")
    _one_line_error(_cli("bench", "--repeats", "0"), EXIT_USAGE, "argument --repeats")


@pytest.fixture
def model_copy(tmp_path: Path) -> Path:
    target = tmp_path / "model"
    shutil.copytree(default_model_dir(), target)
    return target


def test_a_corrupt_tokenizer_config_is_a_model_error(model_copy):
    (model_copy / "tokenizer_config.json").write_text('{"chat_template": ')
    proc = _cli(*GENERATE, "--model", str(model_copy))
    _one_line_error(proc, EXIT_MODEL, "tokenizer_config.json is not valid JSON")


def test_a_missing_model_folder_is_a_model_error(tmp_path):
    proc = _cli(*GENERATE, "--model", str(tmp_path / "nowhere"))
    _one_line_error(proc, EXIT_MODEL, "no genai_config.json in")


def test_debug_adds_the_traceback(model_copy):
    (model_copy / "tokenizer_config.json").write_text("[")
    for argv in (["--debug", *GENERATE], [*GENERATE, "--debug"]):
        proc = _cli(*argv, "--model", str(model_copy))
        assert proc.returncode == EXIT_MODEL
        assert "Traceback (most recent call last)" in proc.stderr
        assert "ModelLoadError" in proc.stderr
        assert proc.stderr.rstrip().splitlines()[-1].startswith("onnx-genrt generate: error:")


def test_a_closed_stdout_ends_quietly():
    """Like ``onnx-genrt generate ... | head -c 20``: read 20 bytes, close the pipe."""
    argv = [sys.executable, "-m", "onnx_genrt", "generate", "--prompt", "def f("]
    argv += ["--max-new-tokens", "600", "--ignore-eos"]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
        head = proc.stdout.read(20)
        proc.stdout.close()
        err = proc.stderr.read().decode()
        code = proc.wait(timeout=300)
    assert head.startswith(b"def f(") and len(head) == 20
    assert code == EXIT_BROKEN_PIPE, err
    assert err == ""


def test_a_successful_run_exits_zero():
    proc = _cli(*GENERATE)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("def f(")
    assert proc.stderr == ""


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (InvalidInputError("x"), EXIT_USAGE),
        (ModelLoadError("x"), EXIT_MODEL),
        (UnsupportedOpError("x"), EXIT_MODEL),
        (UnknownProviderError("x"), EXIT_USAGE),  # a wrong name, as a bad flag value
        (ProviderUnavailableError("x"), EXIT_MODEL),  # installed but cannot run here
        (FileNotFoundError(2, "No such file", "m.onnx"), EXIT_MODEL),
        (KernelError("x"), EXIT_RUNTIME),
        (NonFiniteError("x"), EXIT_RUNTIME),
        (MemoryError(), EXIT_RUNTIME),
        (TypeError("x"), EXIT_INTERNAL),
    ],
)
def test_exit_codes_per_kind(exc, code):
    assert exit_code(exc) == code


def test_a_prompt_that_is_not_utf8_is_a_usage_error():
    """Bytes that are not UTF-8 reach Python as lone surrogates (surrogateescape)."""
    argv = [sys.executable.encode(), b"-m", b"onnx_genrt", b"generate", b"--prompt", b"ab\xff"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    _one_line_error(proc, EXIT_USAGE, "lone surrogate '\\udcff' at index 2")


def test_an_unknown_provider_is_a_usage_error_in_every_command(capsys):
    """``--provider nosuch`` exits 2 with one line naming the installed providers, in
    ``generate`` and ``conformance`` alike (``check-provider`` says 2 too); a provider that is
    installed but cannot run stays 3."""
    from onnx_genrt import conformance
    from onnx_genrt.cli import main as cli_main

    assert cli_main(["generate", "--provider", "nosuch", "--prompt", "x"]) == EXIT_USAGE
    err = capsys.readouterr().err.strip()
    assert err.startswith("onnx-genrt generate: error: no provider named 'nosuch' is installed")
    assert "(known: " in err and "\n" not in err
    assert conformance.main(["--provider", "nosuch"]) == EXIT_USAGE
    err = capsys.readouterr().err.strip()
    assert err.startswith("onnx-genrt conformance: error: provider 'nosuch': no provider named")
    assert "Error" not in err  # the message, not the exception's class
    assert cli_main(["check-provider", "nosuch"]) == EXIT_USAGE
