"""cuBLAS on the CUDA provider's own handle (``providers/cuda/cublas.py``), eager and
recorded in CUDA graphs, against numpy float64: the GEMM itself (fp32, fp16, bf16, plain and
transposed weights, odd shapes), MatMul and 4-bit MatMulNBits above the own kernels' rows,
a whole session's wide step, and a builder model's 200-token prompt as a graphed chunk.

Every test is marked ``gpu``. Outputs are poisoned with NaN before each run; a capture only
records (nothing runs until a replay), and a replay reads inputs rewritten in place.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from onnx_genrt.core.graph_slots import DeviceGraphSlot
from onnx_genrt.core.kernels import MS_DOMAIN, TransposedWeight

from .test_cuda_llm_kernels import BUILDER_MODELS, _fixture, nbits_case, nbits_np
from .test_cuda_llm_kernels import node as named_node
from .test_cuda_provider import _bind, launch, mlp_model, mlp_reference, node

pytestmark = pytest.mark.gpu

VERIFY = DeviceGraphSlot.VERIFY
BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float32), np.dtype(np.float16), BF16]
#: Relative tolerance of a dot product of K terms accumulated in float32 and rounded once to
#: the output dtype, against float64 of the same (rounded) inputs, on outputs of about 1.
TOL = {DTYPES[0]: 2e-5, DTYPES[1]: 2e-3, BF16: 2e-2}


def _skip_without_bf16(dtype) -> None:
    from onnx_genrt.providers.cuda.kernels._common import bf16_unsupported

    if np.dtype(dtype) == BF16 and bf16_unsupported():
        pytest.skip(bf16_unsupported())


def _close(got, want, dtype, what=""):
    tol = TOL[np.dtype(dtype)]
    got64, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.isfinite(got64).all(), f"{what}: NaN left (not written)"
    atol = tol * max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got64, want, rtol=tol, atol=atol, err_msg=what)


def _operands(rng, dtype, m, k, n):
    a = rng.standard_normal((m, k)).astype(dtype)
    w = (rng.standard_normal((k, n)) / math.sqrt(k)).astype(dtype)
    return a, w


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("transposed", [False, True], ids=["w", "w_t"])
@pytest.mark.parametrize("mkn", [(65, 896, 136), (100, 33, 17), (512, 100, 4864), (1, 7, 3)])
def test_gemm_eager_and_replayed(cp, fresh, rng, dtype, transposed, mkn):
    """``c = a @ w`` on the provider's handle: eagerly, then recorded in a graph (which
    runs nothing) and replayed twice on new inputs written in place. M of 65, 100, 512; K
    of 33 and 100 (not multiples of 8)."""
    from onnx_genrt.providers.cuda.cublas import GemmShape

    _skip_without_bf16(dtype)
    prov, (m, k, n) = fresh, mkn
    a, w = _operands(rng, dtype, m, k, n)
    da = prov.upload(a)
    dw = TransposedWeight(prov.upload(np.ascontiguousarray(w.T))) if transposed else prov.upload(w)
    with prov.stream:
        c = cp.full((m, n), np.nan, dtype)
    shape = GemmShape(m, k, n, transposed=transposed)
    prov.cublas.gemm(da, dw, c, shape)
    _close(prov.read([c])[0], a.astype(np.float64) @ w, dtype, "eager")

    with prov.stream:
        c.fill(np.nan)
    prov.begin_capture(VERIFY)
    prov.cublas.gemm(da, dw, c, shape)
    prov.end_capture(VERIFY)
    assert np.isnan(prov.read([c])[0].astype(np.float64)).all(), "a capture must only record"
    for _ in range(2):
        a, _ = _operands(rng, dtype, m, k, n)
        prov.upload(a, out=da)
        with prov.stream:
            c.fill(np.nan)
        prov.replay(VERIFY)
        _close(prov.read([c])[0], a.astype(np.float64) @ w, dtype, "replay")


def test_the_handle_is_made_before_a_capture_and_bound_once(cp):
    """One handle per provider, made by ``graph_begin`` before the stream records (or by
    the first eager GEMM), bound to the provider's stream, its workspace the provider's
    memory of WORKSPACE_BYTES at one address for the provider's life."""
    from onnx_genrt.providers.cuda.cublas import WORKSPACE_BYTES
    from onnx_genrt.providers.cuda.provider import CUDAProvider

    prov = CUDAProvider()
    assert prov._cublas is None
    prov.begin_capture(VERIFY)
    handle = prov._cublas
    assert handle is not None and handle.stream_ptr == prov.stream.ptr
    prov.abort_capture(VERIFY, "only the handle was wanted")
    prov.reset_graph(VERIFY)
    assert prov.cublas is handle and handle.workspace.nbytes == WORKSPACE_BYTES
    assert handle.workspace.device.id == prov.device.index


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("a_shape", "b_shape"),
    [
        ((1, 4, 100, 64), (1, 4, 64, 100)),  # attention-shaped, same batch dims
        ((100, 32), (3, 32, 40)),  # A shared by B's batch
        ((3, 100, 32), (1, 32, 40)),  # B shared by A's batch
        ((2, 70, 24), (24, 9)),  # leading dims fold into M = 140
    ],
)
def test_matmul_batched_shapes_capture(cp, fresh, rng, dtype, a_shape, b_shape):
    """MatMul of two activations above the skinny kernel's rows: cuBLAS (strided batched
    where batched), eager and replayed."""
    _skip_without_bf16(dtype)
    prov = fresh
    a = rng.standard_normal(a_shape).astype(dtype)
    b = (rng.standard_normal(b_shape) / math.sqrt(a_shape[-1])).astype(dtype)
    want = np.matmul(a.astype(np.float64), b.astype(np.float64))
    da, db = prov.upload(a), prov.upload(b)
    with prov.stream:
        c = cp.full(want.shape, np.nan, dtype)
    info = node("MatMul", 2)
    assert launch(prov, info, [da, db], [c])[0] is c
    _close(prov.read([c])[0], want, dtype, "eager")
    prov.begin_capture(VERIFY)
    launch(prov, info, [da, db], [c])
    prov.end_capture(VERIFY)
    b = (rng.standard_normal(b_shape) / math.sqrt(a_shape[-1])).astype(dtype)
    prov.upload(b, out=db)
    with prov.stream:
        c.fill(np.nan)
    prov.replay(VERIFY)
    _close(prov.read([c])[0], np.matmul(a.astype(np.float64), b.astype(np.float64)), dtype)


