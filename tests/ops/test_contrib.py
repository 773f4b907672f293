"""com.microsoft contrib kernels on every provider vs onnxruntime's CPU provider (and float64
references).

Every case builds a single-node model, runs it in onnxruntime and through onnx_genrt's
InferenceSession on the provider under test, and compares. bfloat16, which onnxruntime's CPU
provider lacks for most of these ops, is checked against float64 references.
"""

from __future__ import annotations

import math
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from onnx import ModelProto, helper, numpy_helper

from onnx_genrt.core.errors import KernelError

from .op_tester import OpTester

ort = pytest.importorskip("onnxruntime")
ort.set_default_logger_severity(3)

MS = "com.microsoft"
F32, F16, BF16 = np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)
TOL = {F32: (1e-4, 1e-5), F16: (1e-2, 1e-3), BF16: (2e-2, 2e-2), np.dtype(np.float64): (1e-7, 1e-9)}

GQA_INPUTS = [
    "query",
    "key",
    "value",
    "past_key",
    "past_value",
    "seqlens_k",
    "total_sequence_length",
    "cos_cache",
    "sin_cache",
    "position_ids",
    "attention_bias",
    "head_sink",
    "k_scale",
    "v_scale",
    "q_norm_weight",
    "k_norm_weight",
    "query_seqlens",
]


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


# ----------------------------------------------------------------------------- harness


def _model(
    op: str,
    inputs: dict[str, np.ndarray | None],
    order: list[str],
    outputs: list[str],
    out_types: list[np.dtype],
    *,
    domain: str = MS,
    consts: tuple[str, ...] = (),
    **attrs: Any,
) -> ModelProto:
    """Single-node model; names in ``consts`` become initializers, absent inputs are ''."""
    names = [n if inputs.get(n) is not None else "" for n in order]
    while names and not names[-1]:
        names.pop()
    node = helper.make_node(op, names, outputs, domain=domain, **attrs)
    graph_inputs = [
        helper.make_tensor_value_info(
            n, helper.np_dtype_to_tensor_dtype(inputs[n].dtype), inputs[n].shape
        )
        for n in names
        if n and n not in consts
    ]
    graph_outputs = [
        helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(np.dtype(t)), None)
        for n, t in zip(outputs, out_types, strict=True)
        if n
    ]
    inits = [numpy_helper.from_array(inputs[n], n) for n in consts if inputs.get(n) is not None]
    graph = helper.make_graph([node], "g", graph_inputs, graph_outputs, inits)
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(MS, 1)]
    )
    model.ir_version = 10
    return model


def _feeds(model: ModelProto, inputs: dict[str, np.ndarray | None]) -> dict[str, np.ndarray]:
    return {vi.name: inputs[vi.name].copy() for vi in model.graph.input}


def _run_ort(model: ModelProto, inputs: dict[str, np.ndarray | None]) -> list[np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, _feeds(model, inputs))


def _run_ours(
    tester: OpTester, model: ModelProto, inputs: dict[str, np.ndarray | None]
) -> list[np.ndarray]:
    return tester.run_model(model, _feeds(model, inputs))


def _f64(a: np.ndarray) -> np.ndarray:
    return np.asarray(a).astype(np.float64)


def _close(got: np.ndarray, want: np.ndarray, dtype: np.dtype, scale: float = 1.0) -> None:
    rtol, atol = TOL[np.dtype(dtype)]
    assert got.dtype == dtype, (got.dtype, dtype)
    assert got.shape == want.shape, (got.shape, want.shape)
    np.testing.assert_allclose(_f64(got), _f64(want), rtol=rtol * scale, atol=atol * scale)


def _kernel(
    tester: OpTester, op: str, args: list[np.ndarray | None], outputs: list[str], **attrs: Any
) -> Any:
    """Run the com.microsoft kernel directly on the tester's provider."""
    names = [f"i{i}" if a is not None else "" for i, a in enumerate(args)]
    node = helper.make_node(op, names, outputs, domain=MS, **attrs)
    result = tester.run(node, 1, *args)
    return result[0] if len(result) == 1 else result


# ----------------------------------------------------------------------------- references


