"""CPU kernels' prebound replay calls (``KernelDef.bind``) against numpy references.

A recorded CPU graph calls a kernel's prebound closure instead of the kernel when the kernel
offers one (no attribute lookups, no allocation). Each case here is one node whose inputs are
bound buffers: the graph is recorded once, then replayed with new values written into the
same buffers, and every replay's output is compared with a float64 numpy reference. The
recorded graph must hold the node as a prebound call (else the generic path was tested).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from onnx import TensorProto, helper

from onnx_genrt.core.graph_slots import DeviceGraphSlot
from onnx_genrt.core.kernels import GENRT_DOMAIN
from onnx_genrt.session import InferenceSession

PRIMARY = DeviceGraphSlot.PRIMARY
F32, I64 = np.float32, np.int64
TYPES = {np.dtype(F32): TensorProto.FLOAT, np.dtype(I64): TensorProto.INT64}
TYPES |= {np.dtype(np.int32): TensorProto.INT32, np.dtype(np.float16): TensorProto.FLOAT16}


@dataclass
class Case:
    """One node: ``feeds(rng)`` makes new input values, ``reference(feeds)`` the outputs."""

    op: str
    inputs: dict[str, tuple[tuple[int, ...], Any]]  # name -> (shape, dtype)
    outputs: dict[str, tuple[tuple[int, ...], Any]]
    feeds: Callable[[np.random.Generator], dict[str, np.ndarray]]
    reference: Callable[[dict[str, np.ndarray]], list[np.ndarray]]
    attrs: dict[str, Any] = field(default_factory=dict)
    domain: str = ""
    exact: bool = False
    native: bool = False  # the bound call has a native form (``_native_calls``)

    def model(self):
        node = helper.make_node(
            self.op, list(self.inputs), list(self.outputs), domain=self.domain, **self.attrs
        )
        vi = helper.make_tensor_value_info
        graph = helper.make_graph(
            [node],
            self.op,
            [vi(n, TYPES[np.dtype(t)], list(s)) for n, (s, t) in self.inputs.items()],
            [vi(n, TYPES[np.dtype(t)], list(s)) for n, (s, t) in self.outputs.items()],
        )
        opsets = [helper.make_opsetid("", 21)]
        if self.domain:
            opsets.append(helper.make_opsetid(self.domain, 1))
        model = helper.make_model(graph, opset_imports=opsets)
        model.ir_version = 10
        return model


def _with_nan_and_inf(x):
    """Row 0 gets a NaN (numpy's rule, left to numpy), row 1 an infinity (the largest)."""
    x[0, 7] = np.nan
    x[1, 3] = np.inf
    return x


def _rms(f):
    x = f["x"].astype(np.float64)
    return [x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * f["scale"]]


def _argmax_prob(f):
    x = f["x"].astype(np.float64)
    return [x.argmax(-1), 1.0 / np.exp(x - x.max(-1, keepdims=True)).sum(-1)]


def _logits(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    x = (rng.standard_normal(shape) * 3).astype(F32)
    x[0, 5] = x[0, 9] = x[0].max() + 1  # a tie: the first index wins
    return x


#: The non-finite value of each NonFinite draw in turn, and where (None: all finite): a
#: head and a middle element (the native loop's 16 lanes) and the last (its tail).
_NONFINITE_DRAWS = itertools.cycle(
    [None, (0, np.nan), (150, np.inf), None, (299, -np.inf), (37, np.nan)]
)


def _nonfinite_feeds(rng: np.random.Generator) -> dict[str, np.ndarray]:
    x = (rng.standard_normal((3, 100)) * 50).astype(F32)
    draw = next(_NONFINITE_DRAWS)
    if draw is not None:
        x.reshape(-1)[draw[0]] = draw[1]
    return {"x": x}


def _mtp_accept_feeds(rng: np.random.Generator) -> dict[str, np.ndarray]:
    argmax = rng.integers(0, 50, (1, 4))
    ids = np.concatenate([[[7]], argmax[:, :3]], axis=1)
    miss = rng.integers(0, 4)  # the first draft that differs; 3: all three agree
    if miss < 3:
        ids[0, 1 + miss] = 99
    return {
        "ids": ids.astype(I64),
        "argmax": argmax.astype(I64),
        "hidden": rng.standard_normal((1, 4, 16)).astype(F32),
        "count": np.array([rng.integers(0, 5)], I64),
    }


def _mtp_accept(f):
    k, acc = 3, 0
    while acc < min(k, int(f["count"][0])) and f["argmax"][0, acc] == f["ids"][0, acc + 1]:
        acc += 1
    return [np.array([acc]), f["argmax"][:, acc : acc + 1], f["hidden"][:, acc : acc + 1]]


def _to_float16(f):
    with np.errstate(over="ignore"):  # beyond 65504: inf, as ONNX's Cast without saturation
        return [f["x"].astype(np.float64).astype(np.float16)]


def _silu_halves(f):
    x = f["x"].astype(np.float64)
    g, u = x[..., :24], x[..., 24:]
    return [g / (1 + np.exp(-g)) * u]


CASES = [
    Case(
        "SimplifiedLayerNormalization",
        {"x": ((4, 3, 64), F32), "scale": ((64,), F32)},
        {"y": ((4, 3, 64), F32)},
        lambda r: {
            "x": r.standard_normal((4, 3, 64)).astype(F32),
            "scale": r.random(64).astype(F32),
        },
        _rms,
        {"axis": -1, "epsilon": 1e-5},
        native=True,
    ),
    Case(
        "ArgMaxProb",
        {"x": ((3, 4096), F32)},
        {"idx": ((3,), I64), "prob": ((3,), F32)},
        lambda r: {"x": _logits(r, (3, 4096))},
        _argmax_prob,
        domain=GENRT_DOMAIN,
        native=True,
    ),
    Case(
        "ArgMaxProb",
        {"x": ((2, 1, 37), F32)},  # a row length that is not a multiple of 16
        {"idx": ((2, 1), I64), "prob": ((2, 1), F32)},
        lambda r: {"x": (r.standard_normal((2, 1, 37)) * 8).astype(F32)},
        _argmax_prob,
        domain=GENRT_DOMAIN,
        native=True,
    ),
    Case(
        "NonFinite",
        {"x": ((3, 100), F32)},
        {"y": ((), F32)},
        _nonfinite_feeds,
        lambda f: [np.float32(0) if np.isfinite(f["x"]).all() else np.float32(np.nan)],
        domain=GENRT_DOMAIN,
        exact=True,
        native=True,
    ),
    Case(
        "MTPAccept",
        {"ids": ((1, 4), I64), "argmax": ((1, 4), I64), "hidden": ((1, 4, 16), F32)}
        | {"count": ((1,), I64)},
        {"accepted": ((1,), I64), "token": ((1, 1), I64), "row": ((1, 1, 16), F32)},
        _mtp_accept_feeds,
        _mtp_accept,
        {"to": TensorProto.FLOAT},
        domain=GENRT_DOMAIN,
        exact=True,
        native=True,
    ),
    Case(
        "SiluMul",
        {"x": ((4, 48), F32)},
        {"y": ((4, 24), F32)},
        lambda r: {"x": (r.standard_normal((4, 48)) * 4).astype(F32)},
        _silu_halves,
        {"split": 1},
        domain=GENRT_DOMAIN,
        native=True,
    ),
    Case(
        "ArgMax",
        {"x": ((3, 5, 7), F32)},
        {"y": ((3, 1, 7), I64)},
        lambda r: {"x": r.standard_normal((3, 5, 7)).astype(F32)},
        lambda f: [f["x"].argmax(1)[:, None]],
        {"axis": 1, "keepdims": 1},
        exact=True,
    ),
    Case(
        "ArgMin",
        {"x": ((3, 5), F32)},
        {"y": ((3,), I64)},
        lambda r: {"x": r.standard_normal((3, 5)).astype(F32)},
        lambda f: [f["x"].argmin(-1)],
        {"axis": -1, "keepdims": 0},
        exact=True,
    ),
    Case(
        "ReduceSum",
        {"x": ((1, 37), I64), "axes": ((1,), I64)},
        {"y": ((1, 1), I64)},
        lambda r: {"x": r.integers(0, 2, (1, 37)), "axes": np.array([1])},
        lambda f: [f["x"].sum(1, keepdims=True)],
        exact=True,
        native=True,
    ),
    Case(
        "ReduceSum",
        {"x": ((2, 3, 9), F32), "axes": ((2,), I64)},
        {"y": ((3,), F32)},
        lambda r: {"x": r.standard_normal((2, 3, 9)).astype(F32), "axes": np.array([0, -1])},
        lambda f: [f["x"].astype(np.float64).sum((0, 2))],
        {"keepdims": 0},
    ),
    Case(
        "Gather",
        {"table": ((50, 8), F32), "ids": ((1, 3), I64)},
        {"y": ((1, 3, 8), F32)},
        lambda r: {
            "table": r.standard_normal((50, 8)).astype(F32),
            "ids": r.integers(-50, 50, (1, 3)),
        },
        lambda f: [f["table"][f["ids"]]],
        exact=True,
        native=True,
    ),
    Case(
        "Gather",
        {"x": ((4, 6), I64), "i": ((), I64)},
        {"y": ((4,), I64)},
        lambda r: {"x": r.integers(0, 100, (4, 6)), "i": np.array(r.integers(-6, 6))},
        lambda f: [f["x"][:, int(f["i"])]],
        {"axis": 1},
        exact=True,
    ),
    Case(
        "ArgMax",
        {"x": ((4, 37), F32)},
        {"y": ((4,), I64)},
        lambda r: {"x": r.integers(0, 6, (4, 37)).astype(F32)},  # ties: the first index wins
        lambda f: [f["x"].argmax(-1)],
        {"axis": -1, "keepdims": 0},
        exact=True,
        native=True,
    ),
    Case(
        "ArgMax",
        {"x": ((3, 20), F32)},
        {"y": ((3, 1), I64)},
        lambda r: {"x": _with_nan_and_inf(r.standard_normal((3, 20)).astype(F32))},
        lambda f: [f["x"].argmax(-1)[:, None]],
        {"axis": -1, "keepdims": 1},
        exact=True,
        native=True,
    ),
    Case(
        "Sub",
        {"a": ((3, 40), F32), "b": ((3, 40), F32)},
        {"y": ((3, 40), F32)},
        lambda r: {
            "a": r.standard_normal((3, 40)).astype(F32),
            "b": r.standard_normal((3, 40)).astype(F32),
        },
        lambda f: [f["a"] - f["b"]],
        exact=True,
        native=True,
    ),
    Case(
        "Sub",
        {"a": ((2, 5), I64), "b": ((1,), I64)},
        {"y": ((2, 5), I64)},
        lambda r: {"a": r.integers(-100, 100, (2, 5)), "b": r.integers(-9, 9, (1,))},
        lambda f: [f["a"] - f["b"]],
        exact=True,
        native=True,
    ),
    Case(
        "Mul",
        {"a": ((1,), F32), "b": ((6,), F32)},
        {"y": ((6,), F32)},
        lambda r: {"a": r.standard_normal(1).astype(F32), "b": r.standard_normal(6).astype(F32)},
        lambda f: [f["a"] * f["b"]],
        exact=True,
        native=True,
    ),
    Case(
        "Gather",
        {"shape": ((3,), I64), "i": ((), I64)},
        {"y": ((), I64)},
        lambda r: {"shape": r.integers(1, 9, 3), "i": np.array(r.integers(-3, 3))},
        lambda f: [f["shape"][int(f["i"])]],
        exact=True,
        native=True,
    ),
    Case(
        "Concat",
        {"a": ((2, 3), F32), "b": ((2, 1), F32), "c": ((2, 4), F32)},
        {"y": ((2, 8), F32)},
        lambda r: {
            n: r.standard_normal((2, w)).astype(F32) for n, w in zip("abc", (3, 1, 4), strict=True)
        },
        lambda f: [np.concatenate([f["a"], f["b"], f["c"]], axis=-1)],
        {"axis": -1},
        exact=True,
        native=True,
    ),
    Case(
        "Concat",
        {"a": ((2, 1, 3), I64), "b": ((2, 2, 3), I64)},
        {"y": ((2, 3, 3), I64)},
        lambda r: {"a": r.integers(-9, 9, (2, 1, 3)), "b": r.integers(-9, 9, (2, 2, 3))},
        lambda f: [np.concatenate([f["a"], f["b"]], axis=1)],
        {"axis": 1},
        exact=True,
        native=True,
    ),
    Case(
        "Concat",
        {"a": ((1, 4), F32), "b": ((2, 4), F32)},
        {"y": ((3, 4), F32)},
        lambda r: {"a": r.standard_normal((1, 4)).astype(F32), "b": r.random((2, 4)).astype(F32)},
        lambda f: [np.concatenate([f["a"], f["b"]], axis=0)],
        {"axis": 0},
        exact=True,
        native=True,
    ),
    Case(
        "Cast",
        {"x": ((5,), I64)},
        {"y": ((5,), np.int32)},
        lambda r: {"x": r.integers(-1000, 1000, 5)},
        lambda f: [f["x"].astype(np.int32)],
        {"to": TensorProto.INT32},
        exact=True,
        native=True,
    ),
    Case(  # one kind on both sides: the native copy moves the bytes as they are
        "Cast",
        {"x": ((7,), I64)},
        {"y": ((7,), I64)},
        lambda r: {"x": r.integers(-(2**40), 2**40, 7)},
        lambda f: [f["x"]],
        {"to": TensorProto.INT64},
        exact=True,
        native=True,
    ),
    Case(
        "Cast",
        {"x": ((5,), np.int32)},
        {"y": ((5,), np.int32)},
        lambda r: {"x": r.integers(-1000, 1000, 5).astype(np.int32)},
        lambda f: [f["x"]],
        {"to": TensorProto.INT32},
        exact=True,
        native=True,
    ),
    Case(
        "Cast",
        {"x": ((6,), F32)},
        {"y": ((6,), np.float16)},
        lambda r: {"x": (r.standard_normal(6) * 1e5).astype(F32)},  # some overflow to inf
        _to_float16,
        {"to": TensorProto.FLOAT16},
        exact=True,
    ),
    Case(
        "Shape",
        {"x": ((2, 3, 5), F32)},
        {"y": ((2,), I64)},
        lambda r: {"x": r.standard_normal((2, 3, 5)).astype(F32)},
        lambda f: [np.array(f["x"].shape[1:])],
        {"start": 1},
        exact=True,
        native=True,
    ),
]


def _ids(case: Case) -> str:
    return f"{case.op}-" + "x".join(str(d) for d in next(iter(case.inputs.values()))[0])


class _Bound:
    """The case's node in a CPU session, every input and output bound to a buffer."""

    def __init__(self, case: Case) -> None:
        self.sess = InferenceSession(case.model(), providers=["cpu"])
        self.binding = self.sess.io_binding()
        self.inputs = {
            n: self.binding.bind_input(n, np.zeros(s, t)) for n, (s, t) in case.inputs.items()
        }
        self.outputs = [
            self.binding.bind_output(n, shape=s, dtype=t) for n, (s, t) in case.outputs.items()
        ]

    def run(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        for name, value in feeds.items():
            self.inputs[name][...] = value
        with np.errstate(over="ignore"):
            self.sess.run_with_iobinding(self.binding, PRIMARY)
        return [o.copy() for o in self.outputs]

    def recorded(self):
        return self.sess.main_provider.recorded_graph(PRIMARY)


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_replayed_bound_call_matches_numpy(case: Case) -> None:
    rng = np.random.default_rng(11)
    bound = _Bound(case)
    for _ in range(6):  # record, then replays with new values in the same buffers
        feeds = case.feeds(rng)
        got = bound.run(feeds)
        for g, want in zip(got, case.reference(feeds), strict=True):
            want = np.asarray(want).reshape(g.shape)
            if case.exact:
                np.testing.assert_array_equal(g, want.astype(g.dtype))
            else:
                np.testing.assert_allclose(g, want, rtol=2e-5, atol=1e-6)
    graph = bound.recorded()
    assert graph is not None and graph.calls
    assert graph.bound == len(graph.calls), f"{case.op}: a replayed call is the generic one"
    assert graph.native_calls == (len(graph.calls) if case.native else 0), case.op


def test_reduce_sum_axes_changed_between_replays_follow_the_new_axes() -> None:
    """The axes input is a buffer too: a replay with other axes (same output shape) reduces
    over those, not over the axes the graph was recorded with."""
    case = Case(
        "ReduceSum",
        {"x": ((4, 4), F32), "axes": ((1,), I64)},
        {"y": ((4,), F32)},
        lambda r: {},
        lambda f: [],
        {"keepdims": 0},
    )
    bound = _Bound(case)
    x = np.arange(16, dtype=F32).reshape(4, 4)
    np.testing.assert_array_equal(bound.run({"x": x, "axes": np.array([1])}), [x.sum(1)])
    np.testing.assert_array_equal(bound.run({"x": x, "axes": np.array([1])}), [x.sum(1)])
    np.testing.assert_array_equal(bound.run({"x": x, "axes": np.array([0])}), [x.sum(0)])


@pytest.mark.parametrize("index_input,bad", [("ids", 50), ("i", -7)])
def test_replayed_gather_refuses_an_index_out_of_range(index_input: str, bad: int) -> None:
    case = next(c for c in CASES if c.op == "Gather" and index_input in c.inputs)
    bound = _Bound(case)
    rng = np.random.default_rng(2)
    bound.run(case.feeds(rng))
    bound.run(case.feeds(rng))
    feeds = case.feeds(rng)
    feeds[index_input].reshape(-1)[-1] = bad
    with pytest.raises(Exception, match=rf"Gather.*index {bad} out of range"):
        bound.run(feeds)


def test_replayed_argmax_prob_of_a_row_with_nan_is_numpys() -> None:
    """A NaN in a row sends the native ArgMaxProb back to the numpy closure: numpy's index of
    the first NaN and a NaN confidence, the other rows as before."""
    case = next(c for c in CASES if c.op == "ArgMaxProb")
    bound = _Bound(case)
    rng = np.random.default_rng(5)
    for _ in range(3):  # recorded, then replayed natively
        bound.run(case.feeds(rng))
    assert bound.recorded().native_calls == 1
    feeds = case.feeds(rng)
    feeds["x"][1, 7] = np.nan
    idx, prob = bound.run(feeds)
    want_idx, want_prob = _argmax_prob(feeds)
    assert idx[1] == 7 and np.isnan(prob[1])
    np.testing.assert_array_equal(idx[[0, 2]], want_idx[[0, 2]])
    np.testing.assert_allclose(prob[[0, 2]], want_prob[[0, 2]], rtol=2e-5)
