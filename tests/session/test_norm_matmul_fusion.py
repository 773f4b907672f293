"""The RMS-norm-into-projection fusion (``session.fusion.fuse_norm_matmul``), checked on the
CPU with a provider that has the fused kernels (numpy here; CUDA's run in tests/providers/cuda),
against onnxruntime on the unfused model."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from onnx_genrt.core.kernels import KernelContext, KernelDef, KernelRegistry
from onnx_genrt.core.op_rules import fused_matmul_nbits_unsupported, fused_projection
from onnx_genrt.providers.cpu.kernels import REGISTRY
from onnx_genrt.providers.cpu.provider import CPUProvider
from onnx_genrt.session import InferenceSession
from onnx_genrt.session.fusion import GENRT_DOMAIN
from tests.models import cpu_kernels, norm_projections

ort = pytest.importorskip("onnxruntime")


def _normalize(ctx, x, skip, gamma):
    """(normalized, sum) in float64, rounded to x's dtype."""
    h = x.astype(np.float64) + (0.0 if skip is None else skip.astype(np.float64))
    eps = float(ctx.attr("epsilon"))
    n = h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + eps) * gamma
    return n.astype(x.dtype), h.astype(x.dtype)


def _outputs(ctx, y, total, normed):
    return (y, total, normed)[: len(ctx.node.output_names)]


def _norm_matmul(ctx, x, skip, gamma, w):
    normed, total = _normalize(ctx, x, skip, gamma)
    y = (normed.astype(np.float64) @ w.astype(np.float64)).astype(x.dtype)
    return _outputs(ctx, y, total, normed)


def _norm_matmul_nbits(ctx, x, skip, gamma, b, scales, zp=None, g_idx=None, bias=None):
    normed, total = _normalize(ctx, x, skip, gamma)
    plain = REGISTRY.lookup("com.microsoft", "MatMulNBits", 1)
    y = plain.fn(KernelContext(fused_projection(ctx.node)), normed, b, scales, zp, g_idx, bias)
    return _outputs(ctx, np.array(y, copy=True), total, normed)


def _silu(ctx, g, u):
    if u is None:
        g, u = np.split(g, 2, axis=-1)
    g64 = g.astype(np.float64)
    return (g64 / (1 + np.exp(-g64)) * u).astype(g.dtype)


def _silu_matmul(ctx, g, u, w):
    act = _silu(ctx, g, u)
    y = (act.astype(np.float64) @ w.astype(np.float64)).astype(act.dtype)
    return (y, act)[: len(ctx.node.output_names)]


def _silu_matmul_nbits(ctx, g, u, b, scales, zp=None, g_idx=None, bias=None):
    act = _silu(ctx, g, u)
    plain = REGISTRY.lookup("com.microsoft", "MatMulNBits", 1)
    y = plain.fn(KernelContext(fused_projection(ctx.node)), act, b, scales, zp, g_idx, bias)
    return (np.array(y, copy=True), act)[: len(ctx.node.output_names)]


def _norm_gated_mlp(ctx, x, skip, gamma, w_gate_up, w_down):
    normed, total = _normalize(ctx, x, skip, gamma)
    gate_up = (normed.astype(np.float64) @ w_gate_up.astype(np.float64)).astype(x.dtype)
    act = _silu(ctx, gate_up, None)
    y = (act.astype(np.float64) @ w_down.astype(np.float64)).astype(x.dtype)
    return (y, total, gate_up, act, normed)[: len(ctx.node.output_names)]


def _norm_matmul_silu_mul(ctx, x, skip, gamma, *weights):
    """NormMatMulSiluMul(NBits): the NormMatMul(NBits) kernel above, then SiluMul."""
    node = ctx.node
    project = _norm_matmul if node.op_type == "NormMatMulSiluMul" else _norm_matmul_nbits
    gate_up, total, normed = project(ctx, x, skip, gamma, *weights)
    return (_silu(ctx, gate_up, None), total, normed, gate_up)[: len(node.output_names)]


class FusingCPU(CPUProvider):
    """The CPU provider plus the fused projection kernels (numpy)."""

    name = "fusing-cpu"

    @functools.cached_property
    def kernels(self) -> KernelRegistry:
        reg = cpu_kernels()
        reg.add(KernelDef(GENRT_DOMAIN, "NormMatMul", 1, _norm_matmul))
        reg.add(KernelDef(GENRT_DOMAIN, "SiluMulMatMul", 1, _silu_matmul))
        reg.add(
            KernelDef(
                GENRT_DOMAIN,
                "SiluMulMatMulNBits",
                1,
                _silu_matmul_nbits,
                check=fused_matmul_nbits_unsupported,
            )
        )
        reg.add(
            KernelDef(
                GENRT_DOMAIN,
                "NormMatMulNBits",
                1,
                _norm_matmul_nbits,
                check=fused_matmul_nbits_unsupported,
            )
        )
        return reg


