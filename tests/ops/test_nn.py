"""nn kernels on every provider: ONNX backend node cases plus fp16/bf16 / larger-shape checks
against numpy float64, onnxruntime and ``onnx.reference``."""

from __future__ import annotations

import math
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from .op_tester import OpTester, assert_output_matches, run_case_node, single_node_cases

NN_OPS = (
    "MatMul",
    "Gemm",
    "MatMulInteger",
    "Einsum",
    "Softmax",
    "LogSoftmax",
    "LayerNormalization",
    "RMSNormalization",
    "GroupNormalization",
    "InstanceNormalization",
    "BatchNormalization",
    "Attention",
    "RotaryEmbedding",
    "QuantizeLinear",
    "DequantizeLinear",
    "Conv",
    "GlobalAveragePool",
    "GlobalMaxPool",
)

# Backend cases that cannot pass, with the reason (kept empty when all pass).
XFAIL: dict[str, str] = {}

# bf16 Attention cases: ONNX's reference rounds every intermediate (scaled Q/K, scores,
# exp, sums) to bf16, while the kernel computes in float32 and rounds once, as onnxruntime
# does. The two differ by up to one bf16 ulp (2**-8 relative), above these cases'
# rtol=1e-3, so they are compared at bf16 resolution instead.
BF16_RESOLUTION = {
    "test_attention_3d_causal_bf16",
    "test_attention_4d_attn_mask_causal_bf16",
    "test_attention_4d_causal_bf16",
    "test_attention_4d_causal_padded_kv_bf16",
    "test_attention_4d_padded_kv_bf16",
}

BF16 = np.dtype(ml_dtypes.bfloat16)
RNG = np.random.default_rng(1234)


def _numpy(v: Any) -> Any:
    """TensorProto data (int4, float8 ...) as numpy/ml_dtypes arrays."""
    return numpy_helper.to_array(v) if hasattr(v, "data_type") else v


def _check_case(tester: OpTester, case: Any, rtol: float, atol: float) -> None:
    """Run every data set; outputs matched to graph outputs by name.

    The node may declare unnamed optional outputs in between (Attention's Y, "", "", qk),
    and a kernel returns one array per declared output.
    """
    names = list(case.model.graph.node[0].output)
    for i, (ins, outs) in enumerate(case.data_sets):
        got = run_case_node(tester, case, [_numpy(a) for a in ins])
        assert len(got) == len(names), f"{case.name}: {len(got)} outputs for {len(names)}"
        for vi, want in zip(case.model.graph.output, outs, strict=True):
            label = f"{case.name}[set {i}] output {vi.name}"
            assert_output_matches(label, got[names.index(vi.name)], _numpy(want), rtol, atol)


_CASES = single_node_cases(NN_OPS)


def test_every_nn_op_has_backend_cases() -> None:
    seen = {c.model.graph.node[0].op_type for c in _CASES}
    assert seen == set(NN_OPS)


@pytest.mark.parametrize("case", _CASES, ids=[c.name for c in _CASES])
def test_backend_case(case: Any, tester: OpTester) -> None:
    if case.name in XFAIL:
        pytest.xfail(XFAIL[case.name])
    if case.name in BF16_RESOLUTION:
        _check_case(tester, case, rtol=2**-7, atol=2**-7)
    else:
        _check_case(tester, case, case.rtol, case.atol)


# ----------------------------------------------------------------------------- helpers


def _node(op: str, inputs: list[str], outputs: list[str], **attrs: Any):
    return helper.make_node(op, inputs, outputs, **attrs)


def _run(tester: OpTester, node, opset: int, *inputs: np.ndarray | None) -> tuple[np.ndarray, ...]:
    """Run ``node``'s kernel on the tester's provider."""
    return tester.run(node, opset, *inputs)


_ORT_TYPES = {
    np.dtype(np.float32): TensorProto.FLOAT,
    np.dtype(np.float16): TensorProto.FLOAT16,
    np.dtype(np.float64): TensorProto.DOUBLE,
    np.dtype(np.int64): TensorProto.INT64,
    np.dtype(np.bool_): TensorProto.BOOL,
    BF16: TensorProto.BFLOAT16,
}


