"""``logprobs`` through ``onnx-genrt serve`` (a real process) and the official ``openai``
client: chat (``logprobs`` + ``top_logprobs``), completions (``logprobs`` N), streamed
chat; every value against onnxruntime run teacher-forced on the served sequence."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest
from scipy.special import log_softmax

from ..llm_fixtures import ort_forced
from .conftest import MODEL_NAME, ServerProcess


def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def _reference(model, prompt: str, answer_ids: list[int]) -> np.ndarray:
    """float64 log-probabilities [answer tokens, vocab] of the positions that picked them."""
    ids = model.tokenizer.encode(prompt)
    logits = ort_forced(model.folder, ids, answer_ids[:-1])
    return log_softmax(logits[len(ids) - 1 :].astype(np.float64), axis=-1)


def _token(model, token_id: int) -> str:
    return model.tokenizer.decode([token_id], skip_special_tokens=False)


def _greedy_ids(model, prompt: str, n: int) -> list[int]:
    from onnx_genrt.engine import generate

    result = generate(model, prompt, max_new_tokens=n)
    return result.tokens[result.prompt_tokens :]


def test_chat_logprobs_with_top_alternatives(server, reference_model):
    messages = [{"role": "user", "content": "def fib(n):"}]
    result = client(server).chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        max_tokens=10,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    choice = result.choices[0]
    content = choice.logprobs.content
    prompt = reference_model.tokenizer.apply_chat_template(messages)
    ids = _greedy_ids(reference_model, prompt, 10)
    want = _reference(reference_model, prompt, ids)
    assert [c.token for c in content] == [_token(reference_model, t) for t in ids]
    assert "".join(c.token for c in content) == choice.message.content
    for entry, token_id, row in zip(content, ids, want, strict=True):
        assert entry.logprob == pytest.approx(row[token_id], abs=1e-4)
        assert entry.bytes == list(entry.token.encode())
        best = np.argsort(-row, kind="stable")[:3]
        assert [t.token for t in entry.top_logprobs] == [_token(reference_model, t) for t in best]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(row[best], abs=1e-4)
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)  # greedy


def test_completion_logprobs_lists(server, reference_model):
    prompt = "import os"
    result = client(server).completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=0, logprobs=2
    )
    probs = result.choices[0].logprobs
    ids = _greedy_ids(reference_model, prompt, 8)
    want = _reference(reference_model, prompt, ids)
    texts = [_token(reference_model, t) for t in ids]
    assert probs.tokens == texts
    assert probs.token_logprobs == pytest.approx(
        [row[t] for t, row in zip(ids, want, strict=True)], abs=1e-4
    )
    assert probs.text_offset == np.cumsum([0, *map(len, texts)])[:-1].tolist()
    for top, row in zip(probs.top_logprobs, want, strict=True):
        best = np.argsort(-row, kind="stable")[:2]  # the chosen token is among them (greedy)
        assert top == pytest.approx({_token(reference_model, t): row[t] for t in best}, abs=1e-4)


def test_a_sampled_completion_reports_the_models_distribution(server, reference_model):
    """Temperature and top_p shape the pick, not the reported log-probability; logprobs 0
    lists the chosen token alone. The seeded sample equals ``generate``'s in-process."""
    from onnx_genrt.engine import generate

    prompt, options = "class Foo:", {"temperature": 1.5, "top_p": 0.9, "seed": 11}
    result = client(server).completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=8, logprobs=0, **options
    )
    probs = result.choices[0].logprobs
    sample = generate(reference_model, prompt, 8, do_sample=True, **options)
    ids = sample.tokens[sample.prompt_tokens :]
    assert probs.tokens == [_token(reference_model, t) for t in ids]
    want = _reference(reference_model, prompt, ids)
    assert probs.token_logprobs == pytest.approx(
        [row[t] for t, row in zip(ids, want, strict=True)], abs=1e-4
    )
    assert [list(top) for top in probs.top_logprobs] == [[t] for t in probs.tokens]
    greedy = want.argmax(axis=-1)
    assert (greedy != np.array(ids)).any(), "the sample never left the argmax: a weak check"


