"""CUDA GroupQueryAttention with sliding windows, softcap and the window-sized KV cache of
``sliding_window_cache=1``, against the CPU provider's kernel (itself checked against a
float64 reference and onnxruntime in tests/providers/cpu/test_gqa_window.py).

Every test is marked ``gpu``. Each step runs the CUDA kernel on the device cache and the CPU
kernel on a host copy of the same cache, and compares the output and the rows the cache
keeps (``core.op_rules.windowed_cache_length``).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from onnx_genrt.core.graph_slots import DeviceGraphSlot
from onnx_genrt.core.kernels import MS_DOMAIN, KernelContext, NodeInfo
from onnx_genrt.core.op_rules import windowed_cache_length

pytestmark = pytest.mark.gpu

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float32), np.dtype(np.float16), BF16]
TOL = {np.dtype(np.float32): 2e-5, np.dtype(np.float16): 2e-3, BF16: 2e-2}


def _node(n_inputs: int, attrs: dict) -> NodeInfo:
    names = tuple(f"in{i}" if i not in (1, 2) else "" for i in range(n_inputs))
    return NodeInfo("GroupQueryAttention", "gqa", MS_DOMAIN, 1, attrs, names, ("y", "pk", "pv"))


def _rope(max_pos: int, rot: int, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    inv = 1.0 / 10000.0 ** (np.arange(0, rot, 2) / rot)
    ang = np.arange(max_pos)[:, None] * inv[None, :]
    return np.cos(ang).astype(dtype), np.sin(ang).astype(dtype)


def _cpu(info: NodeInfo, inputs: list) -> list[np.ndarray]:
    from onnx_genrt.providers.cpu.kernels import REGISTRY

    kdef = REGISTRY.lookup(MS_DOMAIN, "GroupQueryAttention", 1)
    return list(kdef.fn(KernelContext(info, None, []), *inputs))


def _gpu(prov, info: NodeInfo, inputs: list, planned: list) -> list:
    kdef = prov.get_kernel(MS_DOMAIN, "GroupQueryAttention", 1)
    return list(prov.launch(kdef, KernelContext(info, prov, planned), inputs))


def _close(got, want, dtype, what: str) -> None:
    tol = TOL[np.dtype(dtype)]
    got64, want64 = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.isfinite(got64).all(), f"{what}: NaN/inf"
    np.testing.assert_allclose(got64, want64, rtol=tol, atol=tol, err_msg=what)


class _Pair:
    """The same window-cache GQA node on the GPU (device cache) and the CPU (host cache)."""

    def __init__(self, cp, prov, rng, dtype, *, cap, window, softcap, b=1, h=8, kvh=2, d=64):
        self.cp, self.prov, self.rng, self.dtype = cp, prov, rng, np.dtype(dtype)
        self.b, self.h, self.kvh, self.d, self.cap, self.window = b, h, kvh, d, cap, window
        self.attrs = {"num_heads": h, "kv_num_heads": kvh, "do_rotary": 1, "softcap": softcap}
        self.attrs |= {"local_window_size": window, "sliding_window_cache": 1}
        keys = rng.standard_normal((b, kvh, cap, d)).astype(self.dtype)
        values = rng.standard_normal((b, kvh, cap, d)).astype(self.dtype)
        self.host = [keys, values]
        self.dev = [prov.as_array(keys.copy()), prov.as_array(values.copy())]
        self.cos, self.sin = _rope(4096, d, self.dtype)
        self.dev_cos, self.dev_sin = prov.as_array(self.cos), prov.as_array(self.sin)

    def inputs(self, s: int, totals: list[int]) -> tuple[list, list]:
        qkv = self.rng.standard_normal((self.b, s, (self.h + 2 * self.kvh) * self.d))
        qkv = qkv.astype(self.dtype)
        seqlens = np.array(totals, np.int32) - 1
        total = np.array(max(totals), np.int32)
        host = [qkv, None, None, *self.host, seqlens, total, self.cos, self.sin]
        dev = [self.prov.as_array(qkv), None, None, *self.dev, self.prov.as_array(seqlens)]
        dev += [total, self.dev_cos, self.dev_sin]
        return host, dev

    def step(self, s: int, totals: list[int]) -> None:
        host, dev = self.inputs(s, totals)
        info = _node(9, self.attrs)
        y = self.cp.full((self.b, s, self.h * self.d), np.nan, self.dtype)
        got = _gpu(self.prov, info, dev, [y])
        assert got[0] is y and got[1] is self.dev[0] and got[2] is self.dev[1]
        want = _cpu(info, host)
        self.check(y, want, s, totals)

    def check(self, y, want, s: int, totals: list[int]) -> None:
        got_y = self.prov.to_numpy(y)
        for i, t in enumerate(totals):
            rows = min(s, t)
            _close(got_y[i, :rows], want[0][i, :rows], self.dtype, f"output, total {t}")
            keep = windowed_cache_length(t, self.cap, self.window)
            for j, name in ((0, "key"), (1, "value")):
                cache = self.prov.to_numpy(self.dev[j])
                _close(cache[i, :, :keep], want[1 + j][i, :, :keep], self.dtype, f"{name} {t}")
        # Both continue from the device's cache (its rounding), as a decoder would.
        self.host = [self.prov.to_numpy(buf).copy() for buf in self.dev]


CASES = [
    # cap, window, softcap, steps (new tokens per step)
    pytest.param(12, 5, 0.0, [6] + [1] * 20 + [3] * 5, id="window5-cap12"),
    pytest.param(12, 5, 30.0, [6] + [1] * 20 + [3] * 5 + [16] * 2, id="window5-cap12-softcap"),
    pytest.param(8, 8, 30.0, [8] + [1] * 12 + [4] * 3, id="window8-cap8"),
    pytest.param(64, 60, 30.0, [20] + [1] * 10 + [5] * 4, id="window-longer-than-sequence"),
    pytest.param(300, 100, 0.0, [40] + [1] * 5 + [16] * 15 + [1] * 5, id="window100-cap300"),
]


@pytest.mark.parametrize("cluster", [True, False], ids=["cluster", "counter"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("cap", "window", "softcap", "steps"), CASES)
def test_window_cache_steps_match_cpu(cp, prov, rng, monkeypatch, cap, window, softcap, steps,
                                      dtype, cluster):  # fmt: skip
    from onnx_genrt.providers.cuda.kernels import contrib_attention

    monkeypatch.setattr(contrib_attention, "CLUSTER", cluster)
    pair = _Pair(cp, prov, rng, dtype, cap=cap, window=window, softcap=softcap)
    total = 0
    for s in steps:
        total += s
        pair.step(s, [total])


def test_window_cache_batch_two_own_layouts(cp, prov, rng) -> None:
    """Two entries of different lengths: each keeps its own compaction phase."""
    pair = _Pair(cp, prov, rng, np.float16, cap=10, window=4, softcap=20.0, b=2)
    totals = [3, 1]
    pair.step(1, totals)
    for _ in range(30):
        totals = [t + 1 for t in totals]
        pair.step(1, totals)


def test_window_cache_replays_one_captured_graph(cp, fresh, rng) -> None:
    """A captured decode step replayed while seqlens_k grows in device memory, through many
    compactions of a 9-row cache (window 4): equal to the CPU kernel at every step."""
    pair = _Pair(cp, fresh, rng, np.float32, cap=9, window=4, softcap=30.0)
    qkv = cp.zeros((1, 1, (pair.h + 2 * pair.kvh) * pair.d), np.float32)
    seqlens = cp.zeros((1,), np.int32)
    y = cp.empty((1, 1, pair.h * pair.d), np.float32)
    info = _node(9, pair.attrs)
    dev = [qkv, None, None, *pair.dev, seqlens, np.array(4096, np.int32)]
    dev += [pair.dev_cos, pair.dev_sin]
    captured = False
    for total in range(1, 60):
        host, _ = pair.inputs(1, [total])
        with fresh.stream:
            qkv.set(host[0], stream=fresh.stream)
            seqlens.set(host[5], stream=fresh.stream)
        if total < 3:
            assert _gpu(fresh, info, dev, [y])[0] is y
        elif not captured:
            fresh.begin_capture(DeviceGraphSlot.PRIMARY)
            _gpu(fresh, info, dev, [y])
            fresh.end_capture(DeviceGraphSlot.PRIMARY)
            captured = True
            fresh.replay(DeviceGraphSlot.PRIMARY)
        else:
            fresh.replay(DeviceGraphSlot.PRIMARY)
        pair.check(y, _cpu(info, host), 1, [total])


def test_window_cache_refuses_a_long_overflowing_prompt(cp, prov, rng) -> None:
    """More than 16 new tokens past a full window-sized cache, total known on the host."""
    pair = _Pair(cp, prov, rng, np.float32, cap=24, window=8, softcap=0.0)
    _, dev = pair.inputs(20, [30])
    with pytest.raises(NotImplementedError, match="overflow the window-sized cache of 24 rows"):
        _gpu(prov, _node(9, pair.attrs), dev, [])


def test_window_cache_refuses_a_cache_smaller_than_the_window(cp, prov, rng) -> None:
    pair = _Pair(cp, prov, rng, np.float32, cap=6, window=4, softcap=0.0)
    pair.attrs["local_window_size"] = 7
    _, dev = pair.inputs(1, [3])
    with pytest.raises(ValueError, match="capacity 6 must be at least local_window_size 7"):
        _gpu(prov, _node(9, pair.attrs), dev, [])
