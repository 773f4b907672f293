"""RMS norms and SiluMul fused into the GEMVs that read them (NormMatMul, SiluMulMatMul and
their NBits forms) on a real GPU, offered by ``CUDAProvider(gemv_prologues=True)``: the fused
plan against the CPU provider's unfused one, eager and replayed.

Marked ``gpu``: skipped without a usable GPU, failed instead when ONNX_GENRT_REQUIRE_GPU=1.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from onnx_genrt.core.graph_slots import DeviceGraphSlot
from tests.models import norm_projections

pytestmark = pytest.mark.gpu


def _fusing_cuda():
    """A CUDA provider that offers the GEMV-prologue fusions (whatever the environment says)."""
    from onnx_genrt.providers.cuda.provider import CUDAProvider

    return CUDAProvider(gemv_prologues=True)


@pytest.mark.parametrize("prologues", [False, True])
def test_cuda_plan_fuses_norms_and_silu_only_when_offered(cp, prologues):
    from onnx_genrt.providers.cuda.provider import CUDAProvider
    from onnx_genrt.session import InferenceSession
    from tests.models import silu_projection

    def ops(model):
        sess = InferenceSession(model, providers=[CUDAProvider(gemv_prologues=prologues)])
        return [s.node.op_type for s in sess.plan.steps]

    norm_ops, silu_ops = ops(norm_projections()), ops(silu_projection())
    if prologues:
        assert "NormMatMul" in norm_ops and "SkipSimplifiedLayerNormalization" not in norm_ops
        assert silu_ops == ["MatMul", "SiluMulMatMulNBits"], silu_ops
    else:
        assert "SkipSimplifiedLayerNormalization" in norm_ops and "NormMatMul" not in norm_ops
        assert silu_ops == ["MatMul", "SiluMul", "MatMulNBits"], silu_ops


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_fused_norm_projections_match_cpu(cp, dtype, rows):
    """Decode (M=1) and verify (M=5) rows run the fused GEMVs, captured and replayed with
    poisoned outputs; M=40 (a prompt) runs the norm kernel and cuBLAS eagerly. The residual
    sum written by the first projection feeds the 4-bit projection of the second norm."""
    from onnx_genrt.session import InferenceSession

    hidden, n = 896, 256
    model = norm_projections(hidden=hidden, rows=rows, n=n, dtype=dtype, seed=3)
    reference = InferenceSession(
        norm_projections(hidden=hidden, rows=rows, n=n, dtype=np.float32, seed=3),
        providers=["cpu"],
    )
    sess = InferenceSession(model, providers=[_fusing_cuda()])
    ops = [s.node.op_type for s in sess.plan.steps]
    assert ops.count("NormMatMul") == 2 and ops.count("NormMatMulNBits") == 1, ops
    prov = sess.main_provider
    rng = np.random.default_rng(rows)
    tol = 1e-4 if dtype == np.float32 else 2e-2 if dtype == np.float16 else 4e-2

    def check(got, feeds):
        want = reference.run(["y", "z"], {k: v.astype(np.float32) for k, v in feeds.items()})
        for g, w in zip(got, want, strict=True):
            g = np.asarray(g, np.float64)
            assert np.isfinite(g).all()
            scale = max(1.0, float(np.abs(w).max()))
            np.testing.assert_allclose(g, w, rtol=tol, atol=tol * scale)

    if rows > 16:
        feeds = {k: rng.standard_normal((1, rows, hidden)).astype(dtype) for k in "ab"}
        check(sess.run(["y", "z"], feeds), feeds)
        return
    slot = DeviceGraphSlot.PRIMARY if rows == 1 else DeviceGraphSlot.VERIFY
    binding = sess.io_binding()
    with prov.stream:
        ins = {k: binding.bind_input(k, cp.zeros((1, rows, hidden), dtype)) for k in "ab"}
    outs = [binding.bind_output(k, shape=(1, rows, n), dtype=dtype) for k in "yz"]
    for _ in range(4):
        feeds = {k: rng.standard_normal((1, rows, hidden)).astype(dtype) for k in "ab"}
        for k, v in feeds.items():
            ins[k].set(v, stream=prov.stream)
        with prov.stream:
            for o in outs:
                o.fill(np.nan)
        sess.run_with_iobinding(binding, slot)
        check([prov.to_numpy(o) for o in outs], feeds)
    stats = sess.graph_stats(slot)
    assert stats.captures == 1 and stats.replays >= 2, stats
    assert stats.fallbacks == 0, dict(stats.fallback_reasons)


@pytest.mark.parametrize("down", ["nbits", "matmul"])
@pytest.mark.parametrize("rows", [1, 5, 40])
@pytest.mark.parametrize("inter", [512, 4864])
def test_fused_silu_down_projection_matches_cpu(cp, rows, inter, down):
    """gate * sigmoid(gate) * up computed inside the 4-bit down GEMV (M=1, M=5 when the rows
    fit the block's shared memory, else the SiluMul kernel first), graphed, against CPU."""
    from onnx_genrt.session import InferenceSession
    from tests.models import silu_projection

    model = silu_projection(hidden=896, inter=inter, rows=rows, seed=4, down=down)
    reference = InferenceSession(model, providers=["cpu"])
    sess = InferenceSession(model, providers=[_fusing_cuda()])
    ops = [s.node.op_type for s in sess.plan.steps]
    fused = "SiluMulMatMulNBits" if down == "nbits" else "SiluMulMatMul"
    assert ops == ["MatMul", fused], ops
    prov = sess.main_provider
    rng = np.random.default_rng(rows)
    if rows > 16:
        x = rng.standard_normal((1, rows, 896)).astype(np.float32)
        np.testing.assert_allclose(
            np.asarray(sess.run(["y"], {"x": x})[0]),
            reference.run(["y"], {"x": x})[0],
            rtol=1e-4,
            atol=1e-4,
        )
        return
    slot = DeviceGraphSlot.PRIMARY if rows == 1 else DeviceGraphSlot.VERIFY
    binding = sess.io_binding()
    with prov.stream:
        x_dev = binding.bind_input("x", cp.zeros((1, rows, 896), np.float32))
    y = binding.bind_output("y", shape=(1, rows, 896), dtype=np.float32)
    for _ in range(4):
        x = rng.standard_normal((1, rows, 896)).astype(np.float32)
        x_dev.set(x, stream=prov.stream)
        with prov.stream:
            y.fill(np.nan)
        sess.run_with_iobinding(binding, slot)
        want = reference.run(["y"], {"x": x})[0]
        np.testing.assert_allclose(prov.to_numpy(y), want, rtol=1e-4, atol=1e-4)
    stats = sess.graph_stats(slot)
    assert stats.captures == 1 and stats.replays >= 2 and stats.fallbacks == 0, stats


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 5, 16])
def test_tensor_core_rows_stage_the_norm_with_the_norm_kernels_bits(cp, monkeypatch, dtype, rows):
    """With the tensor cores from one row (``mma_min_rows`` and ``nbits_mma_min_rows`` 1),
    NormMatMul and NormMatMulNBits rows that stage their norm in the GEMM's blocks
    (``prologue_max_rows`` 16) give the bits of the norm kernel followed by the same GEMM
    (``prologue_max_rows`` 0): a row's bits do not depend on where its norm was made."""
    from onnx_genrt.providers.cuda.kernels import contrib_quant, matmul
    from onnx_genrt.providers.cuda.provider import CUDAProvider
    from onnx_genrt.session import InferenceSession

    staged = []
    real_mma, real_mma4 = matmul.gemm_mma, contrib_quant._nbits_mma
    monkeypatch.setattr(
        matmul,
        "gemm_mma",
        lambda ctx, a, w, c, gated=False, norm=None: (
            staged.append(("mma", norm is not None)),
            real_mma(ctx, a, w, c, gated, norm),
        )[1],
    )
    monkeypatch.setattr(
        contrib_quant,
        "_nbits_mma",
        lambda ctx, call, a, y, m, gated=False: (
            staged.append(("mma4", call.norm is not None)),
            real_mma4(ctx, call, a, y, m, gated),
        )[1],
    )
    model = norm_projections(hidden=896, rows=rows, n=256, dtype=dtype, seed=7)
    rng = np.random.default_rng(rows)
    feeds = {k: rng.standard_normal((1, rows, 896)).astype(dtype) for k in "ab"}

    def run(most: int) -> tuple[list[np.ndarray], list[tuple[str, bool]]]:
        options = dict(mma_min_rows=1, nbits_mma_min_rows=1, prologue_max_rows=most)
        sess = InferenceSession(model, providers=[CUDAProvider(gemv_prologues=True, **options)])
        staged.clear()
        got = [np.asarray(x).view(np.uint16) for x in sess.run(["y", "z"], feeds)]
        return got, sorted(set(staged))

    fused, kernels = run(16)
    assert kernels == [("mma", True), ("mma4", True)]
    unfused, kernels = run(0)
    assert kernels == [("mma", False), ("mma4", False)]
    for f, u in zip(fused, unfused, strict=True):
        np.testing.assert_array_equal(f, u)
