"""The grouped decode attention kernel's splits and merges (``providers/cuda/grouped_decode.py``:
the numpy mirror of ``kernels/_gqa_decode.py``) against float64 attention written from the
op's rules, its key ranges and merges against the visibility of every (row, key), and its
split sizing. Runs on the CPU: only the pure-Python modules are imported (no CuPy)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from onnx_genrt.core.op_rules import windowed_cache_length
from onnx_genrt.providers.cuda.attention_gemm import rotate_rows
from onnx_genrt.providers.cuda.flash_tiling import Rotary
from onnx_genrt.providers.cuda.grouped_decode import (
    DECODE_WARPS,
    MAX_DECODE_SPLITS,
    MAX_GROUP,
    MERGE_GROUP,
    DecodeShape,
    decode_problem,
    decode_splits,
    grouped_decode,
    merge_groups,
    most_keys,
    same_cut_splits,
    split_chunk,
)


def _rotary(max_pos: int, rot: int, interleaved: bool) -> Rotary:
    inv = 1.0 / 10000.0 ** (np.arange(0, rot, 2) / rot)
    angle = np.arange(max_pos)[:, None] * inv[None, :]
    return Rotary(np.cos(angle), np.sin(angle), interleaved)


def _rotate(x: np.ndarray, pos: np.ndarray, rotary: Rotary) -> np.ndarray:
    """Rows [R, H, D] rotated at positions ``pos`` [R] (clamped to the cos/sin table)."""
    p = np.clip(pos, 0, rotary.cos.shape[0] - 1)
    return rotate_rows(np, x, rotary.cos[p], rotary.sin[p], rotary.rot, rotary.interleaved)


def _reference(q, k_new, v_new, kc, vc, seqlens, *, scale, softcap, window, causal, wcache,
               sinks, rotary, storage):  # fmt: skip
    """float64 attention of each new row over every key it may see, from the op's rules: the
    cached rows, then the new keys (rotated, rounded to ``storage`` as a cache holds them;
    None: not rounded); a length past a full-length cache gives NaN."""
    batch, s, heads, d = q.shape
    kvh, cap = kc.shape[1], kc.shape[2]
    group = heads // kvh
    y = np.zeros(q.shape)
    for b in range(batch):
        total = int(seqlens[b]) + 1
        new = min(total, s)
        past = total - new
        base = windowed_cache_length(past, cap, window) if wcache else past
        pos = past + np.arange(s)
        kn = _rotate(k_new[b].astype(np.float64), pos, rotary)[:new]
        vn = v_new[b, :new].astype(np.float64)
        if storage is not None:
            kn, vn = kn.astype(storage).astype(np.float64), vn.astype(storage).astype(np.float64)
        qb = _rotate(q[b].astype(np.float64), pos, rotary) * scale
        keys = np.concatenate([kc[b, :, :base].astype(np.float64), kn.transpose(1, 0, 2)], 1)
        values = np.concatenate([vc[b, :, :base].astype(np.float64), vn.transpose(1, 0, 2)], 1)
        for i in range(s):
            if not wcache and total > cap:
                y[b, i] = np.nan
                continue
            row = base + i
            k = np.arange(keys.shape[1])
            seen = (k <= row) & ((k > row - window) if window > 0 else True) if causal else k >= 0
            for h in range(heads):
                x = keys[h // group, seen] @ qb[i, h]
                if softcap > 0:
                    x = softcap * np.tanh(x / softcap)
                top = x.max(initial=-np.inf)
                sink = None if sinks is None else float(sinks[h])
                if sink is not None:
                    top = max(top, sink)
                if top == -np.inf:
                    continue  # no key and no sink: zeros
                e = np.exp(x - top)
                den = e.sum() + (math.exp(sink - top) if sink is not None else 0.0)
                y[b, i, h] = e @ values[h // group, seen] / den
    return y


# batch, S, heads, kv heads, head size, cache rows, totals, splits, window, softcap, causal,
# wcache, sinks ("head": one per head, "smooth": smooth softmax's 0)
CASES = {
    "g7-d64-decode-length-1": (1, 1, 14, 2, 64, 300, [1], 8, 0, 0.0, True, False, None),
    "g7-d64-split-boundaries": (3, 1, 14, 2, 64, 600, [256, 257, 384], 4, 0, 0.0, True, False, None),
    "g7-d64-capacity-two-levels": (1, 1, 14, 2, 64, 4500, [4500], 40, 0, 0.0, True, False, None),
    "g7-d64-one-group-of-16": (1, 1, 14, 2, 64, 2100, [2048], 16, 0, 0.0, True, False, None),
    "g7-d64-17-splits": (1, 1, 14, 2, 64, 2300, [2177], 20, 0, 0.0, True, False, None),
    "g2-d128-verify5-capacity": (1, 5, 8, 4, 128, 1200, [1200], 24, 0, 0.0, True, False, None),
    "g1-d64-verify5-short-entry": (2, 5, 4, 4, 64, 700, [3, 650], 6, 0, 0.0, True, False, None),
    "g7-verify5-window-softcap-sink": (1, 5, 14, 2, 64, 3000, [2900], 16, 700, 30.0, True, False, "head"),
    "g2-d128-smooth-not-causal": (1, 5, 4, 2, 128, 500, [400], 8, 0, 0.0, False, False, "smooth"),
    "g7-window-cache": (1, 5, 14, 2, 64, 600, [1500], 8, 300, 0.0, True, True, None),
    "g7-window-cache-filling": (1, 5, 14, 2, 64, 600, [200], 8, 300, 0.0, True, True, None),
    "g8-d128-one-split": (1, 5, 16, 2, 128, 900, [700], 1, 0, 0.0, True, False, "head"),
    "overflow-nan": (2, 1, 14, 2, 64, 300, [100, 301], 4, 0, 0.0, True, False, None),
}  # fmt: skip


def _case(name: str, rng, dtype, interleaved: bool = False):
    b, s, heads, kvh, d, cap, totals, splits, window, softcap, causal, wcache, sink = CASES[name]
    q = rng.standard_normal((b, s, heads, d)).astype(dtype)
    k_new = rng.standard_normal((b, s, kvh, d)).astype(dtype)
    v_new = rng.standard_normal((b, s, kvh, d)).astype(dtype)
    kc = rng.standard_normal((b, kvh, cap, d)).astype(dtype)
    vc = rng.standard_normal((b, kvh, cap, d)).astype(dtype)
    seqlens = np.array(totals, np.int32) - 1
    sinks = {"head": rng.standard_normal(heads), "smooth": np.zeros(heads), None: None}[sink]
    opts = dict(
        scale=1.0 / math.sqrt(d),
        softcap=softcap,
        window=window,
        causal=causal,
        wcache=wcache,
        sinks=sinks,
        rotary=_rotary(cap + 64, d - 16, interleaved),  # rot < D: the last features pass
    )
    return (q, k_new, v_new, kc, vc, seqlens), splits, opts


def _poison_unread(kc, vc, seqlens, s, window, wcache) -> None:
    """NaN in the cache rows a call must never read: from the first new row on."""
    for b, seqlen in enumerate(seqlens):
        total = int(seqlen) + 1
        past = total - min(total, s)
        base = windowed_cache_length(past, kc.shape[2], window) if wcache else past
        kc[b, :, base:] = vc[b, :, base:] = np.nan


@pytest.mark.parametrize("itemsize", [2, 4], ids=["16-bit-tiles", "fp32-tiles"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_mirror_matches_float64_attention(case, interleaved, itemsize):
    """float64 inputs (no rounding anywhere): the splits, tiles and merges give attention to
    float64 precision, the new rows land in the cache, and nothing reads a row at or past
    the first new one."""
    rng = np.random.default_rng(len(case) * 31 + interleaved + itemsize)
    inputs, splits, opts = _case(case, rng, np.float64, interleaved)
    q, k_new, v_new, kc, vc, seqlens = inputs
    s, window, wcache = q.shape[1], opts["window"], opts["wcache"]
    _poison_unread(kc, vc, seqlens, s, window, wcache)
    want = _reference(*inputs, **opts, storage=None)
    got = grouped_decode(*inputs, splits=splits, itemsize=itemsize, **opts)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    for b, seqlen in enumerate(seqlens):
        total = int(seqlen) + 1
        new = min(total, s)
        if wcache:  # left to gqa_window_store: the cache keeps its rows
            assert np.isnan(
                kc[b, :, windowed_cache_length(total - new, kc.shape[2], window) :]
            ).all()
            continue
        rows = [p for p in range(total - new, total) if p < kc.shape[2]]
        assert np.isfinite(kc[b, :, rows]).all() and np.isfinite(vc[b, :, rows]).all()


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("case", ["g1-d64-verify5-short-entry", "g7-verify5-window-softcap-sink"])
def test_mirror_rounds_where_the_kernel_does(case, dtype):
    """A 16-bit (or fp32) cache: the new keys (rotated) and values are rounded to its type
    before use, as a cache read gives them, then only the output. Before its own rounding the
    output is float64 attention over those rounded rows; not rounding them is farther off
    than that (so the check would catch it), and the rounded output is at most one step of
    the type from the exact one."""
    rng = np.random.default_rng(7)
    inputs, splits, opts = _case(case, rng, dtype)
    exact = _reference(*inputs, **opts, storage=dtype)
    unrounded = _reference(*inputs, **opts, storage=None)
    raw = grouped_decode(*[x.copy() for x in inputs], splits=splits, round_output=False, **opts)
    np.testing.assert_allclose(raw, exact, rtol=1e-10, atol=1e-12)
    assert np.abs(unrounded - exact).max() > 1e3 * np.abs(raw - exact).max()
    got = grouped_decode(*inputs, splits=splits, **opts)
    want = exact.astype(dtype).astype(np.float64)
    step = np.spacing(np.abs(want).astype(dtype)).astype(np.float64)
    assert (np.abs(got - want) <= step).all()
    assert np.mean(got == want) > 0.95


def test_mirror_in_float32_over_a_long_cache():
    """The kernel's float32 arithmetic over 32768 keys of the 0.5B layout (one row, G = 7),
    one split and many: before the output's fp16 rounding, within 1e-6 of its magnitude of
    float64 attention (measured: about 5e-7), far below one fp16 step."""
    rng = np.random.default_rng(3)
    cap, d = 32768, 64
    q = rng.standard_normal((1, 1, 14, d))
    k_new, v_new = rng.standard_normal((2, 1, 1, 2, d))
    kc, vc = rng.standard_normal((2, 1, 2, cap, d)).astype(np.float16)
    seqlens = np.array([cap - 1], np.int32)
    opts = dict(scale=0.125, rotary=_rotary(cap, d, False))
    want = _reference(q, k_new, v_new, kc.copy(), vc.copy(), seqlens, softcap=0.0, window=0,
                      causal=True, wcache=False, sinks=None, storage=np.float16, **opts)  # fmt: skip
    size = np.abs(want).max()
    for splits in (1, 132, MAX_DECODE_SPLITS):
        got = grouped_decode(q, k_new, v_new, kc.copy(), vc.copy(), seqlens, splits=splits,
                             acc=np.float32, round_output=False, **opts)  # fmt: skip
        assert np.abs(got - want).max() < 1e-6 * size, splits
        assert np.abs(got - want).max() > 0  # float32, not float64


def _visible(row: int, keys: int, window: int, causal: bool) -> set[int]:
    if not causal:
        return set(range(keys))
    return {k for k in range(keys) if k <= row and (window <= 0 or k > row - window)}


@pytest.mark.parametrize("itemsize", [2, 4])
@pytest.mark.parametrize("case", sorted(CASES))
def test_tiles_cover_each_visible_key_once_and_merges_follow_the_splits(case, itemsize):
    """Per (row, KV head): the tiles of all splits and warps cover exactly the visible keys,
    once each; a split's keys are one range of ``chunk`` (the last shorter), each at least
    ``min_chunk`` unless it is the only one; warp w's tiles start at k_begin + (w + n W) TK,
    in order; the warps merge per split, the splits in groups of MERGE_GROUP in order, and
    the groups once more only when there are several."""
    inputs, splits, opts = _case(case, np.random.default_rng(0), np.float64)
    q, k_new, v_new, kc, vc, seqlens = inputs
    batch, s = q.shape[:2]
    cap, window, causal, wcache = kc.shape[2], opts["window"], opts["causal"], opts["wcache"]
    shape = DecodeShape(q.shape[3], itemsize)
    visits: list[tuple[int, ...]] = []
    merges: list[tuple[int, ...]] = []
    grouped_decode(*inputs, splits=splits, itemsize=itemsize, visits=visits, merges=merges, **opts)
    for b in range(batch):
        total = int(seqlens[b]) + 1
        past = total - min(total, s)
        base = windowed_cache_length(past, cap, window) if wcache else past
        keys = base + min(total, s) if wcache else min(total, cap)
        for i in range(s):
            for g in range(kc.shape[1]):
                mine = [v[3:] for v in visits if v[:3] == (b, i, g)]
                done = [m[3:] for m in merges if m[:3] == (b, i, g)]
                if not wcache and total > cap:
                    assert mine == [] and done == []
                    continue
                seen = _visible(base + i, keys, window, causal)
                covered = [k for _, _, k0, k1 in mine for k in range(k0, k1)]
                assert sorted(covered) == sorted(seen), (b, i, g)
                assert len(covered) == len(set(covered))
                _check_splits(mine, done, seen, splits, shape)


def _check_splits(mine, done, seen, splits, shape) -> None:
    lo = min(seen)
    chunk, active = split_chunk(len(seen), splits, shape.min_chunk)
    assert active <= splits
    assert {v[0] for v in mine} == set(range(active))
    for split in range(active):
        k_begin = lo + split * chunk
        k_end = min(k_begin + chunk, max(seen) + 1)
        for w in range(DECODE_WARPS):
            starts = [k0 for sp, wp, k0, _ in mine if (sp, wp) == (split, w)]
            step = DECODE_WARPS * shape.tile_keys
            want = list(range(k_begin + w * shape.tile_keys, k_end, step))
            assert starts == want, (split, w)
            for sp, wp, k0, k1 in mine:
                if (sp, wp) == (split, w):
                    assert k1 == min(k0 + shape.tile_keys, k_end)
        if active > 1:
            assert k_end - k_begin >= shape.min_chunk or split == active - 1
    assert [d for d in done if d[0] == 0] == [(0, sp, DECODE_WARPS) for sp in range(active)]
    level1 = [d[1:] for d in done if d[0] == 1]
    level2 = [d[1:] for d in done if d[0] == 2]
    if active == 1:
        assert level1 == level2 == []
        return
    groups = math.ceil(active / MERGE_GROUP)
    assert level1 == [
        (n * MERGE_GROUP, min(MERGE_GROUP, active - n * MERGE_GROUP)) for n in range(groups)
    ]
    assert level2 == ([] if groups == 1 else [(0, groups)])


def test_merge_groups_and_split_chunks():
    assert merge_groups(1) == [range(0, 1)]
    assert merge_groups(16) == [range(0, 16)]
    assert merge_groups(17) == [range(0, 16), range(16, 17)]
    assert merge_groups(MAX_DECODE_SPLITS)[-1] == range(MAX_DECODE_SPLITS - 16, MAX_DECODE_SPLITS)
    assert len(merge_groups(MAX_DECODE_SPLITS)) == 32  # the groups' merge: a lane each
    assert split_chunk(0, 8, 128) == (128, 0)
    assert split_chunk(1, 8, 128) == (128, 1)
    assert split_chunk(128, 8, 128) == (128, 1)
    assert split_chunk(129, 8, 128) == (128, 2)
    assert split_chunk(30000, 132, 128) == (228, 132)
    assert split_chunk(8192, 132, 128) == (128, 64)
    for visible in (1, 127, 128, 129, 4097, 30000, 32768):
        for splits in (1, 2, 17, 132, 512):
            chunk, active = split_chunk(visible, splits, 128)
            assert active <= splits and (active - 1) * chunk < visible <= active * chunk


@pytest.mark.parametrize("min_chunk", [32, 128])
@pytest.mark.parametrize("keys", [1, 100, 128, 160, 256, 511, 1024, 1025, 2048, 4096])
def test_same_cut_splits_give_every_length_the_chunks_of_eight(keys, min_chunk):
    """The fewest splits that cut every length up to ``keys`` as 8 splits do: each length's
    (chunk, active splits) is the same, checked length by length; one split fewer would cut
    some length otherwise (unless one is already the least, or it is 8 itself)."""
    splits = same_cut_splits(keys, 8, min_chunk)
    assert 1 <= splits <= 8
    for visible in range(keys + 1):
        assert split_chunk(visible, splits, min_chunk) == split_chunk(visible, 8, min_chunk)
    if 1 < splits < 8:
        assert any(
            split_chunk(v, splits - 1, min_chunk) != split_chunk(v, 8, min_chunk)
            for v in range(keys + 1)
        )


def test_split_count_fills_the_gpu_from_the_capacity():
    """H200 (132 SMs), the 0.5B layout (2 KV heads): decode gets two blocks per SM spread over
    the splits, verify (5 rows) fewer splits of the same blocks; never more splits than the
    capacity gives chunks of min_chunk, nor more than MAX_DECODE_SPLITS."""
    chunk = DecodeShape(64, 2).min_chunk
    assert chunk == 128
    assert decode_splits(2, 32768, 132, chunk) == 132
    assert decode_splits(10, 32768, 132, chunk) == 27
    assert decode_splits(2, 4097, 132, chunk) == 33
    assert decode_splits(2, 100, 132, chunk) == 1
    assert decode_splits(1, 1 << 20, 1000, chunk) == MAX_DECODE_SPLITS
    assert decode_splits(64 * 16, 32768, 132, chunk) == 1
    assert decode_splits(2, 32768, 132, chunk, blocks_per_sm=4) == 256
    assert most_keys(32768, 1, 0, True, False) == 32768
    assert most_keys(32768, 5, 4096, True, False) == 4096
    assert most_keys(32768, 5, 4096, False, False) == 32768  # no window without causal
    assert most_keys(600, 5, 300, True, True) == 300
    assert most_keys(600, 5, 0, True, True) == 605  # the new rows come from the inputs


@pytest.mark.parametrize(
    "head_size,itemsize,tile,loads,value_rows,min_chunk",
    [(64, 2, 32, 8, 4, 128), (128, 2, 16, 8, 2, 64), (256, 2, 8, 8, 1, 32), (32, 2, 32, 4, 8, 128),
     (64, 4, 16, 8, 2, 64), (128, 4, 8, 8, 1, 32)],
)  # fmt: skip
def test_decode_shape(head_size, itemsize, tile, loads, value_rows, min_chunk):
    shape = DecodeShape(head_size, itemsize)
    assert (shape.tile_keys, shape.key_loads, shape.value_rows) == (tile, loads, value_rows)
    assert shape.min_chunk == min_chunk
    assert shape.value_loads * shape.value_rows == shape.tile_keys
    assert shape.key_loads * shape.vec * shape.lanes_per_key == head_size
    assert shape.feature_lanes * shape.value_rows == 32


def test_decode_problem():
    assert decode_problem(64, 2, 7) is None
    assert decode_problem(128, 2, 8) is None
    assert decode_problem(256, 2, 1) is None
    assert decode_problem(128, 4, 4) is None
    assert "query heads" in decode_problem(64, 2, 9)
    assert "query heads" in decode_problem(64, 2, 0)
    assert "16 x 2^k" in decode_problem(96, 2, 7)  # 192-byte rows: 12 lanes
    assert "16 x 2^k" in decode_problem(256, 4, 1)  # 1 KiB rows: 64 lanes
    assert "16 x 2^k" in decode_problem(4, 2, 1)  # 8-byte rows


# Instances compiled by nvcc: each storage type, every head size it takes, the largest group
# (the most registers) and the 0.5B model's group of 7, in one head group and spread over two
# (head_groups); (storage, rotary cache, D, G, head groups).
_INSTANCES = [
    ("half_t", "half_t", 64, 1, 1), ("half_t", "half_t", 64, 7, 1), ("half_t", "float", 64, 8, 1),
    ("half_t", "half_t", 128, 8, 1), ("half_t", "half_t", 256, 8, 1),
    ("bf16_t", "bf16_t", 64, 7, 1), ("bf16_t", "float", 128, 8, 1), ("float", "float", 64, 8, 1),
    ("float", "float", 128, 8, 1), ("half_t", "half_t", 64, 7, 2), ("half_t", "half_t", 256, 8, 2),
    ("bf16_t", "float", 128, 6, 2), ("bf16_t", "bf16_t", 64, 8, 2), ("float", "float", 128, 8, 2),
]  # fmt: skip

_DECODE_DUMP = r"""
import json, sys
from onnx_genrt.providers.cuda.grouped_decode import DecodeShape
import onnx_genrt.providers.cuda.kernels._gqa_decode as gd
instances = json.loads(sys.argv[2])
names = [f"gqa_decode<{gd.decode_template_args(s, c, d, g, hg)}>" for s, c, d, g, hg in instances]
body = "".join(f"  auto k{i} = &{n}; (void)k{i};\n" for i, n in enumerate(names))
checks = ""
for s, _, d, _, _ in instances:  # the C++ tile layout is the mirror's
    py = DecodeShape(d, 4 if s == "float" else 2)
    for field, value in (("TK", py.tile_keys), ("KL", py.key_loads), ("LK", py.lanes_per_key),
                         ("FS", py.feature_lanes), ("KS", py.value_rows), ("VL", py.value_loads)):
        checks += f"static_assert(DecodeShape<{s}, {d}>::{field} == {value}, \"{field}\");\n"
