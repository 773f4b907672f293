"""Turn an ONNX graph into an ordered list of steps, each placed on a provider."""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from onnx_genrt.core.dtypes import numpy_dtype_of_onnx
from onnx_genrt.core.errors import KernelError, ModelLoadError, UnsupportedOpError
from onnx_genrt.core.genrt_ops import check_node, expand
from onnx_genrt.core.kernels import (
    GENRT_DOMAIN,
    KernelContext,
    KernelDef,
    NodeInfo,
    TensorType,
    normalize_domain,
    opset_map,
)
from onnx_genrt.core.provider import ExecutionProvider

from .fusion import (
    fuse_argmax_prob,
    fuse_gate_up,
    fuse_gated_mlp,
    fuse_gated_projection,
    fuse_matmul_add,
    fuse_nonfinite,
    fuse_norm_matmul,
    fuse_rms_norm,
    fuse_silu_matmul,
    fuse_silu_mul,
    fuse_skip_rms_norm,
)
from .loader import graph_without_initializers
from .schema_check import check_node_schema

if TYPE_CHECKING:  # onnx is imported when a model is planned, not with the engine
    import onnx

#: Ops whose output changes from run to run; never folded.
NONDETERMINISTIC = {
    "RandomNormal",
    "RandomUniform",
    "RandomNormalLike",
    "RandomUniformLike",
    "Multinomial",
    "Bernoulli",
}
#: Do not fold results larger than this (bytes); a tied embedding transposed once is far below it.
FOLD_LIMIT = 2 << 30


@dataclass
class Step:
    """One node, its kernel and the provider it runs on."""

    node: NodeInfo
    kernel: KernelDef
    provider: ExecutionProvider
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


@dataclass(frozen=True)
class ValueSpec:
    """A graph input or output as declared: name, numpy dtype and shape (None = unknown dim)."""

    name: str
    dtype: np.dtype | None
    shape: tuple[int | str | None, ...] | None


@dataclass
class GraphPlan:
    """Everything needed to run a model, decided once at load."""

    steps: list[Step]
    constants: dict[str, np.ndarray]
    inputs: list[ValueSpec]
    outputs: list[ValueSpec]
    folded: int = 0
    #: Steps that replace several nodes (see ``session.fusion``).
    fused: int = 0
    value_types: dict[str, ValueSpec] = field(default_factory=dict)
    #: Nodes of ``onnx_genrt`` bodies (``core.genrt_ops``) -> the node each body replaces.
    bodies: dict[str, str] = field(default_factory=dict)
    #: The provider that holds values when no step runs anywhere (a graph without nodes:
    #: its outputs are inputs or constants); the session's first.
    home: ExecutionProvider | None = None

    @property
    def providers(self) -> list[ExecutionProvider]:
        """The providers the steps run on, in order of first use; the ``home`` provider
        alone for a graph without steps."""
        seen: dict[int, ExecutionProvider] = {}
        for s in self.steps:
            seen.setdefault(id(s.provider), s.provider)
        if not seen and self.home is not None:
            return [self.home]
        return list(seen.values())

    def placement_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for s in self.steps:
            counts[s.provider.name] = counts.get(s.provider.name, 0) + 1
        return counts

    def type_of(self, name: str) -> TensorType | None:
        """The type a value had when providers were asked about it (see :func:`value_type`)."""
        return value_type(self.constants, self.value_types, name)


def value_type(
    constants: dict[str, np.ndarray], value_types: dict[str, ValueSpec], name: str
) -> TensorType | None:
    """A value's type: a constant's dtype and shape, else ONNX shape inference's (None when
    it knows nothing). Placement and fusions ask providers with these."""
    if name in constants:
        return TensorType(constants[name].dtype, tuple(constants[name].shape))
    spec = value_types.get(name)
    return None if spec is None else TensorType(spec.dtype, spec.shape)


def _value_spec(vi: onnx.ValueInfoProto) -> ValueSpec:
    t = vi.type.tensor_type if vi.type.HasField("tensor_type") else None
    if t is None:
        return ValueSpec(vi.name, None, None)
    try:
        dtype = numpy_dtype_of_onnx(t.elem_type) if t.elem_type else None
    except (KeyError, TypeError, ValueError):
        raise ModelLoadError(
            f"value {vi.name!r} declares element type {t.elem_type}, which is no ONNX type "
            "onnx-genrt knows"
        ) from None
    shape = None
    if t.HasField("shape"):
        shape = tuple(
            d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.shape.dim
        )
    return ValueSpec(vi.name, dtype, shape)


