"""Skinny float32 MatMul (M <= 16) on prepacked constant weights, alone and in sessions.

The kernel is checked against a float64 reference with the standard fp32 dot-product bound
(any summation order): |y - ref| <= K * 2^-23 * (|x| @ |W|), plus one rounding of the bias
add. In sessions the decode (M=1) and verify (M=5) steps replay captured CPU graphs whose
MatMul/Gemm calls are the kernels' prebound calls; M=20 runs BLAS on the same packed weight.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_genrt.core.graph_slots import DeviceGraphSlot
from onnx_genrt.providers.cpu.kernels import _skinny_matmul as sk
from onnx_genrt.session import InferenceSession

from .pool_helpers import worker_helps

F32 = np.float32
SHAPES = [(1, 1), (3, 5), (37, 13), (130, 67), (513, 259)]


def _check(y: np.ndarray, x: np.ndarray, w: np.ndarray, bias: np.ndarray | None = None) -> None:
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    ref = x64 @ w64
    bound = w.shape[0] * 2.0**-23 * (np.abs(x64) @ np.abs(w64))
    if bias is not None:
        ref = ref + bias
        bound = bound + 2.0**-23 * np.abs(ref)
    err = np.abs(y.astype(np.float64) - ref)
    assert (err <= bound + 1e-30).all(), float((err / (bound + 1e-30)).max())


@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_matches_float64_for_every_m(k, n, with_bias):
    rng = np.random.default_rng(k * 1000 + n)
    w = rng.standard_normal((k, n), dtype=F32)
    bias = rng.standard_normal(n, dtype=F32) if with_bias else None
    packed = sk.pack_weight(w)
    for m in range(1, sk.SKINNY_MAX_M + 1):
        x = rng.standard_normal((m, k), dtype=F32)
        y = np.full((m, n), np.nan, F32)
        sk.skinny_matmul(x, packed, y, bias)
        _check(y, x, w, bias)


def test_a_rows_outputs_are_the_same_bits_at_every_row_count():
    """Each column adds its products in the order of k whatever M (``GROUP`` rows a call,
    then the rest): a row alone, among any number of rows or at any place among them gives
    the same bits, so batched rows and verify steps equal greedy alone. A strided X (a view)
    gives its copy's bits."""
    rng = np.random.default_rng(7)
    k, n = 300, 32 * 3 + 5
    w = rng.standard_normal((k, n), dtype=F32)
    bias = rng.standard_normal(n, dtype=F32)
    packed = sk.pack_weight(w)
    x = rng.standard_normal((sk.SKINNY_MAX_M, k), dtype=F32)
    full = np.full((len(x), n), np.nan, F32)
    sk.skinny_matmul(x, packed, full, bias)
    _check(full, x, w, bias)
    for m in range(1, len(x)):
        for first in (0, len(x) - m):
            y = np.full((m, n), np.nan, F32)
            sk.skinny_matmul(x[first : first + m], packed, y, bias)
            np.testing.assert_array_equal(y, full[first : first + m], err_msg=f"rows {first}+{m}")
    wide = np.zeros((len(x), 2 * k), F32)
    wide[:, ::2] = x
    strided = np.full_like(full, np.nan)
    sk._skinny_serial(wide[:, ::2], packed.tiles, bias, strided)
    np.testing.assert_array_equal(strided, full)


@pytest.mark.parametrize("chunks", [2, 3, 11])
def test_column_chunks_over_the_worker_pool_cover_every_column(two_threads, chunks):
    """The pooled kernel splits the weight's tiles of 32 columns into chunks; the last tile
    is partial. Whichever thread computes a chunk, every column is the serial kernel's, bit
    for bit (the same per-column summation), and within the float64 bound. The calls repeat
    until the worker thread has computed chunks of them (``worker_helps``)."""
    rng = np.random.default_rng(chunks)
    k, n = 4099, 32 * 11 + 3  # a long K: chunks of one tile still take microseconds
    w = rng.standard_normal((k, n), dtype=F32)
    bias = rng.standard_normal(n, dtype=F32)
    packed = sk.pack_weight(w)
    for m in (1, 5, 16):
        x = rng.standard_normal((m, k), dtype=F32)
        serial = np.full((m, n), np.nan, F32)
        sk._skinny_serial(x, packed.tiles, bias, serial)
        _check(serial, x, w, bias)

        def call(x=x, serial=serial):
            y = np.full(serial.shape, np.nan, F32)
            sk.skinny_matmul(x, packed, y, bias, chunks=chunks)
            np.testing.assert_array_equal(y, serial)

        worker_helps(two_threads, call)


