"""Host-side rules of ONNX ops (shapes, supported attributes), shared by every provider."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from .genrt_ops import GENRT_OPS, projection_node
from .kernels import KernelContext, NodeInfo

#: Bit widths MatMulNBits kernels support.
NBITS = (2, 4, 8)


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
    return None


def matmul_shape(ctx: KernelContext, a: Sequence[int], b: Sequence[int]) -> tuple[int, ...]:
    """Result shape of ONNX MatMul (numpy matmul rules, 1-D operands included)."""
    a, b = tuple(a), tuple(b)
    if not a or not b:
        raise ValueError(f"{ctx.node.describe()}: MatMul operands must have rank >= 1")
    a2 = (1, *a) if len(a) == 1 else a
    b2 = (*b, 1) if len(b) == 1 else b
    if a2[-1] != b2[-2]:
        raise ValueError(f"{ctx.node.describe()}: MatMul inner dimensions differ: {a} @ {b}")
    shape = (*np.broadcast_shapes(a2[:-2], b2[:-2]), a2[-2], b2[-1])
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
