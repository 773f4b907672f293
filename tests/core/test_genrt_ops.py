"""The ``onnx_genrt`` op domain (``core.genrt_ops``): each op's standard-op body, run where no
provider has the op, equals the CPU provider's fused kernel (where it has one), a numpy
float64 reference, and onnxruntime running the same body."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_genrt.core.errors import ModelLoadError, UnsupportedOpError
from onnx_genrt.core.genrt_ops import BODY_OPSETS, GENRT_OPS, expand
from onnx_genrt.core.kernels import (
    GENRT_DOMAIN,
    MS_DOMAIN,
    KernelDef,
    KernelRegistry,
    NodeInfo,
    TensorType,
)
from onnx_genrt.providers.cpu.kernels import REGISTRY
from onnx_genrt.providers.cpu.provider import CPUProvider
from onnx_genrt.session import InferenceSession
from tests.models import standard_ops_cpu

ort = pytest.importorskip("onnxruntime")

F32, F16, BF16 = np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)


def _model(op: str, feeds: dict, weights: dict, outputs: list[str], **attrs) -> onnx.ModelProto:
    """One ``onnx_genrt::op`` node: ``feeds`` become graph inputs with their static shapes,
    ``weights`` initializers; an empty name in ``outputs`` leaves that output out."""
    names = [*feeds, *weights]
    order = [n for n in attrs.pop("inputs", names)]
    node = helper.make_node(op, order, outputs, name=f"{op}_node", domain=GENRT_DOMAIN, **attrs)
    graph = helper.make_graph(
        [node],
        "g",
        [
            helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
            for n, v in feeds.items()
        ],
        [helper.make_empty_tensor_value_info(o) for o in outputs if o],
        [numpy_helper.from_array(v, n) for n, v in weights.items()],
    )
    opsets = [helper.make_opsetid(d, v) for d, v in (("", 21), (MS_DOMAIN, 1), (GENRT_DOMAIN, 1))]
    return helper.make_model(graph, opset_imports=opsets)


def _genrt_steps(session: InferenceSession) -> list[str]:
    return [p.op for p in session.placement() if p.op.startswith(f"{GENRT_DOMAIN}::")]


def _run_body(model: onnx.ModelProto, feeds: dict) -> dict[str, np.ndarray]:
    """The model on a CPU provider without onnx_genrt kernels: the node's body runs."""
    session = InferenceSession(model, [standard_ops_cpu()], cpu_fallback=False)
    assert _genrt_steps(session) == []
    names = [o.name for o in model.graph.output]
    return dict(zip(names, session.run(names, feeds), strict=True))


def _run_fused(model: onnx.ModelProto, feeds: dict) -> dict[str, np.ndarray]:
    """The model on the CPU provider, whose onnx_genrt kernel runs the node."""
    session = InferenceSession(model, ["cpu"], cpu_fallback=False)
    assert _genrt_steps(session) == [f"{GENRT_DOMAIN}::{model.graph.node[0].op_type}"]
    names = [o.name for o in model.graph.output]
    return dict(zip(names, session.run(names, feeds), strict=True))


def _run_ort_body(model: onnx.ModelProto, feeds: dict) -> dict[str, np.ndarray]:
    """The node's body as its own model, run by onnxruntime: an independent reading of the
    standard ops it is made of."""
    node = model.graph.node[0]
    consts = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    types = [
        TensorType(consts[n].dtype, consts[n].shape)
        if n in consts
        else TensorType(feeds[n].dtype, feeds[n].shape)
        if n
        else None
        for n in node.input
    ]
    body = expand(NodeInfo.from_proto(node, 1), types)
    graph = helper.make_graph(
        body.nodes,
        "body",
        [
            helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
            for n, v in feeds.items()
        ],
        list(model.graph.output),
        [numpy_helper.from_array(v, n) for n, v in {**consts, **body.initializers}.items()],
    )
    opsets = [helper.make_opsetid(d, v) for d, v in BODY_OPSETS.items()]
    assert all(body.opset(n) == BODY_OPSETS[n.domain] for n in body.nodes)
    sess = ort.InferenceSession(helper.make_model(graph, opset_imports=opsets).SerializeToString())
    names = [o.name for o in model.graph.output]
    return dict(zip(names, sess.run(names, feeds), strict=True))


