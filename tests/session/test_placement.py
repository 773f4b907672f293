"""Placement with types: providers are asked with each input's dtype and shape, fusions ask
the provider holding the nodes with the fused node, the CPU provider is the fallback, and a
session reports where every node runs."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_genrt.core.errors import UnsupportedOpError
from onnx_genrt.core.kernels import GENRT_DOMAIN, KernelDef, KernelRegistry
from onnx_genrt.providers.cpu.kernels import REGISTRY
from onnx_genrt.providers.cpu.provider import CPUProvider
from onnx_genrt.session import InferenceSession


def _registry(*ops: tuple[str, str], check=None, replace: dict | None = None) -> KernelRegistry:
    reg = KernelRegistry()
    for domain, op in ops:
        kdef = REGISTRY.lookup(domain, op, 21 if not domain else 1)
        fn = (replace or {}).get(op, kdef.fn)
        reg.add(KernelDef(kdef.domain, kdef.op_type, kdef.since, fn, check, kdef.prepack))
    return reg


class FloatAddOnly(CPUProvider):
    """Claims Add, but only on float32 inputs: a provider choosing nodes by dtype."""

    name = "float-add"

    @property
    def kernels(self) -> KernelRegistry:
        def float32_only(node, types):
            dtypes = [t.dtype if t is not None else None for t in types]
            if any(d != np.float32 for d in dtypes):
                return f"Add on {[str(d) for d in dtypes]}: float32 only"
            return None

        return _registry(("", "Add"), check=float32_only)


def _two_adds():
    nodes = [
        helper.make_node("Add", ["x", "x"], ["fx"], name="float_add"),
        helper.make_node("Add", ["i", "one"], ["fi"], name="int_add"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [2]),
            helper.make_tensor_value_info("i", TensorProto.INT64, [2]),
        ],
        [
            helper.make_tensor_value_info("fx", TensorProto.FLOAT, [2]),
            helper.make_tensor_value_info("fi", TensorProto.INT64, [2]),
        ],
        [numpy_helper.from_array(np.array(1, np.int64), "one")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def test_placement_sees_input_types_and_the_cpu_provider_takes_the_rest():
    sess = InferenceSession(_two_adds(), providers=[FloatAddOnly()])
    assert sess.get_providers() == ["float-add", "cpu"]  # the fallback was appended
    where = {p.node: (p.provider, p.fused) for p in sess.placement()}
    assert where == {"float_add": ("float-add", False), "int_add": ("cpu", False)}
    fx, fi = sess.run(None, {"x": np.array([1.5, 2], np.float32), "i": np.array([3, 4])})
    np.testing.assert_array_equal(fx, [3.0, 4.0])
    np.testing.assert_array_equal(fi, [4, 5])


class NoInt64Arrays(CPUProvider):
    """Claims Add for every dtype, but its arrays cannot hold int64 (``holds_dtype``), as
    CuPy's cannot hold bfloat16: placement must not give it the int64 Add."""

    name = "no-int64"

    @property
    def kernels(self) -> KernelRegistry:
        return _registry(("", "Add"))

    def holds_dtype(self, dtype: np.dtype) -> bool:
        return np.dtype(dtype) != np.int64


def test_a_dtype_the_provider_cannot_hold_is_placed_elsewhere():
    sess = InferenceSession(_two_adds(), providers=[NoInt64Arrays()])
    where = {p.node: p.provider for p in sess.placement()}
    assert where == {"float_add": "no-int64", "int_add": "cpu"}
    fx, fi = sess.run(None, {"x": np.array([1.5, 2], np.float32), "i": np.array([3, 4])})
    np.testing.assert_array_equal(fx, [3.0, 4.0])
    np.testing.assert_array_equal(fi, [4, 5])
    with pytest.raises(
        UnsupportedOpError, match=r"'int_add'.*no-int64: cannot hold int64 \(input 'i'\)"
    ):
        InferenceSession(_two_adds(), providers=[NoInt64Arrays()], cpu_fallback=False)


def test_without_the_fallback_the_refusal_names_the_node_and_the_reason():
    with pytest.raises(UnsupportedOpError, match=r"'int_add'.*float32 only"):
        InferenceSession(_two_adds(), providers=[FloatAddOnly()], cpu_fallback=False)


