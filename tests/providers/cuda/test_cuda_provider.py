"""CUDA provider on a real GPU: kernels against numpy float64, graph slots, whole sessions.

Every test is marked ``gpu``: skipped without a usable GPU, failed instead when
ONNX_GENRT_REQUIRE_GPU=1. This module imports without CuPy; CuPy is imported in fixtures.
Kernels write into planned output buffers poisoned with NaN, as the executor hands them out.
"""

from __future__ import annotations

import math
import time

import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_genrt.core.dtypes import DType
from onnx_genrt.core.errors import GraphCaptureError
from onnx_genrt.core.graph_slots import DeviceGraphSlot
from onnx_genrt.core.kernels import GENRT_DOMAIN, KernelContext, NodeInfo
from onnx_genrt.core.tensor import Tensor

pytestmark = pytest.mark.gpu

PRIMARY, VERIFY, DRAFT = DeviceGraphSlot.PRIMARY, DeviceGraphSlot.VERIFY, DeviceGraphSlot.DRAFT
FLOATS = [np.float32, np.float16]
BF16 = np.dtype(ml_dtypes.bfloat16)
#: The kernels that take bfloat16 as well (not yet MatMul and the norms).
FLOATS_BF16 = [*FLOATS, BF16]
#: (rtol, atol) per output dtype, against a float64 reference of the same inputs.
TOL = {np.dtype(np.float32): (1e-5, 1e-5), np.dtype(np.float16): (2e-3, 2e-3)}
TOL[BF16] = (2e-2, 2e-2)


# ----------------------------------------------------------------------------- helpers


def _poison(cp, shape, dtype):
    dt = np.dtype(dtype)
    buf = cp.empty(shape, dt)
    if dt.kind == "f" or dt == BF16:
        buf.fill(np.nan)
    elif dt.kind == "b":
        buf.fill(True)
    else:
        info = np.iinfo(dt)
        buf.fill(info.min + 7 if info.min < 0 else info.max - 7)
    return buf


def node(op, n_in, n_out=1, attrs=None, opset=21, domain=""):
    return NodeInfo(
        op,
        f"test_{op}",
        domain,
        opset,
        dict(attrs or {}),
        tuple(f"in{i}" for i in range(n_in)),
        tuple(f"out{i}" for i in range(n_out)),
    )


def launch(prov, info, dev_inputs, planned=()):
    kdef = prov.get_kernel(info.domain, info.op_type, info.opset)
    assert kdef is not None, f"no CUDA kernel for {info.op_type}"
    res = prov.launch(kdef, KernelContext(info, prov, list(planned)), list(dev_inputs))
    return list(res) if isinstance(res, tuple | list) else [res]


def run_op(cp, prov, op, inputs, expected, *, attrs=None, opset=21, domain="", planned=True):
    """Run ``op`` on device copies of ``inputs`` into NaN-poisoned planned outputs.

    Returns the host results; asserts each kernel wrote into its planned buffer.
    """
    dev = [None if x is None else prov.as_array(np.asarray(x)) for x in inputs]
    bufs = []
    if planned:
        with prov.stream:
            bufs = [_poison(cp, e.shape, e.dtype) for e in expected]
    info = node(op, len(inputs), len(expected), attrs, opset, domain)
    results = launch(prov, info, dev, bufs)
    for i, buf in enumerate(bufs):
        assert results[i] is buf, f"{op}: output {i} not written into its planned buffer"
    return [prov.to_numpy(r).copy() for r in results]


def assert_close(got, want, dtype=None, scale=1.0):
    dt = np.dtype(dtype or got.dtype)
    rtol, atol = TOL.get(dt, (1e-6, 1e-6))
    assert got.shape == want.shape, (got.shape, want.shape)
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=rtol, atol=atol * scale)


def _cpu_kernels_or_none():
    """The CPU provider class when it imports (it needs Numba), else None."""
    try:
        from onnx_genrt.providers.cpu.provider import CPUProvider
    except Exception:
        return None
    return CPUProvider


# ----------------------------------------------------------------------------- provider basics


def test_plugin_creates_provider_with_all_slots(cp):
    from onnx_genrt.core.registry import get_registry
    from onnx_genrt.providers.cuda.plugin import cuda_unavailable_reason
    from onnx_genrt.providers.cuda.provider import CUDAProvider

    assert cuda_unavailable_reason() is None
    p = get_registry().create("cuda")
    assert isinstance(p, CUDAProvider)
    assert p.device.kind == "cuda" and p.device.index == 0
    assert p.graph_slots == frozenset(DeviceGraphSlot)
    assert not p.CAPTURE_EXECUTES
    assert p.stream.ptr != 0  # its own (non-default) stream


@pytest.mark.parametrize(
    "dtype", [np.float32, np.float16, np.float64, np.int32, np.int64, np.bool_, np.uint8]
)
@pytest.mark.parametrize("shape", [(), (0,), (3,), (5, 7, 3)])
def test_host_round_trip(prov, rng, dtype, shape):
    host = np.abs(rng.standard_normal(shape) * 50).astype(dtype)
    t = prov.copy_from_host(host)
    assert t.buffer.shape == host.shape and t.buffer.dtype == host.dtype
    np.testing.assert_array_equal(prov.copy_to_host(t), host)
    out = np.empty_like(host)
    assert prov.copy_to_host(t, out) is out
    np.testing.assert_array_equal(out, host)


def test_copies_large_noncontiguous_and_many_small(cp, prov, rng):
    big = rng.standard_normal(21_000_000).astype(np.float32)  # > the 64 MiB staging limit
    np.testing.assert_array_equal(prov.to_numpy(prov.as_array(big)), big)
    # Many small async uploads through the one staging buffer, then all read back.
    hosts = [rng.standard_normal((17, 5)).astype(np.float32) for _ in range(40)]
    devs = [prov.as_array(h) for h in hosts]
    for h, d in zip(hosts, devs, strict=True):
        np.testing.assert_array_equal(prov.to_numpy(d), h)
    # Device to device, a strided source, and an upload into an existing buffer.
    src = prov.as_array(rng.standard_normal((6, 4)).astype(np.float32))
    dst = prov.allocate((4, 6), DType.FLOAT32)
    prov.copy(Tensor(src.T, DType.FLOAT32, prov.device), dst)
    np.testing.assert_array_equal(prov.copy_to_host(dst), prov.to_numpy(src).T)
    host = rng.standard_normal((4, 6)).astype(np.float32)
    prov.copy_from_host(host, dst)
    np.testing.assert_array_equal(prov.copy_to_host(dst), host)


