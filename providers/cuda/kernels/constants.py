"""CUDA kernels: Constant and Shape, values known on the host.

Shape's result depends only on the input's shape, so it is a device array uploaded once per
distinct value and kept (per provider) with a host shadow: later runs, captures included,
return the same array without any copy or sync, and ``host_ints`` reads it on the host.
Constant nodes are folded at load; the kernel only runs for that.
"""

from __future__ import annotations

import weakref

import cupy
import numpy as np

from onnx_genrt.core.kernels import KernelContext
from onnx_genrt.core.op_rules import constant_problem, constant_value, shape_value

from ._common import CaptureUnsupported, capturing
from ._registry import REGISTRY

#: provider -> {(dtype str, values): device array}; arrays live as long as their provider.
_HOST_VALUES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_PLAIN: dict[tuple, cupy.ndarray] = {}


def host_known(ctx: KernelContext, host: np.ndarray) -> cupy.ndarray:
    """A persistent device copy of small host array ``host`` (uploaded on first use)."""
    host = np.ascontiguousarray(host)
    key = (host.dtype.str, host.shape, host.tobytes())
    provider = ctx.provider
    try:
        table = _HOST_VALUES.setdefault(provider, {}) if provider is not None else _PLAIN
    except TypeError:  # a provider without weak references
        table = _PLAIN
    dev = table.get(key)
    if dev is None:
        if capturing(ctx):
            raise CaptureUnsupported(
                f"{ctx.node.describe()}: value {host.tolist()} is first needed while capturing; "
                "run the step eagerly first"
            )
        dev = provider.upload(host) if provider is not None else cupy.asarray(host)
        table[key] = dev
    return dev


@REGISTRY.register("Shape", since=1)
def shape(ctx: KernelContext, x) -> cupy.ndarray:
    """The input's shape as int64 (start/end attributes from opset 15); host-shadowed."""
    return host_known(ctx, shape_value(ctx.node, x.shape))


@REGISTRY.register("Constant", since=1, check=constant_problem)
def constant(ctx: KernelContext):
    """The node's value (value, value_float(s), value_int(s)) on the device."""
    value = constant_value(ctx.node)
    if capturing(ctx):
        raise CaptureUnsupported(f"{ctx.node.describe()}: Constant runs at load (folded)")
    return ctx.provider.upload(value) if ctx.provider is not None else cupy.asarray(value)
