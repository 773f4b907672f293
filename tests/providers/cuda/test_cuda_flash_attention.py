"""CUDA GroupQueryAttention prompts on the flash-attention kernel (``kernels/_flash.py``,
from ``attention_flash_min_rows`` new rows, fp16 and bf16, head sizes 64 and 128) against the
CPU provider's kernel on the same inputs and cache: prompts of ragged lengths, chunked
prefill after a past, windows starting mid-tile, softcap, head sinks and smooth softmax,
several batch entries of their own lengths (one shorter than the call), GQA groups of 7 and
1, a window-sized cache; one captured graph replayed while the length grows in device
memory; the option and the refusals that keep the other kernels; a small session model.
Marked ``gpu``; the tiling itself is checked on the CPU (test_flash_tiling.py)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_genrt.core.graph_slots import DeviceGraphSlot
from onnx_genrt.core.kernels import MS_DOMAIN, NodeInfo
from tests.providers.cuda.test_cuda_gqa_window import _close, _cpu, _gpu, _rope

pytestmark = pytest.mark.gpu

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float16), BF16]


@pytest.fixture
def flash_calls(monkeypatch):
    """The new rows of every call that ran the flash kernel."""
    from onnx_genrt.providers.cuda.kernels import contrib_attention

    calls = []
    real = contrib_attention.flash_attend

    def spy(ctx, call, y):
        calls.append(call.new)
        return real(ctx, call, y)

    monkeypatch.setattr(contrib_attention, "flash_attend", spy)
    return calls


def _gqa_node(attrs: dict, sinks: bool = False) -> NodeInfo:
    """A GroupQueryAttention node on packed QKV with a cache, rotary caches and, with
    ``sinks``, head_sink (input 11)."""
    names = ["qkv", "", "", "pk", "pv", "seqlens", "total", "cos", "sin"]
    names += ["", "", "sink"] if sinks else []
    return NodeInfo("GroupQueryAttention", "gqa", MS_DOMAIN, 1, attrs, tuple(names),
                    ("y", "pk_out", "pv_out"))  # fmt: skip


class _Prompt:
    """One GQA node run on the GPU (device cache) and the CPU (host copy of that cache)."""

    def __init__(self, cp, prov, rng, dtype, *, b, h, kvh, d, cap, attrs, rot=None, sinks=None):
        self.cp, self.prov, self.rng, self.dtype = cp, prov, rng, np.dtype(dtype)
        self.b, self.h, self.kvh, self.d, self.cap = b, h, kvh, d, cap
        self.attrs = {"num_heads": h, "kv_num_heads": kvh, "do_rotary": 1, **attrs}
        keys = rng.standard_normal((b, kvh, cap, d)).astype(self.dtype)
        values = rng.standard_normal((b, kvh, cap, d)).astype(self.dtype)
        self.host = [keys, values]
        self.dev = [prov.as_array(keys.copy()), prov.as_array(values.copy())]
        self.cos, self.sin = _rope(4096, rot or d, self.dtype)
        self.dev_rope = [prov.as_array(self.cos), prov.as_array(self.sin)]
        self.sinks = None if sinks is None else sinks.astype(self.dtype)
        self.info = _gqa_node(self.attrs, sinks is not None)

    def poison(self, totals: list[int]) -> None:
        """NaN in each entry's cache rows from ``totals`` on, which no kernel may read."""
        for i, t in enumerate(totals):
            for host, dev in zip(self.host, self.dev, strict=True):
                host[i, :, t:] = np.nan
                with self.prov.stream:  # ordered with the kernels on the provider's stream
                    dev[i, :, t:] = np.nan

    def inputs(self, s: int, totals: list[int]) -> tuple[list, np.ndarray, np.ndarray]:
        """(CPU inputs, the step's qkv, its seqlens) for ``s`` new rows per entry."""
        qkv = self.rng.standard_normal((self.b, s, (self.h + 2 * self.kvh) * self.d))
        qkv = qkv.astype(self.dtype)
        seqlens = np.array(totals, np.int32) - 1
        host = [qkv, None, None, *self.host, seqlens, np.array(self.cap, np.int32)]
        host += [self.cos, self.sin]
        host += [] if self.sinks is None else [None, None, self.sinks]
        return host, qkv, seqlens

    def device_inputs(self, qkv, seqlens) -> list:
        dev = [qkv, None, None, *self.dev, seqlens, np.array(self.cap, np.int32)]
        dev += self.dev_rope
        dev += [] if self.sinks is None else [None, None, self.prov.as_array(self.sinks)]
        return dev

    def step(self, s: int, totals: list[int]) -> None:
        host, qkv, seqlens = self.inputs(s, totals)
        dev = self.device_inputs(self.prov.as_array(qkv), self.prov.as_array(seqlens))
        with self.prov.stream:
            y = self.cp.full((self.b, s, self.h * self.d), np.nan, self.dtype)
        got = _gpu(self.prov, self.info, dev, [y])
        assert got[0] is y and got[1] is self.dev[0] and got[2] is self.dev[1]
        self.check(y, host, s, totals)

    def check(self, y, host: list, s: int, totals: list[int]) -> None:
        """Output rows and the cache rows each entry holds, against the CPU kernel; the host
        cache then continues from the device's (its rounding), as a decoder would."""
        want = _cpu(self.info, host)
        got = self.prov.to_numpy(y)
        wcache = self.attrs.get("sliding_window_cache", 0)
        for i, t in enumerate(totals):
            rows = min(s, t) if wcache else s
            _close(got[i, :rows], want[0][i, :rows], self.dtype, f"output of entry {i}, total {t}")
            for j, name in ((0, "key"), (1, "value")):
                cache = self.prov.to_numpy(self.dev[j])
                _close(cache[i, :, :t], want[1 + j][i, :, :t], self.dtype, f"{name} cache {i}")
        self.host = [self.prov.to_numpy(buf).copy() for buf in self.dev]


