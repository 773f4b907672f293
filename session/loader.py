"""Load an ONNX model safely: clear errors, external data confined to the model's folder.

onnx is imported by the functions that read a model, not with this module: importing the
engine does not import onnx (and ml_dtypes, which it imports), a model load does.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from onnx_genrt.core.dtypes import DType
from onnx_genrt.core.errors import ModelLoadError
from onnx_genrt.core.kernels import GENRT_DOMAIN, MS_DOMAIN, ONNX_DOMAIN, normalize_domain
from onnx_genrt.core.paths import resolve_inside

from .weights import RELEASED_LOCATION, MappedFiles

if TYPE_CHECKING:
    import onnx

#: The domain of ONNX's classical machine-learning operators.
ML_DOMAIN = "ai.onnx.ml"
#: protobuf cannot parse a message of 2 GiB or more; larger models keep weights outside.
MAX_PROTO_BYTES = 2**31 - 1


@dataclass
class LoadedModel:
    """A model as :func:`open_model` loads it: the proto, and the initializers whose data
    stayed in external files, as read-only arrays mapped from them (``session.weights``).
    Those initializers keep their external-data fields in ``proto`` but no bytes.

    An :class:`~onnx_genrt.session.InferenceSession` given a ``LoadedModel`` owns it: once
    its plan holds the initializers as arrays, it drops the proto's copies of their bytes.
    """

    proto: onnx.ModelProto
    weights: dict[str, np.ndarray] = field(default_factory=dict)


def load_model(
    source: str | os.PathLike[str] | bytes | onnx.ModelProto,
    folder: str | os.PathLike[str] | None = None,
) -> onnx.ModelProto:
    """Read a model from a path, serialized bytes or a ``ModelProto``, with every tensor's
    external data read into the proto.

    ``folder`` is the model folder the file and its external data must stay inside
    (default: the folder the path names, as given). The model file and every external-data
    location are resolved with symlinks followed; one that leaves the folder (an absolute
    path, ``..``, or a symlink out) is refused with an error naming the path.
    """
    return _load(source, folder, map_weights=False).proto


def open_model(
    source: str | os.PathLike[str] | bytes | onnx.ModelProto,
    folder: str | os.PathLike[str] | None = None,
) -> LoadedModel:
    """Like :func:`load_model`, but the graph's initializers whose external data numpy can
    read as it is are mapped from their files (``LoadedModel.weights``) instead of being
    copied into the proto; every other external tensor is read into the proto."""
    return _load(source, folder, map_weights=True)


def _load(
    source: str | os.PathLike[str] | bytes | onnx.ModelProto,
    folder: str | os.PathLike[str] | None,
    map_weights: bool,
) -> LoadedModel:
    import onnx

    if isinstance(source, onnx.ModelProto):
        model = source
        base = None
    elif isinstance(source, bytes | bytearray):
        model = _parse(bytes(source), "<bytes>")
        base = None
    else:
        given = Path(source)
        if given.is_dir():
            given = given / "model.onnx"
        base = Path(folder if folder is not None else given.parent).resolve()
        path = resolve_inside(base, os.path.relpath(given.absolute(), base), "model file")
        if not path.is_file():
            raise ModelLoadError(f"model file not found: {given}")
        size = path.stat().st_size
        if size > MAX_PROTO_BYTES:
            raise ModelLoadError(
                f"{given} is {size / 2**30:.1f} GiB; an ONNX file holds at most 2 GiB "
                "(protobuf's limit): save the weights as external data "
                "(onnx.save_model(..., save_as_external_data=True))"
            )
        model = _parse(path.read_bytes(), str(given))
    _check_structure(model)
    loaded = LoadedModel(model)
    if _uses_external_data(model):
        _refuse_released(model)
        if base is None:
            raise ModelLoadError(
                "model refers to external data but was given without a path; load it from its file"
            )
        _load_external(model, base, loaded.weights if map_weights else None)
    return loaded


def _parse(data: bytes, label: str) -> onnx.ModelProto:
    import onnx
    from google.protobuf.message import DecodeError

    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise ModelLoadError(f"{label} is not a valid ONNX model: {exc}") from None
    if not model.HasField("graph"):
        raise ModelLoadError(f"{label} is not a valid ONNX model: it has no graph")
    return model


def _check_text(model: onnx.ModelProto) -> None:
    """Every name, op type and domain is text (protobuf hands back bytes for invalid UTF-8)."""
    g = model.graph
    named = [("opset domain", o.domain) for o in model.opset_import]
    for kind, values in (("input", g.input), ("output", g.output), ("initializer", g.initializer)):
        named += [(f"graph {kind} name", v.name) for v in values]
    for i, node in enumerate(g.node):
        fields = [("name", node.name), ("op type", node.op_type), ("domain", node.domain)]
        fields += [("input", n) for n in node.input] + [("output", n) for n in node.output]
        named += [(f"node {i} {what}", value) for what, value in fields]
    for what, value in named:
        if not isinstance(value, str):
            raise ModelLoadError(f"the model's {what} {value[:40]!r} is not valid UTF-8 text")


def supported_opsets() -> dict[str, int]:
    """The newest opset of each domain this runtime knows: ONNX's from the installed onnx
    package, onnxruntime's contrib ops and the runtime's own fused ops at version 1."""
    import onnx

    return {
        ONNX_DOMAIN: onnx.defs.onnx_opset_version(),
        ML_DOMAIN: onnx.defs.onnx_ml_opset_version(),
        MS_DOMAIN: 1,
        GENRT_DOMAIN: 1,
    }


def _check_opsets(model: onnx.ModelProto) -> None:
    """Refuse opset versions below 1 or newer than the runtime knows (other domains are
    left to the planner, which refuses their nodes when no provider has a kernel)."""
    import onnx

    if not model.opset_import:
        raise ModelLoadError("model imports no opset")
    newest = supported_opsets()
    for entry in model.opset_import:
        domain = normalize_domain(entry.domain)
        label = entry.domain or "ai.onnx"
        if entry.version < 1:
            raise ModelLoadError(
                f"model imports opset {entry.version} of {label!r}; versions start at 1"
            )
        if domain in newest and entry.version > newest[domain]:
            raise ModelLoadError(
                f"model imports opset {entry.version} of {label!r}, newer than this runtime "
                f"supports (1..{newest[domain]}; onnx {onnx.__version__}): export the model "
                "with an older opset or update onnx-genrt"
            )


def _check_initializers(model: onnx.ModelProto) -> None:
    """Refuse initializers whose declared dims are negative (a tensor has no unknown dim)."""
    for init in model.graph.initializer:
        if any(d < 0 for d in init.dims):
            raise ModelLoadError(
                f"initializer {init.name!r} has dims {list(init.dims)}; every dimension of a "
                "stored tensor must be >= 0"
            )


def _check_structure(model: onnx.ModelProto) -> None:
    _check_text(model)
    _check_opsets(model)
    _check_initializers(model)
    # Node inputs are checked by the planner: they may come from later nodes (unsorted graph).
    known = {i.name for i in model.graph.initializer} | {i.name for i in model.graph.input}
    for node in model.graph.node:
        known.update(o for o in node.output if o)
    for out in model.graph.output:
        if out.name not in known:
            raise ModelLoadError(f"graph output {out.name!r} is produced by no node or input")


def _graph_tensors(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    """Every tensor a graph holds: initializers (sparse ones' values and indices too) and
    tensor attributes of its nodes, subgraphs included."""
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield sparse.values
        yield sparse.indices
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            if attr.HasField("sparse_tensor"):
                yield attr.sparse_tensor.values
                yield attr.sparse_tensor.indices
            if attr.HasField("g"):
                yield from _graph_tensors(attr.g)
            for sub in attr.graphs:
                yield from _graph_tensors(sub)


def _model_tensors(model: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    """Every tensor of the main graph and of the model's local functions."""
    yield from _graph_tensors(model.graph)
    for function in model.functions:
        for node in function.node:
            for attr in node.attribute:
                if attr.HasField("t"):
                    yield attr.t
                yield from attr.tensors


def _uses_external_data(model: onnx.ModelProto) -> bool:
    from onnx import external_data_helper

    return any(external_data_helper.uses_external_data(t) for t in _model_tensors(model))


def _load_external(
    model: onnx.ModelProto, base: Path, mapped: dict[str, np.ndarray] | None = None
) -> None:
    """Read every external tensor into the proto; with ``mapped``, put the graph's
    initializers that can be mapped there instead (their protos keep no bytes)."""
    import onnx
    from onnx import external_data_helper

    files = MappedFiles()
    # Held so that the walk below hands back these very objects (protobuf caches them).
    initializers = list(model.graph.initializer) if mapped is not None else []
    mappable = {id(t) for t in initializers}
    for tensor in _model_tensors(model):
        if not external_data_helper.uses_external_data(tensor):
            continue
        target, offset, length = _external_range(tensor, base)
        if id(tensor) in mappable and mapped is not None:
            view = _mapped_view(files, tensor, target, offset, length)
            if view is not None:
                mapped[tensor.name] = view
                continue
        with open(target, "rb") as f:
            f.seek(offset)
            tensor.raw_data = f.read(length)
        del tensor.external_data[:]
        tensor.data_location = onnx.TensorProto.DEFAULT


def _external_range(tensor: onnx.TensorProto, base: Path) -> tuple[Path, int, int]:
    """The file, offset and length of a tensor's external data, checked: the file lies
    inside ``base`` and holds the range (length 0: up to its end)."""
    from onnx import external_data_helper

    try:
        info = external_data_helper.ExternalDataInfo(tensor)
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(
            f"tensor {tensor.name!r}: unreadable external data fields: {exc}"
        ) from None
    key = f"tensor {tensor.name!r}: external data location"
    target = resolve_inside(base, info.location, key)
    if not target.is_file():
        raise ModelLoadError(f"tensor {tensor.name!r}: external data file missing: {target}")
    offset, length, size = info.offset or 0, info.length or 0, target.stat().st_size
    if offset < 0 or length < 0 or offset + length > size:
        raise ModelLoadError(
            f"tensor {tensor.name!r}: external data wants {length} bytes at offset "
            f"{offset} of {target}, which has {size} bytes"
        )
    return target, offset, length or size - offset


def _mapped_view(
    files: MappedFiles, tensor: onnx.TensorProto, target: Path, offset: int, length: int
) -> np.ndarray | None:
    """The tensor as a view of its mapped file, or None where its layout does not allow
    one (packed 4-bit or string elements, a misaligned offset, a length that does not fit
    its dims: those are read, and the planner reports a bad length)."""
    try:
        dtype = DType.from_onnx(tensor.data_type)
    except TypeError:
        return None
    if dtype.is_packed:
        return None
    return files.view(target, offset, length, dtype.numpy, tuple(int(d) for d in tensor.dims))


def _refuse_released(model: onnx.ModelProto) -> None:
    """A proto whose bytes a session dropped (``without_initializer_bytes``) cannot be run."""
    for init in model.graph.initializer:
        if any(e.value == RELEASED_LOCATION for e in init.external_data):
            raise ModelLoadError(
                f"initializer {init.name!r} has no bytes: the session that loaded this model "
                "released them once its plan held the weights (a session's `model` keeps the "
                "graph, not the weights); load the model again from its file"
            )


def without_initializer_bytes(model: onnx.ModelProto) -> onnx.ModelProto:
    """A new proto of ``model`` whose initializers keep their name, type and dims but no
    bytes, marked as external data at ``RELEASED_LOCATION``: planning it again is refused
    with an error naming the initializer, never run on empty weights. A session keeps this
    one once its plan holds the weights (clearing the fields of the original would free
    nothing: protobuf keeps a message's memory until the whole message goes)."""
    import onnx

    stripped = graph_without_initializers(model)
    for init in model.graph.initializer:
        kept = stripped.graph.initializer.add(
            name=init.name, data_type=init.data_type, dims=init.dims
        )
        kept.external_data.add(key="location", value=RELEASED_LOCATION)
        kept.data_location = onnx.TensorProto.EXTERNAL
    return stripped


def graph_without_initializers(model: onnx.ModelProto) -> onnx.ModelProto:
    """A new proto with every field of ``model`` but its graph's initializers (nodes,
    inputs, outputs, functions, metadata: all copied, no weight bytes)."""
    import onnx

    copy = onnx.ModelProto()
    _copy_fields(model, copy, skip="graph")
    _copy_fields(model.graph, copy.graph, skip="initializer")
    return copy


def _copy_fields(src, dst, skip: str) -> None:
    for descriptor, value in src.ListFields():
        if descriptor.name == skip:
            continue
        target = getattr(dst, descriptor.name)
        if hasattr(target, "extend"):  # a repeated field (protobuf versions differ in how
            target.extend(value)  # descriptors say so; containers all have extend)
        elif hasattr(target, "CopyFrom"):  # a message
            target.CopyFrom(value)
        else:
            setattr(dst, descriptor.name, value)
