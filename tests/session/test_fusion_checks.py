"""What the planner's fusions (``session.fusion``) refuse to fuse and what they write (found by
a mutation run: look-alike patterns, steps on another provider, the fused nodes' names and
versions had no test). Every model is run by onnxruntime as written, the reference; a
pattern that must stay unfused is checked in the plan and in the values."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_genrt.core.genrt_ops import check_node, expand
from onnx_genrt.core.kernels import GENRT_DOMAIN, KernelRegistry
from onnx_genrt.providers.cpu.kernels import REGISTRY
from onnx_genrt.providers.cpu.provider import CPUProvider
from onnx_genrt.session import InferenceSession

F = TensorProto.FLOAT


def _model(nodes, inputs: dict, outputs: dict, inits: dict | None = None, opset: int = 18):
    """A float model: ``inputs`` / ``outputs`` map names to shapes, ``inits`` to arrays."""
    graph = helper.make_graph(
        nodes,
        "fusion",
        [helper.make_tensor_value_info(n, F, s) for n, s in inputs.items()],
        [helper.make_tensor_value_info(n, F, s) for n, s in outputs.items()],
        [numpy_helper.from_array(v, n) for n, v in (inits or {}).items()],
    )
    opsets = [helper.make_opsetid("", opset), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets)


def _feeds(model: onnx.ModelProto, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {}
    for value in model.graph.input:
        shape = [d.dim_value for d in value.type.tensor_type.shape.dim]
        feeds[value.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def _ops(sess: InferenceSession) -> list[str]:
    return [s.node.op_type for s in sess.plan.steps]


def _check_against_onnxruntime(model: onnx.ModelProto, providers=None) -> InferenceSession:
    """A session of ``model`` whose every output equals onnxruntime's on the same feeds."""
    sess = InferenceSession(model, providers)
    feeds = _feeds(model)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in model.graph.output]
    for name, got, ref in zip(names, sess.run(names, feeds), want.run(names, feeds), strict=True):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5, err_msg=name)
    return sess


# -- SiluMul: Mul(Mul(g, Sigmoid(g)), u) ----------------------------------------------------


@pytest.mark.parametrize(
    "gate",
    [
        helper.make_node("Tanh", ["g"], ["s"]),  # g * tanh(g) * u: another activation
        helper.make_node("Sigmoid", ["h"], ["s"]),  # g * sigmoid(h) * u: another operand
    ],
    ids=["tanh", "sigmoid-of-another-value"],
)
def test_a_gate_that_is_not_sigmoid_of_its_own_operand_stays_unfused(gate):
    nodes = [
        gate,
        helper.make_node("Mul", ["g", "s"], ["a"]),
        helper.make_node("Mul", ["a", "u"], ["y"]),
    ]
    shape = [2, 8]
    model = _model(nodes, {"g": shape, "h": shape, "u": shape}, {"y": shape})
    sess = _check_against_onnxruntime(model)
    assert _ops(sess) == [gate.op_type, "Mul", "Mul"]


class OneOp(CPUProvider):
    """A partial provider with one standard op: placed first, it holds every node of it."""

    def __init__(self, op: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.op = op
        self.name = f"{op.lower()}-only"

    @property
    def kernels(self) -> KernelRegistry:
        reg = KernelRegistry()
        reg.add(REGISTRY.lookup("", self.op, 18))
        return reg


def test_a_silu_whose_sigmoid_runs_on_another_provider_stays_unfused():
    """The fusion happens only when the three steps run on one provider: the fused step would
    take the Sigmoid off the provider placement gave it."""
    nodes = [
        helper.make_node("Sigmoid", ["g"], ["s"], name="sig"),
        helper.make_node("Mul", ["g", "s"], ["a"], name="act"),
        helper.make_node("Mul", ["a", "u"], ["y"], name="gated"),
    ]
    model = _model(nodes, {"g": [2, 8], "u": [2, 8]}, {"y": [2, 8]})
    sess = _check_against_onnxruntime(model, [OneOp("Sigmoid"), "cpu"])
    placed = [(p.node, p.provider) for p in sess.placement()]
    assert placed == [("sig", "sigmoid-only"), ("act", "cpu"), ("gated", "cpu")]


# -- gate and up projections merged into one ------------------------------------------------


def _gated(gate: onnx.NodeProto, up: onnx.NodeProto, inits: dict, shape=(8, 8)):
    """silu(gate) * up: gate and up (writing g and u) read x, x2 or constants."""
    nodes = [
        gate,
        up,
        helper.make_node("Sigmoid", ["g"], ["s"], name="sig"),
        helper.make_node("Mul", ["g", "s"], ["a"], name="act"),
        helper.make_node("Mul", ["a", "u"], ["y"], name="gated"),
    ]
    return _model(nodes, {"x": list(shape), "x2": list(shape)}, {"y": None}, inits)


def _weights(*names: str, shape=(8, 8), seed: int = 3) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: (rng.standard_normal(shape) / 3).astype(np.float32) for n in names}


@pytest.mark.parametrize(
    ("gate", "up", "weights"),
    [
        (("MatMul", ["x", "wg"]), ("MatMul", ["x2", "wu"]), (8, 8)),  # two inputs
        (("MatMul", ["x", "wg"]), ("MatMul", ["x", "x2"]), (8, 8)),  # up's weights fed
        (("MatMul", ["x", "wg"]), ("MatMul", ["x", "wu"]), (2, 8, 8)),  # batched weights
        (("MatMul", ["x", "wg"]), ("MatMul", ["x", "wu"]), (8,)),  # vector weights
        (("Add", ["x", "wg"]), ("Add", ["x", "wu"]), (8, 8)),  # not projections
        (("MatMul", ["x", "wg"]), ("Add", ["x", "wu"]), (8, 8)),  # two different ops
        (("BiasGelu", ["x", "wg"]), ("BiasGelu", ["x", "wu"]), (8,)),  # not MatMulNBits
    ],
    ids=[
        "two-inputs",
        "fed-weights",
        "3-d-weights",
        "1-d-weights",
        "adds",
        "matmul-and-add",
        "bias-gelu",
    ],
)
def test_gate_and_up_that_are_not_two_projections_of_one_input_stay_apart(gate, up, weights):
    """Only MatMul pairs on 2-D weights or MatMulNBits pairs, reading one input, merge: a
    pair that looks alike in every other way keeps its two steps."""
    ms = "com.microsoft"
    nodes = [
        helper.make_node(op, ins, [out], name=name, domain=ms if op == "BiasGelu" else "")
        for (op, ins), out, name in ((gate, "g", "gate"), (up, "u", "up"))
    ]
    sess = _check_against_onnxruntime(_gated(*nodes, _weights("wg", "wu", shape=weights)))
    assert _ops(sess) == [gate[0], up[0], "SiluMul"]
    assert "wg" in sess.plan.constants and ("wu" in sess.plan.constants or up[1][1] == "x2")