# batch, heads, kv heads, head size, cache, attributes, steps (new rows, totals per entry)
CASES = {
    "prompt-150": (1, 14, 2, 64, 512, {}, [(150, [150])]),
    "chunked-after-a-past": (1, 14, 2, 64, 512, {}, [(100, [100]), (137, [237])]),
    "window-mid-tile-softcap-d128": (
        1, 8, 2, 128, 512, {"local_window_size": 50, "softcap": 30.0},
        [(200, [200]), (90, [290])],
    ),
    "batch-ragged-one-short": (
        3, 14, 2, 64, 400, {}, [(130, [130, 130, 100]), (70, [200, 200, 170])]
    ),
    "group1-d128": (2, 4, 4, 128, 300, {}, [(90, [90, 64]), (64, [154, 128])]),
    "not-causal": (1, 6, 2, 64, 256, {"causal": 0}, [(70, [70]), (65, [135])]),
    "interleaved-partial-rotary": (1, 14, 2, 64, 256, {"rotary_interleaved": 1}, [(99, [99])]),
    "smooth-softmax": (1, 14, 2, 64, 256, {"smooth_softmax": 1}, [(80, [80])]),
    "window-cache": (
        1, 8, 2, 64, 160, {"local_window_size": 40, "sliding_window_cache": 1},
        [(64, [64]), (96, [160])],
    ),
}  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_flash_prompt_matches_cpu(cp, prov, rng, flash_calls, case, dtype):
    b, h, kvh, d, cap, attrs, steps = CASES[case]
    rot = d - 16 if case == "interleaved-partial-rotary" else None
    pair = _Prompt(cp, prov, rng, dtype, b=b, h=h, kvh=kvh, d=d, cap=cap, attrs=attrs, rot=rot)
    pair.poison(steps[-1][1])
    for s, totals in steps:
        pair.step(s, totals)
    assert flash_calls == [s for s, _ in steps]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_flash_head_sinks_match_cpu(cp, prov, rng, flash_calls, dtype):
    sinks = rng.standard_normal(14) * 2
    pair = _Prompt(cp, prov, rng, dtype, b=2, h=14, kvh=2, d=64, cap=300, attrs={}, sinks=sinks)
    pair.poison([166, 150])
    pair.step(96, [96, 80])
    pair.step(70, [166, 150])
    assert flash_calls == [96, 70]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("d", [64, 128])
def test_flash_graph_follows_the_device_length(cp, fresh, rng, flash_calls, dtype, d):
    """One captured prompt chunk of 96 rows (append + flash), replayed while seqlens_k in
    device memory grows: chunked prefill after pasts that start, end and cross tiles, and a
    length past the cache, which writes NaN rows."""
    pair = _Prompt(cp, fresh, rng, dtype, b=1, h=14, kvh=2, d=d, cap=1024, attrs={})
    s = 96
    with fresh.stream:
        qkv = cp.zeros((1, s, (14 + 4) * d), dtype)
        seqlens = cp.zeros((1,), np.int32)
        y = cp.empty((1, s, 14 * d), dtype)
    dev = pair.device_inputs(qkv, seqlens)

    def write(total: int) -> list:
        host, q, lens = pair.inputs(s, [total])
        qkv.set(q, stream=fresh.stream)
        seqlens.set(lens, stream=fresh.stream)
        return host

    host = write(s)
    assert _gpu(fresh, pair.info, dev, [y])[0] is y
    pair.check(y, host, s, [s])
    fresh.begin_capture(DeviceGraphSlot.PRIMARY)
    _gpu(fresh, pair.info, dev, [y])
    fresh.end_capture(DeviceGraphSlot.PRIMARY)
    for total in (2 * s, 3 * s + 1, 448, 700, 1024):
        host = write(total)
        fresh.replay(DeviceGraphSlot.PRIMARY)
        pair.check(y, host, s, [total])
    write(1024 + 5)
    fresh.replay(DeviceGraphSlot.PRIMARY)
    assert np.isnan(fresh.to_numpy(y).astype(np.float32)).all()
    assert flash_calls == [s, s]  # the eager run and the capture


