"""CUDA LLM kernels on a real GPU: GroupQueryAttention, skip/RMS norms, RotaryEmbedding,
MatMulNBits, GatherBlockQuantized, ReduceSum, Shape, Constant, and a whole builder model.

Every test is marked ``gpu``. References are the CPU provider's kernels when they import
(they need Numba), else the numpy float64 versions below (which match them; see
``_check_numpy_references``). Outputs are written into NaN-poisoned planned buffers.

The whole-model test reads ``.gpu_fixtures/`` at the repository root (git-ignored), built on
a machine with onnxruntime-genai by ``python tests/providers/cuda/test_cuda_llm_kernels.py --build``:
two tiny builder models (fp32 and int4) and the CPU provider's logits and greedy tokens.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto

from onnx_genrt.core.graph_slots import DeviceGraphSlot
from onnx_genrt.core.kernels import MS_DOMAIN, KernelContext, NodeInfo

pytestmark = pytest.mark.gpu

PRIMARY, VERIFY, DRAFT = DeviceGraphSlot.PRIMARY, DeviceGraphSlot.VERIFY, DeviceGraphSlot.DRAFT
FLOATS = [np.float32, np.float16]
BF16 = np.dtype(ml_dtypes.bfloat16)
#: The kernels that take bfloat16 as well (GQA, rotary, ArgMax, the reductions).
FLOATS_BF16 = [*FLOATS, BF16]
ROOT = Path(__file__).resolve().parents[3]
FIXTURES = ROOT / ".gpu_fixtures"
FIXTURE_FILES = ("genai_config.json", "model.onnx", "model.onnx.data", "tokenizer.json")
FIXTURE_FILES += ("tokenizer_config.json",)


# ----------------------------------------------------------------------------- helpers


def node(op, inputs, n_out=1, attrs=None, opset=21, domain="", outputs=None):
    """NodeInfo with input names (empty for None inputs) and ``n_out`` named outputs."""
    names = tuple("" if x is None else f"in{i}" for i, x in enumerate(inputs))
    outs = tuple(outputs) if outputs is not None else tuple(f"out{i}" for i in range(n_out))
    return NodeInfo(op, f"test_{op}", domain, opset, dict(attrs or {}), names, outs)


def _poison(cp, shape, dtype):
    dt = np.dtype(dtype)
    buf = cp.empty(shape, dt)
    if dt.kind == "f" or dt == BF16:
        buf.fill(np.nan)
    else:
        buf.fill(np.iinfo(dt).max - 7)
    return buf


def launch(prov, info, dev_inputs, planned=()):
    kdef = prov.get_kernel(info.domain, info.op_type, info.opset)
    assert kdef is not None, f"no CUDA kernel for {info.domain}::{info.op_type}"
    res = prov.launch(kdef, KernelContext(info, prov, list(planned)), list(dev_inputs))
    return list(res) if isinstance(res, tuple | list) else [res]


def dev(prov, x):
    return None if x is None else prov.as_array(np.asarray(x, order="C"))  # 0-d stays 0-d


def run_gpu(cp, prov, info, inputs, out_specs):
    """Run on device copies into poisoned planned buffers; host results (None: unplanned)."""
    d_in = [dev(prov, x) for x in inputs]
    with prov.stream:
        bufs = [None if s is None else _poison(cp, *s) for s in out_specs]
    res = launch(prov, info, d_in, bufs)
    for i, buf in enumerate(bufs):
        if buf is not None:
            assert res[i] is buf, f"{info.op_type}: output {i} not written into its planned buffer"
    return [None if r is None else prov.to_numpy(r).copy() for r in res], d_in, res


def cpu_registry():
    """The CPU provider's kernel registry, or None when it does not import (no Numba)."""
    try:
        from onnx_genrt.providers.cpu.kernels import REGISTRY
    except Exception:
        return None
    return REGISTRY


def cpu_run(info, inputs):
    reg = cpu_registry()
    kdef = reg.lookup(info.domain, info.op_type, info.opset)
    assert kdef is not None
    res = kdef.fn(KernelContext(info, None, []), *[None if x is None else x for x in inputs])
    return [np.asarray(r) for r in (res if isinstance(res, tuple | list) else (res,))]


def reference(info, inputs, numpy_ref):
    """CPU kernel results when the CPU provider imports, else ``numpy_ref(*inputs)``.
    MatMulNBits is taken at accuracy_level 0: the CPU provider quantizes activations to
    int8 at level 4 as onnxruntime's CPU provider does, while the CUDA provider (like
    onnxruntime's) keeps float activations at every level."""
    inputs = [None if x is None else np.array(x, copy=True) for x in inputs]
    if info.op_type == "MatMulNBits":
        info = dataclasses.replace(info, attrs={**info.attrs, "accuracy_level": 0})
    if cpu_registry() is not None:
        return cpu_run(info, inputs)
    res = numpy_ref(*inputs)
    return list(res) if isinstance(res, tuple | list) else [res]


def close(got, want, dtype, scale=1.0, what=""):
    dt = np.dtype(dtype)
    tol = 2e-3 if dt == np.float16 else 2e-5
    if dt == BF16:  # 8 significant bits
        tol = 2e-2
    got64, want64 = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got64.shape == want64.shape, (what, got64.shape, want64.shape)
    assert np.isfinite(got64).all() or not np.isfinite(want64).all(), f"{what}: NaN/inf written"
    np.testing.assert_allclose(got64, want64, rtol=tol, atol=tol * scale, err_msg=what)


# ----------------------------------------------------------------------------- numpy references


def rope_np(x, pos, cos, sin, interleaved):
    """Rotate (..., D) rows at positions ``pos`` (same leading shape); float64."""
    half = cos.shape[1]
    rot = 2 * half
    y = np.array(x, np.float64, copy=True)
    c = cos[pos].astype(np.float64)
    s = sin[pos].astype(np.float64)
    if interleaved:
        x1, x2 = x[..., 0:rot:2].astype(np.float64), x[..., 1:rot:2].astype(np.float64)
        y[..., 0:rot:2] = c * x1 - s * x2
        y[..., 1:rot:2] = s * x1 + c * x2
    else:
        x1, x2 = x[..., :half].astype(np.float64), x[..., half:rot].astype(np.float64)
        y[..., :half] = c * x1 - s * x2
        y[..., half:rot] = s * x1 + c * x2
    return y


def gqa_np(attrs):
    """numpy GroupQueryAttention (shared-buffer mode) bound to the node attributes."""

    def run(
        query, key, value, pk, pv, seqlens, total, cos, sin, pos_ids=None, bias=None, sink=None
    ):
        h, kvh = attrs["num_heads"], attrs["kv_num_heads"]
        b, s, width = query.shape
        if key is None:
            d = width // (h + 2 * kvh)
            qkv = query.reshape(b, s, h + 2 * kvh, d)
            q, k, v = qkv[:, :, :h], qkv[:, :, h : h + kvh], qkv[:, :, h + kvh :]
        else:
            d = width // h
            q, k, v = (t.reshape(b, s, -1, d) for t in (query, key, value))
        scale = attrs.get("scale") or 1.0 / math.sqrt(d)
        softcap, window = attrs.get("softcap", 0.0), attrs.get("local_window_size", -1)
        inter = bool(attrs.get("rotary_interleaved", 0))
        y = np.zeros((b, s, h, d), np.float64)
        for bi in range(b):
            t = int(seqlens[bi]) + 1
            n_new = min(t, s)
            past = t - n_new
            pos = past + np.arange(s)
            qb, kb = q[bi].astype(np.float64), k[bi]
            if attrs.get("do_rotary"):
                qb = rope_np(q[bi], pos[:, None].repeat(h, 1), cos, sin, inter)
                kb = rope_np(k[bi], pos[:, None].repeat(kvh, 1), cos, sin, inter)
            pk[bi, :, past:t] = kb[:n_new].transpose(1, 0, 2).astype(pk.dtype)
            pv[bi, :, past:t] = v[bi, :n_new].transpose(1, 0, 2).astype(pv.dtype)
            keys, vals = pk[bi, :, :t].astype(np.float64), pv[bi, :, :t].astype(np.float64)
            for hi in range(h):
                g = hi // (h // kvh)
                sc = (qb[:, hi] * scale) @ keys[g].T  # (s, t)
                if softcap > 0:
                    sc = softcap * np.tanh(sc / softcap)
                j = np.arange(t)[None, :]
                p = pos[:, None]
                ok = j <= np.minimum(p, t - 1)
                if window > 0:
                    ok &= j >= p - window + 1
                sc = np.where(ok, sc, -np.inf)
                sk = None
                if sink is not None:
                    sk = float(sink[hi])
                elif attrs.get("smooth_softmax", -1) == 1:
                    sk = 0.0
                mx = sc.max(axis=1, keepdims=True)
                if sk is not None:
                    mx = np.maximum(mx, sk)
                e = np.exp(sc - mx)
                den = e.sum(axis=1, keepdims=True) + (np.exp(sk - mx) if sk is not None else 0)
                y[bi, :, hi] = (e / den) @ vals[g]
        return y.reshape(b, s, h * d).astype(query.dtype), pk, pv

    return run


