"""``onnx-genrt serve`` as a real process on 127.0.0.1, driven by the official ``openai``
client and by httpx; greedy answers are checked against ``generate`` run in-process."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from . import prometheus_text
from .conftest import MODEL_NAME, ServerProcess

#: A prompt the embedded model continues for hundreds of tokens without end of sequence.
LONG_PROMPT = "import os"
PROMPTS = (
    "def add(a, b):",
    "import os",
    "class Foo:",
    "x = 1",
    "for i in range(10):",
    "    def __init__(self",
    "return",
    '"""Utilities."""',
)


def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def metrics(server: ServerProcess) -> dict:
    response = httpx.get(f"{server.url}/metrics", timeout=10)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return prometheus_text.parse(response.text)


def wait_for(condition, seconds: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"{what} did not hold within {seconds} s")


def test_models_lists_the_served_model(server):
    assert [m.id for m in client(server).models.list().data] == [MODEL_NAME]


def test_completion_equals_generate(server, reference, reference_model):
    result = client(server).completions.create(
        model=MODEL_NAME, prompt="def add(a, b):", max_tokens=12, temperature=0
    )
    choice = result.choices[0]
    assert choice.text == reference("def add(a, b):", 12)
    assert choice.finish_reason == "length"
    assert result.usage.prompt_tokens == len(reference_model.tokenizer.encode("def add(a, b):"))
    assert result.usage.completion_tokens == 12
    assert result.usage.total_tokens == result.usage.prompt_tokens + 12


def test_a_prompt_of_token_ids(server, reference, reference_model):
    ids = reference_model.tokenizer.encode("class Foo:")
    result = client(server).completions.create(
        model=MODEL_NAME, prompt=ids, max_tokens=6, temperature=0
    )
    assert result.choices[0].text == reference("class Foo:", 6)
    assert result.usage.prompt_tokens == len(ids)


def test_a_stop_string_ends_the_answer_before_it(server, reference):
    full = reference("def add(a, b):", 12)
    stop = full[6:9]
    result = client(server).completions.create(
        model=MODEL_NAME, prompt="def add(a, b):", max_tokens=12, temperature=0, stop=[stop]
    )
    assert result.choices[0].text == full[: full.index(stop)]
    assert result.choices[0].finish_reason == "stop"
    # A stop string whose start ends the answer: held back, then given at the end.
    result = client(server).completions.create(
        model=MODEL_NAME,
        prompt="def add(a, b):",
        max_tokens=12,
        temperature=0,
        stop=[full[-2:] + "QQ"],
    )
    assert result.choices[0].text == full
    assert result.choices[0].finish_reason == "length"


def test_a_seeded_sample_repeats(server):
    def sample() -> str:
        return (
            client(server)
            .completions.create(
                model=MODEL_NAME, prompt="import", max_tokens=8, temperature=1.3, top_p=0.95, seed=7
            )
            .choices[0]
            .text
        )

    assert sample() == sample()


def test_chat_completion_renders_the_template(server, reference, reference_model):
    messages = [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": "def fib(n):"},
    ]
    result = client(server).chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=10, temperature=0
    )
    rendered = reference_model.tokenizer.apply_chat_template(messages)
    assert rendered == "system: You write Python.\nuser: def fib(n):\nassistant:"
    assert result.choices[0].message.role == "assistant"
    assert result.choices[0].message.content == reference(rendered, 10)
    assert result.usage.prompt_tokens == len(reference_model.tokenizer.encode(rendered))


def test_streamed_chat_completion(server, reference, reference_model):
    messages = [{"role": "user", "content": "import sys"}]
    stream = client(server).chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        max_tokens=14,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, reasons, usage = [], [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            reasons.append(choice.finish_reason)
    rendered = reference_model.tokenizer.apply_chat_template(messages)
    assert "".join(pieces) == reference(rendered, 14)
    assert reasons[-1] == "length" and set(reasons[:-1]) == {None}
    assert usage is not None and usage.completion_tokens == 14
    assert len(pieces) > 2  # streamed in pieces, not in one chunk


def test_a_slow_reader_of_a_streamed_completion_gets_every_piece(server, reference):
    """The openai client pauses after the first chunk: the pieces made meanwhile go out
    together (several events in one write), and the client still reads one chunk per
    piece, the text generated alone, the finish reason last, then the usage."""
    stream = client(server).completions.create(
        model=MODEL_NAME,
        prompt="def add(a, b):",
        max_tokens=48,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, reasons, usage = [], [], None
    for index, chunk in enumerate(stream):
        if index == 0:
            time.sleep(0.5)  # the rest of the answer is made meanwhile (~50 ms of work)
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.text)
            reasons.append(choice.finish_reason)
    assert "".join(pieces) == reference("def add(a, b):", 48)
    assert reasons[-1] == "length" and set(reasons[:-1]) == {None}
    assert usage is not None and usage.completion_tokens == 48
    assert len(pieces) > 2


def test_stream_is_server_sent_events_ending_done(server):
    body = {"model": MODEL_NAME, "prompt": "x = 1", "max_tokens": 4, "temperature": 0}
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=30
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert {c["object"] for c in chunks} == {"text_completion"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_concurrent_clients_get_the_answers_served_alone(server, reference):
    """64 requests from 16 threads: each greedy answer equals the prompt generated alone
    (different lengths, so rows join and leave the batch at different steps)."""
    lengths = {p: 4 + 2 * i for i, p in enumerate(PROMPTS)}
    jobs = [PROMPTS[i % len(PROMPTS)] for i in range(64)]
    expected = {p: reference(p, n) for p, n in lengths.items()}
    local = threading.local()

    def ask(prompt: str) -> tuple[str, str]:
        if not hasattr(local, "client"):
            local.client = client(server)
        result = local.client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=lengths[prompt], temperature=0
        )
        return prompt, result.choices[0].text

    before = metrics(server)
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, jobs, timeout=120))
    assert len(answers) == 64
    wrong = [(p, text, expected[p]) for p, text in answers if text != expected[p]]
    assert not wrong, wrong[:3]
    after = metrics(server)
    served = prometheus_text.value(after, "onnx_genrt_requests_total", finish_reason="length")
    assert (
        served - prometheus_text.value(before, "onnx_genrt_requests_total", finish_reason="length")
        == 64
    )
    # Rows were batched: fewer decode steps than tokens.
    steps = (
        after[("onnx_genrt_decode_steps_total", ())] - before[("onnx_genrt_decode_steps_total", ())]
    )
    tokens = (
        after[("onnx_genrt_generated_tokens_total", ())]
        - before[("onnx_genrt_generated_tokens_total", ())]
    )
    assert tokens == sum(lengths[p] for p in jobs)
    assert steps < tokens


@pytest.mark.parametrize(
    ("field", "value", "param"),
    [
        ("frobnicate", 1, "frobnicate"),
        ("temperature", 2.5, "temperature"),
        ("temperature", "hot", "temperature"),
        ("top_p", 0, "top_p"),
        ("max_tokens", 0, "max_tokens"),
        ("max_tokens", True, "max_tokens"),
        ("presence_penalty", 2.5, "presence_penalty"),
        ("logit_bias", {"x": 1}, "logit_bias"),
        ("logit_bias", {"5": 101}, "logit_bias"),
        ("logit_bias", {"999999": 1}, "logit_bias"),
        ("frequency_penalty", "high", "frequency_penalty"),
        ("n", 0, "n"),
        ("n", 17, "n"),
        ("n", 1.5, "n"),
        ("stop", ["a", "b", "c", "d", "e"], "stop"),
        ("logprobs", 6, "logprobs"),
        ("logprobs", True, "logprobs"),
        ("top_logprobs", 2, "top_logprobs"),
        ("prompt", "", "prompt"),
        ("prompt", ["a", "b"], "prompt"),
        ("stream", "yes", "stream"),
        ("seed", -1, "seed"),
    ],
)
def test_bad_fields_get_400_with_an_openai_error_body(server, field, value, param):
    body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 2, field: value}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert param in error["message"]


@pytest.mark.parametrize(
    ("messages", "needle"),
    [
        ([], "empty"),
        ([{"role": "wizard", "content": "hi"}], "role"),
        ([{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "content"),
        ("hello", "list"),
    ],
)
def test_bad_messages_get_400(server, messages, needle):
    body = {"model": MODEL_NAME, "messages": messages}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "messages" and needle in error["message"]


def test_the_openai_client_raises_on_a_bad_field(server):
    with pytest.raises(openai.BadRequestError) as caught:
        client(server).completions.create(
            model=MODEL_NAME, prompt="x", max_tokens=2, extra_body={"best_of": 3}
        )
    assert caught.value.body["param"] == "best_of"


def test_unknown_model_and_bad_json(server):
    response = httpx.post(
        f"{server.url}/v1/completions", json={"model": "gpt-9", "prompt": "x"}, timeout=30
    )
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"
    response = httpx.post(
        f"{server.url}/v1/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_json"
    too_long = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 5000}
    response = httpx.post(f"{server.url}/v1/completions", json=too_long, timeout=30)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize(
    ("method", "path", "status"), [("GET", "/v1/nothing", 404), ("GET", "/v1/completions", 405)]
)
def test_unknown_paths_and_methods_get_openai_error_bodies(server, method, path, status):
    response = httpx.request(method, f"{server.url}{path}", timeout=10)
    assert response.status_code == status
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_a_disconnecting_stream_frees_its_row(server):
    before = metrics(server)
    body = {"model": MODEL_NAME, "prompt": LONG_PROMPT, "max_tokens": 900, "temperature": 0}
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=30
    ) as response:
        lines = response.iter_lines()
        received = [line for _, line in zip(range(6), lines, strict=False)]
        assert len(received) == 6
        assert prometheus_text.value(metrics(server), "onnx_genrt_running_rows") == 1
    # The client is gone: the row is freed at the next step, long before 900 tokens.
    wait_for(
        lambda: metrics(server)[("onnx_genrt_running_rows", ())] == 0, what="running rows back to 0"
    )
    after = metrics(server)
    cancelled = ("onnx_genrt_requests_total", (("finish_reason", "cancelled"),))
    assert after[cancelled] - before[cancelled] == 1
    generated = ("onnx_genrt_generated_tokens_total", ())
    assert after[generated] - before[generated] < 300


def test_a_client_that_gives_up_on_a_whole_answer_frees_its_row(server):
    before = metrics(server)
    # As many tokens as the context holds, so no run of the embedded model finishes within
    # the client's patience (0.05 s: 20000 tok/s would be needed; greedy at two threads
    # reaches about 5000 here, which finished within the 0.3 s this test once gave).
    body = {"model": MODEL_NAME, "prompt": LONG_PROMPT, "max_tokens": 1000, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.05))
    wait_for(
        lambda: metrics(server)[("onnx_genrt_running_rows", ())] == 0, what="running rows back to 0"
    )
    after = metrics(server)
    generated = ("onnx_genrt_generated_tokens_total", ())
    assert after[generated] - before[generated] < 1000  # stopped before the end
    cancelled = ("onnx_genrt_requests_total", (("finish_reason", "cancelled"),))
    assert after[cancelled] - before[cancelled] == 1


def test_metrics_are_prometheus_text(server):
    client(server).completions.create(model=MODEL_NAME, prompt="x", max_tokens=3, temperature=0)
    samples = metrics(server)
    names = {name for name, _ in samples}
    for name in (
        "onnx_genrt_queue_depth",
        "onnx_genrt_running_rows",
        "onnx_genrt_tokens_per_second",
        "onnx_genrt_time_to_first_token_seconds_bucket",
        "onnx_genrt_time_to_first_token_seconds_count",
        "onnx_genrt_graph_replays_total",
        "onnx_genrt_graph_fallbacks_total",
        "onnx_genrt_requests_total",
    ):
        assert name in names, name
    assert prometheus_text.value(samples, "onnx_genrt_time_to_first_token_seconds_count") >= 1
    assert prometheus_text.value(samples, "onnx_genrt_tokens_per_second") > 0
    assert prometheus_text.value(samples, "onnx_genrt_graph_replays_total", slot="primary") > 0
    # Batched decode replays its bucket graphs: no eager fallback.
    assert prometheus_text.value(samples, "onnx_genrt_graph_fallbacks_total", slot="primary") == 0
    try:  # prometheus_client's own parser too, where it is installed (not a dependency)
        from prometheus_client.parser import text_string_to_metric_families
    except ImportError:
        return
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["onnx_genrt_time_to_first_token_seconds"].type == "histogram"
    assert families["onnx_genrt_requests"].type == "counter"


def test_a_full_queue_gets_429(small_server):
    """One row, a queue of one: a running request and a queued one; the third gets 429."""
    body = {"model": MODEL_NAME, "max_tokens": 900, "temperature": 0}
    url = f"{small_server.url}/v1/completions"
    with httpx.stream(
        "POST", url, json={**body, "prompt": LONG_PROMPT, "stream": True}, timeout=30
    ) as running:
        lines = running.iter_lines()  # kept: closing the iterator closes the stream
        next(lines)  # admitted: its row generates
        queued: list[httpx.Response] = []
        waiter = threading.Thread(
            target=lambda: queued.append(
                httpx.post(url, json={**body, "prompt": "x", "max_tokens": 2}, timeout=60)
            )
        )
        waiter.start()
        wait_for(
            lambda: metrics(small_server)[("onnx_genrt_queue_depth", ())] == 1,
            what="one queued request",
        )
        refused = httpx.post(url, json={**body, "prompt": "y"}, timeout=30)
        assert refused.status_code == 429
        error = refused.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["code"] == "queue_full"
        with pytest.raises(openai.RateLimitError):
            client(small_server).completions.create(model=MODEL_NAME, prompt="y", max_tokens=2)
    waiter.join(60)  # the stream closed: its row went to the queued request
    assert queued and queued[0].status_code == 200
    samples = metrics(small_server)
    assert (
        prometheus_text.value(samples, "onnx_genrt_rejected_requests_total", reason="queue_full")
        == 2
    )


def test_n_answers_that_do_not_fit_the_queue_get_429_and_leave_nothing(small_server):
    """One row and a queue of one: n=3 answers cannot all be taken; the request gets 429
    and the answers queued before the refusal are cancelled, not run."""
    url = f"{small_server.url}/v1/completions"
    body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 900, "temperature": 0, "n": 3}
    refused = httpx.post(url, json=body, timeout=30)
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "queue_full"
    wait_for(
        lambda: (
            metrics(small_server)[("onnx_genrt_running_rows", ())] == 0
            and metrics(small_server)[("onnx_genrt_queue_depth", ())] == 0
        ),
        what="no row or queue entry left",
    )
    answer = httpx.post(url, json={**body, "n": 1, "max_tokens": 2}, timeout=60)
    assert answer.status_code == 200 and len(answer.json()["choices"]) == 1
    assert metrics(small_server)[("onnx_genrt_generated_tokens_total", ())] < 100


def test_sigterm_finishes_the_running_request_and_exits_0(small_server, reference):
    """SIGTERM drains: new requests get 503, the running one completes, the exit code is 0."""
    body = {"model": MODEL_NAME, "prompt": LONG_PROMPT, "max_tokens": 200, "temperature": 0}
    url = f"{small_server.url}/v1/completions"
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as response:
        lines = response.iter_lines()
        first = next(lines)
        small_server.terminate()
        wait_for(
            lambda: httpx.get(f"{small_server.url}/health", timeout=5).status_code == 503,
            what="/health answering 503 while draining",
        )
        late = httpx.post(url, json={**body, "max_tokens": 2}, timeout=30)
        assert late.status_code == 503
        assert late.json()["error"]["code"] == "shutting_down"
        rest = [first, *lines]
    chunks = [json.loads(line[6:]) for line in rest if line and line != "data: [DONE]"]
    assert rest[-1] == "data: [DONE]" or [line for line in rest if line][-1] == "data: [DONE]"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "".join(c["choices"][0]["text"] for c in chunks) == reference(LONG_PROMPT, 200)
    assert small_server.process.wait(60) == 0


def test_sigterm_cancels_what_outlives_the_grace_period(impatient_server):
    """The grace period ends: a stream still running or queued gets an error event then
    [DONE], and the process exits 0. Six streams of up to 1000 tokens go to one row; SIGTERM
    comes once three wait in the queue, far more work than the 0.2 s grace period on any
    machine, so at least one is cut short. A request that reaches the server after SIGTERM
    is refused (503, shutting down) or finds it closed."""
    body = {"model": MODEL_NAME, "prompt": LONG_PROMPT, "max_tokens": 1000, "temperature": 0}
    url = f"{impatient_server.url}/v1/completions"

    def stream() -> tuple[int, list[str]]:
        try:
            with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as response:
                return response.status_code, [line for line in response.iter_lines() if line]
        except httpx.TransportError:  # sent after the server closed its socket
            return 0, []

    def queued() -> float:
        return prometheus_text.value(metrics(impatient_server), "onnx_genrt_queue_depth")

    started = time.monotonic()
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(stream) for _ in range(6)]
        while queued() < 3:
            assert time.monotonic() - started < 30, "the requests never queued"
            time.sleep(0.01)
        impatient_server.terminate()
        results = [f.result() for f in futures]
    streams = [lines for status, lines in results if status == 200]
    refused = [(status, lines) for status, lines in results if status != 200]
    assert len(streams) >= 4  # the one running and the three queued
    assert all(lines[-1] == "data: [DONE]" for lines in streams)
    last_events = [json.loads(lines[-2][6:]) for lines in streams]
    cut = [e for e in last_events if "error" in e]
    assert cut, "no stream was cut short by the end of the grace period"
    assert all(e["error"]["code"] == "shutting_down" for e in cut)
    for status, lines in refused:
        assert status == 0 or (status == 503 and "shutting_down" in "".join(lines)), lines
    assert impatient_server.process.wait(30) == 0
    assert time.monotonic() - started < 30


def test_n_answers_each_in_its_own_row(server, reference):
    """``n``: greedy answers are n copies of the answer alone; sampled answer i is what a
    request of n=1 with ``seed + i`` gives, whole or streamed, with usage counting all."""
    api = client(server)
    greedy = api.completions.create(
        model=MODEL_NAME, prompt="def add(a, b):", max_tokens=10, temperature=0, n=3
    )
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    assert {c.text for c in greedy.choices} == {reference("def add(a, b):", 10)}
    assert greedy.usage.completion_tokens == 30
    messages = [{"role": "user", "content": "import os"}]
    asked = {"model": MODEL_NAME, "messages": messages, "max_tokens": 12, "temperature": 0.9}
    sampled = api.chat.completions.create(**asked, n=3, seed=40)
    alone = [api.chat.completions.create(**asked, seed=40 + i) for i in range(3)]
    assert [c.message.content for c in sampled.choices] == [
        a.choices[0].message.content for a in alone
    ]
    assert len({c.message.content for c in sampled.choices}) > 1
    pieces: dict[int, list[str]] = {}
    reasons: dict[int, str] = {}
    usage = None
    stream = api.chat.completions.create(
        **asked, n=3, seed=40, stream=True, stream_options={"include_usage": True}
    )
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            pieces.setdefault(choice.index, []).append(choice.delta.content or "")
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    assert {i: "".join(p) for i, p in pieces.items()} == {
        i: c.message.content for i, c in enumerate(sampled.choices)
    }
    assert set(reasons) == {0, 1, 2}
    assert usage is not None and usage.completion_tokens == sampled.usage.completion_tokens


def test_presence_and_frequency_penalties_answer_like_generate(server, reference_model):
    """OpenAI's penalties reach the engine: a greedy answer with them equals ``generate``
    with the same options in-process (and differs from the answer without them)."""
    from onnx_genrt.engine import generate

    options = {"presence_penalty": 0.6, "frequency_penalty": 1.1}
    result = client(server).completions.create(
        model=MODEL_NAME, prompt="import os", max_tokens=24, temperature=0, **options
    )
    want = generate(reference_model, "import os", 24, **options).text
    assert result.choices[0].text == want
    assert want != generate(reference_model, "import os", 24).text


def test_logit_bias_bans_a_token_like_generate(server, reference_model):
    """``logit_bias`` reaches the engine: -100 on the token greedy decoding picks first
    keeps it out of the answer, which equals ``generate`` with the same bias."""
    from onnx_genrt.engine import generate

    free = generate(reference_model, "import os", 12)
    banned = free.tokens[free.prompt_tokens]
    result = client(server).completions.create(
        model=MODEL_NAME,
        prompt="import os",
        max_tokens=12,
        temperature=0,
        logit_bias={str(banned): -100},
    )
    want = generate(reference_model, "import os", 12, logit_bias={banned: -100})
    assert result.choices[0].text == want.text != free.text
    assert banned not in want.tokens[want.prompt_tokens :]
