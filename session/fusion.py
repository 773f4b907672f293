"""Step fusions applied after placement, where the step's provider supports the fused node.

A fusion replaces steps by one node; it happens only where the provider holding those
steps says yes to that node, asked exactly as placement asks (``provider.supports`` with
the fused node and its input types), so a provider that claims only some forms of a fused
op (say, SiluMul without ``split``) is never handed the others.

They run on a plan's steps after constant folding, in ``session.plan``'s order (SiluMul, RMS
norms, skip norms, the argmax head, the non-finite probe, gate/up projections, norms and
SiluMul into projections, a norm-fused gate/up projection and its down projection into one
gated MLP, a projection's bias), each where the provider has the fused op.

The fused ops of domain ``onnx_genrt`` are declared in ``core.genrt_ops``.

``SiluMul`` (domain ``onnx_genrt``): ``Mul(Mul(g, Sigmoid(g)), u)``, the gated MLP of
Llama/Qwen-style models as exporters write it, becomes one step ``y = g * sigmoid(g) * u``:
three launches and two intermediate buffers fewer per layer.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

import numpy as np

from onnx_genrt.core.dtypes import is_float_dtype
from onnx_genrt.core.genrt_ops import (
    GATED_PROJECTIONS,
    NORM_PROJECTIONS,
    SILU_PROJECTIONS,
    projection_node,
)
from onnx_genrt.core.kernels import GENRT_DOMAIN, NodeInfo, TensorType

if TYPE_CHECKING:  # plan.py imports this module
    from .plan import Step

#: The type of a value by name (None when unknown): what ``provider.supports`` is asked with.
TypeOf = Callable[[str], TensorType | None]
#: Constant values by name (host arrays), as constant folding left them.
Constants = dict[str, np.ndarray]


def no_types(_name: str) -> TensorType | None:
    return None


def step_for(like: Step, node: NodeInfo, type_of: TypeOf) -> Step | None:
    """``node`` as a step on ``like``'s provider, when that provider supports it (asked with
    the node and its input types, as placement asks); None skips the fusion."""
    types = tuple(type_of(n) if n else None for n in node.input_names)
    ok, _reason = like.provider.supports(node, types)
    if not ok:
        return None
    kdef = like.provider.get_kernel(node.domain, node.op_type, node.opset)
    return type(like)(node, kdef, like.provider, node.input_names, node.output_names)


def _index(steps: list[Step]) -> tuple[Counter[str], dict[str, int]]:
    """(readers per value, index of the step producing each value)."""
    readers: Counter[str] = Counter(n for s in steps for n in s.inputs if n)
    producer = {o: i for i, s in enumerate(steps) for o in s.outputs if o}
    return readers, producer


def _rewrite(steps: list[Step], replace: dict[int, Step], drop: set[int]) -> list[Step]:
    """``steps`` with fused steps put in place and the steps they absorbed dropped."""
    return [replace.get(i, s) for i, s in enumerate(steps) if i not in drop]


def fuse_silu_mul(
    steps: list[Step], keep: Iterable[str], type_of: TypeOf = no_types
) -> tuple[list[Step], int]:
    """Steps with every fusable Sigmoid/Mul/Mul triple replaced by one SiluMul step.

    ``keep`` names values that must stay materialized (graph outputs). A triple fuses only
    when its two intermediates have no other reader, all three run on one provider, and
    that provider has a SiluMul kernel.
    """
    keep = set(keep)
    readers, producer = _index(steps)
    drop: set[int] = set()
    replace: dict[int, object] = {}
    for i, mul in enumerate(steps):
        if mul.node.op_type != "Mul" or mul.node.domain != "" or len(mul.inputs) != 2:
            continue
        for j in (0, 1):
            fused = _match(
                steps, producer, readers, keep, mul, mul.inputs[j], mul.inputs[1 - j], type_of
            )
            if fused is not None:
                gate_mul, sigmoid, step = fused
                drop.update((gate_mul, sigmoid))
                replace[i] = step
                break
    out = _rewrite(steps, replace, drop)
    return out, len(replace)


def _match(
    steps: list[Step],
    producer: dict[str, int],
    readers: Counter[str],
    keep: set[str],
    mul: Step,
    act: str,
    up: str,
    type_of: TypeOf,
) -> tuple[int, int, Step] | None:
    """(gate Mul index, Sigmoid index, fused step) when ``act`` is g * sigmoid(g), else None."""
    a = producer.get(act)
    if a is None or readers[act] != 1 or act in keep:
        return None
    gate_mul = steps[a]
    if gate_mul.node.op_type != "Mul" or gate_mul.node.domain != "":
        return None
    for g, s in ((0, 1), (1, 0)):
        sig_out = gate_mul.inputs[s]
        si = producer.get(sig_out)
        if si is None or readers[sig_out] != 1 or sig_out in keep:
            continue
        sigmoid = steps[si]
        gate = gate_mul.inputs[g]
        if sigmoid.node.op_type != "Sigmoid" or tuple(sigmoid.inputs) != (gate,):
            continue
        provider = mul.provider
        if gate_mul.provider is not provider or sigmoid.provider is not provider:
            return None
        node = NodeInfo(
            "SiluMul",
            f"{mul.node.name or mul.outputs[0]}/SiluMul",
            GENRT_DOMAIN,
            1,
            {},
            (gate, up),
            tuple(mul.outputs),
        )
        step = step_for(mul, node, type_of)
        return None if step is None else (a, si, step)
    return None


def fuse_gate_up(
    steps: list[Step], constants: Constants, keep: Iterable[str], type_of: TypeOf = no_types
) -> tuple[list[Step], int]:
    """Gate and up projections of one width, read from one input with constant weights,
    become one projection onto the concatenated weights; SiluMul then splits it in halves.

    One GEMV over 2N columns instead of two over N: one launch fewer per layer and a wider
    grid. Handles MatMul (2-D weights) and com.microsoft MatMulNBits (no bias, no g_idx).
    The original weights leave ``constants`` when nothing else reads them.
    """
    keep = set(keep)
    readers, producer = _index(steps)
    drop: set[int] = set()
    replace: dict[int, object] = {}
    merged_weights: set[str] = set()
    for i, act in enumerate(steps):
        if act.node.op_type != "SiluMul" or len(act.inputs) != 2:
            continue
        gi, ui = producer.get(act.inputs[0]), producer.get(act.inputs[1])
        if gi is None or ui is None or gi == ui:
            continue
        gate, up = steps[gi], steps[ui]
        if any(readers[n] != 1 or n in keep for n in act.inputs):
            continue
        merged = _merge_projections(gate, up, constants, act.provider)
        if merged is None:
            continue
        node, inputs, new_consts = merged
        out_name = f"{act.inputs[0]}/gate_up"

        def merged_type(name: str, new: dict = new_consts) -> TensorType | None:
            if name in new:
                return TensorType(new[name].dtype, tuple(new[name].shape))
            return type_of(name)

        proj = step_for(gate, _with(node, inputs=inputs, outputs=(out_name,)), merged_type)
        split_node = _with(act.node, inputs=(out_name,), attrs={"split": 1})
        split = step_for(act, split_node, merged_type)
        if proj is None or split is None:
            continue
        constants.update(new_consts)
        first, second = sorted((gi, ui))
        drop.add(first)
        replace[second] = proj
        replace[i] = split
        merged_weights.update((*gate.inputs[1:], *up.inputs[1:]))
    out = _rewrite(steps, replace, drop)
    still_read = {n for s in out for n in s.inputs if n}
    for name in merged_weights - still_read - keep:
        constants.pop(name, None)
    return out, len(replace) // 2


def _with(node: NodeInfo, **changes) -> NodeInfo:
    """A copy of ``node`` with other inputs, outputs or extra attributes (an unnamed node's
    copy is named after its first output)."""
    name = (node.name or node.output_names[0]).removesuffix("/fused") + "/fused"
    return NodeInfo(
        node.op_type,
        name,
        node.domain,
        node.opset,
        {**node.attrs, **changes.pop("attrs", {})},
        tuple(changes.get("inputs", node.input_names)),
        tuple(changes.get("outputs", node.output_names)),
    )


def _merge_projections(gate: Step, up: Step, constants: Constants, provider: object):
    """(node, inputs, new constants) projecting onto gate's and up's weights at once."""
    if gate.provider is not provider or up.provider is not provider:
        return None
    if gate.node.op_type != up.node.op_type or gate.node.domain != up.node.domain:
        return None
    if gate.inputs[0] != up.inputs[0] or len(gate.inputs) != len(up.inputs):
        return None
    weights = [(g, u) for g, u in zip(gate.inputs[1:], up.inputs[1:], strict=True)]
    if any(not g or not u or g not in constants or u not in constants for g, u in weights):
        return None
    op = gate.node.op_type
    # Named after the weights merged, so layers or unrolled steps (an MTP chain) that
    # project onto the same pair share one merged constant.
    prefix = "merged[" + "|".join(f"{g},{u}" for g, u in weights) + "]/"
    if op == "MatMul" and gate.node.domain == "":
        ((gw, uw),) = weights
        a, b = constants[gw], constants[uw]
        if a.ndim != 2 or b.ndim != 2 or a.shape != b.shape or a.dtype != b.dtype:
            return None
        merged = constants.get(prefix + "W")
        if merged is None:
            merged = np.concatenate([a, b], axis=1)
        return gate.node, (gate.inputs[0], prefix + "W"), {prefix + "W": merged}
    if op == "MatMulNBits" and gate.node.domain == "com.microsoft":
        keys = ("K", "N", "bits", "block_size", "accuracy_level")
        if any(gate.node.attrs.get(k) != up.node.attrs.get(k) for k in keys):
            return None
        if len(gate.inputs) > 4:  # g_idx or bias
            return None
        n_gate, n_up = int(gate.node.attrs["N"]), int(up.node.attrs["N"])
        merged, names = {}, [gate.inputs[0]]
        for index, (g, u) in enumerate(weights, start=1):
            a, b = constants[g], constants[u]
            if a.dtype != b.dtype or a.size % n_gate or b.size % n_up:
                return None
            row_a, row_b = a.reshape(n_gate, -1), b.reshape(n_up, -1)
            if row_a.shape[1] != row_b.shape[1]:
                return None
            name = f"{prefix}{index}"
            done = constants.get(name)
            if done is None:
                cat = np.concatenate([row_a, row_b], axis=0)
                shape = (n_gate + n_up, *a.shape[1:]) if a.ndim > 1 else (cat.size,)
                done = cat.reshape(shape)
            merged[name] = done
            names.append(name)
        return _with(gate.node, attrs={"N": n_gate + n_up}), tuple(names), merged
    return None


def fuse_rms_norm(
    steps: list[Step], constants: Constants, keep: Iterable[str], type_of: TypeOf = no_types
) -> tuple[list[Step], int]:
    """RMS norms that exporters decompose become one SimplifiedLayerNormalization step.

    Matches ``w * (x * Reciprocal(Sqrt(ReduceMean(Pow(x, 2), [-1]) + eps)))`` (Mul operands
    in either order; ``Div(1, Sqrt(..))`` for the reciprocal), as torch's dynamo exporter
    writes Llama/Qwen RMSNorm: seven launches become one. Every intermediate must have one
    reader and not be a graph output; all steps run on one provider that has the op.
    """
    keep = set(keep)
    readers, producer = _index(steps)
    drop: set[int] = set()
    replace: dict[int, object] = {}
    for i, mul in enumerate(steps):
        if _op(mul) != "Mul" or len(mul.inputs) != 2 or i in drop:
            continue
        for w_pos in (0, 1):
            found = _match_rms(steps, producer, readers, keep, constants, mul, w_pos, type_of)
            if found is not None and not drop.intersection(found[0]):
                chain, step = found
                drop.update(chain)
                replace[i] = step
                break
    out = _rewrite(steps, replace, drop)
    return out, len(replace)


def _op(step: Step) -> str | None:
    return step.node.op_type if step.node.domain == "" else None


def _scalar(constants: Constants, name: str) -> float | None:
    value = constants.get(name)
    if value is None or value.size != 1 or not is_float_dtype(value.dtype):
        return None
    return float(value.reshape(-1)[0])


def _match_rms(
    steps: list[Step],
    producer: dict[str, int],
    readers: Counter[str],
    keep: set[str],
    constants: Constants,
    mul: Step,
    w_pos: int,
    type_of: TypeOf,
):
    """(indices of the six inner steps, fused step) when ``mul`` is w * rms_normalize(x)."""
    weight, normed = mul.inputs[w_pos], mul.inputs[1 - w_pos]
    w = constants.get(weight)
    if w is None or w.ndim != 1:
        return None

    def only(name: str, op: str):
        """The step producing ``name`` when it is ``op`` and ``name`` has no other reader."""
        index = producer.get(name)
        if index is None or readers[name] != 1 or name in keep or _op(steps[index]) != op:
            return None
        return index

    scale_i = only(normed, "Mul")
    if scale_i is None:
        return None
    scale = steps[scale_i]
    for x_pos in (0, 1):
        x, inv = scale.inputs[x_pos], scale.inputs[1 - x_pos]
        recip_i = only(inv, "Reciprocal")
        if recip_i is not None:
            root_name = steps[recip_i].inputs[0]
        else:
            recip_i = only(inv, "Div")
            if recip_i is None or _scalar(constants, steps[recip_i].inputs[0]) != 1.0:
                continue
            root_name = steps[recip_i].inputs[1]
        sqrt_i = only(root_name, "Sqrt")
        if sqrt_i is None:
            continue
        add_i = only(steps[sqrt_i].inputs[0], "Add")
        if add_i is None:
            continue
        add = steps[add_i]
        eps, mean_i = None, None
        for e_pos in (0, 1):
            eps = _scalar(constants, add.inputs[e_pos])
            if eps is not None:
                mean_i = only(add.inputs[1 - e_pos], "ReduceMean")
                break
        if mean_i is None:
            continue
        mean = steps[mean_i]
        if not _last_axis_mean(mean, constants):
            continue
        pow_i = only(mean.inputs[0], "Pow")
        if pow_i is None:
            continue
        power = steps[pow_i]
        if power.inputs[0] != x or _scalar(constants, power.inputs[1]) != 2.0:
            continue
        chain = (scale_i, recip_i, sqrt_i, add_i, mean_i, pow_i)
        provider = mul.provider
        if any(steps[j].provider is not provider for j in chain):
            continue
        node = NodeInfo(
            "SimplifiedLayerNormalization",
            f"{mul.node.name or mul.outputs[0]}/RMSNorm",
            "",
            1,
            {"axis": -1, "epsilon": eps},
            (x, weight),
            tuple(mul.outputs),
        )
        step = step_for(mul, node, type_of)
        return None if step is None else (chain, step)
    return None


def _last_axis_mean(mean: Step, constants: Constants) -> bool:
    """ReduceMean over the last axis only, keeping it (axes as input or attribute)."""
    return int(mean.node.attrs.get("keepdims", 1)) == 1 and _axes(mean, constants) == [-1]


def _axes(step: Step, constants: Constants) -> list[int] | None:
    """A reduction's constant axes, from its second input (opset 18) or its attribute."""
    if len(step.inputs) > 1 and step.inputs[1]:
        axes = constants.get(step.inputs[1])
        if axes is None or axes.dtype.kind not in "iu":  # not int64: the kernel refuses it
            return None
        return [int(a) for a in axes.reshape(-1)]
    axes = step.node.attrs.get("axes")
    return None if axes is None else [int(a) for a in axes]


