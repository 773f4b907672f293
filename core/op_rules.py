"""Host-side rules of ONNX ops (shapes, supported attributes), shared by every provider."""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np
import onnx

from .genrt_ops import GENRT_OPS, projection_node
from .kernels import KernelContext, NodeInfo, TensorType

#: Bit widths MatMulNBits kernels support.
NBITS = (2, 4, 8)
#: MatMulNBits ``accuracy_level`` values (0 unset, 1 fp32, 2 fp16, 3 bf16, 4 int8).
NBITS_ACCURACY_LEVELS = range(5)
#: The ``accuracy_level`` at which onnxruntime's CPU MatMulNBits quantizes A to int8.
NBITS_INT8_LEVEL = 4


def reshape_target(ctx: KernelContext, in_shape: Sequence[int], shape: Sequence[int]) -> list[int]:
    """Resolve 0 (copy the input dim, unless allowzero) and a single -1 in a Reshape target."""
    allowzero = ctx.opset >= 14 and bool(ctx.attr("allowzero", 0))
    target = list(shape)
    for i, s in enumerate(target):
        if s == 0 and not allowzero:
            if i >= len(in_shape):
                raise ValueError(f"{ctx.node.describe()}: 0 at position {i} beyond input rank")
            target[i] = in_shape[i]
    unknown = [i for i, s in enumerate(target) if s == -1]
    total = math.prod(in_shape)
    if len(unknown) > 1:
        raise ValueError(f"{ctx.node.describe()}: more than one -1 in shape {list(shape)}")
    if unknown:
        known = math.prod(s for s in target if s != -1)
        if known == 0 or total % known:
            raise ValueError(
                f"{ctx.node.describe()}: cannot reshape {tuple(in_shape)} to {list(shape)}"
            )
        target[unknown[0]] = total // known
    if math.prod(target) != total or any(s < 0 for s in target):
        raise ValueError(
            f"{ctx.node.describe()}: cannot reshape {tuple(in_shape)} to {list(shape)}"
        )
    return target


def check_index_range(ctx: KernelContext, idx: np.ndarray, dim: int, what: str = "index") -> None:
    """Raise IndexError naming the node when any index is outside ``[-dim, dim)`` (the range
    ONNX's gather-like ops allow; negatives count from the end). ``idx`` is on the host."""
    if idx.size == 0:
        return
    lo, hi = int(idx.min()), int(idx.max())
    if lo < -dim or hi >= dim:
        bad = lo if lo < -dim else hi
        raise IndexError(
            f"{ctx.node.describe()}: {what} {bad} out of range for axis of size {dim} "
            f"(valid: {-dim}..{dim - 1})"
        )


def matmul_nbits_unsupported(node: NodeInfo, _types: object = ()) -> str | None:
    """Why a MatMulNBits node's attributes cannot run, or None (a kernel ``check``)."""
    bits = int(node.attr("bits", 4))
    block = int(node.attr("block_size", 0))
    if bits not in NBITS:
        return f"MatMulNBits bits={bits} is not supported (2, 4 or 8)"
    if block < 16 or block & (block - 1):
        return f"MatMulNBits block_size={block} must be a power of 2 >= 16"
    names = node.input_names
    if len(names) > 4 and names[4]:
        return "MatMulNBits g_idx input is not supported"
    if node.attr("weight_prepacked", 0):
        return "MatMulNBits weight_prepacked is not supported"
    level = int(node.attr("accuracy_level", 0))
    if level not in NBITS_ACCURACY_LEVELS:
        return f"MatMulNBits accuracy_level={level} is not one of 0-4"
    return None


@dataclass(frozen=True)
class NBitsDims:
    """A MatMulNBits node's sizes: Y[..., n] = A[..., k] @ dequant(B[n, k / block, ...])^T."""

    k: int
    n: int
    bits: int
    block: int


def matmul_nbits_dims(node: NodeInfo, a_columns: int, has_g_idx: bool) -> NBitsDims:
    """The sizes of a MatMulNBits node about to run on A with ``a_columns`` columns.

    Raises NotImplementedError for what :func:`matmul_nbits_unsupported` refuses (or a
    ``g_idx`` input given at run time) and ValueError when A does not have K columns."""
    reason = matmul_nbits_unsupported(node)
    if reason or has_g_idx:
        raise NotImplementedError(f"{node.describe()}: {reason or 'g_idx'}")
    dims = NBitsDims(
        int(node.attr("K")),
        int(node.attr("N")),
        int(node.attr("bits", 4)),
        int(node.attr("block_size")),
    )
    if a_columns != dims.k:
        raise ValueError(f"{node.describe()}: A has {a_columns} columns, K is {dims.k}")
    return dims


