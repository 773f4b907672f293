"""Load an ONNX model safely: clear errors, external data confined to the model's folder."""

from __future__ import annotations

import os
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError
from onnx import external_data_helper

from onnx_genrt.core.errors import ModelLoadError


def load_model(source: str | os.PathLike[str] | bytes | onnx.ModelProto) -> onnx.ModelProto:
    """Read a model from a path, serialized bytes or a ``ModelProto``.

    External data must live inside the model's folder; a location that escapes it (an
    absolute path, ``..``, or a symlink out) is refused with an error naming the path.
    """
    if isinstance(source, onnx.ModelProto):
        model = source
        base = None
    elif isinstance(source, bytes | bytearray):
        model = _parse(bytes(source), "<bytes>")
        base = None
    else:
        path = Path(source)
        if path.is_dir():
            path = path / "model.onnx"
        if not path.is_file():
            raise ModelLoadError(f"model file not found: {path}")
        model = _parse(path.read_bytes(), str(path))
        base = path.resolve().parent
    _check_structure(model)
    if _uses_external_data(model):
        if base is None:
            raise ModelLoadError(
                "model refers to external data but was given without a path; load it from its file"
            )
        _load_external(model, base)
    return model


def _parse(data: bytes, label: str) -> onnx.ModelProto:
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise ModelLoadError(f"{label} is not a valid ONNX model: {exc}") from None
    if not model.HasField("graph"):
        raise ModelLoadError(f"{label} is not a valid ONNX model: it has no graph")
    return model


def _check_structure(model: onnx.ModelProto) -> None:
    if not model.opset_import:
        raise ModelLoadError("model imports no opset")
    known = {i.name for i in model.graph.initializer} | {i.name for i in model.graph.input}
    for node in model.graph.node:
        for name in node.input:
            if name and name not in known:
                # Defer to the planner: inputs may come from later nodes (unsorted graph).
                pass
        known.update(o for o in node.output if o)
    for out in model.graph.output:
        if out.name not in known:
            raise ModelLoadError(f"graph output {out.name!r} is produced by no node or input")


def _uses_external_data(model: onnx.ModelProto) -> bool:
    return any(
        external_data_helper.uses_external_data(t)
        for t in external_data_helper._get_all_tensors(model)
    )


def _load_external(model: onnx.ModelProto, base: Path) -> None:
    for tensor in external_data_helper._get_all_tensors(model):
        if not external_data_helper.uses_external_data(tensor):
            continue
        info = external_data_helper.ExternalDataInfo(tensor)
        target = (base / info.location).resolve()
        if os.path.isabs(info.location) or not target.is_relative_to(base):
            raise ModelLoadError(
                f"tensor {tensor.name!r}: external data location {info.location!r} escapes the "
                f"model folder {base}"
            )
        if not target.is_file():
            raise ModelLoadError(f"tensor {tensor.name!r}: external data file missing: {target}")
        with open(target, "rb") as f:
            f.seek(info.offset or 0)
            data = f.read(info.length) if info.length else f.read()
        if info.length and len(data) != info.length:
            raise ModelLoadError(
                f"tensor {tensor.name!r}: external data file {target} is truncated "
                f"(wanted {info.length} bytes at offset {info.offset or 0}, got {len(data)})"
            )
        tensor.raw_data = data
        del tensor.external_data[:]
        tensor.data_location = onnx.TensorProto.DEFAULT
