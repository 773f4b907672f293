"""CUDA grouped decode attention (``kernels/_gqa_decode.py``, ``gqa_decode``) on a real GPU:
decode / verify GroupQueryAttention over long caches, against float64 attention written from
the op's rules (``test_grouped_decode._reference``, which also checks the kernel's numpy
mirror on the CPU), eagerly and replayed in one graph while the device length grows.

Every test is marked ``gpu``. The provider runs with ``attention_cluster_max_keys=1`` so that
short caches take the grouped kernel too; each test checks which kernel ran. Benchmark (not
collected): ``python -m tests.providers.cuda.test_cuda_gqa_decode --timings`` prints the
attention's device time per call for the 0.5B layout on a 32768-position cache (grouped
with its own and with fixed split counts, many-split, cluster); with ``$OUT`` set it also
writes ``$OUT/gqa_decode_timings.txt``.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from onnx_genrt.core.graph_slots import DeviceGraphSlot
from onnx_genrt.core.kernels import MS_DOMAIN
from onnx_genrt.providers.cuda.flash_tiling import Rotary
from onnx_genrt.providers.cuda.grouped_decode import MAX_DECODE_SPLITS, decode_problem
from tests.providers.cuda.test_cuda_llm_kernels import (
    BF16,
    FLOATS_BF16,
    _DecodeStep,
    _graph_us,
    close,
    dev,
    gqa_inputs,
    launch,
    node,
    run_gpu,
)
from tests.providers.cuda.test_grouped_decode import _reference, _rotate

pytestmark = pytest.mark.gpu

PRIMARY = DeviceGraphSlot.PRIMARY


@pytest.fixture
def launched(monkeypatch) -> list[str]:
    """The names of the attention kernels compiled (looked up) from here on."""
    from onnx_genrt.providers.cuda.kernels import _gqa_decode, contrib_attention

    names: list[str] = []
    for module in (_gqa_decode, contrib_attention):
        compile_kernel = module.function

        def recording(source, name, *args, compile_kernel=compile_kernel, **kwargs):
            names.append(name)
            return compile_kernel(source, name, *args, **kwargs)

        monkeypatch.setattr(module, "function", recording)
    return names


_PROVIDERS: dict[tuple, object] = {}


def _provider(**options):
    """A CUDA provider with ``options`` (``attention_cluster_max_keys=1``,
    ``attention_grouped_decode=True`` and ``attention_grouped_cluster=False`` unless given),
    one per option set for the module's eager tests."""
    from onnx_genrt.providers.cuda.provider import CUDAProvider

    options = {
        "attention_cluster_max_keys": 1,
        "attention_grouped_decode": True,
        "attention_grouped_cluster": False,
        **options,
    }
    key = tuple(sorted(options.items()))
    if key not in _PROVIDERS:
        _PROVIDERS[key] = CUDAProvider(**options)
    return _PROVIDERS[key]


def _attention(names: list[str]) -> set[str]:
    """The attention kernels among ``names``, without their template arguments."""
    return {n.split("<")[0] for n in names if n.startswith("gqa_")}


def _split_inputs(inputs, c):
    """gqa_inputs' arrays as [B, S, N, D] queries and [B, S, kvN, D] new keys and values."""
    q, k, v = inputs[:3]
    b, s, h, kvh, d = c["b"], c["s"], c["h"], c["kvh"], c["d"]
    if k is None:  # packed
        qkv = q.reshape(b, s, h + 2 * kvh, d)
        return qkv[:, :, :h], qkv[:, :, h : h + kvh], qkv[:, :, h + kvh :]
    return q.reshape(b, s, h, d), k.reshape(b, s, kvh, d), v.reshape(b, s, kvh, d)


def _table(inputs, c) -> Rotary:
    """The rotary tables the kernel reads (their stored values), empty without rotary."""
    if not c.get("rotary", True):
        return Rotary(np.zeros((1, 0)), np.zeros((1, 0)), False)
    cos, sin = inputs[7].astype(np.float64), inputs[8].astype(np.float64)
    return Rotary(cos, sin, bool(c.get("interleaved")))