def test_copy_array_and_reads_queued_behind_later_work(cp, prov, rng):
    """copy_array (a memcpy when contiguous, else a kernel); read_later values stay right
    while more uploads, copies and reads are queued before they are collected."""
    a = prov.as_array(rng.standard_normal((3, 8)).astype(np.float32))
    b = prov.allocate((3, 8), DType.FLOAT32).buffer
    prov.copy_array(a, b)
    np.testing.assert_array_equal(prov.to_numpy(b), prov.to_numpy(a))
    strided = prov.allocate((8, 3), DType.FLOAT32).buffer
    prov.copy_array(a.T, strided)
    np.testing.assert_array_equal(prov.to_numpy(strided), prov.to_numpy(a).T)
    hosts = [rng.standard_normal(4096).astype(np.float32) for _ in range(100)]
    buf = prov.allocate((4096,), DType.FLOAT32).buffer
    pending = []
    for h in hosts:  # 100 x 2 x 16 KiB through a 1 MiB ring: it wraps while reads pend
        prov.write_from_host(buf, h)
        pending.append(prov.read_later([buf]))
    for h, fetch in zip(hosts, pending, strict=True):
        np.testing.assert_array_equal(fetch()[0], h)


def test_small_int_constants_keep_a_host_copy(prov):
    shape = np.array([2, -1], np.int64)
    dev = prov.as_array(shape)
    assert np.array_equal(prov.host_value(dev), shape)
    assert prov.host_value(prov.as_array(np.zeros(3, np.float32))) is None


# ----------------------------------------------------------------------------- elementwise


def _erf(x):
    return np.vectorize(math.erf)(x)


UNARY = {
    "Neg": (np.negative, "normal"),
    "Sqrt": (np.sqrt, "positive"),
    "Reciprocal": (lambda x: 1.0 / x, "away"),
    "Exp": (np.exp, "normal"),
    "Tanh": (np.tanh, "normal"),
    "Sigmoid": (lambda x: 1.0 / (1.0 + np.exp(-x)), "normal"),
    "Relu": (lambda x: np.maximum(x, 0.0), "normal"),
    "Erf": (_erf, "normal"),
}


def _sample(rng, kind, shape, dtype):
    if kind == "positive":
        x = rng.uniform(0.05, 6.0, shape)
    elif kind == "away":
        x = rng.uniform(0.25, 4.0, shape) * rng.choice([-1.0, 1.0], shape)
    else:
        x = rng.standard_normal(shape) * 2.5
    return x.astype(dtype)


@pytest.mark.parametrize("dtype", FLOATS_BF16)
@pytest.mark.parametrize("op", sorted(UNARY))
def test_unary(cp, prov, rng, op, dtype):
    fn, kind = UNARY[op]
    x = _sample(rng, kind, (3, 5, 67), dtype)
    want = fn(x.astype(np.float64))
    (got,) = run_op(cp, prov, op, [x], [want.astype(dtype)])
    assert got.dtype == dtype
    assert_close(got, want)


@pytest.mark.parametrize("dtype", FLOATS_BF16)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu(cp, prov, rng, approximate, dtype):
    x = _sample(rng, "normal", (3, 5, 67), dtype)
    v = x.astype(np.float64)
    if approximate == "tanh":
        want = 0.5 * v * (1 + np.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v**3)))
    else:
        want = 0.5 * v * (1 + _erf(v / math.sqrt(2)))
    attrs = {"approximate": approximate}
    (got,) = run_op(cp, prov, "Gelu", [x], [want.astype(dtype)], attrs=attrs, opset=20)
    assert got.dtype == dtype
    assert_close(got, want)


BINARY = {
    "Add": np.add,
    "Sub": np.subtract,
    "Mul": np.multiply,
    "Div": np.divide,
    "Pow": np.power,
}


@pytest.mark.parametrize("dtype", FLOATS_BF16)
@pytest.mark.parametrize("b_shape", [(2, 3, 40), (40,), (2, 1, 40), ()])
@pytest.mark.parametrize("op", sorted(BINARY))
def test_binary(cp, prov, rng, op, b_shape, dtype):
    a = rng.standard_normal((2, 3, 40)).astype(dtype)
    b = rng.standard_normal(b_shape).astype(dtype)
    if op == "Div":
        b = (np.sign(b) + (b == 0)) * (np.abs(b) + 0.5)
    if op == "Pow":
        a = np.abs(a) + np.asarray(0.25, dtype)
        b = np.clip(b, -2, 2)
    a, b = a.astype(dtype), np.asarray(b, dtype)
    want = BINARY[op](a.astype(np.float64), b.astype(np.float64))
    (got,) = run_op(cp, prov, op, [a, b], [want.astype(dtype)])
    assert_close(got, want, scale=max(1.0, float(np.abs(want).max())))


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_integer_arithmetic_truncates_like_c(cp, prov, dtype):
    a = np.array([-7, 7, -7, 7, 9, -1, 0], dtype)
    b = np.array([2, 2, -2, -2, 3, 5, 4], dtype)
    (got,) = run_op(cp, prov, "Div", [a, b], [a])
    np.testing.assert_array_equal(got, np.array([-3, 3, 3, -3, 3, 0, 0], dtype))
    (got,) = run_op(cp, prov, "Add", [a, b], [a])
    np.testing.assert_array_equal(got, a + b)
    (got,) = run_op(cp, prov, "Neg", [a], [a])
    np.testing.assert_array_equal(got, -a)


@pytest.mark.parametrize("dtype", FLOATS_BF16 + [np.int64])
@pytest.mark.parametrize("op,fn", [("Equal", np.equal), ("Less", np.less), ("Greater", np.greater)])
def test_compare(cp, prov, rng, op, fn, dtype):
    a = rng.integers(-3, 4, (4, 33)).astype(dtype)
    b = rng.integers(-3, 4, (33,)).astype(dtype)
    want = fn(a, b)
    (got,) = run_op(cp, prov, op, [a, b], [want])
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(
    "op,fn",
    [("And", np.logical_and), ("Or", np.logical_or), ("Xor", np.logical_xor), ("Not", None)],
)
def test_boolean_ops(cp, prov, rng, op, fn):
    """Boolean logic into True-poisoned outputs (the speculative acceptance uses these)."""
    a = rng.random((4, 33)) > 0.5
    b = rng.random((33,)) > 0.5
    inputs, want = ([a], np.logical_not(a)) if fn is None else ([a, b], fn(a, b))
    assert not want.all()  # a poisoned (all True) output would not pass
    (got,) = run_op(cp, prov, op, inputs, [want])
    assert got.dtype == np.bool_
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", FLOATS_BF16 + [np.int64])
def test_where(cp, prov, rng, dtype):
    cond = rng.random((3, 1, 9)) > 0.5
    x = rng.standard_normal((3, 4, 9)).astype(dtype)
    y = np.asarray(rng.standard_normal(()), dtype)
    want = np.where(cond, x, y)
    (got,) = run_op(cp, prov, "Where", [cond, x, y], [want])
    np.testing.assert_array_equal(got, want)


