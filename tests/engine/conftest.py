"""Session-scoped LLM fixtures (built by onnxruntime-genai's builder, cached on disk)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ..llm_fixtures import DRAFT_QWEN2, TINY_QWEN2, build_qwen2, random_mtp_head


@pytest.fixture(scope="session")
def qwen2_dir() -> Path:
    """A random 2-layer Qwen2 (fp32) with hidden_states output, a random MTP head and a
    draft model, wired through genai_config.json's speculative section."""
    folder = build_qwen2(TINY_QWEN2)
    random_mtp_head(folder, TINY_QWEN2["hidden_size"], TINY_QWEN2["vocab_size"])
    draft = build_qwen2(DRAFT_QWEN2, seed=3)
    inside = folder / "draft"  # a copy: a model folder never reads outside itself
    if inside.is_symlink():  # caches made before containment linked it
        inside.unlink()
    if not inside.exists():
        shutil.copytree(draft, inside)
    _add_speculative_section(folder)
    return folder


def _add_speculative_section(folder: Path) -> None:
    """Write speculative.json once, atomically: the fixture cache is shared by concurrent test
    runs, and a reader must never see a half-written file."""
    import json
    import os
    import tempfile

    from onnx_genrt.engine.config import SPECULATIVE_FILE

    spec = {"mtp": {"filename": "mtp/model.onnx"}, "draft": {"path": "draft"}}
    text = json.dumps(spec, indent=2)
    path = folder / SPECULATIVE_FILE
    if path.is_file() and path.read_text(encoding="utf-8") == text:
        return
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".speculative.", suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)