@pytest.mark.parametrize("reader", ["output", "node"])
def test_gate_and_up_whose_outputs_are_read_elsewhere_stay_apart(reader):
    """Merged, the gate's and up's own outputs would no longer exist."""
    nodes = [
        helper.make_node("MatMul", ["x", "wg"], ["g"], name="gate"),
        helper.make_node("MatMul", ["x", "wu"], ["u"], name="up"),
    ]
    model = _gated(*nodes, _weights("wg", "wu"))
    if reader == "node":
        model.graph.node.append(helper.make_node("Neg", ["u"], ["z"]))
        model.graph.output.append(helper.make_tensor_value_info("z", F, None))
    else:
        model.graph.output.append(helper.make_tensor_value_info("u", F, None))
    sess = _check_against_onnxruntime(model)
    assert _ops(sess)[:3] == ["MatMul", "MatMul", "SiluMul"]


class UpOnly(CPUProvider):
    """A partial provider that runs one MatMul, the node named 'up'."""

    name = "up-only"

    @property
    def kernels(self) -> KernelRegistry:
        kdef = REGISTRY.lookup("", "MatMul", 13)

        def only_up(node, types):
            return None if node.name == "up" else "only the node named 'up'"

        reg = KernelRegistry()
        reg.add(type(kdef)(kdef.domain, kdef.op_type, kdef.since, kdef.fn, only_up))
        return reg


def test_gate_and_up_on_two_providers_stay_apart():
    nodes = [
        helper.make_node("MatMul", ["x", "wg"], ["g"], name="gate"),
        helper.make_node("MatMul", ["x", "wu"], ["u"], name="up"),
    ]
    sess = _check_against_onnxruntime(_gated(*nodes, _weights("wg", "wu")), [UpOnly(), "cpu"])
    placed = [(p.node, p.provider) for p in sess.placement()]
    assert placed[:2] == [("gate", "cpu"), ("up", "up-only")]
    assert _ops(sess) == ["MatMul", "MatMul", "SiluMul"]


def _nbits(
    name: str, out: str, x: str, k: int, n: int, rng, *, zp: bool | str, flat: bool, **attrs
):
    """(MatMulNBits node, its initializers): 4-bit, block 16, ``n`` x ``k``; scales and zero
    points as [N, blocks] or flattened; ``zp="float"``: zero points of the scales' type."""
    block = int(attrs.pop("block_size", 16))
    blocks = k // block
    q = rng.integers(0, 16, (n, blocks, block))
    inits = {
        f"{name}_B": (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8),
        f"{name}_s": rng.uniform(0.02, 0.06, (n, blocks)).astype(np.float32),
    }
    if zp == "float":
        inits[f"{name}_zp"] = rng.integers(0, 16, (n, blocks)).astype(np.float32)
    elif zp:
        zeros = rng.integers(0, 16, (n, blocks + blocks % 2))
        inits[f"{name}_zp"] = (zeros[:, 0::2] | (zeros[:, 1::2] << 4)).astype(np.uint8)
    if flat:
        inits = {key: v if key.endswith("_B") else v.reshape(-1) for key, v in inits.items()}
    inputs = [x, *inits]
    if "bias" in attrs:
        inits[f"{name}_bias"] = rng.standard_normal(n).astype(np.float32) * attrs.pop("bias")
        inputs += [""] * (5 - len(inputs)) + [f"{name}_bias"]
    node = helper.make_node(
        "MatMulNBits",
        inputs,
        [out],
        name=name,
        domain="com.microsoft",
        K=k,
        N=n,
        bits=4,
        block_size=block,
        **attrs,
    )
    return node, inits


def _nbits_gated(rng, gate: dict, up: dict, k: int = 32):
    g, g_inits = _nbits("gate", "g", "x", k, gate.pop("n", 16), rng, **gate)
    u, u_inits = _nbits("up", "u", "x", k, up.pop("n", 16), rng, **up)
    rest = [
        helper.make_node("Sigmoid", ["g"], ["s"], name="sig"),
        helper.make_node("Mul", ["g", "s"], ["a"], name="act"),
        helper.make_node("Mul", ["a", "u"], ["y"], name="gated"),
    ]
    return _model([g, u, *rest], {"x": [3, k]}, {"y": None}, {**g_inits, **u_inits})


@pytest.mark.parametrize("flat", [False, True], ids=["2-d-scales", "flat-scales"])
@pytest.mark.parametrize("zp", [False, True], ids=["no-zero-points", "zero-points"])
def test_matmul_nbits_gate_and_up_merge_into_one_projection(zp, flat):
    rng = np.random.default_rng(7)
    model = _nbits_gated(rng, {"zp": zp, "flat": flat}, {"zp": zp, "flat": flat})
    sess = _check_against_onnxruntime(model)
    assert _ops(sess) == ["MatMulNBits", "SiluMul"]
    proj = sess.plan.steps[0]
    assert proj.node.attrs["N"] == 32 and len(proj.inputs) == 3 + zp
    assert not any(n.startswith(("gate_", "up_")) for n in sess.plan.constants)