def test_matmul_partly_broadcast_batches_refuse_capture(cp, fresh, rng):
    """Batches broadcast on both sides are not one strided GEMM: eager through CuPy, and a
    CaptureUnsupported naming the shapes while capturing."""
    from onnx_genrt.providers.cuda.kernels._common import CaptureUnsupported

    prov = fresh
    a = rng.standard_normal((2, 1, 20, 16)).astype(np.float32)
    b = rng.standard_normal((1, 3, 16, 8)).astype(np.float32)
    da, db = prov.upload(a), prov.upload(b)
    with prov.stream:
        c = cp.full((2, 3, 20, 8), np.nan, np.float32)
    launch(prov, node("MatMul", 2), [da, db], [c])
    _close(prov.read([c])[0], np.matmul(a.astype(np.float64), b), np.float32)
    prov.begin_capture(VERIFY)
    with pytest.raises(CaptureUnsupported, match="broadcast partly"):
        launch(prov, node("MatMul", 2), [da, db], [c])
    prov.abort_capture(VERIFY, "partly broadcast MatMul")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [65, 100, 512])
def test_prepacked_matmul_above_64_rows_captures(cp, fresh, rng, dtype, m):
    """A constant weight prepacked as its transpose (``transpose_weight``), M above the
    tensor-core and GEMV-piece rows: cuBLAS on the transposed view, recorded and replayed."""
    from onnx_genrt.providers.cuda.kernels.matmul import transpose_weight

    _skip_without_bf16(dtype)
    prov, (k, n) = fresh, (896, 200)
    a, w = _operands(rng, dtype, m, k, n)
    info = node("MatMul", 2)
    packed = transpose_weight(prov, info, 1, w)
    assert isinstance(packed, TransposedWeight)
    da = prov.upload(a)
    with prov.stream:
        c = cp.full((m, n), np.nan, dtype)
    launch(prov, info, [da, packed], [c])
    _close(prov.read([c])[0], a.astype(np.float64) @ w, dtype, "eager")
    prov.begin_capture(VERIFY)
    launch(prov, info, [da, packed], [c])
    prov.end_capture(VERIFY)
    a, _ = _operands(rng, dtype, m, k, n)
    prov.upload(a, out=da)
    with prov.stream:
        c.fill(np.nan)
    prov.replay(VERIFY)
    _close(prov.read([c])[0], a.astype(np.float64) @ w, dtype, "replay")


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("m", [65, 200])
def test_matmul_nbits_above_64_rows_captures(cp, fresh, rng, m, with_bias):
    """4-bit weights for many rows: dequantized once (on the eager run) and multiplied on
    the provider's handle, the bias added by the GEMM; recorded and replayed."""
    prov = fresh
    inputs, attrs = nbits_case(rng, m, 896, 4864, 32, 4, np.float16, "u8", with_bias)
    info = named_node("MatMulNBits", inputs, attrs=attrs, opset=1, domain=MS_DOMAIN)
    dev = [None if x is None else prov.upload(x) for x in inputs]
    with prov.stream:
        y = cp.full((1, m, 4864), np.nan, np.float16)
    ref = nbits_np(attrs)
    launch(prov, info, dev, [y])
    _close(prov.read([y])[0], ref(*inputs), np.float16, "eager")
    prov.begin_capture(VERIFY)
    launch(prov, info, dev, [y])
    prov.end_capture(VERIFY)
    for _ in range(2):
        inputs[0] = rng.standard_normal((1, m, 896)).astype(np.float16)
        prov.upload(inputs[0], out=dev[0])
        with prov.stream:
            y.fill(np.nan)
        prov.replay(VERIFY)
        _close(prov.read([y])[0], ref(*inputs), np.float16, "replay")


