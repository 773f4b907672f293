"""GroupQueryAttention decode/verify steps replayed from a captured CPU graph.

The engine binds past_key/present_key (and the values) to one cache buffer and replays the
same graph every step while seqlens_k and total_sequence_length change inside the bound
buffers. The captured call is the kernel's prebuilt step (``KernelDef.bind``); every step's output and
the cache it leaves are compared with onnxruntime's GroupQueryAttention, fed a copy of the
cache as it was before the step. The prebuilt step is also checked against the kernel's
general path on the same inputs, feature by feature.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from onnx import ModelProto, TensorProto, helper, numpy_helper

from onnx_genrt.core.graph_slots import DeviceGraphSlot
from onnx_genrt.core.kernels import KernelContext, NodeInfo
from onnx_genrt.providers.cpu.kernels import contrib_attention as ca
from onnx_genrt.session import InferenceSession

ort = pytest.importorskip("onnxruntime")
ort.set_default_logger_severity(3)

MS = "com.microsoft"
PRIMARY = DeviceGraphSlot.PRIMARY
F32 = np.float32
HEADS, KV_HEADS, H, CAP, ROPE_LEN = 8, 2, 32, 48, 64


def _model(m: int, packed: bool, rope: bool, sink: bool, **attrs: Any) -> ModelProto:
    """One GroupQueryAttention node; cos/sin caches and the head sink are initializers."""
    rng = np.random.default_rng(1)
    width = (HEADS + 2 * KV_HEADS) * H if packed else HEADS * H
    names = ["query", "" if packed else "key", "" if packed else "value"]
    names += ["past_key", "past_value", "seqlens_k", "total_sequence_length"]
    inits = []
    if rope:
        theta = rng.random((ROPE_LEN, H // 4)) * 3  # rotary over half the head
        inits += [
            numpy_helper.from_array(np.cos(theta).astype(F32), "cos_cache"),
            numpy_helper.from_array(np.sin(theta).astype(F32), "sin_cache"),
        ]
    names += ["cos_cache" if rope else "", "sin_cache" if rope else ""]
    if sink:
        names += ["", "", "head_sink"]
        inits.append(numpy_helper.from_array(rng.standard_normal(HEADS).astype(F32), "head_sink"))
    node = helper.make_node(
        "GroupQueryAttention",
        names,
        ["output", "present_key", "present_value"],
        domain=MS,
        num_heads=HEADS,
        kv_num_heads=KV_HEADS,
        do_rotary=int(rope),
        **attrs,
    )
    cache = [1, KV_HEADS, CAP, H]
    inputs = [helper.make_tensor_value_info("query", TensorProto.FLOAT, [1, m, width])]
    if not packed:
        inputs += [
            helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, m, KV_HEADS * H])
            for n in ("key", "value")
        ]
    inputs += [
        helper.make_tensor_value_info("past_key", TensorProto.FLOAT, cache),
        helper.make_tensor_value_info("past_value", TensorProto.FLOAT, cache),
        helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
        helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, []),
    ]
    outputs = [
        helper.make_tensor_value_info("output", TensorProto.FLOAT, [1, m, HEADS * H]),
        helper.make_tensor_value_info("present_key", TensorProto.FLOAT, cache),
        helper.make_tensor_value_info("present_value", TensorProto.FLOAT, cache),
    ]
    graph = helper.make_graph([node], "gqa", inputs, outputs, inits)
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(MS, 1)]
    )
    model.ir_version = 10
    return model


class _Bound:
    """A session with the engine's binding: present_* bound to the past_* buffers."""

    def __init__(self, model: ModelProto, m: int, packed: bool):
        self.sess = InferenceSession(model, providers=["cpu"])
        b = self.binding = self.sess.io_binding()
        width = (HEADS + 2 * KV_HEADS) * H if packed else HEADS * H
        self.new = {"query": b.bind_input("query", np.zeros((1, m, width), F32))}
        if not packed:
            for n in ("key", "value"):
                self.new[n] = b.bind_input(n, np.zeros((1, m, KV_HEADS * H), F32))
        rng = np.random.default_rng(2)  # garbage past the valid prefix must stay unread
        self.keys = b.bind_input("past_key", rng.standard_normal((1, KV_HEADS, CAP, H), F32))
        self.values = b.bind_input("past_value", rng.standard_normal((1, KV_HEADS, CAP, H), F32))
        b.bind_output("present_key", self.keys)
        b.bind_output("present_value", self.values)
        self.seqlens = b.bind_input("seqlens_k", np.zeros(1, np.int32))
        self.total = b.bind_input("total_sequence_length", np.zeros((), np.int32))
        self.out = b.bind_output("output", shape=(1, m, HEADS * H), dtype=F32)

    def step(self, rng: np.random.Generator, seqlen: int, total: int) -> dict[str, np.ndarray]:
        """New q/k/v and lengths written into the bound buffers; returns the ORT feeds."""
        for buf in self.new.values():
            buf[...] = rng.standard_normal(buf.shape, F32)
        self.seqlens[...] = seqlen
        self.total[...] = total
        feeds = {n: b.copy() for n, b in self.new.items()}
        feeds |= {"past_key": self.keys.copy(), "past_value": self.values.copy()}
        feeds |= {"seqlens_k": self.seqlens.copy(), "total_sequence_length": self.total.copy()}
        return feeds

    def run(self) -> None:
        self.sess.run_with_iobinding(self.binding, PRIMARY)

    def bound_calls(self) -> int:
        return self.sess.main_provider.recorded_graph(PRIMARY).bound