@pytest.mark.parametrize("nbits", [False, True], ids=["matmul", "matmul-nbits"])
@pytest.mark.parametrize(("n_gate", "n_up"), [(1, 16), (16, 1)])
def test_gate_and_up_of_two_widths_that_broadcast_stay_apart(n_gate, n_up, nbits):
    """silu(g) * u broadcasts a width of 1 against 16: merged, the split SiluMul got 17
    columns and failed at run time (a KernelError) on a model onnxruntime runs."""
    rng = np.random.default_rng(10)
    if nbits:
        common = {"zp": False, "flat": False}
        model = _nbits_gated(rng, {"n": n_gate, **common}, {"n": n_up, **common})
    else:
        nodes = [
            helper.make_node("MatMul", ["x", "wg"], ["g"], name="gate"),
            helper.make_node("MatMul", ["x", "wu"], ["u"], name="up"),
        ]
        inits = {**_weights("wg", shape=(8, n_gate)), **_weights("wu", shape=(8, n_up))}
        model = _gated(*nodes, inits)
    sess = _check_against_onnxruntime(model)
    assert _ops(sess)[:3] == [sess.plan.steps[0].node.op_type] * 2 + ["SiluMul"]


@pytest.mark.parametrize(
    ("gate", "up"),
    [
        ({"block_size": 32}, {}),  # another block size
        ({"accuracy_level": 4}, {}),  # another accuracy level
        ({"bias": 1.0}, {"bias": 1.0}),  # a bias (input 5)
        ({"zp": True}, {}),  # zero points on one only: other inputs
        ({"zp": True, "flat": True}, {"zp": "float", "flat": True}),  # zero points' types
    ],
    ids=["block-size", "accuracy-level", "bias", "zero-points-on-one", "zero-point-types"],
)
def test_matmul_nbits_gate_and_up_that_differ_stay_apart(gate, up):
    """Apart where their attributes or inputs differ (packed uint8 zero points and zero
    points of the scales' type cannot be concatenated: with one block per row, K 16, both
    have one element per row)."""
    rng = np.random.default_rng(8)
    k = 16 if up.get("zp") == "float" else 32
    model = _nbits_gated(
        rng, {"zp": False, "flat": False, **gate}, {"zp": False, "flat": False, **up}, k=k
    )
    sess = _check_against_onnxruntime(model)
    assert _ops(sess) == ["MatMulNBits", "MatMulNBits", "SiluMul"]


# -- ArgMax and ReduceMax(Softmax) into ArgMaxProb -------------------------------------------


