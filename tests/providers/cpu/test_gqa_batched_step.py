"""The CPU GroupQueryAttention step on a batch: B rows, each at its own length, in one
replayed call (``_gqa_step.attend_rows``), as a batched decode or verify step runs it.

For B in 1, 2, 5, 8 and every feature the step takes, each replayed step is compared with a
float64 numpy attention over each row's whole history (absolute positions, no cache layout)
and with onnxruntime's GroupQueryAttention fed a copy of the cache (where onnxruntime takes
the step: with a past, it refuses several rows of several new tokens); and each row with the
same node run on that row alone at batch 1, which must be equal to the bit. Steps split
over the worker pool equal serial ones to the bit too, a late worker included. The general
path must not run, and when it does (lengths outside the step, inputs the step refuses) it
is counted.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from typing import Any

import numba
import numpy as np
import pytest
from onnx import ModelProto, TensorProto, helper, numpy_helper

from onnx_genrt.core.graph_slots import DeviceGraphSlot
from onnx_genrt.core.kernels import KernelContext, NodeInfo
from onnx_genrt.core.op_rules import windowed_cache_length
from onnx_genrt.providers.cpu.kernels import _gqa_step as gs
from onnx_genrt.providers.cpu.kernels import _worker_pool as wp
from onnx_genrt.providers.cpu.kernels import contrib_attention as ca
from onnx_genrt.providers.cpu.kernels._intrinsics import (
    address_as_pointer,
    atomic_add,
    call_address,
    cpu_pause,
    load_acquire,
)
from onnx_genrt.session import InferenceSession

from .pool_helpers import worker_helps

ort = pytest.importorskip("onnxruntime")
ort.set_default_logger_severity(3)

MS = "com.microsoft"
PRIMARY = DeviceGraphSlot.PRIMARY
F32 = np.float32
HEADS, KV_HEADS, H, ROT_HALF, ROPE_LEN = 8, 2, 32, 8, 96  # rotary over half of each head
BATCHES = [1, 2, 5, 8]

FEATURES = [
    pytest.param({"do_rotary": 1}, id="rope"),
    pytest.param({"do_rotary": 1, "rotary_interleaved": 1, "packed": 1}, id="rope_inter-packed"),
    pytest.param({}, id="norope"),
    pytest.param({"do_rotary": 1, "local_window_size": 5, "softcap": 3.0}, id="window-softcap"),
    pytest.param({"smooth_softmax": 1, "scale": 0.3}, id="smooth-scale"),
    pytest.param({"do_rotary": 1, "head_sink": 1, "local_window_size": 4}, id="head_sink"),
    pytest.param({"causal": 0}, id="bidirectional"),
    pytest.param(
        {"do_rotary": 1, "local_window_size": 5, "sliding_window_cache": 1, "cap": 12},
        id="window_cache",
    ),
]


def _tables() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    theta = rng.random((ROPE_LEN, ROT_HALF)) * 3
    return {
        "cos_cache": np.cos(theta).astype(F32),
        "sin_cache": np.sin(theta).astype(F32),
        "head_sink": rng.standard_normal(HEADS).astype(F32),
    }


def _model(m: int, cap: int, attrs: dict[str, Any], dtype: Any = F32) -> ModelProto:
    """One GroupQueryAttention node with a symbolic batch; cos/sin and the head sink are
    initializers."""
    attrs = dict(attrs)
    packed, sink = attrs.pop("packed", 0), attrs.pop("head_sink", 0)
    rope = attrs.get("do_rotary", 0)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    names = ["query", "" if packed else "key", "" if packed else "value", "past_key"]
    names += ["past_value", "seqlens_k", "total_sequence_length"]
    names += ["cos_cache", "sin_cache"] if rope or sink else []
    names += ["", "", "head_sink"] if sink else []
    tables = _tables()
    inits = [numpy_helper.from_array(tables[n].astype(dtype), n) for n in names if n in tables]
    width = (HEADS + 2 * KV_HEADS) * H if packed else HEADS * H
    io = [helper.make_tensor_value_info("query", elem, ["B", m, width])]
    if not packed:
        io += [
            helper.make_tensor_value_info(n, elem, ["B", m, KV_HEADS * H]) for n in ("key", "value")
        ]
    cache = ["B", KV_HEADS, cap, H]
    io += [helper.make_tensor_value_info(n, elem, cache) for n in ("past_key", "past_value")]
    io += [
        helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["B"]),
        helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, []),
    ]
    outs = [
        helper.make_tensor_value_info("output", elem, ["B", m, HEADS * H]),
        helper.make_tensor_value_info("present_key", elem, cache),
        helper.make_tensor_value_info("present_value", elem, cache),
    ]
    node = helper.make_node(
        "GroupQueryAttention",
        names,
        ["output", "present_key", "present_value"],
        domain=MS,
        num_heads=HEADS,
        kv_num_heads=KV_HEADS,
        **attrs,
    )
    model = helper.make_model(
        helper.make_graph([node], "gqa", io, outs, inits),
        opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(MS, 1)],
    )
    model.ir_version = 10
    return model


class _Bound:
    """A session with the engine's binding: present_* bound to the past_* buffers, the new
    rows and lengths in bound inputs, so every run after the capture is a replay."""

    def __init__(self, model: ModelProto, b: int, m: int, cap: int, dtype: Any = F32) -> None:
        self.sess = InferenceSession(model, providers=["cpu"])
        bind = self.binding = self.sess.io_binding()
        self.new = {
            vi.name: bind.bind_input(vi.name, np.zeros((b, m, vi.type.tensor_type.shape.dim[2].dim_value), dtype))
            for vi in model.graph.input
            if vi.name in ("query", "key", "value")
        }  # fmt: skip
        self.keys = bind.bind_input("past_key", np.zeros((b, KV_HEADS, cap, H), dtype))
        self.values = bind.bind_input("past_value", np.zeros((b, KV_HEADS, cap, H), dtype))
        bind.bind_output("present_key", self.keys)
        bind.bind_output("present_value", self.values)
        self.seqlens = bind.bind_input("seqlens_k", np.zeros(b, np.int32))
        self.total = bind.bind_input("total_sequence_length", np.zeros((), np.int32))
        self.out = bind.bind_output("output", shape=(b, m, HEADS * H), dtype=dtype)

    def run(self) -> None:
        self.sess.run_with_iobinding(self.binding, PRIMARY)

    def feeds(self) -> dict[str, np.ndarray]:
        """Copies of everything bound, as onnxruntime's inputs."""
        feeds = {n: x.copy() for n, x in self.new.items()}
        feeds |= {"past_key": self.keys.copy(), "past_value": self.values.copy()}
        feeds |= {"seqlens_k": self.seqlens.copy(), "total_sequence_length": self.total.copy()}
        return feeds