def _tol(dtype) -> dict:
    """One rounding of the dtype (float16: 2**-11, bfloat16: 2**-8), relative and absolute."""
    ulp = {F16: 2e-3, BF16: 1e-2}.get(np.dtype(dtype))
    return {"rtol": ulp, "atol": ulp} if ulp else {"rtol": 1e-5, "atol": 1e-6}


def _silu64(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    g64 = g.astype(np.float64)
    return g64 / (1.0 + np.exp(-g64)) * u.astype(np.float64)


# -- SiluMul, ArgMaxProb (the CPU provider has fused kernels) -------------------------------


@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=str)
@pytest.mark.parametrize("split", [0, 1])
def test_silu_mul_body_equals_the_kernel_and_float64(split, dtype):
    rng = np.random.default_rng(split)
    g = (3 * rng.standard_normal((2, 3, 16))).astype(dtype)
    u = rng.standard_normal((2, 3, 16)).astype(dtype)
    feeds = {"gu": np.concatenate([g, u], axis=-1)} if split else {"g": g, "u": u}
    model = _model("SiluMul", feeds, {}, ["y"], split=split)
    body, fused = _run_body(model, feeds)["y"], _run_fused(model, feeds)["y"]
    assert body.dtype == dtype and body.shape == g.shape
    # the same operations in the same order (16-bit: in float32, rounded once): bit-equal
    np.testing.assert_array_equal(body, fused)
    np.testing.assert_allclose(body, _silu64(g, u), **_tol(dtype))
    if dtype != BF16:  # onnxruntime's Python API takes no bfloat16 arrays
        np.testing.assert_allclose(_run_ort_body(model, feeds)["y"], body, **_tol(dtype))


@pytest.mark.parametrize("dtype", [F32, F16], ids=str)
@pytest.mark.parametrize("outputs", [("i", "p"), ("i", ""), ("", "p")], ids="-".join)
def test_argmax_prob_body_equals_the_kernel_and_float64(outputs, dtype):
    rng = np.random.default_rng(1)
    x = (2 * rng.standard_normal((3, 2, 50))).astype(dtype)
    x[0, 0, 7] = x[0, 0, 30] = x[0, 0].max() + 1  # a tie: the first index wins
    feeds = {"x": x}
    model = _model("ArgMaxProb", feeds, {}, list(outputs))
    body, fused = _run_body(model, feeds), _run_fused(model, feeds)
    x64 = x.astype(np.float64)
    if outputs[0]:
        want = np.argmax(x64, axis=-1)
        assert want[0, 0] == 7
        np.testing.assert_array_equal(body["i"], want)
        np.testing.assert_array_equal(fused["i"], want)
    if outputs[1]:
        want = 1.0 / np.exp(x64 - x64.max(axis=-1, keepdims=True)).sum(axis=-1)
        assert body["p"].dtype == dtype
        np.testing.assert_allclose(body["p"], want, **_tol(dtype))
        np.testing.assert_allclose(fused["p"], body["p"], **_tol(dtype))
    ort_out = _run_ort_body(model, feeds)
    for name, value in body.items():
        np.testing.assert_allclose(ort_out[name], value, **_tol(dtype))


@pytest.mark.filterwarnings("ignore:invalid value encountered in subtract:RuntimeWarning")
@pytest.mark.parametrize("dtype", [F32, F16], ids=str)
@pytest.mark.parametrize("bad", [None, np.nan, np.inf, -np.inf], ids=str)
def test_nonfinite_body_equals_the_kernel_and_numpy(bad, dtype):  # the body's inf - inf
    """0 for finite x (large values included: x - x is 0 however large x is), NaN when one
    element is NaN or infinite; the body, the CPU kernel and onnxruntime agree."""
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((3, 37)) * 1e4).astype(dtype)
    x[1, 2] = np.finfo(dtype).max
    if bad is not None:
        x[2, 36] = bad
    feeds = {"x": x}
    model = _model("NonFinite", feeds, {}, ["y"])
    body, fused = _run_body(model, feeds)["y"], _run_fused(model, feeds)["y"]
    want = np.float64(0) if bad is None else np.float64(np.nan)
    for got in (body, fused, _run_ort_body(model, feeds)["y"]):
        assert got.shape == () and got.dtype == dtype
        np.testing.assert_array_equal(got, want)
        assert bad is not None or not np.signbit(got)  # +0: what x - x gives