def topological_order(graph: onnx.GraphProto, available: set[str]) -> list[onnx.NodeProto]:
    """Nodes ordered so each runs after its producers; stable for already-sorted graphs."""
    producers: dict[str, int] = {}
    for i, node in enumerate(graph.node):
        for out in node.output:
            if out:
                if out in producers:
                    raise ModelLoadError(
                        f"value {out!r} is produced twice (nodes {producers[out]} and {i})"
                    )
                producers[out] = i
    waiting: list[int] = [0] * len(graph.node)
    readers: dict[int, list[int]] = {}
    for i, node in enumerate(graph.node):
        deps = set()
        for name in node.input:
            if not name or name in available:
                continue
            if name not in producers:
                raise ModelLoadError(
                    f"node {node.name or i!r} ({node.op_type}) reads {name!r}, which no node, "
                    "input or initializer provides"
                )
            deps.add(producers[name])
        waiting[i] = len(deps)
        for d in deps:
            readers.setdefault(d, []).append(i)
    ready = [i for i, n in enumerate(waiting) if n == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for r in readers.get(i, []):
            waiting[r] -= 1
            if waiting[r] == 0:
                heapq.heappush(ready, r)
    if len(order) != len(graph.node):
        stuck = [graph.node[i].name or str(i) for i, n in enumerate(waiting) if n > 0]
        raise ModelLoadError(f"graph has a cycle through nodes {stuck[:5]}")
    return [graph.node[i] for i in order]


def _infer_value_types(model: onnx.ModelProto) -> dict[str, ValueSpec]:
    import onnx

    try:
        inferred = onnx.shape_inference.infer_shapes(
            _shape_skeleton(model), strict_mode=False, data_prop=True
        )
    except Exception:
        inferred = model
    g = inferred.graph
    return {vi.name: _value_spec(vi) for vi in [*g.input, *g.value_info, *g.output]}


#: Initializers up to this many elements go to shape inference with their values (shapes,
#: axes and other small tensors that data propagation reads); larger ones by type only.
SKELETON_VALUES_MAX = 1024


def _shape_skeleton(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` without the bytes of its large initializers, which become typed graph
    inputs: shape inference serializes the model it is given (and parses it back twice),
    so weights would be copied three times for types that their dims already give."""
    from onnx import helper

    skeleton = graph_without_initializers(model)
    graph, src = skeleton.graph, model.graph
    declared = {vi.name for vi in src.input}
    for init in src.initializer:
        count = int(np.prod(init.dims, dtype=np.int64))
        if count <= SKELETON_VALUES_MAX and not init.external_data:
            graph.initializer.append(init)
        elif init.name not in declared:
            graph.input.append(
                helper.make_tensor_value_info(init.name, init.data_type, list(init.dims))
            )
    return skeleton


def build_plan(
    model: onnx.ModelProto,
    providers: Sequence[ExecutionProvider],
    weights: Mapping[str, np.ndarray] | None = None,
) -> GraphPlan:
    """Order, place and constant-fold the model's graph. An ``onnx_genrt`` node that no
    provider supports is replaced by its standard-op body (``core.genrt_ops``), placed
    node by node. ``weights``: initializers whose data the proto leaves in external files,
    as arrays (``session.loader.open_model``)."""
    graph = model.graph
    opsets = opset_map(model)
    constants = _read_initializers(graph, weights or {})
    if graph.sparse_initializer:
        names = [sp.values.name for sp in graph.sparse_initializer]
        raise ModelLoadError(
            f"sparse initializers {names[:5]} are not supported; store them as dense initializers"
        )
    init_names = set(constants)
    inputs = [_value_spec(vi) for vi in graph.input if vi.name not in init_names]
    outputs = [_value_spec(vi) for vi in graph.output]
    available = set(constants) | {s.name for s in inputs}
    # Types first: placement and fusions ask providers with each input's dtype and shape.
    value_types = _infer_value_types(model)

    def type_of(name: str) -> TensorType | None:
        return value_type(constants, value_types, name)

    steps: list[Step] = []
    unsupported: list[str] = []
    bodies: dict[str, str] = {}
    folded = 0

    def place(info: NodeInfo) -> None:
        """Place one node (an onnx_genrt node no provider has: its body's nodes), or fold it."""
        nonlocal folded
        types = tuple(type_of(n) if n else None for n in info.input_names)
        if info.domain == GENRT_DOMAIN:
            check_node(info, types)
        placed = _place(info, providers, types)
        if isinstance(placed, str) and info.domain == GENRT_DOMAIN:
            try:
                body = expand(info, types)
            except UnsupportedOpError as exc:
                unsupported.append(f"{placed}; {exc}")
                return
            constants.update(body.initializers)
            inferred = body.value_types(dict(zip(info.input_names, types, strict=True)))
            for name, t in inferred.items():
                value_types.setdefault(name, ValueSpec(name, t.dtype, t.shape))
            for node in body.nodes:
                bodies[node.name] = bodies.get(info.name, info.name)
                place(NodeInfo.from_proto(node, body.opset(node)))
            return
        if isinstance(placed, str):
            unsupported.append(placed)
            return
        provider, kdef = placed
        step = Step(info, kdef, provider, info.input_names, info.output_names)
        if _foldable(step, constants):
            result = _fold(step, constants)
            if result is not None:
                constants.update(result)
                folded += 1
                return
        steps.append(step)

    for proto in topological_order(graph, available):
        domain = normalize_domain(proto.domain)
        if domain not in opsets:
            raise ModelLoadError(
                f"node {proto.name!r} ({proto.op_type}) uses domain {proto.domain!r}, "
                "which the model does not import"
            )
        dtypes = [_dtype_of(type_of(n)) if n else None for n in proto.input]
        check_node_schema(proto, domain, opsets[domain], dtypes)
        try:
            info = NodeInfo.from_proto(proto, opsets[domain])
        except (ValueError, TypeError) as exc:  # a tensor attribute whose bytes do not fit
            raise ModelLoadError(
                f"node {proto.name!r} ({proto.op_type}): unreadable attribute: {exc}"
            ) from None
        place(info)
    if unsupported:
        listed = "\n  ".join(unsupported[:20])
        more = f"\n  ... and {len(unsupported) - 20} more" if len(unsupported) > 20 else ""
        raise UnsupportedOpError(f"no provider can run these nodes:\n  {listed}{more}")
    keep = {o.name for o in outputs}
    steps, fused = fuse_silu_mul(steps, keep, type_of)
    steps, norms = fuse_rms_norm(steps, constants, keep, type_of)
    fused += norms
    shapes = {name: spec.shape for name, spec in value_types.items()}
    steps, skips = fuse_skip_rms_norm(steps, keep, shapes, type_of)
    fused += skips
    steps, picks = fuse_argmax_prob(steps, constants, keep, type_of)
    fused += picks
    steps, probes = fuse_nonfinite(steps, keep, type_of)
    fused += probes
    steps, merged = fuse_gate_up(steps, constants, keep, type_of)
    fused += merged
    steps, normed = fuse_norm_matmul(steps, constants, keep, type_of)
    fused += normed
    steps, activated = fuse_silu_matmul(steps, constants, keep, type_of)
    fused += activated
    steps, mlps = fuse_gated_mlp(steps, constants, keep, type_of)
    fused += mlps
    steps, gated = fuse_gated_projection(steps, keep, type_of)
    fused += gated
    steps, biased = fuse_matmul_add(steps, constants, keep, type_of)
    fused += biased
    plan = GraphPlan(steps, constants, inputs, outputs, folded, fused=fused)
    plan.home = providers[0] if providers else None
    plan.value_types = value_types
    plan.bodies = bodies
    return plan


def _dtype_of(t: TensorType | None) -> np.dtype | None:
    return None if t is None else t.dtype


def _read_initializers(
    graph: onnx.GraphProto, weights: Mapping[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """The graph's initializers as arrays: ``weights`` for those it has, the rest read from
    the proto; an initializer still in an external file that ``weights`` lacks is refused."""
    import onnx
    from onnx import numpy_helper

    constants: dict[str, np.ndarray] = {}
    for init in graph.initializer:
        if init.name in weights:
            constants[init.name] = weights[init.name]
            continue
        if init.data_location == onnx.TensorProto.EXTERNAL:
            raise ModelLoadError(
                f"initializer {init.name!r} keeps its data in an external file that was not "
                "read: load the model from its path (or with session.loader.open_model and "
                "pass the LoadedModel)"
            )
        try:
            constants[init.name] = numpy_helper.to_array(init)
        except Exception as exc:
            raise ModelLoadError(f"initializer {init.name!r} cannot be read: {exc}") from None
    return constants


def _place(
    info: NodeInfo,
    providers: Sequence[ExecutionProvider],
    input_types: tuple[TensorType | None, ...],
) -> tuple[ExecutionProvider, KernelDef] | str:
    """The first provider (in the session's order) that supports the node with these input
    types, and its kernel; else why none does."""
    reasons = []
    for p in providers:
        ok, reason = p.supports(info, input_types)
        if ok:
            kdef = p.get_kernel(info.domain, info.op_type, info.opset)
            assert kdef is not None
            return p, kdef
        reasons.append(reason)
    return f"{info.describe()}: " + "; ".join(reasons)


def _foldable(step: Step, constants: dict[str, np.ndarray]) -> bool:
    if step.node.op_type in NONDETERMINISTIC or step.node.domain not in ("",):
        return False
    import onnx

    if any(isinstance(v, onnx.GraphProto) for v in step.node.attrs.values()):
        return False
    return all((not n) or n in constants for n in step.inputs)


def _fold(step: Step, constants: dict[str, np.ndarray]) -> dict[str, np.ndarray] | None:
    provider = step.provider
    args = [provider.upload(constants[n]) if n else None for n in step.inputs]
    try:
        result = provider.launch(step.kernel, KernelContext(step.node, provider), args)
    except Exception as exc:
        raise KernelError(f"{step.node.describe()} failed while folding constants: {exc}") from exc
    results = result if isinstance(result, tuple | list) else (result,)
    out: dict[str, np.ndarray] = {}
    for name, value in zip(step.outputs, results, strict=False):
        if not name:
            continue
        host = provider.read([value])[0]
        if host.nbytes > FOLD_LIMIT:
            return None
        out[name] = host
    return out


def describe_value(value: Any) -> str:
    return f"{getattr(value, 'dtype', type(value).__name__)}{list(getattr(value, 'shape', ()))}"