def test_streamed_chat_logprobs_equal_the_whole_answers(server):
    request = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "import sys"}],
        "max_tokens": 12,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    whole = client(server).chat.completions.create(**request)
    pieces = []
    text = ""
    for chunk in client(server).chat.completions.create(**request, stream=True):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            if choice.logprobs is not None:
                pieces += choice.logprobs.content
    assert text == whole.choices[0].message.content
    assert [p.model_dump() for p in pieces] == [
        c.model_dump() for c in whole.choices[0].logprobs.content
    ]


def test_no_logprobs_unless_asked(server):
    result = client(server).chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "x"}], max_tokens=2
    )
    assert result.choices[0].logprobs is None


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        ("chat/completions", {"logprobs": 3}, "logprobs"),
        ("chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("chat/completions", {"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
        ("completions", {"logprobs": 6}, "logprobs"),
        ("completions", {"echo": "yes"}, "echo"),
        ("chat/completions", {"echo": True}, "echo"),
        ("completions", {"top_logprobs": 2}, "top_logprobs"),
    ],
)
def test_bad_logprobs_fields_get_400(server, path, fields, param):
    body = {"model": MODEL_NAME, "max_tokens": 2, **fields}
    body |= (
        {"messages": [{"role": "user", "content": "x"}]}
        if path.startswith("chat")
        else {"prompt": "x"}
    )
    response = httpx.post(f"{server.url}/v1/{path}", json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_streamed_completion_logprobs_cover_text_held_for_a_stop_string(server):
    """A stop string that never completes but whose start is the answer's last tokens holds
    their text back until the end: their chunks have no text yet, and still carry their
    log-probabilities; the streamed lists (offsets included) equal the whole answer's."""
    request = {"model": MODEL_NAME, "prompt": "import os", "max_tokens": 10, "temperature": 0}
    whole = client(server).completions.create(**request, logprobs=1).choices[0]
    tokens = whole.logprobs.tokens
    held = len("".join(tokens[:-3]))
    stop = whole.text[held:] + "QQ"
    probs = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    text, textless = "", 0
    chunks = client(server).completions.create(**request, logprobs=1, stop=[stop], stream=True)
    for chunk in chunks:
        for choice in chunk.choices:
            text += choice.text
            if choice.logprobs is not None:
                textless += choice.text == ""
                for key, values in probs.items():
                    values += getattr(choice.logprobs, key)
    assert text == whole.text
    assert textless >= 1, "no chunk held its text back"
    assert probs == whole.logprobs.model_dump(include=set(probs))


def test_echo_scores_the_prompt_as_lm_eval_asks(server, reference_model):
    """lm-evaluation-harness's loglikelihood request: token ids, ``echo``, ``logprobs`` 1,
    ``max_tokens`` 1. The answer begins with the prompt; the first prompt token has no
    log-probability (null), every later one onnxruntime's given the tokens before it, and
    the generated token follows."""
    text = "def fib(n):\n    return"
    ids = reference_model.tokenizer.encode(text)
    result = client(server).completions.create(
        model=MODEL_NAME, prompt=[ids], max_tokens=1, temperature=0, echo=True, logprobs=1
    )
    choice = result.choices[0]
    answer = _greedy_ids(reference_model, text, 1)
    assert choice.text == reference_model.tokenizer.decode(ids + answer)
    probs = choice.logprobs
    assert probs.tokens == [_token(reference_model, t) for t in ids + answer]
    assert probs.token_logprobs[0] is None and probs.top_logprobs[0] is None
    logits = ort_forced(reference_model.folder, ids, answer)[:-1]
    want = log_softmax(logits.astype(np.float64), axis=-1)
    chosen = [row[t] for t, row in zip(ids[1:] + answer, want, strict=True)]
    assert probs.token_logprobs[1:] == pytest.approx(chosen, abs=1e-4)
    for top, row, token in zip(probs.top_logprobs[1:], want, ids[1:] + answer, strict=True):
        best = int(np.argmax(row))  # the likeliest, and the token given (prompt or answer)
        assert top == pytest.approx(
            {_token(reference_model, t): row[t] for t in {best, token}}, abs=1e-4
        )
    offsets = np.cumsum([0, *map(len, probs.tokens)])[:-1].tolist()
    assert probs.text_offset == offsets
    assert result.usage.completion_tokens == 1


def test_echo_without_logprobs_and_streamed(server, reference):
    """``echo`` alone puts the prompt before the answer; streamed, the first chunk carries
    it (with its log-probabilities when asked), and the streamed lists equal the whole."""
    prompt = "import os"
    request = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 6, "temperature": 0}
    plain = client(server).completions.create(**request, echo=True)
    assert plain.choices[0].text == prompt + reference(prompt, 6)
    assert plain.choices[0].logprobs is None
    whole = client(server).completions.create(**request, echo=True, logprobs=2).choices[0]
    text, lists = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in client(server).completions.create(**request, echo=True, logprobs=2, stream=True):
        for choice in chunk.choices:
            text += choice.text
            for key, values in lists.items():
                values += getattr(choice.logprobs, key) if choice.logprobs else []
    assert text == whole.text == plain.choices[0].text
    assert lists == whole.logprobs.model_dump(include=set(lists))


