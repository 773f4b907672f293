"""genai_config.json's defaults against onnxruntime-genai reading the same folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from onnx_genrt.engine import Generator, GeneratorParams, Model

PROMPT = [5, 17, 99]


def _folder_without_search(source: Path, target: Path, **model_values: object) -> Path:
    """A copy of the decoder in ``source`` whose config has no ``search`` section."""
    if not target.exists():
        shutil.copytree(source, target, ignore=shutil.ignore_patterns("draft", "mtp", "spec*"))
    path = target / "genai_config.json"
    config = json.loads(path.read_text())
    config.pop("search", None)
    config["model"].update(model_values)
    path.write_text(json.dumps(config))
    return target


def _ours(folder: Path) -> list[int]:
    model = Model(folder)
    with Generator(model, GeneratorParams(model)) as gen:
        gen.append_tokens(PROMPT)
        while not gen.is_done():
            gen.generate_next_token()
        return gen.get_sequence()


def _onnxruntime_genai(folder: Path) -> list[int]:
    og = pytest.importorskip("onnxruntime_genai")
    model = og.Model(str(folder))
    gen = og.Generator(model, og.GeneratorParams(model))  # no search option set
    gen.append_tokens(PROMPT)
    while not gen.is_done():
        gen.generate_next_token()
    return [int(t) for t in gen.get_sequence(0)]


def test_a_config_without_a_search_section_decodes_like_onnxruntime_genai(qwen2_dir, tmp_path):
    """Without a search section both decode greedily up to the context length, and an
    end-of-sequence token ends the very first step (min_length 0)."""
    context = len(PROMPT) + 12
    folder = _folder_without_search(qwen2_dir, tmp_path / "model", context_length=context)
    reference = _onnxruntime_genai(folder)
    assert len(reference) == context  # the reference ran to the context length
    assert _ours(folder) == reference

    first = reference[len(PROMPT)]
    _folder_without_search(qwen2_dir, folder, eos_token_id=first)
    # onnxruntime-genai 0.18 stops there too, but leaves the eos token out of its sequence
    assert _onnxruntime_genai(folder) == PROMPT
    assert _ours(folder) == [*PROMPT, first]
