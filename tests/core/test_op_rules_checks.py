"""Boundaries of the shared op rules (``core.op_rules``) that tests/core/test_op_rules.py
left open (found by a mutation run): each against ONNX's reference evaluator or onnxruntime
where the rule mirrors an op, else against the refusal it promises."""

from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from onnx_genrt.core.kernels import NodeInfo
from onnx_genrt.core.op_rules import (
    constant_value,
    gqa_input_problem,
    gqa_shapes,
    rotary_layout,
    shape_value,
    slice_index,
)


def _node(op: str, opset: int = 17, inputs: tuple[str, ...] = (), **attrs) -> NodeInfo:
    return NodeInfo(op, "n0", "", opset, attrs, inputs, ("y",))


def _shaped(*shape: int) -> SimpleNamespace:
    return SimpleNamespace(shape=shape)


def _reference(node, opset: int, feeds: dict[str, np.ndarray], out_type=TensorProto.FLOAT):
    """Run one node with ONNX's reference evaluator at ``opset``."""
    graph = helper.make_graph(
        [node],
        "one",
        [
            helper.make_tensor_value_info(
                n, helper.np_dtype_to_tensor_dtype(v.dtype), list(v.shape)
            )
            for n, v in feeds.items()
        ],
        [helper.make_tensor_value_info("y", out_type, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    return ReferenceEvaluator(model).run(None, feeds)[0]


# -- Slice at opset 10: bounds come from the inputs --------------------------------------


def test_slice_at_opset_10_reads_its_bounds_from_the_inputs():
    x = np.arange(4 * 5, dtype=np.float32).reshape(4, 5)
    starts, ends, axes, steps = [1, -4], [4, 5], [0, 1], [2, 1]
    proto = helper.make_node("Slice", ["x", "s", "e", "a", "st"], ["y"])
    feeds = {
        "x": x,
        "s": np.array(starts, np.int64),
        "e": np.array(ends, np.int64),
        "a": np.array(axes, np.int64),
        "st": np.array(steps, np.int64),
    }
    want = _reference(proto, 10, feeds)
    # attributes a pre-10 Slice would read (here ignored): a different slice
    node = _node("Slice", 10, starts=[0], ends=[1])
    np.testing.assert_array_equal(x[slice_index(node, 2, starts, ends, axes, steps)], want)


# -- Shape at opset 15: start and end --------------------------------------------------------


@pytest.mark.parametrize(
    ("opset", "attrs"),
    [(13, {}), (14, {}), (15, {"start": 1}), (15, {"end": -1}), (21, {"start": -2})],
)
def test_shape_value_against_onnx_reference(opset, attrs):
    x = np.zeros((2, 3, 4), np.float32)
    proto = helper.make_node("Shape", ["x"], ["y"], **attrs)
    want = _reference(proto, opset, {"x": x}, TensorProto.INT64)
    got = shape_value(_node("Shape", opset, **attrs), x.shape)
    np.testing.assert_array_equal(got, want)
    assert got.dtype == np.int64


# -- Constant -----------------------------------------------------------------------------


def test_a_string_constant_value_is_refused_naming_the_node():
    tensor = numpy_helper.from_array(np.array([b"a", b"b"], dtype=object), "v")
    node = NodeInfo.from_proto(
        helper.make_node("Constant", [], ["y"], name="words", value=tensor), 17
    )
    with pytest.raises(NotImplementedError, match="'words'.*string constants are not supported"):
        constant_value(node)


# -- RotaryEmbedding and GroupQueryAttention shapes -------------------------------------------


def test_rotary_layout_refuses_a_cos_cache_that_is_not_2d():
    with pytest.raises(ValueError, match=r"'n0'.*cos_cache must be 2-D, got \[8, 4, 1\]"):
        rotary_layout(_node("RotaryEmbedding", num_heads=2), (1, 3, 16), (8, 4, 1))


def _gqa(**attrs) -> NodeInfo:
    return NodeInfo("GroupQueryAttention", "attn", "com.microsoft", 1, attrs)


def test_gqa_shapes_refuse_a_key_without_its_value_and_an_uneven_query():
    node = _gqa(num_heads=4, kv_num_heads=2)
    k, sl = _shaped(2, 3, 16), _shaped(2)
    with pytest.raises(ValueError, match=r"'attn'.*query width 32 not divisible.*value missing"):
        gqa_shapes(node, _shaped(2, 3, 32), k, None, seqlens_k=sl)
    with pytest.raises(ValueError, match="query width 30 not divisible by 4 heads"):
        gqa_shapes(node, _shaped(2, 3, 30), k, k, seqlens_k=sl)


def test_gqa_rotary_caches_must_be_equal_and_two_dimensional():
    node = _gqa(num_heads=4, kv_num_heads=2, do_rotary=1)
    q, kv, sl = _shaped(2, 3, 32), _shaped(2, 3, 16), _shaped(2)
    for cos, sin in (((16, 4), (16, 2)), ((16, 4, 1), (16, 4, 1))):
        with pytest.raises(ValueError, match="cos/sin caches .* must be equal 2-D"):
            gqa_shapes(
                node, q, kv, kv, seqlens_k=sl, cos_cache=_shaped(*cos), sin_cache=_shaped(*sin)
            )
    with pytest.raises(ValueError, match="or the cache has no positions"):
        gqa_shapes(node, q, kv, kv, seqlens_k=sl, cos_cache=_shaped(0, 4), sin_cache=_shaped(0, 4))


@pytest.mark.parametrize(("heads", "kv_heads"), [(0, 2), (4, 0), (-4, -2)])
def test_gqa_head_counts_must_be_positive(heads, kv_heads):
    node = _gqa(num_heads=heads, kv_num_heads=kv_heads)
    with pytest.raises(ValueError, match="must be a positive multiple of kv_num_heads"):
        gqa_shapes(node, _shaped(2, 3, 32), seqlens_k=_shaped(2))


def test_gqa_value_must_match_the_key():
    node = _gqa(num_heads=4, kv_num_heads=2)
    q, k = _shaped(2, 3, 32), _shaped(2, 3, 16)
    with pytest.raises(ValueError, match=r"key/value shapes \[2, 3, 16\], \[2, 3, 8\]"):
        gqa_shapes(node, q, k, _shaped(2, 3, 8), seqlens_k=_shaped(2))


@pytest.mark.parametrize(("heads", "kv_heads"), [(1, 1), (4, 1), (4, 4)])
def test_gqa_single_head_and_multi_query_layouts_are_accepted(heads, kv_heads):
    """Without a past, rotary or value input the call still has a geometry: capacity 0,
    rotary dim 0."""
    node = _gqa(num_heads=heads, kv_num_heads=kv_heads)
    g = gqa_shapes(node, _shaped(2, 3, (heads + 2 * kv_heads) * 8), seqlens_k=_shaped(2))
    assert (g.heads, g.kv_heads, g.head_size, g.packed) == (heads, kv_heads, 8, True)
    assert (g.capacity, g.rotary_dim) == (0, 0)


def test_gqa_without_head_counts_is_refused():
    with pytest.raises(ValueError, match="num_heads 0 must be a positive multiple"):
        gqa_shapes(_gqa(), _shaped(2, 3, 32), seqlens_k=_shaped(2))


def test_gqa_rotary_cache_of_one_position_is_enough():
    node = _gqa(num_heads=4, kv_num_heads=2, do_rotary=1)
    kv, c = _shaped(2, 3, 16), _shaped(1, 4)
    g = gqa_shapes(node, _shaped(2, 3, 32), kv, kv, seqlens_k=_shaped(2), cos_cache=c, sin_cache=c)
    assert g.rotary_dim == 8 == g.head_size


def test_rotary_layout_without_heads_or_cache_width_is_refused():
    with pytest.raises(ValueError, match="hidden 16 not divisible by 0 heads"):
        rotary_layout(_node("RotaryEmbedding"), (1, 3, 16), (8, 0))


def test_gqa_input_problem_ignores_inputs_past_the_nodes_last():
    node = NodeInfo("GroupQueryAttention", "a", "com.microsoft", 1, {}, ("q", "k", "v"))
    assert gqa_input_problem(node, ("past_key", "query_seqlens")) is None


def test_gqa_without_kv_head_count_is_refused():
    with pytest.raises(ValueError, match="must be a positive multiple of kv_num_heads 0"):
        gqa_shapes(_gqa(num_heads=4), _shaped(2, 3, 32), seqlens_k=_shaped(2))


@pytest.mark.parametrize(
    ("x_shape", "attrs", "heads"),
    [((1, 3, 32), {}, 4), ((1, 3, 8), {"num_heads": 1}, 1), ((2, 5, 24), {}, 3)],
)
def test_rotary_layout_of_a_3d_input_takes_its_heads_from_the_attribute_or_the_cache(
    x_shape, attrs, heads
):
    """Against onnxruntime: it runs the node, and the layout's heads times head size is
    the input's width."""
    ort = pytest.importorskip("onnxruntime")
    rng = np.random.default_rng(5)
    x = rng.standard_normal(x_shape).astype(np.float32)
    cos = rng.standard_normal((16, 4)).astype(np.float32)
    pos = np.zeros(x_shape[:2], np.int64)
    proto = helper.make_node(
        "RotaryEmbedding", ["x", "p", "c", "s"], ["y"], domain="com.microsoft", **attrs
    )
    graph = helper.make_graph(
        [proto],
        "rotary",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape)),
            helper.make_tensor_value_info("p", TensorProto.INT64, list(pos.shape)),
            helper.make_tensor_value_info("c", TensorProto.FLOAT, list(cos.shape)),
            helper.make_tensor_value_info("s", TensorProto.FLOAT, list(cos.shape)),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
    )
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (y,) = sess.run(None, {"x": x, "p": pos, "c": cos, "s": cos})
    lay = rotary_layout(NodeInfo.from_proto(proto, 1), x.shape, cos.shape)
    assert y.shape == x.shape
    assert (lay.heads, lay.head_size, lay.rotary_dim, lay.bnsh) == (heads, 8, 8, False)


# -- GroupQueryAttention attributes and the window-sized cache ----------------------------------

_PAST = ("q", "k", "v", "pk", "pv", "seqlens_k", "total")


def _gqa_node(inputs=_PAST, outputs=("y", "pk_out", "pv_out"), **attrs) -> NodeInfo:
    return NodeInfo(
        "GroupQueryAttention",
        "attn",
        "com.microsoft",
        1,
        {"num_heads": 4, "kv_num_heads": 2, **attrs},
        tuple(inputs),
        tuple(outputs),
    )


@pytest.mark.parametrize(
    ("inputs", "outputs", "attrs", "problem"),
    [
        (_PAST, ("y", "pk_out", "pv_out"), {}, None),
        (_PAST, ("y", "pk_out", "pv_out", ""), {}, None),  # output_qk named empty: absent
        (_PAST, ("y", "pk_out", "pv_out", "qk"), {}, "output_qk / qk_output"),
        (_PAST, ("y",), {"qk_output": 1}, "output_qk / qk_output"),
        (_PAST, ("y",), {"causal": 0}, None),
        (_PAST, ("y",), {"causal": 1, "local_window_size": 1}, None),
        (_PAST, ("y",), {"local_window_size": 1}, None),  # causal defaults to 1
        (_PAST, ("y",), {"local_window_size": 0}, "local_window_size=0 must be -1"),
        (_PAST, ("y",), {"local_window_size": -2}, "local_window_size=-2 must be -1"),
        (_PAST, ("y",), {"causal": 0, "local_window_size": 1}, "needs causal=1"),
        (_PAST, ("y",), {"softcap": 0.0}, None),
        (_PAST, ("y",), {"softcap": float("nan")}, "softcap=nan must be finite"),
        (_PAST, ("y",), {"softcap": float("inf")}, "softcap=inf must be finite"),
        (_PAST, ("y",), {"softcap": -0.5}, "softcap=-0.5 must be finite and >= 0"),
        (_PAST, ("y",), {"sliding_window_cache": 1, "local_window_size": 1}, None),
        (_PAST, ("y",), {"sliding_window_cache": 1}, "needs local_window_size >= 1 \\(got -1\\)"),
        (_PAST[:4], ("y",), {"sliding_window_cache": 1, "local_window_size": 2}, "past_key and"),
        (
            ("q", "k", "v", "", "pv"),
            ("y",),
            {"sliding_window_cache": 1, "local_window_size": 2},
            "past_key and past_value",
        ),
        (
            ("q", "k", "v", "pk", ""),
            ("y",),
            {"sliding_window_cache": 1, "local_window_size": 2},
            "past_key and past_value",
        ),
        (
            (*_PAST, "", "", "", "bias"),
            ("y",),
            {"sliding_window_cache": 1, "local_window_size": 2},
            "with attention_bias",
        ),
        (
            (*_PAST, "", "", "", ""),
            ("y",),
            {"sliding_window_cache": 1, "local_window_size": 2},
            None,
        ),
        (
            (*_PAST, "", "", "bias"),
            ("y",),
            {"sliding_window_cache": 1, "local_window_size": 2},
            None,
        ),
    ],
)
def test_gqa_attribute_rules(inputs, outputs, attrs, problem):
    from onnx_genrt.core.op_rules import gqa_attribute_problem

    got = gqa_attribute_problem(_gqa_node(inputs, outputs, **attrs))
    if problem is None:
        assert got is None
    else:
        assert got is not None
        assert re.search(problem, got), got


@pytest.mark.parametrize(("capacity", "window"), [(8, 0), (8, -1), (4, 5)])
def test_windowed_cache_length_refuses_a_window_the_cache_cannot_hold(capacity, window):
    from onnx_genrt.core.op_rules import windowed_cache_length

    with pytest.raises(ValueError, match=f"capacity {capacity} must be at least"):
        windowed_cache_length(3, capacity, window)


# -- Reshape targets and gather index ranges ------------------------------------------------


@pytest.mark.parametrize(
    ("in_shape", "target", "opset", "allowzero"),
    [
        ((2, 3, 4), [4, -1], 13, 0),
        ((2, 3, 4), [0, -1], 13, 0),
        ((2, 3, 4), [0, 0, -1], 13, 0),
        ((2, 3, 4), [-1], 13, 0),
        ((2, 3, 4), [24], 13, 0),
        ((2, 0, 4), [0, -1], 13, 0),
        ((2, 3, 4), [0, 0, 0, 0], 13, 0),  # a 0 past the input's rank
        ((2, 3, 4), [-1, -1], 13, 0),
        ((2, 3, 4), [5, -1], 13, 0),
        ((2, 3, 4), [25], 13, 0),
        ((2, 3, 4), [-2, 12], 13, 0),
        ((2, 3, 4), [0, 12], 14, 1),
        ((0, 3), [0, 3], 14, 1),
        ((0, 3), [3, 0], 14, 1),
        ((0, 3), [3, 0], 14, 0),
        ((0, 3), [3, 0], 13, 1),  # allowzero is not an attribute before opset 14
    ],
)
def test_reshape_target_against_onnxruntime(in_shape, target, opset, allowzero):
    """onnxruntime, not ONNX's reference evaluator: numpy (and so the reference) reads any
    negative size as -1, where ONNX allows -1 only."""
    from onnx_genrt.core.kernels import KernelContext
    from onnx_genrt.core.op_rules import reshape_target

    ort = pytest.importorskip("onnxruntime")
    attrs = {"allowzero": allowzero} if opset >= 14 else {}
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["x", "shape"], ["y"], **attrs)],
        "reshape",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, list(in_shape)),
            helper.make_tensor_value_info("shape", TensorProto.INT64, [len(target)]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    x = np.arange(int(np.prod(in_shape)), dtype=np.float32).reshape(in_shape)
    try:
        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        (y,) = sess.run(None, {"x": x, "shape": np.array(target, np.int64)})
        want = list(y.shape)
    except Exception:  # onnxruntime refuses it
        want = None
    node = _node("Reshape", opset, **({"allowzero": allowzero} if allowzero else {}))
    if want is None:
        with pytest.raises(ValueError, match="'n0'"):
            reshape_target(KernelContext(node), in_shape, target)
    else:
        assert reshape_target(KernelContext(node), in_shape, target) == want


@pytest.mark.parametrize(
    ("indices", "bad"),
    [([0, 4, -5], None), ([5], 5), ([-6], -6), ([-6, 7], -6), ([-5, 5], 5), ([], None)],
)
def test_check_index_range_allows_minus_dim_to_dim_and_names_the_bad_index(indices, bad):
    from onnx_genrt.core.kernels import KernelContext
    from onnx_genrt.core.op_rules import check_index_range

    ctx = KernelContext(_node("Gather"))
    idx = np.array(indices, np.int64)
    if bad is None:
        check_index_range(ctx, idx, 5)
        return
    with pytest.raises(IndexError, match=rf"'n0'.*index {bad} out of range .*\(valid: -5..4\)"):
        check_index_range(ctx, idx, 5)


def test_reshape_refuses_minus_one_beside_an_explicit_zero():
    """ONNX's Reshape: with allowzero=1, -1 beside a 0 is invalid (no unique size); ONNX's
    reference evaluator refuses it (onnxruntime 1.2x returns (4, 0))."""
    from onnx_genrt.core.kernels import KernelContext
    from onnx_genrt.core.op_rules import reshape_target

    proto = helper.make_node("Reshape", ["x", "shape"], ["y"], allowzero=1)
    feeds = {"x": np.zeros((0, 4), np.float32), "shape": np.array([-1, 0], np.int64)}
    with pytest.raises(ValueError):
        _reference(proto, 14, feeds)
    ctx = KernelContext(_node("Reshape", 14, allowzero=1))
    with pytest.raises(ValueError, match=r"'n0'.*cannot reshape \(0, 4\) to \[-1, 0\]"):
        reshape_target(ctx, (0, 4), [-1, 0])


def test_reshape_names_a_second_minus_one():
    from onnx_genrt.core.kernels import KernelContext
    from onnx_genrt.core.op_rules import reshape_target

    ctx = KernelContext(_node("Reshape", 13))
    with pytest.raises(ValueError, match=r"more than one -1 in shape \[-1, 4, -1\]"):
        reshape_target(ctx, (2, 3, 4), [-1, 4, -1])


# -- MatMul shapes and MatMulNBits attributes --------------------------------------------------


def test_matmul_shape_against_numpy():
    """Every pair of shapes of rank 0-4 (dims 1-3): numpy's matmul result shape, or a
    ValueError naming the node where numpy refuses."""
    from onnx_genrt.core.kernels import KernelContext
    from onnx_genrt.core.op_rules import matmul_shape

    rng = np.random.default_rng(6)
    ctx = KernelContext(_node("MatMul"))
    checked = refused = 0
    for _ in range(400):
        a = tuple(int(v) for v in rng.integers(1, 4, rng.integers(0, 5)))
        b = tuple(int(v) for v in rng.integers(1, 4, rng.integers(0, 5)))
        try:
            want = np.matmul(np.zeros(a), np.zeros(b)).shape
        except ValueError:
            with pytest.raises(ValueError, match="'n0'"):
                matmul_shape(ctx, a, b)
            refused += 1
            continue
        assert matmul_shape(ctx, a, b) == want, (a, b)
        checked += 1
    assert checked > 50 and refused > 50


@pytest.mark.parametrize(
    ("attrs", "inputs", "problem"),
    [
        ({"bits": 2, "block_size": 16}, 3, None),
        ({"bits": 4, "block_size": 32}, 3, None),
        ({"bits": 8, "block_size": 128}, 4, None),
        ({"block_size": 32}, 3, None),  # bits defaults to 4
        ({"bits": 3, "block_size": 32}, 3, "bits=3 is not supported"),
        ({"bits": 1, "block_size": 32}, 3, "bits=1 is not supported"),
        ({"bits": 9, "block_size": 32}, 3, "bits=9 is not supported"),
        ({"bits": 16, "block_size": 32}, 3, "bits=16 is not supported"),
        ({"bits": 4}, 3, "block_size=0 must be a power of 2 >= 16"),
        ({"bits": 4, "block_size": 8}, 3, "block_size=8 must be"),
        ({"bits": 4, "block_size": 48}, 3, "block_size=48 must be"),
        ({"bits": 4, "block_size": 32}, 5, "g_idx input is not supported"),
        ({"bits": 4, "block_size": 32, "weight_prepacked": 1}, 3, "weight_prepacked"),
        ({"bits": 4, "block_size": 32, "accuracy_level": 4}, 3, None),
        ({"bits": 4, "block_size": 32, "accuracy_level": 0}, 3, None),
        ({"bits": 4, "block_size": 32, "accuracy_level": 5}, 3, "accuracy_level=5 is not one"),
        ({"bits": 4, "block_size": 32, "accuracy_level": -1}, 3, "accuracy_level=-1 is not one"),
    ],
)
def test_matmul_nbits_attribute_rules(attrs, inputs, problem):
    from onnx_genrt.core.op_rules import matmul_nbits_unsupported

    names = ("a", "b", "scales", "zp", "g_idx")[:inputs]
    got = matmul_nbits_unsupported(_node("MatMulNBits", 1, names, K=64, N=8, **attrs))
    if problem is None:
        assert got is None
    else:
        assert got is not None and problem in got, got
    empty_g_idx = ("a", "b", "scales", "zp", "")
    node = _node("MatMulNBits", 1, empty_g_idx, K=64, N=8, bits=4, block_size=32)
    assert matmul_nbits_unsupported(node) is None


@pytest.mark.parametrize(
    ("level", "zero_points", "int8"),
    [
        (4, None, True),
        (4, np.uint8, True),
        (4, np.float32, False),
        (3, None, False),
        (None, None, False),
    ],
)
def test_matmul_nbits_int8_activations_at_level_4_only(level, zero_points, int8):
    """onnxruntime's CPU MatMulNBits quantizes A to int8 at accuracy_level 4 with packed or no
    zero points (tests/providers/cpu/test_nbits_int8_activations.py compares the values)."""
    from onnx_genrt.core.op_rules import matmul_nbits_int8_activations

    attrs = {} if level is None else {"accuracy_level": level}
    node = _node("MatMulNBits", 1, ("a", "b", "s"), bits=4, block_size=32, **attrs)
    assert matmul_nbits_int8_activations(node, zero_points) is int8