def _rope_ref(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleaved: bool) -> np.ndarray:
    """Float64 rotary of (B, H, S, D) with cos/sin (B, S, rot/2)."""
    x = _f64(x).copy()
    rot = 2 * cos.shape[-1]
    c, s = _f64(cos)[:, None], _f64(sin)[:, None]
    if interleaved:
        x1, x2 = x[..., 0:rot:2].copy(), x[..., 1:rot:2].copy()
        x[..., 0:rot:2], x[..., 1:rot:2] = x1 * c - x2 * s, x1 * s + x2 * c
    else:
        x1, x2 = x[..., : rot // 2].copy(), x[..., rot // 2 : rot].copy()
        x[..., : rot // 2], x[..., rot // 2 : rot] = x1 * c - x2 * s, x1 * s + x2 * c
    return x


def _gqa_ref(inp: dict[str, Any], heads: int, kv_heads: int, **attrs: Any) -> tuple:
    """Float64 GroupQueryAttention: (output, present_key, present_value, per-batch totals)."""
    q, k, v = (_f64(inp[n]) for n in ("query", "key", "value"))
    b, s, _ = q.shape
    h = q.shape[2] // heads
    q = q.reshape(b, s, heads, h).transpose(0, 2, 1, 3)
    k = k.reshape(b, s, kv_heads, h).transpose(0, 2, 1, 3)
    v = v.reshape(b, s, kv_heads, h).transpose(0, 2, 1, 3)
    totals = inp["seqlens_k"].astype(int) + 1
    past = inp.get("past_key")
    cap = 0 if past is None else past.shape[2]
    length = max(cap, int(inp["total_sequence_length"]))
    pk, pv = np.zeros((b, kv_heads, length, h)), np.zeros((b, kv_heads, length, h))
    if past is not None:
        pk[:, :, :cap], pv[:, :, :cap] = _f64(past), _f64(inp["past_value"])
    window, softcap = attrs.get("local_window_size", -1), attrs.get("softcap", 0.0)
    scale = attrs.get("scale", 1 / math.sqrt(h))
    y = np.zeros((b, heads, s, h))
    for i in range(b):
        t = totals[i]
        new = min(s, t)
        p = t - new
        pos = p + np.arange(s)
        qi, ki = q[i : i + 1], k[i : i + 1]
        if attrs.get("do_rotary"):
            idx = np.minimum(pos, len(inp["cos_cache"]) - 1)
            cos, sin = inp["cos_cache"][idx][None], inp["sin_cache"][idx][None]
            inter = bool(attrs.get("rotary_interleaved"))
            qi, ki = _rope_ref(qi, cos, sin, inter), _rope_ref(ki, cos, sin, inter)
        pk[i, :, p:t], pv[i, :, p:t] = ki[0, :, :new], v[i, :, :new]
        keys = np.repeat(pk[i, :, :t], heads // kv_heads, 0)
        vals = np.repeat(pv[i, :, :t], heads // kv_heads, 0)
        sc = qi[0] @ keys.transpose(0, 2, 1) * scale
        if softcap:
            sc = softcap * np.tanh(sc / softcap)
        j = np.arange(t)[None]
        ok = j <= pos[:, None]
        if window > 0:
            ok &= pos[:, None] - j < window
        sc = np.where(ok, sc, -np.inf)
        m = sc.max(-1, keepdims=True)
        e = np.exp(sc - m)
        den = e.sum(-1, keepdims=True)
        if attrs.get("smooth_softmax") == 1:
            den += np.exp(-m)
        y[i] = (e / den) @ vals
    return y.transpose(0, 2, 1, 3).reshape(b, s, heads * h), pk, pv, totals


# ----------------------------------------------------------------------------- GQA


def _gqa_inputs(
    seed: int,
    dtype: np.dtype,
    *,
    b: int,
    s: int,
    seqlens: list[int],
    cap: int | None,
    total: int | None = None,
    heads: int = 4,
    kv_heads: int = 2,
    h: int = 32,
    rot_half: int = 16,
) -> dict[str, np.ndarray | None]:
    rng = _rng(seed)

    def rand(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(dtype)

    theta = rng.random((64, rot_half)) * 3
    seq = np.array(seqlens, np.int32)
    return {
        "query": rand(b, s, heads * h),
        "key": rand(b, s, kv_heads * h),
        "value": rand(b, s, kv_heads * h),
        "past_key": None if cap is None else rand(b, kv_heads, cap, h),
        "past_value": None if cap is None else rand(b, kv_heads, cap, h),
        "seqlens_k": seq,
        "total_sequence_length": np.array(total or int(seq.max()) + 1, np.int32),
        "cos_cache": np.cos(theta).astype(dtype),
        "sin_cache": np.sin(theta).astype(dtype),
    }


def _gqa_model(inp: dict[str, Any], dtype: np.dtype, **attrs: Any) -> ModelProto:
    if not attrs.pop("do_rotary_inputs", attrs.get("do_rotary", 0)):
        inp = {**inp, "cos_cache": None, "sin_cache": None}
    return _model(
        "GroupQueryAttention",
        inp,
        GQA_INPUTS,
        ["output", "present_key", "present_value"],
        [dtype] * 3,
        **attrs,
    )


def _check_gqa(
    tester: OpTester, inp: dict[str, Any], dtype: np.dtype, **attrs: Any
) -> list[np.ndarray]:
    """Run in both runtimes; compare valid output rows and the written cache region."""
    model = _gqa_model(inp, dtype, **attrs)
    got = _run_ours(tester, model, inp)
    want = _run_ort(model, inp)
    totals = inp["seqlens_k"].astype(int) + 1
    s = inp["query"].shape[1]
    qlens = inp.get("query_seqlens")
    for i, t in enumerate(totals):
        rows = int(qlens[i]) if qlens is not None else min(s, t)
        _close(got[0][i, :rows], want[0][i, :rows], dtype)
        for j in (1, 2):
            assert got[j].shape == want[j].shape
            _close(got[j][i, :, :t], want[j][i, :, :t], dtype)
    return got


ROTARY = [
    pytest.param({}, id="norope"),
    pytest.param({"do_rotary": 1}, id="rope"),
    pytest.param({"do_rotary": 1, "rotary_interleaved": 1}, id="rope_inter"),
]
ATTRS = {"num_heads": 4, "kv_num_heads": 2}


@pytest.mark.parametrize("rope", ROTARY)
@pytest.mark.parametrize("dtype", [F32, F16], ids=str)
def test_gqa_prompt_batch_padding(rope: dict, dtype: np.dtype, tester: OpTester) -> None:
    inp = _gqa_inputs(1, dtype, b=2, s=6, seqlens=[5, 3], cap=None)
    _check_gqa(tester, inp, dtype, **ATTRS, **rope)


@pytest.mark.parametrize("rope", ROTARY)
@pytest.mark.parametrize("dtype", [F32, F16], ids=str)
def test_gqa_decode_concat(rope: dict, dtype: np.dtype, tester: OpTester) -> None:
    inp = _gqa_inputs(2, dtype, b=2, s=1, seqlens=[7, 4], cap=7)
    got = _check_gqa(tester, inp, dtype, **ATTRS, **rope)
    assert got[1].shape == (2, 2, 8, 32)


@pytest.mark.parametrize("rope", ROTARY)
@pytest.mark.parametrize("dtype", [F32, F16], ids=str)
def test_gqa_decode_shared_buffer(rope: dict, dtype: np.dtype, tester: OpTester) -> None:
    """past_key longer than total_sequence_length: written in place and returned as present."""
    inp = _gqa_inputs(3, dtype, b=2, s=1, seqlens=[9, 5], cap=16, total=10)
    _check_gqa(tester, inp, dtype, **ATTRS, **rope)


@pytest.mark.parametrize("cap", [5, 12], ids=["concat", "shared"])
@pytest.mark.parametrize("rope", ROTARY[1:])
def test_gqa_chunked_prompt_with_past(cap: int, rope: dict, tester: OpTester) -> None:
    inp = _gqa_inputs(4, F32, b=1, s=4, seqlens=[8], cap=cap)
    _check_gqa(tester, inp, F32, **ATTRS, **rope)


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param({"local_window_size": 3}, id="window3"),
        pytest.param({"softcap": 2.5}, id="softcap"),
        pytest.param({"smooth_softmax": 1}, id="smooth"),
        pytest.param({"scale": 0.3, "local_window_size": 2, "softcap": 4.0}, id="mixed"),
    ],
)
@pytest.mark.parametrize(
    "shape",
    [
        pytest.param({"b": 1, "s": 7, "seqlens": [6], "cap": None}, id="prompt"),
        pytest.param({"b": 2, "s": 1, "seqlens": [8, 5], "cap": 12, "total": 9}, id="decode"),
    ],
)
def test_gqa_attention_options(extra: dict, shape: dict, tester: OpTester) -> None:
    inp = _gqa_inputs(5, F32, **shape)
    _check_gqa(tester, inp, F32, **ATTRS, do_rotary=1, **extra)


def test_gqa_head_sink_bias_positions(tester: OpTester) -> None:
    inp = _gqa_inputs(6, F32, b=1, s=3, seqlens=[9], cap=7)
    rng = _rng(7)
    inp["head_sink"] = rng.standard_normal(4).astype(np.float32)
    inp["attention_bias"] = rng.standard_normal((1, 4, 3, 10)).astype(np.float32)
    inp["position_ids"] = np.array([[9, 10, 11]], np.int64)
    _check_gqa(tester, inp, F32, **ATTRS, do_rotary=1, softcap=3.0)
    inp["attention_bias"] = rng.standard_normal((1, 1, 3, 10)).astype(np.float32)
    _check_gqa(tester, inp, F32, **ATTRS)


def test_gqa_first_prompt_position_ids_offset(tester: OpTester) -> None:
    """onnxruntime reads only the first position id of a first prompt."""
    inp = _gqa_inputs(8, F32, b=2, s=4, seqlens=[3, 2], cap=None)
    inp["position_ids"] = np.array([[5, 6, 7, 8], [9, 10, 11, 12]], np.int64)
    _check_gqa(tester, inp, F32, **ATTRS, do_rotary=1)


def test_gqa_packed_qkv_partial_rotary_and_gqa_ratio(tester: OpTester) -> None:
    inp = _gqa_inputs(9, F32, b=2, s=5, seqlens=[4, 2], cap=None, heads=8, rot_half=8)
    qkv = np.concatenate([inp["query"], inp["key"], inp["value"]], axis=-1)
    feeds = {**inp, "query": qkv, "key": None, "value": None}
    model = _gqa_model(feeds, F32, num_heads=8, kv_num_heads=2, do_rotary=1)
    want, got = _run_ort(model, feeds), _run_ours(tester, model, feeds)
    for i, t in enumerate((5, 3)):
        _close(got[0][i, :t], want[0][i, :t], F32)
        _close(got[1][i, :, :t], want[1][i, :, :t], F32)


def test_gqa_bidirectional(tester: OpTester) -> None:
    inp = _gqa_inputs(10, F32, b=1, s=5, seqlens=[4], cap=None)
    _check_gqa(tester, inp, F32, **ATTRS, causal=0)


def test_gqa_query_seqlens_chunk(tester: OpTester) -> None:
    inp = _gqa_inputs(11, F32, b=2, s=3, seqlens=[6, 3], cap=12, total=12)
    inp["query_seqlens"] = np.array([2, 3], np.int32)
    _check_gqa(tester, inp, F32, **ATTRS, do_rotary=1)


@pytest.mark.parametrize(
    "shape",
    [
        pytest.param({"b": 2, "s": 5, "seqlens": [4, 2], "cap": None}, id="prompt"),
        pytest.param({"b": 2, "s": 1, "seqlens": [8, 5], "cap": 12, "total": 9}, id="decode"),
    ],
)
def test_gqa_bfloat16_vs_reference(shape: dict, tester: OpTester) -> None:
    inp = _gqa_inputs(12, BF16, **shape)
    attrs = {**ATTRS, "do_rotary": 1, "local_window_size": 4, "softcap": 3.0}
    model = _gqa_model(inp, BF16, **attrs)
    got = _run_ours(tester, model, inp)
    want, pk, _, totals = _gqa_ref(inp, 4, 2, **attrs)
    for i, t in enumerate(totals):
        rows = min(inp["query"].shape[1], t)
        _close(got[0][i, :rows], want[i, :rows], BF16)
        _close(got[1][i, :, :t], pk[i, :, :t], BF16)


def test_gqa_reference_agrees_with_ort() -> None:
    """Sanity check of the float64 reference used for bfloat16."""
    inp = _gqa_inputs(13, F32, b=2, s=1, seqlens=[8, 5], cap=12, total=9)
    attrs = {**ATTRS, "do_rotary": 1, "local_window_size": 4, "softcap": 3.0, "smooth_softmax": 1}
    (y, *_) = _run_ort(_gqa_model(inp, F32, **attrs), inp)
    want = _gqa_ref(inp, 4, 2, **attrs)[0]
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-5)


def test_gqa_refuses_quantized_cache(tester: OpTester) -> None:
    from onnx_genrt.core.errors import UnsupportedOpError

    inp = _gqa_inputs(14, F32, b=1, s=1, seqlens=[0], cap=None)
    inp["k_scale"] = inp["v_scale"] = np.ones(1, np.float32)
    with pytest.raises(UnsupportedOpError, match="k_scale"):
        tester.session_alone(_gqa_model(inp, F32, **ATTRS))


@pytest.mark.parametrize(
    ("attrs", "reason"),
    [
        ({"qk_output": 1}, "qk_output is not supported"),
        ({"sliding_window_cache": 1}, "sliding_window_cache=1 needs local_window_size >= 1"),
        (
            {"sliding_window_cache": 1, "local_window_size": 4},
            "sliding_window_cache=1 needs past_key and past_value",
        ),
        ({"sliding_window_cache": 2, "local_window_size": 4}, "sliding_window_cache=2 must be 0"),
        ({"local_window_size": 0}, "local_window_size=0 must be -1 \\(no window\\) or >= 1"),
        ({"softcap": -1.0}, "softcap=-1.0 must be finite and >= 0"),
        ({"softcap": float("nan")}, "softcap=nan must be finite"),
        ({"k_quant_type": "PER_TENSOR"}, "k_quant_type='PER_TENSOR' \\(quantized KV cache\\)"),
        ({"causal": 2}, "causal=2 must be 0 or 1"),
        ({"causal": 0, "local_window_size": 4}, "local_window_size needs causal=1"),
    ],
)
def test_gqa_refuses_attributes_it_does_not_implement(attrs, reason, tester: OpTester) -> None:
    """The attribute rules every provider shares (core.op_rules.gqa_attribute_problem)."""
    from onnx_genrt.core.errors import UnsupportedOpError

    inp = _gqa_inputs(15, F32, b=1, s=1, seqlens=[0], cap=None)
    with pytest.raises(UnsupportedOpError, match=reason):
        tester.session_alone(_gqa_model(inp, F32, **{**ATTRS, **attrs}))


# ----------------------------------------------------------------------------- RotaryEmbedding


@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize("layout", ["3d", "4d", "3d_partial", "offset"])
@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=str)
def test_rotary_embedding(layout: str, interleaved: int, dtype: np.dtype, tester: OpTester) -> None:
    rng = _rng(20)
    b, n, s, h = 2, 4, 5, 16
    rot = 8 if layout == "3d_partial" else h
    x4 = rng.standard_normal((b, n, s, h)).astype(dtype)
    theta = rng.random((32, rot // 2)) * 3
    cos, sin = np.cos(theta).astype(dtype), np.sin(theta).astype(dtype)
    pos = rng.integers(0, 32 - s, (b, s)).astype(np.int64)
    attrs: dict[str, Any] = {"interleaved": interleaved}
    if layout == "3d_partial":
        attrs |= {"num_heads": n, "rotary_embedding_dim": rot}
    if layout == "offset":
        pos = np.array([7], np.int64)
    x = x4 if layout == "4d" else x4.transpose(0, 2, 1, 3).reshape(b, s, n * h)
    inp = {"x": x, "p": pos, "c": cos, "s": sin}
    model = _model("RotaryEmbedding", inp, ["x", "p", "c", "s"], ["y"], [dtype], **attrs)
    (got,) = _run_ours(tester, model, inp)
    if dtype == BF16:
        full = np.broadcast_to(pos.reshape(-1)[0] + np.arange(s), (b, s)) if pos.size == 1 else pos
        want = _rope_ref(x4, cos[full], sin[full], bool(interleaved))
        if layout != "4d":
            want = want.transpose(0, 2, 1, 3).reshape(b, s, n * h)
    else:
        (want,) = _run_ort(model, inp)
    _close(got, want, dtype)


# ----------------------------------------------------------------------------- normalizations


def _rms_ref(x: np.ndarray, g: np.ndarray, eps: float) -> np.ndarray:
    x = _f64(x)
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * _f64(g)


@pytest.mark.parametrize("domain", ["", MS])
@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=str)
def test_simplified_layer_norm(domain: str, dtype: np.dtype, tester: OpTester) -> None:
    rng = _rng(30)
    x = (rng.standard_normal((2, 3, 64)) * 2).astype(dtype)
    g = rng.standard_normal(64).astype(dtype)
    inp = {"x": x, "g": g}
    model = _model(
        "SimplifiedLayerNormalization",
        inp,
        ["x", "g"],
        ["y", "inv"],
        [dtype, F32],
        domain=domain,
        epsilon=1e-6,
    )
    got = _run_ours(tester, model, inp)
    if dtype == BF16 or domain == MS:  # onnxruntime registers it only in the ONNX domain
        x64 = _f64(x)
        inv = 1 / np.sqrt((x64**2).mean(-1, keepdims=True) + 1e-6)
        want = [_rms_ref(x, g, 1e-6), inv]
    else:
        want = _run_ort(model, inp)
    _close(got[0], want[0], dtype)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-4)
    assert got[1].shape == (2, 3, 1) and got[1].dtype == F32


@pytest.mark.parametrize("op", ["SkipSimplifiedLayerNormalization", "SkipLayerNormalization"])
@pytest.mark.parametrize("skip_shape", [(2, 3, 64), (1, 3, 64), (3, 64)], ids=str)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", [F32, F16], ids=str)
def test_skip_layer_norms(
    op: str, skip_shape: tuple, with_bias: bool, dtype: np.dtype, tester: OpTester
) -> None:
    rng = _rng(31)
    inp = {
        "x": rng.standard_normal((2, 3, 64)).astype(dtype),
        "skip": rng.standard_normal(skip_shape).astype(dtype),
        "gamma": rng.standard_normal(64).astype(dtype),
        "beta": rng.standard_normal(64).astype(dtype) if op == "SkipLayerNormalization" else None,
        "bias": rng.standard_normal(64).astype(dtype) if with_bias else None,
    }
    order = ["x", "skip", "gamma", "beta", "bias"]
    if op == "SkipSimplifiedLayerNormalization":
        order.remove("beta")
    outs = ["y", "mean", "inv", "sum"]
    model = _model(op, inp, order, outs, [dtype, F32, F32, dtype], epsilon=1e-5)
    want, got = _run_ort(model, inp), _run_ours(tester, model, inp)
    _close(got[0], want[0], dtype, scale=2.0)
    if op == "SkipLayerNormalization":
        np.testing.assert_allclose(got[1], want[1], rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(got[2], want[2], rtol=1e-3, atol=1e-3)
    _close(got[3], want[3], dtype)


@pytest.mark.parametrize("cols", [64, 896, 60])
@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=str)
def test_rms_norms_asked_only_for_their_rows(cols: int, dtype: np.dtype, tester: OpTester) -> None:
    """SimplifiedLayerNormalization, and SkipSimplifiedLayerNormalization with its sum (2-D,
    its default epsilon), asked for no statistics: rows of whole 16-byte chunks (64, 896) run
    on CUDA as a GEMM's fused norm makes them, other widths (60) on the general kernels; both
    against float64."""
    rng = _rng(33)
    x = (rng.standard_normal((7, cols)) * 2).astype(dtype)
    skip = rng.standard_normal((7, cols)).astype(dtype)
    g = rng.standard_normal(cols).astype(dtype)
    plain = _model(
        "SimplifiedLayerNormalization", {"x": x, "g": g}, ["x", "g"], ["y"], [dtype], epsilon=1e-6
    )
    (y,) = _run_ours(tester, plain, {"x": x, "g": g})
    _close(y, _rms_ref(x, g, 1e-6), dtype)
    inp = {"x": x, "skip": skip, "g": g}
    fused = _model(
        "SkipSimplifiedLayerNormalization",
        inp,
        ["x", "skip", "g"],
        ["y", "", "", "sum"],
        [dtype, F32, F32, dtype],
    )
    y, total = _run_ours(tester, fused, inp)
    h = (_f64(x) + _f64(skip)).astype(dtype)
    _close(y, _rms_ref(h, g, 1e-12), dtype, scale=2.0)
    _close(total, h, dtype)


# ----------------------------------------------------------------------------- MatMulNBits


def _pack(vals: np.ndarray, bits: int) -> np.ndarray:
    """Integers < 2**bits -> uint8, packed low bits first along the last axis."""
    per = 8 // bits
    v = vals.astype(np.uint16).reshape(*vals.shape[:-1], -1, per)
    out = np.zeros(v.shape[:-1], np.uint16)
    for i in range(per):
        out |= v[..., i] << (i * bits)
    return out.astype(np.uint8)


def _quantize_nbits(w: np.ndarray, bits: int, block: int, zero: str) -> dict[str, np.ndarray]:
    """Block-quantize (N, K) ``w`` into MatMulNBits' B / scales / zero_points layout."""
    n, k = w.shape
    nb = -(-k // block)
    wp = np.zeros((n, nb * block), np.float64)
    wp[:, :k] = w
    blocks = wp.reshape(n, nb, block)
    qmax = (1 << bits) - 1
    lo, hi = np.minimum(blocks.min(-1), 0), np.maximum(blocks.max(-1), 0)
    if zero == "none":
        scale = np.maximum(np.abs(blocks).max(-1), 1e-6) / (1 << (bits - 1))
        zp = np.full((n, nb), 1 << (bits - 1))
    else:
        scale = np.maximum(hi - lo, 1e-6) / qmax
        zp = np.clip(np.round(-lo / scale), 0, qmax)
    q = np.clip(np.round(blocks / scale[..., None]) + zp[..., None], 0, qmax).astype(np.int64)
    out = {"B": _pack(q, bits), "scales": scale.astype(np.float32)}
    if zero == "uint8":
        zpad = np.zeros((n, -(-nb * bits // 8) * (8 // bits)), np.int64)
        zpad[:, :nb] = zp
        out["zero_points"] = _pack(zpad, bits)
    elif zero == "float":
        out["zero_points"] = zp.astype(np.float32)
    out["ref"] = ((q - zp[..., None]) * scale[..., None]).reshape(n, -1)[:, :k]
    return out


def _nbits_case(
    seed: int,
    m: int | tuple,
    k: int,
    n: int,
    bits: int,
    block: int,
    zero: str,
    bias: bool,
    dtype: np.dtype,
    accuracy: int = 0,
) -> tuple[ModelProto, dict[str, Any], np.ndarray]:
    """Model, inputs and float64 result of one MatMulNBits case; ``m``: A's leading dims."""
    rng = _rng(seed)
    qw = _quantize_nbits(rng.standard_normal((n, k)), bits, block, zero)
    lead = m if isinstance(m, tuple) else (m,)
    inp: dict[str, Any] = {
        "A": rng.standard_normal((*lead, k)).astype(dtype),
        "B": qw["B"],
        "scales": qw["scales"].astype(dtype),
        "zero_points": qw.get("zero_points"),
        "g_idx": None,
        "bias": rng.standard_normal(n).astype(dtype) if bias else None,
    }
    if inp["zero_points"] is not None and inp["zero_points"].dtype != np.uint8:
        inp["zero_points"] = inp["zero_points"].astype(dtype)
    model = _model(
        "MatMulNBits",
        inp,
        ["A", "B", "scales", "zero_points", "g_idx", "bias"],
        ["Y"],
        [dtype],
        consts=("B", "scales", "zero_points", "bias"),
        K=k,
        N=n,
        bits=bits,
        block_size=block,
        accuracy_level=accuracy,
    )
    want = _f64(inp["A"]) @ qw["ref"].T + (_f64(inp["bias"]) if bias else 0.0)
    return model, inp, want


@pytest.mark.parametrize("m", [1, 7])
@pytest.mark.parametrize("zero", ["none", "uint8"])
@pytest.mark.parametrize("block", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("bits", [4, 8])
def test_matmul_nbits(bits: int, block: int, zero: str, m: int, tester: OpTester) -> None:
    model, inp, want = _nbits_case(40, m, 320, 24, bits, block, zero, False, F32)
    (got,) = _run_ours(tester, model, inp)
    (ort_y,) = _run_ort(model, inp)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    _close(got, ort_y, F32, scale=10.0)  # ORT's blocked kernels sum in another order


@pytest.mark.parametrize("m", [1, 7])
def test_matmul_nbits_refuses_a_whose_width_is_not_k(m: int, tester: OpTester) -> None:
    """A run whose A has K + 8 columns fails naming the node and both widths (no kernel
    reads past or short of the packed rows); the rule is core.op_rules.matmul_nbits_dims."""
    qw = _quantize_nbits(_rng(43).standard_normal((24, 32)), 4, 32, "uint8")
    a = _rng(44).standard_normal((m, 40)).astype(F32)
    node = helper.make_node(
        "MatMulNBits", ["A", "B", "scales", "zp"], ["Y"], "nbits_wide_a", domain=MS,
        K=32, N=24, bits=4, block_size=32,
    )  # fmt: skip
    with pytest.raises((KernelError, ValueError), match=r"nbits_wide_a.*A has 40 columns, K is 32"):
        tester.run(node, 1, a, qw["B"], qw["scales"], qw["zero_points"])


@pytest.mark.parametrize(
    "bits,zero,bias,dtype",
    [
        (4, "float", False, F32),
        (4, "uint8", True, F32),
        (2, "uint8", True, F32),
        (2, "none", False, F32),
        (4, "uint8", True, F16),
        (8, "none", True, F16),
    ],
)
def test_matmul_nbits_variants(
    bits: int, zero: str, bias: bool, dtype: np.dtype, tester: OpTester
) -> None:
    model, inp, want = _nbits_case(41, 5, 96, 40, bits, 32, zero, bias, dtype)
    (got,) = _run_ours(tester, model, inp)
    (ort_y,) = _run_ort(model, inp)
    _close(got, ort_y, dtype, scale=10.0 if dtype == F32 else 3.0)
    _close(got, want, dtype, scale=10.0 if dtype == F32 else 3.0)


def test_matmul_nbits_bfloat16_3d_and_float_zero_8bit(tester: OpTester) -> None:
    model, inp, want = _nbits_case(42, (2, 3), 64, 16, 4, 16, "uint8", True, BF16)
    (got,) = _run_ours(tester, model, inp)
    _close(got, want, BF16, scale=4.0)
    # 8-bit weights with float zero points: onnxruntime's CPU provider refuses them.
    model, inp, want = _nbits_case(43, 3, 64, 16, 8, 32, "float", False, F32)
    (got,) = _run_ours(tester, model, inp)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_matmul_nbits_empty_weight_gives_bias(tester: OpTester) -> None:
    a = _rng(45).standard_normal((3, 32)).astype(np.float32)
    bias = np.arange(8, dtype=np.float32)
    y = _kernel(
        tester,
        "MatMulNBits",
        [a, np.zeros((8, 0, 16), np.uint8), np.zeros((8, 0), np.float32), None, None, bias],
        ["y"],
        K=32,
        N=8,
        bits=4,
        block_size=32,
    )
    np.testing.assert_array_equal(y, np.broadcast_to(bias, (3, 8)))


# 4-bit weights with M <= PACKED_MAX_M (32) run packed (_int4_matmul); larger M the float32 copy.
@pytest.mark.parametrize("m", [1, 5, 16, 32, 40])
@pytest.mark.parametrize("zero", ["none", "uint8", "float"])
@pytest.mark.parametrize("block", [16, 32, 64, 128])
def test_matmul_nbits_int4_packed(m: int, zero: str, block: int, tester: OpTester) -> None:
    # K = 200 is no multiple of the block; N = 150 leaves a partial tile.
    model, inp, want = _nbits_case(47, m, 200, 150, 4, block, zero, block == 32, F32)
    (got,) = _run_ours(tester, model, inp)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    (ort_y,) = _run_ort(model, inp)
    _close(got, ort_y, F32, scale=10.0)


@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("k,n", [(201, 7), (512, 1100), (64, 64)])
def test_matmul_nbits_int4_packed_shapes(m: int, k: int, n: int, tester: OpTester) -> None:
    """Odd K, more rows than one wide tile, a single tile; with a bias."""
    model, inp, want = _nbits_case(48, m, k, n, 4, 32, "uint8", True, F32)
    (got,) = _run_ours(tester, model, inp)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- GatherBlockQuantized


def _gbq_case(kind: str, zero: bool, seed: int) -> tuple[dict[str, Any], dict[str, Any], Any]:
    """(inputs, attrs, float64 dequantized table) for one data layout; blocks of 16."""
    rng = _rng(seed)
    block = 16
    if kind.startswith("uint8"):
        bits = 4 if kind == "uint8_4bit" else 8
        q = rng.integers(0, 1 << bits, (12, 64))
        zp = rng.integers(0, 1 << bits, (12, 4)) if zero else np.full((12, 4), 1 << (bits - 1))
        pack = (lambda a: _pack(a, 4)) if bits == 4 else (lambda a: a.astype(np.uint8))
        inp = {"data": pack(q), "zero_points": pack(zp) if zero else None}
        attrs = {"bits": bits, "block_size": block}
        axis = 1
    else:  # int4 / uint4 elements; "axis0": quantized along axis 0, gathered along axis 1
        t = ml_dtypes.int4 if kind.startswith("int4") else ml_dtypes.uint4
        lo, hi = (-8, 8) if kind.startswith("int4") else (0, 16)
        axis = 0 if kind.endswith("axis0") else 1
        shape, pshape = ((32, 64), (2, 64)) if axis == 0 else ((12, 64), (12, 4))
        q = rng.integers(lo, hi, shape)
        zp = rng.integers(lo, hi, pshape) if zero else np.zeros(pshape, np.int64)
        inp = {"data": q.astype(t), "zero_points": zp.astype(t) if zero else None}
        attrs = {"block_size": block, "quantize_axis": axis, "gather_axis": 1 - axis}
    inp["scales"] = (rng.random(zp.shape) + 0.1).astype(np.float32)
    table = (q - np.repeat(zp, block, axis)) * np.repeat(inp["scales"], block, axis)
    return inp, attrs, table


@pytest.mark.parametrize("zero", [False, True])
@pytest.mark.parametrize("kind", ["uint8_4bit", "uint8_8bit", "int4", "uint4", "int4_axis0"])
@pytest.mark.parametrize("dtype", [F32, F16], ids=str)
def test_gather_block_quantized(kind: str, zero: bool, dtype: np.dtype, tester: OpTester) -> None:
    inp, attrs, table = _gbq_case(kind, zero, 50)
    inp["scales"] = inp["scales"].astype(dtype)
    g = attrs.get("gather_axis", 0)
    dim = table.shape[g]
    idx = np.array([[1, dim - 1], [-1, -dim], [0, 2]], np.int64)  # both ends, negatives
    inp["indices"] = idx
    model = _model(
        "GatherBlockQuantized",
        inp,
        ["data", "indices", "scales", "zero_points"],
        ["y"],
        [dtype],
        consts=("data", "scales", "zero_points"),
        **attrs,
    )
    (got,) = _run_ours(tester, model, inp)
    (want,) = _run_ort(model, inp)
    _close(got, want, dtype)
    ref = np.take(table, np.where(idx < 0, idx + dim, idx), axis=g)
    _close(got, ref.astype(dtype), dtype)


@pytest.mark.parametrize("kind", ["uint8_4bit", "int4", "int4_axis0"])
@pytest.mark.parametrize("offset", [0, 3, -1], ids=["dim", "dim+3", "-dim-1"])
def test_gather_block_quantized_refuses_indices_out_of_range(
    kind: str, offset: int, tester: OpTester
) -> None:
    """onnxruntime's CPU kernel returns zeros for such an index; ours raises, naming it."""
    inp, attrs, table = _gbq_case(kind, True, 52)
    dim = table.shape[attrs.get("gather_axis", 0)]
    bad = dim + offset if offset >= 0 else -dim + offset
    inp["indices"] = np.array([[0, 1], [bad, 2]], np.int64)
    model = _model(
        "GatherBlockQuantized",
        inp,
        ["data", "indices", "scales", "zero_points"],
        ["y"],
        [F32],
        consts=("data", "scales", "zero_points"),
        **attrs,
    )
    with pytest.raises(KernelError) as info:
        _run_ours(tester, model, inp)
    message = str(info.value)
    assert "GatherBlockQuantized" in message
    assert f"indices value {bad} out of range for axis of size {dim}" in message


# ----------------------------------------------------------------------------- GELU family


def _gelu_ref(x: np.ndarray, tanh: bool) -> np.ndarray:
    if tanh:
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    erf = np.vectorize(math.erf)
    return 0.5 * x * (1 + erf(x / math.sqrt(2)))


ACTS = [
    pytest.param("FastGelu", True, {}, id="FastGelu_bias"),
    pytest.param("FastGelu", False, {}, id="FastGelu"),
    pytest.param("BiasGelu", True, {}, id="BiasGelu"),
    pytest.param("Gelu", False, {}, id="Gelu"),
    pytest.param("QuickGelu", False, {"alpha": 1.5}, id="QuickGelu_alpha"),
    pytest.param("QuickGelu", False, {}, id="QuickGelu"),
]


@pytest.mark.parametrize("op,with_bias,attrs", ACTS)
@pytest.mark.parametrize("dtype", [F32, F16, BF16, np.dtype(np.float64)], ids=str)
def test_gelu_family(
    op: str, with_bias: bool, attrs: dict, dtype: np.dtype, tester: OpTester
) -> None:
    rng = _rng(60)
    inp = {
        "x": (rng.standard_normal((3, 5, 32)) * 3).astype(dtype),
        "b": rng.standard_normal(32).astype(dtype) if with_bias else None,
    }
    model = _model(op, inp, ["x", "b"], ["y"], [dtype], **attrs)
    (got,) = _run_ours(tester, model, inp)
    h = _f64(inp["x"]) + (_f64(inp["b"]) if with_bias else 0.0)
    if op == "QuickGelu":
        ref = h / (1 + np.exp(-attrs.get("alpha", 1.702) * h))
    else:
        ref = _gelu_ref(h, tanh=op == "FastGelu")
    _close(got, ref.astype(dtype) if dtype != F32 else ref, dtype, scale=2.0)
    if dtype in (F32, F16):
        (want,) = _run_ort(model, inp)  # onnxruntime has each of these in float and half
        _close(got, want, dtype, scale=2.0)


@pytest.mark.parametrize(
    "scale_shape,block",
    [((12, 4), 16), ((1, 4), 16), ((12, 1), 0)],
    ids=["blocked", "broadcast_rows", "whole_row"],
)
def test_gather_block_quantized_float8(scale_shape: tuple, block: int, tester: OpTester) -> None:
    rng = _rng(51)
    inp = {
        "data": rng.standard_normal((12, 64)).astype(ml_dtypes.float8_e4m3fn),
        "indices": np.array([[1, -1], [3, 11]], np.int64),
        "scales": (rng.random(scale_shape) + 0.1).astype(np.float32),
    }
    model = _model(
        "GatherBlockQuantized",
        inp,
        ["data", "indices", "scales"],
        ["y"],
        [F32],
        consts=("data", "scales"),
        block_size=block,
    )
    (got,) = _run_ours(tester, model, inp)
    (want,) = _run_ort(model, inp)
    _close(got, want, F32)
    inp["indices"] = np.array([[1, -1], [3, 12]], np.int64)
    with pytest.raises(KernelError, match="indices value 12 out of range for axis of size 12"):
        _run_ours(tester, model, inp)
