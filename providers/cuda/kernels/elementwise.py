"""CUDA kernels: elementwise math, activations, comparisons, Where, Cast and Identity.

Float math runs in float32 for float16 and bfloat16 inputs (float64 for float64) and rounds
once.
Every kernel writes into its output buffer with broadcasting; nothing is allocated.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import cupy
import numpy as np
from onnx import TensorProto, helper

from onnx_genrt.core.kernels import KernelContext, NodeInfo
from onnx_genrt.core.op_rules import (
    cast_problem,
    cast_target_code,
    gelu_attribute_problem,
)

from ._common import OPTIONS, out
from ._registry import REGISTRY

BOOL = np.dtype(np.bool_)

#: Compute type per element type (``GenrtAcc<T>::type``) and overloaded math on it.
#: CuPy defines its ``bfloat16`` class (cupy/bfloat16.cuh) only in kernels with a bfloat16
#: argument; the declaration here lets the others compile (a specialization may name an
#: incomplete class, and a class may be declared again before or after its definition).
PREAMBLE = r"""
class bfloat16;
template <typename T> struct GenrtAcc { typedef double type; };
template <> struct GenrtAcc<float> { typedef float type; };
template <> struct GenrtAcc<float16> { typedef float type; };
template <> struct GenrtAcc<bfloat16> { typedef float type; };

__device__ __forceinline__ float genrt_math_exp(float x) { return expf(x); }
__device__ __forceinline__ double genrt_math_exp(double x) { return exp(x); }
__device__ __forceinline__ float genrt_math_tanh(float x) { return tanhf(x); }
__device__ __forceinline__ double genrt_math_tanh(double x) { return tanh(x); }
__device__ __forceinline__ float genrt_math_sqrt(float x) { return sqrtf(x); }
__device__ __forceinline__ double genrt_math_sqrt(double x) { return sqrt(x); }
__device__ __forceinline__ float genrt_math_erf(float x) { return erff(x); }
__device__ __forceinline__ double genrt_math_erf(double x) { return erf(x); }
__device__ __forceinline__ float genrt_math_pow(float a, float b) { return powf(a, b); }
__device__ __forceinline__ double genrt_math_pow(double a, double b) { return pow(a, b); }
"""


def _unary_kernel(name: str, body: str) -> cupy.ElementwiseKernel:
    """``y = body(x)`` where ``v`` is x in its compute type ``A``."""
    op = f"typedef GenrtAcc<T>::type A; const A v = (A)x; y = (T)({body});"
    return cupy.ElementwiseKernel(
        "T x", "T y", op, f"genrt_{name}", preamble=PREAMBLE, options=OPTIONS
    )


_UNARY: dict[str, tuple[int, cupy.ElementwiseKernel]] = {
    "Neg": (1, _unary_kernel("neg", "-v")),
    "Sqrt": (1, _unary_kernel("sqrt", "genrt_math_sqrt(v)")),
    "Reciprocal": (1, _unary_kernel("reciprocal", "(A)1 / v")),
    "Exp": (1, _unary_kernel("exp", "genrt_math_exp(v)")),
    "Tanh": (1, _unary_kernel("tanh", "genrt_math_tanh(v)")),
    "Sigmoid": (1, _unary_kernel("sigmoid", "(A)1 / ((A)1 + genrt_math_exp(-v))")),
    "Relu": (1, _unary_kernel("relu", "v < (A)0 ? (A)0 : v")),
    "Erf": (9, _unary_kernel("erf", "genrt_math_erf(v)")),
}

#: Integer inputs of these run through CuPy's exact integer ufuncs.
_INT_UNARY = {
    "Neg": lambda x, y: cupy.negative(x, out=y),
    "Relu": lambda x, y: cupy.maximum(x, x.dtype.type(0), out=y),
}


def _unary(kernel: cupy.ElementwiseKernel, op_type: str) -> Callable[..., cupy.ndarray]:
    def run(ctx: KernelContext, x: cupy.ndarray) -> cupy.ndarray:
        y = out(ctx, 0, x.shape, x.dtype)
        if x.size == 0:
            return y
        if x.dtype.kind in "iu" and op_type in _INT_UNARY:
            return _INT_UNARY[op_type](x, y)  # exact for int64, unlike a trip through double
        kernel(x, y)
        return y

    run.__name__ = op_type.lower()
    return run


for _op, (_since, _kernel) in _UNARY.items():
    REGISTRY.register(_op, since=_since)(_unary(_kernel, _op))

_GELU = {
    "none": _unary_kernel(
        "gelu", "(A)0.5 * v * ((A)1 + genrt_math_erf(v * (A)0.7071067811865476))"
    ),
    "tanh": _unary_kernel(
        "gelu_tanh",
        "(A)0.5 * v * ((A)1 + genrt_math_tanh((A)0.7978845608028654 * "
        "(v + (A)0.044715 * v * v * v)))",
    ),
}


@REGISTRY.register("Gelu", since=20, check=gelu_attribute_problem)
def gelu(ctx: KernelContext, x: cupy.ndarray) -> cupy.ndarray:
    """Gelu, exact (erf) or with the tanh approximation, in the input's compute type."""
    y = out(ctx, 0, x.shape, x.dtype)
    if x.size:
        _GELU[ctx.attr("approximate", "none")](x, y)
    return y


# ----------------------------------------------------------------------------- binary

