"""CPU kernels: elementwise math, activations, comparisons, logic, Cast, Where, Clip and friends.

Kernels write into ``ctx.out`` buffers with numpy ``out=`` wherever they can. Those buffers
are assumed not to alias the kernel's inputs. Multi-step float formulas run in float32
for float16/bfloat16 inputs and are cast back once at the end.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import ml_dtypes
import numba
import numpy as np
from onnx import TensorProto, helper

from onnx_genrt.core.kernels import KernelContext
from onnx_genrt.core.op_rules import (
    cast_problem,
    cast_target_code,
    cast_type_problem,
    gelu_attribute_problem,
    legacy_broadcast_shape,
    prelu_slope_shape,
)

from ._native_small import binary_native, copy_native
from ._registry import REGISTRY
from ._vector_exp import exp32

F32 = np.dtype(np.float32)
F64 = np.dtype(np.float64)
BOOL = np.dtype(np.bool_)

Array = np.ndarray


# --------------------------------------------------------------------------- helpers


def _quiet() -> Any:
    """Silence numpy floating-point warnings (log(0), 0/0, overflow): ONNX defines the results."""
    return np.errstate(all="ignore")


def _bshape(*arrays: Array) -> tuple[int, ...]:
    return np.broadcast_shapes(*(a.shape for a in arrays))


def _float_op(compute: Callable[[KernelContext, Array, Array], None]) -> Callable[..., Array]:
    """Kernel from an in-place float32/float64 formula ``compute(ctx, x, out)``.

    float16/bfloat16 (and integer) inputs are computed in float32 and cast back once.
    """

    def kernel(ctx: KernelContext, x: Array) -> Array:
        out = ctx.out(0, x.shape, x.dtype)
        with _quiet():
            if x.dtype in (F32, F64):
                compute(ctx, x, out)
                return out
            xf = x.astype(F32)
            tmp = np.empty_like(xf)
            compute(ctx, xf, tmp)
            np.copyto(out, tmp, casting="unsafe")
        return out

    kernel.__name__ = compute.__name__.lstrip("_")
    kernel.__doc__ = compute.__doc__
    return kernel


def _unary(
    names: str | list[str], since: int, ufunc: np.ufunc, *, quiet: bool = False
) -> Callable[..., Array]:
    """Register a kernel applying one numpy ufunc (output has the input's dtype), with its
    prebound call; returns the kernel."""

    def kernel(ctx: KernelContext, x: Array) -> Array:
        out = ctx.out(0, x.shape, x.dtype)
        if quiet:
            with _quiet():
                return ufunc(x, out=out)
        return ufunc(x, out=out)

    def bind(ctx: KernelContext, inputs: Sequence[Array], out: Array) -> Callable[[], Any]:
        if quiet:
            return functools.partial(_quietly, ufunc, inputs[0], out)
        return functools.partial(ufunc, inputs[0], out=out)

    kernel.__name__ = ufunc.__name__
    return REGISTRY.register(names, since=since, bind=bind)(kernel)


def _binary(
    name: str, since: int, ufunc: np.ufunc, out_dtype: np.dtype | None = None
) -> Callable[..., Array]:
    """Register a kernel applying a broadcasting binary ufunc (output dtype ``out_dtype`` or
    A's), with its prebound call; returns the kernel."""

    def kernel(ctx: KernelContext, a: Array, b: Array) -> Array:
        dt = a.dtype if out_dtype is None else out_dtype
        return ufunc(a, b, out=ctx.out(0, _bshape(a, b), dt))

    def bind(ctx: KernelContext, inputs: Sequence[Array], out: Array) -> Callable[[], Any]:
        call = functools.partial(ufunc, inputs[0], inputs[1], out=out)
        call.native = binary_native(ufunc, inputs[0], inputs[1], out, call)  # type: ignore[attr-defined]
        return call

    kernel.__name__ = ufunc.__name__
    return REGISTRY.register(name, since=since, bind=bind)(kernel)


def _quietly(ufunc: np.ufunc, x: Array, out: Array) -> Array:
    with _quiet():
        return ufunc(x, out=out)


def _flat_loop(ctx: KernelContext, x: Array, loop: Callable[..., None], *params: Any) -> Array:
    """Run a Numba loop ``loop(src, dst, *params)`` over flat float32/float64 views of ``x``."""
    work = x.dtype if x.dtype in (F32, F64) else (F64 if x.dtype.kind in "iub" else F32)
    src = np.ascontiguousarray(x, dtype=work).reshape(-1)
    out = ctx.out(0, x.shape, x.dtype)
    if work == x.dtype and out.flags.c_contiguous:
        loop(src, out.reshape(-1), *params)
        return out
    tmp = np.empty(src.shape, work)
    loop(src, tmp, *params)
    np.copyto(out, tmp.reshape(x.shape), casting="unsafe")
    return out


# --------------------------------------------------------------------------- unary math

for _names, _ufunc, _since, _q in (
    ("Abs", np.absolute, 1, False),
    ("Neg", np.negative, 1, False),
    ("Floor", np.floor, 1, False),
    ("Ceil", np.ceil, 1, False),
    ("Round", np.rint, 11, False),  # ONNX rounds half to even, like rint
    ("Reciprocal", np.reciprocal, 1, True),
    ("Sqrt", np.sqrt, 1, True),
    ("Exp", np.exp, 1, True),
    ("Log", np.log, 1, True),
    ("Sin", np.sin, 7, True),
    ("Cos", np.cos, 7, True),
    ("Tan", np.tan, 7, True),
    ("Asin", np.arcsin, 7, True),
    ("Acos", np.arccos, 7, True),
    ("Atan", np.arctan, 7, True),
    ("Sinh", np.sinh, 9, True),
    ("Cosh", np.cosh, 9, True),
    ("Tanh", np.tanh, 1, True),
    ("Asinh", np.arcsinh, 9, True),
    ("Acosh", np.arccosh, 9, True),
    ("Atanh", np.arctanh, 9, True),
    ("Sign", np.sign, 9, False),
    ("Not", np.logical_not, 1, False),
    ("BitwiseNot", np.invert, 18, False),
):
    _unary(_names, _since, _ufunc, quiet=_q)


@numba.njit(cache=True)
def _erf_loop(x: Array, out: Array) -> None:
    for i in range(x.size):
        out[i] = math.erf(x[i])


@REGISTRY.register("Erf", since=9)
def erf(ctx: KernelContext, x: Array) -> Array:
    """Gauss error function (Numba; numpy has none)."""
    return _flat_loop(ctx, x, _erf_loop)


@REGISTRY.register("IsNaN", since=9)
def isnan(ctx: KernelContext, x: Array) -> Array:
    return np.isnan(x, out=ctx.out(0, x.shape, BOOL))


@REGISTRY.register("IsInf", since=10)
def isinf(ctx: KernelContext, x: Array) -> Array:
    """Infinity test, optionally only for one sign (detect_positive / detect_negative)."""
    out = ctx.out(0, x.shape, BOOL)
    pos, neg = ctx.attr("detect_positive", 1), ctx.attr("detect_negative", 1)
    if pos and neg:
        return np.isinf(x, out=out)
    if pos or neg:
        return np.equal(x, np.inf if pos else -np.inf, out=out)
    out[...] = False
    return out


# --------------------------------------------------------------------------- activations


@REGISTRY.register("Relu", since=1)
def relu(ctx: KernelContext, x: Array) -> Array:
    return np.maximum(x, x.dtype.type(0), out=ctx.out(0, x.shape, x.dtype))


@REGISTRY.register("LeakyRelu", since=1)
def leaky_relu(ctx: KernelContext, x: Array) -> Array:
    """x if x >= 0 else alpha * x."""
    alpha = float(ctx.attr("alpha", 0.01))
    out = np.multiply(x, alpha, out=ctx.out(0, x.shape, x.dtype))
    if 0.0 <= alpha <= 1.0:  # then max(x, alpha*x) is exactly the formula
        return np.maximum(out, x, out=out)
    np.copyto(out, x, where=x >= 0)
    return out


def _exp_linear(x: Array, out: Array, alpha: float, scale: float, x_scale: float = 1.0) -> None:
    """out = scale * (x if x > 0 else alpha * expm1(x * x_scale)): Elu, Selu and Celu."""
    np.minimum(x, 0, out=out)
    if x_scale != 1.0:
        out *= x_scale
    np.expm1(out, out=out)
    out *= alpha
    out += np.maximum(x, 0)
    if scale != 1.0:
        out *= scale


@_float_op
def _elu(ctx: KernelContext, x: Array, out: Array) -> None:
    """Elu: x if x > 0 else alpha * (exp(x) - 1)."""
    _exp_linear(x, out, float(ctx.attr("alpha", 1.0)), 1.0)


@_float_op
def _selu(ctx: KernelContext, x: Array, out: Array) -> None:
    """Selu: gamma * (x if x > 0 else alpha * (exp(x) - 1))."""
    alpha = float(ctx.attr("alpha", 1.67326319217681884765625))
    gamma = float(ctx.attr("gamma", 1.05070102214813232421875))
    _exp_linear(x, out, alpha, gamma)


@_float_op
def _celu(ctx: KernelContext, x: Array, out: Array) -> None:
    """Celu: max(0, x) + min(0, alpha * (exp(x / alpha) - 1))."""
    alpha = float(ctx.attr("alpha", 1.0))
    _exp_linear(x, out, alpha, 1.0, 1.0 / alpha)


def as_rows(x: Array) -> Array:
    """``x`` as 2-D (rows, last axis): a view where the strides allow, else a copy."""
    return x.reshape(-1, x.shape[-1]) if x.ndim else x.reshape(1, 1)


# error_model="numpy": a float division without the zero check, so the loop vectorizes.
@numba.njit(cache=True, error_model="numpy")
def _sigmoid_rows(x, alpha, out):
    """out = 1 / (1 + exp(-alpha x)) over 2-D float32 arrays, with the vectorized exp."""
    for i in range(x.shape[0]):
        for j in range(x.shape[1]):
            out[i, j] = np.float32(1) / (np.float32(1) + exp32(-alpha * x[i, j]))


@numba.njit(cache=True, error_model="numpy")
def silu_mul_rows(g, u, out):
    """out = (sigmoid(g) * g) * u over 2-D float32 arrays (SiluMul's order of operations)."""
    for i in range(g.shape[0]):
        for j in range(g.shape[1]):
            x = g[i, j]
            s = np.float32(1) / (np.float32(1) + exp32(-x))
            out[i, j] = (s * x) * u[i, j]


@numba.njit(cache=True, nogil=True, error_model="numpy")
def silu_mul_halves(gu, half, out):
    """``silu_mul_rows`` of the two halves of each row of a C-contiguous ``gu`` (rows,
    2 * half): contiguous rows, where the halves as strided 2-D views (Numba's layout "A")
    run about 10x slower, not vectorized."""
    for i in range(gu.shape[0]):
        row = gu[i]
        o = out[i]
        for j in range(half):
            x = row[j]
            s = np.float32(1) / (np.float32(1) + exp32(-x))
            o[j] = (s * x) * row[half + j]


def sigmoid_into(x: Array, out: Array, alpha: float = 1.0) -> None:
    """out = 1 / (1 + exp(-alpha x)); float32 through one Numba pass (``out`` C-contiguous
    or 1-D), other dtypes through numpy."""
    same = x.dtype == F32 and out.dtype == F32 and x.shape == out.shape and out.size
    if same and (out.flags.c_contiguous or out.ndim <= 1):
        _sigmoid_rows(as_rows(x), np.float32(alpha), as_rows(out))
        return
    np.multiply(x, -alpha, out=out)
    np.exp(out, out=out)
    out += 1
    np.reciprocal(out, out=out)


def _softplus_into(x: Array, out: Array) -> None:
    """Overflow-free log(1 + exp(x)) = max(x, 0) + log1p(exp(-|x|))."""
    np.absolute(x, out=out)
    np.negative(out, out=out)
    np.exp(out, out=out)
    np.log1p(out, out=out)
    out += np.maximum(x, 0)


@_float_op
def _sigmoid(ctx: KernelContext, x: Array, out: Array) -> None:
    """Sigmoid: 1 / (1 + exp(-x))."""
    sigmoid_into(x, out)


@_float_op
def _swish(ctx: KernelContext, x: Array, out: Array) -> None:
    """Swish: x * sigmoid(alpha * x)."""
    sigmoid_into(x, out, float(ctx.attr("alpha", 1.0)))
    out *= x


@_float_op
def _hard_sigmoid(ctx: KernelContext, x: Array, out: Array) -> None:
    """HardSigmoid: clip(alpha * x + beta, 0, 1)."""
    np.multiply(x, float(ctx.attr("alpha", 0.2)), out=out)
    out += float(ctx.attr("beta", 0.5))
    np.clip(out, 0, 1, out=out)


@_float_op
def _hard_swish(ctx: KernelContext, x: Array, out: Array) -> None:
    """HardSwish: x * clip(x / 6 + 0.5, 0, 1)."""
    np.multiply(x, 1.0 / 6.0, out=out)
    out += 0.5
    np.clip(out, 0, 1, out=out)
    out *= x


@_float_op
def _softplus(ctx: KernelContext, x: Array, out: Array) -> None:
    """Softplus: log(1 + exp(x))."""
    _softplus_into(x, out)


@_float_op
def _softsign(ctx: KernelContext, x: Array, out: Array) -> None:
    """Softsign: x / (1 + |x|)."""
    np.absolute(x, out=out)
    out += 1
    np.divide(x, out, out=out)


@_float_op
def _mish(ctx: KernelContext, x: Array, out: Array) -> None:
    """Mish: x * tanh(softplus(x))."""
    _softplus_into(x, out)
    np.tanh(out, out=out)
    out *= x


@_float_op
def _thresholded_relu(ctx: KernelContext, x: Array, out: Array) -> None:
    """ThresholdedRelu: x if x > alpha else 0."""
    np.multiply(x, x > float(ctx.attr("alpha", 1.0)), out=out)


REGISTRY.register("Elu", since=1)(_elu)
REGISTRY.register("Selu", since=1)(_selu)
REGISTRY.register("Celu", since=12)(_celu)
REGISTRY.register("Sigmoid", since=1)(_sigmoid)
REGISTRY.register("Swish", since=24)(_swish)
REGISTRY.register("HardSigmoid", since=1)(_hard_sigmoid)
REGISTRY.register("HardSwish", since=14)(_hard_swish)
REGISTRY.register("Softplus", since=1)(_softplus)
REGISTRY.register("Softsign", since=1)(_softsign)
REGISTRY.register("Mish", since=18)(_mish)
REGISTRY.register("ThresholdedRelu", since=10)(_thresholded_relu)


@REGISTRY.register("PRelu", since=1)
def prelu(ctx: KernelContext, x: Array, slope: Array) -> Array:
    """x if x >= 0 else slope * x (slope broadcasts to x)."""
    slope = slope.reshape(prelu_slope_shape(ctx.node, x.shape, slope.shape))
    out = np.multiply(x, slope, out=ctx.out(0, x.shape, x.dtype), casting="unsafe")
    np.copyto(out, x, where=x >= 0)
    return out


@numba.njit(cache=True)
def _gelu_loop(x: Array, out: Array, tanh_approx: bool) -> None:
    if tanh_approx:
        c = math.sqrt(2.0 / math.pi)
        for i in range(x.size):
            v = x[i]
            out[i] = 0.5 * v * (1.0 + math.tanh(c * (v + 0.044715 * v * v * v)))
    else:
        for i in range(x.size):
            v = x[i]
            out[i] = 0.5 * v * (1.0 + math.erf(v * 0.7071067811865476))


@REGISTRY.register("Gelu", since=20, check=gelu_attribute_problem)
def gelu(ctx: KernelContext, x: Array) -> Array:
    """Gelu, exact (erf) or with the tanh approximation (Numba, one pass)."""
    approx = ctx.attr("approximate", "none")
    if approx not in ("none", "tanh"):
        raise NotImplementedError(f"{ctx.node.describe()}: Gelu approximate={approx!r}")
    return _flat_loop(ctx, x, _gelu_loop, approx == "tanh")


# --------------------------------------------------------------------------- binary arithmetic

_add = _binary("Add", 7, np.add)
_sub = _binary("Sub", 7, np.subtract)
_mul = _binary("Mul", 7, np.multiply)


@REGISTRY.register("Div", since=7)
def div(ctx: KernelContext, a: Array, b: Array) -> Array:
    """Division; signed integers truncate toward zero like C."""
    out = ctx.out(0, _bshape(a, b), a.dtype)
    with _quiet():
        if a.dtype.kind not in "iu":
            return np.divide(a, b, out=out)
        np.floor_divide(a, b, out=out)
        if a.dtype.kind == "i":
            # floor and trunc differ where the remainder is nonzero and the signs differ
            fix = (np.remainder(a, b) != 0) & ((a < 0) != (b < 0))
            np.add(out, fix, out=out, casting="unsafe")
    return out


@REGISTRY.register("Pow", since=7)
def pow_(ctx: KernelContext, a: Array, b: Array) -> Array:
    """a ** b; the output has the base's dtype (mixed exponent types allowed)."""
    out = ctx.out(0, _bshape(a, b), a.dtype)
    with _quiet():
        if a.dtype.kind in "iu" and (
            b.dtype.kind not in "iu" or (b.size and b.min() < 0)
        ):  # integer base, fractional or negative exponent: compute in float64, then truncate
            np.copyto(out, np.power(a.astype(F64), b), casting="unsafe")
            return out
        return np.power(a, b, out=out, casting="unsafe")


@REGISTRY.register("Mod", since=10)
def mod(ctx: KernelContext, a: Array, b: Array) -> Array:
    """fmod=0: result has the divisor's sign (Python style); fmod=1: C fmod (dividend's sign)."""
    out = ctx.out(0, _bshape(a, b), a.dtype)
    with _quiet():
        if ctx.attr("fmod", 0):
            return np.fmod(a, b, out=out)
        return np.remainder(a, b, out=out)


@REGISTRY.register("BitShift", since=11)
def bit_shift(ctx: KernelContext, x: Array, y: Array) -> Array:
    """Shift left/right; shifts < 0 or >= bit width give 0 (-1 for right shift of negatives)."""
    direction = ctx.attr("direction", "")
    if direction not in ("LEFT", "RIGHT"):
        raise ValueError(
            f"{ctx.node.describe()}: direction must be LEFT or RIGHT, got {direction!r}"
        )
    ufunc = np.left_shift if direction == "LEFT" else np.right_shift
    out = ctx.out(0, _bshape(x, y), x.dtype)
    bits = x.dtype.itemsize * 8
    if y.size == 0 or (y.min() >= 0 and y.max() < bits):
        return ufunc(x, y, out=out, casting="unsafe")
    bad = (y < 0) | (y >= bits)
    ufunc(x, np.where(bad, 0, y).astype(y.dtype), out=out, casting="unsafe")
    fill = np.where(x < 0, -1, 0) if direction == "RIGHT" and x.dtype.kind == "i" else 0
    np.copyto(out, fill, where=bad, casting="unsafe")
    return out


_binary("BitwiseAnd", 18, np.bitwise_and)
_binary("BitwiseOr", 18, np.bitwise_or)
_binary("BitwiseXor", 18, np.bitwise_xor)
_and = _binary("And", 7, np.logical_and, BOOL)
_or = _binary("Or", 7, np.logical_or, BOOL)
_xor = _binary("Xor", 7, np.logical_xor, BOOL)
_equal = _binary("Equal", 7, np.equal, BOOL)
_less = _binary("Less", 7, np.less, BOOL)
_binary("LessOrEqual", 12, np.less_equal, BOOL)
_greater = _binary("Greater", 7, np.greater, BOOL)


# --------------------------------------------------------------------------- opset 1-6 forms


def _legacy_broadcast(kernel: Callable[..., Array]) -> Callable[..., Array]:
    """The opset 1-6 form of a binary kernel: B broadcast to A by ``broadcast``/``axis``."""

    def legacy(ctx: KernelContext, a: Array, b: Array) -> Array:
        return kernel(ctx, a, b.reshape(legacy_broadcast_shape(ctx.node, a.shape, b.shape)))

    legacy.__name__ = f"{kernel.__name__}_opset1"
    legacy.__doc__ = f"{kernel.__name__} before opset 7 (``broadcast``/``axis`` attributes)."
    return legacy


for _name, _kernel in (
    ("Add", _add), ("Sub", _sub), ("Mul", _mul), ("Div", div), ("Pow", pow_),
    ("And", _and), ("Or", _or), ("Xor", _xor), ("Equal", _equal), ("Less", _less),
    ("Greater", _greater),
):  # fmt: skip
    REGISTRY.register(_name, since=1)(_legacy_broadcast(_kernel))
_binary("GreaterOrEqual", 12, np.greater_equal, BOOL)


# --------------------------------------------------------------------------- variadic


def _variadic(ufunc: np.ufunc, ctx: KernelContext, inputs: Sequence[Array]) -> Array:
    """Fold ``ufunc`` over all inputs (numpy broadcasting) into one output buffer."""
    arrays = [a for a in inputs if a is not None]
    if not arrays:
        raise ValueError(f"{ctx.node.describe()}: needs at least one input")
    if ctx.opset < 8 and len({a.shape for a in arrays}) > 1:
        raise ValueError(
            f"{ctx.node.describe()}: inputs have shapes {[list(a.shape) for a in arrays]}; "
            f"before opset 8 they must all match (opset 8+ broadcasts)"
        )
    out = ctx.out(0, _bshape(*arrays), arrays[0].dtype)
    if len(arrays) == 1:
        np.copyto(out, arrays[0])
        return out
    ufunc(arrays[0], arrays[1], out=out)
    for a in arrays[2:]:
        ufunc(out, a, out=out)
    return out


@REGISTRY.register("Max", since=1)
def max_(ctx: KernelContext, *inputs: Array) -> Array:
    return _variadic(np.maximum, ctx, inputs)


@REGISTRY.register("Min", since=1)
def min_(ctx: KernelContext, *inputs: Array) -> Array:
    return _variadic(np.minimum, ctx, inputs)


@REGISTRY.register("Sum", since=1)
def sum_(ctx: KernelContext, *inputs: Array) -> Array:
    return _variadic(np.add, ctx, inputs)


@REGISTRY.register("Mean", since=1)
def mean(ctx: KernelContext, *inputs: Array) -> Array:
    out = _variadic(np.add, ctx, inputs)
    n = sum(a is not None for a in inputs)
    if n > 1:
        np.divide(out, n, out=out, casting="unsafe")
    return out


# --------------------------------------------------------------------------- Cast

_F8_SATURATING = {
    TensorProto.FLOAT8E4M3FN,
    TensorProto.FLOAT8E4M3FNUZ,
    TensorProto.FLOAT8E5M2,
    TensorProto.FLOAT8E5M2FNUZ,
}
_E8M0 = getattr(TensorProto, "FLOAT8E8M0", None)


def _to_e8m0(x: Array, saturate: bool, round_mode: str) -> Array:
    """float -> float8e8m0 (a bare power-of-two exponent), rounding per ``round_mode``."""
    bits = np.asarray(x, dtype=F32).view(np.uint32)
    exp = ((bits >> 23) & 0xFF).astype(np.int32)
    frac = bits & 0x7FFFFF
    if round_mode == "up":
        exp += frac != 0
    elif round_mode == "nearest":  # ties (mantissa exactly 1.5) round up
        exp += frac >= 0x400000
    elif round_mode != "down":
        raise NotImplementedError(f"Cast round_mode={round_mode!r} is not supported")
    special = ((bits >> 23) & 0xFF) == 0xFF  # inf or nan
    exp[exp > 0xFE] = 0xFE if saturate else 0xFF
    exp[special] = 0xFF
    if saturate:
        exp[special & (frac == 0)] = 0xFE  # +-inf saturates to the largest value
    return exp.astype(np.uint8).view(ml_dtypes.float8_e8m0fnu)


def _cast(ctx: KernelContext, x: Array, code: int) -> Array:
    reason = cast_type_problem(code)
    if reason is None and x.dtype.kind in "OUS":
        reason = "string tensors are not supported"
    if reason:
        raise NotImplementedError(f"{ctx.node.describe()}: {reason}")
    saturate = bool(ctx.attr("saturate", 1))
    if code == _E8M0:
        return _to_e8m0(x, saturate, ctx.attr("round_mode", "up"))
    target = helper.tensor_dtype_to_np_dtype(code)
    if saturate and code in _F8_SATURATING and x.dtype != BOOL:
        info = ml_dtypes.finfo(target)
        with _quiet():
            x = np.clip(x, float(info.min), float(info.max))  # NaN stays NaN
    out = ctx.out(0, x.shape, target)
    with _quiet():
        np.copyto(out, x, casting="unsafe")
    return out


def cast(ctx: KernelContext, x: Array) -> Array:
    """Convert to the ``to`` type; float8 targets saturate unless saturate=0."""
    return _cast(ctx, x, cast_target_code(ctx.attr("to")))


_PLAIN_CAST_KINDS = "biuf"  # numpy's own conversions: what _cast does for these targets


def _bind_cast(ctx: KernelContext, inputs: Sequence[Array], out: Array) -> Callable[[], Any] | None:
    """Replay closure for a cast between numpy's bool, integer and float types (not the
    float8 family): one ``np.copyto`` into the recorded output."""
    (x,) = inputs
    code = cast_target_code(ctx.attr("to"))
    if cast_type_problem(code) or code == _E8M0 or code in _F8_SATURATING:
        return None
    target = helper.tensor_dtype_to_np_dtype(code)
    if not isinstance(out, np.ndarray) or out.dtype != target or out.shape != x.shape:
        return None
    if x.dtype.kind not in _PLAIN_CAST_KINDS or target.kind not in _PLAIN_CAST_KINDS:
        return None
    if x.dtype.kind != "f" and target != np.float16:  # no floating-point warnings possible
        call = functools.partial(np.copyto, out, x, casting="unsafe")
        call.native = copy_native(x, out, call)  # type: ignore[attr-defined]
        return call

    def run() -> None:
        with _quiet():
            np.copyto(out, x, casting="unsafe")

    return run


REGISTRY.register("Cast", since=1, check=cast_problem, bind=_bind_cast)(cast)


@REGISTRY.register("CastLike", since=15, check=cast_problem)
def cast_like(ctx: KernelContext, x: Array, like: Array) -> Array:
    """Convert to the element type of the second input."""
    try:
        code = helper.np_dtype_to_tensor_dtype(like.dtype)
    except (KeyError, ValueError, TypeError):
        raise NotImplementedError(
            f"{ctx.node.describe()}: CastLike target dtype {like.dtype} is not supported"
        ) from None
    return _cast(ctx, x, code)


# --------------------------------------------------------------------------- selection / misc


@REGISTRY.register("Where", since=9)
def where(ctx: KernelContext, cond: Array, x: Array, y: Array) -> Array:
    """x where cond else y (all three broadcast)."""
    out = ctx.out(0, _bshape(cond, x, y), x.dtype)
    np.copyto(out, y, casting="unsafe")
    np.copyto(out, x, where=cond)
    return out


def _scalar_bound(v: Any) -> Any:
    if isinstance(v, np.ndarray):
        return v.reshape(()) if v.size == 1 else v
    return v


@REGISTRY.register("Clip", since=1)
def clip(ctx: KernelContext, x: Array, lo: Array | None = None, hi: Array | None = None) -> Array:
    """Clamp to [min, max]; bounds are attributes before opset 11, optional inputs after."""
    if ctx.opset < 11:
        lo, hi = ctx.attr("min"), ctx.attr("max")
    lo, hi = _scalar_bound(lo), _scalar_bound(hi)
    out = ctx.out(0, x.shape, x.dtype)
    if lo is None and hi is None:
        np.copyto(out, x)
        return out
    return np.clip(x, lo, hi, out=out, casting="unsafe")


@REGISTRY.register("Identity", since=1)
def identity(ctx: KernelContext, x: Any) -> Any:
    """Copy of the input (sequences and empty optionals pass through)."""
    if not isinstance(x, np.ndarray):
        return list(x) if isinstance(x, list) else x
    out = ctx.out(0, x.shape, x.dtype)
    np.copyto(out, x)
    return out


@REGISTRY.register("Dropout", since=1)
def dropout(
    ctx: KernelContext, x: Array, ratio: Array | None = None, training_mode: Array | None = None
) -> Array | tuple[Array, Array]:
    """Inference dropout: Y = X, optional mask all True. Training with ratio > 0 is unsupported."""
    training = ctx.opset >= 12 and training_mode is not None and bool(np.asarray(training_mode))
    if training:
        r = 0.5 if ratio is None else float(np.asarray(ratio))
        if r != 0.0:
            raise NotImplementedError(
                f"{ctx.node.describe()}: training_mode=True with ratio {r} (random dropout) "
                "is not supported"
            )
    y = ctx.out(0, x.shape, x.dtype)
    np.copyto(y, x)
    outs = ctx.node.output_names
    if len(outs) < 2 or not outs[1]:
        return y
    mask = ctx.out(1, x.shape, BOOL if ctx.opset >= 10 else x.dtype)
    mask[...] = 1
    return y, mask
