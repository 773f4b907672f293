"""GroupQueryAttention with a sliding window: ``local_window_size``, ``softcap`` and the
window-sized KV cache of ``sliding_window_cache=1`` (as onnxruntime-genai's builder emits them
for Gemma-2's local layers).

References: a float64 numpy attention over the whole history at absolute positions (which
knows nothing of the cache layout), and onnxruntime's CPU kernel for the cache layout (which
rows hold which positions after each step).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from onnx import TensorProto, helper

from onnx_genrt.core.graph_slots import DeviceGraphSlot
from onnx_genrt.core.kernels import KernelContext, NodeInfo
from onnx_genrt.core.op_rules import windowed_cache_length
from onnx_genrt.providers.cpu.kernels import contrib_attention as ca
from onnx_genrt.session import InferenceSession

ort = pytest.importorskip("onnxruntime")
ort.set_default_logger_severity(3)

MS = "com.microsoft"
F32, F16 = np.dtype(np.float32), np.dtype(np.float16)
HEADS, KV_HEADS, H, ROT_HALF, ROPE_LEN = 4, 2, 16, 8, 96


def _node(window: int, softcap: float, window_cache: int, rope: bool = True) -> NodeInfo:
    names = ["q", "k", "v", "pk", "pv", "seqlens_k", "total"]
    names += ["cos", "sin"] if rope else []
    attrs: dict[str, Any] = {"num_heads": HEADS, "kv_num_heads": KV_HEADS, "do_rotary": int(rope)}
    attrs |= {"local_window_size": window, "softcap": softcap}
    if window_cache:
        attrs["sliding_window_cache"] = 1
    node = helper.make_node("GroupQueryAttention", names, ["y", "pk", "pv"], domain=MS, **attrs)
    return NodeInfo.from_proto(node, 1)


def _rope_tables(seed: int) -> tuple[np.ndarray, np.ndarray]:
    theta = np.random.default_rng(seed).random((ROPE_LEN, ROT_HALF)) * 3
    return np.cos(theta).astype(F32), np.sin(theta).astype(F32)


class _History:
    """Float64 reference: every token's rotated key and value at its absolute position."""

    def __init__(self, b: int, cos: np.ndarray, sin: np.ndarray) -> None:
        self.keys = [np.zeros((KV_HEADS, 0, H)) for _ in range(b)]
        self.values = [np.zeros((KV_HEADS, 0, H)) for _ in range(b)]
        self.cos, self.sin = cos.astype(np.float64), sin.astype(np.float64)

    def _rotate(self, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """Rotary (half-split layout) of x (N, S, H) at positions ``pos``."""
        c, s = self.cos[pos], self.sin[pos]  # (S, ROT_HALF)
        x1, x2 = x[..., :ROT_HALF], x[..., ROT_HALF : 2 * ROT_HALF]
        return np.concatenate([x1 * c - x2 * s, x1 * s + x2 * c, x[..., 2 * ROT_HALF :]], -1)

    def step(
        self, i: int, q: np.ndarray, k: np.ndarray, v: np.ndarray, window: int, softcap: float
    ) -> np.ndarray:
        """Output (S, N*H) of entry ``i`` for new rows q (S, N*H), k/v (S, kvN*H)."""
        s = q.shape[0]
        past = self.keys[i].shape[1]
        pos = past + np.arange(s)
        q4 = self._rotate(q.astype(np.float64).reshape(s, HEADS, H).transpose(1, 0, 2), pos)
        k4 = self._rotate(k.astype(np.float64).reshape(s, KV_HEADS, H).transpose(1, 0, 2), pos)
        v4 = v.astype(np.float64).reshape(s, KV_HEADS, H).transpose(1, 0, 2)
        self.keys[i] = np.concatenate([self.keys[i], k4], 1)
        self.values[i] = np.concatenate([self.values[i], v4], 1)
        keys = np.repeat(self.keys[i], HEADS // KV_HEADS, 0)
        values = np.repeat(self.values[i], HEADS // KV_HEADS, 0)
        scores = q4 @ keys.transpose(0, 2, 1) / math.sqrt(H)
        if softcap:
            scores = softcap * np.tanh(scores / softcap)
        j = np.arange(past + s)[None]
        seen = (j <= pos[:, None]) & (pos[:, None] - j < window if window > 0 else True)
        scores = np.where(seen, scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        return (probs @ values).transpose(1, 0, 2).reshape(s, HEADS * H)


# ----------------------------------------------------------------------------- cache layout


def _layout_model(cap: int, window: int, s: int) -> bytes:
    """A window-cache GQA node whose past/new values carry markers (no rotary)."""
    f = TensorProto.FLOAT
    io = [
        helper.make_tensor_value_info("q", f, [1, s, HEADS * H]),
        helper.make_tensor_value_info("k", f, [1, s, KV_HEADS * H]),
        helper.make_tensor_value_info("v", f, [1, s, KV_HEADS * H]),
        helper.make_tensor_value_info("pk", f, [1, KV_HEADS, cap, H]),
        helper.make_tensor_value_info("pv", f, [1, KV_HEADS, cap, H]),
        helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
        helper.make_tensor_value_info("total", TensorProto.INT32, []),
    ]
    node = helper.make_node(
        "GroupQueryAttention",
        [v.name for v in io],
        ["y", "pk_out", "pv_out"],
        domain=MS,
        num_heads=HEADS,
        kv_num_heads=KV_HEADS,
        local_window_size=window,
        sliding_window_cache=1,
    )
    outs = [helper.make_tensor_value_info(n, f, None) for n in ("y", "pk_out", "pv_out")]
    model = helper.make_model(
        helper.make_graph([node], "layout", io, outs),
        opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(MS, 1)],
    )
    model.ir_version = 10
    return model.SerializeToString()


@pytest.mark.parametrize(("cap", "window"), [(6, 4), (4, 4), (9, 3), (7, 1)])
@pytest.mark.parametrize("s", [1, 3])
def test_windowed_cache_length_is_onnxruntime_layout(cap: int, window: int, s: int) -> None:
    """Row r of onnxruntime's present holds what windowed_cache_length says, for every total:
    the last L(total) of [past rows 0 .. L(past)-1, then the new tokens]."""
    sess = ort.InferenceSession(_layout_model(cap, window, s), providers=["CPUExecutionProvider"])
    for total in range(s, 3 * cap + 2):
        past = total - s
        resident = windowed_cache_length(past, cap, window)
        keep = windowed_cache_length(total, cap, window)
        marks = np.arange(cap, dtype=F32) + 1000  # past row r carries 1000 + r
        pv = np.broadcast_to(marks[None, None, :, None], (1, KV_HEADS, cap, H)).copy()
        new = np.broadcast_to((np.arange(s, dtype=F32) + 2000)[None, :, None], (1, s, KV_HEADS * H))
        feeds = {
            "q": np.zeros((1, s, HEADS * H), F32),
            "k": np.zeros((1, s, KV_HEADS * H), F32),
            "v": new.copy(),
            "pk": np.zeros_like(pv),
            "pv": pv,
            "seqlens_k": np.array([total - 1], np.int32),
            "total": np.array(total, np.int32),
        }
        got = sess.run(None, feeds)[2][0, 0, :keep, 0]
        sources = np.concatenate([marks[:resident], np.arange(s, dtype=F32) + 2000])
        np.testing.assert_array_equal(got, sources[-keep:], err_msg=f"total {total}")


def test_windowed_cache_length_refuses_a_cache_smaller_than_the_window() -> None:
    with pytest.raises(ValueError, match="capacity 3 must be at least local_window_size 4"):
        windowed_cache_length(5, 3, 4)


# ----------------------------------------------------------------------------- steps


def _schedule(prompt: int, decode: int, verify: int) -> list[int]:
    """New tokens per step: a prompt, single-token decode steps, then multi-token steps."""
    return [prompt] + [1] * decode + [3] * verify


CASES = [
    # window, softcap, capacity (None: full-length cache, sliding_window_cache=0)
    pytest.param(5, 0.0, 9, id="window5-cap9"),
    pytest.param(5, 4.0, 9, id="window5-cap9-softcap"),
    pytest.param(4, 4.0, 4, id="window4-cap4-softcap"),
    pytest.param(40, 4.0, 48, id="window-longer-than-sequence"),
    pytest.param(5, 4.0, None, id="window5-full-cache"),
    pytest.param(-1, 4.0, None, id="no-window-softcap"),
]


def _run_steps(
    window: int, softcap: float, cap: int | None, batch: int, dtype: np.dtype, schedule: list[int]
) -> None:
    """Drive our kernel through ``schedule`` on one cache; compare every step's output and
    the rows the cache keeps with the float64 history, and with onnxruntime fed a copy of the
    cache as it was before the step (where onnxruntime takes the step: with a past, it
    refuses batch 2 with several new tokens, and padded prompts)."""
    rng = np.random.default_rng(7)
    cos, sin = (x.astype(dtype) for x in _rope_tables(8))
    window_cache = cap is not None
    length = cap if window_cache else sum(schedule) + 1
    info = _node(window, softcap, int(window_cache))
    kernel = ca.REGISTRY.lookup(MS, "GroupQueryAttention", 1).fn
    shape = (batch, KV_HEADS, length, H)
    keys = rng.standard_normal(shape).astype(dtype)  # stale rows: never read
    values = rng.standard_normal(shape).astype(dtype)
    history = _History(batch, cos, sin)
    ort_sess = _ort_session(info, dtype)
    # Entry 1's prompt is two tokens shorter (right padding): it keeps its own cache layout.
    padding = [0, 2][:batch]
    done = [0] * batch
    tol = {F32: (2e-4, 2e-5), F16: (2e-2, 2e-3)}[dtype]
    for step, s in enumerate(schedule):
        valid = [s - pad if step == 0 else s for pad in padding]
        totals = np.array([d + n for d, n in zip(done, valid, strict=True)], np.int32)
        q = rng.standard_normal((batch, s, HEADS * H)).astype(dtype)
        k = rng.standard_normal((batch, s, KV_HEADS * H)).astype(dtype)
        v = rng.standard_normal((batch, s, KV_HEADS * H)).astype(dtype)
        args = (q, k, v, keys, values, totals - 1, np.array(totals.max(), np.int32), cos, sin)
        ort_feeds = {n: np.copy(a) for n, a in zip(info.input_names, args, strict=True)}
        with_ort = batch == 1 or (s == 1 and step > 0)
        want = ort_sess.run(None, ort_feeds) if with_ort else None
        y, pk, pv = kernel(KernelContext(info), *args)
        assert pk is keys and pv is values  # written in place, never reallocated
        for i in range(batch):
            n = valid[i]
            expect = history.step(i, q[i, :n], k[i, :n], v[i, :n], window, softcap)
            np.testing.assert_allclose(y[i, :n].astype(np.float64), expect, *tol)
            if want is not None:
                np.testing.assert_allclose(y[i, :n], want[0][i, :n], rtol=tol[0], atol=tol[1])
            t = int(totals[i])
            keep = windowed_cache_length(t, length, window) if window_cache else t
            if want is not None:
                for got, ref in ((keys, want[1]), (values, want[2])):
                    np.testing.assert_allclose(got[i, :, :keep], ref[i, :, :keep], *tol)
            rotated = history.keys[i][:, t - keep :]
            np.testing.assert_allclose(keys[i, :, :keep], rotated, rtol=tol[0] * 10, atol=tol[1])
            np.testing.assert_allclose(values[i, :, :keep], history.values[i][:, t - keep :], *tol)
            done[i] = t


def _ort_session(info: NodeInfo, dtype: np.dtype) -> Any:
    elem = helper.np_dtype_to_tensor_dtype(dtype)
    io = [helper.make_tensor_value_info(n, elem, None) for n in info.input_names[:5]]
    io += [
        helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, None),
        helper.make_tensor_value_info("total", TensorProto.INT32, None),
    ]
    io += [helper.make_tensor_value_info(n, elem, None) for n in ("cos", "sin")]
    attrs = dict(info.attrs)
    node = helper.make_node(
        "GroupQueryAttention", list(info.input_names), ["y", "pk_o", "pv_o"], domain=MS, **attrs
    )
    outs = [helper.make_tensor_value_info(n, elem, None) for n in ("y", "pk_o", "pv_o")]
    model = helper.make_model(
        helper.make_graph([node], "steps", io, outs),
        opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(MS, 1)],
    )
    model.ir_version = 10
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize(("window", "softcap", "cap"), CASES)
def test_window_steps_prebuilt_step(window: int, softcap: float, cap: int | None, monkeypatch):
    """Batch 1, float32: decode and 3-token steps run as the prebuilt _GqaStep (in place)."""
    general = []
    real = ca._gqa_general
    monkeypatch.setattr(ca, "_gqa_general", lambda *a: general.append(1) or real(*a))
    schedule = _schedule(6, 14, 4)
    _run_steps(window, softcap, cap, 1, F32, schedule)
    # Only a 3-token step that must drop rows its first query still sees (a window-sized cache
    # that is full) leaves the prebuilt step for the general path.
    if cap is None or cap >= sum(schedule):
        assert not general
    else:  # and a prompt longer than the cache
        assert len(general) <= schedule.count(3) + (schedule[0] > cap)


@pytest.mark.parametrize(("window", "softcap", "cap"), CASES)
@pytest.mark.parametrize("dtype", [F32, F16], ids=str)
def test_window_steps_batch_two(window, softcap, cap, dtype) -> None:
    """Batch 2 (each entry its own length and layout): float32 runs the prebuilt step (a
    row it cannot take runs the general path alone), float16 the general path."""
    _run_steps(window, softcap, cap, 2, dtype, _schedule(7, 12, 4))


def test_window_prompt_longer_than_the_cache() -> None:
    """A first prompt of 20 tokens into a 6-row cache (window 4): only its last rows stay."""
    _run_steps(4, 0.0, 6, 1, F32, _schedule(20, 5, 2))


# ----------------------------------------------------------------------------- graph replay


def _replay_model(m: int, cap: int, window: int, softcap: float) -> Any:
    f = TensorProto.FLOAT
    cache = [1, KV_HEADS, cap, H]
    io = [
        helper.make_tensor_value_info("q", f, [1, m, HEADS * H]),
        helper.make_tensor_value_info("k", f, [1, m, KV_HEADS * H]),
        helper.make_tensor_value_info("v", f, [1, m, KV_HEADS * H]),
        helper.make_tensor_value_info("pk", f, cache),
        helper.make_tensor_value_info("pv", f, cache),
        helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
        helper.make_tensor_value_info("total", TensorProto.INT32, []),
        helper.make_tensor_value_info("cos", f, [ROPE_LEN, ROT_HALF]),
        helper.make_tensor_value_info("sin", f, [ROPE_LEN, ROT_HALF]),
    ]
    node = helper.make_node(
        "GroupQueryAttention",
        [v.name for v in io],
        ["y", "pk_out", "pv_out"],
        domain=MS,
        num_heads=HEADS,
        kv_num_heads=KV_HEADS,
        do_rotary=1,
        local_window_size=window,
        softcap=softcap,
        sliding_window_cache=1,
    )
    outs = [
        helper.make_tensor_value_info("y", f, [1, m, HEADS * H]),
        helper.make_tensor_value_info("pk_out", f, cache),
        helper.make_tensor_value_info("pv_out", f, cache),
    ]
    model = helper.make_model(
        helper.make_graph([node], "replay", io, outs),
        opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(MS, 1)],
    )
    model.ir_version = 10
    return model


