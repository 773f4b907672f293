"""CPU kernels: Attention (opset 23-25) and RotaryEmbedding (opset 23)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numba
import numpy as np
from onnx import TensorProto

from ._gqa_step import rope_row
from ._nn_common import compute_dtype, output_count, softmax_rows, wants_output
from ._registry import REGISTRY

_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)


# ----------------------------------------------------------------------------- Attention


def _split_heads(t: np.ndarray, heads: int, what: str) -> np.ndarray:
    """(B, S, H*D) -> (B, H, S, D) view."""
    b, s, hidden = t.shape
    if heads <= 0 or hidden % heads:
        raise ValueError(f"Attention: {what} hidden size {hidden} not divisible by {heads} heads")
    return t.reshape(b, s, heads, hidden // heads).transpose(0, 2, 1, 3)


def _present(ctx, index: int, past: np.ndarray | None, new: np.ndarray) -> np.ndarray:
    """past ++ new along the sequence axis, in output buffer ``index`` when it is wanted."""
    if past is None and not wants_output(ctx, index):
        return new
    if past is not None and (past.ndim != 4 or past.shape[:2] != new.shape[:2]):
        raise ValueError(f"Attention: past shape {past.shape} does not fit new {new.shape}")
    p = 0 if past is None else past.shape[2]
    b, h, s, d = new.shape
    out = ctx.out(index, (b, h, p + s, d), new.dtype)
    if p:
        out[:, :, :p] = past
    out[:, :, p:] = new
    return out


_SCORE_BUDGET = 1 << 24  # score elements per query chunk (64 MiB of float32)


@dataclass
class _Masking:
    """The masking rules of one Attention call, evaluated per (query rows, key range) tile."""

    mask: np.ndarray | None
    offset: int | np.ndarray  # absolute position of query 0 (per batch with nonpad_kv_seqlen)
    causal: bool
    left: int
    right: int
    nonpad: np.ndarray | None
    cdt: np.dtype

    def key_range(self, i0: int, i1: int, t: int) -> tuple[int, int]:
        """Keys [k0, k1) that any query in [i0, i1) may see under causal/window rules."""
        off = self.offset
        lo = int(np.min(off)) if isinstance(off, np.ndarray) else off
        hi = int(np.max(off)) if isinstance(off, np.ndarray) else off
        k1 = t
        if self.causal:
            k1 = min(k1, i1 - 1 + hi + 1)
        if self.right >= 0:
            k1 = min(k1, i1 - 1 + hi + self.right + 1)
        k0 = max(0, i0 + lo - self.left) if self.left >= 0 else 0
        k1 = max(0, k1)
        return min(k0, k1), k1

    def _allowed(self, i0: int, i1: int, k0: int, k1: int) -> np.ndarray | None:
        i = np.arange(i0, i1).reshape(-1, 1)
        j = np.arange(k0, k1).reshape(1, -1)
        off = self.offset
        pos = i + (off.reshape(-1, 1, 1, 1) if isinstance(off, np.ndarray) else off)
        rules = []
        if self.causal:
            rules.append(j <= pos)
        if self.left >= 0:
            rules.append(pos - j <= self.left)
        if self.right >= 0:
            rules.append(j - pos <= self.right)
        if self.nonpad is not None:
            rules.append(j < self.nonpad.reshape(-1, 1, 1, 1))
        if not rules:
            return None
        allowed = rules[0]
        for r in rules[1:]:
            allowed = allowed & r
        return None if allowed.all() else allowed

    def _mask_bias(self, i0: int, i1: int, k0: int, k1: int) -> np.ndarray | None:
        """attn_mask tile as additive bias (bool: 0 / -inf); keys past its end are masked."""
        m = self.mask
        if m is None:
            return None
        if m.ndim >= 2 and m.shape[-2] != 1:
            m = m[..., i0:i1, :]
        have = m.shape[-1]
        m = m[..., k0 : min(k1, have)]
        cdt = self.cdt
        bias = np.where(m, cdt.type(0), cdt.type(-np.inf)) if m.dtype == np.bool_ else m.astype(cdt)
        missing = (k1 - k0) - bias.shape[-1]
        if missing > 0:
            pad = np.full((*bias.shape[:-1], missing), -np.inf, cdt)
            bias = np.concatenate((bias, pad), axis=-1)
        return bias

    def bias(self, i0: int, i1: int, k0: int, k1: int) -> np.ndarray | None:
        """Additive bias for queries [i0, i1) x keys [k0, k1), broadcastable to scores."""
        bias = self._mask_bias(i0, i1, k0, k1)
        allowed = self._allowed(i0, i1, k0, k1)
        if allowed is not None:
            cdt = self.cdt
            rule_bias = np.where(allowed, cdt.type(0), cdt.type(-np.inf))
            bias = rule_bias if bias is None else bias + rule_bias
        return bias


def _masking(ctx, mask, sq: int, past_len: int, nonpad: np.ndarray | None, cdt) -> _Masking:
    if nonpad is not None and past_len == 0:
        offset: int | np.ndarray = nonpad.astype(np.int64).reshape(-1) - sq
    else:
        offset = past_len
    return _Masking(
        mask,
        offset,
        bool(ctx.attr("is_causal", 0)),
        int(ctx.attr("left_window_size", -1)),
        int(ctx.attr("right_window_size", -1)),
        None if nonpad is None else nonpad.astype(np.int64).reshape(-1),
        cdt,
    )


def _check_attention(node, _types) -> str | None:
    mode = int(node.attr("qk_matmul_output_mode", 0))
    if mode not in (0, 1, 2, 3):
        return f"qk_matmul_output_mode {mode} is not defined"
    return None


@REGISTRY.register("Attention", since=23, check=_check_attention)
def attention_kernel(
    ctx,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    attn_mask: np.ndarray | None = None,
    past_key: np.ndarray | None = None,
    past_value: np.ndarray | None = None,
    nonpad_kv_seqlen: np.ndarray | None = None,
) -> np.ndarray | tuple[np.ndarray, ...]:
    """Scaled dot-product attention (MHA/GQA/MQA), 3-D or 4-D, with KV cache and masks.

    GQA runs without repeating K/V: the query heads sharing a KV head are stacked along
    the row axis so each KV head is one batched GEMM. Long queries run in row chunks
    (bounded score memory), each against only the keys its causal/window rules allow.
    """
    if (past_key is None) != (past_value is None):
        raise ValueError(f"{ctx.node.describe()}: past_key and past_value go together")
    out_dtype = q.dtype
    precision = ctx.attr("softmax_precision")
    cdt = _F64 if q.dtype == _F64 or precision == TensorProto.DOUBLE else _F32
    three_d = q.ndim == 3
    if three_d:
        hq, hkv = int(ctx.attr("q_num_heads", 0)), int(ctx.attr("kv_num_heads", 0))
        q4 = _split_heads(q, hq, "Q")
        k4, v4 = _split_heads(k, hkv, "K"), _split_heads(v, hkv, "V")
    elif q.ndim == 4:
        q4, k4, v4 = q, k, v
    else:
        raise ValueError(f"{ctx.node.describe()}: Q must be 3-D or 4-D, got {q.shape}")
    b, hq, sq, d = q4.shape
    hkv = k4.shape[1]
    if hkv == 0 or hq % hkv or v4.shape[1] != hkv:
        raise ValueError(f"{ctx.node.describe()}: {hq} query heads vs {hkv} KV heads")
    groups = hq // hkv
    past_len = 0 if past_key is None else past_key.shape[2]
    present_k = _present(ctx, 1, past_key, k4)
    present_v = _present(ctx, 2, past_value, v4)
    t_full = present_k.shape[2]
    dv = present_v.shape[3]

    want_qk = wants_output(ctx, 3)
    t = t_full
    if nonpad_kv_seqlen is not None and not want_qk and nonpad_kv_seqlen.size:
        t = max(0, min(t_full, int(nonpad_kv_seqlen.max())))  # skip all-padding keys
    kc = present_k[:, :, :t].astype(cdt, copy=False)
    vc = present_v[:, :, :t].astype(cdt, copy=False)
    masking = _masking(ctx, attn_mask, sq, past_len, nonpad_kv_seqlen, cdt)

    scale = ctx.attr("scale")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    qs = np.empty((b, hq, sq, d), cdt)
    qs[...] = q4
    qs *= cdt.type(scale)
    qs5 = qs.reshape(b, hkv, groups, sq, d)  # query head h = kv_head * groups + g

    y_shape = (b, sq, hq * dv) if three_d else (b, hq, sq, dv)
    y_out = ctx.out(0, y_shape, out_dtype)
    direct = not three_d and out_dtype == cdt and y_out.flags.c_contiguous
    y5 = (
        y_out.reshape(b, hkv, groups, sq, dv) if direct else np.empty((b, hkv, groups, sq, dv), cdt)
    )
    chunk = sq if want_qk else max(1, min(sq, _SCORE_BUDGET // max(1, b * hq * t)))
    qk = None
    for i0 in range(0, sq, chunk):
        i1 = min(sq, i0 + chunk)
        k0, k1 = (0, t) if want_qk else masking.key_range(i0, i1, t)
        qc = qs5 if i1 - i0 == sq else np.ascontiguousarray(qs5[:, :, :, i0:i1])
        probs, qk = _scores(ctx, qc, kc[:, :, k0:k1], masking, (i0, i1, k0, k1), want_qk, out_dtype)
        yc = np.matmul(probs, vc[:, :, k0:k1])
        y5[:, :, :, i0:i1] = yc.reshape(b, hkv, groups, i1 - i0, dv)
    if not direct:
        y4 = y5.reshape(b, hq, sq, dv)
        y_out[...] = y4.transpose(0, 2, 1, 3).reshape(y_shape) if three_d else y4
    n = output_count(ctx)
    if n == 1:
        return y_out
    if qk is None:  # declared but unnamed optional output
        qk = np.zeros((b, hq, sq, t_full), out_dtype)
    return (y_out, present_k, present_v, qk)[:n]


def _scores(
    ctx,
    qc: np.ndarray,
    kc: np.ndarray,
    masking: _Masking,
    tile: tuple[int, int, int, int],
    want_qk: bool,
    out_dtype: np.dtype,
) -> tuple[np.ndarray, np.ndarray | None]:
    """Softmax probabilities (B, Hkv, G*rows, keys) of one query tile, and qk output if asked."""
    b, hkv, groups, rows, d = qc.shape
    i0, i1, k0, k1 = tile
    tk = k1 - k0
    scores = np.matmul(qc.reshape(b, hkv, groups * rows, d), kc.swapaxes(-1, -2))
    s4 = scores.reshape(b, hkv * groups, rows, tk)  # same memory: rows stack (group, query)
    mode = int(ctx.attr("qk_matmul_output_mode", 0)) if want_qk else -1
    qk = s4.astype(out_dtype) if mode == 0 else None
    softcap = float(ctx.attr("softcap", 0.0))
    if softcap > 0.0:
        s4 *= masking.cdt.type(1.0 / softcap)
        np.tanh(s4, out=s4)
        s4 *= masking.cdt.type(softcap)
    if mode == 1:
        qk = s4.astype(out_dtype)
    bias = masking.bias(i0, i1, k0, k1)
    if bias is not None:
        s4 += bias
    if mode == 2:
        qk = s4.astype(out_dtype)
    flat = scores.reshape(b * hkv * groups * rows, tk)
    softmax_rows(flat, flat, True)
    if mode == 3:
        qk = s4.astype(out_dtype)
    return scores, qk


# ----------------------------------------------------------------------------- RotaryEmbedding


@numba.njit(cache=True)
def _rope(x, cos, sin, out, rot, interleaved):
    """Rotate the first ``rot`` features of x[b, h, s, :]; cos/sin are (B, S, rot/2)."""
    nb, nh, ns, _ = x.shape
    for bi in range(nb):
        for hi in range(nh):
            for si in range(ns):
                rope_row(x[bi, hi, si], cos[bi, si], sin[bi, si], out[bi, hi, si], rot, interleaved)


def _as_bhsd(t: np.ndarray, heads: int) -> np.ndarray:
    """A (B, H, S, D) view of a 4-D (B, H, S, D) or 3-D (B, S, H*D) tensor."""
    if t.ndim == 4:
        return t
    return _split_heads(t, heads, "input")


@REGISTRY.register("RotaryEmbedding", since=23)
def rotary_embedding_kernel(
    ctx,
    x: np.ndarray,
    cos_cache: np.ndarray,
    sin_cache: np.ndarray,
    position_ids: np.ndarray | None = None,
) -> np.ndarray:
    """RotaryEmbedding-23: half-split or interleaved rotation, partial rotary dim."""
    if x.ndim not in (3, 4):
        raise ValueError(f"{ctx.node.describe()}: input must be 3-D or 4-D, got {x.shape}")
    heads = int(ctx.attr("num_heads", 0))
    x4 = _as_bhsd(x, heads)
    b, _, s, d = x4.shape
    rot = int(ctx.attr("rotary_embedding_dim", 0)) or d
    if rot > d or rot % 2:
        raise ValueError(f"{ctx.node.describe()}: rotary_embedding_dim {rot} invalid for head {d}")
    cdt = compute_dtype(x.dtype)
    if position_ids is not None:
        pos = position_ids.astype(np.intp, copy=False)
        cos, sin = cos_cache[pos], sin_cache[pos]
    else:
        cos, sin = cos_cache, sin_cache
    half = rot // 2
    if cos.shape[-1] != half or sin.shape[-1] != half:
        raise ValueError(f"{ctx.node.describe()}: cos/sin last dim must be {half}, got {cos.shape}")
    cos = np.ascontiguousarray(np.broadcast_to(cos, (b, s, half)), dtype=cdt)
    sin = np.ascontiguousarray(np.broadcast_to(sin, (b, s, half)), dtype=cdt)
    out = ctx.out(0, x.shape, x.dtype)
    out4 = _as_bhsd(out, heads)
    if x.dtype == cdt:
        _rope(x4, cos, sin, out4, rot, bool(ctx.attr("interleaved", 0)))
    else:
        tmp = np.empty(x4.shape, cdt)
        _rope(x4.astype(cdt), cos, sin, tmp, rot, bool(ctx.attr("interleaved", 0)))
        out4[...] = tmp
    return out
