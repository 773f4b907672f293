"""The op rules both providers share (core/op_rules.py), against independent references:
numpy's own axis normalisation, ONNX's reference evaluator for Slice and Cast, onnxruntime's
RotaryEmbedding and GroupQueryAttention for the shapes they accept; and the CUDA provider's
checks, imported with CuPy stubbed out, give the same answers as the CPU's."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import onnx
import pytest
from numpy.lib.array_utils import normalize_axis_index
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from onnx_genrt.core.kernels import NodeInfo, TensorType
from onnx_genrt.core.op_rules import (
    cast_problem,
    cast_target_code,
    constant_problem,
    constant_value,
    gqa_attribute_problem,
    gqa_input_problem,
    gqa_shapes,
    matmul_nbits_dims,
    mtp_accept_drafts,
    normalize_axes,
    normalize_axis,
    rotary_layout,
    silu_mul_half,
    slice_index,
)
from tests.cuda_stub import run_with_cupy_stub


def _node(op: str, opset: int = 17, inputs: tuple[str, ...] = (), **attrs) -> NodeInfo:
    return NodeInfo(op, "n0", "", opset, attrs, inputs, ("y",))


def _shaped(*shape: int) -> SimpleNamespace:
    return SimpleNamespace(shape=shape)


# -- axes ----------------------------------------------------------------------------------


@pytest.mark.parametrize("rank", [1, 2, 4])
def test_normalize_axis_agrees_with_numpy(rank):
    node = _node("Softmax")
    for axis in range(-rank - 2, rank + 2):
        try:
            want = normalize_axis_index(axis, rank)
        except np.exceptions.AxisError:
            with pytest.raises(ValueError, match=rf"'n0'.*axis {axis} out of range for rank"):
                normalize_axis(axis, rank, node)
        else:
            assert normalize_axis(axis, rank, node) == want


def test_normalize_axis_scalar_and_repeats():
    assert normalize_axis(0, 0) == 0  # a scalar's one axis (Softmax on a 0-d input)
    with pytest.raises(ValueError, match="axis -1 out of range for rank 0"):
        normalize_axis(-1, 0)
    with pytest.raises(ValueError, match="gather_axis 3"):
        normalize_axis(3, 2, what="gather_axis")
    assert normalize_axes([-1, 0], 3) == [2, 0]
    with pytest.raises(ValueError, match=r"'n0'.*repeated axis in \[1, -2\]"):
        normalize_axes([1, -2], 3, _node("Squeeze"))


# -- Slice ---------------------------------------------------------------------------------


def _reference_slice(x, opset, starts, ends, axes, steps):
    if opset < 10:
        attrs = {"starts": starts, "ends": ends}
        if axes is not None:
            attrs["axes"] = axes
        node = helper.make_node("Slice", ["x"], ["y"], **attrs)
        feeds = {"x": x}
    else:
        names, feeds = ["x", "s", "e"], {"x": x, "s": np.array(starts), "e": np.array(ends)}
        for name, value in (("a", axes), ("p", steps)):
            names.append(name if value is not None else "")
            if value is not None:
                feeds[name] = np.array(value, np.int64)
        while names[-1] == "":
            names.pop()
        node = helper.make_node("Slice", names, ["y"])
    inputs = [helper.make_tensor_value_info(k, TensorProto.FLOAT if k == "x" else TensorProto.INT64, None) for k in feeds]  # fmt: skip
    graph = helper.make_graph(
        [node], "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    feeds = {k: (v.astype(np.int64) if k != "x" else v) for k, v in feeds.items()}
    return ReferenceEvaluator(model).run(None, feeds)[0]


@pytest.mark.parametrize("opset", [9, 13])
def test_slice_index_agrees_with_onnx_reference(opset):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 5, 6)).astype(np.float32)
    for _ in range(60):
        n_axes = int(rng.integers(1, 4))
        axes = [int(a) for a in rng.choice([-3, -2, -1, 0, 1, 2], n_axes, replace=False)]
        if len({normalize_axis_index(a, 3) for a in axes}) < n_axes:
            continue
        starts = [int(v) for v in rng.integers(-8, 8, n_axes)]
        ends = [int(v) for v in rng.integers(-8, 8, n_axes)]
        steps = None if opset < 10 else [int(v) for v in rng.choice([-2, -1, 1, 3], n_axes)]
        use_axes = None if rng.random() < 0.3 and axes == list(range(n_axes)) else axes
        want = _reference_slice(x, opset, starts, ends, use_axes, steps)
        if opset < 10:
            attrs = {"starts": starts, "ends": ends}
            if use_axes is not None:
                attrs["axes"] = use_axes
            index = slice_index(_node("Slice", opset, **attrs), 3)
        else:
            index = slice_index(_node("Slice", opset), 3, starts, ends, use_axes, steps)
        np.testing.assert_array_equal(x[index], want)


def test_slice_index_refuses_bad_bounds():
    node = _node("Slice", 13)
    with pytest.raises(ValueError, match=r"'n0'.*lengths differ \(2, 1, 2, 2\)"):
        slice_index(node, 2, [0, 0], [1], None, None)
    with pytest.raises(ValueError, match="step must not be zero"):
        slice_index(node, 2, [0], [1], [0], [0])
    with pytest.raises(ValueError, match="repeated axis"):
        slice_index(node, 2, [0, 0], [1, 1], [0, -2], None)


# -- Constant and Cast ---------------------------------------------------------------------


def test_constant_value_matches_onnx_reference():
    for attr, value in (
        ("value", helper.make_tensor("v", TensorProto.INT32, [2], [3, 4])),
        ("value_float", 1.5),
        ("value_floats", [1.0, 2.5]),
        ("value_int", 7),
        ("value_ints", [1, -2, 3]),
    ):
        proto = helper.make_node("Constant", [], ["y"], **{attr: value})
        info = NodeInfo.from_proto(proto, 17)
        model = helper.make_model(
            helper.make_graph(
                [proto], "g", [], [helper.make_tensor_value_info("y", TensorProto.UNDEFINED, None)]
            ),
            opset_imports=[helper.make_opsetid("", 17)],
        )
        want = ReferenceEvaluator(model).run(None, {})[0]
        got = constant_value(info)
        assert got.dtype == want.dtype and got.shape == want.shape, attr
        np.testing.assert_array_equal(got, want)
        assert constant_problem(info) is None


def test_constant_refuses_sparse_and_strings():
    node = _node("Constant", value_strings=["a"])
    assert "value_strings" in constant_problem(node)
    with pytest.raises(NotImplementedError, match=r"'n0'.*value_strings"):
        constant_value(node)
    node = _node("Constant", value=np.array(["a"], dtype=object))
    assert "string tensors" in constant_problem(node)


def test_cast_rule_names_every_element_type_onnx_defines():
    for name, code in TensorProto.DataType.items():
        if code == TensorProto.UNDEFINED:
            continue
        assert cast_target_code(name) == code == cast_target_code(code)
        reason = cast_problem(_node("Cast", to=code))
        np_type = None
        if code != TensorProto.STRING:
            np_type = helper.tensor_dtype_to_np_dtype(code)
        refused = code == TensorProto.STRING or np_type.kind in "OUSc"
        assert (reason is not None) == refused, (name, reason)
    assert cast_problem(_node("Cast")) == "Cast needs a 'to' attribute"
    assert "unknown element type" in cast_problem(_node("Cast", to="NOPE"))
    assert cast_problem(_node("CastLike")) is None


def test_cast_rule_with_a_providers_types_checks_target_and_source():
    supported = {TensorProto.FLOAT, TensorProto.INT64}
    ok = _node("Cast", to=TensorProto.INT64)
    assert cast_problem(ok, (TensorType(np.dtype(np.float32), (2,)),), supported) is None
    assert cast_problem(ok, (None,), supported) is None
    reason = cast_problem(ok, (TensorType(np.dtype(np.int8), (2,)),), supported)
    assert reason == "Cast from element type INT8 is not supported"
    reason = cast_problem(_node("Cast", to=TensorProto.DOUBLE), (), supported)
    assert reason == "Cast to element type DOUBLE is not supported"


# -- RotaryEmbedding and GroupQueryAttention: shapes onnxruntime accepts -------------------


def _ort_run(node: onnx.NodeProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    import onnxruntime as ort

    def info(name: str, arr: np.ndarray) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(
            name, helper.np_dtype_to_tensor_dtype(arr.dtype), arr.shape
        )

    outs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in node.output]
    graph = helper.make_graph([node], "g", [info(k, v) for k, v in feeds.items()], outs)
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
    )
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


@pytest.mark.parametrize(
    ("x_shape", "attrs"),
    [((2, 3, 32), {"num_heads": 4}), ((2, 4, 3, 8), {}), ((1, 5, 24), {"num_heads": 3})],
)
def test_rotary_layout_matches_onnxruntime(x_shape, attrs):
    rng = np.random.default_rng(1)
    x = rng.standard_normal(x_shape).astype(np.float32)
    d = 8
    cos = rng.standard_normal((16, d // 2)).astype(np.float32)
    pos = np.zeros((x_shape[0], x_shape[-2] if len(x_shape) == 4 else x_shape[1]), np.int64)
    proto = helper.make_node(
        "RotaryEmbedding", ["x", "p", "c", "s"], ["y"], domain="com.microsoft", **attrs
    )
    y = _ort_run(proto, {"x": x, "p": pos, "c": cos, "s": cos})[0]
    lay = rotary_layout(NodeInfo.from_proto(proto, 1), x.shape, cos.shape)
    assert y.shape == x.shape
    assert (lay.head_size, lay.rotary_dim) == (d, d)
    assert lay.batch * lay.heads * lay.seq * lay.head_size == x.size
    assert lay.bnsh == (x.ndim == 4)


def test_rotary_layout_refuses_what_does_not_fit():
    node = _node("RotaryEmbedding", num_heads=5)
    with pytest.raises(ValueError, match=r"'n0'.*hidden 32 not divisible by 5 heads"):
        rotary_layout(node, (1, 2, 32), (8, 4))
    with pytest.raises(ValueError, match="3-D or 4-D"):
        rotary_layout(_node("RotaryEmbedding"), (2, 32), (8, 4))
    with pytest.raises(ValueError, match=r"rotary dim 8 vs cos cache \[8, 2\]"):
        rotary_layout(_node("RotaryEmbedding"), (1, 1, 2, 8), (8, 2))
    with pytest.raises(NotImplementedError, match="is_packed_batching"):
        rotary_layout(_node("RotaryEmbedding", is_packed_batching=1), (1, 1, 2, 8), (8, 4))


def _gqa_feeds(packed: bool, b=2, s=3, heads=4, kvh=2, d=16, cap=10, rotary=True):
    rng = np.random.default_rng(2)
    f = np.float32
    feeds = {}
    if packed:
        feeds["q"] = rng.standard_normal((b, s, (heads + 2 * kvh) * d)).astype(f)
    else:
        feeds["q"] = rng.standard_normal((b, s, heads * d)).astype(f)
        feeds["k"] = rng.standard_normal((b, s, kvh * d)).astype(f)
        feeds["v"] = rng.standard_normal((b, s, kvh * d)).astype(f)
    feeds["pk"] = np.zeros((b, kvh, cap, d), f)
    feeds["pv"] = np.zeros((b, kvh, cap, d), f)
    feeds["sl"] = np.full((b,), s - 1, np.int32)
    feeds["tl"] = np.array([s], np.int32)
    if rotary:
        feeds["c"] = rng.standard_normal((16, d // 2)).astype(f)
        feeds["si"] = rng.standard_normal((16, d // 2)).astype(f)
    return feeds


@pytest.mark.parametrize("packed", [False, True])
def test_gqa_shapes_match_what_onnxruntime_runs(packed):
    feeds = _gqa_feeds(packed)
    names = ["q", "" if packed else "k", "" if packed else "v", "pk", "pv", "sl", "tl", "c", "si"]
    proto = helper.make_node(
        "GroupQueryAttention", names, ["y", "pko", "pvo"], domain="com.microsoft",
        num_heads=4, kv_num_heads=2, do_rotary=1,
    )  # fmt: skip
    y = _ort_run(proto, feeds)[0]
    g = gqa_shapes(
        NodeInfo.from_proto(proto, 1), _shaped(*feeds["q"].shape),
        None if packed else feeds["k"], None if packed else feeds["v"],
        feeds["pk"], feeds["pv"], feeds["sl"], feeds["c"], feeds["si"],
    )  # fmt: skip
    assert y.shape == (g.batch, g.seq, g.heads * g.head_size)
    assert (g.kv_heads, g.head_size, g.packed, g.capacity, g.rotary_dim) == (2, 16, packed, 10, 16)


def test_gqa_shapes_name_the_input_at_fault():
    node = NodeInfo("GroupQueryAttention", "attn", "com.microsoft", 1,
                    {"num_heads": 4, "kv_num_heads": 2, "do_rotary": 1})  # fmt: skip
    q, k, v = _shaped(2, 3, 32), _shaped(2, 3, 16), _shaped(2, 3, 16)
    pk, sl, c = _shaped(2, 2, 10, 8), _shaped(2), _shaped(16, 4)
    ok = dict(past_key=pk, past_value=pk, seqlens_k=sl, cos_cache=c, sin_cache=c)

    def fails(pattern, *args, **kw):
        with pytest.raises(ValueError, match=pattern):
            gqa_shapes(node, *args, **{**ok, **kw})

    assert gqa_shapes(node, q, k, v, **ok).capacity == 10
    fails(r"'attn'.*query must be", _shaped(2, 32), k, v)
    fails(r"key/value shapes \[2, 3, 8\]", q, _shaped(2, 3, 8), v)
    fails("packed QKV width 30", _shaped(2, 3, 30))
    fails(r"past_key \[2, 2, 10, 4\] does not fit \[2, 2, \*, 8\]", q, k, v,
          past_key=_shaped(2, 2, 10, 4))  # fmt: skip
    fails("past_key and past_value go together", q, k, v, past_value=None)
    fails("differ in shape", q, k, v, past_value=_shaped(2, 2, 12, 8))
    fails(r"seqlens_k \[3\] must hold one entry per batch", q, k, v, seqlens_k=_shaped(3))
    fails("seqlens_k is required", q, k, v, seqlens_k=None)
    fails("do_rotary needs cos_cache and sin_cache", q, k, v, cos_cache=None)
    fails("rotary dim 10", q, k, v, cos_cache=_shaped(16, 5), sin_cache=_shaped(16, 5))
    fails(r"head_sink \[3\]", q, k, v, head_sink=_shaped(3))
    bad = NodeInfo("GroupQueryAttention", "attn", "com.microsoft", 1,
                   {"num_heads": 3, "kv_num_heads": 2})  # fmt: skip
    with pytest.raises(ValueError, match="positive multiple of kv_num_heads 2"):
        gqa_shapes(bad, q, k, v, **ok)


def test_gqa_input_problem():
    names = ("q", "", "", "pk", "pv", "sl", "tl", "", "", "", "", "", "ks")
    node = NodeInfo("GroupQueryAttention", "a", "com.microsoft", 1, {}, names)
    assert gqa_input_problem(node, ("k_scale",), " on X") == (
        "GroupQueryAttention input 'k_scale' is not supported on X"
    )
    assert gqa_input_problem(node, ("position_ids",)) is None
    with pytest.raises(ValueError, match="not GroupQueryAttention inputs"):
        gqa_input_problem(node, ("k_scales",))


def test_genrt_op_rules():
    assert silu_mul_half(_node("SiluMul", split=1), (2, 8)) == 4
    with pytest.raises(ValueError, match="split=1 and an even last dimension"):
        silu_mul_half(_node("SiluMul", split=1), (2, 7))
    with pytest.raises(ValueError, match="split=1"):
        silu_mul_half(_node("SiluMul"), (2, 8))
    assert mtp_accept_drafts(_node("MTPAccept"), (1, 4), (1, 4), (1, 4, 16)) == 3
    with pytest.raises(ValueError, match="share a width of k \\+ 1"):
        mtp_accept_drafts(_node("MTPAccept"), (1, 4), (1, 5), (1, 4, 16))


# -- the CUDA provider's checks are the shared rules (CuPy stubbed) ------------------------

_CUDA_CHECKS = """
import json
import numpy as np
from onnx import TensorProto
from onnx_genrt.core.kernels import NodeInfo, TensorType
from onnx_genrt.providers.cuda.kernels import REGISTRY
def check(domain, op, attrs, inputs=(), types=()):
    node = NodeInfo(op, "n", domain, 17, attrs, tuple(inputs), ("y",))
    return REGISTRY.lookup(domain, op, 17).check(node, types)
