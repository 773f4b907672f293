"""Decode GEMVs on a real GPU: MatMul on prepacked (transposed) weights, 4-bit MatMulNBits on
16-byte chunks, each against numpy float64, eagerly and replayed from a captured graph.

Marked ``gpu``: skipped without a usable GPU, failed instead when ONNX_GENRT_REQUIRE_GPU=1.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from onnx import helper, numpy_helper

from onnx_genrt.core.graph_slots import DeviceGraphSlot

pytestmark = pytest.mark.gpu

PRIMARY, VERIFY = DeviceGraphSlot.PRIMARY, DeviceGraphSlot.VERIFY
BF16 = np.dtype(ml_dtypes.bfloat16)
FLOATS = [np.float32, np.float16, BF16]


def _matmul_model(w: np.ndarray, dtype) -> object:
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    k, n = w.shape
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="proj")],
        "gemv",
        [helper.make_tensor_value_info("x", elem, [1, "m", k])],
        [helper.make_tensor_value_info("y", elem, [1, "m", n])],
        [numpy_helper.from_array(w.astype(dtype), "w")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def _check(got, want, dtype, k):
    tol = {np.dtype(np.float16): 3e-3, BF16: 1e-2}.get(np.dtype(dtype), 2e-5)
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=tol, atol=tol * scale)
    assert np.isfinite(got).all()


def _replay_against_float64(
    cp, rng, sess, slot, m: int, w64: np.ndarray, dtype, b64=0.0, first=None
) -> list[np.ndarray]:
    """Bind x [1, m, K] and y, run four times in ``slot`` (eager, capture, replays) with new
    inputs each time (row 0 ``first`` [1, 1, K] where given) against x @ w (+ ``b64``) in
    float64; one capture, replays, no fallback. Returns each run's output row 0 as bits."""
    prov = sess.main_provider
    k, n = w64.shape
    binding = sess.io_binding()
    with prov.stream:
        x = binding.bind_input("x", cp.zeros((1, m, k), dtype))
    y = binding.bind_output("y", shape=(1, m, n), dtype=dtype)
    rows0 = []
    for _ in range(4):
        host = rng.standard_normal((1, m, k)).astype(dtype)
        if first is not None:
            host[:, :1] = first
        x.set(host, stream=prov.stream)
        with prov.stream:
            y.fill(np.nan)
        sess.run_with_iobinding(binding, slot)
        got = prov.to_numpy(y)
        _check(got, host.astype(np.float64) @ w64 + b64, dtype, k)
        rows0.append(got[0, 0].view(np.uint16))
    stats = sess.graph_stats(slot)
    assert stats.captures == 1 and stats.replays >= 2, (slot, stats)
    assert stats.fallbacks == 0, dict(stats.fallback_reasons)
    return rows0


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize(
    "k,n", [(64, 1), (896, 1152), (896, 896), (4864, 896), (896, 20000), (24, 7)]
)
def test_prepacked_matmul_graphs_and_eager(cp, rng, dtype, k, n):
    """Weights as initializers are prepacked; M=1 (PRIMARY), M=5 (VERIFY) and, prepacked,
    M=40 (a batched step: GEMV pieces of 16 rows, or the tensor cores) capture and replay;
    M=80 runs cuBLAS on the transposed view eagerly; all against float64."""
    from onnx_genrt.providers.cuda.kernels.matmul import TransposedWeight
    from onnx_genrt.session import InferenceSession

    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(dtype)
    sess = InferenceSession(_matmul_model(w, dtype), providers=["cuda"])
    packed = [a for a in sess.executor.constants.values() if isinstance(a, TransposedWeight)]
    assert len(packed) == (1 if (k * np.dtype(dtype).itemsize) % 16 == 0 else 0)
    w64 = w.astype(np.float64)
    steps = [(PRIMARY, 1), (VERIFY, 5)] + ([(DeviceGraphSlot.DRAFT, 40)] if packed else [])
    for slot, m in steps:
        _replay_against_float64(cp, rng, sess, slot, m, w64, dtype)
    host = rng.standard_normal((1, 80, k)).astype(dtype)
    (got,) = sess.run(["y"], {"x": host})
    _check(np.asarray(got), host.astype(np.float64) @ w64, dtype, k)