def matmul_nbits_int8_activations(node: NodeInfo, zero_points_dtype: np.dtype | None) -> bool:
    """Whether a MatMulNBits node computes with A quantized to int8 per block, as
    onnxruntime's CPU provider does: ``accuracy_level`` 4 with packed uint8 zero points or
    none (float zero points keep float activations there). ``zero_points_dtype`` is None
    when the node has no zero points."""
    if int(node.attr("accuracy_level", 0)) != NBITS_INT8_LEVEL:
        return False
    return zero_points_dtype is None or np.dtype(zero_points_dtype) == np.uint8


def matmul_shape(ctx: KernelContext, a: Sequence[int], b: Sequence[int]) -> tuple[int, ...]:
    """Result shape of ONNX MatMul (numpy matmul rules, 1-D operands included)."""
    a, b = tuple(a), tuple(b)
    if not a or not b:
        raise ValueError(f"{ctx.node.describe()}: MatMul operands must have rank >= 1")
    a2 = (1, *a) if len(a) == 1 else a
    b2 = (*b, 1) if len(b) == 1 else b
    if a2[-1] != b2[-2]:
        raise ValueError(f"{ctx.node.describe()}: MatMul inner dimensions differ: {a} @ {b}")
    try:
        batch = np.broadcast_shapes(a2[:-2], b2[:-2])
    except ValueError:
        raise ValueError(
            f"{ctx.node.describe()}: MatMul batch dimensions do not broadcast: {a} @ {b}"
        ) from None
    shape = (*batch, a2[-2], b2[-1])
    if len(a) == 1:
        shape = shape[:-2] + shape[-1:]
    if len(b) == 1:
        shape = shape[:-1]
    return tuple(int(s) for s in shape)


#: The projection each fused op (domain ``onnx_genrt``) wraps: (domain, op_type, number of
#: the fused op's own inputs before the projection's weights); see ``core.genrt_ops``.
FUSED_PROJECTIONS = {name: op.projection for name, op in GENRT_OPS.items() if op.projection}


def fused_projection(node: NodeInfo) -> NodeInfo:
    """The projection inside a ``NormMatMul`` / ``SiluMulMatMul`` (or NBits) node: the node as
    that projection's kernel expects it, reading the prepared activations, with only the
    projection's output."""
    return projection_node(node, f"{node.name}/activations")


def fused_matmul_nbits_unsupported(node: NodeInfo, types: object = ()) -> str | None:
    """``matmul_nbits_unsupported`` for the projection of a fused MatMulNBits node."""
    return matmul_nbits_unsupported(fused_projection(node), types)


def gqa_attribute_problem(node: NodeInfo) -> str | None:
    """Why a GroupQueryAttention node's attributes or outputs are not supported, or None:
    the rules every provider shares (each also refuses inputs it does not take)."""
    if (len(node.output_names) > 3 and node.output_names[3]) or node.attr("qk_output", 0):
        return "GroupQueryAttention output_qk / qk_output is not supported"
    for a in ("k_quant_type", "v_quant_type"):
        if node.attr(a, "NONE") != "NONE":
            return f"GroupQueryAttention {a}={node.attr(a)!r} (quantized KV cache) is not supported"
    if node.attr("causal", 1) not in (0, 1):
        return f"GroupQueryAttention causal={node.attr('causal')} must be 0 or 1"
    window = node.attr("local_window_size", -1)
    if window != -1 and window < 1:
        return f"GroupQueryAttention local_window_size={window} must be -1 (no window) or >= 1"
    if not node.attr("causal", 1) and window != -1:
        return "GroupQueryAttention local_window_size needs causal=1"
    softcap = float(node.attr("softcap", 0.0))
    if not math.isfinite(softcap) or softcap < 0.0:
        return f"GroupQueryAttention softcap={softcap} must be finite and >= 0 (0: no softcap)"
    return _sliding_window_cache_problem(node, window)


def _sliding_window_cache_problem(node: NodeInfo, window: int) -> str | None:
    """The rules of ``sliding_window_cache`` (a window-sized KV cache, see
    ``windowed_cache_length``)."""
    mode = node.attr("sliding_window_cache", 0)
    if mode not in (0, 1):
        return f"GroupQueryAttention sliding_window_cache={mode} must be 0 or 1"
    if not mode:
        return None
    if window < 1:
        return (
            "GroupQueryAttention sliding_window_cache=1 needs local_window_size >= 1 "
            f"(got {window})"
        )
    names = node.input_names
    if len(names) < 5 or not names[3] or not names[4]:
        return "GroupQueryAttention sliding_window_cache=1 needs past_key and past_value inputs"
    if len(names) > 10 and names[10]:
        return "GroupQueryAttention sliding_window_cache=1 with attention_bias is not supported"
    return None


