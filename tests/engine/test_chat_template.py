"""Chat templates rendered in Jinja's sandbox, checked against Hugging Face transformers'
own ``apply_chat_template`` on the same template, tokens and messages."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from onnx_genrt.core.errors import InvalidInputError, ModelLoadError
from onnx_genrt.engine import Tokenizer
from onnx_genrt.engine.chat_template import check_messages, render_chat
from onnx_genrt.generate_cli import default_model_dir

# ChatML with a default system message, as Qwen2 ships it.
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Llama-2 style: bos_token, strip, and raise_exception for roles out of turn.
ALTERNATING = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}"
    "{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'].strip() + ' [/INST]' }}"
    "{% else %}{{ ' ' + message['content'].strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)
# tojson (no HTML escaping, non-ASCII kept), loop controls, a namespace and whitespace control.
TOOLISH = (
    "{%- set ns = namespace(n=0) -%}\n"
    "{%- for message in messages -%}\n"
    "  {%- if message['role'] == 'tool' %}{% continue %}{% endif -%}\n"
    "  {%- set ns.n = ns.n + 1 -%}\n"
    "  {{ ns.n }}:{{ message | tojson }}\n"
    "{% endfor -%}\n"
    "{%- if add_generation_prompt %}>{% endif %}"
)
# Block tags on lines of their own: depends on trim_blocks and lstrip_blocks.
MULTILINE = (
    "{% for message in messages %}\n"
    "    {% if message['role'] == 'user' %}\n"
    "U {{ message['content'] }}\n"
    "    {% else %}\n"
    "{{ message['role'] }} {{ message['content'] }}\n"
    "    {% endif %}\n"
    "{% endfor %}\n"
    "  {% if add_generation_prompt %}\n"
    "A\n"
    "  {% endif %}\n"
)
MESSAGES = [
    {"role": "system", "content": "Be brief <&> 'ok'"},
    {"role": "user", "content": "  héllo → wörld  "},
    {"role": "assistant", "content": "hi"},
    {"role": "tool", "content": '{"x": 1}', "tool_call_id": "call_1"},
    {"role": "user", "content": "again"},
]
SPECIALS = {"bos_token": "<s>", "eos_token": "</s>"}


def transformers_render(template: str, messages, add_generation_prompt: bool) -> str:
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(default_model_dir() / "tokenizer.json"),
        chat_template=template,
        **SPECIALS,
    )
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )


@pytest.mark.parametrize(
    ("template", "messages"),
    [
        (CHATML, MESSAGES[1:3]),
        (CHATML, MESSAGES[:3]),
        (ALTERNATING, [MESSAGES[1], MESSAGES[2], MESSAGES[4]]),
        (TOOLISH, MESSAGES),
        (MULTILINE, MESSAGES[:3]),
    ],
)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_rendering_matches_transformers(template, messages, add_generation_prompt):
    ours = render_chat(
        template, messages, add_generation_prompt=add_generation_prompt, config=SPECIALS
    )
    assert ours == transformers_render(template, messages, add_generation_prompt)


def test_raise_exception_refuses_the_messages_naming_the_file():
    with pytest.raises(InvalidInputError, match=r"my/tokenizer_config.json refused .*alternate"):
        render_chat(
            ALTERNATING, MESSAGES[1:2] * 2, config=SPECIALS, source="my/tokenizer_config.json"
        )


def test_a_template_that_does_not_compile_names_the_file():
    with pytest.raises(ModelLoadError, match=r"cfg.json does not compile: .*line 1"):
        render_chat("{% for m in messages %}", MESSAGES[1:2], source="cfg.json")


@pytest.mark.parametrize(
    "template",
    [
        "{{ messages.__class__.__mro__[1].__subclasses__() }}",  # escape through dunders
        "{% set _ = messages.append({'role': 'user', 'content': 'x'}) %}",  # mutation
        "{{ cycler.__init__.__globals__ }}",
    ],
)
def test_the_sandbox_refuses_unsafe_templates(template):
    with pytest.raises(ModelLoadError, match=r"failed to render: SecurityError"):
        render_chat(template, MESSAGES[1:2], source="cfg.json")


@pytest.mark.parametrize(
    ("messages", "needle"),
    [
        ([], "empty"),
        ("hi", "must be a list"),
        ([{"role": "user"}], r"messages\[0\].content must be a string"),
        ([{"role": "robot", "content": "x"}], r"messages\[0\].role must be one of"),
        ([{"role": "user", "content": "x", "images": []}], "unsupported fields"),
        ([{"role": "user", "content": "x", "name": 3}], r"messages\[0\].name"),
        (["user: hi"], r"messages\[0\] must be an object"),
    ],
)
def test_message_checks(messages, needle):
    with pytest.raises(InvalidInputError, match=needle):
        check_messages(messages)


def test_the_embedded_model_ships_a_role_content_template():
    tokenizer = Tokenizer(default_model_dir())
    rendered = tokenizer.apply_chat_template(MESSAGES[:3])
    assert rendered == (
        "system: Be brief <&> 'ok'\nuser:   héllo → wörld  \nassistant: hi\nassistant:"
    )
    assert rendered == transformers_render(tokenizer.chat_template, MESSAGES[:3], True)


@pytest.fixture
def model_copy(tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir() / name, folder / name)
    return folder


def test_a_model_without_a_template_says_so(model_copy):
    config = json.loads((model_copy / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (model_copy / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"tokenizer_config.json has no chat_template"):
        Tokenizer(model_copy).apply_chat_template(MESSAGES[1:2])


def test_a_broken_template_names_the_model_file(model_copy):
    config = json.loads((model_copy / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ messages[0]['content'] | nosuchfilter }}"
    (model_copy / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=rf"{model_copy}/tokenizer_config.json"):
        Tokenizer(model_copy).apply_chat_template(MESSAGES[1:2])
