"""The CUDA small-K 4-bit GEMV's work split, checked on the CPU (no GPU, no CuPy).

``nbits4_gemv16_small_k`` (providers/cuda/kernels/contrib_quant.py) gives each column ``lpc``
lanes of a warp, and lane ``sub`` of column n the chunks sub, sub + lpc, ... (``cpl`` of them).
Its index math is mirrored below in numpy: every (column, chunk) must be loaded exactly once,
a column's ``warp_sum<lpc>`` butterfly must stay within its own lanes, one lane must store
each column. A float64 emulation of the kernel's arithmetic (2^23 trick, zero points, blocks
of 32 to 128) is then compared with a plainly dequantized matmul, and the project's CPU MatMulNBits kernel runs on the same
packed weights, tying the emulation's reading of the layout to the project's.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from onnx_genrt.core.kernels import MS_DOMAIN, KernelContext, NodeInfo
from onnx_genrt.providers.cpu.kernels import REGISTRY
from onnx_genrt.providers.cuda.gemv_split import (
    SMALL_K_MAX_CHUNKS,
    SMALL_K_MAX_CPL,
    nbits4_small_k_split,
    small_k_blocks,
)

KS = [32, 96, 896, 2048]
H200_SMS = 132


def _loads(n: int, chunks: int, lpc: int, cpl: int):
    """(column, chunk) of every load the kernel's threads make, as the kernel computes them:
    n = (blockIdx.x * 8 + threadIdx.y) * (32 / lpc) + lane / lpc, c = lane % lpc + u * lpc,
    loaded when c < chunks and n < N."""
    bx, y, lane, u = np.meshgrid(
        np.arange(small_k_blocks(n, lpc)),
        np.arange(8),
        np.arange(32),
        np.arange(cpl),
        indexing="ij",
    )
    col = (bx * 8 + y) * (32 // lpc) + lane // lpc
    c = lane % lpc + u * lpc
    ok = (c < chunks) & (col < n)
    return col[ok], c[ok]


def _check_cover(n: int, chunks: int, lpc: int, cpl: int) -> None:
    col, c = _loads(n, chunks, lpc, cpl)
    counts = np.bincount(col * chunks + c, minlength=n * chunks)
    assert counts.shape == (n * chunks,)
    assert (counts == 1).all(), (n, chunks, lpc, cpl, np.flatnonzero(counts != 1)[:8])


def _butterfly(v: np.ndarray, lpc: int) -> np.ndarray:
    """warp_sum<lpc> on 32 lane values: v += shfl_xor(v, o) for o = lpc / 2, ..., 1."""
    lanes = np.arange(32)
    o = lpc // 2
    while o > 0:
        v = v + v[lanes ^ o]
        o //= 2
    return v


#: Every lane count the project's split picks, over the shapes tested below.
CHOSEN_LPC = sorted(
    {
        split[0]
        for k in KS
        for n in (1, 7, 4099, 20001, 151936)
        for sms in (1, H200_SMS)
        if (split := nbits4_small_k_split(k // 32, n, sms)) is not None
    }
)


@pytest.mark.parametrize("lpc", CHOSEN_LPC)
def test_butterfly_model_keeps_each_chosen_lane_count_within_its_column(lpc):
    """A design check on this file's numpy model of ``warp_sum<lpc>`` (the CUDA code runs
    only in the GPU lane): for each lane count ``nbits4_small_k_split`` picks, the xor
    butterfly sums exactly one column's lanes, and one lane per column stores."""
    rng = np.random.default_rng(lpc)
    v = rng.integers(-1000, 1000, 32).astype(np.float64)
    got = _butterfly(v, lpc)
    want = np.repeat(v.reshape(32 // lpc, lpc).sum(axis=1), lpc)  # lanes of column lane / lpc
    np.testing.assert_array_equal(got, want)
    writers = np.flatnonzero(np.arange(32) % lpc == 0)  # sub == 0 stores
    np.testing.assert_array_equal(writers // lpc, np.arange(32 // lpc))


@pytest.mark.parametrize(
    "k,lpc",
    [(k, lpc) for k in KS for lpc in (2, 4, 8, 16) if -(-k // 32 // lpc) <= SMALL_K_MAX_CPL],
)
def test_every_chunk_loaded_once_for_each_lane_count(k, lpc):
    chunks = k // 32
    cpl = -(-chunks // lpc)
    for n in (1, 5, 4099):
        _check_cover(n, chunks, lpc, cpl)


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("n", [1, 7, 4099, 20001, 151936])
@pytest.mark.parametrize("sms", [1, H200_SMS])
def test_split_choice_covers_every_chunk(k, n, sms):
    chunks = k // 32
    split = nbits4_small_k_split(chunks, n, sms)
    if split is None:
        # Only when even 16 lanes a column leave fewer than 2 blocks per SM.
        assert small_k_blocks(n, 16) < 2 * sms
        return
    lpc, cpl = split
    assert lpc in (2, 4, 8, 16) and cpl == -(-chunks // lpc) <= SMALL_K_MAX_CPL
    fewest = 2
    while fewest * SMALL_K_MAX_CPL < chunks:
        fewest *= 2
    assert lpc == fewest or small_k_blocks(n, lpc // 2) < 2 * sms  # fewest lanes that fill
    _check_cover(n, chunks, lpc, cpl)


def test_split_for_the_lm_head_and_limits():
    assert nbits4_small_k_split(896 // 32, 151936, H200_SMS) == (4, 7)  # Qwen2.5-0.5B lm_head
    assert small_k_blocks(151936, 4) == 2374
    assert nbits4_small_k_split(896 // 32, 896, H200_SMS) is None  # too few columns
    assert nbits4_small_k_split(SMALL_K_MAX_CHUNKS + 1, 10**6, H200_SMS) is None
    assert nbits4_small_k_split(SMALL_K_MAX_CHUNKS, 10**6, H200_SMS) == (8, 8)
    assert nbits4_small_k_split(0, 100, 1) is None


# ----------------------------------------------------------------------------- arithmetic


def _zero_at(zp_mode, zp_u8, zp_f, n, blk):
    """Mirror of the kernel's zero_at<W, 4>: mode 0 is 8, 1 a packed nibble, 2 a float."""
    if zp_mode == 1:
        return float((int(zp_u8[n, blk // 2]) >> ((blk % 2) * 4)) & 15)
    if zp_mode == 2:
        return float(zp_f[n, blk])
    return 8.0


def _emulate(a, packed, scales, zp_mode, zp_u8, zp_f, k, n, block, lpc, cpl):
    """The kernel's sums in float64: per lane and chunk, the four words' values through the
    2^23 trick of nbits_word, then the column's lanes summed."""
    m_rows = a.shape[0]
    chunks = k // 32
    words = packed.reshape(n, -1).view("<u4")  # [N, row_chunks * 4]
    y = np.zeros((m_rows, n))
    for col, c in zip(*_loads(n, chunks, lpc, cpl), strict=True):
        blk = c * 32 // block
        s = float(scales[col, blk])
        z = _zero_at(zp_mode, zp_u8, zp_f, col, blk)
        zint = zp_mode != 2
        off = 8388608.0 + z if zint else 8388608.0
        zf = 0.0 if zint else z
        for w in range(4):
            q = int(words[col, c * 4 + w])
            bits = np.array([((q >> (4 * e)) & 15) | 0x4B000000 for e in range(8)], np.uint32)
            qv = (bits.view(np.float32).astype(np.float64) - off) - zf
            k0 = c * 32 + 8 * w
            y[:, col] += s * (a[:, k0 : k0 + 8] @ qv)
    return y


def _dequant(packed, scales, zp_mode, zp_u8, zp_f, k, n, block):
    nb = -(-k // block)
    b = packed.reshape(n, -1)
    q = np.stack([b & 15, b >> 4], axis=-1).reshape(n, -1)[:, :k].astype(np.float64)
    if zp_mode == 1:
        z = np.stack([zp_u8 & 15, zp_u8 >> 4], axis=-1).reshape(n, -1)[:, :nb]
    elif zp_mode == 2:
        z = zp_f
    else:
        z = np.full((n, nb), 8.0)
    z = np.repeat(z.astype(np.float64), block, axis=1)[:, :k]
    s = np.repeat(scales.astype(np.float64), block, axis=1)[:, :k]
    return (q - z) * s


def _cpu_kernel(a, packed, scales, zp_mode, zp_u8, zp_f, k, n, block):
    """The project's CPU MatMulNBits on the same packed weights (float32)."""
    node = helper.make_node(
        "MatMulNBits",
        ["A", "B", "scales", "zero_points" if zp_mode else ""],
        ["Y"],
        domain=MS_DOMAIN,
        K=k,
        N=n,
        bits=4,
        block_size=block,
    )
    args = [a.astype(np.float32), packed, scales.astype(np.float32).reshape(-1)]
    if zp_mode:
        args.append(zp_u8.reshape(-1) if zp_mode == 1 else zp_f.astype(np.float32).reshape(-1))
    kdef = REGISTRY.lookup(MS_DOMAIN, "MatMulNBits", 1)
    return np.asarray(kdef.fn(KernelContext(NodeInfo.from_proto(node, 1)), *args), np.float64)


@pytest.mark.parametrize(
    "k,block,lpc", [(896, 32, 4), (896, 32, 8), (96, 32, 2), (96, 64, 2), (2048, 128, 8)]
)
@pytest.mark.parametrize("zp_mode", [0, 1, 2])
def test_emulated_cuda_sums_match_float64_and_the_cpu_kernel(k, block, lpc, zp_mode):
    """The numpy emulation of the CUDA kernel's arithmetic (a model: the CUDA code runs only
    in the GPU lane) against a plainly dequantized float64 matmul, and the project's CPU
    MatMulNBits against both on the same packed weights, so the emulation's reading of the
    layout (nibble order, zero-point packing, blocks) is the one the project implements."""
    rng = np.random.default_rng(k + block + lpc + zp_mode)
    n, m_rows = 37, 3
    nb = -(-k // block)
    packed = rng.integers(0, 256, (n, nb, block // 2)).astype(np.uint8)
    scales = rng.uniform(0.5, 1.5, (n, nb)).astype(np.float16)
    zp_u8 = rng.integers(0, 256, (n, -(-nb // 2))).astype(np.uint8)
    zp_f = rng.uniform(0, 15, (n, nb)).astype(np.float16)
    a = rng.standard_normal((m_rows, k)).astype(np.float32).astype(np.float64)
    cpl = -(-(k // 32) // lpc)
    got = _emulate(a, packed, scales, zp_mode, zp_u8, zp_f, k, n, block, lpc, cpl)
    want = a @ _dequant(packed, scales, zp_mode, zp_u8, zp_f, k, n, block).T
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-9)
    cpu = _cpu_kernel(a, packed, scales, zp_mode, zp_u8, zp_f, k, n, block)
    scale = np.abs(a) @ np.abs(_dequant(packed, scales, zp_mode, zp_u8, zp_f, k, n, block)).T
    assert np.all(np.abs(cpu - want) <= 1e-5 * scale + 1e-6)