def _want(inputs, c):
    """float64 output [B, S, H * D] from the op's rules (new rows rounded to the cache type)."""
    q, k_new, v_new = _split_inputs(inputs, c)
    pk, pv, seqlens, sink = inputs[3], inputs[4], inputs[5], inputs[11]
    d = c["d"]
    sinks = None
    if sink is not None:
        sinks = sink.astype(np.float64)
    elif c.get("smooth"):
        sinks = np.zeros(c["h"])
    y = _reference(
        q, k_new, v_new, pk, pv, seqlens,
        scale=c.get("scale") or 1.0 / math.sqrt(d), softcap=c.get("softcap", 0.0),
        window=c.get("window", 0), causal=c.get("causal", True), wcache=False, sinks=sinks,
        rotary=_table(inputs, c), storage=pk.dtype,
    )  # fmt: skip
    return y.reshape(c["b"], c["s"], c["h"] * d)


# gqa_inputs' cases: G = h / kvh of 1, 2, 7 and 8, head sizes 64, 128 and 256, S = 1, 5 and 16;
# lengths 1, a split boundary (128 keys at D = 64) and its next, the capacity.
CASES = {
    "g7-d64-decode-lengths": dict(
        b=4, s=1, h=14, kvh=2, d=64, cap=5000, totals=[1, 128, 129, 5000]
    ),
    "g7-d64-verify5": dict(b=2, s=5, h=14, kvh=2, d=64, cap=3000, totals=[5, 2900]),
    "g2-d128-verify5-separate-interleaved": dict(
        b=1, s=5, h=8, kvh=4, d=128, cap=2100, totals=[2100], packed=False, interleaved=True
    ),
    "g1-d64-norotary-softcap": dict(
        b=2, s=1, h=4, kvh=4, d=64, cap=1500, totals=[700, 1500], rotary=False, softcap=30.0
    ),
    "g7-verify5-window-sink": dict(
        b=1, s=5, h=14, kvh=2, d=64, cap=3000, totals=[2500], window=500, sink=True
    ),
    "g2-d128-smooth-partial-rotary-not-causal": dict(
        b=1, s=3, h=4, kvh=2, d=128, cap=900, totals=[850], smooth=True, rot=64, causal=False
    ),
    "g8-d128-verify16": dict(b=1, s=16, h=16, kvh=2, d=128, cap=2000, totals=[1800]),
    "g7-verify5-short-entry": dict(b=2, s=5, h=14, kvh=2, d=64, cap=600, totals=[3, 600]),
    "g4-d256": dict(b=1, s=1, h=4, kvh=1, d=256, cap=1100, totals=[1100], scale=0.05),
}


def _run(cp, prov, c, inputs, attrs):
    info = node("GroupQueryAttention", inputs, 3, attrs, opset=1, domain=MS_DOMAIN)
    b, s, h, d = c["b"], c["s"], c["h"], c["d"]
    return run_gpu(cp, prov, info, inputs, [((b, s, h * d), inputs[3].dtype), None, None])


def _sm90() -> bool:
    from onnx_genrt.providers.cuda.kernels.contrib_attention import _cc_major

    return _cc_major() >= 9