# -- NormMatMul(NBits), SiluMulMatMul(NBits): bodies against float64 and onnxruntime -------

K, N, BLOCK = 64, 24, 32


def _nbits_weight(rng, n: int, k: int, zero_points: bool):
    """(inputs B, scales[, zero_points] of a 4-bit MatMulNBits, its [K, N] float64 weight)."""
    nb = k // BLOCK
    q = rng.integers(0, 16, (n, nb, BLOCK))
    packed = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
    scales = rng.uniform(0.01, 0.05, (n, nb)).astype(np.float32)
    zeros = rng.integers(0, 16, (n, nb)) if zero_points else np.full((n, nb), 8)
    weights = {"B": packed, "scales": scales.reshape(-1)}
    if zero_points:
        padded = np.concatenate([zeros, np.zeros((n, nb % 2), np.int64)], axis=1)
        weights["zp"] = (padded[:, 0::2] | (padded[:, 1::2] << 4)).astype(np.uint8).reshape(-1)
    w = (q - zeros[..., None]) * scales.astype(np.float64)[..., None]
    return weights, w.reshape(n, k).T


def _rms64(x: np.ndarray, gamma: np.ndarray, eps: float) -> np.ndarray:
    x64 = x.astype(np.float64)
    return x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps) * gamma


def _nbits_attrs(n: int, k: int) -> dict:
    return {"K": k, "N": n, "bits": 4, "block_size": BLOCK, "projection_opset": 1}


NORM_OUTPUTS = {"y": ["y"], "y-sum": ["y", "sum"], "all": ["y", "sum", "normed"]}
NORM_OUTPUTS["y-normed"] = ["y", "", "normed"]


@pytest.mark.parametrize("outputs", list(NORM_OUTPUTS))
@pytest.mark.parametrize("skip", [True, False], ids=["skip", "no-skip"])
@pytest.mark.parametrize("proj", ["MatMul", "NBits", "NBits-zp"])
def test_norm_matmul_bodies_equal_float64(proj, skip, outputs):
    outputs = NORM_OUTPUTS[outputs]
    if "sum" in outputs and not skip:
        with pytest.raises(ModelLoadError, match=r"'NormMatMul.*sum output \(1\) needs a skip"):
            expand(
                NodeInfo(
                    "NormMatMul",
                    "NormMatMul",
                    GENRT_DOMAIN,
                    1,
                    {},
                    ("x", "", "g", "w"),
                    tuple(outputs),
                )
            )
        return
    rng = np.random.default_rng(len(outputs))
    x = rng.standard_normal((1, 3, K)).astype(np.float32)
    r = rng.standard_normal((1, 3, K)).astype(np.float32)
    gamma = (1 + 0.1 * rng.standard_normal(K)).astype(np.float32)
    feeds = {"x": x, "skip": r} if skip else {"x": x}
    inputs = ["x", "skip" if skip else "", "gamma"]
    eps = 1e-6
    if proj == "MatMul":
        w = rng.standard_normal((K, N)).astype(np.float32) / 8
        weights, w64, op, attrs = {"W": w}, w.astype(np.float64), "NormMatMul", {}
        attrs["projection_opset"] = 21
    else:
        weights, w64 = _nbits_weight(rng, N, K, proj == "NBits-zp")
        op, attrs = "NormMatMulNBits", _nbits_attrs(N, K)
    weights = {"gamma": gamma, **weights}
    model = _model(
        op, feeds, weights, outputs, inputs=[*inputs, *list(weights)[1:]], epsilon=eps, **attrs
    )
    total = x.astype(np.float64) + (r if skip else 0)
    normed = _rms64(total, gamma, eps)
    want = {"y": normed @ w64, "sum": total, "normed": normed}
    body = _run_body(model, feeds)
    for name, value in body.items():
        np.testing.assert_allclose(value, want[name], rtol=1e-4, atol=1e-4, err_msg=name)
    ort_out = _run_ort_body(model, feeds)
    for name, value in body.items():
        np.testing.assert_allclose(ort_out[name], value, rtol=1e-4, atol=1e-4, err_msg=name)


