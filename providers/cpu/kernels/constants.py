"""CPU kernels: Constant, Shape and Size, values known without reading the data.

Constant nodes are folded when a session is built; the kernel runs for that.
"""

from __future__ import annotations

import functools

import numpy as np

from onnx_genrt.core.kernels import KernelContext
from onnx_genrt.core.op_rules import constant_problem, constant_value, shape_value

from ._native_small import copy_native
from ._registry import REGISTRY


@REGISTRY.register("Constant", since=1, check=constant_problem)
def constant(ctx: KernelContext) -> np.ndarray:
    """The node's constant value (value, value_float(s), value_int(s)); returned read-only."""
    value = constant_value(ctx.node)
    value.flags.writeable = False
    return value


def shape(ctx: KernelContext, x: np.ndarray) -> np.ndarray:
    """The input's shape as int64 (start/end slice attributes from opset 15)."""
    return shape_value(ctx.node, x.shape)


def _bind_shape(ctx: KernelContext, inputs, out):
    """Replay closure: a recorded graph's shapes are fixed, so the value is written as it was
    computed when the graph was recorded (the buffer may be shared with other tensors)."""
    value = shape_value(ctx.node, inputs[0].shape)
    if not isinstance(out, np.ndarray) or out.shape != value.shape or out.dtype != value.dtype:
        return None
    call = functools.partial(np.copyto, out, value)
    call.native = copy_native(value, out, call)  # type: ignore[attr-defined]
    return call


REGISTRY.register("Shape", since=1, bind=_bind_shape)(shape)


@REGISTRY.register("Size", since=1)
def size(ctx: KernelContext, x: np.ndarray) -> np.ndarray:
    """Number of elements as a 0-d int64 tensor."""
    return np.asarray(x.size, dtype=np.int64)
