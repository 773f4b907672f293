"""Tokenizer at its edges (survivors of the mutation run in docs/mutation.md): a folder
without tokenizer.json, text that is not a str, a chat_template that is not a string; and the
decode heads of a model whose configured logits output is missing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from onnx_genrt.core.errors import InvalidInputError, ModelLoadError
from onnx_genrt.engine.decode_heads import ARGMAX, add_decode_heads
from onnx_genrt.engine.tokenizer import Tokenizer
from onnx_genrt.generate_cli import default_model_dir


def _tokenizer_copy(tmp_path: Path, **config) -> Path:
    folder = tmp_path / "tok"
    folder.mkdir()
    source = Path(default_model_dir())
    shutil.copy(source / "tokenizer.json", folder)
    cfg = json.loads((source / "tokenizer_config.json").read_text())
    cfg.update(config)
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return folder


def _empty(tmp_path: Path) -> Path:
    folder = tmp_path / "empty"
    folder.mkdir()
    return folder


def test_a_folder_without_tokenizer_json_is_named(tmp_path):
    with pytest.raises(ModelLoadError, match=r"no tokenizer\.json in .*empty"):
        Tokenizer(_empty(tmp_path))


@pytest.mark.parametrize("text", [123, b"bytes", None, ["a"]])
def test_encode_refuses_what_is_not_a_str(tmp_path, text):
    tok = Tokenizer(_tokenizer_copy(tmp_path))
    with pytest.raises(InvalidInputError, match=f"must be a str, got {type(text).__name__}"):
        tok.encode(text)


def test_a_chat_template_that_is_not_a_string_is_refused(tmp_path):
    """Named templates (a list of {name, template}) are not supported: a clear refusal that
    names tokenizer_config.json, not a Jinja error."""
    named = [{"name": "default", "template": "{{ messages }}"}]
    tok = Tokenizer(_tokenizer_copy(tmp_path, chat_template=named))
    with pytest.raises(ModelLoadError, match=r"tokenizer_config\.json: chat_template must be a "):
        _ = tok.chat_template
    with pytest.raises(ModelLoadError, match="got list"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def _tiny_model(output: str) -> onnx.ModelProto:
    node = helper.make_node("Identity", ["x"], [output])
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info(output, TensorProto.FLOAT, [1, 4])],
    )
    return helper.make_model(graph)


def test_decode_heads_need_the_configured_logits_output():
    with pytest.raises(ModelLoadError, match=r"no output 'logits' .*outputs\.logits"):
        add_decode_heads(_tiny_model("scores"), "logits")
    model = add_decode_heads(_tiny_model("logits"), "logits")
    assert [o.name for o in model.graph.output][:2] == ["logits", ARGMAX]
