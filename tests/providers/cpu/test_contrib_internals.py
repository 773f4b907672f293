"""The CPU provider's com.microsoft kernels inside (``providers/cpu/kernels/contrib_quant.py``,
``_int4_matmul.py``, ``contrib_attention.py``): MatMulNBits dequantizes once and keeps only
what its cache option says, the packed int4 paths agree with each other and with a float64
reference, and GroupQueryAttention writes a shared cache buffer in place. The op's results
on every provider are in tests/ops/test_contrib.py, whose model builders these tests reuse."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from onnx_genrt.core.kernels import KernelContext, NodeInfo
from onnx_genrt.providers.cpu.kernels import REGISTRY, contrib_quant
from onnx_genrt.session import InferenceSession

from ...ops.test_contrib import (
    ATTRS,
    F32,
    GQA_INPUTS,
    MS,
    ROTARY,
    _f64,
    _feeds,
    _gqa_inputs,
    _gqa_model,
    _model,
    _nbits_case,
    _quantize_nbits,
    _rng,
)
from .pool_helpers import worker_helps


@pytest.mark.parametrize("accuracy,vnni", [(0, True), (4, False), (4, True)])
def test_matmul_nbits_constant_int4_weight_is_tiled_once_at_load(
    monkeypatch, accuracy: int, vnni: bool
) -> None:
    """Constant B, scales and zero points are prepacked into tiles when the session is
    built, and the plan keeps no host copy of them: the weight is held once (at
    accuracy_level 4 too, whose int8 kernel wants its own tile width, or the VNNI layout
    where the CPU has it and the ``int4_vnni`` option is on)."""
    from onnx_genrt.providers.cpu.kernels._int4_vnni import HOST_VNNI
    from onnx_genrt.session.constant_cache import ReleasedConstant

    tiled: list[tuple[tuple[int, ...], np.ndarray]] = []
    real = contrib_quant.tile_weight

    def counting(packed: np.ndarray, n: int, *layout):
        tiles = real(packed, n, *layout)
        tiled.append((packed.shape, tiles))
        return tiles

    monkeypatch.setattr(contrib_quant, "tile_weight", counting)
    model, inp, want = _nbits_case(44, 1, 128, 32, 4, 32, "uint8", False, F32, accuracy=accuracy)
    sess = InferenceSession(model, providers=[("cpu", {"int4_vnni": vnni})])
    assert [shape for shape, _ in tiled] == [(32, 4, 16)]
    held_vnni = accuracy == 4 and vnni and HOST_VNNI
    assert tiled[0][1].ndim == (4 if held_vnni else 3)
    builds = contrib_quant.DEQUANT_CACHE.builds
    # int8 activations move the result by about a percent of its scale
    atol = 1e-4 if accuracy == 0 else 0.02 * float(np.abs(want).max())
    for _ in range(3):
        (got,) = sess.run(None, {"A": inp["A"]})
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=atol)
    assert contrib_quant.DEQUANT_CACHE.builds == builds and len(tiled) == 1
    held = {name: sess.plan.constants[name] for name in ("B", "scales", "zero_points")}
    assert all(isinstance(v, ReleasedConstant) for v in held.values()), held
    assert held["B"].shape == inp["B"].shape and held["B"].dtype == np.uint8


@pytest.mark.parametrize("m", [1, 40])
@pytest.mark.parametrize("consts", [(), ("scales", "zero_points"), ("B",)])
def test_matmul_nbits_int4_weight_not_all_constant(consts: tuple[str, ...], m: int) -> None:
    """B, scales or zero points fed as inputs: the prepacked ones are taken back to their
    own layout, the weight is tiled (or dequantized) from the fed arrays, once per set of
    arrays, and entries die with their weights."""
    model, inp, want = _nbits_case(44, m, 128, 32, 4, 32, "uint8", False, F32)
    rebuilt = _model(
        "MatMulNBits",
        inp,
        ["A", "B", "scales", "zero_points"],
        ["Y"],
        [F32],
        consts=consts,
        K=128,
        N=32,
        bits=4,
        block_size=32,
    )
    sess = InferenceSession(rebuilt, providers=[("cpu", {"nbits_cache": True})])
    feeds = _feeds(rebuilt, inp)
    builds = contrib_quant.DEQUANT_CACHE.builds
    for _ in range(3):
        (got,) = sess.run(None, feeds)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert contrib_quant.DEQUANT_CACHE.builds == builds + 1
    cached = len(contrib_quant.DEQUANT_CACHE)
    del sess, feeds
    import gc

    gc.collect()
    assert len(contrib_quant.DEQUANT_CACHE) < cached


@pytest.mark.parametrize("rows", [32, 48, 64, 128])
@pytest.mark.parametrize("zero", ["none", "uint8"])
@pytest.mark.parametrize("m", [2, 3, 4, 5, 6, 7, 8, 9, 16, 17])
def test_int4_float_gemm_rows_equal_the_one_row_kernel(m: int, zero: str, rows: int) -> None:
    """The float 4-bit kernel for M > 1 (groups of ``GROUP`` rows of x and a last smaller
    one, 32 output columns at a time, last tile partial) against float64, and each row the
    same bits as that row of x alone."""
    from onnx_genrt.providers.cpu.kernels import _int4_matmul as im

    rng = _rng(50 + m)
    n, k = 300, 256
    qw = _quantize_nbits(rng.standard_normal((n, k)), 4, 32, zero)
    zeros = None
    if zero == "uint8":
        zeros = contrib_quant._nbits_zeros(qw["zero_points"], n, k // 32, 4)
    w = im.pack_int4(qw["B"], qw["scales"], zeros, n, 32, rows=rows)
    x = rng.standard_normal((m, k)).astype(np.float32)
    got = np.full((m, n), np.nan, np.float32)
    im._int4_serial(x, w.tiles, w.scales, w.zeros, w.block, got)
    np.testing.assert_allclose(got, _f64(x) @ qw["ref"].T, rtol=1e-4, atol=1e-4)
    for i in range(m):
        row = np.full((1, n), np.nan, np.float32)
        im._int4_serial(x[i : i + 1], w.tiles, w.scales, w.zeros, w.block, row)
        np.testing.assert_array_equal(got[i], row[0])
    # Tiles and scales that are views with gaps (the kernel reads them through pointers).
    wide = np.zeros((*w.tiles.shape[:2], 2 * w.tiles.shape[2]), np.uint8)
    wide[:, :, ::2] = w.tiles
    wide_scales = np.repeat(w.scales, 2, axis=1)
    view = np.full((m, n), np.nan, np.float32)
    im._int4_serial(x, wide[:, :, ::2], wide_scales[:, ::2], w.zeros, w.block, view)
    np.testing.assert_array_equal(view, got)


@pytest.mark.parametrize("m", [1, 4, 5])
def test_int4_matmul_on_the_worker_pool_matches_serial(two_threads, m: int) -> None:
    """Tiles split into chunks over the caller and the worker thread: the serial kernel's
    bits (repeated until the worker computed chunks), and the float64 product."""
    from onnx_genrt.providers.cpu.kernels import _int4_matmul as im

    rng = _rng(49)
    k = 2048  # chunks of a microsecond or more: the worker has time to take some
    qw = _quantize_nbits(rng.standard_normal((300, k)), 4, 32, "uint8")
    zeros = contrib_quant._nbits_zeros(qw["zero_points"], 300, k // 32, 4)
    w = im.pack_int4(qw["B"], qw["scales"], zeros, 300, 32, rows=32)
    x = rng.standard_normal((m, k)).astype(np.float32)
    serial = np.empty((m, 300), np.float32)
    im._int4_serial(x, w.tiles, w.scales, w.zeros, w.block, serial)
    np.testing.assert_allclose(serial, _f64(x) @ qw["ref"].T, rtol=1e-4, atol=1e-4)

    def call() -> None:
        parallel = np.full((m, 300), np.nan, np.float32)
        im.int4_matmul(x, w, parallel, chunks=5)
        np.testing.assert_array_equal(parallel, serial)

    worker_helps(two_threads, call)


@pytest.mark.parametrize("keep", [False, True])
def test_matmul_nbits_int4_float_weight_only_for_large_m(monkeypatch, keep: bool) -> None:
    """Decode-sized calls never build the float32 weight; each large call does (from the
    tiles), unless the cache keeps it (then once). The weight is tiled once, at load."""
    real_dequant, real_tiles = contrib_quant.dequantize_tiles, contrib_quant.tile_weight
    built: list[str] = []

    def counting(real, what):
        def build(*args: Any) -> Any:
            built.append(what)
            return real(*args)

        return build

    monkeypatch.setattr(contrib_quant, "dequantize_tiles", counting(real_dequant, "float"))
    monkeypatch.setattr(contrib_quant, "tile_weight", counting(real_tiles, "tiles"))
    model, inp, _ = _nbits_case(50, 1, 128, 32, 4, 32, "none", False, F32)
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "m"
    sess = InferenceSession(model, providers=[("cpu", {"nbits_cache": keep})])
    a = _rng(51).standard_normal((40, 128)).astype(np.float32)
    want = _f64(a) @ _quantize_nbits(_rng(50).standard_normal((32, 128)), 4, 32, "none")["ref"].T
    for rows in (1, 16, 2):
        (got,) = sess.run(None, {"A": a[:rows]})
        np.testing.assert_allclose(got, want[:rows], rtol=1e-4, atol=1e-4)
    assert built == ["tiles"]
    for _ in range(2):
        (got,) = sess.run(None, {"A": a})
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert built.count("float") == (1 if keep else 2)
    assert built.count("tiles") == 1


@pytest.mark.parametrize("layout", ["float", "int8", "vnni"])
@pytest.mark.parametrize("zero", ["none", "uint8", "float"])
@pytest.mark.parametrize("k", [256, 200])
def test_int4_tiles_dequantize_to_the_packed_weight(
    monkeypatch, zero: str, k: int, layout: str
) -> None:
    """Dequantizing the tiles (row tiles of either width, or the VNNI layout) gives the
    bits of dequantizing the packed weight, transposed (K not a multiple of the block
    included), and ``Int4Input.plain`` gives the inputs back."""
    from onnx_genrt.core.kernels import NodeInfo
    from onnx_genrt.providers.cpu.kernels import _int4_matmul as im
    from onnx_genrt.providers.cpu.kernels._int4_vnni import HOST_VNNI

    if layout == "vnni" and not HOST_VNNI:
        pytest.skip("the VNNI layout is used on CPUs with AVX-512 VNNI only")
    monkeypatch.setenv("ONNX_GENRT_INT4_VNNI", "1" if layout == "vnni" else "0")
    rng = _rng(53)
    n, block = 150, 64
    qw = _quantize_nbits(rng.standard_normal((n, k)), 4, block, zero)
    nb = -(-k // block)
    attrs = {"K": k, "N": n, "bits": 4, "block_size": block}
    attrs["accuracy_level"] = 0 if layout == "float" else 4
    node = NodeInfo("MatMulNBits", "mm", MS, 1, attrs)
    node.input_names = ("A", "B", "scales", "zero_points")
    packed = [
        contrib_quant.prepack_int4(None, node, i, qw[name])
        for i, name in ((1, "B"), (2, "scales"), (3, "zero_points"))
        if name in qw
    ]
    zp = packed[2] if len(packed) == 3 else None
    assert packed[0].packed.ndim == (4 if layout == "vnni" else 3)
    w4 = contrib_quant._prepacked(packed[0], packed[1], zp, n, block)
    from_tiles = im.dequantize_tiles(w4, k)
    direct = contrib_quant.dequantize_nbits(
        qw["B"], qw["scales"], qw.get("zero_points"), k, n, 4, block
    )
    np.testing.assert_array_equal(from_tiles, direct.T)
    np.testing.assert_allclose(from_tiles.T, qw["ref"], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(packed[0].plain(), qw["B"])
    np.testing.assert_array_equal(packed[1].plain(), qw["scales"])
    if zp is not None:
        want_zp = contrib_quant._nbits_zeros(qw["zero_points"], n, nb, 4)
        np.testing.assert_array_equal(zp.plain(), want_zp)


@pytest.mark.parametrize("zero", ["none", "uint8", "float"])
def test_whole_block_int4_dequant_equals_the_general_one(zero: str) -> None:
    """The vectorized 4-bit path gives the same bits as the general loop."""
    rng = _rng(52)
    n, k, block = 70, 256, 64
    qw = _quantize_nbits(rng.standard_normal((n, k)), 4, block, zero)
    nb = k // block
    packed = np.ascontiguousarray(qw["B"], np.uint8).reshape(n, nb, block // 2)
    scales = np.ascontiguousarray(qw["scales"], np.float32).reshape(n, nb)
    zeros = contrib_quant._nbits_zeros(qw.get("zero_points"), n, nb, 4)
    general = np.empty((n, k), np.float32)
    contrib_quant._dequant_nbits(packed, scales, zeros, 4, block, k, general)
    fast = contrib_quant.dequantize_nbits(
        qw["B"], qw["scales"], qw.get("zero_points"), k, n, 4, block
    )
    np.testing.assert_array_equal(fast, general)
    np.testing.assert_allclose(fast, qw["ref"], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rope", ROTARY)
@pytest.mark.parametrize("dtype", [F32, np.dtype(np.float16)], ids=str)
def test_gqa_shared_buffer_is_written_in_place(rope: dict, dtype: np.dtype) -> None:
    """past_key longer than total_sequence_length: the fed buffer is written in place and
    returned as present, by the session and by the kernel alone; only each entry's new slot
    changes."""
    inp = _gqa_inputs(3, dtype, b=2, s=1, seqlens=[9, 5], cap=16, total=10)
    model = _gqa_model(inp, dtype, **ATTRS, **rope)
    feeds = _feeds(model, inp)
    _, pk, pv = InferenceSession(model, providers=["cpu"]).run(None, feeds)
    assert pk is feeds["past_key"] and pv is feeds["past_value"]
    args = [None if inp[n] is None else inp[n].copy() for n in GQA_INPUTS[:9]]
    if not rope:
        args[7] = args[8] = None
    before = args[3].copy()
    names = [f"i{i}" if a is not None else "" for i, a in enumerate(args)]
    node = NodeInfo(
        "GroupQueryAttention", "gqa", MS, 1, {**ATTRS, **rope}, tuple(names), ("y", "pk", "pv")
    )
    while args[-1] is None:  # trailing absent inputs are not passed
        args.pop()
    _, pk, pv = REGISTRY.lookup(MS, "GroupQueryAttention", 1).fn(KernelContext(node), *args)
    assert pk is args[3] and pv is args[4]
    changed = np.any(pk != before, axis=(1, 3))  # (batch, position)
    assert changed[0].nonzero()[0].tolist() == [9] and changed[1].nonzero()[0].tolist() == [5]