def _pick(
    argmax: dict | None = None,
    softmax: str = "Softmax",
    softmax_axis: int = -1,
    reduce_keep: int = 0,
    outputs: tuple[str, ...] = (),
    opset: int = 18,
    ties: bool = False,
) -> onnx.ModelProto:
    """draft = ArgMax(logits), confidence = ReduceMax(Softmax(logits)) over the last axis of
    logits [2, 3, 10] (a constant: ``ties`` repeats each row's maximum)."""
    rng = np.random.default_rng(9)
    logits = rng.standard_normal((2, 3, 10)).astype(np.float32)
    if ties:
        logits[..., 7] = logits.max(axis=-1)
    argmax_attrs = {"axis": -1, "keepdims": 0, **(argmax or {})}
    argmax_attrs = {k: v for k, v in argmax_attrs.items() if v is not None}  # None: default
    reduce_inputs, reduce_attrs = ["probs"], {"keepdims": reduce_keep}
    inits = {"logits0": logits}
    if opset >= 18:
        reduce_inputs.append("last")
        inits["last"] = np.array([-1], np.int64)
    else:
        reduce_attrs["axes"] = [-1]
    nodes = [
        helper.make_node("Identity", ["logits0"], ["logits"]),
        helper.make_node("Add", ["logits", "x"], ["l"]),
        helper.make_node("ArgMax", ["l"], ["draft"], **argmax_attrs),
        helper.make_node(softmax, ["l"], ["probs"], axis=softmax_axis),
        helper.make_node("ReduceMax", reduce_inputs, ["confidence"], **reduce_attrs),
    ]
    graph = helper.make_graph(
        nodes,
        "pick",
        [helper.make_tensor_value_info("x", F, [1])],
        [
            helper.make_tensor_value_info("draft", TensorProto.INT64, None),
            helper.make_tensor_value_info("confidence", F, None),
            *(helper.make_tensor_value_info(n, F, None) for n in outputs),
        ],
        [numpy_helper.from_array(v, n) for n, v in inits.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def _pick_ops(model: onnx.ModelProto, providers=None) -> list[str]:
    sess = _check_against_onnxruntime(model, providers)
    return [op for op in _ops(sess) if op not in ("Identity", "Add")]


@pytest.mark.parametrize("opset", [13, 18])
def test_argmax_and_softmax_maximum_fuse_into_argmax_prob(opset):
    assert _pick_ops(_pick(opset=opset)) == ["ArgMaxProb"]


@pytest.mark.parametrize(
    "case",
    [
        {"argmax": {"select_last_index": 1}, "ties": True},
        {"argmax": {"keepdims": 1}},
        {"argmax": {"keepdims": None}},
        {"argmax": {"axis": None}},
        {"argmax": {"axis": 1}},
        {"reduce_keep": 1},
        {"softmax": "LogSoftmax"},
        {"softmax_axis": 1},
        {"outputs": ("probs",)},
    ],
    ids=[
        "argmax-last-index",
        "argmax-keepdims",
        "argmax-keepdims-by-default",
        "argmax-axis-0-by-default",
        "argmax-axis-1",
        "reducemax-keepdims",
        "log-softmax",
        "softmax-axis-1",
        "probabilities-an-output",
    ],
)
def test_a_pick_unlike_argmax_prob_stays_unfused(case):
    assert "ArgMaxProb" not in _pick_ops(_pick(**case))


def test_a_softmax_maximum_without_an_argmax_stays_unfused():
    model = _pick()
    del model.graph.node[2]  # the ArgMax
    del model.graph.output[0]
    assert _pick_ops(model) == ["Softmax", "ReduceMax"]


def test_an_argmax_on_another_provider_stays_unfused():
    assert _pick_ops(_pick(), [OneOp("ArgMax"), "cpu"]) == ["ArgMax", "Softmax", "ReduceMax"]


# -- the non-finite probe: ReduceSum(Sub(x, x)) -----------------------------------------------


def _probe(sub_inputs=("x", "x"), keepdims: int = 0, axes: list[int] | None = None):
    """``p = ReduceSum(x - x)`` (keepdims=0, every axis) beside ``y = x * 2``."""
    inits = {}
    reduce_inputs = ["d"]
    if axes is not None:
        inits["axes"] = np.array(axes, np.int64)
        reduce_inputs.append("axes")
    nodes = [
        helper.make_node("Sub", list(sub_inputs), ["d"]),
        helper.make_node("ReduceSum", reduce_inputs, ["p"], keepdims=keepdims),
        helper.make_node("Add", ["x", "x"], ["y"]),
    ]
    out_shape = [] if keepdims == 0 and axes is None else None
    model = _model(nodes, {"x": [2, 7], "x2": [2, 7]}, {"p": out_shape, "y": [2, 7]}, inits)
    return model


@pytest.mark.parametrize("bad", [None, np.nan, np.inf], ids=str)
def test_the_non_finite_probe_fuses_and_still_finds_what_is_not_finite(bad):
    model = _probe()
    sess = _check_against_onnxruntime(model)
    assert _ops(sess) == ["NonFinite", "Add"]
    x = np.random.default_rng(1).standard_normal((2, 7)).astype(np.float32)
    if bad is not None:
        x[1, 6] = bad
    p, y = sess.run(["p", "y"], {"x": x, "x2": x})
    np.testing.assert_array_equal(p, 0.0 if bad is None else np.nan)
    np.testing.assert_array_equal(y, x + x)


@pytest.mark.parametrize(
    "case", ["other operand", "keepdims", "axes", "difference read", "no kernel"]
)
def test_a_sum_unlike_the_non_finite_probe_stays_unfused(case):
    from tests.models import standard_ops_cpu

    providers = None
    if case == "other operand":
        model = _probe(sub_inputs=("x", "x2"))
    elif case == "keepdims":
        model = _probe(keepdims=1)
    elif case == "axes":
        model = _probe(axes=[1])
    elif case == "difference read":
        model = _probe()
        model.graph.output.append(helper.make_tensor_value_info("d", F, [2, 7]))
    else:
        model, providers = _probe(), [standard_ops_cpu()]
    sess = _check_against_onnxruntime(model, providers)
    assert _ops(sess) == ["Sub", "ReduceSum", "Add"]


# -- what every fusion writes: names and the onnx_genrt version ------------------------------


def _skip_norm(outputs: tuple[str, ...] = ("y",)) -> onnx.ModelProto:
    nodes = [
        helper.make_node("Add", ["a", "b"], ["r"]),
        helper.make_node(
            "SimplifiedLayerNormalization", ["r", "w"], list(outputs), axis=-1, epsilon=1e-5
        ),
    ]
    w = np.random.default_rng(4).standard_normal(16).astype(np.float32)
    return _model(nodes, {"a": [2, 3, 16], "b": [2, 3, 16]}, {"y": [2, 3, 16]}, {"w": w})


def _fusion_cases():
    """(model, providers, [(op, name) of each fused step]); a name's ``{out}`` is the name
    of the model's node that writes ``out``, or ``out`` itself where that node has none."""
    from tests.models import norm_projections, silu_projection
    from tests.session.test_norm_matmul_fusion import FusingCPU

    from .test_session import _decomposed_rms_norm

    gated = _gated(
        helper.make_node("MatMul", ["x", "wg"], ["g"]),
        helper.make_node("MatMul", ["x", "wu"], ["u"]),
        _weights("wg", "wu"),
    )
    yield gated, None, [("MatMul", "{g}/fused"), ("SiluMul", "{y}/SiluMul/fused")]
    yield (
        _decomposed_rms_norm("reciprocal"),
        None,
        [("SimplifiedLayerNormalization", "{y}/RMSNorm")],
    )
    yield _skip_norm(), None, [("SkipSimplifiedLayerNormalization", "{y}/SkipRMSNorm")]
    yield _pick(), None, [("ArgMaxProb", "{confidence}/ArgMaxProb")]
    yield _probe(), None, [("NonFinite", "{p}/NonFinite")]
    fused = [
        ("NormMatMul", "{p1}/NormMatMul"),
        ("NormMatMul", "{p2}/NormMatMul"),
        ("NormMatMulNBits", "{z}/NormMatMulNBits"),
    ]
    yield norm_projections(), [FusingCPU()], fused
    fused = [("MatMul", "{g}/fused"), ("SiluMulMatMulNBits", "{y}/SiluMulMatMulNBits")]
    yield silu_projection(), [FusingCPU()], fused
    unsplit = _silu_then(helper.make_node("MatMul", ["m", "w3"], ["y"]), up_input="x2")
    yield unsplit, [FusingCPU()], [("SiluMulMatMul", "{y}/SiluMulMatMul")]


@pytest.mark.parametrize("named", [True, False], ids=["named-nodes", "unnamed-nodes"])
def test_fused_steps_are_named_after_the_nodes_they_replace(named):
    """A fused step's name (placement, error messages) leads back to the model: the node it
    takes the place of, by name, or by its output where the node has no name."""
    for model, providers, want in _fusion_cases():
        writer = {}
        for node in model.graph.node:
            node.name = f"node_{node.output[0]}" if named else ""
            writer[node.output[0]] = node.name or node.output[0]
        sess = _check_against_onnxruntime(model, providers)
        got = [(p.op.split("::")[1], p.node) for p in sess.placement() if p.fused]
        assert got == [(op, name.format(**writer)) for op, name in want], model.graph.name


def test_every_fused_onnx_genrt_node_fits_its_version_and_has_a_body():
    """The domain has version 1 only: each fused node says so, passes its op's checks with
    its input types, and expands to the standard-op body a provider without the kernel runs."""
    seen = set()
    for model, providers, _ in _fusion_cases():
        plan = InferenceSession(model, providers).plan
        for step in plan.steps:
            if step.node.domain != GENRT_DOMAIN:
                continue
            types = [plan.type_of(name) for name in step.inputs]
            assert step.node.opset == 1, step.node.describe()
            check_node(step.node, types)
            assert expand(step.node, types).nodes, step.node.describe()
            seen.add(step.node.op_type)
    assert seen == {
        "SiluMul",
        "ArgMaxProb",
        "NonFinite",
        "NormMatMul",
        "NormMatMulNBits",
        "SiluMulMatMul",
        "SiluMulMatMulNBits",
    }


# -- decomposed RMS norms --------------------------------------------------------------------


def _rms(
    x_first: bool = True,
    eps_first: bool = False,
    power: tuple[str, float] = ("x", 2.0),
    opset: int = 18,
) -> onnx.ModelProto:
    """y = w * (x * 1 / sqrt(mean(base ** p, -1) + eps)) with (base, p) = ``power``; before
    opset 18, ReduceMean's axes are an attribute."""
    rng = np.random.default_rng(12)
    inits = {
        "w": rng.standard_normal(16).astype(np.float32),
        "p": np.array(power[1], np.float32),
        "eps": np.array(1e-6, np.float32),
        "axes": np.array([-1], np.int64),
    }
    nodes = [
        helper.make_node("Pow", [power[0], "p"], ["sq"]),
        helper.make_node("ReduceMean", ["sq", "axes"], ["mean"], keepdims=1)
        if opset >= 18
        else helper.make_node("ReduceMean", ["sq"], ["mean"], keepdims=1, axes=[-1]),
        helper.make_node("Add", ["eps", "mean"] if eps_first else ["mean", "eps"], ["var"]),
        helper.make_node("Sqrt", ["var"], ["root"]),
        helper.make_node("Reciprocal", ["root"], ["inv"]),
        helper.make_node("Mul", ["x", "inv"] if x_first else ["inv", "x"], ["normed"]),
        helper.make_node("Mul", ["w", "normed"], ["y"]),
    ]
    return _model(nodes, {"x": [3, 16], "x2": [3, 16]}, {"y": [3, 16]}, inits, opset=opset)


@pytest.mark.parametrize(
    "form",
    [{"x_first": False}, {"eps_first": True}, {"opset": 13}],
    ids=["inv-times-x", "eps-plus-mean", "axes-attribute"],
)
def test_an_rms_norm_in_each_form_an_exporter_writes_fuses(form):
    sess = _check_against_onnxruntime(_rms(**form))
    assert _ops(sess) == ["SimplifiedLayerNormalization"]


@pytest.mark.parametrize("power", [("x", 3.0), ("x2", 2.0)], ids=["cube", "another-value"])
def test_an_rms_norm_of_another_power_or_value_stays_unfused(power):
    sess = _check_against_onnxruntime(_rms(power=power))
    assert "SimplifiedLayerNormalization" not in _ops(sess)


# -- Add, then SimplifiedLayerNormalization: SkipSimplifiedLayerNormalization ----------------


@pytest.mark.parametrize(
    ("b_shape", "norm"),
    [
        ([2, 3, 16], {"axis": 1}),  # a norm over the last two axes
        ([16], {}),  # the Add broadcasts b
        ([2, 3, 16], {"outputs": ["y", "inv_std"]}),  # the inverse std is an output
    ],
    ids=["axis-1", "broadcast-add", "inv-std-read"],
)
def test_an_add_and_norm_unlike_skip_norm_stay_unfused(b_shape, norm):
    outputs = norm.pop("outputs", ["y"])
    w = np.random.default_rng(4).standard_normal([16] if "axis" not in norm else [3, 16])
    nodes = [
        helper.make_node("Add", ["a", "b"], ["r"]),
        helper.make_node(
            "SimplifiedLayerNormalization",
            ["r", "w"],
            outputs,
            epsilon=1e-5,
            **{"axis": -1, **norm},
        ),
    ]
    model = _model(
        nodes,
        {"a": [2, 3, 16], "b": b_shape},
        dict.fromkeys(outputs),
        {"w": w.astype(np.float32)},
    )
    sess = _check_against_onnxruntime(model)
    assert _ops(sess) == ["Add", "SimplifiedLayerNormalization"]


# -- norms and SiLU activations into the projections that read them (FusingCPU) ---------------


def _fusing(*, without_matmul: bool = False):
    """The CPU provider with the fused projection kernels (numpy); ``without_matmul``: one
    that refuses MatMul, so that a second provider holds the projections."""
    from tests.session.test_norm_matmul_fusion import FusingCPU

    if not without_matmul:
        return FusingCPU()

    class NormsOnly(FusingCPU):
        name = "norms-only"

        @property
        def kernels(self) -> KernelRegistry:
            reg = KernelRegistry()
            for domain, op in super().kernels.ops():
                if op != "MatMul":
                    for since in super().kernels.versions(domain, op):
                        reg.add(super().kernels.lookup(domain, op, since))
            return reg

    return NormsOnly()


def _norm_then(
    *after: onnx.NodeProto,
    skip: bool = False,
    axis: int = -1,
    bias: str | None = None,
    outputs: tuple[str, ...] = ("n",),
):
    """x [1, 3, 32] (+ b with ``skip``) -> (Skip)SimplifiedLayerNormalization -> n, then
    ``after`` (constants w1, w2 [32, 32], an input w [32, 32]); output y."""
    rng = np.random.default_rng(14)
    if skip:
        inputs = ["x", "b", "g"] + ([bias] if bias is not None else [])
        norm = helper.make_node(
            "SkipSimplifiedLayerNormalization",
            inputs,
            list(outputs),
            domain="com.microsoft",
            epsilon=1e-5,
        )
    else:
        norm = helper.make_node("SimplifiedLayerNormalization", ["x", "g"], ["n"], axis=axis)
    inits = {
        "g": (1 + 0.1 * rng.standard_normal(32)).astype(np.float32),
        **_weights("w1", "w2", shape=(32, 32)),
        **_weights("w3d", shape=(2, 32, 32)),
    }
    feeds = {"x": [1, 3, 32], "b": [1, 3, 32], "w": [32, 32]}
    return _model([norm, *after], feeds, {"y": None}, inits)


def _silu_then(*after: onnx.NodeProto, up_input: str = "x"):
    """SiluMul(g, u) -> m as the gated MLP fuses (x [3, 32]), then ``after``; output y."""
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["g"]),
        helper.make_node("MatMul", [up_input, "w2"], ["u"]),
        helper.make_node("Sigmoid", ["g"], ["s"]),
        helper.make_node("Mul", ["g", "s"], ["a"]),
        helper.make_node("Mul", ["a", "u"], ["m"]),
        *after,
    ]
    feeds = {"x": [3, 32], "x2": [3, 32], "w": [32, 32]}
    inits = {**_weights("w1", "w2", "w3", shape=(32, 32)), **_weights("w3d", shape=(2, 32, 32))}
    return _model(nodes, feeds, {"y": None}, inits)


