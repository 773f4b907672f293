"""The tokenizer wrapper against Hugging Face transformers loading the same folder, and its
refusals of missing or malformed files and inputs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from onnx_genrt.core.errors import InvalidInputError, ModelLoadError
from onnx_genrt.engine import Tokenizer
from onnx_genrt.generate_cli import default_model_dir

#: Multi-byte characters that byte-level BPE splits over several tokens, and the special
#: token's text inside ordinary text.
TEXTS = [
    "def héllo():  # 日本語 🎉\n\treturn x",
    'print("<|endoftext|>") + ñ',
    "  leading and trailing spaces  ",
    "ünïcödé → ∑ 𝔘",
]


@pytest.fixture(scope="module")
def ours() -> Tokenizer:
    return Tokenizer(default_model_dir())


@pytest.fixture(scope="module")
def reference():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(default_model_dir()))


@pytest.mark.parametrize("text", TEXTS)
def test_encode_and_decode_match_transformers(ours, reference, text):
    ids = ours.encode(text)
    assert ids == reference(text, add_special_tokens=False).input_ids
    assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == reference.decode(
        ids, skip_special_tokens=False
    )


def test_vocabulary_and_token_ids_match_transformers(ours, reference):
    assert ours.vocab_size == len(reference)
    vocab = reference.get_vocab()
    for token in ["<|endoftext|>", "def", "Ġreturn", "no such token"]:
        assert ours.token_to_id(token) == vocab.get(token)


@pytest.mark.parametrize("text", TEXTS)
def test_a_stream_shows_whole_characters_as_transformers_decodes_them(ours, reference, text):
    """Each prefix of the stream's output is the decoded prefix of the ids, up to the last
    complete character; special tokens are skipped as decode skips them."""
    ids = ours.encode(text)
    stream = ours.create_stream()
    shown = ""
    for n, token in enumerate(ids, 1):
        piece = stream.decode(token)
        assert isinstance(piece, str) and "\ufffd" not in piece
        shown += piece
        decoded = reference.decode(ids[:n], skip_special_tokens=True)
        assert decoded.startswith(shown)
        assert decoded.rstrip("\ufffd") == shown  # only an incomplete character is held
    assert shown == reference.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("value", [b"bytes", None, ["a"], 3])
def test_encode_refuses_what_is_not_a_str(ours, value):
    with pytest.raises(InvalidInputError, match=f"must be a str, got {type(value).__name__}"):
        ours.encode(value)


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    copy = tmp_path / "model"
    copy.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir() / name, copy / name)
    return copy


def test_a_folder_without_tokenizer_json_is_a_model_load_error(folder):
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match=f"no tokenizer.json in {folder}"):
        Tokenizer(folder)
    (folder / "tokenizer.json").mkdir()  # a folder by that name is not a file
    with pytest.raises(ModelLoadError, match=f"no tokenizer.json in {folder}"):
        Tokenizer(folder)


def test_a_corrupt_tokenizer_json_names_the_file(folder):
    (folder / "tokenizer.json").write_text('{"model": ')
    with pytest.raises(ModelLoadError, match=r"tokenizer.json cannot be read"):
        Tokenizer(folder)


def test_tokenizer_config_is_optional(folder, ours):
    """Without tokenizer_config.json the tokenizer works, with an empty config and no chat
    template (asking for one says which file to add it to)."""
    (folder / "tokenizer_config.json").unlink()
    bare = Tokenizer(folder)
    assert bare.config == {} and bare.chat_template is None
    assert bare.encode(TEXTS[0]) == ours.encode(TEXTS[0])
    with pytest.raises(ModelLoadError, match=r"tokenizer_config.json has no chat_template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])


def test_the_config_is_the_files_content(folder, ours):
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert ours.config == config
    assert ours.chat_template == config["chat_template"]


def test_named_chat_templates_are_refused_naming_the_file(folder):
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "default", "template": config["chat_template"]}]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = Tokenizer(folder)
    expected = rf"{folder}/tokenizer_config.json: chat_template must be a string, got list"
    with pytest.raises(ModelLoadError, match=expected):
        tokenizer.chat_template  # noqa: B018 - the property raises
    with pytest.raises(ModelLoadError, match=expected):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