open(sys.argv[1], "w").write(gd._SOURCE + "\n" + checks + "void instantiate() {\n" + body + "}\n")
print(json.dumps(names))
"""


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_decode_kernel_compiles_without_spills(tmp_path, arch):
    """The grouped decode source through nvcc (where it is installed), for instances of every
    storage type and head size and the largest groups: it compiles, its tile layout is the
    mirror's (static_asserts against DecodeShape), and ptxas keeps everything in registers."""
    import json
    import re
    import shutil
    import subprocess

    from tests.cuda_stub import run_with_cupy_stub

    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed")
    source = tmp_path / "decode.cu"
    names = run_with_cupy_stub(_DECODE_DUMP, str(source), json.dumps(_INSTANCES))
    done = subprocess.run(
        [nvcc, "-std=c++17", f"-arch={arch}", "-cubin", "-Xptxas", "-v", "-diag-suppress",
         "550", str(source), "-o", str(tmp_path / "decode.cubin")],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", done.stderr)
    assert len(spills) == len(names) == len(_INSTANCES)
    assert all(s == ("0", "0") for s in spills), done.stderr


def test_decode_shared_memory_fits_the_default_limit():
    """Every instance the kernel has, at up to FUSE_MAX_NEW new rows, takes at most the 48 KiB
    of dynamic shared memory a block gets without opting in (the launch does not opt in)."""
    from tests.cuda_stub import run_with_cupy_stub

    most = run_with_cupy_stub(
        r"""
import json
from onnx_genrt.providers.cuda.grouped_decode import MAX_GROUP, decode_problem
from onnx_genrt.providers.cuda.kernels._gqa_decode import decode_shared_bytes
from onnx_genrt.providers.cuda.kernels.contrib_attention import FUSE_MAX_NEW
sizes = [decode_shared_bytes(s, d, item, g, c, hg) for item in (2, 4)
         for d in (8, 16, 32, 64, 128, 256) for g in range(1, MAX_GROUP + 1)
         for s in (1, FUSE_MAX_NEW) for c in (False, True) for hg in (1, 2)
         if decode_problem(d, item, g) is None]
print(json.dumps([len(sizes), max(sizes)]))
"""
    )
    assert most[0] == 2 * (6 + 5) * MAX_GROUP * 2 * 2
    assert most[1] <= 48 << 10


def test_head_groups_spread_a_launch_of_few_blocks():
    """Two warp groups share the heads where the launch has fewer blocks than SMs (the 0.5B
    shape's one row: 8 splits x 2 KV heads on 132 SMs), one where it fills them (32 rows);
    forced values stay within the group and MAX_HEAD_GROUPS."""
    from onnx_genrt.providers.cuda.grouped_decode import (
        DECODE_HEAD_GROUPS,
        MAX_HEAD_GROUPS,
        SPREAD_GROUPS,
        head_groups,
    )

    assert head_groups(7, 16, 132) == SPREAD_GROUPS == 2
    assert head_groups(7, 8 * 2 * 32, 132) == 1
    assert head_groups(1, 16, 132) == 1  # one head: nothing to share
    assert head_groups(7, 16, 132, forced=1) == 1
    assert head_groups(7, 512, 132, forced=2) == 2
    assert head_groups(8, 16, 132, forced=8) == MAX_HEAD_GROUPS == 4
    assert head_groups(7, 512, 132, forced=4) == 4
    assert head_groups(3, 16, 132, forced=4) == 3  # never more than the group's heads
    assert head_groups(7, 16, 132, forced=DECODE_HEAD_GROUPS) == 2  # the default: the rule
