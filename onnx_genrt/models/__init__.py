"""Models shipped in the package: the embedded default model and the demo decoder block."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

__all__ = ["default_model_path"]


def default_model_path() -> Path:
    """The embedded default model's folder (a 4M-parameter Qwen2 with an MTP head and a draft
    model), as ``Model(default_model_path())`` and ``onnx-genrt generate`` without ``--model``
    load it."""
    return Path(str(resources.files(__name__) / "default"))