# ----------------------------------------------------------------------------- reference


class _History:
    """Float64 reference: each row's rotated keys and values at their absolute positions."""

    def __init__(self, attrs: dict[str, Any]) -> None:
        self.attrs = attrs
        self.keys: list[np.ndarray] = []
        self.values: list[np.ndarray] = []
        tables = {n: x.astype(np.float64) for n, x in _tables().items()}
        self.cos, self.sin, self.sink = (
            tables["cos_cache"],
            tables["sin_cache"],
            tables["head_sink"],
        )

    def _rotate(self, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """Rotary of x (heads, S, H) at positions ``pos`` over the first 2*ROT_HALF features."""
        if not self.attrs.get("do_rotary"):
            return x
        c, s = self.cos[pos], self.sin[pos]
        r = 2 * ROT_HALF
        if self.attrs.get("rotary_interleaved"):
            x1, x2 = x[..., 0:r:2], x[..., 1:r:2]
            out = x.copy()
            out[..., 0:r:2], out[..., 1:r:2] = x1 * c - x2 * s, x1 * s + x2 * c
            return out
        x1, x2 = x[..., :ROT_HALF], x[..., ROT_HALF:r]
        return np.concatenate([x1 * c - x2 * s, x1 * s + x2 * c, x[..., r:]], -1)

    def step(self, b: int, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        """Output (M, N*H) of row ``b`` for its new q (M, N*H), k/v (M, kvN*H)."""
        a = self.attrs
        m = q.shape[0]
        past = self.keys[b].shape[1]
        pos = past + np.arange(m)
        q4 = self._rotate(q.astype(np.float64).reshape(m, HEADS, H).transpose(1, 0, 2), pos)
        k4 = self._rotate(k.astype(np.float64).reshape(m, KV_HEADS, H).transpose(1, 0, 2), pos)
        v4 = v.astype(np.float64).reshape(m, KV_HEADS, H).transpose(1, 0, 2)
        self.keys[b] = np.concatenate([self.keys[b], k4], 1)
        self.values[b] = np.concatenate([self.values[b], v4], 1)
        keys = np.repeat(self.keys[b], HEADS // KV_HEADS, 0)
        values = np.repeat(self.values[b], HEADS // KV_HEADS, 0)
        scores = q4 @ keys.transpose(0, 2, 1) * a.get("scale", 1 / math.sqrt(H))
        if a.get("softcap"):
            scores = a["softcap"] * np.tanh(scores / a["softcap"])
        j = np.arange(past + m)[None]
        seen = j <= pos[:, None] if a.get("causal", 1) else np.ones((m, past + m), bool)
        if a.get("local_window_size", -1) > 0:
            seen &= pos[:, None] - j < a["local_window_size"]
        scores = np.where(seen, scores, -np.inf)
        sink = None
        if a.get("head_sink"):
            sink = self.sink[:, None, None]
        elif a.get("smooth_softmax"):
            sink = np.zeros((HEADS, 1, 1))
        top = (
            scores.max(-1, keepdims=True)
            if sink is None
            else np.maximum(scores.max(-1, keepdims=True), sink)
        )
        probs = np.exp(scores - top)
        total = probs.sum(-1, keepdims=True) + (0 if sink is None else np.exp(sink - top))
        return (probs / total @ values).transpose(1, 0, 2).reshape(m, HEADS * H)


# ----------------------------------------------------------------------------- the steps


def _rows_alone(bound: _Bound, single: _Bound, before: dict[str, np.ndarray], total: int) -> None:
    """Each row of ``bound``'s last step equals ``single`` (batch 1) stepping that row from
    the same cache: output and cache, bit for bit."""
    for b in range(bound.out.shape[0]):
        for n, buf in single.new.items():
            buf[...] = before[n][b : b + 1]
        single.keys[...] = before["past_key"][b : b + 1]
        single.values[...] = before["past_value"][b : b + 1]
        single.seqlens[...] = before["seqlens_k"][b]
        single.total[...] = total
        single.run()
        np.testing.assert_array_equal(bound.out[b], single.out[0], err_msg=f"row {b}")
        np.testing.assert_array_equal(bound.keys[b], single.keys[0], err_msg=f"row {b}")
        np.testing.assert_array_equal(bound.values[b], single.values[0], err_msg=f"row {b}")


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("attrs", FEATURES)
@pytest.mark.parametrize("b", BATCHES)
def test_batched_step_rows_at_their_own_lengths(b: int, attrs: dict, m: int) -> None:
    attrs = dict(attrs)
    window_cache = attrs.get("sliding_window_cache", 0)
    cap = attrs.pop("cap", 40)
    model = _model(m, cap, attrs)
    bound, single = _Bound(model, b, m, cap), _Bound(model, 1, m, cap)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    history = _History(attrs)
    rng = np.random.default_rng(10 * b + m)
    steps = 5 if window_cache else 4  # a window-sized cache goes past its capacity
    # Every row starts with its own history (already rotated keys) in cache rows [0, L).
    most = cap if window_cache else cap - steps * m
    lengths = [(3 + 7 * i) % (most + 1) for i in range(b)]
    bound.keys[...] = rng.standard_normal(bound.keys.shape)  # rows past L: never read
    bound.values[...] = rng.standard_normal(bound.values.shape)
    for i, n in enumerate(lengths):
        history.keys.append(bound.keys[i, :, :n].astype(np.float64))
        history.values.append(bound.values[i, :, :n].astype(np.float64))
    general_before = ca.general_path_steps()
    for step in range(steps):
        for buf in bound.new.values():
            buf[...] = rng.standard_normal(buf.shape)
        totals = np.array(lengths) + m
        bound.seqlens[...] = totals - 1
        bound.total[...] = cap if step % 2 else totals.max()  # the engine's mask length, or exact
        before = bound.feeds()
        bound.run()
        want = ref.run(None, before) if m == 1 or b == 1 else None
        q, k, v = _split(before, m)
        for i, t in enumerate(totals):
            expect = history.step(i, q[i], k[i], v[i])
            np.testing.assert_allclose(bound.out[i], expect, rtol=1e-4, atol=1e-5)
            keep = (
                windowed_cache_length(int(t), cap, attrs["local_window_size"])
                if window_cache
                else t
            )
            np.testing.assert_allclose(
                bound.keys[i, :, :keep], history.keys[i][:, t - keep : t], rtol=1e-4, atol=1e-5
            )
            np.testing.assert_array_equal(
                bound.values[i, :, :keep], history.values[i][:, t - keep : t]
            )
            if want is not None:
                np.testing.assert_allclose(bound.out[i], want[0][i], rtol=1e-4, atol=1e-5)
                np.testing.assert_allclose(
                    bound.keys[i, :, :keep], want[1][i, :, :keep], rtol=1e-5, atol=1e-6
                )
                np.testing.assert_array_equal(bound.values[i, :, :keep], want[2][i, :, :keep])
            if not window_cache:  # the rows past the new ones are untouched
                np.testing.assert_array_equal(bound.keys[i, :, t:], before["past_key"][i, :, t:])
        _rows_alone(bound, single, before, int(bound.total))
        lengths = list(totals)
    ran_general = _delta(general_before)
    if window_cache and m > 1:  # rows whose full cache would drop keys a new query still sees
        assert set(ran_general) <= {OUTSIDE_ROW, OUTSIDE}, ran_general
    else:
        assert not ran_general  # the step ran every call
    stats = bound.sess.graph_stats(PRIMARY)
    assert stats.replays == steps - 2 and stats.fallbacks == 0  # planning, capture, replays
    assert bound.sess.main_provider.recorded_graph(PRIMARY).bound == 1


OUTSIDE = "lengths outside the prebuilt step"
OUTSIDE_ROW = "a row's lengths outside the prebuilt step"


def _delta(before: dict[str, int]) -> dict[str, int]:
    """General-path runs counted since ``before`` (ca.general_path_steps), by reason."""
    after = ca.general_path_steps()
    return {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}


def _split(feeds: dict[str, np.ndarray], m: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(B, M, N*H) queries and (B, M, kvN*H) keys and values from separate or packed feeds."""
    if "key" in feeds:
        return feeds["query"], feeds["key"], feeds["value"]
    qkv = feeds["query"]
    kv = KV_HEADS * H
    return qkv[..., : HEADS * H], qkv[..., HEADS * H : HEADS * H + kv], qkv[..., HEADS * H + kv :]


# ----------------------------------------------------------------------------- the general path


def test_a_row_outside_the_step_runs_alone_and_is_counted() -> None:
    """A verify step (M=3) whose row 1 holds fewer tokens than M: that row runs the general
    kernel alone, counted, and the others the step; every row equals the node run on it
    alone at batch 1, to the bit. With no row able to step, the whole call runs the general
    kernel, counted once."""
    m, cap, attrs = 3, 24, {"do_rotary": 1}
    model = _model(m, cap, attrs)
    bound, single = _Bound(model, 3, m, cap), _Bound(model, 1, m, cap)
    rng = np.random.default_rng(5)
    bound.keys[...] = rng.standard_normal(bound.keys.shape)
    bound.values[...] = rng.standard_normal(bound.values.shape)
    for lengths, counted in (
        ([9, 1, 14], {OUTSIDE_ROW: 1}),
        ([12, 4, 17], {}),
        ([15, 0, 20], {OUTSIDE_ROW: 1}),
        ([1, 0, 1], {OUTSIDE: 1}),
    ):
        for buf in bound.new.values():
            buf[...] = rng.standard_normal(buf.shape)
        bound.seqlens[...] = lengths
        bound.total[...] = cap
        before = bound.feeds()
        general_before = ca.general_path_steps()
        bound.run()
        assert _delta(general_before) == counted, lengths
        _rows_alone(bound, single, before, cap)
        info = NodeInfo.from_proto(model.graph.node[0], 1)
        tables = [numpy_helper.to_array(t) for t in model.graph.initializer]
        args = [before[n].copy() for n in ("query", "key", "value", "past_key", "past_value")]
        want = ca._gqa_general(
            KernelContext(info),
            *args,
            before["seqlens_k"],
            before["total_sequence_length"],
            *tables,
        )
        np.testing.assert_allclose(bound.out, want[0], rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(bound.keys, want[1])
    assert bound.sess.graph_stats(PRIMARY).fallbacks == 0
    # the replays ran the step's native form, whose Python side took the rows it left
    assert bound.sess.main_provider.recorded_graph(PRIMARY).native_calls == 1


def test_refused_batched_steps_run_the_general_path_counted() -> None:
    """float16 is not the step's: each call of a bound float16 decode step (B=2) runs the
    general kernel and is counted under the reason."""
    model = _model(1, 16, {"do_rotary": 1}, np.float16)
    bound = _Bound(model, 2, 1, 16, np.float16)
    general_before = ca.general_path_steps()
    for step in range(4):
        for buf in bound.new.values():
            buf[...] = 0.1 * step
        bound.seqlens[...] = (3 + step, 7 + step)
        bound.total[...] = 16
        bound.run()
    assert _delta(general_before) == {"float16 query (the step is float32)": 4}
    assert bound.sess.graph_stats(PRIMARY).replays == 2


# ----------------------------------------------------------------------------- the worker pool


def _step_case(attrs: dict[str, Any], b: int = 8, m: int = 4) -> tuple[ca._GqaStep, list]:
    """A prebuilt step of ``b`` rows of ``m`` new tokens at their own lengths (float32 inputs
    as the node gets them), and its caches before the step."""
    cap = ROPE_LEN
    model = _model(m, cap, attrs, F32)
    rng = np.random.default_rng(6)
    q = rng.standard_normal((b, m, HEADS * H)).astype(F32)
    k, v = (rng.standard_normal((b, m, KV_HEADS * H)).astype(F32) for _ in range(2))
    caches = [rng.standard_normal((b, KV_HEADS, cap, H)).astype(F32) for _ in range(2)]
    seqlens = (cap - 1 - np.arange(b) * 7).astype(np.int32)
    tables = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    node = model.graph.node[0]
    args = (q, k, v, *caches, seqlens, np.array(cap, np.int32))
    args += tuple(tables.get(name) for name in node.input[len(args) :])
    step = ca._GqaStep.build(KernelContext(NodeInfo.from_proto(node, 1)), args, None)
    assert isinstance(step, ca._GqaStep), step
    return step, [c.copy() for c in caches]


@pytest.fixture
def pool(two_threads) -> Iterator[wp.WorkerPool]:
    """``two_threads``, stopped afterwards: a step's chunks are short, so a worker slow to
    run misses jobs and the pool may end these tests napping (its worker asleep through the
    next jobs), which later tests of a running worker must not inherit."""
    yield two_threads
    wp.stop_pool()


POOL_FEATURES = [
    pytest.param({"do_rotary": 1, "softcap": 5.0}, id="rope-softcap"),
    pytest.param({"do_rotary": 1, "head_sink": 1, "local_window_size": 9}, id="sink-window"),
]


@pytest.mark.parametrize("attrs", POOL_FEATURES)
@pytest.mark.parametrize("chunks", [2, 3, 7, 64])
def test_pooled_step_equals_serial(pool, chunks: int, attrs: dict) -> None:
    """The groups (row, token, KV head) split into chunks that the caller and the pool's
    worker take; every group is the same code on either thread, so output and caches equal
    the serial step's (one chunk on the calling thread) to the bit, for any split. The calls
    repeat until the worker computed chunks of them (copied from its scratch region)."""
    step, caches = _step_case(attrs)

    def run(split: int) -> list[np.ndarray]:
        for cache, before in zip(step.caches, caches, strict=True):
            cache[...] = before
        step.y[...] = np.nan
        assert gs.attend_rows(step.plan, split) == 8
        return [x.copy() for x in step.results]

    serial = run(1)
    assert not np.isnan(serial[0]).any()

    def pooled() -> None:
        for got, want in zip(run(chunks), serial, strict=True):
            np.testing.assert_array_equal(got, want)

    worker_helps(pool, pooled)


def test_the_split_follows_the_threads_and_the_work(pool, monkeypatch) -> None:
    """At one thread, or below ``PARALLEL_MIN_WORK`` multiply-adds, a step runs on the
    calling thread (no pool job); above it, its groups go to the pool in chunks of about
    ``CHUNK_WORK`` multiply-adds, at least two per thread, at most one per group."""
    step, _ = _step_case({"do_rotary": 1})
    jobs = pool.stats()["jobs"]
    monkeypatch.setattr(gs, "PARALLEL_MIN_WORK", 1 << 40)
    assert step.run() and pool.stats()["jobs"] == jobs
    monkeypatch.setattr(gs, "PARALLEL_MIN_WORK", 0)
    assert step.run() and pool.stats()["jobs"] == jobs + 1
    wp.set_pool_threads(1)
    assert step.run() and pool.stats()["jobs"] == jobs + 1  # one thread: no pool
    used = 8 * 4 * 100  # score slots of the stepping groups
    d = step.plan.desc
    assert gs.step_chunks(d, used, 1, 0, 1) == 1
    assert gs.step_chunks(d, used, 2, 2 * used * H + 1, 1) == 1  # too little work
    assert gs.step_chunks(d, used, 2, 0, 1 << 40) == 4  # two per thread
    assert gs.step_chunks(d, used, 2, 0, 2 * used * H // 10) == 10
    assert gs.step_chunks(d, used, 2, 0, 1) == 8 * 4 * KV_HEADS  # one per group


# A runner wrapping the step's: on the worker (mode SCRATCH) it waits inside its chunk until
# the test releases it (a descheduled worker); the caller's chunk 0 waits for the worker to
# have taken a chunk. GATE: release, entered.
_GATE = np.zeros(2, np.int64)
_GATE_ADDRESS = _GATE.ctypes.data
_REAL_RUNNER = gs._step_runner()


def _held_runner(args, chunk, mode):
    gate = numba.carray(address_as_pointer(_GATE_ADDRESS, np.int64), (2,))
    if mode == wp.SCRATCH:
        atomic_add(gate, 1, 1)
        while not load_acquire(gate, 0):
            cpu_pause()
    elif mode == wp.OUT and chunk == 0:
        for _ in range(400_000_000):  # about seconds
            if load_acquire(gate, 1):
                break
            cpu_pause()
    return call_address(_REAL_RUNNER, args, chunk, mode)


def test_a_late_worker_costs_its_chunk_and_never_writes_the_step(pool) -> None:
    """The worker is held inside its chunk of the step (as if descheduled): the caller
    computes that chunk itself, with its own scratch, and returns the serial result; the
    step's arrays stay referenced until the worker leaves, and its late result goes to its
    scratch region, never to the output."""
    step, caches = _step_case({"do_rotary": 1, "softcap": 5.0})
    serial = gs.attend_rows(step.plan, 1) and [x.copy() for x in step.results]
    for cache, before in zip(step.caches, caches, strict=True):
        cache[...] = before
    step.y[...] = np.nan
    held = numba.cfunc(wp.RUNNER_SIGNATURE)(_held_runner).address
    _GATE[:] = 0
    plan = step.plan
    pool.reserve(plan.region_values)
    stepped, status = gs._step(plan.desc, plan.args, pool.ctrl, held, 2, 0, 1, 4)
    assert stepped == 8 and _GATE[1] == 1, "the worker never took a chunk"
    assert status & 3 == 1  # taken, not finished: computed by the caller
    for got, want in zip(step.results, serial, strict=True):
        np.testing.assert_array_equal(got, want)
    pool.settle(status, plan.keep, "test step")
    assert pool.pending() == 1
    step.y[...] = -1
    _GATE[0] = 1
    _wait_for(lambda: pool.pending() == 0)
    assert (step.y == -1).all()


def _wait_for(condition, timeout: float = 30.0) -> None:
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout, "timed out"
        time.sleep(0.001)