class GatedFusingCPU(FusingCPU):
    """FusingCPU plus SiluMul in the gate/up projection (``NormMatMulSiluMul``, numpy)."""

    name = "gated-fusing-cpu"

    @functools.cached_property
    def kernels(self) -> KernelRegistry:
        reg = super().kernels
        reg.add(KernelDef(GENRT_DOMAIN, "NormMatMulSiluMul", 1, _norm_matmul_silu_mul))
        reg.add(
            KernelDef(
                GENRT_DOMAIN,
                "NormMatMulNBitsSiluMul",
                1,
                _norm_matmul_silu_mul,
                check=fused_matmul_nbits_unsupported,
            )
        )
        return reg


class MLPFusingCPU(FusingCPU):
    """FusingCPU plus the whole gated MLP as one op (``NormGatedMLP``, numpy)."""

    name = "mlp-fusing-cpu"

    @functools.cached_property
    def kernels(self) -> KernelRegistry:
        reg = super().kernels
        reg.add(KernelDef(GENRT_DOMAIN, "NormGatedMLP", 1, _norm_gated_mlp))
        return reg


@pytest.mark.parametrize(
    ("variant", "want_ops"),
    [
        ("fusable", ["NormMatMul", "NormMatMul", "Add", "NormMatMulNBits", "Identity"]),
        ("extra_reader", None),  # n1 has a non-projection reader: its norm stays
        ("sum_first", None),  # the sum is read before a projection could write it
    ],
)
def test_norms_fuse_into_projections_and_match_onnxruntime(variant, want_ops):
    model = norm_projections(variant=variant)
    sess = InferenceSession(model, providers=[FusingCPU()])
    ops = [s.node.op_type for s in sess.plan.steps]
    if want_ops is not None:
        assert ops == want_ops
        first = sess.plan.steps[0]
        assert first.outputs[1] == "r", "the first projection writes the residual sum"
        assert sess.plan.steps[1].outputs[1] == ""
    else:
        assert "SkipSimplifiedLayerNormalization" in ops
        assert ops.count("NormMatMulNBits") == 1  # the second norm still fuses
    rng = np.random.default_rng(1)
    a, b = (rng.standard_normal((1, 3, 64)).astype(np.float32) for _ in range(2))
    got = sess.run(["y", "z"], {"a": a, "b": b})
    want = ort.InferenceSession(model.SerializeToString()).run(["y", "z"], {"a": a, "b": b})
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)


def test_providers_without_the_fused_kernels_keep_the_norms():
    sess = InferenceSession(norm_projections(), providers=["cpu"])
    ops = [s.node.op_type for s in sess.plan.steps]
    assert "NormMatMul" not in ops and "SkipSimplifiedLayerNormalization" in ops


def _decodes_the_cpu_tokens(fused) -> None:
    """Greedy tokens of ``fused`` (graphed, as on a GPU) equal the CPU provider's."""
    from onnx_genrt.engine import Model, generate
    from onnx_genrt.generate_cli import default_model_dir

    plain = Model(default_model_dir(), ["cpu"])
    prompt = "    def __init__(self"
    want = generate(plain, prompt, max_new_tokens=24, ignore_eos=True).tokens
    got = generate(fused, prompt, max_new_tokens=24, ignore_eos=True)
    assert got.tokens == want
    assert got.graph_stats["target"]["primary"]["replays"] > 0


def test_embedded_model_with_fused_norms_decodes_the_same_tokens():
    """On the embedded model every layer's norms go into their projections, and greedy
    decoding (graphed, as on a GPU) gives the CPU provider's tokens."""
    from onnx_genrt.engine import Model
    from onnx_genrt.generate_cli import default_model_dir

    fused = Model(default_model_dir(), [FusingCPU()])
    ops = [s.node.op_type for s in fused.session.plan.steps]
    layers = fused.config.num_layers
    assert ops.count("NormMatMul") == 2 * layers, ops  # qkv and gate_up of every layer
    assert ops.count("SiluMulMatMul") == layers and "SiluMul" not in ops, ops  # down
    assert ops.count("SkipSimplifiedLayerNormalization") == 1  # the final norm: an output
    _decodes_the_cpu_tokens(fused)


def test_embedded_model_with_fused_mlps_decodes_the_same_tokens():
    """With NormGatedMLP on the provider every layer's norm, gate/up projection, SiluMul and
    down projection become one step (the qkv projection keeps its NormMatMul), and greedy
    decoding gives the CPU provider's tokens."""
    from onnx_genrt.engine import Model
    from onnx_genrt.generate_cli import default_model_dir

    fused = Model(default_model_dir(), [MLPFusingCPU()])
    steps = fused.session.plan.steps
    ops = [s.node.op_type for s in steps]
    layers = fused.config.num_layers
    assert ops.count("NormGatedMLP") == layers, ops
    assert ops.count("NormMatMul") == layers and "SiluMulMatMul" not in ops, ops
    first = next(s for s in steps if s.node.op_type == "NormGatedMLP")
    assert first.outputs[1], "the MLP's norm still writes the residual sum the next layer reads"
    _decodes_the_cpu_tokens(fused)


