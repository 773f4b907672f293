"""Paths a model folder names: resolved once, symlinks followed, never outside the folder.

Every file that a model folder points at (the model file, its external data, tokenizer
files, ``speculative.json`` entries, a draft model's folder) goes through
:func:`resolve_inside`, so a configuration file cannot make the runtime read elsewhere.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .errors import ModelLoadError


def resolve_inside(folder: str | os.PathLike[str], name: Any, key: str) -> Path:
    """The path ``name`` (relative to ``folder``) resolves to, following every symlink.

    ``key`` says where the path came from (for example ``"genai_config.json:
    model.decoder.filename"``) and is named in the error. Refused, with
    :class:`ModelLoadError`: a value that is not a non-empty string, an absolute path, and a
    path that resolves outside the folder (through ``..`` or a symlink, file or directory).
    The path need not exist; callers check that themselves.
    """
    if isinstance(name, os.PathLike):
        name = os.fspath(name)
    if not isinstance(name, str) or not name.strip():
        raise ModelLoadError(
            f"{key} must be a non-empty path relative to the model folder, got {name!r}"
        )
    root = Path(folder).resolve()
    if os.path.isabs(name) or Path(name).drive:
        raise ModelLoadError(
            f"{key} = {name!r} is an absolute path; paths a model folder names must be "
            f"relative to it ({root})"
        )
    target = (root / name).resolve()
    if not target.is_relative_to(root):
        raise ModelLoadError(
            f"{key} = {name!r} resolves to {target}, outside the model folder {root}"
        )
    return target