print(json.dumps([
    check("", "Constant", {"value_strings": ["a"]}),
    check("", "Cast", {"to": TensorProto.FLOAT16}),
    check("", "Cast", {"to": TensorProto.FLOAT8E4M3FN}),
    check("", "Cast", {"to": TensorProto.FLOAT}, ("x",), (TensorType(np.dtype("complex64"), None),)),
    check("com.microsoft", "RotaryEmbedding", {"is_packed_batching": 1}),
    check("com.microsoft", "GroupQueryAttention", {}, ("q", "", "", "pk", "pv", "s", "t", "", "", "p")),
    check("com.microsoft", "GroupQueryAttention", {"num_heads": 2, "kv_num_heads": 1},
          ("q", "", "", "", "", "s", "t")),
    check("com.microsoft", "GroupQueryAttention", {"softcap": -1.0}, ("q", "", "", "", "", "s", "t")),
]))
"""


def test_cuda_checks_are_the_shared_rules():
    got = run_with_cupy_stub(_CUDA_CHECKS)
    f8 = TensorProto.FLOAT8E4M3FN
    assert got == [
        constant_problem(_node("Constant", value_strings=["a"])),
        None,
        cast_problem(_node("Cast", to=f8), (), {TensorProto.FLOAT}),
        "Cast from element type COMPLEX64 is not supported",
        "RotaryEmbedding is_packed_batching=1 is not supported",
        "GroupQueryAttention input 'position_ids' is not supported on CUDA",
        None,  # concat mode: no past, a present buffer is made
        gqa_attribute_problem(_node("GroupQueryAttention", softcap=-1.0)),
    ]


# -- MatMulNBits ---------------------------------------------------------------------------


def _nbits_node(inputs: tuple[str, ...] = ("A", "B", "scales"), **attrs) -> NodeInfo:
    return _node("MatMulNBits", 1, inputs, **{"K": 64, "N": 24, "block_size": 32, **attrs})


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_matmul_nbits_dims_reads_the_attributes(bits):
    dims = matmul_nbits_dims(_nbits_node(bits=bits), 64, has_g_idx=False)
    assert (dims.k, dims.n, dims.bits, dims.block) == (64, 24, bits, 32)


def test_matmul_nbits_dims_default_is_four_bits():
    assert matmul_nbits_dims(_nbits_node(), 64, has_g_idx=False).bits == 4


@pytest.mark.parametrize(
    "node,columns,g_idx,error,message",
    [
        (_nbits_node(), 65, False, ValueError, r"'n0'.*A has 65 columns, K is 64"),
        (_nbits_node(bits=3), 64, False, NotImplementedError, r"'n0'.*bits=3 is not supported"),
        (_nbits_node(block_size=24), 64, False, NotImplementedError, r"block_size=24"),
        (_nbits_node(), 64, True, NotImplementedError, r"'n0'.*g_idx"),
        (_nbits_node(("A", "B", "s", "", "g")), 64, False, NotImplementedError, r"g_idx input"),
    ],
)
def test_matmul_nbits_dims_refuses(node, columns, g_idx, error, message):
    with pytest.raises(error, match=message):
        matmul_nbits_dims(node, columns, has_g_idx=g_idx)