@pytest.mark.parametrize("n", [1, 31, 32, 33, 70])
def test_tiles_hold_the_weight_once_zero_padded(n):
    """tiles[t, k, c] = W[k, 32 t + c], zero past N; an [N, K] Gemm weight (transB) packs
    to the same tiles as its transpose."""
    w = np.arange(5 * n, dtype=F32).reshape(5, n) + 1
    packed = sk.pack_weight(w)
    assert packed.shape == (5, n) and packed.tiles.shape == (-(-n // 32), 5, 32)
    for t in range(packed.tiles.shape[0]):
        cols = w[:, 32 * t : 32 * t + 32]
        np.testing.assert_array_equal(packed.tiles[t, :, : cols.shape[1]], cols)
        assert not packed.tiles[t, :, cols.shape[1] :].any()
    np.testing.assert_array_equal(packed.dense(), w)
    np.testing.assert_array_equal(sk.pack_weight(w.T.copy(), transposed=True).tiles, packed.tiles)


# ----------------------------------------------------------------------------- sessions

K, N = 37, 53


def _model(op: str, rank: int, **attrs):
    """x @ W (MatMul, x of the given rank) or Gemm(x, W, bias); W and bias initializers."""
    rng = np.random.default_rng(5)
    trans_b = attrs.get("transB", 0)
    w = rng.standard_normal((N, K) if trans_b else (K, N), dtype=F32)
    inits = [numpy_helper.from_array(w, "W")]
    inputs = ["x", "W"]
    if op == "Gemm":
        inits.append(numpy_helper.from_array(rng.standard_normal(N, dtype=F32), "bias"))
        inputs.append("bias")
    lead = {1: [], 2: ["m"], 3: [1, "m"]}[rank]
    graph = helper.make_graph(
        [helper.make_node(op, inputs, ["y"], **attrs)],
        "skinny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [*lead, K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [*lead, N])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    weight = w.T if trans_b else w
    bias = numpy_helper.to_array(inits[1]) if op == "Gemm" else None
    return model, weight, bias


CASES = [
    ("MatMul", 2, {}),
    ("MatMul", 3, {}),
    ("Gemm", 2, {}),
    ("Gemm", 2, {"transB": 1}),
]


@pytest.mark.parametrize("op,rank,attrs", CASES)
def test_decode_and_verify_steps_replay_the_prebound_kernel(op, rank, attrs):
    model, w, bias = _model(op, rank, **attrs)
    sess = InferenceSession(model, providers=["cpu"])
    packed = [v for v in sess.executor.constants.values() if isinstance(v, sk.TiledWeight)]
    assert len(packed) == 1
    np.testing.assert_array_equal(packed[0].dense(), w)  # [K, N], whatever transB said
    rng = np.random.default_rng(11)
    slots = [
        (DeviceGraphSlot.PRIMARY, 1),
        (DeviceGraphSlot.VERIFY, 5),
        (DeviceGraphSlot.DRAFT, 20),  # more than SKINNY_MAX_M rows: BLAS on the packed weight
    ]
    runs = []
    for slot, m in slots:
        lead = (1, m) if rank == 3 else (m,)
        binding = sess.io_binding()
        x = binding.bind_input("x", np.zeros((*lead, K), F32))
        y = binding.bind_output("y", shape=(*lead, N))
        runs.append((slot, binding, x, y))
    for _ in range(5):
        for slot, binding, x, y in runs:
            x[...] = rng.standard_normal(x.shape, dtype=F32)
            sess.run_with_iobinding(binding, slot)
            _check(y.reshape(-1, N), x.reshape(-1, K), w, bias)
    provider = sess.main_provider
    for slot, *_ in runs:
        stats = sess.graph_stats(slot)
        assert stats.captures == 1 and stats.replays == 3 and stats.fallbacks == 0, slot
        graph = provider.recorded_graph(slot)
        assert graph.bound == len(graph.calls) == 1, slot  # the kernel's own prebound call


def test_one_dimensional_input_and_plain_run():
    model, w, _ = _model("MatMul", 1)
    sess = InferenceSession(model, providers=["cpu"])
    x = np.random.default_rng(2).standard_normal(K, dtype=F32)
    (y,) = sess.run(None, {"x": x})
    assert y.shape == (N,)
    _check(y[None], x[None], w)


@pytest.mark.parametrize("how", ["option", "environment"])
def test_disabled_prepack_keeps_the_plain_weight(monkeypatch, how):
    model, w, _ = _model("MatMul", 2)
    if how == "option":
        sess = InferenceSession(model, providers=[("cpu", {"skinny_matmul": False})])
    else:
        monkeypatch.setenv("ONNX_GENRT_SKINNY_MATMUL", "0")
        sess = InferenceSession(model, providers=["cpu"])
    assert not any(isinstance(v, sk.TiledWeight) for v in sess.executor.constants.values())
    x = np.random.default_rng(4).standard_normal((3, K), dtype=F32)
    (y,) = sess.run(None, {"x": x})
    _check(y, x, w)


@pytest.mark.parametrize("op,rank,attrs", CASES)
def test_prompt_rows_run_the_skinny_kernel_in_blocks(monkeypatch, op, rank, attrs):
    """A prompt of more rows than one block (``PROMPT_BLOCK_ROWS``) runs the skinny kernel
    block by block on the tiles, never a dense copy of the weight: every row matches
    float64, and a block's rows carry the bits of the same rows multiplied alone."""
    from onnx_genrt.providers.cpu.kernels import matmul as mm

    model, w, bias = _model(op, rank, **attrs)
    sess = InferenceSession(model, providers=["cpu"])

    def no_dense(self):
        raise AssertionError("a prompt made a dense copy of the tiled weight")

    monkeypatch.setattr(sk.TiledWeight, "dense", no_dense)
    m = 2 * mm.PROMPT_BLOCK_ROWS + 11
    x = np.random.default_rng(12).standard_normal((m, K), dtype=F32)
    lead = (1,) if rank == 3 else ()
    (y,) = sess.run(None, {"x": x.reshape(*lead, m, K)})
    _check(y.reshape(m, N), x, w, bias)
    r0 = mm.PROMPT_BLOCK_ROWS
    (alone,) = sess.run(None, {"x": x[r0 : r0 + 16].reshape(*lead, 16, K)})
    np.testing.assert_array_equal(y.reshape(m, N)[r0 : r0 + 16], alone.reshape(16, N))
