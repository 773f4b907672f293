"""The app under Ray Serve on localhost (docs/deploy.md): two replicas behind Ray's HTTP
proxy (speculating per row by prompt lookup), driven by the openai client. Ray is not in the
test extra: skipped without it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

ray = pytest.importorskip("ray", reason="ray[serve] is not installed (optional; docs/deploy.md)")
serve = pytest.importorskip("ray.serve")

import openai  # noqa: E402

from onnx_genrt.serve.ray_deployment import app_builder  # noqa: E402

from .conftest import HOST, MODEL_NAME, free_port  # noqa: E402

pytestmark = pytest.mark.slow  # starting Ray takes ~20 s on two cores


@pytest.fixture(scope="module")
def ray_url() -> Iterator[str]:
    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": HOST, "port": port})
        app = app_builder(
            {"num_replicas": "2", "num_cpus": "0.5", "max_batch": "4", "spec": "ngram", "k": "3"}
        )
        serve.run(app, name="onnx-genrt", route_prefix="/")
        yield f"http://{HOST}:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def test_replicas_behind_ray_serve_answer_like_generate(ray_url, reference, reference_model):
    client = openai.OpenAI(base_url=f"{ray_url}/v1", api_key="unused", max_retries=0, timeout=120)
    for _ in range(4):  # requests land on either replica; each answers alike
        result = client.completions.create(
            model=MODEL_NAME, prompt="def add(a, b):", max_tokens=10, temperature=0
        )
        assert result.choices[0].text == reference("def add(a, b):", 10)
    messages = [{"role": "user", "content": "import sys"}]
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=6, temperature=0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == reference(reference_model.tokenizer.apply_chat_template(messages), 6)


def test_app_builder_refuses_unknown_arguments():
    from onnx_genrt.core.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match=r"unknown arguments \['replicas'\]"):
        app_builder({"replicas": "2"})
    with pytest.raises(InvalidInputError, match=r"max_batch='many' must be int"):
        app_builder({"max_batch": "many"})