_CAST_TYPES = {
    np.float32: TensorProto.FLOAT,
    np.float16: TensorProto.FLOAT16,
    BF16: TensorProto.BFLOAT16,
    np.int32: TensorProto.INT32,
    np.int64: TensorProto.INT64,
    np.bool_: TensorProto.BOOL,
}


@pytest.mark.parametrize("src", list(_CAST_TYPES))
@pytest.mark.parametrize("dst", list(_CAST_TYPES))
def test_cast(cp, prov, src, dst):
    values = np.array([-2.75, -1.0, -0.5, 0.0, 0.5, 1.0, 3.9, 100.25, 7.0, -33.5])
    x = values.astype(src)
    want = x.astype(dst)
    (got,) = run_op(cp, prov, "Cast", [x], [want], attrs={"to": _CAST_TYPES[dst]})
    assert got.dtype == np.dtype(dst)
    np.testing.assert_array_equal(got, want)


def test_cast_to_float8_is_refused_at_planning(prov):
    ok, reason = prov.supports(node("Cast", 1, attrs={"to": TensorProto.FLOAT8E4M3FN}))
    assert not ok and "FLOAT8E4M3FN" in reason


@pytest.mark.parametrize("dtype", FLOATS_BF16)
def test_identity(cp, prov, rng, dtype):
    x = rng.standard_normal((4, 6)).astype(dtype)
    (got,) = run_op(cp, prov, "Identity", [x], [x])
    np.testing.assert_array_equal(got, x)


# ----------------------------------------------------------------------------- shape ops


@pytest.mark.parametrize("device_shape", [False, True])
def test_reshape_is_a_view(cp, prov, rng, device_shape):
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    shape = np.array([0, -1], np.int64)
    dx = prov.as_array(x)
    ds = prov.as_array(shape) if device_shape else shape
    (res,) = launch(prov, node("Reshape", 2, opset=21), [dx, ds])
    assert res.shape == (2, 12) and res.data.ptr == dx.data.ptr
    np.testing.assert_array_equal(prov.to_numpy(res), x.reshape(2, 12))


def test_squeeze_unsqueeze_flatten(cp, prov, rng):
    x = rng.standard_normal((1, 3, 1, 4)).astype(np.float16)
    dx = prov.as_array(x)
    axes = prov.as_array(np.array([0, -2], np.int64))
    (sq,) = launch(prov, node("Squeeze", 2, opset=13), [dx, axes])
    assert sq.shape == (3, 4)
    (un,) = launch(prov, node("Unsqueeze", 2, opset=13), [sq, prov.as_array(np.array([1, -1]))])
    assert un.shape == (3, 1, 4, 1)
    (fl,) = launch(prov, node("Flatten", 1, attrs={"axis": 2}), [dx])
    assert fl.shape == (3, 4)
    (all1,) = launch(prov, node("Squeeze", 1, opset=13), [dx])
    assert all1.shape == (3, 4)
    np.testing.assert_array_equal(prov.to_numpy(un).reshape(-1), x.reshape(-1))


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("perm", [None, (1, 0, 2), (2, 0, 1)])
def test_transpose(cp, prov, rng, perm, dtype):
    x = rng.standard_normal((3, 5, 7)).astype(dtype)
    want = np.transpose(x, perm)
    attrs = {} if perm is None else {"perm": list(perm)}
    (got,) = run_op(cp, prov, "Transpose", [x], [want], attrs=attrs)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("axis", [1, -1, 0])
def test_concat(cp, prov, rng, axis):
    shapes = {1: [(2, 3, 4), (2, 1, 4), (2, 5, 4)], -1: [(2, 3, 1), (2, 3, 6)], 0: [(1, 3), (4, 3)]}
    parts = [rng.standard_normal(s).astype(np.float16) for s in shapes[axis]]
    want = np.concatenate(parts, axis=axis)
    (got,) = run_op(cp, prov, "Concat", parts, [want], attrs={"axis": axis})
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(
    "starts,ends,axes,steps",
    [
        ([1, -8], [3, 100], [0, 1], [1, 2]),
        ([-1], [-100], [2], [-2]),
        ([0, 0, 2], [1, 10, 5], None, None),
    ],
)
def test_slice(cp, prov, rng, starts, ends, axes, steps):
    x = rng.standard_normal((4, 10, 6)).astype(np.float32)
    index = [slice(None)] * 3
    for i, (s, e) in enumerate(zip(starts, ends, strict=True)):
        a = axes[i] if axes else i
        index[a] = slice(s, e, steps[i] if steps else 1)
    want = np.ascontiguousarray(x[tuple(index)])
    ints = [np.array(v, np.int64) if v is not None else None for v in (starts, ends, axes, steps)]
    while ints and ints[-1] is None:
        ints.pop()
    dev = [prov.as_array(x)] + [prov.as_array(v) if v is not None else None for v in ints]
    with prov.stream:
        buf = _poison(cp, want.shape, want.dtype)
    (res,) = launch(prov, node("Slice", len(dev), opset=13), dev, [buf])
    assert res is buf
    np.testing.assert_array_equal(prov.to_numpy(res), want)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("axis", [0, 1])
def test_gather(cp, prov, rng, axis, index_dtype, dtype):
    x = rng.standard_normal((10, 6, 3)).astype(dtype)
    dim = x.shape[axis]
    idx = np.array([[0, -1, 3], [dim - 1, 2, -dim]], index_dtype)
    want = np.take(x, idx.astype(np.int64) % dim, axis=axis)
    (got,) = run_op(cp, prov, "Gather", [x, idx], [want], attrs={"axis": axis})
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("bad", [10, -11])
def test_gather_refuses_device_indices_out_of_range(cp, prov, rng, bad):
    """Eager runs check device indices (one min/max read-back), like host indices."""
    x = rng.standard_normal((10, 4)).astype(np.float32)
    idx = prov.as_array(np.array([0, bad], np.int64))
    with pytest.raises(IndexError, match=f"{bad} out of range for axis of size 10"):
        launch(prov, node("Gather", 2, opset=13), [prov.as_array(x), idx])