def dequant_np(b, scales, zp, k, n, bits, block):
    nb = -(-k // block)
    per = 8 // bits
    packed = b.reshape(n, -1)
    shifts = np.arange(per) * bits
    q = ((packed[..., None] >> shifts) & ((1 << bits) - 1)).reshape(n, -1)[:, : nb * block]
    if zp is None:
        z = np.full((n, nb), 1 << (bits - 1), np.float64)
    elif zp.dtype == np.uint8:
        zz = ((zp.reshape(n, -1)[..., None] >> shifts) & ((1 << bits) - 1)).reshape(n, -1)
        z = zz[:, :nb].astype(np.float64)
    else:
        z = zp.reshape(n, nb).astype(np.float64)
    s = scales.reshape(n, nb).astype(np.float64)
    w = (q.astype(np.float64) - np.repeat(z, block, 1)) * np.repeat(s, block, 1)
    return w[:, :k]


def nbits_np(attrs):
    def run(a, b, scales, zp=None, g_idx=None, bias=None):
        k, n = attrs["K"], attrs["N"]
        w = dequant_np(b, scales, zp, k, n, attrs["bits"], attrs["block_size"])
        y = a.astype(np.float64).reshape(-1, k) @ w.T
        if bias is not None:
            y += bias.astype(np.float64)
        return y.reshape(*a.shape[:-1], n).astype(a.dtype)

    return run


def skip_norm_np(eps, rms, n_out):
    def run(x, skip, gamma, *rest):
        beta = None if rms else (rest[0] if rest else None)
        bias = rest[0] if rms and rest else (rest[1] if len(rest) > 1 else None)
        h = x.astype(np.float64) + skip.astype(np.float64)
        if bias is not None:
            h = h + bias.astype(np.float64)
        mean = np.zeros(h.shape[:-1] + (1,)) if rms else h.mean(-1, keepdims=True)
        var = (h * h).mean(-1, keepdims=True) if rms else ((h - mean) ** 2).mean(-1, keepdims=True)
        inv = 1.0 / np.sqrt(var + eps)
        y = (h - mean) * inv * gamma.astype(np.float64)
        if beta is not None:
            y = y + beta.astype(np.float64)
        outs = [
            y.astype(x.dtype),
            mean.astype(np.float32),
            inv.astype(np.float32),
            h.astype(x.dtype),
        ]
        return outs[:n_out]

    return run


def gbq_np(bits, block):
    def run(data, idx, scales, zp=None):
        rows = data.shape[0]
        per = 8 // bits
        shifts = np.arange(per) * bits
        q = ((data[..., None] >> shifts) & ((1 << bits) - 1)).reshape(rows, -1).astype(np.float64)
        nb = scales.shape[1]
        if zp is None:
            z = np.full((rows, nb), 1 << (bits - 1), np.float64)
        else:
            z = ((zp[..., None] >> shifts) & ((1 << bits) - 1)).reshape(rows, -1)[:, :nb]
        cols = q.shape[1]
        w = (q - np.repeat(z, block, 1)[:, :cols]) * np.repeat(scales.astype(np.float64), block, 1)[
            :, :cols
        ]
        ii = idx.astype(np.int64)
        ii = np.where(ii < 0, ii + rows, ii)
        ok = (ii >= 0) & (ii < rows)
        res = w[np.where(ok, ii, 0)] * ok[..., None]
        return res.astype(scales.dtype)

    return run


def rotary_ms_np(attrs):
    def run(x, pos_ids, cos, sin):
        inter = bool(attrs.get("interleaved", 0))
        if x.ndim == 4:
            b, n, s, d = x.shape
            pos = pos_ids.reshape(-1)[0] + np.arange(s) if pos_ids.size == 1 else pos_ids
            pos = np.broadcast_to(pos, (b, s))
            return rope_np(x, np.broadcast_to(pos[:, None, :], (b, n, s)), cos, sin, inter).astype(
                x.dtype
            )
        b, s, hidden = x.shape
        n = attrs["num_heads"]
        x4 = x.reshape(b, s, n, hidden // n)
        pos = pos_ids.reshape(-1)[0] + np.arange(s) if pos_ids.size == 1 else pos_ids
        pos = np.broadcast_to(pos, (b, s))
        y = rope_np(x4, np.broadcast_to(pos[:, :, None], (b, s, n)), cos, sin, inter)
        return y.reshape(x.shape).astype(x.dtype)

    return run


def rope_cache(max_pos, rot, dtype, base=10000.0):
    inv = 1.0 / base ** (np.arange(0, rot, 2) / rot)
    ang = np.arange(max_pos)[:, None] * inv[None, :]
    return np.cos(ang).astype(dtype), np.sin(ang).astype(dtype)


# ----------------------------------------------------------------------------- GroupQueryAttention

GQA_CASES = {
    "decode_packed_rotary": dict(b=2, s=1, h=8, kvh=2, d=64, cap=300, totals=[1, 257]),
    "verify_separate_interleaved": dict(
        b=1, s=5, h=4, kvh=4, d=32, cap=64, totals=[40], packed=False, interleaved=True
    ),
    "prefill_softcap_norotary": dict(
        b=2, s=37, h=6, kvh=2, d=128, cap=100, totals=[37, 90], rotary=False, softcap=30.0
    ),
    "window_long_cache": dict(b=1, s=3, h=4, kvh=1, d=16, cap=2000, totals=[1500], window=100),
    "head_sink_scale": dict(b=1, s=1, h=2, kvh=1, d=64, cap=50, totals=[20], sink=True, scale=0.2),
    "smooth_partial_rotary": dict(
        b=1, s=4, h=4, kvh=2, d=96, cap=64, totals=[10], smooth=True, rot=64
    ),
    # 16 new tokens: the most gqa_attn appends itself; several splits merged in-kernel.
    "verify16_softcap_window_splits": dict(
        b=2, s=16, h=8, kvh=2, d=128, cap=600, totals=[16, 530], softcap=20.0, window=300
    ),
    # 17 new tokens: gqa_append first, then split keys merged with a head sink.
    "prefill17_sink_splits": dict(
        b=1, s=17, h=4, kvh=2, d=64, cap=400, totals=[300], sink=True, packed=False
    ),
    # Enough rows for one split per row: every block writes its output directly.
    "prefill200_one_split": dict(b=1, s=200, h=14, kvh=2, d=64, cap=256, totals=[256]),
    # Head size 256 (four feature chunks per lane), batch rows of very different lengths.
    "decode_d256_batch3": dict(b=3, s=1, h=4, kvh=1, d=256, cap=1100, totals=[1, 700, 1100]),
}


def gqa_inputs(rng, c, dtype):
    b, s, h, kvh, d, cap = c["b"], c["s"], c["h"], c["kvh"], c["d"], c["cap"]
    packed = c.get("packed", True)
    if packed:
        q = rng.standard_normal((b, s, (h + 2 * kvh) * d)).astype(dtype)
        k = v = None
    else:
        q = rng.standard_normal((b, s, h * d)).astype(dtype)
        k = rng.standard_normal((b, s, kvh * d)).astype(dtype)
        v = rng.standard_normal((b, s, kvh * d)).astype(dtype)
    pk = rng.standard_normal((b, kvh, cap, d)).astype(dtype)
    pv = rng.standard_normal((b, kvh, cap, d)).astype(dtype)
    seqlens = np.array(c["totals"], np.int32) - 1
    total = np.array(max(c["totals"]), np.int32)
    rotary = c.get("rotary", True)
    cos, sin = rope_cache(cap, c.get("rot", d), dtype) if rotary else (None, None)
    sink = rng.standard_normal(h).astype(dtype) if c.get("sink") else None
    attrs = {"num_heads": h, "kv_num_heads": kvh, "do_rotary": int(rotary)}
    attrs["rotary_interleaved"] = int(c.get("interleaved", False))
    for key, attr in (("softcap", "softcap"), ("window", "local_window_size"), ("scale", "scale")):
        if key in c:
            attrs[attr] = c[key]
    if c.get("smooth"):
        attrs["smooth_softmax"] = 1
    inputs = [q, k, v, pk, pv, seqlens, total, cos, sin, None, None, sink]
    return inputs, attrs


@pytest.mark.parametrize("dtype", FLOATS_BF16)
@pytest.mark.parametrize("case", sorted(GQA_CASES))
def test_group_query_attention(cp, prov, rng, case, dtype):
    c = GQA_CASES[case]
    inputs, attrs = gqa_inputs(rng, c, dtype)
    if inputs[-1] is None:
        inputs = inputs[:9]
    info = node("GroupQueryAttention", inputs, 3, attrs, opset=1, domain=MS_DOMAIN)
    want = reference(info, inputs, gqa_np(attrs))
    b, s, h, d = c["b"], c["s"], c["h"], c["d"]
    got, d_in, res = run_gpu(cp, prov, info, inputs, [((b, s, h * d), dtype), None, None])
    assert res[1] is d_in[3] and res[2] is d_in[4], "present must be the past buffer itself"
    close(got[0], want[0], dtype, what="output")
    # The whole cache: new rows written at [past, total), everything else untouched.
    close(got[1], want[1], dtype, what="present_key")
    close(got[2], want[2], dtype, what="present_value")
    for bi, t in enumerate(c["totals"]):
        past = t - min(t, s)
        np.testing.assert_array_equal(got[1][bi, :, :past], inputs[3][bi, :, :past])
        np.testing.assert_array_equal(got[2][bi, :, t:], inputs[4][bi, :, t:])


def test_group_query_attention_marks_a_device_length_past_the_cache(cp, prov, rng):
    """total_sequence_length on the device (unknown to the host): a length past the cache
    gives NaN rows for that sequence (caught by the engine's non-finite probe), never a
    clamped attention and no host sync; the other sequence is unaffected."""
    c = dict(b=2, s=1, h=4, kvh=2, d=32, cap=16, totals=[4, 17])
    inputs, attrs = gqa_inputs(rng, c, np.float32)
    info = node("GroupQueryAttention", inputs[:9], 3, attrs, opset=1, domain=MS_DOMAIN)
    d_in = [dev(prov, x) for x in inputs[:9]]
    with prov.stream:  # a plain device copy: no host shadow of the total length
        d_in[6] = cp.asarray(inputs[6])
    out = prov.to_numpy(launch(prov, info, d_in)[0])
    assert np.isnan(out[1]).all()
    assert np.isfinite(out[0]).all()


def test_group_query_attention_claims_concat_mode(prov):
    """No past: a present buffer is made (its results: tests/ops/test_contrib.py on cuda)."""
    ok, reason = prov.supports(
        NodeInfo(
            "GroupQueryAttention",
            "gqa",
            MS_DOMAIN,
            1,
            {"num_heads": 2, "kv_num_heads": 1},
            ("q", "", "", "", "", "seqlens", "total"),
            ("y", "pk", "pv"),
        )
    )
    assert ok, reason


class _DecodeStep:
    """mask -> ReduceSum -> Sub 1 -> Cast int32 -> GroupQueryAttention, on fixed buffers."""

    def __init__(self, cp, prov, rng, s, dtype=np.float16, h=14, kvh=2, d=64, cap=4096):
        self.cp, self.prov, self.rng, self.s, self.dtype = cp, prov, rng, s, dtype
        self.h, self.kvh, self.d, self.cap = h, kvh, d, cap
        self.host_k = rng.standard_normal((1, kvh, cap, d)).astype(dtype)
        self.host_v = rng.standard_normal((1, kvh, cap, d)).astype(dtype)
        self.cos, self.sin = rope_cache(cap, d, dtype)
        with prov.stream:
            self.mask = cp.zeros((1, cap), np.int64)
            self.q = cp.zeros((1, s, (h + 2 * kvh) * d), dtype)
            self.red, self.sub = cp.empty((1,), np.int64), cp.empty((1,), np.int64)
            self.seqlens = cp.empty((1,), np.int32)
            self.y = cp.empty((1, s, h * d), dtype)
        self.pk, self.pv = dev(prov, self.host_k), dev(prov, self.host_v)
        one = dev(prov, np.array([1], np.int64))
        total = dev(prov, np.array(cap, np.int32))
        self.attrs = {"num_heads": h, "kv_num_heads": kvh, "do_rotary": 1, "scale": 0.125}
        gqa_in = [self.q, None, None, self.pk, self.pv, self.seqlens, total]
        gqa_in += [dev(prov, self.cos), dev(prov, self.sin)]
        self.steps = [
            (
                node("ReduceSum", [1, 1], attrs={"keepdims": 0}, opset=13),
                [self.mask, one],
                self.red,
            ),
            (node("Sub", [1, 1], opset=14), [self.red, one], self.sub),
            (
                node("Cast", [1], attrs={"to": TensorProto.INT32}, opset=19),
                [self.sub],
                self.seqlens,
            ),
            (node("GroupQueryAttention", gqa_in, 3, self.attrs, 1, MS_DOMAIN), gqa_in, self.y),
        ]

    def run(self):
        for info, ins, buf in self.steps:
            res = launch(self.prov, info, ins, [buf])
            assert res[0] is buf

    def write(self, total):
        """Mask for ``total`` tokens and a random query, written in place; returns the query."""
        mask = np.zeros((1, self.cap), np.int64)
        mask[0, :total] = 1
        q = self.rng.standard_normal(self.q.shape).astype(self.dtype)
        self.mask.set(mask, stream=self.prov.stream)
        self.q.set(q, stream=self.prov.stream)
        return q

    def check(self, q, total):
        """Compare with the reference on the device's own cache (rounding kept per step)."""
        prev_k, prev_v = self.host_k, self.host_v
        inputs = [q, None, None, prev_k.copy(), prev_v.copy(), np.array([total - 1], np.int32)]
        inputs += [np.array(self.cap, np.int32), self.cos, self.sin]
        info = node("GroupQueryAttention", inputs, 3, self.attrs, opset=1, domain=MS_DOMAIN)
        y, pk, pv = reference(info, inputs, gqa_np(self.attrs))
        close(self.prov.to_numpy(self.y), y, self.dtype, what=f"output at total {total}")
        rows = slice(total - self.s, total)
        for name, buf, want, prev in (("key", self.pk, pk, prev_k), ("value", self.pv, pv, prev_v)):
            cache = self.prov.to_numpy(buf).copy()
            close(cache[:, :, rows], want[:, :, rows], self.dtype, what=f"{name} rows at {total}")
            np.testing.assert_array_equal(cache[:, :, : rows.start], prev[:, :, : rows.start])
            np.testing.assert_array_equal(cache[:, :, total:], prev[:, :, total:])
            if name == "key":
                self.host_k = cache
            else:
                self.host_v = cache


@pytest.mark.parametrize(
    "cluster",
    ["grouped", True, False, "capacity"],
    ids=["grouped-cluster", "cluster", "counter", "counter-by-capacity"],
)
@pytest.mark.parametrize("dtype", FLOATS_BF16)
@pytest.mark.parametrize("s", [1, 4, 5])
def test_gqa_one_graph_follows_the_device_length(cp, fresh, rng, monkeypatch, s, dtype, cluster):
    """One captured graph, replayed while the mask (hence seqlens_k) grows in device memory.

    Qwen2.5-0.5B heads (14 q, 2 kv, 64 wide) on a 4096-position cache: one split with keys
    for short lengths, then more and more splits, merged through the thread-block cluster
    (sm_90+: one cluster per query head, or with ``attention_grouped_cluster``, the provider's
    default, the grouped kernel's cluster launch) or by the last split to
    finish (a counter; the path of older GPUs, and of caches longer than the provider's
    ``attention_cluster_max_keys`` with ``attention_grouped_decode`` off: the grouped kernel
    has its own tests, test_cuda_gqa_decode.py)."""
    from onnx_genrt.providers.cuda.kernels import _gqa_decode, contrib_attention
    from onnx_genrt.providers.cuda.provider import CUDAProvider

    prov = fresh
    if cluster == "capacity":
        prov = CUDAProvider(attention_cluster_max_keys=4095, attention_grouped_decode=False)
    elif cluster == "grouped":
        prov = CUDAProvider(attention_grouped_cluster=True)
    elif cluster is True:  # the per-head cluster kernel
        prov = CUDAProvider(attention_grouped_cluster=False)
    elif cluster is False:
        monkeypatch.setattr(contrib_attention, "CLUSTER", False)
    launched: list[str] = []
    for module in (contrib_attention, _gqa_decode):

        def recording(source, name, *args, compile_kernel=module.function, **kwargs):
            launched.append(name)
            return compile_kernel(source, name, *args, **kwargs)

        monkeypatch.setattr(module, "function", recording)
    step = _DecodeStep(cp, prov, rng, s, dtype=dtype)
    q = step.write(s)
    step.run()  # eager: compiles, sizes the scratch and the counters
    step.check(q, s)
    want = {"grouped": "gqa_decode_cluster<", True: "gqa_attn_cluster<"}.get(cluster, "gqa_attn<")
    if cluster in ("grouped", True) and contrib_attention._cc_major() < 9:
        want = "gqa_attn<"
    attention = [name for name in launched if name.startswith("gqa_")]
    assert attention and all(name.startswith(want) for name in attention), launched
    prov.begin_capture(PRIMARY)
    step.run()
    prov.end_capture(PRIMARY)
    for total in (s + 1, 17, 64, 65, 200, 255, 256, 1000, 1024, 2500, 4000, 4096):
        q = step.write(total)
        prov.replay(PRIMARY)
        step.check(q, total)
    if prov is not fresh:
        prov.reset_graph(PRIMARY)


# ----------------------------------------------------------------------------- norms and rotary


@pytest.mark.parametrize("dtype", FLOATS_BF16)
@pytest.mark.parametrize(
    "op,outs,with_bias,skip_shape",
    [
        ("SkipSimplifiedLayerNormalization", ["y", "", "", "sum"], False, (2, 7, 896)),
        ("SkipSimplifiedLayerNormalization", ["y", "mean", "inv", "sum"], True, (7, 896)),
        ("SkipSimplifiedLayerNormalization", ["y"], False, (2, 7, 896)),
        ("SkipLayerNormalization", ["y", "mean", "inv", "sum"], True, (2, 7, 896)),
    ],
)
def test_skip_norms(cp, prov, rng, op, outs, with_bias, skip_shape, dtype):
    cols = skip_shape[-1]
    x = (rng.standard_normal((2, 7, cols)) * 2).astype(dtype)
    skip = rng.standard_normal(skip_shape).astype(dtype)
    gamma = rng.uniform(0.5, 1.5, cols).astype(dtype)
    rms = op.startswith("SkipSimplified")
    extra = [] if rms else [rng.standard_normal(cols).astype(dtype)]
    if with_bias:
        extra.append(rng.standard_normal(cols).astype(dtype))
    inputs = [x, skip, gamma, *extra]
    info = node(op, inputs, attrs={"epsilon": 1e-6}, opset=1, domain=MS_DOMAIN, outputs=outs)
    want = reference(info, inputs, skip_norm_np(1e-6, rms, len(outs)))
    stat = ((2, 7, 1), np.float32)
    specs = [(x.shape, dtype), stat, stat, (x.shape, dtype)][: len(outs)]
    specs = [sp if name else None for sp, name in zip(specs, outs, strict=True)]
    got, _, _ = run_gpu(cp, prov, info, inputs, specs)
    close(got[0], want[0], dtype, scale=4, what="y")
    for i, name in enumerate(outs[1:], 1):
        if name:
            close(got[i], want[i], np.float32 if i < 3 else dtype, scale=4, what=name)


@pytest.mark.parametrize("dtype", FLOATS_BF16)
def test_simplified_layer_norm_ms_domain(cp, prov, rng, dtype):
    x = rng.standard_normal((3, 64)).astype(dtype)
    g = rng.uniform(0.5, 1.5, 64).astype(dtype)
    xd = x.astype(np.float64)
    want = xd / np.sqrt((xd * xd).mean(-1, keepdims=True) + 1e-6) * g
    info = node("SimplifiedLayerNormalization", [x, g], 1, {"epsilon": 1e-6}, 1, MS_DOMAIN)
    got, _, _ = run_gpu(cp, prov, info, [x, g], [(x.shape, dtype)])
    close(got[0], want, dtype, scale=2)


@pytest.mark.parametrize("dtype", FLOATS_BF16)
@pytest.mark.parametrize("layout", ["bsh", "bnsh"])
@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize("single_pos", [False, True])
def test_rotary_embedding_ms(cp, prov, rng, layout, interleaved, single_pos, dtype):
    b, n, s, d = 2, 3, 5, 32
    x = rng.standard_normal((b, s, n * d) if layout == "bsh" else (b, n, s, d)).astype(dtype)
    cos, sin = rope_cache(64, 24, dtype)  # partial rotary: 24 of 32
    pos = np.array([7], np.int64) if single_pos else rng.integers(0, 64, (b, s)).astype(np.int64)
    attrs = {"interleaved": interleaved, "rotary_embedding_dim": 24, "num_heads": n}
    inputs = [x, pos, cos, sin]
    info = node("RotaryEmbedding", inputs, attrs=attrs, opset=1, domain=MS_DOMAIN)
    want = reference(info, inputs, rotary_ms_np(attrs))
    got, _, _ = run_gpu(cp, prov, info, inputs, [(x.shape, dtype)])
    close(got[0], want[0], dtype)


# ----------------------------------------------------------------------------- MatMulNBits


def nbits_case(rng, m, k, n, block, bits, dtype, zp_kind, with_bias):
    nb = -(-k // block)
    blob = block * bits // 8
    b = rng.integers(0, 256, (n, nb, blob)).astype(np.uint8)
    scales = (rng.uniform(0.5, 1.5, (n, nb)) / (math.sqrt(k) * (1 << bits))).astype(dtype)
    zp = None
    if zp_kind == "u8":
        zp = rng.integers(0, 256, (n, -(-nb * bits // 8))).astype(np.uint8)
    elif zp_kind == "float":
        zp = rng.uniform(0, (1 << bits) - 1, (n, nb)).astype(dtype)
    bias = rng.standard_normal(n).astype(dtype) if with_bias else None
    a = rng.standard_normal((1, m, k)).astype(dtype)
    attrs = {"K": k, "N": n, "bits": bits, "block_size": block, "accuracy_level": 4}
    return [a, b, scales, zp, None, bias], attrs


@pytest.mark.parametrize("dtype", FLOATS_BF16)
@pytest.mark.parametrize("block", [32, 64, 128])
@pytest.mark.parametrize("m", [1, 4, 16, 33])
def test_matmul_nbits(cp, prov, rng, m, block, dtype):
    zp_kind = {32: None, 64: "u8", 128: "float"}[block]
    k, n = (200, 96) if block == 32 else (512, 320)  # K=200: a partial last block
    inputs, attrs = nbits_case(rng, m, k, n, block, 4, dtype, zp_kind, with_bias=m != 4)
    while inputs[-1] is None and len(inputs) > 3:
        inputs.pop()
    info = node("MatMulNBits", inputs, attrs=attrs, opset=1, domain=MS_DOMAIN)
    want = reference(info, inputs, nbits_np(attrs))
    got, _, _ = run_gpu(cp, prov, info, inputs, [((1, m, n), dtype)])
    close(got[0], want[0], dtype, scale=2)


@pytest.mark.parametrize(
    "bits,block,k,n",
    [(8, 16, 96, 70), (2, 64, 256, 33), (4, 16, 4864, 40), (4, 32, 64, 20001)],  # last: 2 cols/warp
)
def test_matmul_nbits_other_bits_and_many_words(cp, prov, rng, bits, block, k, n):
    inputs, attrs = nbits_case(rng, 3, k, n, block, bits, np.float32, "u8", False)
    inputs = inputs[:4]
    info = node("MatMulNBits", inputs, attrs=attrs, opset=1, domain=MS_DOMAIN)
    want = reference(info, inputs, nbits_np(attrs))
    got, _, _ = run_gpu(cp, prov, info, inputs, [((1, 3, n), np.float32)])
    close(got[0], want[0], np.float32, scale=2)


@pytest.mark.parametrize("dtype", FLOATS_BF16)
@pytest.mark.parametrize("zp_kind", [None, "u8", "float"])
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize(
    "k,n,block,lanes",
    [
        (896, 4099, 32, 4),  # the lm_head split (7 chunks a lane), odd column tail
        (896, 4099, 32, 16),  # 2 chunks a lane, the second round 12 of 16 lanes
        (96, 1001, 32, 2),  # 3 chunks: lane 1 idle in round 2
        (2048, 4099, 64, 8),  # the largest K: 8 chunks a lane, 2 chunks a block
        (896, 20001, 128, None),  # the split's own choice, which must be this kernel
    ],
)
def test_matmul_nbits_small_k(cp, prov, rng, monkeypatch, k, n, block, lanes, m, zp_kind, dtype):
    """``nbits4_gemv16_small_k`` (a few lanes a column) against float64, bias at M=3 (the
    GEMVs' rows: ``nbits_mma_min_rows`` 0, as fp16/bf16 rows run on the tensor cores from
    one row by default)."""
    from onnx_genrt.providers.cuda.kernels import contrib_quant as cq

    monkeypatch.setattr(prov, "_options", {**prov._options, "nbits_mma_min_rows": 0})
    chunks = k // 32
    if lanes is None:
        assert prov.option("nbits_small_k")
        assert cq.nbits4_small_k_split(chunks, n, cq.sm_count()) is not None
    else:
        split = (lanes, -(-chunks // lanes))
        monkeypatch.setattr(cq, "nbits4_small_k_split", lambda *_: split)
    names = []
    real = cq.function
    monkeypatch.setattr(cq, "function", lambda src, name: names.append(name) or real(src, name))
    inputs, attrs = nbits_case(rng, m, k, n, block, 4, dtype, zp_kind, with_bias=m == 3)
    while inputs[-1] is None and len(inputs) > 3:
        inputs.pop()
    info = node("MatMulNBits", inputs, attrs=attrs, opset=1, domain=MS_DOMAIN)
    want = reference(info, inputs, nbits_np(attrs))
    got, _, _ = run_gpu(cp, prov, info, inputs, [((1, m, n), dtype)])
    assert names and names[-1].startswith("nbits4_gemv16_small_k<"), names
    close(got[0], want[0], dtype, scale=2)


@pytest.mark.parametrize("m", [1, 5])
# the small-K kernel; a warp per column; two columns a warp (N >= 16 * 8 * SMs, M <= 4)
@pytest.mark.parametrize("k,n", [(896, 4099), (4864, 96), (4096, 16999)])
def test_matmul_nbits_fp16_large_activations(cp, prov, rng, m, k, n):
    """fp16 activations up to ~8000 stay finite and accurate: a single product (q - z) * a
    would pass 65504, so the packed-half math must keep its partial sums scaled down."""
    inputs, attrs = nbits_case(rng, m, k, n, 32, 4, np.float16, "u8", False)
    inputs = inputs[:4]
    inputs[0] = (inputs[0].astype(np.float32) * 2000).astype(np.float16)
    assert 15 * float(np.abs(inputs[0]).max()) > 65504
    info = node("MatMulNBits", inputs, attrs=attrs, opset=1, domain=MS_DOMAIN)
    want = reference(info, inputs, nbits_np(attrs))
    got, _, _ = run_gpu(cp, prov, info, inputs, [((1, m, n), np.float16)])
    close(got[0], want[0], np.float16, scale=float(np.abs(want[0]).max()))


def test_matmul_nbits_capture_small_m_refuse_large_m(cp, fresh, rng):
    from onnx_genrt.providers.cuda.kernels._common import CaptureUnsupported

    prov = fresh
    inputs, attrs = nbits_case(rng, 1, 896, 4864, 32, 4, np.float16, None, False)
    d_in = [dev(prov, x) for x in inputs[:3]]
    info = node("MatMulNBits", inputs[:3], attrs=attrs, opset=1, domain=MS_DOMAIN)
    with prov.stream:
        y = cp.empty((1, 1, 4864), np.float16)
    launch(prov, info, d_in, [y])
    prov.begin_capture(PRIMARY)
    launch(prov, info, d_in, [y])
    prov.end_capture(PRIMARY)
    for _ in range(3):
        a = rng.standard_normal((1, 1, 896)).astype(np.float16)
        d_in[0].set(a, stream=prov.stream)
        with prov.stream:
            y.fill(np.nan)
        prov.replay(PRIMARY)
        want = nbits_np(attrs)(a, *inputs[1:3])
        close(prov.to_numpy(y), want, np.float16, scale=2)
    from onnx_genrt.providers.cuda.kernels.contrib_quant import CHUNKED_GEMV_MAX_M

    # Above the capturable GEMV pieces and tensor-core rows, with cublas_in_graphs off:
    # CuPy's cuBLAS, eager only (on, the step captures: test_cuda_cublas.py).
    from onnx_genrt.providers.cuda.provider import CUDAProvider

    prov = CUDAProvider(cublas_in_graphs=False)
    d_in = [dev(prov, x) for x in inputs[:3]]
    m = CHUNKED_GEMV_MAX_M + 1
    big = dev(prov, rng.standard_normal((1, m, 896)).astype(np.float16))
    with prov.stream:
        y_big = cp.empty((1, m, 4864), np.float16)
    launch(prov, info, [big, *d_in[1:]], [y_big])  # eager: dequantize once + cuBLAS
    prov.begin_capture(VERIFY)
    with pytest.raises(CaptureUnsupported, match="cublas_in_graphs off"):
        launch(prov, info, [big, *d_in[1:]], [y_big])
    prov.abort_capture(VERIFY, f"MatMulNBits M={m}")
    prov.reset_graph(VERIFY)


# ----------------------------------------------------------------------------- small ops


@pytest.mark.parametrize("dtype", [*FLOATS_BF16, np.int64, np.int32])
@pytest.mark.parametrize(
    "shape,axes,keep",
    [
        ((1, 300), [1], 0),
        ((4, 5, 6), [0, 1], 1),
        ((3, 4, 5), None, 0),
        ((3, 4, 5), [1], 1),
        ((3, 4, 5), [0, 2], 0),
    ],
)
def test_reduce_sum(cp, prov, rng, shape, axes, keep, dtype):
    x = (rng.standard_normal(shape) * 3).astype(dtype)
    want = np.sum(
        x.astype(np.float64), axis=None if axes is None else tuple(axes), keepdims=bool(keep)
    )
    inputs = [x] + ([np.array(axes, np.int64)] if axes is not None else [])
    info = node("ReduceSum", inputs, attrs={"keepdims": keep}, opset=13)
    got, _, _ = run_gpu(cp, prov, info, inputs, [(np.shape(want), dtype)])
    if np.dtype(dtype).kind == "i":
        np.testing.assert_array_equal(got[0], want.astype(dtype))
    else:
        close(got[0], want, dtype, scale=10)


# ----------------------------------------------------------------------------- decode heads

VOCAB = 151936


def _argmax_logits(rng, rows, cols, dtype, k):
    """Random logits with planted cases per row (``k`` shifts them between replays)."""
    x = rng.standard_normal((rows, cols)).astype(dtype)
    for r in range(rows):
        kind = (r + k) % 5
        if kind == 0:  # ties straddling block boundaries and the row's end: the first wins
            x[r, [cols - 1, cols // 2 + 1, 8193 + k, 8192 + k]] = 30
        elif kind == 1:  # the only maximum is the last column
            x[r, cols - 1] = 30
        elif kind == 2:  # everything equal
            x[r] = 0.5
        elif kind == 3:  # NaN counts as the largest value (numpy): the first NaN wins
            x[r, [cols - 7 - k, 5000 + k]] = np.nan
            x[r, 3] = 30
        else:  # all -inf: index 0
            x[r] = -np.inf
    return x


@pytest.mark.parametrize("dtype", FLOATS_BF16)
@pytest.mark.parametrize("rows,cols", [(1, VOCAB), (5, VOCAB), (16, VOCAB), (3, 100003)])
def test_argmax_long_rows_ties_captured(cp, fresh, rng, rows, cols, dtype):
    """ArgMax over a vocabulary: one graph replayed on new logits (the per-row counters must
    be back at zero after every launch); ties go to the first index, as numpy / the CPU."""
    prov = fresh
    info = node("ArgMax", [1], attrs={"axis": -1, "keepdims": 0}, opset=13)
    with prov.stream:
        x = cp.empty((rows, cols), dtype)
        y = _poison(cp, (rows,), np.int64)

    def write_and_want(k):
        host = _argmax_logits(rng, rows, cols, dtype, k)
        x.set(host, stream=prov.stream)
        with prov.stream:
            y.fill(-5)
        return reference(info, [host], lambda a: np.argmax(a, axis=-1))[0]

    want = write_and_want(0)
    assert launch(prov, info, [x], [y])[0] is y  # eager: compiles, sizes scratch and counters
    np.testing.assert_array_equal(prov.to_numpy(y), want)
    prov.begin_capture(PRIMARY)
    launch(prov, info, [x], [y])
    prov.end_capture(PRIMARY)
    for k in range(1, 4):
        want = write_and_want(k)
        prov.replay(PRIMARY)
        np.testing.assert_array_equal(prov.to_numpy(y), want, err_msg=f"replay {k}")
    # select_last_index=1 (eager): ties and NaNs go to the last index.
    last = node("ArgMax", [1], attrs={"axis": -1, "keepdims": 1, "select_last_index": 1}, opset=13)
    host = _argmax_logits(rng, rows, cols, dtype, 0)
    want = reference(last, [host], lambda a: cols - 1 - np.argmax(a[:, ::-1], -1, keepdims=True))
    got, _, _ = run_gpu(cp, prov, last, [host], [((rows, 1), np.int64)])
    np.testing.assert_array_equal(got[0], want[0])


@pytest.mark.parametrize("dtype", FLOATS_BF16)
@pytest.mark.parametrize("shape", [(1, 1, VOCAB), (1, 5, VOCAB), (16, VOCAB), (3, 100003)])
def test_reduce_sum_all_axes_long_captured(cp, fresh, rng, shape, dtype):
    """The engine's non-finite probe, ReduceSum(logits - logits) to a scalar, and a plain sum
    of the logits, in one graph replayed on new logits: 0 / the float64 sum when finite, NaN
    or inf as the values say otherwise, the same bits on every replay."""
    prov = fresh
    sub = node("Sub", [1, 1], opset=14)
    red = node("ReduceSum", [1], attrs={"keepdims": 0}, opset=13)
    with prov.stream:
        x = cp.empty(shape, dtype)
        diff = cp.empty(shape, dtype)
        probe = _poison(cp, (), dtype)
        total = _poison(cp, (), dtype)

    def run():
        assert launch(prov, sub, [x, x], [diff])[0] is diff
        assert launch(prov, red, [diff], [probe])[0] is probe
        assert launch(prov, red, [x], [total])[0] is total

    def check(host, what):
        want_total = np.sum(host.astype(np.float64))
        got_probe = float(prov.to_numpy(probe))
        got_total = float(prov.to_numpy(total))
        if np.isfinite(host).all():
            assert got_probe == 0.0, what
            rounding = {np.dtype(np.float16): 2e-3, BF16: 4e-3}.get(np.dtype(dtype), 0.0)
            tol = 1e-5 * np.abs(host.astype(np.float64)).sum() + rounding * abs(want_total)
            assert abs(got_total - want_total) <= tol, (what, got_total, want_total)
        else:
            assert np.isnan(got_probe), (what, got_probe)
            if np.isnan(want_total):
                assert np.isnan(got_total), (what, got_total)
            else:
                assert got_total == want_total, (what, got_total, want_total)
        return got_total

    host = rng.standard_normal(shape).astype(dtype)
    x.set(host, stream=prov.stream)
    run()  # eager: compiles, sizes scratch and counters
    first = check(host, "eager")
    prov.begin_capture(PRIMARY)
    run()
    prov.end_capture(PRIMARY)
    prov.replay(PRIMARY)
    again = check(host, "replay of the same logits")
    assert np.array_equal(np.float64(first), np.float64(again)), "the sum is not deterministic"
    flat = host.reshape(-1)
    n = flat.size
    for what, plant in (
        ("+inf", {n - 1: np.inf}),
        ("-inf", {n // 3: -np.inf}),
        ("+inf and -inf", {7: np.inf, n - 3: -np.inf}),
        ("NaN", {n // 2 + 1: np.nan}),
        ("finite again", {}),
    ):
        h = rng.standard_normal(shape).astype(dtype)
        for i, v in plant.items():
            h.reshape(-1)[i] = v
        x.set(h, stream=prov.stream)
        prov.replay(PRIMARY)
        check(h, what)


@pytest.mark.parametrize(
    "shape,axes,dtype",
    [
        ((70000, 3), [0], np.float32),  # strided (inner 3), split over blocks
        ((2, 300001), [1], np.int64),  # integers, unaligned rows, split
        ((4, 65536), [1], np.int32),  # integers, aligned rows, split
        ((1, 200000), [1], np.float64),
    ],
)
def test_reduce_sum_split_strided_and_integer(cp, prov, rng, shape, axes, dtype):
    x = (rng.standard_normal(shape) * 100).astype(dtype)
    want = np.sum(x.astype(np.float64), axis=tuple(axes))
    info = node("ReduceSum", [x, 1], attrs={"keepdims": 0}, opset=13)
    got, _, _ = run_gpu(cp, prov, info, [x, np.array(axes, np.int64)], [(want.shape, dtype)])
    if np.dtype(dtype).kind == "i":
        np.testing.assert_array_equal(got[0], np.sum(x, axis=tuple(axes)))
    else:
        scale = np.abs(x.astype(np.float64)).sum(axis=tuple(axes))
        np.testing.assert_allclose(got[0], want, rtol=0, atol=float(scale.max()) * 1e-6)


def test_shape_is_host_known_and_capturable(cp, fresh, rng):
    from onnx_genrt.providers.cuda.kernels._common import host_ints

    prov = fresh
    x = dev(prov, np.zeros((1, 4096), np.int64))
    info = node("Shape", [x], opset=21)
    (s1,) = launch(prov, info, [x])
    assert np.array_equal(prov.host_value(s1), [1, 4096])
    gi = node("Gather", [1, 1], attrs={"axis": 0}, opset=13)
    idx = dev(prov, np.array(1, np.int64))
    with prov.stream:
        g = cp.empty((), np.int64)
    prov.begin_capture(PRIMARY)
    (s2,) = launch(prov, info, [x])
    launch(prov, gi, [s2, idx], [g])
    prov.end_capture(PRIMARY)
    assert s2 is s1
    assert host_ints(KernelContext(info, prov, []), s2) == [1, 4096]
    prov.replay(PRIMARY)
    assert int(prov.to_numpy(g)) == 4096
    (tail,) = launch(prov, node("Shape", [x], attrs={"start": -1}, opset=21), [x])
    assert prov.to_numpy(tail).tolist() == [4096]


def test_constant_on_device(cp, prov):
    info = node("Constant", [], attrs={"value_ints": [1, 2, 3]}, opset=21)
    (c,) = launch(prov, info, [])
    assert isinstance(c, cp.ndarray) and prov.to_numpy(c).tolist() == [1, 2, 3]


@pytest.mark.parametrize("bits,zp", [(4, False), (4, True), (8, True)])
def test_gather_block_quantized(cp, prov, rng, bits, zp):
    rows, cols, block = 50, 96, 32
    data = rng.integers(0, 256, (rows, cols * bits // 8)).astype(np.uint8)
    scales = rng.uniform(0.1, 1.0, (rows, cols // block)).astype(np.float32)
    zps = (
        rng.integers(0, 256, (rows, -(-cols // block * bits // 8))).astype(np.uint8) if zp else None
    )
    idx = np.array([[0, 7, -1], [49, 3, -50]], np.int64)  # both ends of the table
    inputs = [data, idx, scales] + ([zps] if zp else [])
    attrs = {"bits": bits, "block_size": block, "gather_axis": 0, "quantize_axis": 1}
    info = node("GatherBlockQuantized", inputs, attrs=attrs, opset=1, domain=MS_DOMAIN)
    want = reference(info, inputs, gbq_np(bits, block))
    got, _, _ = run_gpu(cp, prov, info, inputs, [((2, 3, cols), np.float32)])
    close(got[0], want[0], np.float32)


@pytest.mark.parametrize("bad", [50, -51])
def test_gather_block_quantized_refuses_indices_out_of_range(cp, prov, rng, bad):
    """Eager runs check device indices (one min/max read-back) and host indices alike."""
    rows, cols, block = 50, 64, 32
    data = rng.integers(0, 256, (rows, cols // 2)).astype(np.uint8)
    scales = rng.uniform(0.1, 1.0, (rows, cols // block)).astype(np.float32)
    idx = np.array([[0, bad]], np.int64)
    attrs = {"bits": 4, "block_size": block, "gather_axis": 0, "quantize_axis": 1}
    info = node("GatherBlockQuantized", [data, idx, scales], attrs=attrs, opset=1, domain=MS_DOMAIN)
    message = f"indices value {bad} out of range for axis of size {rows}"
    with pytest.raises(IndexError, match=message):
        run_gpu(cp, prov, info, [data, idx, scales], [((1, 2, cols), np.float32)])
    with pytest.raises(IndexError, match=message):  # host indices, checked before the upload
        launch(prov, info, [dev(prov, data), idx, dev(prov, scales)])


# ----------------------------------------------------------------------------- whole models


def _fixture(name):
    folder = FIXTURES / name
    if not (folder / "reference.npz").is_file():
        why = (
            f"{folder} is absent: build it with `python tests/providers/cuda/test_cuda_llm_kernels.py "
            "--build` on a machine with onnxruntime-genai, then carry .gpu_fixtures"
        )
        if os.environ.get("ONNX_GENRT_REQUIRE_GPU") == "1":  # a GPU run must not skip these
            pytest.fail(f"ONNX_GENRT_REQUIRE_GPU=1: {why}", pytrace=False)
        pytest.skip(why)
    return folder


#: Builder models of .gpu_fixtures; gemma2-fp32: sliding-window layers with a window-sized
#: KV cache (sliding_window_cache=1), attention and final logit softcaps.
BUILDER_MODELS = ["qwen2-fp32", "qwen2-int4", "qwen2-bf16", "gemma2-fp32"]


@pytest.mark.parametrize("name", BUILDER_MODELS)
def test_builder_model_ops_all_on_cuda(cp, prov, name):
    import onnx

    from onnx_genrt.core.kernels import opset_map

    folder = _fixture(name)
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    opsets = opset_map(model)
    missing = []
    for n in model.graph.node:
        info = NodeInfo.from_proto(n, opsets[n.domain or ""])
        ok, reason = prov.supports(info)
        if not ok:
            missing.append(f"{n.op_type}: {reason}")
    assert not missing, missing


@pytest.mark.parametrize("name", BUILDER_MODELS)
def test_builder_model_matches_cpu(cp, name):
    """Logits (teacher-forced, decode steps replayed from one graph) and greedy tokens."""
    from onnx_genrt.engine import Generator, GeneratorParams, Model
    from onnx_genrt.engine.decoder import DecoderRunner

    folder = _fixture(name)
    ref = np.load(folder / "reference.npz")
    prompt, tokens = ref["prompt"].tolist(), ref["tokens"].tolist()
    model = Model(folder, provider="cuda")
    plan = model.session.plan
    assert plan.placement_counts() == {"cuda": len(plan.steps)}
    runner = DecoderRunner(model.session, model.config, len(prompt) + len(tokens) + 1)
    # bf16 rounds every op's output to 8 bits, in another order on each provider; on this
    # chaotic fixture HF's own bf16 run is ~2.5% of the logit range off float32 (parity tests)
    tol = 0.06 * float(np.abs(ref["prefill"]).max()) if name == "qwen2-bf16" else 1e-3
    # a prefill computes its last row's logits only (session.row_tail) ...
    last = DecoderRunner(model.session, model.config, len(prompt) + 1)
    assert last.prefill_last_row
    got = np.asarray(last.forward(prompt, None).logits, np.float64)
    np.testing.assert_allclose(got, ref["prefill"][-1:], atol=tol, rtol=0)
    # ... and every row's when asked
    runner.prefill_last_row = False
    got = np.asarray(runner.forward(prompt, None).logits, np.float64)
    np.testing.assert_allclose(got, ref["prefill"], atol=tol, rtol=0)
    for i, tok in enumerate(tokens[:-1]):
        got = np.asarray(runner.forward([tok], PRIMARY).logits[0], np.float64)
        np.testing.assert_allclose(got, ref["steps"][i], atol=tol, rtol=0, err_msg=f"step {i}")
    stats = model.session.graph_stats(PRIMARY)
    assert stats.captures == 1 and stats.fallbacks == 0, dict(stats.fallback_reasons)
    assert stats.replays >= len(tokens) - 3

    params = GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + len(tokens))
    gen = Generator(model, params)
    gen.append_tokens(prompt)
    while not gen.is_done():
        gen.generate_next_token()
    got_tokens = gen.get_sequence()[len(prompt) :]
    if got_tokens != tokens:
        # Only a near tie in the reference logits may flip a greedy pick.
        i = next(j for j, (a, b) in enumerate(zip(got_tokens, tokens, strict=False)) if a != b)
        row = ref["prefill"][-1] if i == 0 else ref["steps"][i - 1]
        top = np.sort(row)[::-1]
        near = 2 * tol if name == "qwen2-bf16" else 1e-3
        assert top[0] - top[1] < near, f"greedy tokens differ at {i}: {got_tokens} != {tokens}"


# ----------------------------------------------------------------------------- timings


def _graph_us(cp, prov, fn, reps=20, iters=10):
    """Device microseconds per ``fn()`` call, from a graph of ``reps`` calls."""
    fn()
    prov.synchronize()
    prov.begin_capture(DRAFT)
    for _ in range(reps):
        fn()
    prov.end_capture(DRAFT)
    prov.replay(DRAFT)
    prov.synchronize()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record(prov.stream)
    for _ in range(iters):
        prov.replay(DRAFT)
    end.record(prov.stream)
    end.synchronize()
    prov.reset_graph(DRAFT)
    return cp.cuda.get_elapsed_time(start, end) * 1000 / (reps * iters)


def llm_kernel_timings(cp, prov, rng) -> str:
    """Device time per call (graph replay) of GQA, the vocab heads and the int4 GEMVs: a
    benchmark, not a test (pytest does not collect it). Run it on a GPU machine with
    ``python tests/providers/cuda/test_cuda_llm_kernels.py --timings``; with ``$OUT`` set it also writes
    ``$OUT/llm_kernel_timings.txt``."""
    lines = []
    for h, kvh, d, s in ((14, 2, 64, 1), (14, 2, 64, 5), (28, 4, 128, 1)):
        step = _DecodeStep(cp, prov, rng, s, h=h, kvh=kvh, d=d, cap=4096)
        info, ins, buf = step.steps[-1]
        for total in (256, 1024, 4096):
            step.write(total)
            step.run()  # the mask -> seqlens for this length

            def gqa(info=info, ins=ins, buf=buf):
                launch(prov, info, ins, [buf])

            us = _graph_us(cp, prov, gqa)
            kv_bytes = 2 * kvh * total * d * 2
            lines.append(
                f"GQA fp16 M={s} H={h} KVH={kvh} D={d} cache {total}: {us:.1f} us "
                f"({kv_bytes / us / 1e3:.0f} GB/s of KV)"
            )
    for dtype in FLOATS:
        for rows in (1, 16):
            with prov.stream:
                x = cp.asarray(rng.standard_normal((rows, VOCAB)).astype(dtype))
                idx = cp.empty((rows,), np.int64)
                tot = cp.empty((), dtype)
            arg = node("ArgMax", [1], attrs={"axis": -1, "keepdims": 0}, opset=13)
            red = node("ReduceSum", [1], attrs={"keepdims": 0}, opset=13)
            name = np.dtype(dtype).name
            for what, info, buf in (("ArgMax", arg, idx), ("ReduceSum all", red, tot)):

                def head(info=info, buf=buf, x=x):
                    launch(prov, info, [x], [buf])

                us = _graph_us(cp, prov, head)
                lines.append(
                    f"{what} {name} {rows}x{VOCAB}: {us:.1f} us ({x.nbytes / us / 1e3:.0f} GB/s)"
                )
    from onnx_genrt.providers.cuda.kernels import contrib_quant

    shapes = ((896, 4864, 1), (896, 4864, 4), (4864, 896, 1), (896, 151936, 1), (896, 151936, 8))
    for k, n, m in shapes:
        inputs, attrs = nbits_case(rng, m, k, n, 32, 4, np.float16, None, False)
        d_in = [dev(prov, x) for x in inputs[:3]]
        info = node("MatMulNBits", inputs[:3], attrs=attrs, opset=1, domain=MS_DOMAIN)
        with prov.stream:
            y = cp.empty((1, m, n), np.float16)

        def gemv(info=info, d_in=d_in, y=y):
            launch(prov, info, d_in, [y])

        nbytes = sum(int(x.nbytes) for x in d_in[1:3])
        split = contrib_quant.nbits4_small_k_split(k // 32, n, contrib_quant.sm_count())
        for variant in (True, False):  # the nbits_small_k option on / off
            options = prov._options
            prov._options = {**options, "nbits_small_k": variant}
            try:
                us = _graph_us(cp, prov, gemv)
            finally:
                prov._options = options
            on = variant and split is not None and m <= contrib_quant.SMALL_K_MAX_M
            kind = f"small-K {split[0]} lanes/column" if on else "chunk16 warp/column"
            lines.append(
                f"MatMulNBits int4 GEMV fp16 M={m} K={k} N={n} block 32 ({kind}): {us:.1f} us "
                f"({nbytes / us / 1e3:.0f} GB/s of weights+scales)"
            )
    return "\n".join(lines)


def _print_timings() -> None:
    import cupy

    from onnx_genrt.providers.cuda.provider import CUDAProvider

    text = llm_kernel_timings(cupy, CUDAProvider(), np.random.default_rng(0))
    print(text)
    out_dir = os.environ.get("OUT")
    if out_dir:
        Path(out_dir, "llm_kernel_timings.txt").write_text(text + "\n")


# ----------------------------------------------------------------------------- fixture builder


def build_fixtures(dest: Path = FIXTURES) -> None:
    """Copy two tiny builder models and save the CPU provider's reference results."""
    import shutil

    sys.path.insert(0, str(ROOT / "tests"))
    import llm_fixtures

    from onnx_genrt.engine import Generator, GeneratorParams, Model
    from onnx_genrt.engine.decoder import DecoderRunner

    # bf16: the CUDA target, whose bf16 model uses GroupQueryAttention (the CPU target's
    # MultiHeadAttention is not supported); the CPU provider computes its reference.
    sources = {
        f"qwen2-{precision}": llm_fixtures.build_qwen2(
            llm_fixtures.TINY_QWEN2, precision, target=target
        )
        for precision, target in (("fp32", "cpu"), ("bf16", "cuda"))
    }
    # int4 at accuracy_level 1 (float activations): the builder's CPU default, level 4, makes
    # the CPU provider quantize activations to int8 as onnxruntime's CPU provider does, while
    # CUDA MatMulNBits computes in float whatever the level (as onnxruntime's CUDA provider).
    sources["qwen2-int4"] = llm_fixtures.build_qwen2_with_options(
        llm_fixtures.TINY_QWEN2, "int4", options={"accuracy_level": 1}
    )
    # The CPU provider decodes it token-identically to onnxruntime-genai
    # (tests/engine/test_sliding_window_parity.py).
    sources["gemma2-fp32"] = llm_fixtures.build_gemma2(llm_fixtures.TINY_GEMMA2)
    for name, src in sources.items():
        folder = dest / name
        folder.mkdir(parents=True, exist_ok=True)
        for f in FIXTURE_FILES:
            if (src / f).is_file():
                shutil.copy2(src / f, folder / f)
        model = Model(folder, provider="cpu")
        prompt = [5, 77, 301, 12, 450, 9, 123, 64]
        params = GeneratorParams(model)
        params.set_search_options(max_length=len(prompt) + 32)
        gen = Generator(model, params)
        gen.append_tokens(prompt)
        while not gen.is_done():
            gen.generate_next_token()
        tokens = gen.get_sequence()[len(prompt) :]
        runner = DecoderRunner(model.session, model.config, len(prompt) + len(tokens) + 1)
        runner.prefill_last_row = False  # the reference keeps every prompt row's logits
        prefill = np.array(runner.forward(prompt, None).logits, copy=True)
        steps = [np.array(runner.forward([t], None).logits[0], copy=True) for t in tokens[:-1]]
        np.savez(
            folder / "reference.npz",
            prompt=np.array(prompt, np.int64),
            tokens=np.array(tokens, np.int64),
            prefill=prefill,
            steps=np.array(steps),
        )
        print(f"{folder}: {len(tokens)} tokens {tokens[:8]}...")


if __name__ == "__main__":
    if "--build" in sys.argv:
        build_fixtures()
    if "--timings" in sys.argv:
        _print_timings()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FLOATS_BF16)
@pytest.mark.parametrize(
    ("axes", "keepdims", "opset"), [([-1], 1, 18), ([1, 2], 0, 18), (None, 1, 13)]
)
def test_reduce_mean_matches_numpy(dtype, axes, keepdims, opset):
    import cupy

    from onnx_genrt.core.kernels import KernelContext, NodeInfo
    from onnx_genrt.core.registry import get_registry
    from onnx_genrt.providers.cuda.kernels import REGISTRY as CUDA

    provider = get_registry().create("cuda")
    x = np.random.default_rng(3).standard_normal((2, 5, 7)).astype(dtype)
    attrs = {"keepdims": keepdims}
    if opset < 18 and axes is not None:
        attrs["axes"] = axes
    node = NodeInfo("ReduceMean", "rm", "", opset, attrs)
    args = [cupy.asarray(x)]
    if opset >= 18 and axes is not None:
        args.append(provider.as_array(np.array(axes, np.int64)))
    got = provider.launch(CUDA.lookup("", "ReduceMean", opset), KernelContext(node, provider), args)
    provider.synchronize()
    ref = x.astype(np.float64).mean(
        axis=None if axes is None else tuple(axes), keepdims=bool(keepdims)
    )
    tol = {np.dtype(np.float32): 1e-5, np.dtype(np.float16): 2e-3}.get(np.dtype(dtype), 2e-2)
    np.testing.assert_allclose(cupy.asnumpy(got).astype(np.float64), ref, rtol=tol, atol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["ReduceMax"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_reduce_max_min_match_numpy_and_capture(op, dtype):
    import cupy

    from onnx_genrt.core.registry import get_registry
    from onnx_genrt.providers.cuda.kernels import REGISTRY as CUDA

    provider = get_registry().create("cuda")
    x = np.random.default_rng(4).standard_normal((1, 1, 4099)).astype(dtype)
    node = NodeInfo(op, "r", "", 18, {"keepdims": 0})
    xd = cupy.asarray(x)
    axes = provider.as_array(np.array([-1], np.int64))
    y = cupy.full((1, 1), np.nan, dtype)
    ctx = KernelContext(node, provider, [y])
    kdef = CUDA.lookup("", op, 18)
    provider.begin_capture(DeviceGraphSlot.DRAFT)
    provider.launch(kdef, ctx, [xd, axes])
    provider.end_capture(DeviceGraphSlot.DRAFT)
    provider.replay(DeviceGraphSlot.DRAFT)
    provider.synchronize()
    ref = x.max(axis=-1) if op == "ReduceMax" else x.min(axis=-1)
    np.testing.assert_array_equal(cupy.asnumpy(y), ref)
    provider.reset_graph(DeviceGraphSlot.DRAFT)