def fuse_skip_rms_norm(
    steps: list[Step],
    keep: Iterable[str],
    shapes: dict[str, tuple | None],
    type_of: TypeOf = no_types,
) -> tuple[list[Step], int]:
    """``SimplifiedLayerNormalization(Add(a, b))`` becomes one com.microsoft
    SkipSimplifiedLayerNormalization step (residual add and norm in one launch).

    ``shapes`` gives each value's static shape where known; ``a`` and ``b`` must have the
    same known shape. When the sum has other readers it stays available as the fused step's
    fourth output (``input_skip_bias_sum``), as onnxruntime-genai's builder writes it.
    """
    readers, producer = _index(steps)
    drop: set[int] = set()
    replace: dict[int, object] = {}
    for i, norm in enumerate(steps):
        if _op(norm) != "SimplifiedLayerNormalization" or len(norm.inputs) != 2:
            continue
        if int(norm.node.attrs.get("axis", -1)) != -1 or any(norm.outputs[1:]):
            continue
        j = producer.get(norm.inputs[0])
        if (
            j is None
            or j in drop
            or _op(steps[j]) != "Add"
            or norm.provider is not steps[j].provider
        ):
            continue
        add = steps[j]
        a, b = add.inputs
        shape_a, shape_b = shapes.get(a), shapes.get(b)
        if not shape_a or shape_a != shape_b or not all(isinstance(d, int) for d in shape_a):
            continue
        total = add.outputs[0]
        keeps_sum = readers[total] > 1 or total in keep
        outputs = (norm.outputs[0], "", "", total) if keeps_sum else (norm.outputs[0],)
        node = NodeInfo(
            "SkipSimplifiedLayerNormalization",
            f"{norm.node.name or norm.outputs[0]}/SkipRMSNorm",
            "com.microsoft",
            1,
            {"epsilon": float(norm.node.attrs.get("epsilon", 1e-5))},
            (a, b, norm.inputs[1]),
            outputs,
        )
        step = step_for(norm, node, type_of)
        if step is None:
            continue
        drop.add(j)
        replace[i] = step
    out = _rewrite(steps, replace, drop)
    return out, len(replace)