MATMUL_N = helper.make_node("MatMul", ["n", "w1"], ["y"])


@pytest.mark.parametrize(
    ("model", "want"),
    [
        (_norm_then(MATMUL_N), ["NormMatMul"]),
        (_norm_then(MATMUL_N, skip=True, bias=""), ["NormMatMul"]),  # no bias: an empty name
        (  # mean and inverse std named, unread
            _norm_then(MATMUL_N, skip=True, outputs=("n", "mean", "inv_std")),
            ["NormMatMul"],
        ),
        (_norm_then(MATMUL_N, axis=1), ["SimplifiedLayerNormalization", "MatMul"]),
        (
            _norm_then(helper.make_node("MatMul", ["n", "w"], ["y"])),  # weights fed
            ["SimplifiedLayerNormalization", "MatMul"],
        ),
        (
            _norm_then(helper.make_node("MatMul", ["n", "w3d"], ["y"])),  # batched weights
            ["SimplifiedLayerNormalization", "MatMul"],
        ),
        (
            _norm_then(
                helper.make_node("MatMul", ["n", "w1"], ["h"]),
                helper.make_node("MatMul", ["h", "w2"], ["y"]),
            ),
            ["NormMatMul", "MatMul"],  # the second projection reads no norm and no SiLU
        ),
        (_silu_then(helper.make_node("MatMul", ["m", "w3"], ["y"])), ["MatMul", "SiluMulMatMul"]),
        (  # gate and up read two inputs: a SiluMul of two inputs goes in
            _silu_then(helper.make_node("MatMul", ["m", "w3"], ["y"]), up_input="x2"),
            ["MatMul", "MatMul", "SiluMulMatMul"],
        ),
        (
            _silu_then(helper.make_node("MatMul", ["m", "w"], ["y"])),  # weights fed
            ["MatMul", "SiluMul", "MatMul"],
        ),
        (_silu_then(helper.make_node("Neg", ["m"], ["y"])), ["MatMul", "SiluMul", "Neg"]),
        (
            _silu_then(helper.make_node("MatMul", ["m", "w3d"], ["y"])),  # batched weights
            ["MatMul", "SiluMul", "MatMul"],
        ),
    ],
    ids=[
        "norm",
        "skip-norm-no-bias",
        "skip-norm-statistics-unread",
        "norm-axis-1",
        "norm-weights-fed",
        "norm-3-d-weights",
        "two-projections",
        "silu",
        "silu-unsplit",
        "silu-weights-fed",
        "silu-read-by-neg",
        "silu-3-d-weights",
    ],
)
def test_norms_and_silu_go_into_projections_with_constant_weights_only(model, want):
    sess = _check_against_onnxruntime(model, [_fusing()])
    assert _ops(sess) == want


