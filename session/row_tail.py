"""The row-local tail of a graph output: the last steps of a plan that compute, say, the
logits from the final hidden states one row (token) at a time.

A prefill reads the logits of its last row only. When every step between the hidden states
and the logits is row-local (a projection on a constant weight, elementwise math with
constants, a softmax or argmax over the last axis), the executor can feed those steps the
last row alone (:meth:`session.executor.Executor.run_bound_eager` with ``last_row_of``):
for a 512-token prompt and a 151936-token vocabulary that skips 511 rows of the largest
matmul of the step and a 311 MB logits buffer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from onnx_genrt.core.genrt_ops import NORM_PROJECTIONS
from onnx_genrt.core.kernels import normalize_domain

#: Elementwise ops: output row i reads row i of each row input (constants broadcast, rank <= 1).
_ELEMENTWISE = frozenset(
    {"Add", "Sub", "Mul", "Div", "Cast", "Tanh", "Sigmoid", "Relu", "Neg", "Exp", "Log", "Abs"}
)
#: Ops over the last axis only (attribute ``axis`` must be -1).
_LAST_AXIS = frozenset({"Softmax", "LogSoftmax", "ArgMax", "ArgMin"})
#: Full reductions to a scalar (no axes, keepdims=0): over the tail they cover the rows it
#: computes, which is what a probe such as the engine's non-finite check wants.
_FULL_REDUCTIONS = frozenset({"ReduceSum", "ReduceMax", "ReduceMin"})


#: Fused ops (``session.fusion``) that normalize their rows, then project them: inputs
#: (x, skip, gamma, weight...), outputs (y, residual sum, normalized rows).
_NORM_PROJECTIONS = frozenset(NORM_PROJECTIONS.values())


@dataclass(frozen=True)
class RowTail:
    """Steps ``start`` on that only need the last row of ``start``'s row inputs (its inputs
    that are no constants: the activations, and a fused norm's residual).

    ``outputs``: the graph outputs computed from that row alone (a caller binds them with one
    row); every other value in the plan is computed as usual.
    """

    start: int
    outputs: frozenset[str]


def _is_projection(step: Any, constants: Mapping[str, Any]) -> bool:
    """A MatMul on a constant 2-D weight (or a fused ``MatMulAdd`` with its constant bias
    row), or a MatMulNBits (row input 0, the rest constant)."""
    op, domain = step.node.op_type, normalize_domain(step.node.domain)
    rest = [name for name in step.inputs[1:] if name]
    if not all(name in constants for name in rest):
        return False
    if (domain, op) == ("", "MatMul"):
        return len(step.inputs) == 2 and getattr(constants[step.inputs[1]], "ndim", 0) == 2
    if (domain, op) == ("onnx_genrt", "MatMulAdd"):
        weight, bias = (constants[name] for name in step.inputs[1:3])
        return getattr(weight, "ndim", 0) == 2 and getattr(bias, "ndim", 0) == 1
    return (domain, op) == ("com.microsoft", "MatMulNBits")


def _is_start(step: Any, constants: Mapping[str, Any], readers: Mapping[str, int]) -> bool:
    """A projection, or a norm fused into one whose residual sum no one reads."""
    if _is_projection(step, constants):
        return True
    if normalize_domain(step.node.domain) != "onnx_genrt":
        return False
    if step.node.op_type not in _NORM_PROJECTIONS or len(step.inputs) < 4:
        return False
    weights = [name for name in step.inputs[2:] if name]
    total = step.outputs[1] if len(step.outputs) > 1 else ""
    return all(name in constants for name in weights) and not (total and readers.get(total))


def _row_local(step: Any, rows: set[str], constants: Mapping[str, Any]) -> bool:
    """Whether ``step`` computes each row of its outputs from that row of ``rows`` values."""
    op, domain = step.node.op_type, normalize_domain(step.node.domain)
    if _is_projection(step, constants):
        return step.inputs[0] in rows
    if (domain, op) == ("onnx_genrt", "NonFinite"):  # a full reduction, as below
        return step.inputs[0] in rows
    if domain != "":
        return False
    others = [name for name in step.inputs if name and name not in rows]
    if op in _ELEMENTWISE:
        return all(getattr(constants.get(name), "ndim", 99) <= 1 for name in others)
    if op in _LAST_AXIS:
        return not others and step.node.attrs.get("axis", 0) == -1
    if op in _FULL_REDUCTIONS:
        attrs = step.node.attrs
        return (
            not others
            and len([n for n in step.inputs if n]) == 1
            and "axes" not in attrs
            and attrs.get("keepdims", 1) == 0
            and attrs.get("noop_with_empty_axes", 0) == 0
        )
    return False


def find_row_tail(
    steps: Sequence[Any], constants: Mapping[str, Any], graph_outputs: set[str], output: str
) -> RowTail | None:
    """The row-local tail that makes ``output``, or None where there is none.

    From ``output``'s producer it walks back through row-local steps (a Cast or a softcap
    after the lm_head), over values with one reader that are no graph output, to a
    projection (or a norm fused into one): the tail's start. Every step downstream of the
    start must be row-local.
    """
    producer = {name: i for i, s in enumerate(steps) for name in s.outputs if name}
    readers: dict[str, int] = {}
    for s in steps:
        for name in s.inputs:
            if name:
                readers[name] = readers.get(name, 0) + 1
    i = producer.get(output)
    while i is not None and not _is_start(steps[i], constants, readers):
        row_inputs = [n for n in steps[i].inputs if n and n not in constants]
        if len(set(row_inputs)) != 1 or not _row_local(steps[i], set(row_inputs), constants):
            return None
        value = row_inputs[0]
        i = producer.get(value)
        if value in graph_outputs or readers.get(value) != 1:
            return None
    if i is None:
        return None
    rows = {name for name in steps[i].outputs if name}
    # Values made from a full reduction: over the tail it covers the last row only, so
    # no row may read them (each row would see the last row's statistic).
    reduced: set[str] = set()
    for step in steps[i + 1 :]:
        read = {name for name in step.inputs if name and name in rows}
        if not read:
            continue
        if not _row_local(step, rows, constants):
            return None
        made = {name for name in step.outputs if name}
        if read & reduced:
            if read - reduced:
                return None
            reduced |= made
        elif step.node.op_type in _FULL_REDUCTIONS:
            reduced |= made
        rows |= made
    return RowTail(i, frozenset(rows & graph_outputs))
