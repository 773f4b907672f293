"""Mutations of a valid ONNX model, each drawn with hypothesis: dims, element types,
attributes, edges, initializer bytes, opset versions, op types and the serialized bytes."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import onnx
from hypothesis import strategies as st
from onnx import AttributeProto, TensorProto, helper

Draw = Callable[[st.SearchStrategy], object]

ELEM_TYPES = [t for t in TensorProto.DataType.values() if t != TensorProto.UNDEFINED] + [0, 99]
OP_TYPES = [
    "Add", "MatMul", "Relu", "Reshape", "Transpose", "Gather", "Concat", "Slice", "Softmax",
    "ReduceSum", "Cast", "Where", "Expand", "Conv", "Identity", "Shape", "Split", "Squeeze",
    "Unsqueeze", "Tile", "Pad", "ArgMax", "TopK", "Range", "LayerNormalization", "Einsum",
    "NoSuchOp",
]  # fmt: skip
DIMS = st.one_of(st.integers(-3, 9), st.just(2**40), st.sampled_from(["n", "", "batch"]))
INTS = st.integers(-(2**40), 2**40) | st.integers(-4, 8)
FLOATS = st.floats(allow_nan=True, allow_infinity=True, width=32)


def _values(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    g = model.graph
    return [*g.input, *g.output, *g.value_info]


def _names(model: onnx.ModelProto) -> list[str]:
    g = model.graph
    names = [v.name for v in g.input] + [i.name for i in g.initializer]
    names += [o for n in g.node for o in n.output]
    return names + ["", "nowhere"]


def mutate_dim(model: onnx.ModelProto, draw: Draw) -> None:
    values = [v for v in _values(model) if v.type.HasField("tensor_type")]
    value = draw(st.sampled_from(values))
    shape = value.type.tensor_type.shape
    choice = draw(st.integers(0, 3))
    if choice == 0 or not shape.dim:
        shape.dim.add()
    if choice == 1:
        value.type.tensor_type.ClearField("shape")
        return
    if choice == 2 and shape.dim:
        del shape.dim[draw(st.integers(0, len(shape.dim) - 1))]
        return
    dim = shape.dim[draw(st.integers(0, len(shape.dim) - 1))]
    new = draw(DIMS)
    if isinstance(new, str):
        dim.dim_param = new
    else:
        dim.dim_value = new


def mutate_elem_type(model: onnx.ModelProto, draw: Draw) -> None:
    targets: list = [v.type.tensor_type for v in _values(model) if v.type.HasField("tensor_type")]
    targets += list(model.graph.initializer)
    target = draw(st.sampled_from(targets))
    new = draw(st.sampled_from(ELEM_TYPES))
    if isinstance(target, TensorProto):
        target.data_type = new
    else:
        target.elem_type = new


def mutate_attribute(model: onnx.ModelProto, draw: Draw) -> None:
    node = draw(st.sampled_from(list(model.graph.node)))
    choice = draw(st.integers(0, 2))
    if choice == 0 and node.attribute:
        del node.attribute[draw(st.integers(0, len(node.attribute) - 1))]
        return
    if choice == 1 or not node.attribute:
        name = draw(st.sampled_from(["axis", "perm", "to", "keepdims", "pads", "bogus", "value"]))
        node.attribute.append(_random_attribute(name, draw))
        return
    index = draw(st.integers(0, len(node.attribute) - 1))
    old = node.attribute[index]
    node.attribute[index].CopyFrom(_random_attribute(old.name, draw))


def _random_attribute(name: str, draw: Draw) -> AttributeProto:
    kind = draw(st.sampled_from(["int", "float", "ints", "string", "floats", "tensor"]))
    if kind == "int":
        return helper.make_attribute(name, draw(INTS))
    if kind == "float":
        return helper.make_attribute(name, draw(FLOATS))
    if kind == "ints":
        attr = AttributeProto(name=name, type=AttributeProto.INTS)
        attr.ints.extend(draw(st.lists(INTS, max_size=5)))
        return attr
    if kind == "floats":
        attr = AttributeProto(name=name, type=AttributeProto.FLOATS)
        attr.floats.extend(draw(st.lists(FLOATS, max_size=4)))
        return attr
    if kind == "tensor":
        tensor = TensorProto(name="t", data_type=TensorProto.FLOAT, raw_data=b"\0" * 3)
        tensor.dims.extend(draw(st.lists(st.integers(0, 3), max_size=3)))
        return helper.make_attribute(name, tensor)
    return helper.make_attribute(name, draw(st.text(max_size=4)))


def mutate_edge(model: onnx.ModelProto, draw: Draw) -> None:
    g = model.graph
    node = draw(st.sampled_from(list(g.node)))
    choice = draw(st.integers(0, 5))
    names = _names(model)
    if choice == 0 and node.input:  # rewire an input
        node.input[draw(st.integers(0, len(node.input) - 1))] = draw(st.sampled_from(names))
    elif choice == 1:  # an extra or a dropped input
        if node.input and draw(st.booleans()):
            del node.input[-1]
        else:
            node.input.append(draw(st.sampled_from(names)))
    elif choice == 2 and node.output:  # rename an output (duplicates and cycles included)
        node.output[draw(st.integers(0, len(node.output) - 1))] = draw(st.sampled_from(names))
    elif choice == 3:  # drop a node
        g.node.remove(node)
    elif choice == 4:  # a graph output naming another value
        if g.output:
            g.output[draw(st.integers(0, len(g.output) - 1))].name = draw(st.sampled_from(names))
    else:  # reorder
        nodes = list(g.node)
        i, j = (draw(st.integers(0, len(nodes) - 1)) for _ in range(2))
        nodes[i], nodes[j] = nodes[j], nodes[i]
        del g.node[:]
        g.node.extend(nodes)


def mutate_initializer(model: onnx.ModelProto, draw: Draw) -> None:
    inits = list(model.graph.initializer)
    if not inits:
        return
    tensor = draw(st.sampled_from(inits))
    data = tensor.raw_data
    if not data:
        with contextlib.suppress(Exception):  # a tensor an earlier mutation broke
            data = onnx.numpy_helper.to_array(tensor).tobytes()
    choice = draw(st.integers(0, 4))
    tensor.ClearField("float_data")
    tensor.ClearField("int64_data")
    tensor.ClearField("int32_data")
    if choice == 0:  # truncate or extend the bytes
        data = data[: draw(st.integers(0, len(data)))] + draw(st.binary(max_size=9))
    elif choice == 1 and data:  # overwrite some bytes (NaN, huge ids, ...)
        at = draw(st.integers(0, len(data) - 1))
        patch = draw(st.binary(min_size=1, max_size=8))
        data = data[:at] + patch + data[at + len(patch) :]
    elif choice == 2:  # new dims
        del tensor.dims[:]
        tensor.dims.extend(draw(st.lists(st.integers(-2, 6), max_size=4)))
    elif choice == 3:  # external data that is not there
        tensor.data_location = TensorProto.EXTERNAL
        tensor.external_data.add(key="location", value=draw(st.sampled_from(["w.bin", "../x"])))
    else:  # typed fields instead of raw bytes
        tensor.data_type = TensorProto.FLOAT
        tensor.float_data.extend(draw(st.lists(FLOATS, max_size=6)))
        data = b""
    tensor.raw_data = data


def mutate_opset(model: onnx.ModelProto, draw: Draw) -> None:
    choice = draw(st.integers(0, 3))
    if choice == 0 and model.opset_import:
        model.opset_import[0].version = draw(st.integers(-1, 40) | st.just(999))
    elif choice == 1:
        model.opset_import.add(domain=draw(st.sampled_from(["com.microsoft", "x", ""])), version=1)
    elif choice == 2:
        node = draw(st.sampled_from(list(model.graph.node)))
        node.domain = draw(st.sampled_from(["com.microsoft", "ai.onnx", "unknown.domain"]))
    else:
        del model.opset_import[:]


def mutate_op_type(model: onnx.ModelProto, draw: Draw) -> None:
    node = draw(st.sampled_from(list(model.graph.node)))
    node.op_type = draw(st.sampled_from(OP_TYPES))


MUTATIONS = [
    mutate_dim,
    mutate_elem_type,
    mutate_attribute,
    mutate_edge,
    mutate_initializer,
    mutate_opset,
    mutate_op_type,
]


def mutate_bytes(data: bytes, draw: Draw) -> bytes:
    """Flip, cut or splice the serialized model."""
    if not data:
        return data
    at = draw(st.integers(0, len(data) - 1))
    if draw(st.booleans()):
        return data[:at]
    patch = draw(st.binary(min_size=1, max_size=4))
    return data[:at] + patch + data[at + len(patch) :]
