"""Boundaries of the ``onnx_genrt`` op declarations (``core.genrt_ops``) that
tests/core/test_genrt_ops.py left open (found by a mutation run): schema refusals, bodies
built from inputs whose types or shapes are unknown, outputs left out, and bodies of unnamed
nodes. Results against numpy or onnxruntime running the body."""

from __future__ import annotations

import re

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_genrt.core.errors import ModelLoadError, UnsupportedOpError
from onnx_genrt.core.genrt_ops import BODY_OPSETS, GENRT_OPS, expand, projection_node
from onnx_genrt.core.kernels import GENRT_DOMAIN, MS_DOMAIN, NodeInfo, TensorType
from onnx_genrt.session import InferenceSession
from tests.core.test_genrt_ops import _model, _run_body, _run_fused
from tests.models import standard_ops_cpu

ort = pytest.importorskip("onnxruntime")

F32, I64 = np.dtype(np.float32), np.dtype(np.int64)


def _ort_body(node: NodeInfo, types, feeds: dict, outputs: list[str]) -> dict[str, np.ndarray]:
    """``expand(node, types)`` as a model of its own, run by onnxruntime."""
    body = expand(node, types)
    graph = helper.make_graph(
        body.nodes,
        "body",
        [
            helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
            for n, v in feeds.items()
        ],
        [helper.make_empty_tensor_value_info(o) for o in outputs],
        [numpy_helper.from_array(v, n) for n, v in body.initializers.items()],
    )
    opsets = [helper.make_opsetid(d, v) for d, v in BODY_OPSETS.items()]
    model = helper.make_model(graph, opset_imports=opsets)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip(outputs, sess.run(outputs, feeds), strict=True))


def _next_feeds(k: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "accepted": np.array([1], np.int64),
        "start": np.array([5], np.int64),
        "token": np.array([[7]], np.int64),
        "drafts": rng.integers(0, 100, (1, k)).astype(np.int64),
        "confidences": np.array([[0.9, 0.2, 0.8][:k]], np.float32),
    }


# -- MTPNextInputs: the mask needs its width --------------------------------------------------


@pytest.mark.parametrize("length", [None, 0, -1])
@pytest.mark.parametrize("provider", ["cpu", "standard-ops"])
def test_a_mask_output_without_mask_length_is_refused(provider, length):
    """The mask output is [1, mask_length]: without a width (the default 0) the CPU kernel
    and the body both made a mask of no columns, where the CUDA kernel refuses the node."""
    feeds = _next_feeds(3)
    attrs = {} if length is None else {"mask_length": length}
    model = _model("MTPNextInputs", feeds, {}, ["s", "i", "c", "", "mask"], **attrs)
    providers = ["cpu"] if provider == "cpu" else [standard_ops_cpu()]
    got = 0 if length is None else length
    message = rf"'MTPNextInputs_node'.*mask output \(4\) needs mask_length >= 1, got {got}"
    with pytest.raises(ModelLoadError, match=message):
        InferenceSession(model, providers, cpu_fallback=False)


def test_a_mask_of_one_column_is_allowed():
    feeds = _next_feeds(3)
    model = _model("MTPNextInputs", feeds, {}, ["s", "i", "c", "", "mask"], mask_length=1)
    for out in (_run_body(model, feeds), _run_fused(model, feeds)):
        np.testing.assert_array_equal(out["mask"], [[1]])


def test_mask_length_without_a_mask_output_is_allowed():
    feeds = _next_feeds(3)
    for length in (None, 0, 16):
        attrs = {} if length is None else {"mask_length": length}
        model = _model("MTPNextInputs", feeds, {}, ["s", "i", "c", "p"], **attrs)
        for out in (_run_body(model, feeds), _run_fused(model, feeds)):
            np.testing.assert_array_equal(out["p"], [np.arange(7, 11)])
            np.testing.assert_array_equal(out["c"], [3])  # min_confidence 0: all count