@pytest.mark.parametrize(
    ("provider", "down", "want_ops"),
    [
        (MLPFusingCPU, "matmul", ["NormGatedMLP"]),
        (MLPFusingCPU, "nbits", ["NormMatMul", "SiluMulMatMulNBits"]),  # 4-bit down: not yet
        (FusingCPU, "matmul", ["NormMatMul", "SiluMulMatMul"]),  # no NormGatedMLP kernel
        (GatedFusingCPU, "matmul", ["NormMatMulSiluMul", "MatMul"]),
        (GatedFusingCPU, "nbits", ["NormMatMulSiluMul", "MatMulNBits"]),
        (GatedFusingCPU, "nbits-gate-up", ["NormMatMulNBitsSiluMul", "MatMul"]),
    ],
)
def test_a_normed_gated_mlp_fuses_into_one_step_and_matches_onnxruntime(provider, down, want_ops):
    from tests.models import silu_projection

    if down == "nbits-gate-up":
        model = silu_projection(down="matmul", norm=True, gate_up="nbits")
    else:
        model = silu_projection(down=down, norm=True)
    sess = InferenceSession(model, providers=[provider()])
    assert [s.node.op_type for s in sess.plan.steps] == want_ops
    rng = np.random.default_rng(3)
    x, r = (rng.standard_normal((1, 3, 32)).astype(np.float32) for _ in range(2))
    got = sess.run(["y", "h"], {"x": x, "r": r})
    want = ort.InferenceSession(model.SerializeToString()).run(["y", "h"], {"x": x, "r": r})
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)


def test_embedded_model_with_gated_projections_decodes_the_same_tokens():
    """With NormMatMulSiluMul on the provider every layer's gate/up projection applies the
    SiluMul and the down projection is a plain MatMul; greedy decoding (graphed) gives the
    CPU provider's tokens."""
    from onnx_genrt.engine import Model
    from onnx_genrt.generate_cli import default_model_dir

    fused = Model(default_model_dir(), [GatedFusingCPU()])
    steps = fused.session.plan.steps
    ops = [s.node.op_type for s in steps]
    layers = fused.config.num_layers
    assert ops.count("NormMatMulSiluMul") == layers, ops
    assert ops.count("NormMatMul") == layers and "SiluMulMatMul" not in ops, ops
    for i, step in enumerate(steps):
        if step.node.op_type == "NormMatMulSiluMul":
            down = steps[i + 1]
            assert (down.node.op_type, down.inputs[0]) == ("MatMul", step.outputs[0])
            assert step.outputs[1], "the norm still writes the residual sum"
    _decodes_the_cpu_tokens(fused)


def test_silu_mul_fuses_into_the_down_projection_and_matches_onnxruntime():
    from tests.models import silu_projection

    model = silu_projection()
    sess = InferenceSession(model, providers=[FusingCPU()])
    ops = [s.node.op_type for s in sess.plan.steps]
    assert ops == ["MatMul", "SiluMulMatMulNBits"], ops  # gate and up merged, then fused
    assert sess.plan.steps[1].node.attrs["split"] == 1
    x = np.random.default_rng(2).standard_normal((1, 3, 32)).astype(np.float32)
    (got,) = sess.run(["y"], {"x": x})
    (want,) = ort.InferenceSession(model.SerializeToString()).run(["y"], {"x": x})
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("which", "start"),
    [
        ("embedded", "MatMul"),  # hidden_states is an output: the final norm stays
        ("builder-without-hidden-states", "NormMatMul"),  # the final norm fuses into lm_head
    ],
)
def test_last_row_prefill_with_the_projection_fusions(which, start):
    """With the fused projections a CUDA plan makes (here numpy kernels on the CPU), a
    prefill still computes the last row's logits only, and they equal the last of every
    row's. Without a hidden_states output the tail starts at the lm_head's NormMatMul, whose
    input and residual are both cut to the last row."""
    from onnx_genrt.engine import Model
    from onnx_genrt.engine.decoder import DecoderRunner
    from onnx_genrt.generate_cli import default_model_dir

    from ..llm_fixtures import TINY_QWEN2, build_qwen2

    if which == "embedded":
        folder = default_model_dir()
    else:
        folder = build_qwen2(TINY_QWEN2, hidden_states=False)
    model = Model(folder, provider=[FusingCPU()])
    tail = model.session.executor.row_tail(model.config.io.logits)
    assert tail is not None
    assert model.session.plan.steps[tail.start].node.op_type == start
    prompt = [5, 17, 99, 3, 250, 7, 5, 17, 99]
    last = DecoderRunner(model.session, model.config, 32)
    assert last.prefill_last_row
    every = DecoderRunner(model.session, model.config, 32)
    every.prefill_last_row = False
    got, want = last.forward(prompt, None), every.forward(prompt, None)
    assert got.logits.shape[0] == 1 and want.logits.shape[0] == len(prompt)
    np.testing.assert_allclose(got.logits[-1], want.logits[-1], rtol=1e-5, atol=1e-5)
    assert int(got.tokens[-1]) == int(want.tokens[-1])