def test_a_projection_on_another_provider_keeps_its_norm():
    model = _norm_then(MATMUL_N)
    sess = _check_against_onnxruntime(model, [_fusing(without_matmul=True), _fusing()])
    placed = [(p.op, p.provider) for p in sess.placement()]
    assert placed == [
        ("ai.onnx::SimplifiedLayerNormalization", "norms-only"),
        ("ai.onnx::MatMul", "fusing-cpu"),
    ]


@pytest.mark.parametrize("total", ["unread", "read", "output"])
def test_skip_norm_writes_the_residual_sum_where_it_is_still_needed(total):
    """The fused step has the sum as output 3 where a later step or the caller reads it,
    and only the normalized output otherwise."""
    model = _skip_norm()
    if total == "read":
        model.graph.node.append(helper.make_node("Neg", ["r"], ["z"]))
        model.graph.output.append(helper.make_tensor_value_info("z", F, None))
    elif total == "output":
        model.graph.output.append(helper.make_tensor_value_info("r", F, None))
    sess = _check_against_onnxruntime(model)
    fused = sess.plan.steps[0]
    assert fused.node.op_type == "SkipSimplifiedLayerNormalization"
    assert tuple(fused.outputs) == (("y",) if total == "unread" else ("y", "", "", "r"))


#: Attributes at their schema's default value: written out or left away, the same node.
DEFAULTS = {
    ("ReduceMean", "keepdims"): 1,
    ("SimplifiedLayerNormalization", "axis"): -1,
    ("Softmax", "axis"): -1,
}