@pytest.mark.parametrize("act", [True, False], ids=["act", "no-act"])
@pytest.mark.parametrize("split", [0, 1])
@pytest.mark.parametrize("proj", ["MatMul", "NBits", "NBits-zp"])
def test_silu_mul_matmul_bodies_equal_float64(proj, split, act):
    rng = np.random.default_rng(split + 2 * act)
    g = (2 * rng.standard_normal((1, 3, K))).astype(np.float32)
    u = rng.standard_normal((1, 3, K)).astype(np.float32)
    feeds = {"gu": np.concatenate([g, u], axis=-1)} if split else {"g": g, "u": u}
    inputs = ["gu", ""] if split else ["g", "u"]
    if proj == "MatMul":
        w = rng.standard_normal((K, N)).astype(np.float32) / 8
        weights, w64, op, attrs = {"W": w}, w.astype(np.float64), "SiluMulMatMul", {}
        attrs["projection_opset"] = 21
    else:
        weights, w64 = _nbits_weight(rng, N, K, proj == "NBits-zp")
        op, attrs = "SiluMulMatMulNBits", _nbits_attrs(N, K)
    outputs = ["y", "act"] if act else ["y"]
    model = _model(op, feeds, weights, outputs, inputs=[*inputs, *weights], split=split, **attrs)
    activations = _silu64(g, u)
    want = {"y": activations @ w64, "act": activations}
    body = _run_body(model, feeds)
    assert set(body) == set(outputs)
    for name, value in body.items():
        np.testing.assert_allclose(value, want[name], rtol=1e-4, atol=1e-4, err_msg=name)
    ort_out = _run_ort_body(model, feeds)
    for name, value in body.items():
        np.testing.assert_allclose(ort_out[name], value, rtol=1e-4, atol=1e-4, err_msg=name)


def _check_body(model, feeds, outputs, want) -> None:
    """The body's named outputs: exactly ``outputs``, close to ``want`` (float64) and to
    onnxruntime's run of the same body."""
    body = _run_body(model, feeds)
    assert set(body) == {o for o in outputs if o}
    for name, value in body.items():
        np.testing.assert_allclose(value, want[name], rtol=1e-4, atol=1e-4, err_msg=name)
    ort_out = _run_ort_body(model, feeds)
    for name, value in body.items():
        np.testing.assert_allclose(ort_out[name], value, rtol=1e-4, atol=1e-4, err_msg=name)


GATED_OUTPUTS = {
    "y": ["y"],
    "y-sum": ["y", "sum"],
    "all": ["y", "sum", "normed", "gate_up"],
    "y-gate_up": ["y", "", "", "gate_up"],
}


@pytest.mark.parametrize("outputs", list(GATED_OUTPUTS))
@pytest.mark.parametrize("proj", ["MatMul", "NBits", "NBits-zp"])
def test_norm_matmul_silu_mul_bodies_equal_float64(proj, outputs):
    """NormMatMulSiluMul(NBits): the norm, the gate/up projection, SiluMul of its halves."""
    outputs = GATED_OUTPUTS[outputs]
    rng = np.random.default_rng(len(outputs) + 7 * len(proj))
    F = 20
    x = rng.standard_normal((1, 3, K)).astype(np.float32)
    r = rng.standard_normal((1, 3, K)).astype(np.float32)
    gamma = (1 + 0.1 * rng.standard_normal(K)).astype(np.float32)
    feeds = {"x": x, "skip": r}
    if proj == "MatMul":
        w = rng.standard_normal((K, 2 * F)).astype(np.float32) / 8
        weights, w64, op = {"W": w}, w.astype(np.float64), "NormMatMulSiluMul"
        attrs = {"projection_opset": 21}
    else:
        weights, w64 = _nbits_weight(rng, 2 * F, K, proj == "NBits-zp")
        op, attrs = "NormMatMulNBitsSiluMul", _nbits_attrs(2 * F, K)
    weights = {"gamma": gamma, **weights}
    eps = 1e-6
    model = _model(
        op, feeds, weights, outputs, inputs=["x", "skip", *weights], epsilon=eps, **attrs
    )
    total = x.astype(np.float64) + r
    normed = _rms64(total, gamma, eps)
    gate_up = normed @ w64
    act = _silu64(gate_up[..., :F], gate_up[..., F:])
    want = {"y": act, "sum": total, "normed": normed, "gate_up": gate_up}
    _check_body(model, feeds, outputs, want)