def test_the_option_and_the_refusals_keep_the_other_kernels(cp, rng, flash_calls):
    """Below ``attention_flash_min_rows`` (and with it 0), float32, a head size without an
    instance, and the fused calls of at most 16 new rows run the other kernels; at the
    option's value the flash kernel runs."""
    from onnx_genrt.providers.cuda.provider import CUDAProvider

    runs = [  # option, dtype, head size, new rows, flash?
        (64, np.float16, 64, 63, False),
        (64, np.float16, 64, 64, True),
        (0, np.float16, 64, 600, False),
        (17, np.float32, 64, 100, False),
        (17, np.float16, 32, 100, False),
        (17, BF16, 128, 17, True),
        (1, np.float16, 64, 16, False),
    ]
    for option, dtype, d, s, flash in runs:
        prov = CUDAProvider(attention_flash_min_rows=option)
        pair = _Prompt(cp, prov, rng, dtype, b=1, h=4, kvh=2, d=d, cap=700, attrs={})
        before = len(flash_calls)
        pair.step(s, [s])
        assert (len(flash_calls) > before) == flash, (option, dtype, d, s)


def _session_model(rng, s: int, dtype, h=14, kvh=2, d=64, cap=512):
    """x -> MatMul (packed QKV) -> GroupQueryAttention (cache, rotary) -> MatMul -> y."""
    t = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    hidden = h * d
    w_qkv = (rng.standard_normal((hidden, (h + 2 * kvh) * d)) / np.sqrt(hidden)).astype(dtype)
    w_out = (rng.standard_normal((hidden, hidden)) / np.sqrt(hidden)).astype(dtype)
    cos, sin = _rope(cap, d, np.dtype(dtype))
    attrs = {"num_heads": h, "kv_num_heads": kvh, "do_rotary": 1}
    nodes = [
        helper.make_node("MatMul", ["x", "w_qkv"], ["qkv"]),
        helper.make_node(
            "GroupQueryAttention",
            ["qkv", "", "", "pk", "pv", "seqlens", "total", "cos", "sin"],
            ["att", "pk_out", "pv_out"],
            domain=MS_DOMAIN,
            **attrs,
        ),
        helper.make_node("MatMul", ["att", "w_out"], ["y"]),
    ]
    cache = [1, kvh, cap, d]
    graph = helper.make_graph(
        nodes,
        "flash",
        [
            helper.make_tensor_value_info("x", t, [1, s, hidden]),
            helper.make_tensor_value_info("pk", t, cache),
            helper.make_tensor_value_info("pv", t, cache),
            helper.make_tensor_value_info("seqlens", TensorProto.INT32, [1]),
            helper.make_tensor_value_info("total", TensorProto.INT32, []),
        ],
        [helper.make_tensor_value_info("y", t, [1, s, hidden])],
        [
            numpy_helper.from_array(a, n)
            for a, n in ((w_qkv, "w_qkv"), (w_out, "w_out"), (cos, "cos"), (sin, "sin"))
        ],  # fmt: skip
    )
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid(MS_DOMAIN, 1)]
    return helper.make_model(graph, opset_imports=opsets), cache


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_session_model_prompt_matches_cpu(cp, rng, flash_calls, dtype):
    """A session's prompt (300 rows after 20 cached) through the provider's default options
    runs the flash kernel and matches the CPU provider's session on the same feeds."""
    from onnx_genrt.session import InferenceSession

    s, past = 300, 20
    model, cache = _session_model(rng, s, dtype)
    feeds = {
        "x": rng.standard_normal((1, s, 14 * 64)).astype(dtype),
        "pk": rng.standard_normal(cache).astype(dtype),
        "pv": rng.standard_normal(cache).astype(dtype),
        "seqlens": np.array([past + s - 1], np.int32),
        "total": np.array(past + s, np.int32),
    }
    (want,) = InferenceSession(model, providers=["cpu"]).run(["y"], dict(feeds))
    (got,) = InferenceSession(model, providers=["cuda"]).run(["y"], dict(feeds))
    assert flash_calls and set(flash_calls) == {s}
    _close(np.asarray(got), np.asarray(want), dtype, "session output")
