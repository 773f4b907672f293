"""Check a node against its ONNX operator schema before it is planned.

Input and output counts and attribute names and types are compared with the schema
``onnx.defs`` holds for the node's op at the model's opset, so a malformed node is refused
with a message naming it, instead of failing later inside a fusion or a kernel (or an
attribute of a later opset being ignored). Ops ONNX does not define (contrib and custom
domains) are left to their providers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

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


def check_node_schema(node: onnx.NodeProto, domain: str, opset: int) -> None:
    """Raise :class:`ModelLoadError` when ``node`` does not fit its op's ONNX schema."""
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