def fuse_argmax_prob(
    steps: list[Step], constants: Constants, keep: Iterable[str], type_of: TypeOf = no_types
) -> tuple[list[Step], int]:
    """``ArgMax(l)`` next to ``ReduceMax(Softmax(l))`` over the last axis (keepdims=0)
    becomes one ``onnx_genrt::ArgMaxProb`` step: a draft and its probability in one pass,
    without writing the softmax. The fused step takes the place of the first of the three,
    where ``l`` is ready and neither output has been read yet."""
    keep = set(keep)
    readers, producer = _index(steps)
    argmax_of: dict[str, int] = {}
    for i, s in enumerate(steps):
        if (
            _op(s) == "ArgMax"
            and _last_axis_no_keep(s)
            and not s.node.attrs.get("select_last_index")
        ):
            argmax_of.setdefault(s.inputs[0], i)
    drop: set[int] = set()
    replace: dict[int, object] = {}
    for r, reduce in enumerate(steps):
        if _op(reduce) != "ReduceMax" or not _last_axis_no_keep(reduce, constants):
            continue
        si = producer.get(reduce.inputs[0])
        if si is None or _op(steps[si]) != "Softmax":
            continue
        softmax = steps[si]
        probs = softmax.outputs[0]
        if readers[probs] != 1 or probs in keep or int(softmax.node.attrs.get("axis", -1)) != -1:
            continue
        if softmax.node.opset < 13:
            continue
        logits = softmax.inputs[0]
        ai = argmax_of.get(logits)
        if ai is None or {ai, si, r} & (drop | set(replace)):
            continue
        provider = reduce.provider
        if steps[ai].provider is not provider or softmax.provider is not provider:
            continue
        outputs = (steps[ai].outputs[0], reduce.outputs[0])
        node = NodeInfo(
            "ArgMaxProb",
            f"{reduce.node.name or outputs[1]}/ArgMaxProb",
            GENRT_DOMAIN,
            1,
            {},
            (logits,),
            outputs,
        )
        step = step_for(reduce, node, type_of)
        if step is None:
            continue
        first, *rest = sorted((ai, si, r))
        replace[first] = step
        drop.update(rest)
    out = _rewrite(steps, replace, drop)
    return out, len(replace)