def test_next_inputs_body_needs_only_the_drafts_width():
    """The body's one static dimension is the drafts' width: confidences of unknown shape
    (or unknown type, float32 then) do not stop it."""
    feeds = _next_feeds(3)
    names = tuple(feeds)
    node = NodeInfo(
        "MTPNextInputs", "next", GENRT_DOMAIN, 1, {"min_confidence": 0.5}, names, ("s", "i", "c")
    )
    types = [TensorType(I64, v.shape) for v in feeds.values()]
    for conf in (TensorType(F32, (1, "k")), TensorType(None, None), None):
        out = _ort_body(node, [*types[:4], conf], feeds, ["s", "i", "c"])
        np.testing.assert_array_equal(out["s"], [7])
        np.testing.assert_array_equal(out["i"], [[7, *feeds["drafts"][0]]])
        np.testing.assert_array_equal(out["c"], [1])  # 0.2 < 0.5 ends the count


def test_next_inputs_compares_float16_confidences_in_their_own_type():
    feeds = _next_feeds(3)
    feeds["confidences"] = feeds["confidences"].astype(np.float16)
    model = _model("MTPNextInputs", feeds, {}, ["s", "i", "c"], min_confidence=0.5)
    for out in (_run_body(model, feeds), _run_fused(model, feeds)):
        np.testing.assert_array_equal(out["s"], [7])
        np.testing.assert_array_equal(out["c"], [1])


# -- ArgMaxProb -------------------------------------------------------------------------------


def _softmax_max(x: np.ndarray) -> np.ndarray:
    x64 = x.astype(np.float64)
    return 1.0 / np.exp(x64 - x64.max(axis=-1, keepdims=True)).sum(axis=-1)


def test_argmax_prob_with_its_index_output_only():
    rng = np.random.default_rng(3)
    feeds = {"x": rng.standard_normal((2, 30)).astype(np.float32)}
    model = _model("ArgMaxProb", feeds, {}, ["i"])
    for out in (_run_body(model, feeds), _run_fused(model, feeds)):
        assert set(out) == {"i"}
        np.testing.assert_array_equal(out["i"], np.argmax(feeds["x"], axis=-1))