MLP_OUTPUTS = {
    "y": ["y"],
    "y-sum": ["y", "sum"],
    "all": ["y", "sum", "gate_up", "act", "normed"],
    "y-act": ["y", "", "", "act"],
}


@pytest.mark.parametrize("outputs", list(MLP_OUTPUTS))
@pytest.mark.parametrize("skip", [True, False], ids=["skip", "no-skip"])
def test_norm_gated_mlp_body_equals_float64(skip, outputs):
    outputs = MLP_OUTPUTS[outputs]
    if "sum" in outputs and not skip:
        return  # refused as NormMatMul's (the same norm; see that test)
    rng = np.random.default_rng(len(outputs) + 5 * skip)
    F = 40
    x = rng.standard_normal((1, 3, K)).astype(np.float32)
    r = rng.standard_normal((1, 3, K)).astype(np.float32)
    gamma = (1 + 0.1 * rng.standard_normal(K)).astype(np.float32)
    w_gate_up = (rng.standard_normal((K, 2 * F)) / 8).astype(np.float32)
    w_down = (rng.standard_normal((F, N)) / 8).astype(np.float32)
    feeds = {"x": x, "skip": r} if skip else {"x": x}
    weights = {"gamma": gamma, "W_gate_up": w_gate_up, "W_down": w_down}
    inputs = ["x", "skip" if skip else "", *weights]
    eps = 1e-6
    model = _model(
        "NormGatedMLP", feeds, weights, outputs, inputs=inputs, epsilon=eps, projection_opset=21
    )
    total = x.astype(np.float64) + (r if skip else 0)
    normed = _rms64(total, gamma, eps)
    gate_up = normed @ w_gate_up.astype(np.float64)
    act = _silu64(gate_up[..., :F], gate_up[..., F:])
    want = {"y": act @ w_down, "sum": total, "gate_up": gate_up, "act": act, "normed": normed}
    _check_body(model, feeds, outputs, want)


# -- MTPAccept, MTPNextInputs -----------------------------------------------------------------


def _accepted(ids: np.ndarray, argmax: np.ndarray, count: int) -> int:
    accepted = 0
    while accepted < count and argmax[0, accepted] == ids[0, accepted + 1]:
        accepted += 1
    return accepted


@pytest.mark.parametrize("to", [TensorProto.FLOAT, TensorProto.FLOAT16], ids=["f32", "to-f16"])
@pytest.mark.parametrize("k", [1, 3, 4])
def test_mtp_accept_body_equals_the_kernel_and_python(k, to):
    hidden_size = 8
    for seed in range(6):
        rng = np.random.default_rng(seed)
        argmax = rng.integers(0, 20, (1, k + 1)).astype(np.int64)
        ids = rng.integers(20, 40, (1, k + 1)).astype(np.int64)
        matches, count = int(rng.integers(0, k + 1)), int(rng.integers(0, k + 1))
        ids[0, 1 : matches + 1] = argmax[0, :matches]
        feeds = {
            "ids": ids,
            "argmax": argmax,
            "hidden": rng.standard_normal((1, k + 1, hidden_size)).astype(np.float32),
            "count": np.array([count], np.int64),
        }
        model = _model("MTPAccept", feeds, {}, ["accepted", "token", "row"], to=to)
        body, fused = _run_body(model, feeds), _run_fused(model, feeds)
        want = _accepted(ids, argmax, count)
        assert want == min(matches, count)
        row = feeds["hidden"][:, want : want + 1].astype(helper.tensor_dtype_to_np_dtype(to))
        for out in (body, fused):
            np.testing.assert_array_equal(out["accepted"], [want])
            np.testing.assert_array_equal(out["token"], argmax[:, want : want + 1])
            assert out["row"].dtype == row.dtype
            np.testing.assert_array_equal(out["row"], row)


