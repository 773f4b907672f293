"""The ``onnx_genrt`` op domain: each of the runtime's own ops declared once.

An op here has a schema (inputs, outputs, attributes, allowed element types, what it
computes) and a *body*: the same computation in standard ops (ai.onnx, and the com.microsoft
ops every provider of the runtime has), built for one node from its attributes and input
types. Fusions (``session.fusion``) and the MTP chain (``engine.mtp_chain``) emit these ops;
placement (``session.plan``) runs a node's body where no provider of the session has the op.

=====================  ===========================================================  =========
op                     computes                                                     made by
=====================  ===========================================================  =========
SiluMul                ``g * sigmoid(g) * u`` (``split=1``: g, u = halves of input)  fusion
ArgMaxProb             ArgMax of the last axis and the max of its Softmax           fusion
NormMatMul             ``MatMul(rms_norm(x [+ skip]) * gamma, W)``                   fusion
NormMatMulNBits        the same with ``com.microsoft::MatMulNBits``                  fusion
NormMatMulSiluMul      ``SiluMul(NormMatMul(x, skip, gamma, W); split=1)``           fusion
NormMatMulNBitsSiluMul the same with ``com.microsoft::MatMulNBits``                  fusion
SiluMulMatMul          ``MatMul(SiluMul(g, u), W)``                                  fusion
SiluMulMatMulNBits     the same with ``com.microsoft::MatMulNBits``                  fusion
MatMulAdd              ``MatMul(A, W) + bias`` (bias a row of N)                     fusion
NonFinite              ``ReduceSum(x - x)``: 0 if all of x is finite, else NaN      fusion
MTPAccept              accepted drafts of a verify step, and the row to draft from   MTP chain
MTPNextInputs          the next verify step's start, ids, positions, mask, count     MTP chain
SampleTokens           a token per row from ``softmax(logits / temperature)``       decode head
=====================  ===========================================================  =========

Every op is version 1 of the domain. ``GENRT_OPS[name]`` is the declaration;
``expand(node, input_types)`` returns the body of one node (:class:`Body`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING, Any

import numpy as np

from .dtypes import DType, numpy_dtype_of_onnx
from .errors import ModelLoadError, UnsupportedOpError
from .kernels import GENRT_DOMAIN, MS_DOMAIN, NodeInfo, TensorType

if TYPE_CHECKING:  # onnx is imported when a body is built, not with the engine
    import onnx

#: Opsets the bodies are written against.
BODY_OPSETS: Mapping[str, int] = {"": 21, MS_DOMAIN: 1}


class AttrKind(IntEnum):
    """The ONNX ``AttributeProto.AttributeType`` codes of the ops' attributes (fixed by the
    standard; ``tests/engine/test_import_cost.py`` checks them against onnx)."""

    FLOAT = 1
    INT = 2


#: Allowed element types, by numpy dtype name (bfloat16 is ml_dtypes', imported only when
#: a model has it).
_FLOATS = ("float16", "float32", "float64", "bfloat16")
_INT64 = ("int64",)


def _onnx_type(dtype: Any) -> int:
    """The ONNX element type code of a numpy dtype (ml_dtypes' bfloat16 included)."""
    return DType.from_numpy(dtype).value


@dataclass(frozen=True)
class Formal:
    """One input or output of an op: name, type constraint, whether it may be absent."""

    name: str
    types: str
    doc: str
    optional: bool = False


@dataclass(frozen=True)
class Attribute:
    """One attribute: name, ONNX attribute type, default (None: required)."""

    name: str
    kind: int
    default: Any
    doc: str


@dataclass
class Body:
    """An instantiated function body: nodes (in order) and the constants they read. Nodes
    are written against ``BODY_OPSETS``, except those named in ``node_opsets`` (a fused
    projection keeps the opset it had in the model)."""

    nodes: list[onnx.NodeProto] = field(default_factory=list)
    initializers: dict[str, np.ndarray] = field(default_factory=dict)
    node_opsets: dict[str, int] = field(default_factory=dict)

    def opset(self, node: onnx.NodeProto) -> int:
        """The opset ``node`` of this body is to run at."""
        if node.name in self.node_opsets:
            return self.node_opsets[node.name]
        return BODY_OPSETS["" if node.domain in ("", "ai.onnx") else node.domain]

    def value_types(self, inputs: Mapping[str, TensorType | None]) -> dict[str, TensorType]:
        """Types of the body's values, by ONNX shape inference from its inputs' types
        (``inputs``: the node's inputs by name; values after an op ONNX does not know, a
        com.microsoft one, stay unknown)."""

        import onnx
        from onnx import helper

        def info(name: str, t: TensorType | None) -> onnx.ValueInfoProto:
            if t is None or t.dtype is None:
                return helper.make_empty_tensor_value_info(name)
            shape = None if t.shape is None else list(t.shape)
            return helper.make_tensor_value_info(name, _onnx_type(t.dtype), shape)

        graph = helper.make_graph(
            self.nodes,
            "body",
            [info(n, t) for n, t in inputs.items() if n],
            [],
            [onnx.numpy_helper.from_array(v, n) for n, v in self.initializers.items()],
        )
        opsets = [helper.make_opsetid(d, v) for d, v in BODY_OPSETS.items()]
        try:
            inferred = onnx.shape_inference.infer_shapes(
                helper.make_model(graph, opset_imports=opsets), strict_mode=False
            )
        except Exception:  # inference is a hint for placement; the kernels check shapes
            return {}
        types = {}
        for vi in inferred.graph.value_info:
            t = vi.type.tensor_type
            if not t.elem_type:
                continue
            shape = None
            if t.HasField("shape"):
                shape = tuple(
                    d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                    for d in t.shape.dim
                )
            types[vi.name] = TensorType(numpy_dtype_of_onnx(t.elem_type), shape)
        return types


class BodyBuilder:
    """Builds one node's body; every value and node it makes is named under the node."""

    def __init__(self, node: NodeInfo) -> None:
        self.node = node
        # an unnamed node's first output that it writes (output 0 may be left out): values
        # are made once in a graph, so two unnamed nodes never share a prefix
        named = next((o for o in node.output_names if o), node.op_type)
        self.prefix = f"{node.name or named}/"
        self.body = Body()

    def tmp(self, name: str) -> str:
        """A value private to the body."""
        return self.prefix + name

    def const(self, name: str, value: Any, dtype: Any = np.int64) -> str:
        """A constant of the body (an initializer)."""
        self.body.initializers[self.tmp(name)] = np.asarray(value, dtype)
        return self.tmp(name)

    def add(
        self, op: str, inputs: Sequence[str], outputs: Sequence[str], domain: str = "", **attrs
    ):
        """Append a node; returns its first output."""
        from onnx import helper

        index = len(self.body.nodes)
        node = helper.make_node(
            op, list(inputs), list(outputs), name=f"{self.prefix}{index}_{op}", domain=domain
        )
        node.attribute.extend(helper.make_attribute(k, v) for k, v in attrs.items())
        self.body.nodes.append(node)
        return outputs[0]

    def output(self, index: int, fallback: str) -> str:
        """The node's output ``index``, or a private value when the node leaves it out."""
        names = self.node.output_names
        return names[index] if index < len(names) and names[index] else self.tmp(fallback)


BodyFn = Callable[[BodyBuilder, Sequence[TensorType | None]], None]


@dataclass(frozen=True)
class GenrtOp:
    """Declaration of one ``onnx_genrt`` op (version 1)."""

    name: str
    doc: str
    inputs: tuple[Formal, ...]
    outputs: tuple[Formal, ...]
    attributes: tuple[Attribute, ...]
    #: Type constraint -> the allowed numpy dtype names.
    type_constraints: Mapping[str, tuple[str, ...]]
    build: BodyFn
    #: (domain, op, index of its first weight input) of the projection this op ends in (its
    #: attributes carried by the op's node), or None.
    projection: tuple[str, str, int] | None = None
    #: ``check(op, node)``: what the op's own rules refuse beyond arity, attribute names and
    #: element types (an attribute an output needs), or None.
    check: Callable[[GenrtOp, NodeInfo], str | None] | None = None

    def attr(self, node: NodeInfo, name: str) -> Any:
        """The node's value of attribute ``name``, or its default."""
        spec = next(a for a in self.attributes if a.name == name)
        return node.attrs.get(name, spec.default)

    def problem(self, node: NodeInfo, types: Sequence[TensorType | None] = ()) -> str | None:
        """Why ``node`` does not fit this schema (arity, required inputs, attributes,
        element types), or None."""
        names = node.input_names
        if len(names) > len(self.inputs):
            return f"takes at most {len(self.inputs)} inputs, got {len(names)}"
        for i, formal in enumerate(self.inputs):
            if not formal.optional and (i >= len(names) or not names[i]):
                return f"input {i} ({formal.name}) is required"
        if len(node.output_names) > len(self.outputs):
            return f"has at most {len(self.outputs)} outputs, got {len(node.output_names)}"
        known = {a.name for a in self.attributes}
        missing = [
            a.name for a in self.attributes if a.default is None and a.name not in node.attrs
        ]
        if missing:
            return f"attributes {missing} are required"
        if self.projection is None:
            extra = sorted(set(node.attrs) - known)
            if extra:
                return f"unknown attributes {extra}; {self.name} takes {sorted(known)}"
        by_constraint: dict[str, np.dtype] = {}
        for i, t in enumerate(types[: len(self.inputs)]):
            if t is None or t.dtype is None:
                continue
            formal = self.inputs[i]
            allowed = self.type_constraints.get(formal.types)
            if allowed is not None and np.dtype(t.dtype).name not in allowed:
                return f"input {i} ({formal.name}) is {t.dtype}; allowed: {list(allowed)}"
            seen = by_constraint.setdefault(formal.types, np.dtype(t.dtype))
            if seen != t.dtype and allowed is not None:
                return f"inputs of type {formal.types} differ: {seen} and {t.dtype}"
        return None if self.check is None else self.check(self, node)

    def expand(self, node: NodeInfo, types: Sequence[TensorType | None] = ()) -> Body:
        """The body of ``node``: standard-op nodes and constants computing its outputs
        (values and node names made unique under the node's name)."""
        reason = self.problem(node, types)
        if reason:
            raise ModelLoadError(f"{node.describe()}: {reason}")
        builder = BodyBuilder(node)
        padded = tuple(types) + (None,) * (len(self.inputs) - len(types))
        self.build(builder, padded)
        return builder.body


def _input(node: NodeInfo, index: int) -> str:
    names = node.input_names
    return names[index] if index < len(names) else ""


def _static_dim(node: NodeInfo, t: TensorType | None, formal: str, axis: int) -> int:
    """A dimension the body needs as a constant; UnsupportedOpError when it is not static."""
    dim = None
    if t is not None and t.shape is not None and -len(t.shape) <= axis < len(t.shape):
        dim = t.shape[axis]
    if not isinstance(dim, int):
        raise UnsupportedOpError(
            f"{node.describe()}: its standard-op body needs a static dimension {axis} of input "
            f"{formal!r} (shape {None if t is None else t.shape}); declare that shape in the "
            f"model or run on a provider with an {node.op_type} kernel"
        )
    return dim


def _is_16bit(t: TensorType | None) -> bool:
    return t is not None and t.dtype is not None and np.dtype(t.dtype).itemsize == 2


# -- SiluMul ---------------------------------------------------------------------------------


def _silu_mul(b: BodyBuilder, types, gate: str, up: str, out: str, split: int | None = None) -> str:
    """``out = g * sigmoid(g) * u`` from inputs ``gate`` and (optional) ``up``; ``split``
    (the node's attribute when None)."""
    node = b.node
    if split is None:
        split = int(GENRT_OPS[node.op_type].attr(node, "split"))
    if not up:
        if not split:
            raise ModelLoadError(f"{node.describe()}: one input (no up) needs split=1")
        halves = (b.tmp("gate"), b.tmp("up"))
        b.add("Split", [gate], halves, axis=-1, num_outputs=2)
        gate, up = halves
    elif split:
        raise ModelLoadError(f"{node.describe()}: split=1 takes one input, got gate and up")
    # 16-bit floats compute in float32 and round once, as the fused kernels do.
    wide = _is_16bit(types[0])
    if wide:
        dtype = _onnx_type(types[0].dtype)
        gate = b.add("Cast", [gate], [b.tmp("gate_f32")], to=DType.FLOAT32.value)
        up = b.add("Cast", [up], [b.tmp("up_f32")], to=DType.FLOAT32.value)
    sig = b.add("Sigmoid", [gate], [b.tmp("sigmoid")])
    silu = b.add("Mul", [gate, sig], [b.tmp("silu")])
    if not wide:
        return b.add("Mul", [silu, up], [out])
    prod = b.add("Mul", [silu, up], [b.tmp("act_f32")])
    return b.add("Cast", [prod], [out], to=dtype)


def _silu_mul_body(b: BodyBuilder, types) -> None:
    node = b.node
    _silu_mul(b, types, node.input_names[0], _input(node, 1), b.output(0, "y"))


# -- ArgMaxProb ------------------------------------------------------------------------------


def _argmax_prob_body(b: BodyBuilder, types) -> None:
    x = b.node.input_names[0]
    names = b.node.output_names
    if names and names[0]:
        b.add("ArgMax", [x], [names[0]], axis=-1, keepdims=0)
    if len(names) > 1 and names[1]:
        probs = b.add("Softmax", [x], [b.tmp("probs")], axis=-1)
        b.add("ReduceMax", [probs, b.const("axes", [-1])], [names[1]], keepdims=0)


# -- NonFinite --------------------------------------------------------------------------------


def _nonfinite_body(b: BodyBuilder, types) -> None:
    x = b.node.input_names[0]
    diff = b.add("Sub", [x, x], [b.tmp("diff")])
    b.add("ReduceSum", [diff], [b.output(0, "y")], keepdims=0)


# -- NormMatMul(NBits), SiluMulMatMul(NBits) -------------------------------------------------

#: Attributes of a fused projection op that belong to the fused op, not the projection.
_OWN_ATTRIBUTES = ("epsilon", "projection_opset", "split")


def projection_node(node: NodeInfo, activations: str) -> NodeInfo:
    """The projection inside a NormMatMul / SiluMulMatMul (or NBits) node, as that
    projection's kernel expects it: reading ``activations`` and the weights, with its own
    attributes and opset, and only output 0."""
    domain, op, first_weight = GENRT_OPS[node.op_type].projection  # type: ignore[misc]
    weights = list(node.input_names[first_weight:])
    while weights and not weights[-1]:
        weights.pop()
    return NodeInfo(
        op,
        node.name,
        domain,
        int(GENRT_OPS[node.op_type].attr(node, "projection_opset")),
        {k: v for k, v in node.attrs.items() if k not in _OWN_ATTRIBUTES},
        (activations, *weights),
        tuple(node.output_names[:1]),
    )


def _projection(b: BodyBuilder, activations: str) -> None:
    """The projection's node reading ``activations``, writing the node's output 0."""
    proj = projection_node(b.node, activations)
    b.add(proj.op_type, proj.input_names, [b.output(0, "y")], proj.domain, **proj.attrs)
    b.body.node_opsets[b.body.nodes[-1].name] = proj.opset


def _norm(b: BodyBuilder, normed: str) -> str:
    """The (Skip)SimplifiedLayerNormalization of inputs x [, skip], gamma into ``normed``,
    writing the node's output 1 (the residual sum) when it names one."""
    node = b.node
    x, skip, gamma = node.input_names[0], _input(node, 1), node.input_names[2]
    eps = float(node.attrs.get("epsilon", 1e-5))
    total = node.output_names[1] if len(node.output_names) > 1 else ""
    if skip:
        outs = [normed, "", "", total] if total else [normed]
        b.add("SkipSimplifiedLayerNormalization", [x, skip, gamma], outs, MS_DOMAIN, epsilon=eps)
    elif total:
        raise ModelLoadError(f"{node.describe()}: a sum output (1) needs a skip input (1)")
    else:
        # ai.onnx, where onnxruntime (and every provider here) registers it
        b.add("SimplifiedLayerNormalization", [x, gamma], [normed], axis=-1, epsilon=eps)
    return normed


def _norm_matmul_body(b: BodyBuilder, types) -> None:
    _projection(b, _norm(b, b.output(2, "normed")))


def _norm_matmul_silu_mul_body(b: BodyBuilder, types) -> None:
    """norm -> the projection into output 3 (gate and up side by side) -> SiluMul(split=1)
    into output 0."""
    proj = projection_node(b.node, _norm(b, b.output(2, "normed")))
    gate_up = b.add(
        proj.op_type, proj.input_names, [b.output(3, "gate_up")], proj.domain, **proj.attrs
    )
    b.body.node_opsets[b.body.nodes[-1].name] = proj.opset
    _silu_mul(b, types, gate_up, "", b.output(0, "y"), split=1)


def _silu_mul_matmul_body(b: BodyBuilder, types) -> None:
    node = b.node
    act = _silu_mul(b, types, node.input_names[0], _input(node, 1), b.output(1, "act"))
    _projection(b, act)


def _norm_gated_mlp_body(b: BodyBuilder, types) -> None:
    """norm -> MatMul(W_gate_up) -> SiluMul(split=1) -> MatMul(W_down), each MatMul at
    ``projection_opset``."""
    node = b.node
    opset = int(GENRT_OPS[node.op_type].attr(node, "projection_opset"))
    normed = _norm(b, b.output(4, "normed"))
    gate_up = b.add("MatMul", [normed, node.input_names[3]], [b.output(2, "gate_up")])
    b.body.node_opsets[b.body.nodes[-1].name] = opset
    act = _silu_mul(b, types, gate_up, "", b.output(3, "act"), split=1)
    b.add("MatMul", [act, node.input_names[4]], [b.output(0, "y")])
    b.body.node_opsets[b.body.nodes[-1].name] = opset


# -- MatMulAdd ------------------------------------------------------------------------------


def _matmul_add_body(b: BodyBuilder, types) -> None:
    """``y = MatMul(A, W) + bias``, the MatMul at the opset it had in the model."""
    a, w, bias = b.node.input_names[:3]
    product = b.add("MatMul", [a, w], [b.tmp("product")])
    b.body.node_opsets[b.body.nodes[-1].name] = int(b.node.attrs.get("projection_opset", 1))
    b.add("Add", [product, bias], [b.output(0, "y")])


# -- MTPAccept, MTPNextInputs -----------------------------------------------------------------


def _mtp_accept_body(b: BodyBuilder, types) -> None:
    """accepted = index of the first draft that is padding or disagrees with the target's
    argmax: ArgMax (first maximum) over [rejected_0 .. rejected_k-1, 1]."""
    node = b.node
    ids, argmax, hidden, count = node.input_names
    k = _static_dim(node, types[0], "ids", -1) - 1
    one, zero = b.const("1", [1]), b.const("0", [0])
    kk, k1, axis1 = b.const("k", [k]), b.const("k1", [k + 1]), b.const("axis1", [1])
    accepted = b.output(0, "accepted")
    next_ids = b.add("Slice", [ids, one, k1, axis1], [b.tmp("next_ids")])
    picks = b.add("Slice", [argmax, zero, kk, axis1], [b.tmp("picks")])
    eq = b.add("Equal", [picks, next_ids], [b.tmp("eq")])
    real = b.add("Less", [b.const("arange", np.arange(k)[None, :]), count], [b.tmp("real")])
    ok = b.add("And", [eq, real], [b.tmp("ok")])
    rejected = b.add("Not", [ok], [b.tmp("rejected")])
    # float32, which every provider's ArgMax takes (0 = accepted, 1 = stop)
    rejected_f = b.add("Cast", [rejected], [b.tmp("rejected_f")], to=DType.FLOAT32.value)
    end = b.const("end", np.ones((1, 1)), np.float32)
    stops = b.add("Concat", [rejected_f, end], [b.tmp("stops")], axis=1)
    b.add("ArgMax", [stops], [accepted], axis=1, keepdims=0)
    b.add("Gather", [argmax, accepted], [b.output(1, "token")], axis=1)
    to = int(GENRT_OPS["MTPAccept"].attr(node, "to"))
    same = types[2] is not None and types[2].dtype is not None
    same = same and _onnx_type(types[2].dtype) == to
    row = b.output(2, "row")
    gathered = row if same else b.tmp("row_in")
    b.add("Gather", [hidden, accepted], [gathered], axis=1)
    if not same:
        b.add("Cast", [gathered], [row], to=to)


def _mtp_next_inputs_problem(op: GenrtOp, node: NodeInfo) -> str | None:
    """The mask output is [1, mask_length]: it needs a width."""
    names = node.output_names
    length = int(op.attr(node, "mask_length"))
    if len(names) > 4 and names[4] and length < 1:
        return f"the mask output (4) needs mask_length >= 1, got {length}"
    return None


def _mtp_next_inputs_body(b: BodyBuilder, types) -> None:
    node = b.node
    accepted, start, token, drafts, confidences = node.input_names
    k = _static_dim(node, types[3], "drafts", -1)
    op = GENRT_OPS["MTPNextInputs"]
    conf_dtype = np.float32 if types[4] is None or types[4].dtype is None else types[4].dtype
    min_conf = b.const("min_conf", op.attr(node, "min_confidence"), conf_dtype)
    advance = b.add("Add", [accepted, b.const("1", [1])], [b.tmp("advance")])
    next_start = b.add("Add", [start, advance], [b.output(0, "next_start")])
    b.add("Concat", [token, drafts], [b.output(1, "next_ids")], axis=1)
    low = b.add("Less", [confidences, min_conf], [b.tmp("low")])
    low_f = b.add("Cast", [low], [b.tmp("low_f")], to=DType.FLOAT32.value)
    end = b.const("end", np.ones((1, 1)), np.float32)
    stops = b.add("Concat", [low_f, end], [b.tmp("stops")], axis=1)
    b.add("ArgMax", [stops], [b.output(2, "next_count")], axis=1, keepdims=0)
    names = node.output_names
    if len(names) > 3 and names[3]:
        arange = b.const("arange_w", np.arange(k + 1)[None, :])
        b.add("Add", [next_start, arange], [names[3]])
    if len(names) > 4 and names[4]:
        length = int(op.attr(node, "mask_length"))
        end_pos = b.add("Add", [next_start, b.const("width", [k + 1])], [b.tmp("end_pos")])
        arange_l = b.const("arange_l", np.arange(length)[None, :])
        mask = b.add("Less", [arange_l, end_pos], [b.tmp("mask_b")])
        b.add("Cast", [mask], [names[4]], to=DType.INT64.value)


# -- declarations -----------------------------------------------------------------------------

_T = {"T": _FLOATS}
_EPS = Attribute("epsilon", AttrKind.FLOAT, 1e-5, "added to the mean square")
_PROJ_OPSET = Attribute("projection_opset", AttrKind.INT, 1, "the projection's opset in the model")
_SPLIT = Attribute("split", AttrKind.INT, 0, "1: one input g whose last-axis halves are g and u")
_NBITS_WEIGHTS = (
    Formal("B", "T_B", "packed quantized weight, as MatMulNBits input 1"),
    Formal("scales", "T", "per-block scales, as MatMulNBits input 2"),
    Formal("zero_points", "T_ZP", "as MatMulNBits input 3", optional=True),
    Formal("g_idx", "T_I", "as MatMulNBits input 4", optional=True),
    Formal("bias", "T", "as MatMulNBits input 5", optional=True),
)
_NORM_INPUTS = (
    Formal("x", "T", "activations [..., K]"),
    Formal("skip", "T", "residual added to x before the norm (same shape)", optional=True),
    Formal("gamma", "T", "norm scale [K]"),
)
_NORM_OUTPUTS = (
    Formal("y", "T", "the projection of the normalized activations"),
    Formal("sum", "T", "x + skip, the residual (needs skip)", optional=True),
    Formal(
        "normed",
        "T",
        "the normalized activations where an implementation makes them (the body does); "
        "a fused kernel may use it as scratch only, so nothing may read it",
        optional=True,
    ),
)
_GATED_OUTPUTS = (
    Formal("y", "T", "SiluMul of the gate and up halves of the projection [..., F]"),
    *_NORM_OUTPUTS[1:],
    Formal(
        "gate_up",
        "T",
        "the projection [..., 2F] where an implementation makes it (the body does); a fused "
        "kernel may use it as scratch only, so nothing may read it",
        optional=True,
    ),
)
_SILU_INPUTS = (
    Formal("g", "T", "gate [..., K] (split=1: gate and up side by side, [..., 2K])"),
    Formal("u", "T", "up [..., K]; absent with split=1", optional=True),
)
_SILU_OUTPUTS = (
    Formal("y", "T", "the projection of the activations"),
    Formal(
        "act",
        "T",
        "SiluMul(g, u) where an implementation makes it (the body does); a fused kernel "
        "may use it as scratch only, so nothing may read it",
        optional=True,
    ),
)
_NBITS_TYPES = {
    **_T,
    "T_B": ("uint8",),
    "T_ZP": ("uint8", "int32", *_T["T"]),
    "T_I": ("int32",),
}


def _fused_ops() -> list[GenrtOp]:
    """The ops fusion makes: activations, the argmax head, norms and SiluMul in projections,
    a projection's bias."""
    return [
        GenrtOp(
            "SiluMul",
            "``y = g * sigmoid(g) * u`` elementwise, the gated-MLP activation; with one input "
            "and split=1, g and u are the first and second half of its last axis. 16-bit "
            "floats compute in float32 and round once.",
            _SILU_INPUTS,
            (Formal("y", "T", "the activations, the shape of g (of one half with split=1)"),),
            (_SPLIT,),
            _T,
            _silu_mul_body,
        ),
        GenrtOp(
            "ArgMaxProb",
            "Over the last axis of x: the first index of the largest value (ArgMax, "
            "keepdims=0) and its softmax probability ``1 / sum(exp(x - max))`` "
            "(ReduceMax of Softmax, keepdims=0).",
            (Formal("x", "T", "scores [..., V]"),),
            (
                Formal("index", "I", "argmax [...], int64"),
                Formal("probability", "T", "softmax probability of index [...]"),
            ),
            (),
            {**_T, "I": _INT64},
            _argmax_prob_body,
        ),
        GenrtOp(
            "NonFinite",
            "``ReduceSum(x - x)`` over every axis (keepdims=0): 0 when every element of x "
            "is finite, NaN when one is NaN or infinite, whatever the order of the sum (a "
            "decoder's non-finite probe of its logits).",
            (Formal("x", "T", "any tensor"),),
            (Formal("y", "T", "the scalar 0 or NaN"),),
            (),
            _T,
            _nonfinite_body,
        ),
        GenrtOp(
            "NormMatMul",
            "``y = MatMul(normed, W)`` with ``normed = (Skip)SimplifiedLayerNormalization("
            "x [, skip], gamma, epsilon)`` over the last axis (RMS norm, float32 statistics); "
            "the projection is ai.onnx MatMul at ``projection_opset``.",
            (*_NORM_INPUTS, Formal("W", "T", "weight [K, N]")),
            _NORM_OUTPUTS,
            (_EPS, _PROJ_OPSET),
            _T,
            _norm_matmul_body,
            projection=("", "MatMul", 3),
        ),
        GenrtOp(
            "NormMatMulNBits",
            "NormMatMul with the projection a com.microsoft MatMulNBits (its attributes K, "
            "N, bits, block_size, accuracy_level carried by this node).",
            (*_NORM_INPUTS, *_NBITS_WEIGHTS),
            _NORM_OUTPUTS,
            (_EPS, _PROJ_OPSET),
            _NBITS_TYPES,
            _norm_matmul_body,
            projection=(MS_DOMAIN, "MatMulNBits", 3),
        ),
        GenrtOp(
            "SiluMulMatMul",
            "``y = MatMul(SiluMul(g, u; split), W)``; the projection is ai.onnx MatMul at "
            "``projection_opset``.",
            (*_SILU_INPUTS, Formal("W", "T", "weight [K, N]")),
            _SILU_OUTPUTS,
            (_SPLIT, _PROJ_OPSET),
            _T,
            _silu_mul_matmul_body,
            projection=("", "MatMul", 2),
        ),
        GenrtOp(
            "MatMulAdd",
            "``y = MatMul(A, W) + bias``: a projection and the Add of its bias (a row of N, "
            "broadcast over A's rows), each result rounded as the two ops round it; the "
            "MatMul is ai.onnx MatMul at ``projection_opset``.",
            (
                Formal("A", "T", "activations [..., K]"),
                Formal("W", "T", "weight [K, N]"),
                Formal("bias", "T", "bias [N]"),
            ),
            (Formal("y", "T", "[..., N]"),),
            (_PROJ_OPSET,),
            _T,
            _matmul_add_body,
        ),
        GenrtOp(
            "SiluMulMatMulNBits",
            "SiluMulMatMul with the projection a com.microsoft MatMulNBits (its attributes "
            "carried by this node).",
            (*_SILU_INPUTS, *_NBITS_WEIGHTS),
            _SILU_OUTPUTS,
            (_SPLIT, _PROJ_OPSET),
            _NBITS_TYPES,
            _silu_mul_matmul_body,
            projection=(MS_DOMAIN, "MatMulNBits", 2),
        ),
    ]


def _gated_ops() -> list[GenrtOp]:
    """A gated MLP's gate/up projection with the SiluMul of its halves."""
    return [
        GenrtOp(
            "NormMatMulSiluMul",
            "``y = SiluMul(MatMul(normed, W); split=1)`` with ``normed`` as in NormMatMul: a "
            "gated MLP's gate/up projection (gate and up side by side in W [K, 2F]) and its "
            "activation, y [..., F]; the projection is ai.onnx MatMul at ``projection_opset``.",
            (*_NORM_INPUTS, Formal("W", "T", "gate and up weights side by side [K, 2F]")),
            _GATED_OUTPUTS,
            (_EPS, _PROJ_OPSET),
            _T,
            _norm_matmul_silu_mul_body,
            projection=("", "MatMul", 3),
        ),
        GenrtOp(
            "NormMatMulNBitsSiluMul",
            "NormMatMulSiluMul with the projection a com.microsoft MatMulNBits of N = 2F "
            "(its attributes K, N, bits, block_size, accuracy_level carried by this node).",
            (*_NORM_INPUTS, *_NBITS_WEIGHTS),
            _GATED_OUTPUTS,
            (_EPS, _PROJ_OPSET),
            _NBITS_TYPES,
            _norm_matmul_silu_mul_body,
            projection=(MS_DOMAIN, "MatMulNBits", 3),
        ),
    ]


def _layer_ops() -> list[GenrtOp]:
    """Fused ops spanning several projections of a decoder layer."""
    return [
        GenrtOp(
            "NormGatedMLP",
            "A decoder layer's gated MLP after its norm: ``y = MatMul(SiluMul(MatMul(normed, "
            "W_gate_up); split=1), W_down)`` with ``normed`` as in NormMatMul; both "
            "projections are ai.onnx MatMul at ``projection_opset``.",
            (
                *_NORM_INPUTS,
                Formal("W_gate_up", "T", "gate and up weights side by side [K, 2F]"),
                Formal("W_down", "T", "down weight [F, N]"),
            ),
            (
                Formal("y", "T", "the down projection [..., N]"),
                Formal("sum", "T", "x + skip, the residual (needs skip)", optional=True),
                *(
                    Formal(
                        name,
                        "T",
                        f"{what} where an implementation makes it (the body does); a fused "
                        "kernel may use it as scratch only, so nothing may read it",
                        optional=True,
                    )
                    for name, what in (
                        ("gate_up", "the gate/up projection [..., 2F]"),
                        ("act", "SiluMul of gate_up [..., F]"),
                        ("normed", "the normalized activations [..., K]"),
                    )
                ),
            ),
            (_EPS, _PROJ_OPSET),
            _T,
            _norm_gated_mlp_body,
        ),
    ]


def _mtp_ops() -> list[GenrtOp]:
    """The ops of the MTP chain: accepting drafts, and the next verify step's inputs."""
    return [
        GenrtOp(
            "MTPAccept",
            "After a verify step of width k + 1: ``accepted`` = the length of the leading "
            "run of i < k with ``argmax[0, i] == ids[0, i + 1]`` and ``i < count[0]``; "
            "``token = argmax[:, accepted]`` and ``row = hidden[:, accepted]`` cast to "
            "``to``, the state the MTP chain drafts from. The body needs k static.",
            (
                Formal("ids", "I", "the verify step's ids [1, k + 1]: pending token, drafts"),
                Formal("argmax", "I", "the target's argmax per row [1, k + 1]"),
                Formal("hidden", "T", "the target's hidden states [1, k + 1, H]"),
                Formal("count", "I", "how many drafts are real [1]; the rest is padding"),
            ),
            (
                Formal("accepted", "I", "accepted drafts [1]"),
                Formal("token", "I", "the target's token after them [1, 1]"),
                Formal("row", "T_TO", "the hidden row there [1, 1, H], of type ``to``"),
            ),
            (Attribute("to", AttrKind.INT, DType.FLOAT32.value, "element type of row"),),
            {**_T, "I": _INT64, "T_TO": _T["T"]},
            _mtp_accept_body,
        ),
        GenrtOp(
            "MTPNextInputs",
            "The next verify step's inputs after an MTP chain: ``next_start = start + "
            "accepted + 1``; ``next_ids = [token, drafts]``; ``next_count`` = the leading "
            "drafts with confidence >= ``min_confidence``; ``positions = next_start + "
            "arange(k + 1)``; ``mask[0, j] = j < next_start + k + 1`` for j < "
            "``mask_length`` (int64). The body needs k static.",
            (
                Formal("accepted", "I", "accepted drafts of the last verify step [1]"),
                Formal("start", "I", "cache length that verify step started at [1]"),
                Formal("token", "I", "the new pending token [1, 1]"),
                Formal("drafts", "I", "the chain's drafts [1, k]"),
                Formal("confidences", "T", "their softmax probabilities [1, k]"),
            ),
            (
                Formal("next_start", "I", "[1]"),
                Formal("next_ids", "I", "[1, k + 1]"),
                Formal("next_count", "I", "[1]"),
                Formal("positions", "I", "[1, k + 1]", optional=True),
                Formal("mask", "I", "[1, mask_length]", optional=True),
            ),
            (
                Attribute(
                    "min_confidence",
                    AttrKind.FLOAT,
                    0.0,
                    "drafts below it end the count",
                ),
                Attribute("mask_length", AttrKind.INT, 0, "width of mask"),
            ),
            {**_T, "I": _INT64},
            _mtp_next_inputs_body,
            check=_mtp_next_inputs_problem,
        ),
    ]


# -- SampleTokens -----------------------------------------------------------------------------


def _sample_tokens_body(b: BodyBuilder, types) -> None:
    """``core.token_sampling``'s rule in standard ops: Philox4x32-10 in uint64 arithmetic
    (each 32 x 32-bit product exact in 64 bits), one entry of four words per vocabulary index,
    then the Gumbel scores and their first argmax."""
    from .token_sampling import MASK32, PHILOX_M, PHILOX_ROUNDS, PHILOX_W, SAMPLE_STREAM

    logits, temperature, seed, offset = b.node.input_names[:4]
    u64 = DType.UINT64.value

    def const(name: str, value: int) -> str:
        return b.const(name, value, np.uint64)

    mask, n32 = const("mask32", MASK32), const("n32", 32)

    def op(kind: str, *inputs: str, **attrs) -> str:
        return b.add(kind, list(inputs), [b.tmp(f"{kind.lower()}{len(b.body.nodes)}")], **attrs)

    def shr(x: str, bits: str) -> str:
        return op("BitShift", x, bits, direction="RIGHT")

    def low(x: str) -> str:
        return op("BitwiseAnd", x, mask)

    x = op("Cast", logits, to=DType.FLOAT32.value)
    vocab = op("Squeeze", op("Shape", x, start=-1), b.const("axis0", [0]))
    index = op("Cast", op("Range", b.const("zero", 0), vocab, b.const("one", 1)), to=u64)
    last = b.const("last", [-1])
    s = op("Unsqueeze", op("Cast", seed, to=u64), last)
    o = op("Unsqueeze", op("Cast", offset, to=u64), last)
    c = [shr(index, const("two", 2)), low(o), shr(o, n32), const("stream", SAMPLE_STREAM)]
    k = [low(s), shr(s, n32)]
    m = [const("m0", PHILOX_M[0]), const("m1", PHILOX_M[1])]
    w = [const("w0", PHILOX_W[0]), const("w1", PHILOX_W[1])]
    for r in range(PHILOX_ROUNDS):
        if r:
            k = [low(op("Add", k[0], w[0])), low(op("Add", k[1], w[1]))]
        p0, p1 = op("Mul", m[0], c[0]), op("Mul", m[1], c[2])
        c = [
            op("BitwiseXor", op("BitwiseXor", shr(p1, n32), c[1]), k[0]),
            low(p1),
            op("BitwiseXor", op("BitwiseXor", shr(p0, n32), c[3]), k[1]),
            low(p0),
        ]
    word = op("BitwiseAnd", index, const("three", 3))
    bits = ""  # the entry's word: the sum of each word times (word == i), one of them 1
    for i in range(4):
        pick = op("Mul", c[i], op("Cast", op("Equal", word, const(f"word{i}", i)), to=u64))
        bits = op("Add", bits, pick) if bits else pick
    odd = op("Add", op("Mul", shr(bits, const("nine", 9)), const("two_u", 2)), const("one_u", 1))
    u = op("Mul", op("Cast", odd, to=DType.FLOAT32.value), b.const("ulp", 2.0**-24, np.float32))
    noise = op("Neg", op("Log", op("Neg", op("Log", u))))
    t = op("Unsqueeze", op("Cast", temperature, to=DType.FLOAT32.value), last)
    hot = op("Greater", t, b.const("zero_f", 0.0, np.float32))
    scaled = op("Add", op("Div", x, op("Where", hot, t, b.const("one_f", 1.0, np.float32))), noise)
    scores = op("Where", hot, scaled, x)
    ninf = b.const("ninf", -np.inf, np.float32)
    if len(b.node.input_names) > 4 and b.node.input_names[4]:
        # the k-th largest logit (a full descending sort; NaN as -inf), -inf where k is off
        finite = op("Where", op("IsNaN", x), ninf, x)
        full = op("Shape", x, start=-1)
        ordered = b.add("TopK", [finite, full], [b.tmp("sorted"), b.tmp("order")], axis=-1)
        k = op("Unsqueeze", b.node.input_names[4], last)
        one, zero = b.const("k_one", 1), b.const("k_zero", 0)
        at = op("Clip", op("Sub", k, one), zero, op("Sub", full, one))
        kth = op("GatherElements", ordered, at, axis=-1)
        on = op("And", op("Greater", k, zero), op("Less", k, full))
        floor = op("Where", on, kth, ninf)
        scores = op("Where", op("And", hot, op("Less", x, floor)), ninf, scores)
    scores = op("Where", op("IsNaN", scores), ninf, scores)
    b.add("ArgMax", [scores], [b.output(0, "tokens")], axis=-1, keepdims=0)


def _sample_tokens_problem(op: GenrtOp, node: NodeInfo) -> str | None:
    """Refuse a node without its four inputs (the schema's optional flags cannot say it)."""
    if len(node.input_names) < 4 or not all(node.input_names[:4]):
        return "SampleTokens needs logits, temperature, seed and offset (top_k is optional)"
    return None


def _sampling_ops() -> list[GenrtOp]:
    """Device-side sampling (``core.token_sampling``)."""
    return [
        GenrtOp(
            "SampleTokens",
            "A token per row drawn from ``softmax(logits / temperature)`` by the Gumbel-max "
            "trick with Philox4x32-10 noise keyed by ``seed`` and counted by ``offset`` and "
            "the vocabulary index (``core.token_sampling``): the first largest of ``logits / "
            "temperature - log(-log(u))`` in float32 over the entries at or above the row's "
            "``top_k``-th largest logit (0: all); ``temperature <= 0``: the argmax of the "
            "logits. temperature, seed, offset and top_k are shaped like the logits but the "
            "last axis.",
            (
                Formal("logits", "T", "[..., vocab]"),
                Formal("temperature", "F", "[...] (float32)"),
                Formal("seed", "I", "[...]: the key (its 64 bits)"),
                Formal("offset", "I", "[...]: the draw's number in its sequence"),
                Formal("top_k", "I", "[...]: entries kept per row (0: all)", optional=True),
            ),
            (Formal("tokens", "I", "[...] int64"),),
            (),
            {**_T, "F": ("float32",), "I": _INT64},
            _sample_tokens_body,
            check=_sample_tokens_problem,
        ),
    ]


def _ops() -> dict[str, GenrtOp]:
    ops = [*_fused_ops(), *_gated_ops(), *_layer_ops(), *_mtp_ops(), *_sampling_ops()]
    return {op.name: op for op in ops}


#: Every ``onnx_genrt`` op by name.
GENRT_OPS: Mapping[str, GenrtOp] = _ops()


def _by_projection(*names: str) -> Mapping[tuple[str, str], str]:
    return {GENRT_OPS[name].projection[:2]: name for name in names}  # type: ignore[index]


#: Projection (domain, op) -> the op that normalizes its activations first (NormMatMul...).
NORM_PROJECTIONS = _by_projection("NormMatMul", "NormMatMulNBits")
#: Projection (domain, op) -> the op that makes its SiluMul activations first.
SILU_PROJECTIONS = _by_projection("SiluMulMatMul", "SiluMulMatMulNBits")
#: Projection (domain, op) -> the op that normalizes its activations and applies SiluMul to
#: its gate and up halves (NormMatMulSiluMul...).
GATED_PROJECTIONS = _by_projection("NormMatMulSiluMul", "NormMatMulNBitsSiluMul")


def check_node(node: NodeInfo, input_types: Sequence[TensorType | None] = ()) -> None:
    """ModelLoadError naming the node when an ``onnx_genrt`` node breaks its op's schema
    (placement checks every node of the domain before asking providers)."""
    op = GENRT_OPS.get(node.op_type)
    reason = None if op is None else op.problem(node, input_types)
    if reason:
        raise ModelLoadError(f"{node.describe()}: {reason}")


def expand(node: NodeInfo, input_types: Sequence[TensorType | None] = ()) -> Body:
    """The standard-op body of an ``onnx_genrt`` node (see :meth:`GenrtOp.expand`)."""
    op = GENRT_OPS.get(node.op_type) if node.domain == GENRT_DOMAIN else None
    if op is None:
        raise UnsupportedOpError(
            f"{node.describe()}: not an op of the {GENRT_DOMAIN} domain ({', '.join(GENRT_OPS)})"
        )
    if node.opset != 1:
        raise UnsupportedOpError(f"{node.describe()}: {GENRT_DOMAIN} ops have version 1 only")
    return op.expand(node, input_types)