def test_max_tokens_0_with_echo_scores_the_prompt_alone(server, reference_model):
    """``max_tokens`` 0 with ``echo`` (older scoring clients): the answer is the prompt with
    its log-probabilities, no token after it, whole and streamed; without echo 0 is a 400."""
    prompt = "class Foo:\n    def"
    request = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 0, "echo": True}
    result = client(server).completions.create(**request, logprobs=1, temperature=0)
    choice = result.choices[0]
    ids = reference_model.tokenizer.encode(prompt)
    assert choice.text == prompt and choice.finish_reason == "length"
    assert result.usage.completion_tokens == 0
    assert choice.logprobs.tokens == [_token(reference_model, t) for t in ids]
    want = log_softmax(ort_forced(reference_model.folder, ids, [])[:-1].astype(np.float64), -1)
    chosen = [row[t] for t, row in zip(ids[1:], want, strict=True)]
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(chosen, abs=1e-4)
    chunks = list(client(server).completions.create(**request, logprobs=1, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == prompt
    tokens = [
        t
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.tokens
    ]
    assert tokens == choice.logprobs.tokens
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 0}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "max_tokens"


def test_each_of_n_answers_has_its_own_logprobs(server):
    """``n`` answers, each a row: each choice's log-probabilities are its own tokens', whole
    and streamed (greedy: the two equal; seeded samples: each matches its own text)."""
    request = {"model": MODEL_NAME, "prompt": "import os", "max_tokens": 6, "logprobs": 1, "n": 2}
    greedy = client(server).completions.create(**request, temperature=0).choices
    assert greedy[0].logprobs.model_dump() == greedy[1].logprobs.model_dump()
    sampled = client(server).completions.create(**request, temperature=1.5, seed=5).choices
    assert sampled[0].text != sampled[1].text
    for choice in sampled:
        assert "".join(choice.logprobs.tokens) == choice.text
    streamed: dict[int, list[str]] = {0: [], 1: []}
    chunks = client(server).completions.create(**request, temperature=1.5, seed=5, stream=True)
    for chunk in chunks:
        for choice in chunk.choices:
            if choice.logprobs is not None:
                streamed[choice.index] += choice.logprobs.tokens
    assert streamed == {i: c.logprobs.tokens for i, c in enumerate(sampled)}