@pytest.mark.parametrize(
    "splits", [0, 1, 40, "cluster"], ids=["auto", "one-split", "two-levels", "cluster"]
)
@pytest.mark.parametrize("dtype", FLOATS_BF16)
@pytest.mark.parametrize("case", sorted(CASES))
def test_grouped_decode_matches_float64(cp, rng, launched, case, dtype, splits):
    """Output and cache (the new rows rotated at [past, total), all else untouched) against
    float64; the grouped kernel ran unless it has no instance for the call (fp32 at head size
    256). Splits: the kernel's own count, one (the block writes the output), 40 (groups of
    splits merged, then the groups), or the cluster launch (sm_90+: every cache counts as
    short, ``gqa_decode_cluster``; the cluster kernel where the grouped one has no instance)."""
    c = CASES[case]
    inputs, attrs = gqa_inputs(rng, c, dtype)
    if not c.get("causal", True):
        attrs["causal"] = 0
    if splits == "cluster":
        if not _sm90():
            pytest.skip("thread-block clusters need sm_90")
        prov = _provider(
            attention_cluster_max_keys=0,
            attention_grouped_cluster=True,
            attention_grouped_cluster_max_rows=0,  # the cluster launch at any row count
        )
        kernels = ("gqa_decode_cluster", "gqa_attn_cluster")
    else:
        prov = _provider(attention_decode_splits=splits)
        kernels = ("gqa_decode", "gqa_attn")
    got, d_in, res = _run(cp, prov, c, inputs if inputs[11] is not None else inputs[:9], attrs)
    assert res[1] is d_in[3] and res[2] is d_in[4], "present must be the past buffer itself"
    grouped = decode_problem(c["d"], np.dtype(dtype).itemsize, c["h"] // c["kvh"]) is None
    assert _attention(launched) == {kernels[0] if grouped else kernels[1]}, launched
    close(got[0], _want(inputs, c), dtype, what="output")
    _, k_new, v_new = _split_inputs(inputs, c)
    table = _table(inputs, c)
    for bi, t in enumerate(c["totals"]):
        new = min(t, c["s"])
        past = t - new
        keys = _rotate(k_new[bi].astype(np.float64), past + np.arange(c["s"]), table)[:new]
        close(got[1][bi, :, past:t], keys.transpose(1, 0, 2), dtype, what="new keys")
        np.testing.assert_array_equal(got[2][bi, :, past:t], v_new[bi, :new].transpose(1, 0, 2))
        for cache, host in ((got[1], inputs[3]), (got[2], inputs[4])):
            np.testing.assert_array_equal(cache[bi, :, :past], host[bi, :, :past])
            np.testing.assert_array_equal(cache[bi, :, t:], host[bi, :, t:])


def test_grouped_decode_is_deterministic_and_leaves_the_counters_zero(cp, rng, launched):
    """Two runs on the same inputs give the same bits (fixed-order merges at every level);
    every merge counter is back at zero after the launch."""
    from onnx_genrt.providers.cuda.kernels import reduce

    c = dict(b=2, s=5, h=14, kvh=2, d=64, cap=4500, totals=[4400, 4500])
    inputs, attrs = gqa_inputs(rng, c, np.float16)
    prov = _provider(attention_decode_splits=MAX_DECODE_SPLITS)
    first, _, _ = _run(
        cp, prov, c, [x.copy() if x is not None else None for x in inputs[:9]], attrs
    )
    again, _, _ = _run(
        cp, prov, c, [x.copy() if x is not None else None for x in inputs[:9]], attrs
    )
    assert _attention(launched) == {"gqa_decode"}
    np.testing.assert_array_equal(first[0].view(np.uint16), again[0].view(np.uint16))
    prov.synchronize()
    for held in reduce._COUNTERS.get(prov, []):
        assert int(cp.count_nonzero(held)) == 0


def test_grouped_decode_marks_a_device_length_past_the_cache(cp, rng, launched):
    """total_sequence_length on the device: a length past the cache gives that sequence's rows
    NaN and writes no key past the buffer; the other sequence is unaffected."""
    c = dict(b=2, s=5, h=14, kvh=2, d=64, cap=300, totals=[200, 302])
    inputs, attrs = gqa_inputs(rng, c, np.float16)
    info = node("GroupQueryAttention", inputs[:9], 3, attrs, opset=1, domain=MS_DOMAIN)
    prov = _provider()
    d_in = [dev(prov, x) for x in inputs[:9]]
    with prov.stream:  # a plain device copy: no host shadow of the total length
        d_in[6] = cp.asarray(inputs[6])
    out = prov.to_numpy(launch(prov, info, d_in)[0])
    assert _attention(launched) == {"gqa_decode"}
    assert np.isnan(out[1]).all()
    assert np.isfinite(out[0]).all()
    cache = prov.to_numpy(d_in[3])
    np.testing.assert_array_equal(cache[1, :, :297], inputs[3][1, :, :297])


@pytest.mark.parametrize(
    "options,h,kernel",
    [
        (dict(), 14, "gqa_decode"),
        (dict(attention_grouped_decode=False), 14, "gqa_attn"),
        (
            dict(attention_cluster_max_keys=0, attention_grouped_cluster=True),
            14,
            "gqa_decode_cluster",
        ),
        (dict(attention_cluster_max_keys=0), 14, "gqa_attn"),  # cluster (sm_90) or many-split
        (dict(), 18, "gqa_attn"),  # 9 query heads per KV head: no instance
    ],
    ids=["grouped", "option-off", "short-cache", "short-cache-per-head", "group-of-9"],
)
def test_grouped_decode_is_chosen_for_long_caches(cp, rng, launched, options, h, kernel):
    """A long cache takes the grouped kernel; a short one the cluster kernel per query head
    (many-split before sm_90), or with ``attention_grouped_cluster`` the grouped kernel's
    cluster launch (sm_90+)."""
    if kernel == "gqa_decode_cluster" and not _sm90():
        kernel = "gqa_attn"
    c = dict(b=1, s=1, h=h, kvh=2, d=64, cap=700, totals=[650])
    inputs, attrs = gqa_inputs(rng, c, np.float16)
    _run(cp, _provider(**options), c, inputs[:9], attrs)
    assert {k[: len(kernel)] for k in _attention(launched)} == {kernel}, launched


@pytest.mark.parametrize(
    "b,s,most,kernel",
    [
        (16, 1, 8, "gqa_decode"),
        (4, 5, 8, "gqa_decode"),
        (8, 1, 8, "gqa_attn"),
        (16, 1, 0, "gqa_attn"),
    ],
    ids=["16-rows", "4-rows-verify5", "8-rows", "16-rows-option-0"],
)
def test_many_rows_on_a_short_cache_take_the_grouped_kernel(cp, rng, launched, b, s, most, kernel):
    """A batch's decode (or verify) step of more query rows than attention_cluster_max_rows
    runs the grouped kernel on a short cache (the cluster kernel's 8 blocks per row and head
    cost more there), and matches float64; up to that many rows (or with the option 0) the
    cluster kernel (many-split before sm_90) keeps it."""
    totals = [int(t) for t in rng.integers(s, 257, b)]
    c = dict(b=b, s=s, h=14, kvh=2, d=64, cap=256, totals=totals)
    inputs, attrs = gqa_inputs(rng, c, np.float16)
    prov = _provider(attention_cluster_max_keys=4096, attention_cluster_max_rows=most)
    got, _, _ = _run(cp, prov, c, inputs[:9], attrs)
    assert {k[: len(kernel)] for k in _attention(launched)} == {kernel}, launched
    close(got[0], _want(inputs, c), np.float16, what="output")


@pytest.mark.parametrize("dtype", [np.float16, BF16])
@pytest.mark.parametrize(
    "b,s,cap", [(1, 1, 1024), (16, 1, 256), (4, 5, 1024)], ids=["1-row", "16-rows", "4-verify5"]
)
def test_the_cluster_launch_gives_the_bits_of_eight_splits(cp, rng, launched, b, s, cap, dtype):
    """``gqa_decode_cluster`` (8 splits merged through distributed shared memory) gives the
    output and cache bits of ``gqa_decode`` over 8 splits (merged through global memory): the
    same tiles, the same merge order. Lengths spread from one split to eight."""
    if not _sm90():
        pytest.skip("thread-block clusters need sm_90")
    totals = [int(t) for t in rng.integers(s, cap + 1, b)]
    totals[0] = cap
    c = dict(b=b, s=s, h=14, kvh=2, d=64, cap=cap, totals=totals)
    inputs, attrs = gqa_inputs(rng, c, dtype)
    runs = {}
    for name, options in (
        (
            "gqa_decode_cluster",
            dict(
                attention_cluster_max_keys=4096,
                attention_grouped_cluster=True,
                attention_grouped_cluster_max_rows=0,
            ),
        ),
        ("gqa_decode", dict(attention_decode_splits=8)),
    ):
        launched.clear()
        fresh = [x.copy() if x is not None else None for x in inputs[:9]]
        got, _, _ = _run(cp, _provider(**options), c, fresh, attrs)
        assert _attention(launched) == {name}, launched
        runs[name] = [np.asarray(g) for g in got]
    for a, b_ in zip(runs["gqa_decode_cluster"], runs["gqa_decode"], strict=True):
        np.testing.assert_array_equal(a.view(np.uint16), b_.view(np.uint16))
    close(runs["gqa_decode_cluster"][0], _want(inputs, c), dtype, what="output")


@pytest.mark.parametrize("dtype", [np.float16, BF16])
@pytest.mark.parametrize(
    "b,s,cap,splits",
    [(16, 1, 256, 2), (32, 1, 160, 2), (4, 5, 512, 4), (3, 1, 1024, 8), (2, 1, 2048, 8)],
    ids=["16-rows", "32-rows", "4-verify5", "3-rows-1024", "2-rows-2048"],
)
def test_many_rows_take_the_plain_launch_with_the_cluster_bits(
    cp, rng, launched, monkeypatch, b, s, cap, splits, dtype
):
    """Above ``attention_grouped_cluster_max_rows`` query rows, decode / verify on a short
    cache run ``gqa_decode`` over the fewest splits that cut the keys as the cluster's 8 do
    (``min_chunk`` = 128 keys here, so ceil(cap / 128) up to 8): the cluster launch's output
    and cache bits. Lengths spread over the cache."""
    if not _sm90():
        pytest.skip("thread-block clusters need sm_90")
    from onnx_genrt.providers.cuda.kernels import contrib_attention

    asked: list[int] = []
    attend = contrib_attention.decode_attend

    def recording(ctx, call, y, n, cluster=False):
        asked.append(n if not cluster else -n)
        return attend(ctx, call, y, n, cluster)

    monkeypatch.setattr(contrib_attention, "decode_attend", recording)
    totals = [int(t) for t in rng.integers(s, cap + 1, b)]
    totals[0] = cap
    c = dict(b=b, s=s, h=14, kvh=2, d=64, cap=cap, totals=totals)
    inputs, attrs = gqa_inputs(rng, c, dtype)
    runs = {}
    short = dict(attention_cluster_max_keys=4096, attention_grouped_cluster=True)
    for name, most in (("gqa_decode_cluster", 0), ("gqa_decode", b * s - 1)):
        launched.clear()
        asked.clear()
        fresh = [x.copy() if x is not None else None for x in inputs[:9]]
        options = dict(short, attention_grouped_cluster_max_rows=most)
        got, _, _ = _run(cp, _provider(**options), c, fresh, attrs)
        assert _attention(launched) == {name}, launched
        assert asked == [-8 if most == 0 else splits], asked
        runs[name] = [np.asarray(g) for g in got]
    for a, b_ in zip(runs["gqa_decode_cluster"], runs["gqa_decode"], strict=True):
        np.testing.assert_array_equal(a.view(np.uint16), b_.view(np.uint16))
    close(runs["gqa_decode"][0], _want(inputs, c), dtype, what="output")


@pytest.mark.parametrize("cluster", [True, False], ids=["cluster", "splits"])
@pytest.mark.parametrize("dtype", [np.float16, BF16, np.float32])
@pytest.mark.parametrize(
    "b,s,h,cap", [(1, 1, 14, 1024), (2, 5, 12, 512), (1, 1, 8, 300)], ids=["g7", "g6-verify5", "g4"]
)
def test_head_groups_give_the_bits_of_one(cp, rng, launched, b, s, h, cap, dtype, cluster):
    """``attention_decode_head_groups`` 2 and 4 (each group's heads shared by two or four
    sets of warps walking the same tiles; 2 is the default for a launch of fewer blocks than
    SMs) give the output and cache bits of 1, on the cluster launch and the split one; groups
    of 7 (one padding head at 2 and at 4), 6 (two at 4) and 4 query heads per KV head."""
    if cluster and not _sm90():
        pytest.skip("thread-block clusters need sm_90")
    totals = [int(t) for t in rng.integers(s, cap + 1, b)]
    totals[0] = cap
    c = dict(b=b, s=s, h=h, kvh=2, d=64, cap=cap, totals=totals)
    inputs, attrs = gqa_inputs(rng, c, dtype)
    on = dict(attention_cluster_max_keys=4096, attention_grouped_cluster=True)
    options = on if cluster else dict(attention_decode_splits=8)
    runs = {}
    for groups in (1, 2, 4):
        launched.clear()
        fresh = [x.copy() if x is not None else None for x in inputs[:9]]
        got, _, _ = _run(
            cp, _provider(**options, attention_decode_head_groups=groups), c, fresh, attrs
        )
        (name,) = [n for n in launched if n.startswith("gqa_decode")]
        assert name.split(", ")[-2] == str(groups), name  # the kernel's HG
        runs[groups] = [np.asarray(g) for g in got]
    bits = np.uint32 if dtype == np.float32 else np.uint16
    for groups in (2, 4):
        for one, more in zip(runs[1], runs[groups], strict=True):
            np.testing.assert_array_equal(one.view(bits), more.view(bits))
    close(runs[2][0], _want(inputs, c), dtype, what="output")


@pytest.mark.parametrize("dtype", [np.float16, BF16])
@pytest.mark.parametrize("s", [1, 5])
def test_grouped_decode_one_graph_follows_the_device_length(cp, rng, launched, s, dtype):
    """One captured graph on the 0.5B layout (14 query heads, 2 KV heads, 64 wide) with a
    32768-position cache, replayed while the mask (hence seqlens_k) grows in device memory:
    one split, then more, then groups of splits merged twice, up to the capacity."""
    prov = _provider(attention_cluster_max_keys=4096)  # the provider's default
    step = _DecodeStep(cp, prov, rng, s, dtype=dtype, cap=32768)
    q = step.write(s)
    step.run()  # eager: compiles, sizes the scratch and the counters
    step.check(q, s)
    assert _attention(launched) == {"gqa_decode"}, launched
    prov.begin_capture(PRIMARY)
    step.run()
    prov.end_capture(PRIMARY)
    lengths = (s + 1, 128, 129, 2048, 2177, 4096, 4097, 8192, 16384, 30000, 32767, 32768)
    for total in lengths:
        q = step.write(total)
        prov.replay(PRIMARY)
        step.check(q, total)
    prov.reset_graph(PRIMARY)


# ----------------------------------------------------------------------------- timings


def gqa_decode_timings(cp, rng) -> str:
    """Device time per GroupQueryAttention call (graph replay) of the 0.5B layout on a
    32768-position fp16 cache after 256 / 8192 / 30000 tokens, decode (S = 1) and verify
    (S = 5): the grouped kernel with its own split count and fixed ones, the many-split
    kernel and the 8-block cluster kernel (sm_90)."""
    from onnx_genrt.providers.cuda.provider import CUDAProvider

    prov = CUDAProvider()
    variants = [("grouped auto", {"attention_grouped_decode": True})]
    variants += [
        (f"grouped {n} splits", {"attention_grouped_decode": True, "attention_decode_splits": n})
        for n in (32, 66, 132, 264, 512)
    ]
    variants += [
        ("many-split", {"attention_grouped_decode": False}),
        ("cluster", {"attention_cluster_max_keys": 0}),
    ]
    lines = []
    for s in (1, 5):
        step = _DecodeStep(cp, prov, rng, s, cap=32768)
        info, ins, buf = step.steps[-1]
        for total in (256, 8192, 30000):
            step.write(total)
            step.run()  # the mask -> seqlens for this length
            kv_bytes = 2 * step.kvh * total * step.d * 2
            for label, options in variants:
                saved = prov._options
                prov._options = {**saved, **options}
                try:

                    def gqa(info=info, ins=ins, buf=buf):
                        launch(prov, info, ins, [buf])

                    us = _graph_us(cp, prov, gqa)
                finally:
                    prov._options = saved
                lines.append(
                    f"GQA fp16 S={s} H=14 KVH=2 D=64 cap 32768 length {total} {label}: "
                    f"{us:.1f} us ({kv_bytes / us / 1e3:.0f} GB/s of KV)"
                )
    return "\n".join(lines)


def _print_timings() -> None:
    import cupy

    text = gqa_decode_timings(cupy, np.random.default_rng(0))
    print(text)
    out_dir = os.environ.get("OUT")
    if out_dir:
        Path(out_dir, "gqa_decode_timings.txt").write_text(text + "\n")


if __name__ == "__main__" and "--timings" in sys.argv:
    _print_timings()