@pytest.mark.parametrize("m", [1, 3])
def test_window_cache_replays_one_graph(m: int) -> None:
    """The engine's binding (present bound to the past buffers, lengths in bound tensors):
    one capture, then replays, while the window-sized cache fills and is compacted in place;
    each step equals onnxruntime fed the cache as it was."""
    cap, window, softcap = 10, 4, 5.0
    model = _replay_model(m, cap, window, softcap)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    sess = InferenceSession(model, providers=["cpu"])
    b = sess.io_binding()
    rng = np.random.default_rng(9)
    new = {n: b.bind_input(n, np.zeros((1, m, w * H), F32)) for n, w in
           (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS))}  # fmt: skip
    keys = b.bind_input("pk", rng.standard_normal((1, KV_HEADS, cap, H)).astype(F32))
    values = b.bind_input("pv", rng.standard_normal((1, KV_HEADS, cap, H)).astype(F32))
    addresses = (keys.ctypes.data, values.ctypes.data)
    b.bind_output("pk_out", keys)
    b.bind_output("pv_out", values)
    seqlens = b.bind_input("seqlens_k", np.zeros(1, np.int32))
    total = b.bind_input("total", np.zeros((), np.int32))
    cos, sin = _rope_tables(10)
    b.bind_input("cos", cos)
    b.bind_input("sin", sin)
    y = b.bind_output("y", shape=(1, m, HEADS * H), dtype=F32)
    steps = 0
    for t in range(m, 60, m):
        for buf in new.values():
            buf[...] = rng.standard_normal(buf.shape).astype(F32)
        seqlens[...] = t - 1
        total[...] = t
        feeds = {n: x.copy() for n, x in new.items()}
        feeds |= {"pk": keys.copy(), "pv": values.copy(), "seqlens_k": seqlens.copy()}
        feeds |= {"total": total.copy(), "cos": cos, "sin": sin}
        want = ref.run(None, feeds)
        sess.run_with_iobinding(b, DeviceGraphSlot.PRIMARY)
        keep = windowed_cache_length(t, cap, window)
        np.testing.assert_allclose(y, want[0], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(keys[:, :, :keep], want[1][:, :, :keep], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(values[:, :, :keep], want[2][:, :, :keep], rtol=1e-5, atol=1e-6)
        steps += 1
    assert (keys.ctypes.data, values.ctypes.data) == addresses
    stats = sess.graph_stats(DeviceGraphSlot.PRIMARY)
    assert stats.captures == 1 and stats.fallbacks == 0 and stats.invalidations == 0
    assert stats.replays == steps - 2  # a planning run, the capture, then replays
    assert (
        sess.main_provider.recorded_graph(DeviceGraphSlot.PRIMARY).bound == 1
    )  # the prebuilt step


def test_window_cache_refuses_a_cache_smaller_than_the_window() -> None:
    info = _node(6, 0.0, 1)
    kernel = ca.REGISTRY.lookup(MS, "GroupQueryAttention", 1).fn
    cos, sin = _rope_tables(11)
    q = np.zeros((1, 1, HEADS * H), F32)
    kv = np.zeros((1, 1, KV_HEADS * H), F32)
    cache = np.zeros((1, KV_HEADS, 4, H), F32)
    args = (q, kv, kv, cache, cache.copy(), np.array([2], np.int32), np.array(3, np.int32))
    with pytest.raises(ValueError, match="capacity 4 must be at least local_window_size 6"):
        kernel(KernelContext(info), *args, cos, sin)