def test_cublas_in_graphs_off_refuses_capture(cp, rng):
    """With the option off, MatMul above 64 rows takes CuPy's matmul (eager), and a capture
    raises CaptureUnsupported naming the option; the provider says it captures 64 rows."""
    from onnx_genrt.providers.cuda.kernels._common import CaptureUnsupported
    from onnx_genrt.providers.cuda.kernels.matmul import PIECES_MAX_M
    from onnx_genrt.providers.cuda.provider import CUDAProvider

    prov = CUDAProvider(cublas_in_graphs=False)
    assert prov.graph_max_rows == PIECES_MAX_M and CUDAProvider().graph_max_rows is None
    a, w = _operands(rng, np.float16, 100, 64, 48)
    da, dw = prov.upload(a), prov.upload(w)
    with prov.stream:
        c = cp.full((100, 48), np.nan, np.float16)
    launch(prov, node("MatMul", 2), [da, dw], [c])
    _close(prov.read([c])[0], a.astype(np.float64) @ w, np.float16)
    prov.begin_capture(VERIFY)
    with pytest.raises(CaptureUnsupported, match="cublas_in_graphs is off"):
        launch(prov, node("MatMul", 2), [da, dw], [c])
    prov.abort_capture(VERIFY, "cublas_in_graphs off")
    assert prov._cublas is None  # never made: no graph began, no GEMM needed it
    prov.reset_graph(VERIFY)


def test_session_step_above_64_rows_replays(cp, rng):
    """A bound step of 65 rows through a whole session: captured once, then replayed, no
    fallback; results equal the float64 reference."""
    from onnx_genrt.providers.cuda.kernels.matmul import PIECES_MAX_M
    from onnx_genrt.session import InferenceSession

    hidden, vocab = 64, 100
    model = mlp_model(hidden=hidden, vocab=vocab)
    sess = InferenceSession(model, providers=["cuda"])
    assert sess.graph_max_rows is None
    prov = sess.main_provider
    binding, x, p, _ = _bind(cp, sess, PIECES_MAX_M + 1, hidden, vocab, np.float32)
    for _ in range(4):
        host = rng.standard_normal(x.shape).astype(np.float32)
        x.set(host, stream=prov.stream)
        sess.run_with_iobinding(binding, VERIFY)
        np.testing.assert_allclose(
            prov.to_numpy(p), mlp_reference(model, host)[0], rtol=1e-4, atol=1e-5
        )
    stats = sess.graph_stats(VERIFY)
    assert stats.captures == 1 and stats.replays >= 2, stats
    assert stats.fallbacks == 0, dict(stats.fallback_reasons)


@pytest.mark.parametrize("name", BUILDER_MODELS)
def test_builder_model_graphs_a_200_token_prompt(cp, monkeypatch, name):
    """A 200-token prompt as one graphed chunk of 256 rows (its first run eager, then
    captured, then replayed) gives the last row's logits of the eager prefill, and
    ``generate`` the same tokens (only a near tie of the eager logits may flip a pick)."""
    from onnx_genrt.engine import Generator, Model, generate
    from onnx_genrt.engine.decoder import DecoderRunner

    model = Model(_fixture(name), provider="cuda")
    assert model.session.graph_max_rows is None
    prompt = np.random.default_rng(200).integers(1, model.config.vocab_size, 200).tolist()
    runner = DecoderRunner(model.session, model.config, 512)
    assert max(runner.prefill_widths()) > 200 and runner.prefill_graph_max_tokens() >= 200
    want = np.asarray(runner.prefill(prompt, graphed=False)[0].logits[-1], np.float64)
    tol = 0.06 * float(np.abs(want).max()) if name == "qwen2-bf16" else 1e-3
    for i in range(3):  # the width's first run (eager), its capture, a replay
        runner.rewind_to(0)
        got = np.asarray(runner.prefill(prompt, graphed=True)[0].logits[-1], np.float64)
        np.testing.assert_allclose(got, want, atol=tol, rtol=0, err_msg=f"run {i}")
    stats = model.session.graph_stats(VERIFY)
    assert stats.captures >= 1 and stats.replays >= 1, stats
    assert stats.fallbacks == 0, dict(stats.fallback_reasons)

    monkeypatch.setattr(Generator, "graph_prefill", False)
    eager = generate(model, prompt, 16, ignore_eos=True).tokens
    monkeypatch.setattr(Generator, "graph_prefill", True)
    for _ in range(2):  # the pooled runner's graphs: captured, then replayed
        graphed = generate(model, prompt, 16, ignore_eos=True).tokens
        if graphed != eager:
            i = next(j for j, (x, y) in enumerate(zip(graphed, eager, strict=False)) if x != y)
            runner.rewind_to(0)
            row = runner.prefill(prompt + eager[:i], graphed=False)[0].logits[-1]
            top = np.sort(np.asarray(row, np.float64))[::-1]
            assert top[0] - top[1] < 2 * tol, f"tokens differ at {i}: {graphed} != {eager}"