NEXT_OUTPUTS = {
    "both": ["next_start", "next_ids", "count", "pos", "mask"],
    "positions": ["next_start", "next_ids", "count", "pos"],
    "mask": ["next_start", "next_ids", "count", "", "mask"],
    "neither": ["next_start", "next_ids", "count"],
}


@pytest.mark.parametrize("outputs", list(NEXT_OUTPUTS))
@pytest.mark.parametrize("k", [1, 4])
def test_mtp_next_inputs_body_equals_the_kernel_and_python(k, outputs):
    outputs = NEXT_OUTPUTS[outputs]
    length = 24
    for seed, min_conf in enumerate((0.0, 0.3, 0.6, 1.0)):
        rng = np.random.default_rng(seed)
        feeds = {
            "accepted": np.array([int(rng.integers(0, k + 1))], np.int64),
            "start": np.array([int(rng.integers(0, 12))], np.int64),
            "token": rng.integers(0, 100, (1, 1)).astype(np.int64),
            "drafts": rng.integers(0, 100, (1, k)).astype(np.int64),
            "confidences": rng.uniform(0, 1, (1, k)).astype(np.float32),
        }
        model = _model(
            "MTPNextInputs", feeds, {}, outputs, min_confidence=min_conf, mask_length=length
        )
        begin = int(feeds["start"][0] + feeds["accepted"][0] + 1)
        low = feeds["confidences"][0] < min_conf
        want = {
            "next_start": [begin],
            "next_ids": np.concatenate([feeds["token"], feeds["drafts"]], axis=1),
            "count": [int(np.argmax(low)) if low.any() else k],
            "pos": np.arange(begin, begin + k + 1)[None, :],
            "mask": (np.arange(length) < begin + k + 1).astype(np.int64)[None, :],
        }
        body, fused = _run_body(model, feeds), _run_fused(model, feeds)
        assert set(body) == {o for o in outputs if o}
        for name in body:
            assert body[name].dtype == np.int64, name
            np.testing.assert_array_equal(body[name], want[name], err_msg=name)
            np.testing.assert_array_equal(fused[name], want[name], err_msg=name)


# -- placement and the schema ----------------------------------------------------------------


# -- SampleTokens -------------------------------------------------------------------------------


@pytest.mark.parametrize("top_k", [False, True], ids=["all", "top-k"])
@pytest.mark.parametrize("dtype", [F32, F16], ids=str)
def test_sample_tokens_body_equals_the_kernel_and_the_rule(dtype, top_k):
    """The body (Philox in uint64 ops, the Gumbel scores, a sort for the top-k floor,
    ArgMax), the CPU kernel and onnxruntime running the body give
    ``core.token_sampling.sample_tokens``'s tokens, on rows of temperature 0 (the argmax) and
    above, seeds of all 64 bits, offsets past 2**32, top_k off, small, tied and past the
    vocabulary."""
    from onnx_genrt.core.token_sampling import gumbel_scores, sample_tokens

    rng = np.random.default_rng(3)
    logits = (3 * rng.standard_normal((5, 2, 37))).astype(dtype)
    logits[1, 1, :4] = logits[1, 1].max()  # the floor of top_k 2 is a tie of four
    temperature = rng.uniform(0.3, 1.7, (5, 2)).astype(np.float32)
    temperature[0, 0] = 0.0
    seed = rng.integers(-(2**63), 2**63 - 1, (5, 2))
    offset = rng.integers(0, 2**40, (5, 2))
    feeds = {"logits": logits, "temperature": temperature, "seed": seed, "offset": offset}
    k = None
    if top_k:
        k = feeds["top_k"] = np.array([[0, 3], [5, 2], [1, 40], [37, 36], [-1, 10]], np.int64)
    model = _model("SampleTokens", feeds, {}, ["tokens"])
    want = sample_tokens(logits, temperature, seed, offset, k)
    if top_k:
        assert want[1, 0] in np.argsort(-logits[1, 0].astype(np.float32))[:5]
        assert want[2, 0] == np.argmax(logits[2, 0])
    scores = np.sort(gumbel_scores(logits, temperature, seed, offset, k), axis=-1)
    gaps = scores[..., -1] - scores[..., -2]
    assert ((gaps > 1e-4) | np.isinf(scores[..., -2])).all()  # no near tie: exact tokens
    assert want[0, 0] == np.argmax(logits[0, 0])
    np.testing.assert_array_equal(_run_body(model, feeds)["tokens"], want)
    np.testing.assert_array_equal(_run_fused(model, feeds)["tokens"], want)
    np.testing.assert_array_equal(_run_ort_body(model, feeds)["tokens"], want)


