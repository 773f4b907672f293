"""Check a node against its ONNX operator schema before it is planned.

Input and output counts and attribute names and types are compared with the schema
``onnx.defs`` holds for the node's op at the model's opset, so a malformed node is refused
with a message naming it, instead of failing later inside a fusion or a kernel (or an
attribute of a later opset being ignored). So are the element types of its inputs, where
they are known: each must be one its type constraint allows, and inputs sharing a type
parameter must agree (a Gather with float indices is refused, never truncated). Ops ONNX
does not define (contrib and custom domains) are left to their providers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from onnx_genrt.core.errors import ModelLoadError

if TYPE_CHECKING:  # onnx is imported when a model is planned, not with the engine
    import onnx
    from onnx import defs


#: Ops whose ONNX schema takes attributes it does not list (``AllowUncheckedAttributes`` in
#: onnx; the checker accepts any attribute on them).
UNCHECKED_ATTRIBUTES = frozenset({("", "LayerNormalization")})


def _schema(node: onnx.NodeProto, domain: str, opset: int) -> defs.OpSchema | None:
    from onnx import defs

    try:
        return defs.get_schema(node.op_type, opset, domain)
    except defs.SchemaError:
        return None


def _type_name(code: int) -> str:
    from onnx import AttributeProto

    return AttributeProto.AttributeType.Name(code)


def check_node_schema(
    node: onnx.NodeProto, domain: str, opset: int, dtypes: Sequence[np.dtype | None] = ()
) -> None:
    """Raise :class:`ModelLoadError` when ``node`` does not fit its op's ONNX schema: its
    input and output counts, its attributes, and the element types of its inputs
    (``dtypes``, None where absent or unknown)."""
    schema = _schema(node, domain, opset)
    if schema is None:
        return
    where = f"node {node.name or '<unnamed>'!r} ({node.op_type}, opset {opset})"
    fits = f"ONNX {node.op_type}-{schema.since_version}"
    n_in, n_out = len(node.input), len(node.output)
    if not schema.min_input <= n_in <= schema.max_input:
        raise ModelLoadError(
            f"{where} has {n_in} inputs; {fits} takes {schema.min_input} to {schema.max_input}"
        )
    if not schema.min_output <= n_out <= schema.max_output:
        raise ModelLoadError(
            f"{where} has {n_out} outputs; {fits} gives {schema.min_output} to {schema.max_output}"
        )
    given = {a.name: a for a in node.attribute}
    unknown = sorted(set(given) - set(schema.attributes))
    if unknown and (domain, node.op_type) not in UNCHECKED_ATTRIBUTES:
        raise ModelLoadError(
            f"{where} has attributes {unknown} that {fits} does not define (it defines "
            f"{sorted(schema.attributes) or 'none'}): remove them, or import the opset that "
            "defines them (onnxruntime refuses them too)"
        )
    for name, spec in schema.attributes.items():
        attr = given.get(name)
        if attr is None:
            if spec.required:
                raise ModelLoadError(f"{where} lacks the attribute {name!r} that {fits} requires")
            continue
        want = int(spec.type)
        if attr.type != want:
            raise ModelLoadError(
                f"{where}: attribute {name!r} is {_type_name(attr.type)}; {fits} wants "
                f"{_type_name(want)}"
            )
    _check_input_types(node, domain, schema, where, dtypes)


#: Inputs whose schema type is taken as the union of two type parameters: Tile-1 declares
#: its ``tiles`` and ``axis`` as T (its data's float type) and T1 (int64) without using T1,
#: and the models of that opset give them as int64.
TYPE_ERRATA = {("", "Tile", 1): {"tiles": ("T", "T1"), "axis": ("T", "T1")}}


def _tensor_type(dtype: np.dtype) -> str | None:
    """ONNX's name of a tensor of ``dtype`` (``tensor(float)``), None for a dtype it has none for."""
    from onnx import TensorProto, helper

    try:
        code = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    except (KeyError, TypeError, ValueError):
        return None
    return f"tensor({TensorProto.DataType.Name(code).lower()})"


def _check_input_types(
    node: onnx.NodeProto, domain: str, schema: defs.OpSchema, where: str, dtypes: Sequence
) -> None:
    """Raise :class:`ModelLoadError` when an input's element type is not one the op's
    schema allows, or differs from another input's bound to the same type parameter. The
    input count fits the schema already: inputs past its list are its variadic last one's."""
    if not schema.inputs:
        return
    allowed = {c.type_param_str: set(c.allowed_type_strs) for c in schema.type_constraints}
    bound: dict[str, tuple[str, str]] = {}
    for i, dtype in enumerate(dtypes):
        formal = schema.inputs[min(i, len(schema.inputs) - 1)]
        name = node.input[i] if i < len(node.input) else ""
        if dtype is None or not name:
            continue
        given = _tensor_type(dtype)
        if given is None:
            continue
        errata = TYPE_ERRATA.get((domain, node.op_type, schema.since_version), {})
        if formal.name in errata:  # either parameter's types, bound to neither
            wanted, param = set().union(*(allowed[p] for p in errata[formal.name])), None
        else:
            wanted = allowed.get(formal.type_str, {formal.type_str})
            homogeneous = formal.type_str in allowed and formal.is_homogeneous
            param = formal.type_str if homogeneous else None
        if given not in wanted and all(w.startswith("tensor(") for w in wanted):
            raise ModelLoadError(
                f"{where}: input {i} ({name!r}, {formal.name}) is {given}; ONNX "
                f"{node.op_type}-{schema.since_version} takes {' or '.join(sorted(wanted))}"
            )
        if param is not None:
            first = bound.setdefault(param, (given, name))
            if first[0] != given:
                raise ModelLoadError(
                    f"{where}: input {i} ({name!r}) is {given} but {first[1]!r} is "
                    f"{first[0]}; both are {param} of ONNX "
                    f"{node.op_type}-{schema.since_version}, one type"
                )
