"""MatMulNBits at accuracy_level 4 (int8 activations) against onnxruntime's own level-4 output.

At accuracy_level 4 onnxruntime's CPU provider quantizes each row of A per block to int8
(``scale = max|a| / 127``, round half to even), takes the block dot products in integers and
scales them back. Its output then differs from the float result by a few tenths on these
shapes; our level-4 output must be within a hundredth of that difference of onnxruntime's
(it measures about 1e-4 of it: float32 summation order), so a float path, a wrong rounding
rule or a wrong zero point fails. Edge cases (ties, overflow, NaN) are also checked against a
float64 numpy reading of the same contract.

Both integer kernels run these tests (the ``int8_kernel`` fixture): ``vpdpbusd`` on VNNI
tiles (``_int4_vnni``, CPUs with AVX-512 VNNI) and int16 multiplies on row tiles
(``_int8_activations``); they also give each other's bits.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from onnx import ModelProto, helper, numpy_helper

from onnx_genrt.core.errors import UnsupportedOpError
from onnx_genrt.providers.cpu.kernels import _int4_matmul as im
from onnx_genrt.providers.cpu.kernels import _int4_vnni as vnni
from onnx_genrt.providers.cpu.kernels import _int8_activations as q8
from onnx_genrt.providers.cpu.kernels import contrib_quant
from onnx_genrt.session import InferenceSession

from ...ops.test_contrib import _pack
from .pool_helpers import worker_helps

ort = pytest.importorskip("onnxruntime")
ort.set_default_logger_severity(3)

F32 = np.float32
#: Our level-4 error against onnxruntime's level 4, as a fraction of onnxruntime's own
#: level-4 minus level-1 difference on the same inputs.
OF_INT8_EFFECT = 0.01
NO_VNNI = pytest.mark.skipif(not vnni.HOST_VNNI, reason="the CPU lacks AVX-512 VNNI")
KERNELS = ["int16", pytest.param("vnni", marks=NO_VNNI)]


@pytest.fixture(params=KERNELS)
def int8_kernel(request, monkeypatch) -> str:
    """The integer kernel that sessions made in the test take at accuracy_level 4:
    ``vnni`` (the CPU provider's ``int4_vnni`` option from ``ONNX_GENRT_INT4_VNNI``) or
    ``int16``."""
    monkeypatch.setenv(vnni.ENV, "1" if request.param == "vnni" else "0")
    return request.param


def _weights(
    rng: np.random.Generator, n: int, k: int, bits: int, block: int, zero: str
) -> dict[str, Any]:
    """Random quantized weights in MatMulNBits' layout, and their integer values q (N, nb,
    block), zero points z (N, nb) and scales (N, nb) for the references."""
    nb = -(-k // block)
    q = rng.integers(0, 1 << bits, (n, nb, block))
    scales = (rng.random((n, nb)) * 0.2 + 0.01).astype(F32)
    if zero == "none":
        z = np.full((n, nb), 1 << (bits - 1))
        zp = None
    else:
        z = rng.integers(0, 1 << bits, (n, nb))
        zpad = np.zeros((n, -(-nb * bits // 8) * (8 // bits)), np.int64)
        zpad[:, :nb] = z
        zp = _pack(zpad, bits) if zero == "uint8" else z.astype(F32)
    return {"B": _pack(q, bits), "scales": scales, "zero_points": zp, "q": q, "z": z}


def _model(w: dict[str, Any], k: int, n: int, bits: int, block: int, level: int, bias=None):
    """A single MatMulNBits node with its weights (and bias) as initializers."""
    consts = {"B": w["B"], "scales": w["scales"], "zero_points": w["zero_points"], "bias": bias}
    names = ["A", "B", "scales", "zero_points" if w["zero_points"] is not None else ""]
    if bias is not None:
        names += ["", "bias"]
    node = helper.make_node(
        "MatMulNBits",
        names,
        ["Y"],
        domain="com.microsoft",
        K=k,
        N=n,
        bits=bits,
        block_size=block,
        accuracy_level=level,
    )
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("A", 1, ["m", k])],
        [helper.make_tensor_value_info("Y", 1, None)],
        [numpy_helper.from_array(v, name) for name, v in consts.items() if v is not None],
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)],
    )
    model.ir_version = 10
    return model


def _ort(model: ModelProto, a: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"A": a})[0]


def _ours(model: ModelProto, a: np.ndarray) -> np.ndarray:
    return InferenceSession(model, providers=["cpu"]).run(None, {"A": a})[0]


def _contract(a: np.ndarray, w: dict[str, Any], block: int) -> np.ndarray:
    """The level-4 result in float64 from numpy: A quantized per block (float32 arithmetic,
    np.rint: half to even), integer block dots, scales applied in float64."""
    m, k = a.shape
    nb = w["scales"].shape[1]
    pad = np.zeros((m, nb * block), F32)
    pad[:, :k] = a
    blocks = pad.reshape(m, nb, block)
    amax = np.abs(blocks).max(-1)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, F32(127) / amax, F32(0)).astype(F32)
    qa = np.rint(blocks * inv[..., None]).astype(np.int64)
    sa = (amax / F32(127)).astype(np.float64)
    dots = np.einsum("mbk,nbk->mnb", qa, w["q"] - w["z"][..., None])
    return (dots * sa[:, None, :] * w["scales"].astype(np.float64)[None]).sum(-1)


def _dequantized(w: dict[str, Any], k: int) -> np.ndarray:
    """The float64 (N, K) weight."""
    deq = (w["q"] - w["z"][..., None]) * w["scales"].astype(np.float64)[..., None]
    return deq.reshape(deq.shape[0], -1)[:, :k]


CASES = [
    # m, k, n, bits, block, zero points, bias
    (1, 256, 300, 4, 32, "none", False),  # decode; N leaves a partial tile
    (1, 200, 150, 4, 16, "uint8", False),  # K no multiple of the block
    (5, 512, 128, 4, 64, "uint8", True),  # a verify step, with a bias
    (16, 768, 1100, 4, 32, "uint8", False),  # nine tiles
    (32, 256, 300, 4, 32, "uint8", False),  # the most rows the int16 kernel takes packed
    (3, 320, 64, 4, 128, "none", False),
    (2, 512, 40, 4, 256, "uint8", False),
    (40, 256, 96, 4, 32, "uint8", False),  # a prompt: int16 A quantized and back, then BLAS
    (520, 256, 96, 4, 32, "uint8", False),  # the same above the VNNI kernel's 512 rows
    (3, 200, 40, 8, 32, "uint8", True),  # 8-bit weights: same contract in onnxruntime
    (2, 256, 32, 2, 64, "none", False),  # 2-bit weights
]


@pytest.mark.parametrize("m,k,n,bits,block,zero,bias", CASES)
def test_level4_matches_onnxruntime_level4(int8_kernel, m, k, n, bits, block, zero, bias) -> None:
    rng = np.random.default_rng(m * 1000 + k + n + block)
    w = _weights(rng, n, k, bits, block, zero)
    b = rng.standard_normal(n).astype(F32) if bias else None
    a = rng.standard_normal((m, k)).astype(F32)
    level4, level1 = (_model(w, k, n, bits, block, lv, b) for lv in (4, 1))
    ort4, ort1 = _ort(level4, a), _ort(level1, a)
    int8_effect = np.abs(ort4 - ort1).max()
    assert int8_effect > 1e-3 * np.abs(ort1).max(), "onnxruntime kept A in float at level 4"
    ours = _ours(level4, a)
    assert ours.dtype == F32 and ours.shape == (m, n)
    assert np.abs(ours - ort4).max() <= OF_INT8_EFFECT * int8_effect
    # and the same numbers from numpy's reading of the contract
    want = _contract(a, w, block) + (0 if b is None else b)
    np.testing.assert_allclose(ours, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("m", [1, 20])
def test_ties_round_half_to_even_as_onnxruntime_does(int8_kernel, m: int) -> None:
    """A block whose max|a| is 127 has scale 1, so a = j + 0.5 is an exact tie: onnxruntime
    rounds it to even (0.5 -> 0, 1.5 -> 2, -2.5 -> -2). One weight of 1 per column (nibble 9,
    zero point 8, scale 1) reads each quantized activation out as an output."""
    k = n = 64
    q = np.full((n, 2, 32), 8)
    q.reshape(n, k)[np.arange(n), np.arange(n)] = 9
    w = {"B": _pack(q, 4), "scales": np.ones((n, 2), F32), "zero_points": None}
    a = np.tile(np.arange(k, dtype=F32) % 16 - 7.5, (m, 1))
    a[:, 0] = a[:, 32] = 127  # each block's max
    model = _model(w, k, n, 4, 32, 4)
    want = np.rint(a)
    np.testing.assert_array_equal(_ort(model, a), want)
    np.testing.assert_array_equal(_ours(model, a), want)


@pytest.mark.parametrize("block", [16, 32, 256])
@pytest.mark.parametrize("nibble,zero", [(15, 0), (0, 15), (0, None), (15, None)])
def test_largest_block_sums_are_exact(
    int8_kernel, block: int, nibble: int, zero: int | None
) -> None:
    """Every activation quantized to +-127 and every weight at its extreme: the largest
    integer sums the int16 runs and int32 blocks can see, against onnxruntime and numpy."""
    k, n = 512, 130
    nb = k // block
    q = np.full((n, nb, block), nibble)
    z = np.full((n, nb), 8 if zero is None else zero)
    zp = None if zero is None else _pack(np.full((n, 2 * (-(-nb // 2))), zero), 4)
    w = {"B": _pack(q, 4), "scales": np.ones((n, nb), F32), "zero_points": zp, "q": q, "z": z}
    a = np.ones((2, k), F32)
    a[1] *= -1
    model = _model(w, k, n, 4, block, 4)
    want = _contract(a, w, block)
    np.testing.assert_allclose(np.abs(want), abs(nibble - z[0, 0]) * k, rtol=1e-6)  # extreme
    np.testing.assert_allclose(_ours(model, a), want, rtol=1e-6)
    np.testing.assert_allclose(_ort(model, a), want, rtol=1e-6)


@pytest.mark.parametrize("m", [1, 20])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_activation_makes_its_row_nan(int8_kernel, m: int, bad: float) -> None:
    """Quantizing a block with NaN or an infinity has no meaningful scale: that row of Y is
    NaN, not a finite number; the other rows are unaffected."""
    rng = np.random.default_rng(3)
    k, n = 128, 70
    w = _weights(rng, n, k, 4, 32, "uint8")
    a = rng.standard_normal((m, k)).astype(F32)
    a[0, 40] = bad
    ours = _ours(_model(w, k, n, 4, 32, 4), a)
    assert np.isnan(ours[0]).all()
    if m > 1:
        want = _contract(a[1:], w, 32)
        np.testing.assert_allclose(ours[1:], want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_a_block_of_zeros_contributes_nothing(int8_kernel) -> None:
    rng = np.random.default_rng(4)
    k, n = 128, 50
    w = _weights(rng, n, k, 4, 32, "uint8")
    a = rng.standard_normal((3, k)).astype(F32)
    a[:, 32:64] = 0
    model = _model(w, k, n, 4, 32, 4)
    ours, ort4 = _ours(model, a), _ort(model, a)
    np.testing.assert_allclose(ours, ort4, rtol=1e-5, atol=1e-5 * np.abs(ort4).max())


@pytest.mark.parametrize("level,zero", [(0, "uint8"), (1, "none"), (2, "uint8"), (3, "none")])
def test_levels_0_to_3_keep_float_activations(level: int, zero: str) -> None:
    rng = np.random.default_rng(5 + level)
    k, n = 256, 96
    w = _weights(rng, n, k, 4, 32, zero)
    for m in (1, 20):
        a = rng.standard_normal((m, k)).astype(F32)
        want = a.astype(np.float64) @ _dequantized(w, k).T
        ours = _ours(_model(w, k, n, 4, 32, level), a)
        np.testing.assert_allclose(ours, want, rtol=1e-4, atol=1e-4)


def test_level4_with_float_zero_points_keeps_float_activations(int8_kernel) -> None:
    """onnxruntime keeps A in float for float zero points at accuracy_level 4 (it has no
    int8 kernel for them); so do we (the float kernel retiles a weight prepacked for the
    VNNI kernel)."""
    rng = np.random.default_rng(6)
    k, n = 256, 64
    w = _weights(rng, n, k, 4, 32, "float")
    a = rng.standard_normal((2, k)).astype(F32)
    model = _model(w, k, n, 4, 32, 4)
    want = a.astype(np.float64) @ _dequantized(w, k).T
    np.testing.assert_allclose(_ours(model, a), want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(_ort(model, a), want, rtol=1e-4, atol=1e-4)


def test_packed_and_prompt_paths_agree_row_by_row(int8_kernel) -> None:
    """The same rows through the packed int8 kernel (16 rows) and through quantize-and-back
    then BLAS (more rows than the packed kernel takes): a prefill and the decode steps after
    it see one contract."""
    rng = np.random.default_rng(7)
    k, n = 384, 200
    w = _weights(rng, n, k, 4, 64, "uint8")
    rows = contrib_quant.packed_max_m(True, int8_kernel == "vnni") + 8
    a = rng.standard_normal((rows, k)).astype(F32)
    sess = InferenceSession(_model(w, k, n, 4, 64, 4), providers=["cpu"])
    packed = sess.run(None, {"A": a[:16]})[0]
    prompt = sess.run(None, {"A": a})[0][:16]
    np.testing.assert_allclose(packed, prompt, rtol=1e-5, atol=1e-5 * np.abs(prompt).max())


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("m", [1, 6])
def test_int8_kernel_threads_give_the_same_bits(two_threads, m: int, kernel: str) -> None:
    rng = np.random.default_rng(8)
    k, n = 256, 700
    w = _weights(rng, n, k, 4, 32, "uint8")
    zeros = contrib_quant._nbits_zeros(w["zero_points"], n, k // 32, 4)
    packed = w["B"].reshape(n, k // 32, 16)
    x = rng.standard_normal((m, k)).astype(F32)
    serial = np.empty((m, n), F32)
    if kernel == "vnni":
        tiles = im.pack_int4(packed, w["scales"], zeros, n, 32, vnni.PANEL, vnni=True)
        vnni._vnni_serial(x, 32, tiles.tiles, tiles.scales, tiles.zeros, serial)
        parallel_kernel = vnni.int4_vnni_matmul
    else:
        tiles = im.pack_int4(packed, w["scales"], zeros, n, 32, q8.ROWS)
        q8._q8_serial(x, 32, tiles.tiles, tiles.scales, tiles.zeros, serial)
        parallel_kernel = q8.int4_int8_matmul
    want = _contract(x, w, 32)
    np.testing.assert_allclose(serial, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())

    def call() -> None:
        parallel = np.full((m, n), np.nan, F32)
        parallel_kernel(x, tiles, parallel, chunks=3)
        np.testing.assert_array_equal(parallel, serial)

    worker_helps(two_threads, call)


@NO_VNNI
@pytest.mark.parametrize(
    "m,k,n,block,zero",
    [
        (1, 256, 300, 32, "none"),  # a partial last tile
        (2, 200, 64, 16, "uint8"),  # K no multiple of the block
        (3, 512, 130, 64, "uint8"),
        (4, 768, 128, 32, "none"),
        (5, 320, 200, 128, "uint8"),  # rows beyond 4: a second pass over each panel
        (9, 512, 64, 256, "none"),
        (32, 256, 192, 32, "uint8"),
    ],
)
def test_vnni_kernel_gives_the_int16_kernels_bits(m, k, n, block, zero) -> None:
    """The integer sums are exact in both kernels and the per-block float32 steps are the
    same operations in the same order: the VNNI kernel's output is the int16 kernel's, bit
    for bit, and numpy's reading of the contract."""
    rng = np.random.default_rng(m + k + n)
    w = _weights(rng, n, k, 4, block, zero)
    nb = -(-k // block)
    zeros = None if zero == "none" else contrib_quant._nbits_zeros(w["zero_points"], n, nb, 4)
    packed = w["B"].reshape(n, nb, block // 2)
    vt = im.pack_int4(packed, w["scales"], zeros, n, block, vnni.PANEL, vnni=True)
    rt = im.pack_int4(packed, w["scales"], zeros, n, block, q8.ROWS)
    x = rng.standard_normal((m, k)).astype(F32)
    ours, int16 = np.full((m, n), np.nan, F32), np.full((m, n), np.nan, F32)
    vnni.int4_vnni_matmul(x, vt, ours)
    q8.int4_int8_matmul(x, rt, int16)
    np.testing.assert_array_equal(ours, int16)
    want = _contract(x, w, block)
    np.testing.assert_allclose(ours, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_vnni_kernel_refuses_row_tiles() -> None:
    rng = np.random.default_rng(10)
    w = _weights(rng, 64, 64, 4, 32, "none")
    tiles = im.pack_int4(w["B"].reshape(64, 2, 16), w["scales"], None, 64, 32, q8.ROWS)
    with pytest.raises(ValueError, match="VNNI tiles"):
        vnni.int4_vnni_matmul(np.ones((1, 64), F32), tiles, np.empty((1, 64), F32))


@pytest.mark.parametrize("option", [True, False])
def test_level4_weights_are_held_in_the_vnni_layout_where_the_cpu_has_it(option: bool) -> None:
    """At accuracy_level 4 the session holds B once, in the layout of the kernel it runs:
    VNNI tiles where the CPU has AVX-512 VNNI and the ``int4_vnni`` option is on, else row
    tiles."""
    rng = np.random.default_rng(11)
    k, n = 256, 96
    w = _weights(rng, n, k, 4, 32, "uint8")
    model = _model(w, k, n, 4, 32, 4)
    sess = InferenceSession(model, providers=[("cpu", {"int4_vnni": option})])
    packed = [v for v in sess.executor.constants.values() if isinstance(v, contrib_quant.Int4Input)]
    weights = [v.packed for v in packed if v.role == "weight"]
    assert len(weights) == 1 and weights[0].ndim == (4 if option and vnni.HOST_VNNI else 3)
    builds = contrib_quant.DEQUANT_CACHE.builds
    for m in (1, 6):  # decode and verify sizes: the packed kernel on the held tiles
        a = rng.standard_normal((m, k)).astype(F32)
        want = _contract(a, w, 32)
        got = sess.run(None, {"A": a})[0]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert contrib_quant.DEQUANT_CACHE.builds == builds  # no second copy


def test_an_accuracy_level_outside_0_to_4_is_refused() -> None:
    rng = np.random.default_rng(9)
    w = _weights(rng, 16, 64, 4, 32, "none")
    with pytest.raises(UnsupportedOpError, match="accuracy_level=7 is not one of 0-4"):
        InferenceSession(_model(w, 64, 16, 4, 32, 7), providers=["cpu"])


@pytest.mark.parametrize(
    "m,level,zero,bias,prebound",
    [
        (1, 4, "uint8", False, True),  # decode at level 4: the int8 kernel, prebound
        (5, 0, "none", False, True),  # verify-sized, float activations, prebound
        (16, 4, "none", False, True),
        (32, 4, "uint8", False, True),  # the most rows the integer kernel takes packed
        (20, 0, "none", False, True),  # float activations, up to 32 rows packed
        (40, 0, "none", False, False),  # float activations above 32 rows: dequantized, BLAS
        (2, 4, "uint8", True, False),  # a bias: the generic replay
    ],
)
def test_replayed_graph_matches_onnxruntime(m, level, zero, bias, prebound) -> None:
    """A captured MatMulNBits replays as one prebound packed-kernel call (no checks or
    dispatch per replay) on the buffers it was recorded with: every replay, with new values
    in the bound input, equals onnxruntime's output for those values."""
    from onnx_genrt.core.graph_slots import DeviceGraphSlot

    k, n, block = 256, 300, 32
    rng = np.random.default_rng(m * 10 + level)
    w = _weights(rng, n, k, 4, block, zero)
    b = rng.standard_normal(n).astype(F32) if bias else None
    model = _model(w, k, n, 4, block, level, b)
    sess = InferenceSession(model, providers=["cpu"])
    binding = sess.io_binding()
    a = binding.bind_input("A", np.zeros((m, k), F32))
    y = binding.bind_output("Y", shape=(m, n), dtype=F32)
    for _ in range(4):  # the capture, then replays
        a[...] = rng.standard_normal((m, k)).astype(F32)
        sess.run_with_iobinding(binding, DeviceGraphSlot.PRIMARY)
        np.testing.assert_allclose(y, _ort(model, a.copy()), rtol=2e-4, atol=2e-4)
    graph = sess.main_provider.recorded_graph(DeviceGraphSlot.PRIMARY)
    assert graph is not None and len(graph.calls) == 1
    assert graph.bound == (1 if prebound else 0)
    # the VNNI kernel's call replays in native form (``_native_calls``)
    assert graph.native_calls == (1 if prebound and level == 4 and vnni.vnni_enabled() else 0)


@NO_VNNI
def test_vnni_prompt_of_any_length_runs_packed_in_row_blocks(monkeypatch) -> None:
    """With VNNI a prompt longer than one packed call takes (``VNNI_PACKED_MAX_M``) still
    runs the integer kernel, a block of rows a call: rows past the first block carry the
    same bits as those rows multiplied alone (dequantizing + BLAS sums in another order),
    and every row meets the level-4 contract."""
    monkeypatch.setenv(vnni.ENV, "1")
    rng = np.random.default_rng(9)
    k, n, block = 256, 136, 32
    w = _weights(rng, n, k, 4, block, "uint8")
    rows = contrib_quant.VNNI_PACKED_MAX_M + 9
    a = rng.standard_normal((rows, k)).astype(F32)
    sess = InferenceSession(_model(w, k, n, 4, block, 4), providers=["cpu"])
    whole = sess.run(None, {"A": a})[0]
    tail = sess.run(None, {"A": a[-9:]})[0]
    np.testing.assert_array_equal(whole[-9:], tail)
    want = _contract(a, w, block)
    np.testing.assert_allclose(whole, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