def fuse_nonfinite(
    steps: list[Step], keep: Iterable[str], type_of: TypeOf = no_types
) -> tuple[list[Step], int]:
    """``ReduceSum(Sub(x, x))`` over every axis (keepdims=0) becomes one
    ``onnx_genrt::NonFinite`` step: a decoder's non-finite probe of its logits (0, or NaN
    when a logit is not finite) without writing ``x - x``. Its value is the same whatever the
    order of the sum, so a provider's kernel may sum (or test) in any order."""
    keep = set(keep)
    readers, producer = _index(steps)
    drop: set[int] = set()
    replace: dict[int, object] = {}
    for r, reduce in enumerate(steps):
        if _op(reduce) != "ReduceSum" or int(reduce.node.attrs.get("keepdims", 1)) != 0:
            continue
        if len(reduce.inputs) > 1 and reduce.inputs[1] or "axes" in reduce.node.attrs:
            continue  # axes given: not every axis
        if int(reduce.node.attrs.get("noop_with_empty_axes", 0)):
            continue
        si = producer.get(reduce.inputs[0])
        if si is None or _op(steps[si]) != "Sub" or si in drop:
            continue
        sub = steps[si]
        diff = sub.outputs[0]
        if sub.inputs[0] != sub.inputs[1] or readers[diff] != 1 or diff in keep:
            continue
        if sub.provider is not reduce.provider:
            continue
        node = NodeInfo(
            "NonFinite",
            f"{reduce.node.name or reduce.outputs[0]}/NonFinite",
            GENRT_DOMAIN,
            1,
            {},
            (sub.inputs[0],),
            (reduce.outputs[0],),
        )
        step = step_for(reduce, node, type_of)
        if step is None:
            continue
        replace[si] = step
        drop.add(r)
    return _rewrite(steps, replace, drop), len(replace)