def _ort(node, opset: int, inputs: list[np.ndarray | None], out_types: list[np.dtype]):
    """Run ``node`` in onnxruntime (the test skips only when onnxruntime is not installed)."""
    ort = pytest.importorskip("onnxruntime")
    names = [n for n, a in zip(node.input, inputs, strict=False) if n and a is not None]
    arrays = [a for n, a in zip(node.input, inputs, strict=False) if n and a is not None]
    graph = helper.make_graph(
        [node],
        "g",
        [
            helper.make_tensor_value_info(n, _ORT_TYPES[a.dtype], a.shape)
            for n, a in zip(names, arrays, strict=True)
        ],
        [
            helper.make_tensor_value_info(n, _ORT_TYPES[np.dtype(t)], None)
            for n, t in zip(node.output, out_types, strict=False)
            if n
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10
    # Every case here runs in onnxruntime: an error creating the session is a failure.
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, dict(zip(names, arrays, strict=True)))


def _f64(a: np.ndarray) -> np.ndarray:
    return np.asarray(a).astype(np.float64)


def _tol(dtype: np.dtype) -> dict[str, float]:
    if dtype == BF16:
        return {"rtol": 2e-2, "atol": 2e-2}
    if dtype == np.float16:
        return {"rtol": 2e-3, "atol": 2e-3}
    return {"rtol": 1e-5, "atol": 1e-5}


def _close(got: np.ndarray, want: np.ndarray, dtype: np.dtype) -> None:
    assert got.dtype == dtype
    assert got.shape == want.shape
    np.testing.assert_allclose(_f64(got), _f64(want), **_tol(dtype))


FLOATS = [np.dtype(np.float32), np.dtype(np.float16), BF16]


# ----------------------------------------------------------------------------- MatMul / Gemm


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize(
    "sa,sb",
    [((2, 7, 96), (96, 80)), ((3, 1, 5, 64), (2, 64, 33)), ((64,), (4, 64, 9)), ((5, 64), (64,))],
)
def test_matmul_dtypes_shapes(dtype: np.dtype, sa: tuple, sb: tuple, tester: OpTester) -> None:
    a = RNG.standard_normal(sa).astype(dtype)
    b = RNG.standard_normal(sb).astype(dtype)
    (y,) = _run(tester, _node("MatMul", ["a", "b"], ["y"]), 13, a, b)
    want = np.matmul(_f64(a), _f64(b))
    assert y.dtype == dtype and y.shape == want.shape
    np.testing.assert_allclose(
        _f64(y), want, rtol=3e-2 if dtype == BF16 else 2e-3, atol=0.3 if dtype == BF16 else 3e-2
    )


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_gemm_bias_broadcast(dtype: np.dtype, tester: OpTester) -> None:
    a = RNG.standard_normal((16, 8)).astype(dtype)
    b = RNG.standard_normal((12, 8)).astype(dtype)
    c = RNG.standard_normal((12,)).astype(dtype)
    node = _node("Gemm", ["a", "b", "c"], ["y"], alpha=0.5, beta=2.0, transB=1)
    (y,) = _run(tester, node, 13, a, b, c)
    want = 0.5 * _f64(a) @ _f64(b).T + 2.0 * _f64(c)
    assert y.dtype == dtype
    np.testing.assert_allclose(_f64(y), want, rtol=3e-2, atol=0.2 if dtype == BF16 else 2e-2)


def test_matmul_integer_per_row_zero_points(tester: OpTester) -> None:
    a = RNG.integers(0, 255, (4, 6)).astype(np.uint8)
    b = RNG.integers(-128, 127, (6, 3)).astype(np.int8)
    azp = np.array([1, 2, 3, 4], np.uint8)
    bzp = np.array([-1, 0, 5], np.int8)
    (y,) = _run(tester, _node("MatMulInteger", ["a", "b", "az", "bz"], ["y"]), 10, a, b, azp, bzp)
    want = (a.astype(np.int64) - azp[:, None]) @ (b.astype(np.int64) - bzp)
    assert y.dtype == np.int32
    np.testing.assert_array_equal(y, want)


# ----------------------------------------------------------------------------- Softmax


def _softmax_ref(x: np.ndarray, axis: int) -> np.ndarray:
    x = _f64(x)
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("axis", [-1, 1, 0])
def test_softmax_opset13(dtype: np.dtype, axis: int, tester: OpTester) -> None:
    x = (RNG.standard_normal((3, 40, 50)) * 4).astype(dtype)
    (y,) = _run(tester, _node("Softmax", ["x"], ["y"], axis=axis), 13, x)
    _close(y, _softmax_ref(x, axis), dtype)
    (ly,) = _run(tester, _node("LogSoftmax", ["x"], ["y"], axis=axis), 13, x)
    want = np.log(_softmax_ref(x, axis))
    assert ly.dtype == dtype
    np.testing.assert_allclose(
        _f64(ly),
        want,
        rtol=2e-2 if dtype != np.float32 else 1e-5,
        atol=6e-2 if dtype == BF16 else 1e-2 if dtype == np.float16 else 1e-5,
    )


def test_softmax_opset11_flattens(tester: OpTester) -> None:
    x = RNG.standard_normal((2, 3, 4)).astype(np.float32)
    node = _node("Softmax", ["x"], ["y"], axis=1)
    (y,) = _run(tester, node, 11, x)
    want = _softmax_ref(x.reshape(2, 12), 1).reshape(x.shape)
    _close(y, want, np.dtype(np.float32))
    (ort_y,) = _ort(node, 11, [x], [np.float32])
    np.testing.assert_allclose(y, ort_y, rtol=1e-5, atol=1e-6)


def test_softmax_long_row(tester: OpTester) -> None:
    x = (RNG.standard_normal((2, 150_000)) * 10).astype(np.float32)
    (y,) = _run(tester, _node("Softmax", ["x"], ["y"]), 13, x)
    np.testing.assert_allclose(_f64(y), _softmax_ref(x, -1), rtol=1e-5, atol=1e-9)


# ----------------------------------------------------------------------------- norms


def _layer_norm_ref(x, scale, bias, axis, eps):
    x = _f64(x)
    ax = tuple(range(axis % x.ndim, x.ndim))
    mean = x.mean(axis=ax, keepdims=True)
    inv = 1.0 / np.sqrt(((x - mean) ** 2).mean(axis=ax, keepdims=True) + eps)
    y = (x - mean) * inv * _f64(scale)
    return (y + _f64(bias) if bias is not None else y), mean, inv


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("axis", [-1, -2])
def test_layer_norm(dtype: np.dtype, axis: int, tester: OpTester) -> None:
    x = (RNG.standard_normal((4, 6, 256)) * 3 + 1).astype(dtype)
    norm_shape = x.shape[axis:]
    scale = RNG.standard_normal(norm_shape).astype(dtype)
    bias = RNG.standard_normal(norm_shape).astype(dtype)
    node = _node("LayerNormalization", ["x", "s", "b"], ["y", "m", "i"], axis=axis, epsilon=1e-5)
    y, mean, inv = _run(tester, node, 17, x, scale, bias)
    want, wmean, winv = _layer_norm_ref(x, scale, bias, axis, 1e-5)
    _close(y, want, dtype)
    assert mean.dtype == np.float32 and mean.shape == wmean.shape
    np.testing.assert_allclose(mean, wmean, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(inv, winv, rtol=1e-4, atol=1e-5)
    if dtype != BF16:
        ort_y = _ort(node, 17, [x, scale, bias], [dtype, np.float32, np.float32])[0]
        np.testing.assert_allclose(_f64(y), _f64(ort_y), **_tol(dtype))


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_rms_norm(dtype: np.dtype, tester: OpTester) -> None:
    x = (RNG.standard_normal((3, 5, 512)) * 2).astype(dtype)
    scale = RNG.standard_normal(512).astype(dtype)
    node = _node("RMSNormalization", ["x", "s"], ["y"], epsilon=1e-6)
    (y,) = _run(tester, node, 23, x, scale)
    xf = _f64(x)
    want = xf / np.sqrt((xf**2).mean(-1, keepdims=True) + 1e-6) * _f64(scale)
    _close(y, want, dtype)
    if dtype != BF16:
        (ort_y,) = _ort(node, 23, [x, scale], [dtype])
        np.testing.assert_allclose(_f64(y), _f64(ort_y), **_tol(dtype))


def test_layer_norm_scale_broadcast_over_rows(tester: OpTester) -> None:
    x = RNG.standard_normal((2, 3, 8)).astype(np.float32)
    scale = RNG.standard_normal((2, 1, 8)).astype(np.float32)  # broadcasts over leading dims
    (y,) = _run(tester, _node("LayerNormalization", ["x", "s"], ["y"]), 17, x, scale)
    want, _, _ = _layer_norm_ref(x, scale, None, -1, 1e-5)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- Attention


def _attention_ref(
    q, k, v, *, causal=False, past_k=None, past_v=None, mask=None, scale=None, softcap=0.0
):
    """Float64 attention on 4-D (B, H, S, D) inputs with head-grouped GQA."""
    q, k, v = _f64(q), _f64(k), _f64(v)
    if past_k is not None:
        k = np.concatenate([_f64(past_k), k], axis=2)
        v = np.concatenate([_f64(past_v), v], axis=2)
    hq, hkv = q.shape[1], k.shape[1]
    kk = np.repeat(k, hq // hkv, axis=1)
    vv = np.repeat(v, hq // hkv, axis=1)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = q @ kk.swapaxes(-1, -2) * scale
    if softcap:
        s = softcap * np.tanh(s / softcap)
    sq, t = s.shape[-2:]
    if mask is not None:
        s = s + (np.where(mask, 0, -np.inf) if mask.dtype == bool else _f64(mask))
    if causal:
        allowed = np.arange(t)[None, :] <= np.arange(sq)[:, None] + (t - sq)
        s = np.where(allowed, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return p @ vv, k, v


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_attention_gqa_causal_with_past(dtype: np.dtype, tester: OpTester) -> None:
    b, hq, hkv, s, p, d = 2, 8, 2, 5, 11, 64
    q = RNG.standard_normal((b, hq, s, d)).astype(dtype)
    k = RNG.standard_normal((b, hkv, s, d)).astype(dtype)
    v = RNG.standard_normal((b, hkv, s, d)).astype(dtype)
    pk = RNG.standard_normal((b, hkv, p, d)).astype(dtype)
    pv = RNG.standard_normal((b, hkv, p, d)).astype(dtype)
    node = _node("Attention", ["q", "k", "v", "", "pk", "pv"], ["y", "ok", "ov"], is_causal=1)
    y, ok, ov = _run(tester, node, 23, q, k, v, None, pk, pv)
    want, wk, wv = _attention_ref(q, k, v, causal=True, past_k=pk, past_v=pv)
    _close(y, want, dtype)
    np.testing.assert_array_equal(_f64(ok), wk)
    np.testing.assert_array_equal(_f64(ov), wv)
    if dtype == np.float32:
        ort_out = _ort(node, 23, [q, k, v, None, pk, pv], [dtype] * 3)
        np.testing.assert_allclose(y, ort_out[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_attention_3d_decode_gqa_mask(dtype: np.dtype, tester: OpTester) -> None:
    b, hq, hkv, p, d = 1, 4, 1, 20, 32
    q = RNG.standard_normal((b, 1, hq * d)).astype(dtype)
    k = RNG.standard_normal((b, 1, hkv * d)).astype(dtype)
    v = RNG.standard_normal((b, 1, hkv * d)).astype(dtype)
    pk = RNG.standard_normal((b, hkv, p, d)).astype(dtype)
    pv = RNG.standard_normal((b, hkv, p, d)).astype(dtype)
    mask = RNG.random((1, p + 1)) > 0.3
    mask[0, -1] = True
    node = _node(
        "Attention",
        ["q", "k", "v", "m", "pk", "pv"],
        ["y", "ok", "ov"],
        q_num_heads=hq,
        kv_num_heads=hkv,
        softcap=30.0,
    )
    y, ok, ov = _run(tester, node, 23, q, k, v, mask, pk, pv)
    split = lambda t, h: t.reshape(b, 1, h, d).transpose(0, 2, 1, 3)  # noqa: E731
    want, _, _ = _attention_ref(
        split(q, hq), split(k, hkv), split(v, hkv), past_k=pk, past_v=pv, mask=mask, softcap=30.0
    )
    _close(y, want.transpose(0, 2, 1, 3).reshape(b, 1, hq * d), dtype)
    assert ok.shape == (b, hkv, p + 1, d) and ov.dtype == dtype


def test_attention_large_prefill_vs_reference(tester: OpTester) -> None:
    b, hq, hkv, s, d = 1, 16, 4, 128, 64
    q = RNG.standard_normal((b, hq, s, d)).astype(np.float32)
    k = RNG.standard_normal((b, hkv, s, d)).astype(np.float32)
    v = RNG.standard_normal((b, hkv, s, d)).astype(np.float32)
    (y,) = _run(
        tester, _node("Attention", ["q", "k", "v"], ["y"], is_causal=1, scale=0.1), 23, q, k, v
    )
    want, _, _ = _attention_ref(q, k, v, causal=True, scale=0.1)
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- RotaryEmbedding


def _rope_ref(x, cos, sin, interleaved, rot):
    """Float64 reference on (B, H, S, D) with cos/sin (B, S, rot/2)."""
    x = _f64(x)
    c, s = _f64(cos)[:, None], _f64(sin)[:, None]
    xr, rest = x[..., :rot], x[..., rot:]
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
    else:
        x1, x2 = xr[..., : rot // 2], xr[..., rot // 2 :]
    r1, r2 = x1 * c - x2 * s, x1 * s + x2 * c
    rr = np.stack([r1, r2], -1).reshape(xr.shape) if interleaved else np.concatenate([r1, r2], -1)
    return np.concatenate([rr, rest], -1)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize("three_d", [False, True])
def test_rotary_embedding(
    dtype: np.dtype, interleaved: int, three_d: bool, tester: OpTester
) -> None:
    b, h, s, d, rot, max_pos = 2, 4, 7, 64, 48, 50
    x = RNG.standard_normal((b, h, s, d)).astype(dtype)
    theta = RNG.random((max_pos, rot // 2)) * 6
    cos_cache, sin_cache = np.cos(theta).astype(dtype), np.sin(theta).astype(dtype)
    pos = RNG.integers(0, max_pos, (b, s)).astype(np.int64)
    attrs = {"interleaved": interleaved, "rotary_embedding_dim": rot}
    xin = x.transpose(0, 2, 1, 3).reshape(b, s, h * d) if three_d else x
    if three_d:
        attrs["num_heads"] = h
    node = _node("RotaryEmbedding", ["x", "c", "s", "p"], ["y"], **attrs)
    (y,) = _run(tester, node, 23, xin, cos_cache, sin_cache, pos)
    want = _rope_ref(x, cos_cache[pos], sin_cache[pos], interleaved, rot)
    if three_d:
        want = want.transpose(0, 2, 1, 3).reshape(b, s, h * d)
    _close(y, want, dtype)
    if dtype == np.float32:
        (ort_y,) = _ort(node, 23, [xin, cos_cache, sin_cache, pos], [dtype])
        np.testing.assert_allclose(y, ort_y, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- quantization


def test_dequantize_blocked_int4_matches_repeat(tester: OpTester) -> None:
    w = RNG.integers(-8, 8, (64, 96)).astype(ml_dtypes.int4)
    scale = RNG.random((64, 3)).astype(np.float32)
    zp = RNG.integers(-2, 2, (64, 3)).astype(ml_dtypes.int4)
    node = _node("DequantizeLinear", ["w", "s", "z"], ["y"], axis=1, block_size=32)
    (y,) = _run(tester, node, 21, w, scale, zp)
    want = (w.astype(np.float64) - np.repeat(zp.astype(np.float64), 32, 1)) * np.repeat(
        scale, 32, 1
    )
    assert y.dtype == np.float32
    np.testing.assert_allclose(y, want, rtol=1e-6)


def test_quantize_dequantize_per_axis_round_trip(tester: OpTester) -> None:
    x = RNG.standard_normal((3, 8)).astype(np.float32)
    scale = (np.abs(x).max(axis=1) / 127).astype(np.float32)
    zp = np.zeros(3, np.int8)
    (q,) = _run(tester, _node("QuantizeLinear", ["x", "s", "z"], ["q"], axis=0), 21, x, scale, zp)
    assert q.dtype == np.int8
    (back,) = _run(
        tester, _node("DequantizeLinear", ["q", "s", "z"], ["y"], axis=0), 21, q, scale, zp
    )
    np.testing.assert_allclose(back, x, atol=float(scale.max()) / 2 + 1e-7)


# ----------------------------------------------------------------------------- Attention tiling


def _onnx_reference(node, opset: int, inputs: list[np.ndarray | None]) -> list[np.ndarray]:
    from onnx.reference import ReferenceEvaluator

    names = [n for n, a in zip(node.input, inputs, strict=False) if n and a is not None]
    arrays = [a for n, a in zip(node.input, inputs, strict=False) if n and a is not None]
    graph = helper.make_graph(
        [node],
        "g",
        [
            helper.make_tensor_value_info(n, _ORT_TYPES[a.dtype], a.shape)
            for n, a in zip(names, arrays, strict=True)
        ],
        [helper.make_tensor_value_info(n, TensorProto.UNDEFINED, None) for n in node.output if n],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    return ReferenceEvaluator(model).run(None, dict(zip(names, arrays, strict=True)))


def _qkv(b: int, hq: int, hkv: int, sq: int, skv: int, d: int) -> list[np.ndarray]:
    return [
        RNG.standard_normal((b, hq, sq, d)).astype(np.float32),
        RNG.standard_normal((b, hkv, skv, d)).astype(np.float32),
        RNG.standard_normal((b, hkv, skv, d)).astype(np.float32),
    ]


def _tiling_cases() -> list[tuple[str, int, dict, list[str], list]]:
    q, k, v = _qkv(2, 4, 2, 9, 9, 16)
    past = [RNG.standard_normal((2, 2, 5, 16)).astype(np.float32) for _ in range(2)]
    mask4 = RNG.random((2, 1, 9, 14)) > 0.2
    q2, k2, v2 = _qkv(2, 4, 1, 3, 12, 8)
    nonpad = np.array([7, 12], np.int64)
    q3, k3, v3 = _qkv(1, 2, 2, 7, 7, 8)
    past3 = [RNG.standard_normal((1, 2, 6, 8)).astype(np.float32) for _ in range(2)]
    q4, k4, v4 = _qkv(1, 2, 2, 8, 8, 8)
    fmask = (RNG.standard_normal((8, 6)) * 2).astype(np.float32)
    return [
        (
            "causal_past_gqa_boolmask",
            23,
            {"is_causal": 1},
            ["q", "k", "v", "m", "pk", "pv"],
            [q, k, v, mask4, *past],
        ),
        (
            "causal_nonpad",
            24,
            {"is_causal": 1},
            ["q", "k", "v", "", "", "", "n"],
            [q2, k2, v2, None, None, None, nonpad],
        ),
        (
            "causal_window_past",
            25,
            {"is_causal": 1, "left_window_size": 3},
            ["q", "k", "v", "", "pk", "pv"],
            [q3, k3, v3, None, *past3],
        ),
        (
            "bidirectional_window_short_mask",
            25,
            {"left_window_size": 2, "right_window_size": 1, "softcap": 2.0},
            ["q", "k", "v", "m"],
            [q4, k4, v4, fmask],
        ),
    ]


@pytest.mark.parametrize(
    "name,opset,attrs,inputs,arrays", _tiling_cases(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_attention_forms_match_onnx_reference(
    name, opset, attrs, inputs, arrays, tester: OpTester
) -> None:
    node = _node("Attention", inputs, ["y"], **attrs)
    (want,) = _onnx_reference(node, opset, arrays)
    (got,) = _run(tester, node, opset, *arrays)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=name)


# ----------------------------------------------------------------------------- Conv


@pytest.mark.parametrize(
    "xshape,wshape,attrs",
    [
        (
            (2, 6, 17, 13),
            (4, 3, 3, 2),
            {"group": 2, "strides": [2, 1], "dilations": [1, 2], "pads": [1, 0, 2, 1]},
        ),
        ((1, 8, 50), (16, 8, 3), {"auto_pad": "SAME_UPPER", "strides": [2]}),
        ((1, 4, 9, 9), (4, 1, 3, 3), {"group": 4, "auto_pad": "SAME_LOWER"}),
    ],
)
def test_conv_vs_onnxruntime(xshape: tuple, wshape: tuple, attrs: dict, tester: OpTester) -> None:
    x = RNG.standard_normal(xshape).astype(np.float32)
    w = RNG.standard_normal(wshape).astype(np.float32)
    bias = RNG.standard_normal(wshape[0]).astype(np.float32)
    node = _node("Conv", ["x", "w", "b"], ["y"], **attrs)
    (y,) = _run(tester, node, 22, x, w, bias)
    (want,) = _ort(node, 22, [x, w, bias], [np.float32])
    assert y.dtype == np.float32 and y.shape == want.shape
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4)
