"""A gated MLP's SiluMul in its gate/up GEMV (``NormMatMulSiluMul``, ``gemv_nk`` with GATED =
1, option ``gated_gemv``) on a real GPU: against float64 numpy, eager and replayed in a
graph, the same bits as the kernels it replaces (NormMatMul, then SiluMul in or before the
down projection), and the same greedy tokens on the builder fixtures.

Marked ``gpu``: skipped without a usable GPU, failed instead when ONNX_GENRT_REQUIRE_GPU=1.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from onnx import numpy_helper

from onnx_genrt.core.graph_slots import DeviceGraphSlot
from tests.models import nbits_weight, silu_projection

pytestmark = pytest.mark.gpu

BF16 = ml_dtypes.bfloat16
#: (hidden, intermediate): split-k's gate/up GEMM on the tensor cores sums K in 4 splits
SHAPES = {"small": (64, 40), "split-k": (1024, 40), "0.5B": (896, 4864)}
DTYPES = [np.float16, BF16, np.float32]
DTYPE_IDS = ["fp16", "bf16", "fp32"]


def _session(model, gated: bool):
    from onnx_genrt.providers.cuda.provider import CUDAProvider
    from onnx_genrt.session import InferenceSession

    return InferenceSession(model, providers=[CUDAProvider(gated_gemv=gated, gated_mma=gated)])


def _reference(model, x: np.ndarray, r: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(y, h) in float64 from the model's own weights (float or 4-bit gate and up)."""
    w = {i.name: numpy_helper.to_array(i).astype(np.float64) for i in model.graph.initializer}
    h = x.astype(np.float64) + r.astype(np.float64)
    n = h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + 1e-6) * w["gamma"]
    if "Bg" in w:
        g, u = n @ nbits_weight(model, "Bg", "sg"), n @ nbits_weight(model, "Bu", "su")
    else:
        g, u = n @ w["wg"], n @ w["wu"]
    return (g / (1 + np.exp(-g)) * u) @ w["wd"], h


def _check(got, want, dtype) -> None:
    tol = {np.float16: 2e-2, BF16: 5e-2}.get(dtype, 1e-4)
    for g, w in zip(got, want, strict=True):
        g = np.asarray(g, np.float64)
        assert np.isfinite(g).all()
        scale = max(1.0, float(np.abs(w).max()))
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol * scale)


def _bits(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.uint32 if a.dtype == np.float32 else np.uint16)


#: gate/up weights -> (the gated plan, the plan with gated_gemv off)
PLANS = {
    "matmul": (["NormMatMulSiluMul", "MatMul"], ["NormMatMul", "SiluMulMatMul"]),
    "nbits": (["NormMatMulNBitsSiluMul", "MatMul"], ["NormMatMulNBits", "SiluMulMatMul"]),
}


@pytest.mark.parametrize("gate_up", list(PLANS))
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("rows", [1, 2, 5, 32])
def test_gated_gemv_matches_float64_and_the_unfused_bits(cp, rows, dtype, shape, gate_up):
    """Float and 4-bit gate/up weights: 1-2 rows stage the norm in the gated GEMV, more rows
    run the norm kernel first; fp16/bf16 from 3 rows gate on the tensor cores (split-k
    through the gated split sum), fp32's 32 rows in gated GEMV pieces: close to float64 and
    the same bits as NormMatMul(NBits) + SiluMulMatMul (``gated_gemv`` off), eager and
    replayed (outputs poisoned before each replay), 0 fallbacks."""
    hidden, inter = SHAPES[shape]
    model = silu_projection(
        hidden, inter, rows, seed=5, down="matmul", norm=True, dtype=dtype, gate_up=gate_up
    )
    sess, plain = _session(model, gated=True), _session(model, gated=False)
    assert [s.node.op_type for s in sess.plan.steps] == PLANS[gate_up][0]
    assert [s.node.op_type for s in plain.plan.steps] == PLANS[gate_up][1]
    prov = sess.main_provider
    rng = np.random.default_rng(rows)

    def feeds():
        return {k: rng.standard_normal((1, rows, hidden)).astype(dtype) for k in "xr"}

    f = feeds()
    got = sess.run(["y", "h"], f)
    _check(got, _reference(model, f["x"], f["r"]), dtype)
    for g, w in zip(got, plain.run(["y", "h"], f), strict=True):
        np.testing.assert_array_equal(_bits(g), _bits(w))
    slot = DeviceGraphSlot.PRIMARY if rows == 1 else DeviceGraphSlot.VERIFY
    binding = sess.io_binding()
    with prov.stream:
        ins = {k: binding.bind_input(k, cp.zeros((1, rows, hidden), dtype)) for k in "xr"}
    outs = [binding.bind_output(k, shape=(1, rows, hidden), dtype=dtype) for k in "yh"]
    for _ in range(4):  # the first run is eager, the second captures
        f = feeds()
        for k, v in f.items():
            ins[k].set(v, stream=prov.stream)
        with prov.stream:
            for o in outs:
                o.fill(np.nan)
        sess.run_with_iobinding(binding, slot)
        replayed = [prov.to_numpy(o) for o in outs]
        for g, w in zip(replayed, plain.run(["y", "h"], f), strict=True):
            np.testing.assert_array_equal(_bits(g), _bits(w))
    stats = sess.graph_stats(slot)
    assert stats.captures == 1 and stats.replays >= 2, stats
    assert stats.fallbacks == 0, dict(stats.fallback_reasons)


@pytest.mark.parametrize("fixture", ["qwen2-fp32", "qwen2-bf16", "qwen2-int4"])
def test_builder_models_decode_the_same_tokens_with_the_gated_gemv(cp, monkeypatch, fixture):
    """Every layer's gate/up projection becomes NormMatMulSiluMul, and greedy decoding
    (graphed) gives the tokens of the plan without it."""
    from onnx_genrt.engine import Model, generate

    from .test_cuda_llm_kernels import _fixture

    prompt = np.load(_fixture(fixture) / "reference.npz")["prompt"].tolist()
    runs = {}
    for gated in ("1", "0"):
        monkeypatch.setenv("ONNX_GENRT_GATED_GEMV", gated)
        model = Model(_fixture(fixture), provider="cuda")
        ops = [s.node.op_type for s in model.session.plan.steps]
        want = model.config.num_layers if gated == "1" else 0
        gated_ops = [op for op in ops if op.endswith("SiluMul") and op.startswith("Norm")]
        assert len(gated_ops) == want, ops
        result = generate(model, prompt, 24, ignore_eos=True)
        assert result.graph_stats["target"]["primary"]["fallbacks"] == 0
        runs[gated] = result.tokens
    assert runs["1"] == runs["0"]
