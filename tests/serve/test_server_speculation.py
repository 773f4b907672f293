"""``onnx-genrt serve --spec ngram|mtp``: rows speculate by prompt lookup or the model's MTP
head, and every greedy answer still equals its prompt generated alone (the official ``openai`` client against a
real server process on 127.0.0.1)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from . import prometheus_text
from .conftest import MODEL_NAME, ServerProcess
from .test_server import client, metrics

#: Python the embedded model continues with text it repeats (prompt lookup finds drafts).
PROMPTS = ("import os\nimport sys\n", "class Foo:\n    def", "    def __init__(self", "x = [")


@pytest.fixture(scope="module", params=["ngram", "mtp"])
def spec_server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """The embedded model served with 4 rows speculating by prompt lookup or its MTP head."""
    log = tmp_path_factory.mktemp(f"serve-{request.param}") / "server.log"
    proc = ServerProcess("--max-batch", "4", "--spec", request.param, "-k", "3", log=log)
    yield proc
    code = proc.stop()
    assert code == 0, f"exit code {code} after SIGTERM:\n{proc.output()}"


def test_concurrent_answers_equal_each_served_alone(spec_server, reference):
    """16 requests from 8 clients through 4 speculating rows: each greedy answer equals the
    prompt generated alone, and drafts were verified and kept."""
    jobs = [PROMPTS[i % len(PROMPTS)] for i in range(16)]
    expected = {p: reference(p, 40) for p in PROMPTS}
    before = metrics(spec_server)

    def ask(prompt: str) -> tuple[str, str]:
        result = client(spec_server).completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=40, temperature=0
        )
        return prompt, result.choices[0].text

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, jobs, timeout=120))
    wrong = [(p, text, expected[p]) for p, text in answers if text != expected[p]]
    assert not wrong, wrong[:3]
    after = metrics(spec_server)

    def grew(name: str) -> float:
        return prometheus_text.value(after, name) - prometheus_text.value(before, name)

    assert grew("onnx_genrt_speculation_verify_steps_total") > 0
    assert grew("onnx_genrt_speculation_accepted_total") > 0
    assert grew("onnx_genrt_generated_tokens_total") == 16 * 40
    assert prometheus_text.value(after, "onnx_genrt_graph_fallbacks_total", slot="verify") == 0


def test_streamed_chat_completion_equals_served_alone(spec_server, reference, reference_model):
    messages = [{"role": "user", "content": PROMPTS[0]}]
    stream = client(spec_server).chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=30, temperature=0, stream=True
    )
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    rendered = reference_model.tokenizer.apply_chat_template(messages)
    assert "".join(pieces) == reference(rendered, 30)


def test_a_bad_spec_is_one_line_and_exit_2(tmp_path: Path):
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "onnx_genrt", "serve", "--spec", "draft"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "--spec" in done.stderr and "Traceback" not in done.stderr


def test_a_seeded_sampled_completion_repeats(spec_server):
    """Sampled rows speculate too (the rejection rule): the same seed gives the same text,
    another seed another."""

    def sample(seed: int) -> str:
        result = client(spec_server).completions.create(
            model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=32, temperature=0.8, seed=seed
        )
        return result.choices[0].text

    first = sample(5)
    assert first == sample(5) and len(first) > 0
    assert sample(6) != first


def test_a_disconnecting_stream_frees_its_speculating_row(spec_server):
    """A client that goes away mid-stream while rows speculate: its row is freed at the next
    step (counted cancelled), long before its 900 tokens, and the server answers on."""
    import httpx

    before = metrics(spec_server)
    body = {"model": MODEL_NAME, "prompt": "import os", "max_tokens": 900, "temperature": 0}
    url = f"{spec_server.url}/v1/completions"
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=30) as response:
        received = [line for _, line in zip(range(6), response.iter_lines(), strict=False)]
        assert len(received) == 6
    deadline = time.monotonic() + 20
    while metrics(spec_server)[("onnx_genrt_running_rows", ())] != 0:
        assert time.monotonic() < deadline, "the row was not freed"
        time.sleep(0.05)
    after = metrics(spec_server)
    cancelled = ("onnx_genrt_requests_total", (("finish_reason", "cancelled"),))
    assert after[cancelled] - before[cancelled] == 1
    generated = ("onnx_genrt_generated_tokens_total", ())
    assert after[generated] - before[generated] < 600
    result = client(spec_server).completions.create(
        model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=8, temperature=0
    )
    assert result.choices[0].finish_reason == "length"