def _last_axis_no_keep(step: Step, constants: Constants | None = None) -> bool:
    """ArgMax over axis -1, or ReduceMax over axes [-1], with keepdims=0."""
    if int(step.node.attrs.get("keepdims", 1)) != 0:
        return False
    if step.node.op_type == "ArgMax":
        return int(step.node.attrs.get("axis", 0)) == -1
    return _axes(step, constants or {}) == [-1]


#: Norms fused into the projections that read them (see :func:`fuse_norm_matmul`).
_NORMS = {
    ("", "SimplifiedLayerNormalization"),
    ("com.microsoft", "SimplifiedLayerNormalization"),
    ("com.microsoft", "SkipSimplifiedLayerNormalization"),
}
#: Projection op -> its norm-fused op (domain ``onnx_genrt``).
_NORM_FUSED = NORM_PROJECTIONS


def fuse_norm_matmul(
    steps: list[Step], constants: Constants, keep: Iterable[str], type_of: TypeOf = no_types
) -> tuple[list[Step], int]:
    """An RMS norm whose normalized output only projections read (MatMul on a constant 2-D
    weight, MatMulNBits) goes into those projections: each becomes ``NormMatMul`` /
    ``NormMatMulNBits`` (domain ``onnx_genrt``), whose GEMV normalizes its rows itself.

    ``SkipSimplifiedLayerNormalization``'s residual sum (output 3) is written by the first of
    them, which must come before every reader of that sum; its mean and inverse-std outputs
    must be unread, and it must have no bias. The norm's provider must run every projection
    and have the fused kernels. One launch fewer per norm on a decode step.
    """
    keep = set(keep)
    read_by: dict[str, list[int]] = {}
    for i, s in enumerate(steps):
        for n in set(s.inputs):
            if n:
                read_by.setdefault(n, []).append(i)
    drop: set[int] = set()
    replace: dict[int, object] = {}
    for i, norm in enumerate(steps):
        fused = _norm_projections(steps, constants, keep, read_by, norm, type_of)
        if fused is None or drop.intersection(fused) or set(replace).intersection(fused):
            continue
        drop.add(i)
        replace.update(fused)
    return _rewrite(steps, replace, drop), len(drop)