def test_two_bodies_of_one_op_get_distinct_names_and_run_on_the_session_provider():
    rng = np.random.default_rng(0)
    g, u = rng.standard_normal((2, 4, 8)).astype(np.float32)
    nodes = [
        helper.make_node("SiluMul", ["g", "u"], ["a"], name="first", domain=GENRT_DOMAIN),
        helper.make_node("SiluMul", ["a", "u"], ["b"], name="second", domain=GENRT_DOMAIN),
    ]
    f = TensorProto.FLOAT
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, f, [4, 8]) for n in "gu"],
        [helper.make_tensor_value_info("b", f, [4, 8])],
    )
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid(GENRT_DOMAIN, 1)]
    session = InferenceSession(
        helper.make_model(graph, opset_imports=opsets), [standard_ops_cpu()], cpu_fallback=False
    )
    placed = session.placement()
    assert {p.provider for p in placed} == {"cpu-standard"}
    assert not any(p.fused for p in placed)
    assert set(session.plan.bodies.values()) == {"first", "second"}
    assert [p.op for p in placed] == ["ai.onnx::Sigmoid", "ai.onnx::Mul", "ai.onnx::Mul"] * 2
    assert all(p.node.startswith(("first/", "second/")) for p in placed)
    (b,) = session.run(["b"], {"g": g, "u": u})
    a = _silu64(g, u)
    np.testing.assert_allclose(b, _silu64(a, u), rtol=1e-5, atol=1e-6)


class Float32Only(CPUProvider):
    """Sigmoid and Mul, claimed only where every input is known to be float32."""

    name = "float32-only"

    @property
    def kernels(self) -> KernelRegistry:
        def float32_only(node, types):
            dtypes = [None if t is None else t.dtype for t in types]
            return None if all(d == F32 for d in dtypes) else f"input types {dtypes}"

        reg = KernelRegistry()
        for op in ("Sigmoid", "Mul"):
            kdef = REGISTRY.lookup("", op, 21)
            reg.add(KernelDef("", op, kdef.since, kdef.fn, float32_only))
        return reg


def test_body_values_are_typed_for_placement():
    """A provider that claims nodes by dtype sees the types of a body's inner values
    (inferred from the node's input types), so the whole body runs on it."""
    rng = np.random.default_rng(0)
    feeds = {"g": rng.standard_normal((3, 8)).astype(np.float32)}
    feeds["u"] = rng.standard_normal((3, 8)).astype(np.float32)
    model = _model("SiluMul", feeds, {}, ["y"])
    session = InferenceSession(model, [Float32Only()], cpu_fallback=False)
    assert {p.provider for p in session.placement()} == {"float32-only"}
    assert session.plan.value_types["SiluMul_node/sigmoid"].shape == (3, 8)
    (y,) = session.run(["y"], feeds)
    np.testing.assert_allclose(y, _silu64(feeds["g"], feeds["u"]), rtol=1e-5, atol=1e-6)