@pytest.mark.parametrize(
    ("make", "fusing"),
    [
        (lambda: _rms(), False),
        (lambda: _skip_norm(), False),
        (lambda: _pick(), False),
        (lambda: _norm_then(MATMUL_N), True),
    ],
    ids=["rms-norm", "skip-norm", "argmax-prob", "norm-matmul"],
)
def test_attributes_left_at_their_defaults_fuse_as_written_out(make, fusing):
    written, left = make(), make()
    for node in left.graph.node:
        for attr in list(node.attribute):
            if DEFAULTS.get((node.op_type, attr.name)) == helper.get_attribute_value(attr):
                node.attribute.remove(attr)
    assert written != left  # something was left away
    providers = [_fusing()] if fusing else None
    assert _ops(_check_against_onnxruntime(left, providers)) == _ops(
        _check_against_onnxruntime(written, providers)
    )
    assert _ops(_check_against_onnxruntime(left, providers)) != [n.op_type for n in left.graph.node]


@pytest.mark.parametrize("sum_read", [False, True])
def test_a_norm_whose_unused_output_is_written_as_an_empty_name_fuses(sum_read):
    """``["y", ""]``: the inverse std declared absent; the fused step writes y (and the sum
    where it is read)."""
    model = _skip_norm(outputs=("y", ""))
    if sum_read:
        model.graph.output.append(helper.make_tensor_value_info("r", F, None))
    sess = _check_against_onnxruntime(model)
    (placed,) = sess.placement()
    assert placed.op == "com.microsoft::SkipSimplifiedLayerNormalization"
    assert placed.node == "y/SkipRMSNorm"
    assert tuple(sess.plan.steps[0].outputs) == (("y", "", "", "r") if sum_read else ("y",))


@pytest.mark.parametrize("read", ["mean", "inv_std"])
def test_a_skip_norm_whose_statistics_are_read_keeps_them(read):
    """Its mean or inverse std read by a later node: the norm cannot go into a projection,
    which writes neither."""
    model = _norm_then(MATMUL_N, skip=True, outputs=("n", "mean", "inv_std"))
    model.graph.node.append(helper.make_node("Neg", [read], ["z"]))
    model.graph.output.append(helper.make_tensor_value_info("z", F, None))
    sess = _check_against_onnxruntime(model, [_fusing()])
    assert _ops(sess) == ["SkipSimplifiedLayerNormalization", "MatMul", "Neg"]


def test_a_matmul_nbits_whose_scales_are_fed_still_takes_its_norm():
    """Only the packed weight must be a constant: scales fed at run time go into the fused
    step as they are."""
    rng = np.random.default_rng(15)
    proj, inits = _nbits("proj", "y", "n", 32, 16, rng, zp=False, flat=False)
    scales = inits.pop("proj_s")
    model = _norm_then(proj)
    model.graph.initializer.append(numpy_helper.from_array(inits["proj_B"], "proj_B"))
    model.graph.input.append(helper.make_tensor_value_info("proj_s", F, list(scales.shape)))
    sess = _check_against_onnxruntime(model, [_fusing()])
    assert _ops(sess) == ["NormMatMulNBits"]


# -- found by the recorded mutation run (docs/mutation.md, session/fusion.py) ------------------


def _check_feeds(model: onnx.ModelProto, feeds: dict, providers=None) -> InferenceSession:
    """``_check_against_onnxruntime`` with the feeds given (inputs other than float32)."""
    sess = InferenceSession(model, providers)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in model.graph.output]
    for name, got, ref in zip(names, sess.run(names, feeds), want.run(names, feeds), strict=True):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5, err_msg=name)
    return sess


def test_a_silu_written_up_times_activation_fuses():
    """``Mul(u, Mul(g, Sigmoid(g)))``: the activation is the second operand of the last Mul."""
    nodes = [
        helper.make_node("Sigmoid", ["g"], ["s"]),
        helper.make_node("Mul", ["g", "s"], ["a"]),
        helper.make_node("Mul", ["u", "a"], ["y"]),
    ]
    model = _model(nodes, {"g": [2, 8], "u": [2, 8]}, {"y": [2, 8]})
    assert _ops(_check_against_onnxruntime(model)) == ["SiluMul"]


def test_a_silu_whose_gate_is_a_graph_input_fuses_without_merging_projections():
    """The gate has no producing step (a graph input): the SiluMul stays, with nothing to
    merge its up projection with."""
    nodes = [
        helper.make_node("MatMul", ["x", "wu"], ["u"], name="up"),
        helper.make_node("Sigmoid", ["x2"], ["s"]),
        helper.make_node("Mul", ["x2", "s"], ["a"]),
        helper.make_node("Mul", ["a", "u"], ["y"]),
    ]
    model = _model(nodes, {"x": [8, 8], "x2": [8, 8]}, {"y": None}, _weights("wu"))
    assert _ops(_check_against_onnxruntime(model)) == ["MatMul", "SiluMul"]


def test_a_scale_of_a_graph_input_is_no_rms_norm():
    """``w * x`` with a 1-D constant w and x fed: no producer to match a norm in."""
    w = np.random.default_rng(15).standard_normal(16).astype(np.float32)
    model = _model(
        [helper.make_node("Mul", ["w", "x"], ["y"])], {"x": [3, 16]}, {"y": None}, {"w": w}
    )
    assert _ops(_check_against_onnxruntime(model)) == ["Mul"]