def test_unnamed_argmax_prob_nodes_with_only_probabilities_keep_their_bodies_apart():
    """Two unnamed nodes whose index output is left out: each body's values are named after
    the node, so they must not both be named after the empty output 0."""
    rng = np.random.default_rng(4)
    a, b = rng.standard_normal((2, 3, 40)).astype(np.float32)
    nodes = [
        helper.make_node("ArgMaxProb", ["a"], ["", "pa"], domain=GENRT_DOMAIN),
        helper.make_node("ArgMaxProb", ["b"], ["", "pb"], domain=GENRT_DOMAIN),
    ]
    f = TensorProto.FLOAT
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, f, [3, 40]) for n in "ab"],
        [helper.make_tensor_value_info(n, f, [3]) for n in ("pa", "pb")],
    )
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid(GENRT_DOMAIN, 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    session = InferenceSession(model, [standard_ops_cpu()], cpu_fallback=False)
    steps = [p.node for p in session.placement()]
    assert len(set(steps)) == len(steps) == 4, steps
    pa, pb = session.run(["pa", "pb"], {"a": a, "b": b})
    np.testing.assert_allclose(pa, _softmax_max(a), rtol=1e-5)
    np.testing.assert_allclose(pb, _softmax_max(b), rtol=1e-5)


# -- SiluMul ----------------------------------------------------------------------------------


def test_silu_mul_with_gate_and_up_refuses_split():
    node = NodeInfo("SiluMul", "act", GENRT_DOMAIN, 1, {"split": 1}, ("g", "u"), ("y",))
    with pytest.raises(ModelLoadError, match=r"'act'.*split=1 takes one input, got gate and up"):
        expand(node, [TensorType(F32, (2, 8))] * 2)


def test_body_value_types_leave_unknown_element_types_unknown():
    """An input of unknown type is declared untyped to shape inference (not float64, numpy's
    default dtype), so the body's values stay untyped and placement asks with None."""
    node = NodeInfo("SiluMul", "act", GENRT_DOMAIN, 1, {}, ("g", "u"), ("y",))
    body = expand(node)
    assert body.value_types({"g": None, "u": None}) == {}
    assert body.value_types({"g": TensorType(None, (3, 8)), "u": TensorType(None, (3, 8))}) == {}
    typed = body.value_types({"g": TensorType(F32, (3, "k")), "u": TensorType(F32, (3, "k"))})
    assert typed["act/sigmoid"] == TensorType(F32, (3, "k"))


def test_element_types_outside_the_constraint_or_unequal_are_refused():
    node = NodeInfo("SiluMul", "act", GENRT_DOMAIN, 1, {}, ("g", "u"), ("y",))
    with pytest.raises(ModelLoadError, match=r"'act'.*input 0 \(g\) is int64; allowed"):
        expand(node, [TensorType(I64, (2, 8)), TensorType(I64, (2, 8))])
    f16 = TensorType(np.dtype(np.float16), (2, 8))
    with pytest.raises(
        ModelLoadError, match=r"'act'.*inputs of type T differ: float32 and float16"
    ):
        expand(node, [TensorType(F32, (2, 8)), f16])
    assert expand(node, [f16, f16]).nodes


# -- MTPAccept --------------------------------------------------------------------------------


@pytest.mark.parametrize("to", [TensorProto.FLOAT, TensorProto.FLOAT16])
def test_mtp_accept_casts_a_row_of_unknown_type_to(to):
    """With the hidden states' type unknown the body cannot tell whether they are already of
    type ``to``: it casts (and the row comes out of that type)."""
    k, hidden = 3, 4
    rng = np.random.default_rng(5)
    feeds = {
        "ids": np.array([[9, 1, 2, 8]], np.int64),
        "argmax": np.array([[1, 2, 3, 4]], np.int64),
        "hidden": rng.standard_normal((1, k + 1, hidden)).astype(np.float32),
        "count": np.array([3], np.int64),
    }
    node = NodeInfo(
        "MTPAccept", "acc", GENRT_DOMAIN, 1, {"to": to}, tuple(feeds), ("n", "t", "row")
    )
    types = [TensorType(I64, (1, k + 1))] * 2
    out = _ort_body(node, [*types, None, TensorType(I64, (1,))], feeds, ["n", "t", "row"])
    want = feeds["hidden"][:, 2:3].astype(helper.tensor_dtype_to_np_dtype(to))
    np.testing.assert_array_equal(out["n"], [2])
    np.testing.assert_array_equal(out["t"], [[3]])
    assert out["row"].dtype == want.dtype
    np.testing.assert_array_equal(out["row"], want)


def test_mtp_accept_body_needs_only_the_ids_width_and_gathers_a_row_of_type_to_directly():
    """k comes from ids alone (argmax of unknown shape is fine); hidden states already of
    type ``to`` are gathered straight into the row output, with no Cast after."""
    k, hidden = 2, 3
    feeds = {
        "ids": np.array([[9, 1, 5]], np.int64),
        "argmax": np.array([[1, 2, 3]], np.int64),
        "hidden": np.arange(9, dtype=np.float32).reshape(1, k + 1, hidden),
        "count": np.array([2], np.int64),
    }
    node = NodeInfo("MTPAccept", "acc", GENRT_DOMAIN, 1, {}, tuple(feeds), ("n", "t", "row"))
    types = [TensorType(I64, (1, k + 1)), None, TensorType(F32, (1, k + 1, hidden)), None]
    body = expand(node, types)
    (writer,) = [n for n in body.nodes if "row" in n.output]
    assert writer.op_type == "Gather"
    assert not [n for n in body.nodes if n.op_type == "Cast" and "hidden" in str(n.input)]
    out = _ort_body(node, types, feeds, ["n", "t", "row"])
    np.testing.assert_array_equal(out["n"], [1])
    np.testing.assert_array_equal(out["t"], [[2]])
    np.testing.assert_array_equal(out["row"], feeds["hidden"][:, 1:2])


def test_a_node_missing_a_required_input_is_refused_by_name():
    for inputs in [(), ("x", "")]:
        op = "SiluMul" if not inputs else "NormMatMul"
        node = NodeInfo(op, "bad", GENRT_DOMAIN, 1, {}, inputs, ("y",))
        formal = "0 (g)" if not inputs else "2 (gamma)"
        with pytest.raises(ModelLoadError, match=rf"'bad'.*input {re.escape(formal)} is required"):
            expand(node)


def test_a_body_of_a_scalar_input_says_it_needs_a_static_width():
    node = NodeInfo(
        "MTPAccept", "acc", GENRT_DOMAIN, 1, {}, ("ids", "argmax", "hidden", "count"), ("n",)
    )
    with pytest.raises(UnsupportedOpError, match=r"'acc'.*static dimension -1 of input 'ids'"):
        expand(node, [TensorType(I64, ())])
    with pytest.raises(UnsupportedOpError, match=r"'acc'.*input 'ids' \(shape None\)"):
        expand(node)


# -- expand -----------------------------------------------------------------------------------


def test_expand_refuses_other_domains_and_versions():
    silu = NodeInfo("SiluMul", "act", GENRT_DOMAIN, 1, {}, ("g", "u"), ("y",))
    assert expand(silu).nodes
    other = NodeInfo("SiluMul", "act", MS_DOMAIN, 1, {}, ("g", "u"), ("y",))
    with pytest.raises(UnsupportedOpError, match=r"'act'.*not an op of the onnx_genrt domain"):
        expand(other)
    unknown = NodeInfo("GeluMul", "act", GENRT_DOMAIN, 1, {}, ("g", "u"), ("y",))
    with pytest.raises(UnsupportedOpError, match=r"not an op of the onnx_genrt domain \(SiluMul"):
        expand(unknown)
    later = NodeInfo("SiluMul", "act", GENRT_DOMAIN, 2, {}, ("g", "u"), ("y",))
    with pytest.raises(UnsupportedOpError, match=r"'act'.*version 1 only"):
        expand(later)


def test_declared_defaults_are_the_ones_the_bodies_use():
    """A node without ``split`` or ``projection_opset`` gets the declared defaults: two
    inputs (no split) and the projection at opset 1."""
    assert GENRT_OPS["SiluMul"].attr(NodeInfo("SiluMul", "", GENRT_DOMAIN, 1, {}), "split") == 0
    rng = np.random.default_rng(6)
    feeds = {"g": rng.standard_normal((2, 8)).astype(np.float32)}
    feeds["u"] = rng.standard_normal((2, 8)).astype(np.float32)
    w = rng.standard_normal((8, 5)).astype(np.float32)
    model = _model("SiluMulMatMul", feeds, {"W": w}, ["y"])
    body = expand(NodeInfo.from_proto(model.graph.node[0], 1), [None, None, None])
    (proj,) = [n for n in body.nodes if n.op_type == "MatMul"]
    assert body.opset(proj) == 1
    (y,) = _run_body(model, feeds).values()
    g64, u64 = feeds["g"].astype(np.float64), feeds["u"].astype(np.float64)
    np.testing.assert_allclose(y, (g64 / (1 + np.exp(-g64)) * u64) @ w, rtol=1e-5, atol=1e-5)


def test_the_projection_of_a_fused_node_takes_its_weights_attributes_and_output_0():
    """What a fused node's projection kernel is handed (``projection_node``): the weights
    without trailing absent inputs, the node's attributes but its own, the projection's
    opset and only output 0."""
    attrs = {"K": 64, "N": 24, "bits": 4, "block_size": 32, "epsilon": 1e-6, "split": 0}
    names = ("x", "", "gamma", "B", "scales", "", "", "")
    node = NodeInfo(
        "NormMatMulNBits",
        "n",
        GENRT_DOMAIN,
        1,
        {**attrs, "projection_opset": 1},
        names,
        ("y", "sum", "normed"),
    )
    proj = projection_node(node, "n/act")
    assert (proj.domain, proj.op_type, proj.opset) == (MS_DOMAIN, "MatMulNBits", 1)
    assert proj.input_names == ("n/act", "B", "scales")
    assert proj.output_names == ("y",)
    assert proj.attrs == {"K": 64, "N": 24, "bits": 4, "block_size": 32}
    zp = NodeInfo(
        "SiluMulMatMulNBits",
        "s",
        GENRT_DOMAIN,
        1,
        {},
        ("g", "u", "B", "scales", "", "", "b"),
        ("y", "act"),
    )
    assert projection_node(zp, "s/act").input_names == ("s/act", "B", "scales", "", "", "b")
    assert projection_node(zp, "s/act").output_names == ("y",)


def test_attribute_kinds_are_onnx_codes():
    for op in GENRT_OPS.values():
        for a in op.attributes:
            want = onnx.AttributeProto.FLOAT if isinstance(a.default, float) else None
            want = want or onnx.AttributeProto.INT
            assert a.kind == want, (op.name, a.name)