def _norm_projections(
    steps: list[Step],
    constants: Constants,
    keep: set[str],
    read_by: dict[str, list[int]],
    norm: Step,
    type_of: TypeOf,
) -> dict[int, Step] | None:
    """{index: fused step} for the projections reading ``norm``, or None."""
    if (norm.node.domain, norm.node.op_type) not in _NORMS:
        return None
    skip_op = norm.node.op_type.startswith("Skip")
    attrs = norm.node.attrs
    if int(attrs.get("axis", -1)) != -1 or int(attrs.get("stash_type", 1)) != 1:
        return None
    n_in = 3 if skip_op else 2
    if len(norm.inputs) > n_in and any(norm.inputs[n_in:]):  # a bias
        return None
    gamma = norm.inputs[n_in - 1]
    if gamma not in constants or constants[gamma].ndim != 1:
        return None
    outs = list(norm.outputs) + [""] * 4
    normed, total = outs[0], outs[3] if skip_op else ""
    if not normed or normed in keep or any(o and o in read_by for o in outs[1:3]):
        return None
    consumers = read_by.get(normed, [])
    if not consumers:
        return None
    provider = norm.provider
    fused: dict[int, object] = {}
    for j in consumers:
        proj = steps[j]
        op = _NORM_FUSED.get((proj.node.domain, proj.node.op_type))
        if op is None or proj.provider is not provider or proj.inputs[0] != normed:
            return None
        if normed in proj.inputs[1:] or not all(n in constants for n in proj.inputs[1:2]):
            return None
        if op == "NormMatMul" and (len(proj.inputs) != 2 or constants[proj.inputs[1]].ndim != 2):
            return None
        first = j == consumers[0]
        if first and total and any(r <= j for r in read_by.get(total, [])):
            return None  # the sum is read before the first projection could write it
        x, skip = norm.inputs[0], norm.inputs[1] if skip_op else ""
        inputs = (x, skip, gamma, *proj.inputs[1:])
        outputs = (proj.outputs[0], total if first else "", f"{normed}/normed/{j}")
        node = NodeInfo(
            op,
            f"{proj.node.name or proj.outputs[0]}/{op}",
            GENRT_DOMAIN,
            1,
            {
                **proj.node.attrs,
                "epsilon": float(attrs.get("epsilon", 1e-5)),
                "projection_opset": proj.node.opset,
            },
            inputs,
            outputs,
        )
        step = step_for(proj, node, type_of)
        if step is None:
            return None
        fused[j] = step
    return fused


#: Projection op -> its SiLU-fused op (domain ``onnx_genrt``).
_SILU_FUSED = SILU_PROJECTIONS


