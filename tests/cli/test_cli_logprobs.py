"""``onnx-genrt generate --logprobs N``: each generated token's log-probability, as the engine's
``generate(..., logprobs=N)`` gives it (itself checked against onnxruntime in
tests/engine/test_logprobs.py)."""

from __future__ import annotations

import json

import pytest

from onnx_genrt.cli import main
from onnx_genrt.engine import Model, generate
from onnx_genrt.models import default_model_path

PROMPT = "def add(a, b):"


@pytest.fixture(scope="module")
def want():
    return generate(Model(default_model_path()), PROMPT, 4, logprobs=2)


def test_json_lists_each_tokens_logprob(capsys, want) -> None:
    argv = ["generate", "--prompt", PROMPT, "--max-new-tokens", "4", "--logprobs", "2", "--json"]
    assert main(argv) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["text"] == want.text
    assert [e["token"] for e in got["logprobs"]] == want.tokens[want.prompt_tokens :]
    assert [e["logprob"] for e in got["logprobs"]] == pytest.approx(
        [e.logprob for e in want.logprobs], abs=1e-6
    )
    for entry, kept in zip(got["logprobs"], want.logprobs, strict=True):
        assert [t for t, _ in entry["top"]] == [t for t, _ in kept.top]
        assert [lp for _, lp in entry["top"]] == pytest.approx([lp for _, lp in kept.top], abs=1e-6)
    assert main(["generate", "--prompt", PROMPT, "--max-new-tokens", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["logprobs"] is None


def test_text_then_a_line_per_token(capsys, want) -> None:
    assert main(["generate", "--prompt", PROMPT, "--max-new-tokens", "4", "--logprobs", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(PROMPT + want.text + "\n")
    lines = out[len(PROMPT + want.text) + 1 :].splitlines()
    assert len(lines) == 4
    assert [float(line.split()[0]) for line in lines] == pytest.approx(
        [e.logprob for e in want.logprobs], abs=1e-3
    )


@pytest.mark.parametrize(
    ("argv", "needle"),
    [(["--spec", "draft"], "not by a draft model"), (["--logprobs", "21"], "<= 20, got 21")],
)
def test_bad_logprobs_requests_are_one_line(capsys, argv, needle) -> None:
    base = ["generate", "--prompt", "x", "--max-new-tokens", "2"]
    extra = argv if "--logprobs" in argv else ["--logprobs", "1", *argv]
    assert main([*base, *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err, err
