"""Every file a model folder names resolves inside the folder, symlinks followed.

Each hostile folder below points at a *valid* file outside (a copy of the real one), so
the load would succeed if the containment check were missing.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from onnx_genrt.core.errors import ModelLoadError
from onnx_genrt.engine import Model
from onnx_genrt.engine.api import make_proposer
from onnx_genrt.generate_cli import default_model_dir


@pytest.fixture
def folders(tmp_path) -> tuple[Path, Path]:
    """(model folder, a sibling folder outside it), both full copies of the embedded model."""
    model, outside = tmp_path / "model", tmp_path / "base"
    shutil.copytree(default_model_dir(), model)
    shutil.copytree(default_model_dir(), outside)
    return model, outside


def _edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def _set_decoder_filename(folder: Path, value) -> None:
    _edit_json(folder / "genai_config.json", lambda d: d["model"]["decoder"].update(filename=value))


def test_the_embedded_model_loads_from_a_copy(folders):
    model, _ = folders
    assert Model(model).config.num_layers == 4


@pytest.mark.parametrize("kind", ["dotdot", "absolute"])
def test_decoder_filename_outside_the_folder_is_refused(folders, kind):
    model, outside = folders
    value = "../base/model.onnx" if kind == "dotdot" else str(outside / "model.onnx")
    _set_decoder_filename(model, value)
    why = "outside the model folder" if kind == "dotdot" else "is an absolute path"
    with pytest.raises(ModelLoadError, match=rf"model\.decoder\.filename = .*{why}"):
        Model(model)


@pytest.mark.parametrize("value", [123, "", None, ["model.onnx"]])
def test_decoder_filename_of_the_wrong_type_is_a_clear_error(folders, value):
    model, _ = folders
    _set_decoder_filename(model, value)
    with pytest.raises(ModelLoadError, match=r"model\.decoder\.filename must be a file name"):
        Model(model)


def test_model_file_symlinked_outside_is_refused(folders):
    model, outside = folders
    (model / "model.onnx").unlink()
    (model / "model.onnx").symlink_to(outside / "model.onnx")
    with pytest.raises(ModelLoadError, match=r"resolves to .*base.*model\.onnx, outside"):
        Model(model)


def test_decoder_in_a_symlinked_directory_outside_is_refused(folders):
    model, outside = folders
    (model / "sub").symlink_to(outside, target_is_directory=True)
    _set_decoder_filename(model, "sub/model.onnx")
    with pytest.raises(ModelLoadError, match="outside the model folder"):
        Model(model)


def test_a_config_file_symlinked_outside_is_refused(folders):
    model, outside = folders
    (model / "genai_config.json").unlink()
    (model / "genai_config.json").symlink_to(outside / "genai_config.json")
    with pytest.raises(ModelLoadError, match=r"genai_config\.json = .* outside the model folder"):
        Model(model)


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json"])
def test_tokenizer_files_symlinked_outside_are_refused(folders, name):
    model, outside = folders
    (model / name).unlink()
    (model / name).symlink_to(outside / name)
    with pytest.raises(ModelLoadError, match=rf"{name} = .* outside the model folder"):
        Model(model).tokenizer.encode("x")


def test_a_corrupt_tokenizer_config_is_a_clear_error(folders):
    model, _ = folders
    (model / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"tokenizer_config\.json is not valid JSON"):
        Model(model).tokenizer.encode("x")


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "symlink"])
def test_mtp_head_outside_the_folder_is_refused(folders, kind):
    model, outside = folders
    if kind == "symlink":
        (model / "mtp" / "model.onnx").unlink()
        (model / "mtp" / "model.onnx").symlink_to(outside / "mtp" / "model.onnx")
        value = "mtp/model.onnx"
    else:
        value = "../base/mtp/model.onnx" if kind == "dotdot" else str(outside / "mtp/model.onnx")
    _edit_json(model / "speculative.json", lambda d: d["mtp"].update(filename=value))
    loaded = Model(model)
    with pytest.raises(ModelLoadError, match=r"speculative\.json: mtp\.filename = "):
        make_proposer(loaded, "mtp", 64)


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "symlink"])
def test_draft_folder_outside_the_folder_is_refused(folders, kind):
    model, outside = folders
    if kind == "symlink":
        shutil.rmtree(model / "draft")
        (model / "draft").symlink_to(outside / "draft", target_is_directory=True)
        value = "draft"
    else:
        value = "../base/draft" if kind == "dotdot" else str(outside / "draft")
    _edit_json(model / "speculative.json", lambda d: d["draft"].update(path=value))
    loaded = Model(model)
    with pytest.raises(ModelLoadError, match=r"speculative\.json: draft\.path = "):
        make_proposer(loaded, "draft", 64)


def test_a_speculative_section_that_is_not_an_object_is_a_clear_error(folders):
    model, _ = folders
    _edit_json(model / "speculative.json", lambda d: d.update(mtp=["mtp/model.onnx"]))
    with pytest.raises(ModelLoadError, match=r"section 'mtp' must be an object, got list"):
        Model(model)


def test_proposers_inside_the_folder_still_load(folders):
    model, _ = folders
    loaded = Model(model)
    assert make_proposer(loaded, "mtp", 64).name == "mtp"
    assert make_proposer(loaded, "draft", 64).name == "draft"


@pytest.mark.parametrize(
    ("section", "key", "value"),
    [
        ("mtp", "filename", 123),
        ("mtp", "filename", ""),
        ("draft", "path", ""),  # would name the model folder itself: the base model as draft
        ("draft", "path", "   "),
        ("draft", "path", ["draft"]),
    ],
)
def test_speculative_paths_that_are_not_a_relative_path_are_a_clear_error(
    folders, section, key, value
):
    model, _ = folders
    _edit_json(model / "speculative.json", lambda d: d[section].update({key: value}))
    loaded = Model(model)
    with pytest.raises(
        ModelLoadError,
        match=rf"speculative\.json: {section}\.{key} must be a non-empty path relative to the "
        rf"model folder, got {re.escape(repr(value))}",
    ):
        make_proposer(loaded, section, 64)