def fuse_silu_matmul(
    steps: list[Step], constants: Constants, keep: Iterable[str], type_of: TypeOf = no_types
) -> tuple[list[Step], int]:
    """A SiluMul whose one reader is a projection (MatMul on a constant 2-D weight, or
    MatMulNBits) goes into it: ``SiluMulMatMul`` / ``SiluMulMatMulNBits`` (domain
    ``onnx_genrt``), whose GEMV computes the activations itself. The fused step takes the
    projection's place; its second output keeps a planned buffer for shapes the fused
    kernel does not take. Only where the provider has the fused kernels."""
    keep = set(keep)
    readers, producer = _index(steps)
    drop: set[int] = set()
    replace: dict[int, object] = {}
    for j, proj in enumerate(steps):
        op = _SILU_FUSED.get((proj.node.domain, proj.node.op_type))
        if op is None or not proj.inputs:
            continue
        act = proj.inputs[0]
        i = producer.get(act)
        if i is None or readers[act] != 1 or act in keep or i in drop:
            continue
        silu = steps[i]
        if silu.node.domain != GENRT_DOMAIN or silu.node.op_type != "SiluMul":
            continue
        if silu.provider is not proj.provider or proj.inputs[1] not in constants:
            continue
        if op == "SiluMulMatMul" and (len(proj.inputs) != 2 or constants[proj.inputs[1]].ndim != 2):
            continue
        gate_up = tuple(silu.inputs) + ("",) * (2 - len(silu.inputs))
        inputs = (*gate_up[:2], *proj.inputs[1:])
        outputs = (proj.outputs[0], f"{act}/act")
        node = NodeInfo(
            op,
            f"{proj.node.name or proj.outputs[0]}/{op}",
            GENRT_DOMAIN,
            1,
            {
                **proj.node.attrs,
                "split": int(silu.node.attrs.get("split", 0)),
                "projection_opset": proj.node.opset,
            },
            inputs,
            outputs,
        )
        step = step_for(proj, node, type_of)
        if step is None:
            continue
        drop.add(i)
        replace[j] = step
    return _rewrite(steps, replace, drop), len(replace)


def _gated_mlps(
    steps: list[Step], keep: set[str], downs: Iterable[str], norms: Iterable[str]
) -> Iterator[tuple[int, int]]:
    """(i, j) of each gated MLP after its norm: step i a norm-fused projection (op in
    ``norms``) whose output 0 (gate and up side by side) only step j reads, a SiLU-fused
    projection (op in ``downs``, split=1, one input) on the same provider."""
    readers, producer = _index(steps)
    downs, norms = set(downs), set(norms)
    for j, down in enumerate(steps):
        if down.node.domain != GENRT_DOMAIN or down.node.op_type not in downs:
            continue
        if int(down.node.attrs.get("split", 0)) != 1 or any(down.inputs[1:2]):
            continue
        gate_up = down.inputs[0]
        i = producer.get(gate_up)
        if i is None or readers[gate_up] != 1 or gate_up in keep:
            continue
        norm = steps[i]
        if norm.node.domain != GENRT_DOMAIN or norm.node.op_type not in norms:
            continue
        if norm.provider is down.provider and norm.outputs[0] == gate_up:
            yield i, j


def fuse_gated_mlp(
    steps: list[Step], constants: Constants, keep: Iterable[str], type_of: TypeOf = no_types
) -> tuple[list[Step], int]:
    """A ``NormMatMul`` whose one reader is a ``SiluMulMatMul`` with split=1 (a gated MLP
    after its norm: gate and up side by side, then the down projection) becomes
    ``NormGatedMLP`` (domain ``onnx_genrt``) in the NormMatMul's place, where both weights
    are constant 2-D ([K, 2F] and [F, N]), both projections have one opset and one provider
    holds both steps and has the fused op. Its gate/up, activation and norm buffers stay
    planned outputs for shapes the fused kernel does not take."""
    drop: set[int] = set()
    replace: dict[int, object] = {}
    for i, j in _gated_mlps(steps, set(keep), ["SiluMulMatMul"], ["NormMatMul"]):
        norm, down, gate_up = steps[i], steps[j], steps[i].outputs[0]
        w_gate_up, w_down = constants.get(norm.inputs[3]), constants.get(down.inputs[2])
        if w_gate_up is None or w_down is None or w_gate_up.ndim != 2 or w_down.ndim != 2:
            continue
        if w_gate_up.shape[1] != 2 * w_down.shape[0]:
            continue
        opset = norm.node.attrs.get("projection_opset", 1)
        if down.node.attrs.get("projection_opset", 1) != opset:
            continue
        total = norm.outputs[1] if len(norm.outputs) > 1 else ""
        node = NodeInfo(
            "NormGatedMLP",
            f"{down.node.name or down.outputs[0]}/NormGatedMLP",
            GENRT_DOMAIN,
            1,
            {"epsilon": float(norm.node.attrs.get("epsilon", 1e-5)), "projection_opset": opset},
            (*norm.inputs[:3], norm.inputs[3], down.inputs[2]),
            (down.outputs[0], total, gate_up, f"{gate_up}/act", f"{gate_up}/normed"),
        )
        step = step_for(norm, node, type_of)
        if step is None:
            continue
        replace[i] = step
        drop.add(j)
    return _rewrite(steps, replace, drop), len(replace)