@pytest.mark.parametrize("dtype", [np.float16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("m", [1, 3, 5, 16, 17, 32, 33, 64])
@pytest.mark.parametrize("k,n", [(64, 8), (896, 1152), (4864, 896), (896, 20000), (192, 40)])
def test_tensor_core_gemm_matches_float64(cp, rng, dtype, m, k, n):
    """``gemm_mma`` (K split across blocks or not, partial 16-row tiles) against float64."""
    from onnx_genrt.core.kernels import KernelContext, NodeInfo
    from onnx_genrt.providers.cuda.kernels.matmul import (
        TransposedWeight,
        gemm_mma,
        mma_config,
        mma_fits,
    )
    from onnx_genrt.providers.cuda.provider import CUDAProvider

    prov = CUDAProvider()
    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(dtype)
    a = rng.standard_normal((m, k)).astype(dtype)
    with prov.stream:
        tw = TransposedWeight(cp.asarray(np.ascontiguousarray(w.T)))
        da = cp.asarray(a)
        c = cp.full((m, n), np.nan, dtype)
    assert mma_fits(da, tw, m)
    ctx = KernelContext(NodeInfo("MatMul", "mm", "", 21, {}), prov, [])
    with prov.stream:
        gemm_mma(ctx, da, tw, c)
    prov.synchronize()
    _check(prov.to_numpy(c), a.astype(np.float64) @ w.astype(np.float64), dtype, k)
    assert mma_config(m, k, n, 132)[1] >= 1


@pytest.mark.parametrize("dtype", [np.float16, BF16], ids=["fp16", "bf16"])
def test_tensor_core_rows_capture_and_replay(cp, rng, dtype):
    """With ``mma_min_rows`` 3: M=1 stays on gemv_nk, M=5 (VERIFY) and M=32 (a batched step,
    past the 16 rows gemv_nk takes) run on the tensor cores, captured and replayed."""
    from onnx_genrt.session import InferenceSession

    k, n = 896, 1152
    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(dtype)
    sess = InferenceSession(_matmul_model(w, dtype), providers=[("cuda", {"mma_min_rows": 3})])
    w64 = w.astype(np.float64)
    for slot, m in ((PRIMARY, 1), (VERIFY, 5), (DeviceGraphSlot.DRAFT, 32)):
        _replay_against_float64(cp, rng, sess, slot, m, w64, dtype)


def _nbits_model(
    k: int,
    n: int,
    block: int,
    dtype,
    rng,
    zp: bool,
    bias: np.ndarray | None = None,
    scales: np.ndarray | None = None,
):
    nb = -(-k // block)
    blob = block // 2
    q = rng.integers(0, 16, (n, nb * block)).astype(np.uint8)
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(n, nb, blob)
    if scales is None:
        scales = (rng.uniform(0.5, 1.5, (n, nb)) / (np.sqrt(k) * 8)).astype(dtype)
    zeros = rng.integers(0, 16, (n, nb)).astype(np.uint8) if zp else np.full((n, nb), 8)
    inits = [
        numpy_helper.from_array(packed, "b"),
        numpy_helper.from_array(scales, "s"),
    ]
    inputs = ["x", "b", "s"]
    if zp:
        zpad = np.zeros((n, 2 * -(-nb // 2)), np.uint8)
        zpad[:, :nb] = zeros
        inits.append(numpy_helper.from_array(zpad[:, 0::2] | (zpad[:, 1::2] << 4), "z"))
        inputs.append("z")
    if bias is not None:
        inits.append(numpy_helper.from_array(bias.astype(dtype), "bias"))
        inputs += [""] * (5 - len(inputs)) + ["bias"]
    w = (q[:, :k].astype(np.float64) - np.repeat(zeros, block, axis=1)[:, :k]) * np.repeat(
        scales.astype(np.float64), block, axis=1
    )[:, :k]
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    node = helper.make_node(
        "MatMulNBits", inputs, ["y"], domain="com.microsoft", K=k, N=n, bits=4, block_size=block
    )
    graph = helper.make_graph(
        [node],
        "nbits",
        [helper.make_tensor_value_info("x", elem, [1, "m", k])],
        [helper.make_tensor_value_info("y", elem, [1, "m", n])],
        inits,
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)],
    )
    return model, w.T  # [K, N] float64


def test_nbits_dequantized_weight_goes_with_its_session(cp, rng):
    """A prompt of more than 64 rows multiplies a dequantized copy of the 4-bit weight (cuBLAS),
    made once per weight and provider, against float64; the copy is freed with the session
    (one process-wide cache used to keep every session's copies and sources)."""
    import gc

    from onnx_genrt.providers.cuda.kernels import contrib_quant
    from onnx_genrt.session import InferenceSession

    k, n = 896, 1152
    model, w64 = _nbits_model(k, n, 32, np.float16, rng, True)
    before = len(contrib_quant._DEQUANT)
    sess = InferenceSession(model, providers=["cuda"])
    for _ in range(2):
        x = rng.standard_normal((1, 80, k)).astype(np.float16)
        (got,) = sess.run(["y"], {"x": x})
        _check(np.asarray(got), x.astype(np.float64) @ w64, np.float16, k)
    cache = contrib_quant._DEQUANT[sess.main_provider]
    assert len(cache) == 1 and cache.builds == 1  # made once, used twice
    pool = cp.get_default_memory_pool()  # the provider allocates from CuPy's default pool
    used = pool.used_bytes()
    del sess, cache
    gc.collect()
    assert len(contrib_quant._DEQUANT) == before
    assert used - pool.used_bytes() >= n * k * 2  # the [N, K] fp16 copy went back to the pool


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize(
    "k,n,block,zp",
    [(896, 1152, 32, False), (4864, 896, 32, True), (896, 20000, 64, False), (512, 33, 128, True)],
)
def test_nbits_chunk16_graphs(cp, rng, dtype, k, n, block, zp):
    """4-bit weights on 16-byte chunks: M=1, M=5 and M=33 (a batched step: GEMV pieces of
    16 rows) captured and replayed against float64."""
    from onnx_genrt.session import InferenceSession

    model, w64 = _nbits_model(k, n, block, dtype, rng, zp)
    sess = InferenceSession(model, providers=["cuda"])
    for slot, m in ((PRIMARY, 1), (VERIFY, 5), (DeviceGraphSlot.DRAFT, 33)):
        _replay_against_float64(cp, rng, sess, slot, m, w64, dtype)


def test_transposed_weight_keeps_the_plain_copy_off_the_device(cp, rng):
    """A weight only MatMul reads is uploaded once, transposed; none of it twice."""
    from onnx_genrt.providers.cuda.kernels.matmul import TransposedWeight
    from onnx_genrt.session import InferenceSession

    w = rng.standard_normal((256, 512)).astype(np.float16)
    sess = InferenceSession(_matmul_model(w, np.float16), providers=["cuda"])
    consts = list(sess.executor.constants.values())
    assert len(consts) == 1 and isinstance(consts[0], TransposedWeight)
    np.testing.assert_array_equal(consts[0].t.get(), w.T)


@pytest.fixture
def mma4_calls(monkeypatch):
    """Counts the launches of the 4-bit tensor-core GEMM."""
    from onnx_genrt.providers.cuda.kernels import contrib_quant

    calls = []
    real = contrib_quant._nbits_mma

    def spy(ctx, call, a, y, m, *args, **kwargs):
        calls.append(m)
        return real(ctx, call, a, y, m, *args, **kwargs)

    monkeypatch.setattr(contrib_quant, "_nbits_mma", spy)
    return calls


@pytest.mark.parametrize("dtype", [np.float16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("m", [3, 5, 16, 17, 33, 64])
@pytest.mark.parametrize(
    "k,n,block,zp",
    [(896, 1152, 32, False), (4864, 896, 32, True), (896, 20000, 128, True), (192, 40, 64, False)],
)
def test_nbits_tensor_core_rows(cp, rng, mma4_calls, dtype, m, k, n, block, zp):
    """4-bit weights on the tensor cores (``gemm_mma_nbits4``, ``nbits_mma_min_rows`` 3): the
    rows of a verify step or a batched step, captured and replayed against float64."""
    from onnx_genrt.session import InferenceSession

    model, w64 = _nbits_model(k, n, block, dtype, rng, zp)
    sess = InferenceSession(model, providers=[("cuda", {"nbits_mma_min_rows": 3})])
    _replay_against_float64(cp, rng, sess, VERIFY, m, w64, dtype)
    assert mma4_calls and set(mma4_calls) == {m}


@pytest.mark.parametrize("zp", [False, True], ids=["zero-8", "zero-points"])
def test_nbits_tensor_core_half2_dequant_keeps_the_bits(cp, rng, mma4_calls, zp):
    """fp16 4-bit weights on the tensor cores dequantized on packed halves (``nbits_half2``,
    the default) give the same bits as in float (``nbits_half2`` off) at 1, 5 and 32 rows,
    scales that make subnormal and large products among them, and both match float64."""
    from onnx_genrt.session import InferenceSession

    k, n, block = 896, 1152, 32
    scales = (rng.uniform(0.5, 1.5, (n, k // block)) / (np.sqrt(k) * 8)).astype(np.float16)
    scales[::7, 2] = 3e-6  # (q - z) * s subnormal in fp16
    scales[1::11, 3] = 60.0  # products up to 900
    model, w64 = _nbits_model(k, n, block, np.float16, rng, zp, scales=scales)
    outputs = {}
    for half2 in (True, False):
        sess = InferenceSession(model, providers=[("cuda", {"nbits_half2": half2})])
        for m in (1, 5, 32):
            x = np.random.default_rng(m).standard_normal((1, m, k)).astype(np.float16)
            (got,) = sess.run(["y"], {"x": x})
            outputs[half2, m] = np.asarray(got)
            if half2:
                want = x.astype(np.float64) @ w64
                np.testing.assert_allclose(got, want, rtol=3e-3, atol=3e-3 * np.abs(want).max())
    for m in (1, 5, 32):
        np.testing.assert_array_equal(
            outputs[True, m].view(np.uint16), outputs[False, m].view(np.uint16)
        )
    assert sorted(set(mma4_calls)) == [1, 5, 32]


@pytest.mark.parametrize("dtype", [np.float16, BF16], ids=["fp16", "bf16"])
def test_nbits_tensor_core_bias_and_split_k(cp, rng, mma4_calls, dtype):
    """The bias is added once whether K is split across blocks (K=4864, few columns) or not;
    M=1 stays on the GEMV."""
    from onnx_genrt.session import InferenceSession

    for k, n in ((4864, 64), (896, 20000)):
        bias = rng.standard_normal(n)
        model, w64 = _nbits_model(k, n, 32, dtype, rng, True, bias=bias)
        sess = InferenceSession(model, providers=[("cuda", {"nbits_mma_min_rows": 3})])
        b64 = bias.astype(dtype).astype(np.float64)
        for m in (1, 7):
            x = rng.standard_normal((1, m, k)).astype(dtype)
            (got,) = sess.run(["y"], {"x": x})
            _check(np.asarray(got), x.astype(np.float64) @ w64 + b64, dtype, k)
    assert mma4_calls == [7, 7]


@pytest.mark.parametrize("dtype", [np.float16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("weights", ["float", "nbits"])
@pytest.mark.parametrize(
    "options", [{"mma_max_splits": 1}, {"mma_split_min_k": 8192}], ids=["max-1", "min-k"]
)
def test_tensor_core_gemm_with_k_unsplit(cp, rng, monkeypatch, dtype, weights, options):
    """``mma_max_splits`` 1, or a K below ``mma_split_min_k``: a tensor-core GEMM whose K the
    default splits (few columns) runs in one block per column tile, without the sum kernel,
    eagerly and replayed, against float64; a row's bits are the same at 1, 5 and 32 rows (row
    0 of each call); the 4-bit weight with a bias."""
    from onnx_genrt.providers.cuda.kernels import contrib_quant, matmul
    from onnx_genrt.session import InferenceSession

    sums = []
    for module in (matmul, contrib_quant):
        real = module.sum_splits
        monkeypatch.setattr(
            module, "sum_splits", lambda *a, real=real, **kw: sums.append(1) or real(*a, **kw)
        )
    for k, n in ((4864, 896), (896, 1152)):
        assert matmul.mma_config(1, k, n, matmul.sm_count())[1] > 1  # the default splits K
        bias = rng.standard_normal(n)
        if weights == "float":
            w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(dtype)
            model, w64, b64 = _matmul_model(w, dtype), w.astype(np.float64), 0.0
        else:
            model, w64 = _nbits_model(k, n, 32, dtype, rng, True, bias=bias)
            b64 = bias.astype(dtype).astype(np.float64)
        sess = InferenceSession(model, providers=[("cuda", options)])
        first = rng.standard_normal((1, 1, k)).astype(dtype)
        rows0 = []
        for slot, m in ((PRIMARY, 1), (VERIFY, 5), (DeviceGraphSlot.DRAFT, 32)):
            rows0 += _replay_against_float64(cp, rng, sess, slot, m, w64, dtype, b64, first)
        assert not sums  # no sum kernel ran
        for row in rows0[1:]:
            np.testing.assert_array_equal(row, rows0[0])