def test_a_body_that_needs_a_static_width_says_which_input():
    node = helper.make_node(
        "MTPNextInputs",
        ["accepted", "start", "token", "drafts", "confidences"],
        ["s", "i", "c"],
        name="next",
        domain=GENRT_DOMAIN,
    )
    i64 = TensorProto.INT64
    graph = helper.make_graph(
        [node],
        "g",
        [
            helper.make_tensor_value_info("accepted", i64, [1]),
            helper.make_tensor_value_info("start", i64, [1]),
            helper.make_tensor_value_info("token", i64, [1, 1]),
            helper.make_tensor_value_info("drafts", i64, [1, "k"]),
            helper.make_tensor_value_info("confidences", TensorProto.FLOAT, [1, "k"]),
        ],
        [helper.make_tensor_value_info(n, i64, None) for n in "sic"],
    )
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid(GENRT_DOMAIN, 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    with pytest.raises(UnsupportedOpError, match=r"'next'.*static dimension -1 of input 'drafts'"):
        InferenceSession(model, [standard_ops_cpu()], cpu_fallback=False)
    # with the fallback, the CPU provider's kernel runs it
    fallback = InferenceSession(model, [standard_ops_cpu()])
    assert _genrt_steps(fallback) == ["onnx_genrt::MTPNextInputs"]


@pytest.mark.parametrize(
    ("op", "inputs", "attrs", "message"),
    [
        ("SiluMul", ["g"], {}, "needs split=1"),
        ("SiluMul", ["g", "u", "w"], {}, "at most 2 inputs"),
        ("SiluMul", ["g", "u"], {"axis": 1}, r"unknown attributes \['axis'\]"),
        ("NormMatMul", ["x", "", "", "w"], {}, r"input 2 \(gamma\) is required"),
    ],
)
def test_a_node_that_breaks_its_schema_is_refused_by_name(op, inputs, attrs, message):
    node = NodeInfo(op, "bad", GENRT_DOMAIN, 1, attrs, tuple(inputs), ("y",))
    with pytest.raises(ModelLoadError, match=rf"'bad'.*{message}"):
        expand(node, [TensorType(F32, (2, 8))] * len(inputs))


def test_a_model_node_that_breaks_its_schema_is_refused_even_where_a_kernel_exists():
    """The CPU provider has an MTPNextInputs kernel, but a misspelt attribute is an error
    naming the node, not an attribute silently ignored."""
    feeds = {
        "accepted": np.zeros(1, np.int64),
        "start": np.zeros(1, np.int64),
        "token": np.zeros((1, 1), np.int64),
        "drafts": np.zeros((1, 2), np.int64),
        "confidences": np.zeros((1, 2), np.float32),
    }
    model = _model("MTPNextInputs", feeds, {}, ["s", "i", "c"], min_confidense=0.5)
    with pytest.raises(ModelLoadError, match=r"'MTPNextInputs_node'.*\['min_confidense'\]"):
        InferenceSession(model, ["cpu"])


def test_every_cpu_kernel_of_the_domain_is_declared():
    cpu_ops = {op for domain, op in REGISTRY.ops() if domain == GENRT_DOMAIN}
    assert cpu_ops <= set(GENRT_OPS)
    for op in GENRT_OPS.values():
        assert op.doc and all(f.doc for f in (*op.inputs, *op.outputs)), op.name


def test_the_nodes_fusions_make_fit_their_schemas():
    """Every onnx_genrt node the planner's fusions write (SiluMul split and not, ArgMaxProb,
    NormMatMul(NBits) with the residual sum, SiluMulMatMul(NBits)) fits its declaration,
    input element types included."""
    from tests.models import decomposed_head, norm_projections, silu_projection
    from tests.session.test_norm_matmul_fusion import FusingCPU, MLPFusingCPU

    seen = set()
    models = [decomposed_head(), norm_projections(), silu_projection(down="nbits")]
    models += [silu_projection(down="matmul"), silu_projection(down="matmul", norm=True)]
    for model in models:
        for providers in (["cpu"], [FusingCPU()], [MLPFusingCPU()]):
            plan = InferenceSession(model, providers).plan
            for step in plan.steps:
                if step.node.domain != GENRT_DOMAIN:
                    continue
                types = [plan.type_of(name) for name in step.inputs]
                op = GENRT_OPS[step.node.op_type]
                assert op.problem(step.node, types) is None, step.node
                seen.add((step.node.op_type, len(step.inputs), int(step.node.attr("split", 0))))
    ops = {s[0] for s in seen}
    assert {"ArgMaxProb", "SiluMul", "NormMatMul", "NormMatMulNBits"} <= ops, seen
    assert {"SiluMulMatMul", "SiluMulMatMulNBits", "NormGatedMLP"} <= ops, seen
