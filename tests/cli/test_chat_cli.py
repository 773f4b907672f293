"""``onnx-genrt chat`` through a pipe: replies equal greedy generation over the rendered
conversation, the conversation is kept, /reset forgets it, /exit and end of input end."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from onnx_genrt.engine import Model, generate
from onnx_genrt.generate_cli import default_model_dir

SYSTEM = "Write Python."
NEW = 8


def chat(*flags: str, stdin: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "onnx_genrt", "chat", "--max-new-tokens", str(NEW), *flags],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def model() -> Model:
    return Model(default_model_dir())


def reply(model: Model, messages: list[dict[str, str]]) -> str:
    prompt = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return generate(model, prompt, max_new_tokens=NEW).text


def test_a_conversation_keeps_its_history_and_resets(model):
    proc = chat("--system", SYSTEM, stdin="def f(x):\nimport os\n/reset\nimport os\n")
    assert proc.returncode == 0, proc.stderr
    system = {"role": "system", "content": SYSTEM}
    first = [system, {"role": "user", "content": "def f(x):"}]
    answer1 = reply(model, first)
    second = [
        *first,
        {"role": "assistant", "content": answer1},
        {"role": "user", "content": "import os"},
    ]
    answer2 = reply(model, second)
    answer3 = reply(model, [system, {"role": "user", "content": "import os"}])
    assert answer2 != answer3  # the history changed the second reply
    assert proc.stdout == f"{answer1}\n{answer2}\n{answer3}\n"
    assert "(conversation reset)" in proc.stderr


def test_exit_ends_the_session(model):
    proc = chat(stdin="x = 1\n/exit\nimport os\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == reply(model, [{"role": "user", "content": "x = 1"}]) + "\n"


def test_a_model_without_a_template_is_a_model_error(tmp_path: Path):
    folder = tmp_path / "model"
    shutil.copytree(default_model_dir(), folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    proc = chat("--model", str(folder), stdin="hi\n")
    assert proc.returncode == 3
    assert "has no chat_template" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("spec", ["mtp", "ngram"])
def test_speculative_replies_equal_greedy_ones(model, spec):
    """``--spec``: each reply is decoded speculatively (``--stats`` says so, per reply) and
    equals the greedy reply."""
    proc = chat("--spec", spec, "-k", "3", "--stats", stdin="def f(x):\nimport os\n")
    assert proc.returncode == 0, proc.stderr
    first = [{"role": "user", "content": "def f(x):"}]
    answer1 = reply(model, first)
    second = [*first, {"role": "assistant", "content": answer1}]
    answer2 = reply(model, [*second, {"role": "user", "content": "import os"}])
    assert proc.stdout == f"{answer1}\n{answer2}\n"
    assert proc.stderr.count(f"speculation: {spec}, k 3") == 2