#: A norm-fused projection (NormMatMul...) -> the same with SiluMul of its halves after it.
_GATED = {NORM_PROJECTIONS[proj]: gated for proj, gated in GATED_PROJECTIONS.items()}


def fuse_gated_projection(
    steps: list[Step], keep: Iterable[str], type_of: TypeOf = no_types
) -> tuple[list[Step], int]:
    """A ``NormMatMul`` (or NBits) whose one reader is a ``SiluMulMatMul`` (or NBits) with
    split=1 (a gated MLP's gate/up projection, then its activation and down projection): the
    SiluMul moves out of the down projection's prologue into the gate/up projection, which
    becomes ``NormMatMulSiluMul`` (or NBits; its GEMV writes the activations, each made once,
    where the down GEMV's every block made all of them), and the down projection its plain
    op reading the activations. Both steps on one provider, which has the gated op and the
    plain projection."""
    replace: dict[int, object] = {}
    for i, j in _gated_mlps(steps, set(keep), SILU_PROJECTIONS.values(), _GATED):
        norm, down, gate_up = steps[i], steps[j], steps[i].outputs[0]
        op = _GATED[norm.node.op_type]
        outs = (*norm.outputs, "", "")
        act = down.outputs[1] if len(down.outputs) > 1 and down.outputs[1] else f"{gate_up}/act"
        normed = outs[2] or f"{gate_up}/normed"
        node = NodeInfo(
            op,
            f"{norm.node.name}/{op}",
            GENRT_DOMAIN,
            1,
            dict(norm.node.attrs),
            tuple(norm.inputs),
            (act, outs[1], normed, gate_up),
        )
        gated = step_for(norm, node, type_of)
        plain = step_for(down, projection_node(down.node, act), type_of)
        if gated is None or plain is None:
            continue
        replace[i], replace[j] = gated, plain
    return _rewrite(steps, replace, set()), len(replace) // 2


def fuse_matmul_add(
    steps: list[Step], constants: Constants, keep: Iterable[str], type_of: TypeOf = no_types
) -> tuple[list[Step], int]:
    """``Add(MatMul(A, W), bias)`` (either order of the Add's inputs) becomes ``MatMulAdd``
    (domain ``onnx_genrt``) where W is a constant 2-D weight [K, N], bias a constant 1-D
    array of N, the Add the MatMul's one reader, and both on one provider that has the
    fused kernel: a projection's bias (Qwen2's q/k/v, Phi's every projection) added by its
    GEMV, one step fewer per biased projection."""
    keep = set(keep)
    readers, producer = _index(steps)
    drop: set[int] = set()
    replace: dict[int, object] = {}
    for i, add in enumerate(steps):
        if (add.node.domain, add.node.op_type) != ("", "Add") or len(add.inputs) != 2:
            continue
        for product, bias in (add.inputs, add.inputs[::-1]):
            j = producer.get(product)
            if j is None or j in drop or product in keep or readers[product] != 1:
                continue
            mm = steps[j]
            if (mm.node.domain, mm.node.op_type) != (
                "",
                "MatMul",
            ) or mm.provider is not add.provider:
                continue
            a, w = mm.inputs
            weight, row = constants.get(w), constants.get(bias)
            if weight is None or row is None or weight.ndim != 2 or row.shape != weight.shape[1:]:
                continue
            node = NodeInfo(
                "MatMulAdd",
                f"{mm.node.name or mm.outputs[0]}/MatMulAdd",
                GENRT_DOMAIN,
                1,
                {"projection_opset": mm.node.opset},
                (a, w, bias),
                (add.outputs[0],),
            )
            step = step_for(add, node, type_of)
            if step is None:
                continue
            drop.add(j)
            replace[i] = step
            break
    return _rewrite(steps, replace, drop), len(replace)