def _rms_mean(mean: onnx.NodeProto, rows: int = 16, axes_input: bool = False):
    """An RMS norm of x [rows, 16] whose ReduceMean (reading sq, writing mean) is ``mean``."""
    rng = np.random.default_rng(16)
    inits = {
        "w": rng.standard_normal(16).astype(np.float32),
        "p": np.array(2.0, np.float32),
        "eps": np.array(1e-6, np.float32),
    }
    if not axes_input:
        inits.update(
            axes=np.array([-1], np.int64),
            axes0=np.array([0], np.int64),
            axes_f=np.array([-1.0], np.float32),
        )
    nodes = [
        helper.make_node("Pow", ["x", "p"], ["sq"]),
        mean,
        helper.make_node("Add", ["mean", "eps"], ["var"]),
        helper.make_node("Sqrt", ["var"], ["root"]),
        helper.make_node("Reciprocal", ["root"], ["inv"]),
        helper.make_node("Mul", ["x", "inv"], ["normed"]),
        helper.make_node("Mul", ["w", "normed"], ["y"]),
    ]
    inputs = [helper.make_tensor_value_info("x", F, [rows, 16])]
    if axes_input:
        inputs.append(helper.make_tensor_value_info("axes", TensorProto.INT64, [1]))
    graph = helper.make_graph(
        nodes,
        "rms",
        inputs,
        [helper.make_tensor_value_info("y", F, None)],
        [numpy_helper.from_array(v, n) for n, v in inits.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize(
    "mean",
    [
        helper.make_node("ReduceMean", ["sq", "axes"], ["mean"], keepdims=0),
        helper.make_node("ReduceMean", ["sq", "axes0"], ["mean"], keepdims=1),
    ],
    ids=["keepdims-0", "axis-0"],
)
def test_a_mean_not_over_the_last_axis_kept_is_no_rms_norm(mean):
    """A square x [16, 16]: a mean without the kept axis, or over the rows, still broadcasts
    (per column), and is no RMS norm."""
    rng = np.random.default_rng(17)
    sess = _check_feeds(_rms_mean(mean), {"x": rng.standard_normal((16, 16)).astype(np.float32)})
    assert "SimplifiedLayerNormalization" not in _ops(sess)


def test_a_mean_over_fed_axes_is_no_rms_norm():
    """Axes that are not a constant cannot be read at planning time: no fusion (and no
    error)."""
    mean = helper.make_node("ReduceMean", ["sq", "axes"], ["mean"], keepdims=1)
    model = _rms_mean(mean, rows=3, axes_input=True)
    feeds = {
        "x": np.random.default_rng(18).standard_normal((3, 16)).astype(np.float32),
        "axes": np.array([-1], np.int64),
    }
    assert "SimplifiedLayerNormalization" not in _ops(_check_feeds(model, feeds))


def test_an_add_then_a_scale_is_no_skip_norm():
    """Only a SimplifiedLayerNormalization after the Add becomes a skip norm: a Mul by a 1-D
    constant after it (two inputs, the shape a norm's scale has) stays as written."""
    w = np.random.default_rng(19).standard_normal(16).astype(np.float32)
    nodes = [helper.make_node("Add", ["a", "b"], ["r"]), helper.make_node("Mul", ["r", "w"], ["y"])]
    model = _model(nodes, {"a": [2, 3, 16], "b": [2, 3, 16]}, {"y": None}, {"w": w})
    assert _ops(_check_against_onnxruntime(model)) == ["Add", "Mul"]


def test_a_silu_written_sigmoid_times_gate_fuses():
    """``Mul(Sigmoid(g), g)``: the gate is the second operand of the activation's Mul."""
    nodes = [
        helper.make_node("Sigmoid", ["g"], ["s"]),
        helper.make_node("Mul", ["s", "g"], ["a"]),
        helper.make_node("Mul", ["a", "u"], ["y"]),
    ]
    model = _model(nodes, {"g": [2, 8], "u": [2, 8]}, {"y": [2, 8]})
    assert _ops(_check_against_onnxruntime(model)) == ["SiluMul"]


def test_a_softmax_before_opset_13_without_an_axis_stays_unfused():
    """Before opset 13 Softmax's default axis is 1 and it normalizes over every axis from
    there (coerced to 2-D): over [2, 3, 10] logits that is 30 values, not the last axis."""
    model = _pick(opset=12)
    softmax = model.graph.node[3]
    assert softmax.op_type == "Softmax"
    del softmax.attribute[:]
    assert "ArgMaxProb" not in _pick_ops(model)


def test_an_rms_norm_written_normed_times_weight_fuses():
    """``Mul(normed, w)``: the weight is the second operand of the last Mul."""
    model = _rms()
    last = model.graph.node[-1]
    assert list(last.input) == ["w", "normed"]
    last.input[:] = ["normed", "w"]
    assert _ops(_check_against_onnxruntime(model)) == ["SimplifiedLayerNormalization"]


@pytest.mark.parametrize(("one", "fuses"), [(1.0, True), (2.0, False)])
def test_an_rms_norm_with_a_division_for_the_reciprocal(one, fuses):
    """``Div(1, Sqrt(..))`` is the reciprocal; ``Div(2, Sqrt(..))`` is not."""
    model = _rms()
    (recip,) = [n for n in model.graph.node if n.op_type == "Reciprocal"]
    recip.op_type = "Div"
    recip.input[:] = ["one", "root"]
    model.graph.initializer.append(numpy_helper.from_array(np.array(one, np.float32), "one"))
    ops = _ops(_check_against_onnxruntime(model))
    assert (ops == ["SimplifiedLayerNormalization"]) == fuses, ops


def test_a_norm_with_a_fed_scale_keeps_it_out_of_the_projection():
    model = _norm_then(MATMUL_N)
    (gamma,) = [i for i in model.graph.initializer if i.name == "g"]
    model.graph.initializer.remove(gamma)
    model.graph.input.append(helper.make_tensor_value_info("g", F, [32]))
    sess = _check_against_onnxruntime(model, [_fusing()])
    assert _ops(sess) == ["SimplifiedLayerNormalization", "MatMul"]


def test_a_merged_gate_and_up_counts_as_one_fusion():
    """The plan's count of fusions: the SiluMul, then gate and up merged into one projection
    (two steps replaced, one fusion)."""
    nodes = [
        helper.make_node("MatMul", ["x", "wg"], ["g"], name="gate"),
        helper.make_node("MatMul", ["x", "wu"], ["u"], name="up"),
    ]
    sess = _check_against_onnxruntime(_gated(*nodes, _weights("wg", "wu")))
    assert _ops(sess) == ["MatMul", "SiluMul"]
    assert sess.plan.fused == 2