def _gated_mlp(hidden: int = 8):
    """y = silu(x @ Wg) * (x @ Wu): the pattern fused into SiluMul, then one gate_up MatMul."""
    rng = np.random.default_rng(0)
    wg, wu = (rng.standard_normal((hidden, hidden)).astype(np.float32) for _ in range(2))
    nodes = [
        helper.make_node("MatMul", ["x", "wg"], ["g"], name="gate"),
        helper.make_node("MatMul", ["x", "wu"], ["u"], name="up"),
        helper.make_node("Sigmoid", ["g"], ["s"], name="sig"),
        helper.make_node("Mul", ["g", "s"], ["a"], name="silu"),
        helper.make_node("Mul", ["a", "u"], ["y"], name="gated"),
    ]
    graph = helper.make_graph(
        nodes,
        "gated",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, hidden])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, hidden])],
        [numpy_helper.from_array(wg, "wg"), numpy_helper.from_array(wu, "wu")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.opset_import.append(helper.make_opsetid(GENRT_DOMAIN, 1))
    return model, wg, wu


class TwoInputSiluMul(CPUProvider):
    """A plugin's SiluMul with the obvious two inputs; its check refuses the one-input
    ``split`` form the gate/up fusion would make."""

    name = "two-input-silu"

    @property
    def kernels(self) -> KernelRegistry:
        def silu_mul(ctx, gate, up):  # no split form: called with one input, it would crash
            return gate / (1 + np.exp(-gate)) * up

        def two_inputs(node, types):
            return "split form not supported" if node.attr("split", 0) else None

        reg = _registry(("", "MatMul"), ("", "Sigmoid"), ("", "Mul"))
        kdef = REGISTRY.lookup(GENRT_DOMAIN, "SiluMul", 1)
        reg.add(KernelDef(kdef.domain, kdef.op_type, kdef.since, silu_mul, two_inputs))
        return reg


def test_a_fusion_happens_only_in_the_form_the_provider_says_yes_to():
    model, wg, wu = _gated_mlp()
    x = np.random.default_rng(1).standard_normal((1, 8)).astype(np.float32)
    g, u = x.astype(np.float64) @ wg, x.astype(np.float64) @ wu
    want = g / (1 + np.exp(-g)) * u
    sess = InferenceSession(model, providers=[TwoInputSiluMul()], cpu_fallback=False)
    placed = sess.placement()
    assert [p.op for p in placed] == ["ai.onnx::MatMul", "ai.onnx::MatMul", "onnx_genrt::SiluMul"]
    assert [p.fused for p in placed] == [False, False, True]
    (y,) = sess.run(None, {"x": x})
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    # The CPU provider says yes to both forms: one gate_up projection and a split SiluMul.
    cpu = InferenceSession(model, providers=["cpu"])
    assert [p.op for p in cpu.placement()] == ["ai.onnx::MatMul", "onnx_genrt::SiluMul"]
    np.testing.assert_allclose(cpu.run(None, {"x": x})[0], want, rtol=1e-5, atol=1e-5)


def test_gate_up_projections_onto_the_same_weights_share_one_merged_weight():
    """Two gated MLPs (an unrolled MTP chain's steps, say) reading the same gate and up
    weights become two gate_up projections onto one merged constant, not one copy each;
    both outputs still equal float64 numpy."""
    model, wg, wu = _gated_mlp()
    graph = model.graph
    second = []
    for node in list(graph.node):
        copy = helper.make_node(
            node.op_type,
            [n if n in ("wg", "wu") else f"{n}2" for n in node.input],
            [f"{n}2" for n in node.output],
            name=f"{node.name}2",
        )
        second.append(copy)
    graph.node.extend(second)
    graph.input.append(helper.make_tensor_value_info("x2", TensorProto.FLOAT, [1, 8]))
    graph.output.append(helper.make_tensor_value_info("y2", TensorProto.FLOAT, [1, 8]))
    sess = InferenceSession(model, providers=["cpu"])
    projections = [s for s in sess.plan.steps if s.node.op_type == "MatMul"]
    assert len(projections) == 2
    assert len({s.inputs[1] for s in projections}) == 1 and len(sess.plan.constants) == 1
    rng = np.random.default_rng(3)
    feeds = {n: rng.standard_normal((1, 8)).astype(np.float32) for n in ("x", "x2")}
    for name, got in zip(("x", "x2"), sess.run(["y", "y2"], feeds), strict=True):
        x = feeds[name].astype(np.float64)
        g, u = x @ wg, x @ wu
        np.testing.assert_allclose(got, g / (1 + np.exp(-g)) * u, rtol=1e-5, atol=1e-5)