_INT_DIV = cupy.ElementwiseKernel(
    "T a, T b", "T z", "z = b == (T)0 ? (T)0 : a / b", "genrt_int_div", options=OPTIONS
)
_POW = cupy.ElementwiseKernel(
    "T a, U b",
    "T z",
    "typedef GenrtAcc<T>::type A; z = (T)genrt_math_pow((A)a, (A)b);",
    "genrt_pow",
    preamble=PREAMBLE,
    options=OPTIONS,
)


def broadcast_shape(*arrays: Any) -> tuple[int, ...]:
    """The shape the arrays broadcast to."""
    return tuple(np.broadcast_shapes(*(tuple(a.shape) for a in arrays)))


def _binary(ufunc: Any, out_dtype: np.dtype | None = None) -> Callable[..., cupy.ndarray]:
    def run(ctx: KernelContext, a: cupy.ndarray, b: cupy.ndarray) -> cupy.ndarray:
        z = out(ctx, 0, broadcast_shape(a, b), a.dtype if out_dtype is None else out_dtype)
        if z.size:
            ufunc(a, b, out=z)
        return z

    run.__name__ = ufunc.__name__
    return run


REGISTRY.register("Add", since=7)(_binary(cupy.add))
REGISTRY.register("Sub", since=7)(_binary(cupy.subtract))
REGISTRY.register("Mul", since=7)(_binary(cupy.multiply))
REGISTRY.register("Equal", since=7)(_binary(cupy.equal, BOOL))
REGISTRY.register("Less", since=7)(_binary(cupy.less, BOOL))
REGISTRY.register("Greater", since=7)(_binary(cupy.greater, BOOL))
REGISTRY.register("And", since=7)(_binary(cupy.logical_and, BOOL))
REGISTRY.register("Or", since=7)(_binary(cupy.logical_or, BOOL))
REGISTRY.register("Xor", since=7)(_binary(cupy.logical_xor, BOOL))


@REGISTRY.register("Not", since=1)
def logical_not(ctx: KernelContext, x: cupy.ndarray) -> cupy.ndarray:
    """Elementwise boolean negation."""
    y = out(ctx, 0, x.shape, BOOL)
    if y.size:
        cupy.logical_not(x, out=y)
    return y


@REGISTRY.register("Div", since=7)
def div(ctx: KernelContext, a: cupy.ndarray, b: cupy.ndarray) -> cupy.ndarray:
    """Division; integers truncate toward zero like C (x / 0 gives 0 rather than a trap)."""
    z = out(ctx, 0, broadcast_shape(a, b), a.dtype)
    if not z.size:
        return z
    if a.dtype.kind in "iu":
        _INT_DIV(a, b, z)
    else:
        cupy.true_divide(a, b, out=z)
    return z


@REGISTRY.register("Pow", since=7)
def pow_(ctx: KernelContext, a: cupy.ndarray, b: cupy.ndarray) -> cupy.ndarray:
    """a ** b in the base's compute type; the output has the base's dtype."""
    z = out(ctx, 0, broadcast_shape(a, b), a.dtype)
    if z.size:
        _POW(a, b, z)
    return z


# ----------------------------------------------------------------------------- Where

_WHERE = cupy.ElementwiseKernel(
    "bool c, T x, T y", "T z", "z = c ? x : y", "genrt_where", options=OPTIONS
)


@REGISTRY.register("Where", since=9)
def where(ctx: KernelContext, cond: cupy.ndarray, x: cupy.ndarray, y: cupy.ndarray) -> Any:
    """x where cond else y (all three broadcast)."""
    z = out(ctx, 0, broadcast_shape(cond, x, y), x.dtype)
    if z.size:
        _WHERE(cond, x, y, z)
    return z


# ----------------------------------------------------------------------------- Cast

#: Element types Cast handles on CUDA (the 8/4-bit floats come later).
_CAST_TYPES = {
    TensorProto.FLOAT,
    TensorProto.FLOAT16,
    TensorProto.BFLOAT16,
    TensorProto.DOUBLE,
    TensorProto.INT8,
    TensorProto.INT16,
    TensorProto.INT32,
    TensorProto.INT64,
    TensorProto.UINT8,
    TensorProto.UINT16,
    TensorProto.UINT32,
    TensorProto.UINT64,
    TensorProto.BOOL,
}


def _cast_check(node: NodeInfo, input_types: Sequence[Any]) -> str | None:
    """The shared Cast rule with the element types CUDA handles."""
    return cast_problem(node, input_types, _CAST_TYPES)


@REGISTRY.register("Cast", since=1, check=_cast_check)
def cast(ctx: KernelContext, x: cupy.ndarray) -> cupy.ndarray:
    """Convert to the ``to`` type (C conversions: floats truncate toward zero into ints)."""
    target = np.dtype(helper.tensor_dtype_to_np_dtype(cast_target_code(ctx.attr("to"))))
    y = out(ctx, 0, x.shape, target)
    if y.size:
        cupy.copyto(y, x, casting="unsafe")
    return y


@REGISTRY.register("Identity", since=1)
def identity(ctx: KernelContext, x: cupy.ndarray | list | None) -> cupy.ndarray | list | None:
    """A copy of the input: a tensor, a sequence of tensors (each copied) or an absent
    optional (None)."""
    if x is None:
        return None
    if isinstance(x, list):
        return [item.copy() for item in x]
    y = out(ctx, 0, x.shape, x.dtype)
    if y.size:
        cupy.copyto(y, x)
    return y