def _check_step(
    bound: _Bound, feeds: dict[str, np.ndarray], want: list[np.ndarray], rows: int
) -> None:
    """Output rows and cache against onnxruntime; the cache past the new rows is untouched."""
    t = int(feeds["seqlens_k"][0]) + 1
    np.testing.assert_allclose(bound.out[:, :rows], want[0][:, :rows], rtol=1e-4, atol=1e-5)
    for got, ref, before in (
        (bound.keys, want[1], feeds["past_key"]),
        (bound.values, want[2], feeds["past_value"]),
    ):
        np.testing.assert_allclose(got[:, :, :t], ref[:, :, :t], rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(got[:, :, t:], before[:, :, t:])
        np.testing.assert_array_equal(got[:, :, : t - rows], before[:, :, : t - rows])


CASES = [
    pytest.param(1, True, {"rotary_interleaved": 0}, id="m1-packed-rope"),
    pytest.param(5, True, {"rotary_interleaved": 0}, id="m5-packed-rope"),
    pytest.param(5, False, {"rotary_interleaved": 1}, id="m5-separate-rope_inter"),
    pytest.param(1, False, None, id="m1-separate-norope"),
    pytest.param(5, True, {"local_window_size": 7, "softcap": 3.0}, id="m5-window-softcap"),
    pytest.param(1, True, {"smooth_softmax": 1, "scale": 0.3}, id="m1-smooth-scale"),
    pytest.param(5, True, {"sink": True, "local_window_size": 4}, id="m5-head_sink-window"),
]


@pytest.mark.parametrize("m,packed,extra", CASES)
def test_gqa_graph_replay_matches_onnxruntime(m: int, packed: bool, extra: dict | None) -> None:
    attrs = dict(extra or {})
    sink = attrs.pop("sink", False)
    model = _model(m, packed, extra is not None, sink, **attrs)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    bound = _Bound(model, m, packed)
    rng = np.random.default_rng(3)
    steps = 0
    for past in range(0 if m == 1 else 2, CAP - m + 1, 1 if m == 1 else 3):
        t = past + m
        total = CAP if steps % 3 else t  # the engine's mask length, or the exact length
        feeds = bound.step(rng, t - 1, total)
        bound.run()
        _check_step(bound, feeds, ref.run(None, feeds), m)
        steps += 1
    stats = bound.sess.graph_stats(PRIMARY)
    assert stats.captures == 1 and stats.fallbacks == 0 and stats.invalidations == 0
    assert stats.replays == steps - 2  # a planning run, the capture, then replays
    assert bound.bound_calls() == bound.sess.main_provider.recorded_calls(PRIMARY) == 1


def test_gqa_replay_falls_back_per_call_when_rows_are_padding() -> None:
    """Fewer valid tokens than rows (seqlens_k + 1 < M): the general path runs that call
    (its very results), counted; the other calls run the step (equal to float32 rounding)."""
    m = 5
    model = _model(m, True, True, False)
    bound = _Bound(model, m, True)
    rng = np.random.default_rng(4)
    reason = "lengths outside the prebuilt step"
    before = ca.general_path_steps().get(reason, 0)
    for seqlen in (10, 14, 2, 19, 0, 25):  # 2 and 0 leave padded rows
        feeds = bound.step(rng, seqlen, CAP)
        bound.run()
        args = [feeds[n].copy() for n in ("query",)] + [None, None]
        args += [feeds["past_key"].copy(), feeds["past_value"].copy()]
        args += [feeds["seqlens_k"], feeds["total_sequence_length"]]
        args += [numpy_helper.to_array(i) for i in model.graph.initializer]
        ctx = KernelContext(NodeInfo.from_proto(model.graph.node[0], 1))
        y, pk, pv = ca._gqa_general(ctx, *args)
        if seqlen + 1 < m:
            np.testing.assert_array_equal(bound.out, y)
        else:
            np.testing.assert_allclose(bound.out, y, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(bound.keys, pk)
        np.testing.assert_array_equal(bound.values, pv)
    assert ca.general_path_steps()[reason] - before == 2
    assert bound.bound_calls() == 1
    assert bound.sess.graph_stats(PRIMARY).fallbacks == 0


def test_gqa_replay_batch_two_rows_at_their_own_lengths() -> None:
    """Batch 2 (a batched decode step, each row at its own length) replays the prebuilt
    step: equal to onnxruntime and to the general kernel (to float32 rounding), the cache
    to the bit."""
    rng = np.random.default_rng(5)
    node = helper.make_node(
        "GroupQueryAttention",
        ["q", "k", "v", "pk", "pv", "seq", "tot"],
        ["y", "pk_out", "pv_out"],
        domain=MS,
        num_heads=4,
        kv_num_heads=2,
    )
    cache = [2, 2, 16, 8]
    f = TensorProto.FLOAT
    graph = helper.make_graph(
        [node],
        "gqa",
        [
            helper.make_tensor_value_info("q", f, [2, 1, 32]),
            helper.make_tensor_value_info("k", f, [2, 1, 16]),
            helper.make_tensor_value_info("v", f, [2, 1, 16]),
            helper.make_tensor_value_info("pk", f, cache),
            helper.make_tensor_value_info("pv", f, cache),
            helper.make_tensor_value_info("seq", TensorProto.INT32, [2]),
            helper.make_tensor_value_info("tot", TensorProto.INT32, []),
        ],
        [helper.make_tensor_value_info(n, f, None) for n in ("y", "pk_out", "pv_out")],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(MS, 1)]
    )
    model.ir_version = 10
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    sess = InferenceSession(model, providers=["cpu"])
    b = sess.io_binding()
    new = {
        n: b.bind_input(n, np.zeros((2, 1, w), F32)) for n, w in (("q", 32), ("k", 16), ("v", 16))
    }
    keys = b.bind_input("pk", np.zeros(cache, F32))
    values = b.bind_input("pv", np.zeros(cache, F32))
    b.bind_output("pk_out", keys)
    b.bind_output("pv_out", values)
    seq = b.bind_input("seq", np.zeros(2, np.int32))
    tot = b.bind_input("tot", np.zeros((), np.int32))
    y = b.bind_output("y", shape=(2, 1, 32), dtype=F32)
    for i in range(6):
        for buf in new.values():
            buf[...] = rng.standard_normal(buf.shape, F32)
        seq[...] = (i + 3, i)
        tot[...] = 16
        feeds = {**{n: x.copy() for n, x in new.items()}, "pk": keys.copy(), "pv": values.copy()}
        feeds |= {"seq": seq.copy(), "tot": tot.copy()}
        want = ref.run(None, feeds)
        ctx = KernelContext(NodeInfo.from_proto(node, 1))
        general = ca._gqa_general(ctx, *(feeds[n].copy() for n in ("q", "k", "v", "pk", "pv")),
                                  feeds["seq"], feeds["tot"])  # fmt: skip
        sess.run_with_iobinding(b, PRIMARY)
        np.testing.assert_allclose(y, want[0], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(y, general[0], rtol=1e-5, atol=1e-6)
        for j, t in enumerate(seq + 1):
            np.testing.assert_allclose(keys[j, :, :t], want[1][j, :, :t], rtol=1e-5, atol=1e-6)
            np.testing.assert_array_equal(values[j, :, :t], general[2][j, :, :t])
    assert sess.graph_stats(PRIMARY).replays == 4
    assert sess.main_provider.recorded_graph(PRIMARY).bound == 1


# ----------------------------------------------------------------------------- step vs general

FEATURES = [
    pytest.param({"do_rotary": 1}, id="rope"),
    pytest.param({"do_rotary": 1, "rotary_interleaved": 1}, id="rope_inter"),
    pytest.param({}, id="norope"),
    pytest.param({"do_rotary": 1, "local_window_size": 5}, id="window"),
    pytest.param({"do_rotary": 1, "softcap": 2.0, "scale": 0.5}, id="softcap"),
    pytest.param({"smooth_softmax": 1}, id="smooth"),
    pytest.param({"do_rotary": 1, "head_sink": True}, id="head_sink"),
    pytest.param({"causal": 0}, id="bidirectional"),
]


# (heads, KV heads, head size): query heads per KV head one at a time (3) or a block of four
# and one (5); head sizes below 32 and 32 plus a tail (the weighted values go 32 at a time).
SHAPES = [pytest.param((6, 2, 16), id="3x16"), pytest.param((10, 2, 40), id="5x40")]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "separate"])
@pytest.mark.parametrize("attrs", FEATURES)
def test_gqa_step_agrees_with_general_path(
    m: int, packed: bool, attrs: dict, shape: tuple[int, int, int]
) -> None:
    """The step sums in its own order (per query row and head), so its output agrees with
    the general path's to float32 rounding; the cache rows it writes are equal."""
    attrs = dict(attrs)
    rng = np.random.default_rng(6)
    (heads, kvn, h), cap = shape, 40
    use_sink = attrs.pop("head_sink", False)

    def rand(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(F32)

    q, k, v = rand(1, m, heads * h), rand(1, m, kvn * h), rand(1, m, kvn * h)
    theta = rng.random((cap + 4, h // 2)) * 3
    args: list[Any] = [np.concatenate([q, k, v], -1), None, None] if packed else [q, k, v]
    args += [rand(1, kvn, cap, h), rand(1, kvn, cap, h), None, np.array(cap, np.int32)]
    rope = attrs.get("do_rotary", 0)
    args += [np.cos(theta).astype(F32), np.sin(theta).astype(F32)] if rope else [None, None]
    args += [None, None, rand(heads) if use_sink else None]
    while args[-1] is None:
        args.pop()
    names = [f"i{i}" if a is not None else "" for i, a in enumerate(args)]
    names[5] = "seqlens_k"
    node = helper.make_node(
        "GroupQueryAttention",
        names,
        ["y", "pk", "pv"],
        domain=MS,
        num_heads=heads,
        kv_num_heads=kvn,
        **attrs,
    )
    info = NodeInfo.from_proto(node, 1)
    for t in (m, m + 1, 17, cap):
        args[5] = np.array([t - 1], np.int32)
        ref = [a.copy() if a is not None else None for a in args]
        want = ca._gqa_general(KernelContext(info), *ref)
        ours = [a.copy() if a is not None else None for a in args]
        step = ca._GqaStep.build(KernelContext(info), tuple(ours), None)
        assert isinstance(step, ca._GqaStep) and step.run()
        got = step.results
        assert got[1] is ours[3] and got[2] is ours[4]
        np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(got[1], want[1])
        np.testing.assert_array_equal(got[2], want[2])


def test_gqa_step_declines_what_it_does_not_handle() -> None:
    info = NodeInfo.from_proto(
        helper.make_node(
            "GroupQueryAttention",
            ["q", "k", "v", "pk", "pv", "s", "t"],
            ["y", "a", "b"],
            domain=MS,
            num_heads=2,
            kv_num_heads=1,
        ),
        1,
    )
    q, kv = np.zeros((1, 1, 16), F32), np.zeros((1, 1, 8), F32)
    cache = np.zeros((1, 1, 8, 8), F32)
    seq, tot = np.array([3], np.int32), np.array(8, np.int32)

    def build(*args: Any, present: Any = None) -> Any:
        return ca._GqaStep.build(KernelContext(info), args, None, present)

    assert isinstance(build(q, kv, kv, cache, cache.copy(), seq, tot), ca._GqaStep)
    not_a_step = "not a step: a past cache and at most 16 new tokens per row"
    assert build(q, kv, kv, None, None, seq, tot) == not_a_step  # no past: prompt / concat
    long_q, long_kv = np.zeros((1, 17, 16), F32), np.zeros((1, 17, 8), F32)
    assert build(long_q, long_kv, long_kv, cache, cache.copy(), seq, tot) == not_a_step
    half = build(q.astype(np.float16), kv, kv, cache, cache.copy(), seq, tot)
    assert half == "float16 query (the step is float32)"
    inputs = "position_ids, attention_bias or query_seqlens given"
    pos = np.zeros((1, 1), np.int64)
    assert build(q, kv, kv, cache, cache.copy(), seq, tot, None, None, pos) == inputs
    bias = np.zeros((1, 1, 1, 8), F32)
    assert build(q, kv, kv, cache, cache.copy(), seq, tot, None, None, None, bias) == inputs
    # present buffers other than the past ones (concat into new outputs)
    other = (np.zeros_like(cache), np.zeros_like(cache))
    moved = build(q, kv, kv, cache, cache.copy(), seq, tot, present=other)
    assert moved == "present_key/present_value are not the past buffers"
    frozen = cache.copy()
    frozen.flags.writeable = False
    read_only = build(q, kv, kv, frozen, cache.copy(), seq, tot)
    assert read_only == "past_key/past_value not writeable float32 arrays"
    # the step reads raw addresses: contiguous caches, int32 lengths
    strided = np.zeros((1, 1, 8, 16), F32)[..., ::2]
    assert (
        build(q, kv, kv, strided, cache.copy(), seq, tot) == "past_key/past_value not C-contiguous"
    )
    lengths = "seqlens_k / total_sequence_length not int32"
    assert build(q, kv, kv, cache, cache.copy(), seq.astype(np.int64), tot) == lengths
    step = build(q, kv, kv, cache, cache.copy(), np.array([8], np.int32), tot)
    assert isinstance(step, ca._GqaStep) and not step.run()  # past the cache: general path