def test_gather_replayed_with_an_index_out_of_range_writes_nan(cp):
    """A captured Gather cannot read back its indices: a replay with an out-of-range index
    writes NaN in that row (the rows of valid indices stay exact), never another row."""
    from onnx import TensorProto, helper, numpy_helper

    from onnx_genrt.session import InferenceSession

    table = np.arange(40, dtype=np.float32).reshape(10, 4)
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "idx"], ["y"], axis=0)],
        "g",
        [helper.make_tensor_value_info("idx", TensorProto.INT64, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
        [numpy_helper.from_array(table, "table")],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    sess = InferenceSession(proto, providers=["cuda"])
    provider = sess.main_provider
    idx = provider.as_array(np.array([1, 2], np.int64))
    binding = sess.io_binding()
    binding.bind_input("idx", idx)
    y = binding.bind_output("y", shape=(2, 4), dtype=np.float32)
    for _ in range(3):  # eager, warm-up, capture
        sess.run_with_iobinding(binding, PRIMARY)
    np.testing.assert_array_equal(provider.to_numpy(y), table[[1, 2]])
    replays = sess.graph_stats(PRIMARY).replays
    provider.write_from_host(idx, np.array([3, 10], np.int64))
    sess.run_with_iobinding(binding, PRIMARY)
    got = provider.to_numpy(y)
    assert sess.graph_stats(PRIMARY).replays == replays + 1  # this run was a replay
    np.testing.assert_array_equal(got[0], table[3])
    assert np.isnan(got[1]).all()


# ----------------------------------------------------------------------------- nn


def _softmax(x, axis=-1):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


@pytest.mark.parametrize("dtype", FLOATS_BF16)
@pytest.mark.parametrize("shape", [(3, 7), (2, 3, 1000), (2, 151936)])
def test_softmax_last_axis(cp, prov, rng, shape, dtype):
    x = (rng.standard_normal(shape) * 3).astype(dtype)
    want = _softmax(x.astype(np.float64))
    (got,) = run_op(cp, prov, "Softmax", [x], [want.astype(dtype)], opset=13)
    assert_close(got, want)


def test_softmax_old_opset_flattens_and_inner_axis(cp, prov, rng):
    x = rng.standard_normal((2, 3, 5)).astype(np.float32)
    want = _softmax(x.reshape(2, 15).astype(np.float64)).reshape(2, 3, 5)
    (got,) = run_op(
        cp, prov, "Softmax", [x], [want.astype(np.float32)], opset=11, attrs={"axis": 1}
    )
    assert_close(got, want)
    want = _softmax(x.astype(np.float64), axis=1)
    (got,) = run_op(
        cp, prov, "Softmax", [x], [want.astype(np.float32)], opset=13, attrs={"axis": 1}
    )
    assert_close(got, want)


@pytest.mark.parametrize("dtype", FLOATS_BF16)
@pytest.mark.parametrize("keepdims", [0, 1])
@pytest.mark.parametrize("last", [0, 1])
def test_argmax(cp, prov, rng, dtype, keepdims, last):
    x = rng.standard_normal((5, 3000)).astype(dtype)
    x[:, 3] = x[:, 2900] = 10  # ties: first or last index
    want = np.full((5, 1) if keepdims else (5,), 2900 if last else 3, np.int64)
    attrs = {"axis": -1, "keepdims": keepdims, "select_last_index": last}
    (got,) = run_op(cp, prov, "ArgMax", [x], [want], attrs=attrs, opset=13)
    np.testing.assert_array_equal(got, want)
    # ONNX's default axis is 0: that one runs through CuPy eagerly (distinct values).
    x0 = rng.permutation(5 * 40).reshape(5, 40).astype(dtype)
    want0 = np.argmax(x0, axis=0, keepdims=bool(keepdims))
    (got0,) = run_op(cp, prov, "ArgMax", [x0], [want0], attrs={"keepdims": keepdims}, opset=13)
    np.testing.assert_array_equal(got0, want0)


@pytest.mark.parametrize("dtype", FLOATS_BF16)
@pytest.mark.parametrize("rows,cols", [(1, 151936), (4, 3000), (33, 32768), (3, 5), (2, 4099)])
def test_argmax_prob(cp, prov, rng, dtype, rows, cols):
    """onnx_genrt::ArgMaxProb against float64 numpy: the first index of the largest value and
    1 / sum(exp(x - max)), rows split over many blocks (a vocabulary at one row) or not.
    Edge rows: ties far apart, a first stretch all -inf (a block that adds nothing), a NaN
    (picked, NaN probability) and a row all -inf (NaN, as softmax of it). Ten launches give the
    same bits, whichever block finishes last."""
    x = (rng.standard_normal((rows, cols)) * 3).astype(dtype)
    first = min(7, cols // 4)
    x[:, first] = x[:, cols - 1 - cols // 3] = 20  # ties: the first index
    if rows > 1:
        x[1, : cols // 2] = -np.inf
        x[1, cols - 2] = 25
    if rows > 2:
        x[2, cols // 2] = np.nan
    if rows > 3:
        x[3] = -np.inf
    x64 = x.astype(np.float64)
    with np.errstate(invalid="ignore"):
        top = np.where(np.isnan(x64).any(-1), np.nan, x64.max(-1))
        want_p = 1.0 / np.exp(x64 - top[:, None]).sum(-1)
    want_i = np.full(rows, first, np.int64)
    if rows > 1:
        want_i[1] = cols - 2
    if rows > 2:
        want_i[2] = cols // 2
    if rows > 3:
        want_i[3] = 0
    expected = [want_i, want_p.astype(dtype)]
    got_i, got_p = run_op(cp, prov, "ArgMaxProb", [x], expected, opset=1, domain=GENRT_DOMAIN)
    np.testing.assert_array_equal(got_i, want_i)
    assert np.array_equal(np.isnan(got_p), np.isnan(want_p)), (got_p, want_p)
    finite = ~np.isnan(want_p)
    assert_close(got_p[finite], want_p[finite])
    for _ in range(10):
        again_i, again_p = run_op(
            cp, prov, "ArgMaxProb", [x], expected, opset=1, domain=GENRT_DOMAIN
        )
        np.testing.assert_array_equal(again_i, got_i)
        assert again_p.tobytes() == got_p.tobytes()


@pytest.mark.parametrize("top_k", [False, True], ids=["all", "top-k"])
@pytest.mark.parametrize("dtype", FLOATS_BF16)
@pytest.mark.parametrize("rows,vocab", [(1, 151936), (37, 5003), (3, 1)])
def test_sample_tokens(cp, prov, rng, dtype, rows, vocab, top_k):
    """onnx_genrt::SampleTokens against ``core.token_sampling``'s rule on the same logits (as
    stored): the same token on every row but where the two best scores are within float32
    rounding (CUDA's logf and numpy's may differ by an ulp); temperature 0 is the argmax;
    with top_k (the radix select's floor), k from off to past the vocabulary, ties at it."""
    from onnx_genrt.core.token_sampling import gumbel_scores, sample_tokens

    x = (rng.standard_normal((rows, 1, vocab)) * 3).astype(dtype)
    x[-1, 0, : min(vocab, 6)] = x[-1, 0].max()  # ties at the top
    temperature = rng.uniform(0.2, 2.0, (rows, 1)).astype(np.float32)
    temperature[0, 0] = 0.0 if rows > 1 else temperature[0, 0]
    seed = rng.integers(-(2**63), 2**63 - 1, (rows, 1))
    offset = rng.integers(0, 2**40, (rows, 1))
    inputs = [x, temperature, seed, offset]
    k = None
    if top_k:
        k = rng.integers(0, 60, (rows, 1))
        k[-1, 0] = 3  # inside the tie of six
        if rows > 2:
            k[1, 0] = vocab + 1
        inputs.append(k)
    logits = x.astype(np.float32)
    want = sample_tokens(logits, temperature, seed, offset, k)
    (got,) = run_op(cp, prov, "SampleTokens", inputs, [want], opset=1, domain=GENRT_DOMAIN)
    scores = np.sort(gumbel_scores(logits, temperature, seed, offset, k), axis=-1)
    near = np.zeros(want.shape, bool)
    if vocab > 1:
        near = scores[..., -1] - scores[..., -2] <= 1e-5 * np.abs(scores[..., -1])
    assert ((got == want) | near).all(), np.argwhere((got != want) & ~near)
    if rows > 1:
        assert got[0, 0] == np.argmax(logits[0, 0])


@pytest.mark.parametrize("dtype", FLOATS_BF16)
@pytest.mark.parametrize("split", [0, 1])
def test_silu_mul(cp, prov, rng, dtype, split):
    g = (rng.standard_normal((3, 70)) * 2.5).astype(dtype)
    u = rng.standard_normal((3, 70)).astype(dtype)
    g64, u64 = g.astype(np.float64), u.astype(np.float64)
    want = g64 / (1.0 + np.exp(-g64)) * u64
    inputs = [np.concatenate([g, u], -1)] if split else [g, u]
    kw = dict(attrs={"split": split}, opset=1, domain=GENRT_DOMAIN)
    (got,) = run_op(cp, prov, "SiluMul", inputs, [want.astype(dtype)], **kw)
    assert_close(got, want, scale=max(1.0, float(np.abs(want).max())))


# ----------------------------------------------------------------------------- normalization


def _rms_ref(x, scale, eps, axis=-1):
    axes = tuple(range(axis % x.ndim, x.ndim))
    x = x.astype(np.float64)
    inv = 1.0 / np.sqrt(np.mean(x * x, axis=axes, keepdims=True) + eps)
    return x * inv * scale.astype(np.float64), inv


@pytest.mark.parametrize(
    "x_dtype,s_dtype", [(np.float32,) * 2, (np.float16,) * 2, (np.float16, np.float32)]
)
def test_rms_normalization(cp, prov, rng, x_dtype, s_dtype):
    x = (rng.standard_normal((3, 5, 896)) * 4).astype(x_dtype)
    scale = rng.uniform(0.5, 1.5, 896).astype(s_dtype)
    want, _ = _rms_ref(x, scale, 1e-6)
    (got,) = run_op(
        cp,
        prov,
        "RMSNormalization",
        [x, scale],
        [want.astype(s_dtype)],
        opset=23,
        attrs={"epsilon": 1e-6},
    )
    assert got.dtype == s_dtype
    assert_close(got, want, scale=4)


def test_rms_normalization_over_two_axes(cp, prov, rng):
    x = rng.standard_normal((3, 4, 16)).astype(np.float32)
    scale = rng.uniform(0.5, 1.5, (4, 16)).astype(np.float32)
    want, _ = _rms_ref(x, scale, 1e-5, axis=1)
    (got,) = run_op(
        cp,
        prov,
        "RMSNormalization",
        [x, scale],
        [want.astype(np.float32)],
        opset=23,
        attrs={"axis": 1},
    )
    assert_close(got, want)


@pytest.mark.parametrize("dtype", FLOATS)
def test_simplified_layer_normalization_with_inv_std(cp, prov, rng, dtype):
    x = rng.standard_normal((2, 7, 64)).astype(dtype)
    scale = rng.uniform(0.5, 1.5, 64).astype(dtype)
    want, inv = _rms_ref(x, scale, 1e-5)
    got, got_inv = run_op(
        cp,
        prov,
        "SimplifiedLayerNormalization",
        [x, scale],
        [want.astype(dtype), inv.astype(np.float32)],
        opset=1,
    )
    assert_close(got, want)
    assert_close(got_inv, inv, np.float32)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("with_bias,n_out", [(True, 3), (False, 1), (True, 1)])
def test_layer_normalization(cp, prov, rng, dtype, with_bias, n_out):
    x = (rng.standard_normal((4, 3, 200)) + 0.7).astype(dtype)
    scale = rng.uniform(0.5, 1.5, 200).astype(dtype)
    bias = rng.standard_normal(200).astype(dtype)
    xd = x.astype(np.float64)
    mean = xd.mean(axis=-1, keepdims=True)
    inv = 1.0 / np.sqrt(((xd - mean) ** 2).mean(axis=-1, keepdims=True) + 1e-5)
    want = (xd - mean) * inv * scale.astype(np.float64) + (
        bias.astype(np.float64) if with_bias else 0
    )
    inputs = [x, scale, bias] if with_bias else [x, scale]
    expected = [want.astype(dtype), mean.astype(np.float32), inv.astype(np.float32)][:n_out]
    got = run_op(cp, prov, "LayerNormalization", inputs, expected, opset=17)
    assert_close(got[0], want, scale=2)
    if n_out == 3:
        assert_close(got[1], mean, np.float32)
        assert_close(got[2], inv, np.float32)


# ----------------------------------------------------------------------------- MatMul


def _matmul_case(rng, a_shape, b_shape, dtype):
    k = a_shape[-1]
    a = rng.standard_normal(a_shape).astype(dtype)
    b = (rng.standard_normal(b_shape) / math.sqrt(k)).astype(dtype)
    return a, b, np.matmul(a.astype(np.float64), b.astype(np.float64))


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize(
    "kn", [(896, 4864), (4864, 896), (33, 17), (1000, 129), (128, 151936 // 8)]
)
@pytest.mark.parametrize("m", [1, 4, 5, 16, 17, 64])
def test_matmul(cp, prov, rng, m, kn, dtype):
    k, n = kn
    a, b, want = _matmul_case(rng, (m, k), (k, n), dtype)
    (got,) = run_op(cp, prov, "MatMul", [a, b], [want.astype(dtype)])
    assert_close(got, want, scale=2)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize(
    "a_shape,b_shape",
    [
        ((2, 3, 256), (256, 72)),  # leading dims fold into M = 6
        ((2, 4, 64), (2, 64, 40)),  # batched B, same batch dims
        ((256,), (256, 96)),  # 1-D A
        ((5, 256), (256,)),  # 1-D B
        ((3, 1, 2, 64), (3, 1, 64, 8)),
        ((2, 40, 64), (64, 24)),  # M = 80: cuBLAS
        ((3, 2, 64), (1, 64, 8)),  # broadcast batch: cuBLAS
    ],
)
def test_matmul_shapes(cp, prov, rng, a_shape, b_shape, dtype):
    a, b, want = _matmul_case(rng, a_shape, b_shape, dtype)
    (got,) = run_op(cp, prov, "MatMul", [a, b], [want.astype(dtype)])
    assert_close(got, want, scale=2)


@pytest.mark.parametrize("dtype", FLOATS)
def test_matmul_misaligned_weight(cp, prov, rng, dtype):
    """B starting one element past an aligned address takes the scalar-load path."""
    a, b, want = _matmul_case(rng, (3, 96), (96, 64), dtype)
    with prov.stream:
        raw = cp.empty(b.size + 1, dtype)
    raw[1:].set(b.reshape(-1), stream=prov.stream)
    dev_b = raw[1:].reshape(b.shape)
    assert dev_b.data.ptr % 16 != 0
    with prov.stream:
        buf = _poison(cp, want.shape, dtype)
    (res,) = launch(prov, node("MatMul", 2), [prov.as_array(a), dev_b], [buf])
    assert res is buf
    assert_close(prov.to_numpy(res), want, scale=2)


def test_skinny_config_fills_the_gpu():
    from onnx_genrt.providers.cuda.kernels.matmul import skinny_config

    for m, k, n, item in [
        (1, 896, 4864, 2),
        (1, 4864, 896, 2),
        (16, 896, 151936, 4),
        (5, 33, 17, 2),
        (16, 4864, 896, 2),
    ]:
        mt, groups, v, tx, splits, k_chunk = skinny_config(item, m, k, n, 1, 0, 0, 132)
        assert mt * groups >= m and mt <= 4 and n % v == 0 and 256 % tx == 0
        assert 256 // (mt * v * tx) <= 32  # lanes sharing one sum fit a warp
        assert splits * k_chunk >= k and (splits - 1) * k_chunk < k
    assert skinny_config(2, 1, 4864, 896, 1, 0, 0, 132)[4] > 1  # few columns: split K
    assert skinny_config(4, 16, 896, 151936, 1, 0, 0, 132)[4] == 1
    assert skinny_config(2, 1, 896, 4864, 1, 2, 0, 132)[2] == 1  # misaligned B: scalar loads


# ----------------------------------------------------------------------------- graph slots


class _Seq:
    """A few kernels on preallocated buffers: x[M, K] -> MatMul -> Sigmoid*h -> RMSNorm -> Softmax."""

    def __init__(self, cp, prov, rng, m, k, n, dtype=np.float16):
        self.prov, self.m, self.dtype = prov, m, dtype
        self.w = (rng.standard_normal((k, n)) / math.sqrt(k)).astype(dtype)
        self.scale = rng.uniform(0.5, 1.5, n).astype(dtype)
        dw, ds = prov.as_array(self.w), prov.as_array(self.scale)
        with prov.stream:
            self.x = cp.zeros((m, k), dtype)
            h, s, g, y, self.p = (cp.empty((m, n), dtype) for _ in range(5))
        self.steps = [
            (node("MatMul", 2), [self.x, dw], h),
            (node("Sigmoid", 1), [h], s),
            (node("Mul", 2), [h, s], g),
            (node("RMSNormalization", 2, attrs={"epsilon": 1e-6}, opset=23), [g, ds], y),
            (node("Softmax", 1, opset=13), [y], self.p),
        ]

    def run(self):
        for info, ins, buf in self.steps:
            (res,) = launch(self.prov, info, ins, [buf])
            assert res is buf

    def write(self, host):
        self.x.set(host.astype(self.dtype), stream=self.prov.stream)

    def reference(self, host):
        h = host.astype(self.dtype).astype(np.float64) @ self.w.astype(np.float64)
        g = h / (1 + np.exp(-h))  # h * sigmoid(h)
        y, _ = _rms_ref(g, self.scale, 1e-6)
        return _softmax(y)

    def check(self, host):
        got = self.prov.to_numpy(self.p).astype(np.float64)
        np.testing.assert_allclose(got, self.reference(host), rtol=2e-2, atol=2e-3)


def test_graph_slots_capture_and_replay_independently(cp, fresh, rng):
    prov = fresh
    # K=2048, N=256: few column tiles, so both slots split K and share the provider's scratch.
    dec = _Seq(cp, prov, rng, 1, 2048, 256)
    ver = _Seq(cp, prov, rng, 4, 2048, 256)
    for seq in (dec, ver):  # eager first: compiles every kernel outside the capture
        host = rng.standard_normal(seq.x.shape)
        seq.write(host)
        seq.run()
        seq.check(host)
    for slot, seq in ((PRIMARY, dec), (VERIFY, ver)):
        with prov.stream:
            seq.p.fill(np.nan)
        prov.begin_capture(slot)
        seq.run()
        prov.end_capture(slot)
        assert prov.has_graph(slot) and prov.capture_error(slot) is None
        prov.synchronize()
        assert np.isnan(prov.to_numpy(seq.p)).all(), "capture must record, not run"
    assert not prov.has_graph(DRAFT)
    assert prov.workspace.capacity > 0, "expected split-K to use the scratch workspace"
    for _ in range(4):
        hd, hv = rng.standard_normal(dec.x.shape), rng.standard_normal(ver.x.shape)
        dec.write(hd)
        prov.replay(PRIMARY)
        dec.check(hd)
        ver.write(hv)
        prov.replay(VERIFY)
        ver.check(hv)
        # Both written first, then both replayed: each graph reads only its own buffers.
        hd, hv = rng.standard_normal(dec.x.shape), rng.standard_normal(ver.x.shape)
        dec.write(hd)
        ver.write(hv)
        prov.replay(VERIFY)
        prov.replay(PRIMARY)
        dec.check(hd)
        ver.check(hv)
    prov.reset_graph(VERIFY)
    assert not prov.has_graph(VERIFY) and prov.has_graph(PRIMARY)
    with pytest.raises(GraphCaptureError):
        prov.replay(VERIFY)
    hd = rng.standard_normal(dec.x.shape)
    dec.write(hd)
    prov.replay(PRIMARY)
    dec.check(hd)


@pytest.fixture
def no_cublas_in_graphs(cp):
    """A provider of its own with ``cublas_in_graphs`` off: MatMul above 64 rows takes
    CuPy's cuBLAS, which refuses stream capture."""
    from onnx_genrt.providers.cuda.provider import CUDAProvider

    p = CUDAProvider(cublas_in_graphs=False)
    yield p
    for slot in DeviceGraphSlot:
        p.reset_graph(slot)


def test_cublas_in_capture_latches_only_its_slot(cp, no_cublas_in_graphs, rng):
    """With ``cublas_in_graphs`` off (test_cuda_cublas.py has it on)."""
    from onnx_genrt.providers.cuda.kernels._common import CaptureUnsupported

    prov = no_cublas_in_graphs
    a, b, want = _matmul_case(rng, (64, 128), (128, 256), np.float16)
    da, db = prov.as_array(a), prov.as_array(b)
    with prov.stream:
        c = cp.empty(want.shape, np.float16)
    info = node("MatMul", 2)
    launch(prov, info, [da, db], [c])  # eager (cuBLAS) works
    assert_close(prov.to_numpy(c), want, scale=2)

    prov.begin_capture(VERIFY)
    with pytest.raises(CaptureUnsupported, match="cublas_in_graphs is off"):
        launch(prov, info, [da, db], [c])
    prov.abort_capture(VERIFY, "MatMul M=64 needs cuBLAS")
    assert prov.capturing is None
    assert prov.capture_error(VERIFY) == "MatMul M=64 needs cuBLAS"
    with pytest.raises(GraphCaptureError, match="latched"):
        prov.begin_capture(VERIFY)

    # CuPy itself refuses cuBLAS inside a capture (the reason for the skinny kernel).
    prov.begin_capture(DRAFT)
    with pytest.raises(Exception), prov.stream:  # noqa: B017  (CuPy's NotImplementedError)
        cp.matmul(da, db, out=c)
    prov.abort_capture(DRAFT, "cupy.matmul refused")
    assert prov.capture_error(DRAFT) == "cupy.matmul refused"

    # PRIMARY is untouched: it captures and replays an M=1 step.
    dec = _Seq(cp, prov, rng, 1, 128, 256)
    host = rng.standard_normal(dec.x.shape)
    dec.write(host)
    dec.run()
    prov.begin_capture(PRIMARY)
    dec.run()
    prov.end_capture(PRIMARY)
    host = rng.standard_normal(dec.x.shape)
    dec.write(host)
    prov.replay(PRIMARY)
    dec.check(host)
    assert prov.capture_error(PRIMARY) is None

    # Resetting VERIFY clears its latch; an M=4 step then captures there.
    prov.reset_graph(VERIFY)
    assert prov.capture_error(VERIFY) is None
    ver = _Seq(cp, prov, rng, 4, 128, 256)
    host = rng.standard_normal(ver.x.shape)
    ver.write(host)
    ver.run()
    prov.begin_capture(VERIFY)
    ver.run()
    prov.end_capture(VERIFY)
    host = rng.standard_normal(ver.x.shape)
    ver.write(host)
    prov.replay(VERIFY)
    ver.check(host)
    assert prov.capture_error(DRAFT) == "cupy.matmul refused"


# ----------------------------------------------------------------------------- sessions


def mlp_model(hidden=64, inter=192, vocab=100, dtype=np.float32, seed=0):
    """x -> MatMul+Add -> SiLU (Sigmoid, Mul) -> MatMul -> +x -> RMSNorm -> MatMul -> Softmax."""
    rng = np.random.default_rng(seed)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))

    def init(name, shape, scale):
        return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(dtype), name)

    inits = [
        init("w1", (hidden, inter), 1 / math.sqrt(hidden)),
        init("b1", (inter,), 0.1),
        init("w2", (inter, hidden), 1 / math.sqrt(inter)),
        numpy_helper.from_array(rng.uniform(0.5, 1.5, hidden).astype(dtype), "scale"),
        init("w3", (hidden, vocab), 1 / math.sqrt(hidden)),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h0"], name="mm1"),
        helper.make_node("Add", ["h0", "b1"], ["h1"], name="bias"),
        helper.make_node("Sigmoid", ["h1"], ["s"], name="sig"),
        helper.make_node("Mul", ["h1", "s"], ["g"], name="silu"),
        helper.make_node("MatMul", ["g", "w2"], ["o"], name="mm2"),
        helper.make_node("Add", ["o", "x"], ["r"], name="residual"),
        helper.make_node("RMSNormalization", ["r", "scale"], ["n"], name="norm", epsilon=1e-6),
        helper.make_node("MatMul", ["n", "w3"], ["logits"], name="lm_head"),
        helper.make_node("Softmax", ["logits"], ["p"], name="softmax", axis=-1),
    ]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", elem, ["batch", hidden])],
        [
            helper.make_tensor_value_info("p", elem, ["batch", vocab]),
            helper.make_tensor_value_info("n", elem, ["batch", hidden]),
        ],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])


def mlp_reference(model, x):
    w = {i.name: numpy_helper.to_array(i).astype(np.float64) for i in model.graph.initializer}
    xd = x.astype(np.float64)
    h = xd @ w["w1"] + w["b1"]
    g = h / (1 + np.exp(-h))
    n, _ = _rms_ref(g @ w["w2"] + xd, w["scale"], 1e-6)
    return _softmax(n @ w["w3"]), n


def _bind(cp, sess, rows, hidden, vocab, dtype):
    prov = sess.main_provider
    binding = sess.io_binding()
    with prov.stream:
        x = binding.bind_input("x", cp.zeros((rows, hidden), dtype))
    p = binding.bind_output("p", shape=(rows, vocab), dtype=dtype)
    n = binding.bind_output("n", shape=(rows, hidden), dtype=dtype)
    return binding, x, p, n


@pytest.mark.parametrize("dtype", FLOATS)
def test_session_primary_and_verify_interleaved(cp, rng, dtype):
    from onnx_genrt.session import InferenceSession

    hidden, vocab = 64, 100
    model = mlp_model(hidden=hidden, vocab=vocab, dtype=dtype)
    sess = InferenceSession(model, providers=["cuda"])
    assert sess.get_providers() == ["cuda"]
    prov = sess.main_provider
    cpu_cls = _cpu_kernels_or_none() if dtype == np.float32 else None
    cpu = InferenceSession(model, providers=[cpu_cls()]) if cpu_cls else None
    tol = dict(rtol=2e-2, atol=2e-3) if dtype == np.float16 else dict(rtol=1e-4, atol=1e-5)
    slots = {
        PRIMARY: _bind(cp, sess, 1, hidden, vocab, dtype),
        VERIFY: _bind(cp, sess, 4, hidden, vocab, dtype),
    }
    for _ in range(6):
        for slot, (binding, x, p, n) in slots.items():
            host = rng.standard_normal(x.shape).astype(dtype)
            x.set(host, stream=prov.stream)
            sess.run_with_iobinding(binding, slot)
            got_p, got_n = prov.to_numpy(p).copy(), prov.to_numpy(n).copy()
            want_p, want_n = mlp_reference(model, host)
            np.testing.assert_allclose(got_p.astype(np.float64), want_p, **tol)
            np.testing.assert_allclose(
                got_n.astype(np.float64), want_n, rtol=tol["rtol"], atol=10 * tol["atol"]
            )
            if cpu is not None:
                cpu_p, cpu_n = cpu.run(["p", "n"], {"x": host})
                np.testing.assert_allclose(got_p, cpu_p, rtol=1e-4, atol=1e-6)
                np.testing.assert_allclose(got_n, cpu_n, rtol=1e-4, atol=1e-5)
    for slot in (PRIMARY, VERIFY):
        stats = sess.graph_stats(slot)
        assert stats.captures == 1, (slot, stats)
        assert stats.replays > 0 and stats.invalidations == 0, (slot, stats)
        assert stats.fallbacks == 0, (slot, dict(stats.fallback_reasons))
        assert prov.has_graph(slot)
    # Eager host-feed runs go through the same kernels (and Executor.run's CuPy path).
    host = rng.standard_normal((3, hidden)).astype(dtype)
    got_p, got_n = sess.run(["p", "n"], {"x": host})
    want_p, _ = mlp_reference(model, host)
    np.testing.assert_allclose(got_p.astype(np.float64), want_p, **tol)
    if cpu_cls is None and dtype == np.float32:
        pytest.skip("CPU provider does not import here (Numba?); compared with numpy only")


def test_session_large_m_falls_back_to_eager_with_reason(cp, rng):
    """With ``cublas_in_graphs`` off (on, the step replays: test_cuda_cublas.py)."""
    from onnx_genrt.providers.cuda.kernels.matmul import PIECES_MAX_M
    from onnx_genrt.session import InferenceSession

    hidden, vocab = 64, 100
    model = mlp_model(hidden=hidden, vocab=vocab)
    sess = InferenceSession(model, providers=[("cuda", {"cublas_in_graphs": False})])
    assert sess.graph_max_rows == PIECES_MAX_M
    prov = sess.main_provider
    # above the rows the prepacked GEMV runs in capturable pieces: CuPy's cuBLAS, which
    # refuses a capture
    binding, x, p, _ = _bind(cp, sess, PIECES_MAX_M + 1, hidden, vocab, np.float32)
    for _ in range(4):
        host = rng.standard_normal(x.shape).astype(np.float32)
        x.set(host, stream=prov.stream)
        sess.run_with_iobinding(binding, VERIFY)
        np.testing.assert_allclose(
            prov.to_numpy(p), mlp_reference(model, host)[0], rtol=1e-4, atol=1e-5
        )
    stats = sess.graph_stats(VERIFY)
    assert stats.captures == 0 and stats.replays == 0 and stats.fallbacks >= 1
    reasons = " ".join(stats.fallback_reasons)
    assert "cuBLAS" in reasons, reasons
    assert prov.capture_error(VERIFY) and prov.capture_error(PRIMARY) is None


def test_eager_vs_replay_host_time_per_step(cp, rng):
    """Prints host time per bound step, eager against replay (no timing asserts)."""
    from onnx_genrt.session import InferenceSession
    from onnx_genrt.tools import dispatch_bench

    hidden, vocab = 896, 1000
    model = mlp_model(hidden=hidden, inter=4864, vocab=vocab, dtype=np.float16)
    times, probs = {}, {}
    host = rng.standard_normal((1, hidden)).astype(np.float16)
    for graphs in (False, True):
        sess = InferenceSession(model, providers=["cuda"], enable_graphs=graphs)
        prov = sess.main_provider
        binding, x, p, _ = _bind(cp, sess, 1, hidden, vocab, np.float16)
        x.set(host, stream=prov.stream)
        for _ in range(3):
            sess.run_with_iobinding(binding, PRIMARY)
        prov.synchronize()
        steps = 200
        start = time.perf_counter()
        for _ in range(steps):
            sess.run_with_iobinding(binding, PRIMARY)
        prov.synchronize()
        times[graphs] = (time.perf_counter() - start) / steps * 1e6
        assert sess.graph_stats(PRIMARY).captures == (1 if graphs else 0)
        probs[graphs] = prov.to_numpy(p).copy()
    # The down projection (K=4864, N=896) splits K: replayed and eager results agree.
    np.testing.assert_array_equal(probs[True], probs[False])
    want_p, _ = mlp_reference(model, host)
    np.testing.assert_allclose(probs[True].astype(np.float64), want_p, rtol=5e-2, atol=2e-3)
    nodes = len(model.graph.node)
    print(
        f"\nMLP step ({nodes} nodes, fp16, hidden {hidden}, inter 4864, M=1): "
        f"eager {times[False]:.1f} us, replay {times[True]:.1f} us, "
        f"{times[False] / times[True]:.1f}x"
    )
    result = dispatch_bench.measure("cuda", nodes=100, repeats=20)
    print(dispatch_bench.format_table([result]))
    assert result.replay_us_per_node > 0


@pytest.mark.parametrize("dtype", FLOATS)
def test_exporter_style_head_fuses_and_replays(cp, rng, dtype):
    """Residual Add + decomposed RMSNorm -> SkipSimplifiedLayerNormalization, and ArgMax +
    ReduceMax(Softmax) -> ArgMaxProb, on CUDA: eager and replayed against float64."""
    from onnx_genrt.session import InferenceSession
    from tests.models import decomposed_head, decomposed_head_reference

    model = decomposed_head(dtype=dtype, seed=4)
    sess = InferenceSession(model, providers=["cuda"])
    prov = sess.main_provider
    ops = [s.node.op_type for s in sess.plan.steps]
    norm_and_head = ["NormMatMul"]  # the norm fused into the head's GEMV
    if not prov.gemv_prologues:
        norm_and_head = ["SkipSimplifiedLayerNormalization", "MatMul"]
    assert ops == [*norm_and_head, "ArgMaxProb"], ops
    binding = sess.io_binding()
    with prov.stream:
        a_dev = binding.bind_input("a", cp.zeros((1, 2, 24), dtype))
        b_dev = binding.bind_input("b", cp.zeros((1, 2, 24), dtype))
    draft = binding.bind_output("draft", shape=(1, 2), dtype=np.int64)
    conf = binding.bind_output("confidence", shape=(1, 2), dtype=dtype)
    rtol = 2e-2 if dtype == np.float16 else 1e-4
    checked = 0
    for step in range(5):
        a, b = (rng.standard_normal((1, 2, 24)).astype(dtype) for _ in range(2))
        logits, want_draft, want_conf = decomposed_head_reference(model, a, b)
        if step == 0:
            got_draft, got_conf = sess.run(None, {"a": a, "b": b})
        else:
            with prov.stream:
                cp.copyto(draft, cp.full((1, 2), -7, np.int64))  # poisoned before each run
                cp.copyto(conf, cp.full((1, 2), np.nan, dtype))
            a_dev.set(a, stream=prov.stream)
            b_dev.set(b, stream=prov.stream)
            sess.run_with_iobinding(binding, PRIMARY)
            got_draft, got_conf = prov.to_numpy(draft).copy(), prov.to_numpy(conf).copy()
        np.testing.assert_allclose(got_conf.astype(np.float64), want_conf, rtol=rtol, atol=1e-4)
        top2 = np.sort(logits, axis=-1)[..., -2:]
        if np.all(top2[..., 1] - top2[..., 0] > 0.05):  # a clear winner: same pick
            np.testing.assert_array_equal(got_draft, want_draft)
            checked += 1
    assert checked >= 2
    stats = sess.graph_stats(PRIMARY)
    assert stats.replays > 0 and stats.fallbacks == 0, (stats, dict(stats.fallback_reasons))