def windowed_cache_length(total: int, capacity: int, window: int) -> int:
    """Rows of a ``sliding_window_cache=1`` KV cache that hold tokens after ``total`` tokens.

    onnxruntime's contract for a window-sized cache of ``capacity`` rows and a window of
    ``window`` keys: rows ``[0, L)`` hold the ``L`` most recent positions in order (row i holds
    position ``total - L + i``). Until the cache is full L = total; after that the cache is
    compacted in blocks of ``capacity - window + 1`` rows, so L runs from ``window`` back up
    to ``capacity``.
    """
    if window < 1 or capacity < window:
        raise ValueError(
            f"sliding_window_cache: KV cache capacity {capacity} must be at least "
            f"local_window_size {window}"
        )
    if total <= capacity:
        return total
    block = capacity - window + 1
    return total - block * -(-(total - capacity) // block)


# -- windowed ops (pooling, ConvTranspose) ------------------------------------------------

#: auto_pad values ONNX defines for Conv, ConvTranspose and the pooling ops.
AUTO_PADS = ("NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID")


@dataclass(frozen=True)
class PoolGeometry:
    """Where a pooling window sits along each spatial axis.

    ``pads`` are the (begin, end) pads the op defines; ``extra_end`` is what ``ceil_mode``
    adds past the end pad so that the last partial window fits (never counted as padding).
    """

    kernel: tuple[int, ...]
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    pads: tuple[tuple[int, int], ...]
    extra_end: tuple[int, ...]
    out_shape: tuple[int, ...]

    @property
    def extents(self) -> tuple[int, ...]:
        """Span of each dilated window."""
        return tuple(d * (k - 1) + 1 for k, d in zip(self.kernel, self.dilations, strict=True))


def _ints(node: NodeInfo, name: str, n: int, default: int) -> tuple[int, ...]:
    values = node.attr(name)
    if values is None:
        return (default,) * n
    values = tuple(int(v) for v in values)
    if len(values) != n:
        raise ValueError(
            f"{node.describe()}: {name} has {len(values)} values, expected {n} "
            f"(one per spatial axis)"
        )
    return values


def pool_attribute_problem(node: NodeInfo, _types: object = ()) -> str | None:
    """Why a MaxPool / AveragePool / LpPool node's attributes cannot run, or None."""
    auto = node.attr("auto_pad", "NOTSET")
    if auto not in AUTO_PADS:
        return f"{node.op_type} auto_pad={auto!r} is not one of {', '.join(AUTO_PADS)}"
    if node.attr("kernel_shape") is None:
        return f"{node.op_type} needs the kernel_shape attribute"
    if node.op_type == "MaxPool" and node.attr("storage_order", 0) not in (0, 1):
        return f"MaxPool storage_order={node.attr('storage_order')} must be 0 or 1"
    if node.op_type == "LpPool" and int(node.attr("p", 2)) < 1:
        return f"LpPool p={node.attr('p')} must be >= 1"
    return None


def pool_geometry(node: NodeInfo, in_spatial: Sequence[int]) -> PoolGeometry:
    """Window geometry and output spatial shape of a pooling node over ``in_spatial``."""
    n = len(in_spatial)
    kernel = tuple(int(k) for k in node.attr("kernel_shape", ()))
    if len(kernel) != n:
        raise ValueError(
            f"{node.describe()}: kernel_shape {list(kernel)} has {len(kernel)} axes but the "
            f"input has {n} spatial axes"
        )
    if 0 in in_spatial:
        raise ValueError(
            f"{node.describe()}: X has spatial shape {list(in_spatial)}; pooling needs at "
            f"least one element on every spatial axis"
        )
    strides = _ints(node, "strides", n, 1)
    dils = _ints(node, "dilations", n, 1)
    if min(kernel + strides + dils, default=1) < 1:
        raise ValueError(f"{node.describe()}: kernel_shape, strides and dilations must be >= 1")
    ext = [d * (k - 1) + 1 for k, d in zip(kernel, dils, strict=True)]
    auto = node.attr("auto_pad", "NOTSET")
    ceil_mode = bool(node.attr("ceil_mode", 0))
    pads: list[tuple[int, int]] = []
    out: list[int] = []
    extra: list[int] = []
    for i, (size, e, s) in enumerate(zip(in_spatial, ext, strides, strict=True)):
        if auto in ("SAME_UPPER", "SAME_LOWER"):
            o = -(-size // s)
            total = max(0, (o - 1) * s + e - size)
            small = total // 2
            pads.append((small, total - small) if auto == "SAME_UPPER" else (total - small, small))
        elif auto == "VALID":
            if size < e:
                raise ValueError(
                    f"{node.describe()}: window of {e} does not fit axis {i} of size {size} "
                    f"(auto_pad=VALID pads nothing)"
                )
            o = -(-(size - e + 1) // s)
            pads.append((0, 0))
        else:
            flat = _ints(node, "pads", 2 * n, 0)
            b, en = flat[i], flat[n + i]
            if b < 0 or en < 0:
                raise ValueError(f"{node.describe()}: negative pads {list(flat)}")
            pads.append((b, en))
            span = size + b + en - e
            if span < 0:
                raise ValueError(
                    f"{node.describe()}: window of {e} does not fit axis {i} of size {size} "
                    f"padded by {(b, en)}"
                )
            o = (-(-span // s) if ceil_mode else span // s) + 1
            if ceil_mode and (o - 1) * s >= size + b:
                o -= 1  # the last window would start inside the end padding only
        out.append(o)
        need = (o - 1) * s + e  # o >= 1: every axis has an element and the window fits
        extra.append(max(0, need - (size + pads[-1][0] + pads[-1][1])))
    return PoolGeometry(kernel, strides, dils, tuple(pads), tuple(extra), tuple(out))


@dataclass(frozen=True)
class ConvTransposeGeometry:
    """ConvTranspose along each spatial axis: the full scatter length before cropping and
    the (begin, end) crop; a negative crop extends the output with zeros."""

    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    full: tuple[int, ...]
    pads: tuple[tuple[int, int], ...]

    @property
    def out_shape(self) -> tuple[int, ...]:
        return tuple(f - b - e for f, (b, e) in zip(self.full, self.pads, strict=True))


def conv_transpose_attribute_problem(node: NodeInfo, _types: object = ()) -> str | None:
    """Why a ConvTranspose node's attributes cannot run, or None."""
    auto = node.attr("auto_pad", "NOTSET")
    if auto not in AUTO_PADS:
        return f"ConvTranspose auto_pad={auto!r} is not one of {', '.join(AUTO_PADS)}"
    if int(node.attr("group", 1)) < 1:
        return f"ConvTranspose group={node.attr('group')} must be >= 1"
    return None


def conv_transpose_geometry(
    node: NodeInfo, in_spatial: Sequence[int], kernel: Sequence[int]
) -> ConvTransposeGeometry:
    """Output geometry of ConvTranspose from pads, or from output_shape / auto_pad (whose
    total padding is split with the odd unit at the end for SAME_UPPER, else at the start)."""
    n = len(in_spatial)
    strides = _ints(node, "strides", n, 1)
    dils = _ints(node, "dilations", n, 1)
    out_pad = _ints(node, "output_padding", n, 0)
    if node.attr("kernel_shape") is not None and tuple(node.attr("kernel_shape")) != tuple(kernel):
        raise ValueError(
            f"{node.describe()}: kernel_shape {list(node.attr('kernel_shape'))} does not match "
            f"the weight's spatial shape {list(kernel)}"
        )
    for i, (op_, s, d) in enumerate(zip(out_pad, strides, dils, strict=True)):
        if op_ < 0 or op_ >= max(s, d):
            raise ValueError(
                f"{node.describe()}: output_padding[{i}]={op_} must be >= 0 and below the "
                f"stride or dilation ({max(s, d)})"
            )
    full = tuple(
        s * (size - 1) + op_ + d * (k - 1) + 1
        for size, k, s, d, op_ in zip(in_spatial, kernel, strides, dils, out_pad, strict=True)
    )
    auto = node.attr("auto_pad", "NOTSET")
    wanted = node.attr("output_shape")
    if wanted is not None:
        wanted = tuple(int(v) for v in wanted)[-n:]
        if len(wanted) != n:
            raise ValueError(
                f"{node.describe()}: output_shape {list(node.attr('output_shape'))} needs "
                f"{n} spatial sizes"
            )
    elif auto in ("SAME_UPPER", "SAME_LOWER"):
        wanted = tuple(size * s for size, s in zip(in_spatial, strides, strict=True))
    if wanted is not None:
        pads = []
        for f, w in zip(full, wanted, strict=True):
            total = f - w
            half = total // 2
            pads.append((half, total - half) if auto == "SAME_UPPER" else (total - half, half))
    elif auto == "VALID":
        pads = [(0, 0)] * n
    else:
        flat = _ints(node, "pads", 2 * n, 0)
        pads = list(zip(flat[:n], flat[n:], strict=True))
    geom = ConvTransposeGeometry(strides, dils, full, tuple(pads))
    if min(geom.out_shape, default=1) < 0:
        raise ValueError(f"{node.describe()}: pads {pads} leave a negative output size")
    return geom


# -- opset 1-6 broadcasting and PRelu slopes -----------------------------------------------


def legacy_broadcast_shape(
    node: NodeInfo, a_shape: Sequence[int], b_shape: Sequence[int]
) -> tuple[int, ...]:
    """The shape B takes to broadcast against A under the opset 1-6 rules of the binary ops
    (``broadcast``/``axis`` attributes): B's dims line up with A's from ``axis`` (default:
    the trailing dims); without broadcast=1 the shapes must match.
    """
    a, b = tuple(a_shape), tuple(b_shape)
    if not node.attr("broadcast", 0):
        if a != b:
            raise ValueError(
                f"{node.describe()}: B {list(b)} differs from A {list(a)}; opset "
                f"{node.opset} broadcasts only with broadcast=1 (or upgrade the model to "
                f"opset 7+, which broadcasts like numpy)"
            )
        return b
    axis = node.attr("axis")
    axis = len(a) - len(b) if axis is None else int(axis)
    if axis < 0:
        axis += len(a)
    if (
        axis < 0
        or axis + len(b) > len(a)
        or any(db not in (1, da) for da, db in zip(a[axis:], b, strict=False))
    ):
        raise ValueError(
            f"{node.describe()}: B {list(b)} does not fit A {list(a)} from axis "
            f"{node.attr('axis', 'trailing')} (broadcast=1 needs B's dims equal to A's there)"
        )
    return (1,) * axis + b + (1,) * (len(a) - axis - len(b))


def prelu_slope_shape(
    node: NodeInfo, x_shape: Sequence[int], slope_shape: Sequence[int]
) -> tuple[int, ...]:
    """The shape the PRelu slope takes against X. A 1-D slope of X's channel count (axis 1)
    is per channel: always before opset 7 (its definition then), and from opset 7 on where
    numpy broadcasting would fail, as older exporters wrote it. Otherwise unchanged."""
    x, s = tuple(x_shape), tuple(slope_shape)
    per_channel = len(s) == 1 and len(x) >= 2 and s[0] == x[1] and s[0] != 1
    if per_channel and (node.opset < 7 or s[0] != x[-1]):
        return (s[0],) + (1,) * (len(x) - 2)
    try:
        if np.broadcast_shapes(x, s) == x:
            return s
    except ValueError:
        pass
    per_channel_hint = f", a per-channel slope of {x[1]} values" if len(x) > 1 else ""
    raise ValueError(
        f"{node.describe()}: slope {list(s)} does not broadcast to X {list(x)}; give one "
        f"slope{per_channel_hint} or a shape that broadcasts to X"
    )


def gelu_attribute_problem(node: NodeInfo, _types: object = ()) -> str | None:
    """Why a Gelu node cannot run: ``approximate`` must be ``none`` (erf) or ``tanh``."""
    approx = node.attr("approximate", "none")
    if approx not in ("none", "tanh"):
        return f"Gelu approximate={approx!r} is not supported (expected 'none' or 'tanh')"
    return None


# -- axes -----------------------------------------------------------------------------------


def normalize_axis(axis: int, rank: int, node: NodeInfo | None = None, what: str = "axis") -> int:
    """``axis`` mapped into ``[0, rank)`` (negatives count from the end); a ValueError naming
    the node otherwise. A scalar (rank 0) accepts axis 0."""
    axis = int(axis)
    if not -rank <= axis < max(rank, 1):
        where = f"{node.describe()}: " if node is not None else ""
        raise ValueError(f"{where}{what} {axis} out of range for rank {rank}")
    return axis + rank if axis < 0 else axis


def normalize_axes(axes: Sequence[int], rank: int, node: NodeInfo | None = None) -> list[int]:
    """Each of ``axes`` normalized (see :func:`normalize_axis`); a repeated axis is an error."""
    out = [normalize_axis(int(a), rank, node) for a in axes]
    if len(set(out)) != len(out):
        where = f"{node.describe()}: " if node is not None else ""
        raise ValueError(f"{where}repeated axis in {[int(a) for a in axes]}")
    return out


# -- Constant -------------------------------------------------------------------------------

#: Constant attributes no provider supports (sparse and string tensors).
CONSTANT_UNSUPPORTED = ("sparse_value", "value_string", "value_strings")


def constant_problem(node: NodeInfo, _types: object = ()) -> str | None:
    """Why a Constant node cannot run (a kernel ``check``), or None."""
    for name in CONSTANT_UNSUPPORTED:
        if name in node.attrs:
            return f"Constant attribute {name!r} is not supported (sparse and string tensors)"
    value = node.attrs.get("value")
    if isinstance(value, np.ndarray) and value.dtype.kind in "OUS":
        return "Constant string tensors are not supported"
    return None


def constant_value(node: NodeInfo) -> np.ndarray:
    """A Constant node's value on the host (value, value_float(s) or value_int(s));
    NotImplementedError naming the node for the forms :func:`constant_problem` refuses."""
    attrs = node.attrs
    if "value" in attrs:
        value = np.asarray(attrs["value"])
    elif "value_float" in attrs:
        value = np.asarray(attrs["value_float"], dtype=np.float32)
    elif "value_floats" in attrs:
        value = np.asarray(attrs["value_floats"], dtype=np.float32).reshape(-1)
    elif "value_int" in attrs:
        value = np.asarray(attrs["value_int"], dtype=np.int64)
    elif "value_ints" in attrs:
        value = np.asarray(attrs["value_ints"], dtype=np.int64).reshape(-1)
    else:
        reason = constant_problem(node) or "Constant has no value attribute"
        raise NotImplementedError(f"{node.describe()}: {reason}")
    if value.dtype.kind in "OUS":
        raise NotImplementedError(f"{node.describe()}: string constants are not supported")
    return value


# -- Cast -----------------------------------------------------------------------------------


def cast_target_code(to: object) -> int:
    """ONNX element type code of Cast's ``to`` (an int, or a type name such as 'FLOAT' as
    opset 1 wrote it); ValueError for an unknown name."""
    if isinstance(to, str):
        return int(onnx.TensorProto.DataType.Value(to.upper()))
    return int(to)  # type: ignore[call-overload]


def _element_type_name(code: int) -> str:
    if code in onnx.TensorProto.DataType.values():
        return onnx.TensorProto.DataType.Name(code)
    return str(code)


def cast_type_problem(code: int, supported: Collection[int] | None = None) -> str | None:
    """Why element type ``code`` cannot be a Cast's source or target, or None: strings and
    complex numbers never; with ``supported`` (a provider's element types), anything else."""
    if code == onnx.TensorProto.STRING:
        return "string tensors are not supported"
    try:
        dt = onnx.helper.tensor_dtype_to_np_dtype(code)
    except (KeyError, ValueError):
        return f"element type code {code} is not supported"
    if dt.kind in "OUSc" or (supported is not None and code not in supported):
        return f"element type {_element_type_name(code)} is not supported"
    return None


def cast_problem(
    node: NodeInfo,
    input_types: Sequence[TensorType | None] = (),
    supported: Collection[int] | None = None,
) -> str | None:
    """Why a Cast node cannot run (a kernel ``check``), or None: ``to`` must name an element
    type; with ``supported``, the target and (when known) the source must be among them.
    CastLike takes its target from an input and is not checked here."""
    if node.op_type == "CastLike":
        return None
    to = node.attr("to")
    if to is None:
        return "Cast needs a 'to' attribute"
    try:
        code = cast_target_code(to)
    except ValueError:
        return f"Cast to={to!r}: unknown element type"
    reason = cast_type_problem(code, supported)
    if reason:
        return f"Cast to {reason}"
    source = input_types[0] if input_types else None
    if supported is not None and source is not None and source.dtype is not None:
        try:
            code_in = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(source.dtype))
        except (KeyError, TypeError, ValueError):
            return f"Cast from {source.dtype} is not supported"
        reason = cast_type_problem(code_in, supported)
        if reason:
            return f"Cast from {reason}"
    return None


# -- Slice ----------------------------------------------------------------------------------


def slice_index(
    node: NodeInfo,
    rank: int,
    starts: Sequence[int] | None = None,
    ends: Sequence[int] | None = None,
    axes: Sequence[int] | None = None,
    steps: Sequence[int] | None = None,
) -> tuple[slice, ...]:
    """The index a Slice node takes on an input of ``rank``: bounds from the attributes
    before opset 10, else from the inputs (read on the host; None when absent). Python
    slicing clamps out-of-range bounds exactly as ONNX specifies."""
    if node.opset < 10:
        starts, ends = node.attr("starts", []), node.attr("ends", [])
        axes, steps = node.attr("axes", None) or None, None
    st = [int(v) for v in (starts or ())]
    en = [int(v) for v in (ends or ())]
    ax = list(range(len(st))) if axes is None else [int(v) for v in axes]
    sp = [1] * len(st) if steps is None else [int(v) for v in steps]
    if not len(st) == len(en) == len(ax) == len(sp):
        raise ValueError(
            f"{node.describe()}: starts/ends/axes/steps lengths differ "
            f"({len(st)}, {len(en)}, {len(ax)}, {len(sp)})"
        )
    index: list[slice] = [slice(None)] * rank
    for a, s, e, step in zip(normalize_axes(ax, rank, node), st, en, sp, strict=True):
        if step == 0:
            raise ValueError(f"{node.describe()}: step must not be zero")
        index[a] = slice(s, e, step)
    return tuple(index)


# -- RotaryEmbedding (com.microsoft) --------------------------------------------------------


def rotary_problem(node: NodeInfo, _types: object = ()) -> str | None:
    """Why a com.microsoft RotaryEmbedding node cannot run (a kernel ``check``), or None."""
    if node.attr("is_packed_batching", 0):
        return "RotaryEmbedding is_packed_batching=1 is not supported"
    return None


@dataclass(frozen=True)
class RotaryLayout:
    """How a com.microsoft RotaryEmbedding input splits into heads: (B, N, S, D) views of a
    (B, S, N*D) input (``bnsh`` False) or the 4-D (B, N, S, D) input itself."""

    batch: int
    heads: int
    seq: int
    head_size: int
    rotary_dim: int
    bnsh: bool


def rotary_layout(node: NodeInfo, x_shape: Sequence[int], cos_shape: Sequence[int]) -> RotaryLayout:
    """The layout of a RotaryEmbedding input of ``x_shape`` with a cos cache of
    ``cos_shape`` (max positions, rotary_dim / 2); ValueError naming the node when they do
    not fit."""
    reason = rotary_problem(node)
    if reason:
        raise NotImplementedError(f"{node.describe()}: {reason}")
    desc = node.describe()
    if len(cos_shape) != 2:
        raise ValueError(f"{desc}: cos_cache must be 2-D, got {list(cos_shape)}")
    half = int(cos_shape[1])
    if len(x_shape) == 4:
        b, n, s, d = (int(v) for v in x_shape)
        bnsh = True
    elif len(x_shape) == 3:
        b, s, hidden = (int(v) for v in x_shape)
        n = int(node.attr("num_heads", 0)) or (hidden // (2 * half) if half else 0)
        if n <= 0 or hidden % n:
            raise ValueError(f"{desc}: hidden {hidden} not divisible by {n} heads")
        d, bnsh = hidden // n, False
    else:
        raise ValueError(f"{desc}: input must be 3-D or 4-D, got {list(x_shape)}")
    rot = int(node.attr("rotary_embedding_dim", 0)) or d
    if rot != 2 * half or rot > d:
        raise ValueError(f"{desc}: rotary dim {rot} vs cos cache {list(cos_shape)}")
    return RotaryLayout(b, n, s, d, rot, bnsh)


# -- GroupQueryAttention shapes -------------------------------------------------------------

#: GroupQueryAttention's inputs in order, as onnxruntime's com.microsoft schema names them.
GQA_INPUTS = (
    "query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length",
    "cos_cache", "sin_cache", "position_ids", "attention_bias", "head_sink", "k_scale",
    "v_scale", "q_norm_weight", "k_norm_weight", "query_seqlens",
)  # fmt: skip


def gqa_input_problem(node: NodeInfo, refused: Collection[str], where: str = "") -> str | None:
    """Why a GroupQueryAttention node cannot run because it feeds an input named in
    ``refused`` (the optional inputs a provider does not take), or None. ``where`` ends the
    message (" on CUDA")."""
    unknown = set(refused) - set(GQA_INPUTS)
    if unknown:
        raise ValueError(f"not GroupQueryAttention inputs: {sorted(unknown)}")
    names = node.input_names
    for i, what in enumerate(GQA_INPUTS):
        if what in refused and i < len(names) and names[i]:
            return f"GroupQueryAttention input {what!r} is not supported{where}"
    return None


@dataclass(frozen=True)
class GqaShapes:
    """A GroupQueryAttention call's geometry: batch, new tokens, query and KV heads, head
    size, whether Q, K and V come packed in ``query``, the KV cache capacity (0 without a
    past) and the rotary dimension (0 without ``do_rotary``)."""

    batch: int
    seq: int
    heads: int
    kv_heads: int
    head_size: int
    packed: bool
    capacity: int
    rotary_dim: int


class _Shaped:  # anything with a ``shape`` (numpy, CuPy), for the signature below
    shape: tuple[int, ...]


def _shape(value: _Shaped | None) -> tuple[int, ...] | None:
    return None if value is None else tuple(int(d) for d in value.shape)


def gqa_shapes(
    node: NodeInfo,
    query: _Shaped,
    key: _Shaped | None = None,
    value: _Shaped | None = None,
    past_key: _Shaped | None = None,
    past_value: _Shaped | None = None,
    seqlens_k: _Shaped | None = None,
    cos_cache: _Shaped | None = None,
    sin_cache: _Shaped | None = None,
    head_sink: _Shaped | None = None,
) -> GqaShapes:
    """Check the shapes of a GroupQueryAttention call against its attributes (num_heads,
    kv_num_heads, do_rotary) and each other; ValueError naming the node and the input at
    fault. Arguments are arrays of any kind (only ``.shape`` is read) or None when absent."""
    desc = node.describe()
    heads, kvh = int(node.attr("num_heads", 0)), int(node.attr("kv_num_heads", 0))
    if heads <= 0 or kvh <= 0 or heads % kvh:
        raise ValueError(
            f"{desc}: num_heads {heads} must be a positive multiple of kv_num_heads {kvh}"
        )
    q = _shape(query)
    if q is None or len(q) != 3:
        raise ValueError(f"{desc}: query must be (batch, seq, width), got {q}")
    b, s, width = q
    k, v = _shape(key), _shape(value)
    if k is None:
        if v is not None or width % (heads + 2 * kvh):
            raise ValueError(
                f"{desc}: packed QKV width {width} does not fit {heads}+2*{kvh} heads "
                "(or value given without key)"
            )
        d = width // (heads + 2 * kvh)
    else:
        if v is None or width % heads:
            raise ValueError(
                f"{desc}: query width {width} not divisible by {heads} heads (or value missing)"
            )
        d = width // heads
        if k != (b, s, kvh * d) or v != k:
            raise ValueError(
                f"{desc}: key/value shapes {list(k)}, {list(v or ())} != {[b, s, kvh * d]}"
            )
    capacity = _gqa_capacity(desc, (b, kvh, d), _shape(past_key), _shape(past_value))
    lens = _shape(seqlens_k)
    if lens is None:
        raise ValueError(f"{desc}: seqlens_k is required")
    if math.prod(lens) != b:
        raise ValueError(f"{desc}: seqlens_k {list(lens)} must hold one entry per batch ({b})")
    rot = _gqa_rotary_dim(node, d, _shape(cos_cache), _shape(sin_cache))
    sink = _shape(head_sink)
    if sink is not None and math.prod(sink) != heads:
        raise ValueError(f"{desc}: head_sink {list(sink)} must hold one value per head ({heads})")
    return GqaShapes(b, s, heads, kvh, d, k is None, capacity, rot)


def _gqa_capacity(
    desc: str,
    bnd: tuple[int, int, int],
    past_key: tuple[int, ...] | None,
    past_value: tuple[int, ...] | None,
) -> int:
    """Rows of the past KV cache (0 without one), checked against (batch, kv heads, size)."""
    if (past_key is None) != (past_value is None):
        raise ValueError(f"{desc}: past_key and past_value go together")
    if past_key is None or past_value is None:
        return 0
    b, kvh, d = bnd
    for name, shape in (("past_key", past_key), ("past_value", past_value)):
        if len(shape) != 4 or shape[:2] != (b, kvh) or shape[3] != d:
            raise ValueError(f"{desc}: {name} {list(shape)} does not fit [{b}, {kvh}, *, {d}]")
    if past_key != past_value:
        raise ValueError(f"{desc}: past_key {list(past_key)} and past_value differ in shape")
    return past_key[2]


def _gqa_rotary_dim(
    node: NodeInfo, head_size: int, cos: tuple[int, ...] | None, sin: tuple[int, ...] | None
) -> int:
    """The rotary dimension of a ``do_rotary=1`` node (0 otherwise), from its caches."""
    if not node.attr("do_rotary", 0):
        return 0
    desc = node.describe()
    if cos is None or sin is None:
        raise ValueError(f"{desc}: do_rotary needs cos_cache and sin_cache")
    if len(cos) != 2 or cos != sin:
        raise ValueError(f"{desc}: cos/sin caches {list(cos)}, {list(sin)} must be equal 2-D")
    rot = 2 * cos[1]
    if rot > head_size or cos[0] < 1:
        raise ValueError(
            f"{desc}: rotary dim {rot} (cos cache {list(cos)}) exceeds head size {head_size} "
            "or the cache has no positions"
        )
    return rot


# -- the runtime's own ops (domain onnx_genrt, see core.genrt_ops) --------------------------


def silu_mul_half(node: NodeInfo, gate_shape: Sequence[int]) -> int:
    """Width of each half of a one-input SiluMul (gate and up side by side on the last
    axis); ValueError naming the node unless ``split=1`` and the last axis is even."""
    width = int(gate_shape[-1]) if len(gate_shape) else 0
    if not node.attr("split", 0) or width % 2 or not len(gate_shape):
        raise ValueError(
            f"{node.describe()}: one input needs split=1 and an even last dimension, "
            f"got {list(gate_shape)}"
        )
    return width // 2


def mtp_accept_drafts(
    node: NodeInfo,
    ids_shape: Sequence[int],
    argmax_shape: Sequence[int],
    hidden_shape: Sequence[int],
) -> int:
    """The number of drafts k an MTPAccept node checks: ids, argmax and hidden must share a
    width of k + 1 (hidden is [1, k + 1, H]); ValueError naming the node otherwise."""
    k = int(ids_shape[-1]) - 1
    if int(argmax_shape[-1]) != k + 1 or len(hidden_shape) != 3 or hidden_shape[1] != k + 1:
        raise ValueError(
            f"{node.describe()}: ids {list(ids_shape)}, argmax {list(argmax_shape)} and "
            f"hidden {list(hidden_shape)} must share a width of k + 1"
        )
    return k


def shape_value(node: NodeInfo, shape: Sequence[int]) -> np.ndarray:
    """What a Shape node returns for an input of ``shape``: its dims as int64, sliced by the
    ``start`` / ``end`` attributes from opset 15 (negatives count from the end, clamped)."""
    dims = tuple(int(d) for d in shape)
    if node.opset >= 15:
        dims = dims[int(node.attr("start", 0)) : node.attr("end", None)]
    return np.array(dims, dtype=np.int64)
