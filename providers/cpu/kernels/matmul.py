"""CPU kernels: MatMul, Gemm, Einsum and MatMulInteger (numpy BLAS, the skinny GEMM for
decode-sized rows of prepacked weights)."""

from __future__ import annotations

import functools

import numpy as np

from onnx_genrt.core.dtypes import is_float_dtype
from onnx_genrt.core.op_rules import matmul_shape

from ._nn_common import (
    compute_dtype,
)
from ._prompt_threads import split_matmul, splits
from ._registry import REGISTRY
from ._skinny_matmul import SKINNY_MAX_M, TiledWeight, pack_weight, skinny_call
from ._weight_arena import arena_zeros

_F64 = np.dtype(np.float64)
_F32 = np.dtype(np.float32)
# Constant float32 MatMul/Gemm weights are prepacked for ``skinny_matmul`` (decode and
# verify steps) unless the provider's ``skinny_matmul`` option is off (numpy/BLAS only).


# ----------------------------------------------------------------------------- MatMul / Gemm


def _as_rows(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """``a`` and ``out`` as 2-D rows when np.matmul(a, b) is one GEMM on a 2-D weight (a
    stack of rows: contiguous ``a`` and ``out`` of one dtype), else None."""
    if b.ndim != 2 or a.ndim < 2 or a.dtype != out.dtype:
        return None
    if a.ndim == 2:
        return a, out
    if a.flags.c_contiguous and out.flags.c_contiguous:
        return a.reshape(-1, a.shape[-1]), out.reshape(-1, out.shape[-1])
    return None


def _matmul_into(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> np.ndarray:
    """np.matmul(a, b) written into ``out``; a stack of rows times a 2-D weight is one GEMM,
    its rows split over the threads when large (``split_matmul``)."""
    rows = _as_rows(a, b, out)
    if rows is None:
        np.matmul(a, b, out=out)
    else:
        split_matmul(rows[0], b, rows[1])
    return out


def _bind_matmul(ctx, inputs, out: np.ndarray):
    """Replay closure for the float32 path: one BLAS or skinny-kernel call on prebuilt views."""
    a, b = inputs
    if isinstance(b, TiledWeight):
        if a.dtype == out.dtype == _F32 and out.shape == packed_shape(ctx, a, b):
            return packed_call(a, b, out)
        return functools.partial(_replay_kernel, matmul_kernel, ctx, a, b, out)
    if not (a.dtype == b.dtype == out.dtype == np.float32):
        return functools.partial(_replay_kernel, matmul_kernel, ctx, a, b, out)
    rows = _as_rows(a, b, out)
    if rows is None:
        return functools.partial(np.matmul, a, b, out=out)
    a2, out2 = rows
    gemm = split_matmul if splits(*a2.shape, b.shape[1]) else np.matmul
    return functools.partial(gemm, a2, b, out=out2)


def _replay_kernel(fn, ctx, a, b, out) -> None:
    result = fn(ctx, a, b)
    if result is not out:
        np.copyto(out, result, casting="unsafe")


def matmul(ctx, a: np.ndarray, b: np.ndarray, index: int = 0) -> np.ndarray:
    """MatMul with float32 BLAS for every float type; integers through numpy."""
    if a.dtype != b.dtype:
        raise TypeError(
            f"{ctx.node.describe()}: MatMul operand dtypes differ: {a.dtype}, {b.dtype}"
        )
    shape = matmul_shape(ctx, a.shape, b.shape)
    out = ctx.out(index, shape, a.dtype)
    if not is_float_dtype(a.dtype):
        out[...] = np.matmul(a, b)
        return out
    cdt = compute_dtype(a.dtype)
    if a.dtype == cdt:
        return _matmul_into(a, b, out)
    res = np.empty(shape, cdt)
    _matmul_into(a.astype(cdt), b.astype(cdt), res)
    out[...] = res
    return out


def prepack_weight(provider, node, index: int, host: np.ndarray) -> TiledWeight | None:
    """A constant 2-D float32 weight (input B) tiled for ``skinny_matmul`` (for Gemm, read
    as [N, K] when ``transB``) in the provider's weight arena (huge pages); the tiles replace
    the initializer, which is not kept."""
    host = np.asarray(host)
    if not provider.option("skinny_matmul") or index != 1 or host.ndim != 2 or host.dtype != _F32:
        return None
    if 0 in host.shape:
        return None
    transposed = node.op_type == "Gemm" and bool(node.attr("transB", 0))
    return pack_weight(host, transposed=transposed, zeros=arena_zeros(provider))


def packed_shape(ctx, a: np.ndarray, w: TiledWeight) -> tuple[int, ...]:
    if a.dtype != w.dtype:
        raise TypeError(
            f"{ctx.node.describe()}: MatMul operand dtypes differ: {a.dtype}, {w.dtype}"
        )
    return matmul_shape(ctx, a.shape, w.shape)


#: Rows of A a prompt-sized call on a prepacked weight multiplies per skinny call: the rows
#: stay in L2 while each weight tile is read (the kernel runs at the same rate to 512 rows,
#: ahead of BLAS, which also needs a dense copy of the weight; docs/performance.md).
PROMPT_BLOCK_ROWS = 64


def packed_call(a: np.ndarray, w: TiledWeight, out: np.ndarray, bias=None):
    """A call computing ``out = a @ W (+ bias)`` for a prepacked W: the skinny kernel for
    contiguous float32 rows (more than ``SKINNY_MAX_M`` in blocks of ``PROMPT_BLOCK_ROWS``),
    else BLAS on the weight untiled for the call."""
    k, n = w.shape
    m = a.size // k if k else 0
    if m and n and a.flags.c_contiguous and out.flags.c_contiguous and out.dtype == _F32:
        x, y = a.reshape(m, k), out.reshape(m, n)
        if m <= SKINNY_MAX_M:
            return skinny_call(x, w, y, bias)
        rows = PROMPT_BLOCK_ROWS
        calls = [skinny_call(x[r : r + rows], w, y[r : r + rows], bias) for r in range(0, m, rows)]
        return functools.partial(_call_each, calls)
    if a.ndim > 2 and a.flags.c_contiguous and out.flags.c_contiguous and a.dtype == out.dtype:
        a, out = a.reshape(-1, k), out.reshape(-1, n)
    return functools.partial(_matmul_dense, a, w, bias, out)


def _call_each(calls: list) -> None:
    for call in calls:
        call()


def _matmul_dense(a: np.ndarray, w: TiledWeight, bias: np.ndarray | None, out: np.ndarray):
    """out = a @ W (+ bias) through BLAS on a dense copy of W made for this call
    (non-contiguous operands)."""
    if a.ndim == 2:
        split_matmul(a, w.dense(), out)
    else:
        np.matmul(a, w.dense(), out=out)
    if bias is not None:
        out += bias


def _matmul_packed(ctx, a: np.ndarray, w: TiledWeight) -> np.ndarray:
    out = ctx.out(0, packed_shape(ctx, a, w), a.dtype)
    packed_call(a, w, out)()
    return out


def matmul_kernel(ctx, a: np.ndarray, b: np.ndarray | TiledWeight) -> np.ndarray:
    """ONNX MatMul (numpy matmul semantics, batched broadcasting, 1-D operands).

    A constant float32 weight arrives prepacked (:func:`prepack_weight`): contiguous rows
    of A run ``skinny_matmul``, which reads each weight tile once for all the rows of a call
    (``PROMPT_BLOCK_ROWS`` a call for a prompt).
    """
    if isinstance(b, TiledWeight):
        return _matmul_packed(ctx, a, b)
    return matmul(ctx, a, b)


REGISTRY.register("MatMul", since=1, prepack=prepack_weight, bind=_bind_matmul)(matmul_kernel)


def _gemmpacked_call(ctx, a: np.ndarray, w: TiledWeight, c: np.ndarray | None, out):
    """The prepacked-weight call of a Gemm that is A @ B + C (alpha = 1, no transA, C absent
    or a float32 row of N with beta = 1), else None."""
    if float(ctx.attr("alpha", 1.0)) != 1.0 or ctx.attr("transA", 0):
        return None
    if a.ndim != 2 or a.dtype != _F32 or a.shape[1] != w.shape[0]:
        return None
    n = w.shape[1]
    if out.shape != (a.shape[0], n) or out.dtype != _F32:
        return None
    bias = None
    if c is not None and float(ctx.attr("beta", 1.0)) != 0.0:
        if float(ctx.attr("beta", 1.0)) != 1.0 or c.dtype != _F32 or c.shape not in ((n,), (1, n)):
            return None
        bias = np.ascontiguousarray(c).reshape(n)
    return packed_call(a, w, out, bias)


def _bind_gemm(ctx, inputs, out: np.ndarray):
    """Replay closure for a Gemm on a prepacked weight (see ``_gemm_packed_call``)."""
    a, b, *rest = inputs
    if not isinstance(b, TiledWeight):
        return None
    c = rest[0] if rest else None
    if c is not None and not c.flags.c_contiguous:  # the bias view must stay live
        return None
    return _gemmpacked_call(ctx, a, b, c, out)


def gemm_kernel(
    ctx, a: np.ndarray, b: np.ndarray | TiledWeight, c: np.ndarray | None = None
) -> np.ndarray:
    """Y = alpha * A' @ B' + beta * C, with C broadcast to (M, N).

    A constant float32 B arrives prepacked; A @ B + C (a row of N) then runs
    ``skinny_matmul`` with C as its bias.
    """
    alpha = float(ctx.attr("alpha", 1.0))
    beta = float(ctx.attr("beta", 1.0))
    if isinstance(b, TiledWeight):
        if a.ndim == 2 and b.dtype == a.dtype:
            m = a.shape[1] if ctx.attr("transA", 0) else a.shape[0]
            out = ctx.out(0, (m, b.shape[1]), a.dtype)
            call = _gemmpacked_call(ctx, a, b, c, out)
            if call is not None:
                call()
                return out
        b = b.dense()  # [K, N], whatever transB said: prepack applied it
    elif ctx.attr("transB", 0):
        b = b.T
    if ctx.attr("transA", 0):
        a = a.T
    if a.ndim != 2 or b.ndim != 2:
        raise ValueError(
            f"{ctx.node.describe()}: Gemm needs 2-D operands, got {a.shape}, {b.shape}"
        )
    dtype = a.dtype
    is_float = is_float_dtype(dtype)
    cdt = compute_dtype(dtype) if is_float else dtype
    shape = (a.shape[0], b.shape[1])
    out = ctx.out(0, shape, dtype)
    y = out if cdt == dtype else np.empty(shape, cdt)
    if cdt == dtype:
        split_matmul(a, b, y)
    else:
        split_matmul(a.astype(cdt), b.astype(cdt), y)
    if alpha != 1.0:
        if is_float:
            y *= cdt.type(alpha)
        else:
            y[...] = (y * alpha).astype(cdt)
    if c is not None and beta != 0.0:
        cc = c.astype(cdt) if c.dtype != cdt else c
        if beta == 1.0:
            y += cc
        elif is_float:
            y += cdt.type(beta) * cc
        else:
            y[...] = (y + beta * cc).astype(cdt)
    if y is not out:
        out[...] = y
    return out


REGISTRY.register("Gemm", since=1, prepack=prepack_weight, bind=_bind_gemm)(gemm_kernel)


def _zero_point(zp: np.ndarray | None, axis_len: int, axis: int, what: str) -> np.ndarray:
    """A MatMulInteger zero point as float64 broadcastable to its 2-D operand."""
    if zp is None:
        return np.zeros((), _F64)
    z = zp.astype(_F64)
    if z.size == 1:
        return z.reshape(())
    if z.ndim == 1 and z.shape[0] == axis_len:
        return z.reshape((-1, 1)) if axis == 0 else z
    raise NotImplementedError(f"MatMulInteger {what} zero point of shape {zp.shape} not supported")


@REGISTRY.register("MatMulInteger", since=10)
def matmul_integer_kernel(
    ctx,
    a: np.ndarray,
    b: np.ndarray,
    a_zero_point: np.ndarray | None = None,
    b_zero_point: np.ndarray | None = None,
) -> np.ndarray:
    """(A - a_zp) @ (B - b_zp) in int32; float64 BLAS is exact for these ranges."""
    m_axis_len = a.shape[-2] if a.ndim >= 2 else 1
    af = a.astype(_F64)
    bf = b.astype(_F64)
    if a_zero_point is not None:
        af -= _zero_point(a_zero_point, m_axis_len, 0 if a.ndim >= 2 else 1, "a")
    if b_zero_point is not None:
        bf -= _zero_point(b_zero_point, b.shape[-1], 1, "b")
    res = np.matmul(af, bf)
    out = ctx.out(0, res.shape, np.int32)
    np.rint(res, out=res)
    out[...] = res
    return out


# ----------------------------------------------------------------------------- Einsum


@REGISTRY.register("Einsum", since=12)
def einsum_kernel(ctx, *inputs: np.ndarray) -> np.ndarray:
    """np.einsum with path optimisation; low-precision floats computed in float32."""
    equation = str(ctx.attr("equation")).replace(" ", "")
    dtype = inputs[0].dtype
    if is_float_dtype(dtype):
        cdt = compute_dtype(dtype)
        ops = [x.astype(cdt) if x.dtype != cdt else x for x in inputs]
    else:
        ops = list(inputs)
    res = np.asarray(np.einsum(equation, *ops, optimize=len(ops) > 1))
    return res if res.dtype == dtype else res.astype(dtype)
