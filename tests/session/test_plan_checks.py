"""Planning (``session.plan``) refusals and limits that no other test reached (found by a
mutation run): each refusal beside onnxruntime's on the same model, results against numpy or
onnxruntime."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_genrt.core.errors import ModelLoadError, UnsupportedOpError
from onnx_genrt.core.kernels import KernelRegistry
from onnx_genrt.core.registry import get_registry
from onnx_genrt.providers.cpu.provider import CPUProvider
from onnx_genrt.session import InferenceSession
from onnx_genrt.session import plan as plan_module
from onnx_genrt.session.plan import SKELETON_VALUES_MAX, _shape_skeleton, build_plan

X = np.array([-1.5, 2.0], np.float32)


def _model(
    nodes: list[onnx.NodeProto],
    initializers: list[onnx.TensorProto] = (),
    imports: dict[str, int] | None = None,
    outputs: tuple[str, ...] = ("y",),
) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs],
        list(initializers),
    )
    opsets = [helper.make_opsetid(d, v) for d, v in (imports or {"": 17}).items()]
    return helper.make_model(graph, opset_imports=opsets)


def _ort_refuses(model: onnx.ModelProto) -> None:
    with pytest.raises(Exception):  # noqa: B017 - onnxruntime's own error types
        sess = onnxruntime.InferenceSession(
            model.SerializeToString(), providers=["CPUExecutionProvider"]
        )
        sess.run(None, {"x": X})


# -- graph structure ---------------------------------------------------------------------------


def test_a_cycle_names_the_first_five_nodes_caught_in_it():
    """``pre`` runs; c0 -> c1 -> ... -> c6 -> c0 never can, nor ``post`` after them."""
    nodes = [helper.make_node("Relu", ["x"], ["p"], name="pre")]
    nodes.append(helper.make_node("Add", ["p", "v6"], ["v0"], name="c0"))
    nodes += [helper.make_node("Neg", [f"v{i - 1}"], [f"v{i}"], name=f"c{i}") for i in range(1, 7)]
    nodes.append(helper.make_node("Relu", ["v3"], ["y"], name="post"))
    model = _model(nodes)
    _ort_refuses(model)
    with pytest.raises(ModelLoadError) as info:
        InferenceSession(model)
    assert str(info.value) == "graph has a cycle through nodes ['c0', 'c1', 'c2', 'c3', 'c4']"


def test_a_cycle_through_unnamed_nodes_names_their_positions():
    nodes = [
        helper.make_node("Relu", ["x"], ["p"], name="pre"),
        helper.make_node("Add", ["p", "b"], ["a"]),
        helper.make_node("Neg", ["a"], ["b"]),
        helper.make_node("Relu", ["a"], ["y"], name="post"),
    ]
    with pytest.raises(ModelLoadError, match=r"cycle through nodes \['1', '2', 'post'\]"):
        InferenceSession(_model(nodes))


def test_a_value_made_by_two_nodes_is_refused():
    model = _model(
        [helper.make_node("Relu", ["x"], ["y"], name="a"), helper.make_node("Neg", ["x"], ["y"])]
    )
    _ort_refuses(model)
    with pytest.raises(ModelLoadError, match=r"value 'y' is produced twice \(nodes 0 and 1\)"):
        InferenceSession(model)


def test_a_node_of_a_domain_the_model_does_not_import_is_refused():
    model = _model([helper.make_node("Relu", ["x"], ["y"], name="act", domain="com.example")])
    _ort_refuses(model)
    with pytest.raises(ModelLoadError, match="'act' .*domain 'com.example', which the model"):
        InferenceSession(model)


def test_sparse_initializers_are_refused_by_name():
    """onnxruntime densifies them; onnx-genrt says it does not."""
    values = numpy_helper.from_array(np.array([3.0], np.float32), "bias")
    indices = numpy_helper.from_array(np.array([1], np.int64), "bias_indices")
    model = _model([helper.make_node("Add", ["x", "bias"], ["y"])])
    model.graph.sparse_initializer.append(helper.make_sparse_tensor(values, indices, [2]))
    sess = onnxruntime.InferenceSession(
        model.SerializeToString(), providers=["CPUExecutionProvider"]
    )
    np.testing.assert_array_equal(sess.run(None, {"x": X})[0], X + np.array([0.0, 3.0]))
    with pytest.raises(ModelLoadError, match=r"sparse initializers \['bias'\] are not supported"):
        InferenceSession(model)


def test_a_symbolic_dim_keeps_its_name_as_in_onnxruntime():
    model = _model([helper.make_node("Relu", ["x"], ["y"])])
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "batch"
    theirs = onnxruntime.InferenceSession(
        model.SerializeToString(), providers=["CPUExecutionProvider"]
    ).get_inputs()[0]
    ours = InferenceSession(model).get_inputs()[0]
    assert ours.shape == tuple(theirs.shape) == ("batch",)


# -- refusals listed together ------------------------------------------------------------------


@pytest.mark.parametrize("count", [20, 21, 23])
def test_at_most_twenty_unsupported_nodes_are_listed(count: int):
    nodes = [
        helper.make_node("Frobnicate", ["x"], [f"v{i}"], name=f"f{i}", domain="com.example")
        for i in range(count)
    ]
    nodes.append(helper.make_node("Sum", [f"v{i}" for i in range(count)], ["y"]))
    model = _model(nodes, imports={"": 17, "com.example": 1})
    _ort_refuses(model)
    with pytest.raises(UnsupportedOpError) as info:
        InferenceSession(model)
    lines = str(info.value).splitlines()
    assert lines[0] == "no provider can run these nodes:"
    listed = [line for line in lines if "Frobnicate" in line]
    assert [line.split("'")[1] for line in listed] == [f"f{i}" for i in range(min(count, 20))]
    more = [line.strip() for line in lines if "more" in line]
    assert more == ([f"... and {count - 20} more"] if count > 20 else [])


# -- build_plan given a proto whose weights live elsewhere -------------------------------------


def test_build_plan_refuses_external_weights_it_was_not_given():
    weight = numpy_helper.from_array(np.array([1.0, 2.0], np.float32), "w")
    onnx.external_data_helper.set_external_data(weight, "w.bin")
    weight.ClearField("raw_data")
    model = _model([helper.make_node("Add", ["x", "w"], ["y"])], [weight])
    cpu = [get_registry().create("cpu")]
    with pytest.raises(ModelLoadError, match="initializer 'w' keeps its data in an external file"):
        build_plan(model, cpu)
    plan = build_plan(model, cpu, {"w": np.array([1.0, 2.0], np.float32)})
    np.testing.assert_array_equal(plan.constants["w"], [1.0, 2.0])


# -- what is folded ------------------------------------------------------------------------------


class Dice(CPUProvider):
    """A provider with one kernel, RandomUniform (the CPU provider has none), drawing from
    its own generator."""

    name = "dice"
    _only = KernelRegistry()

    def __init__(self) -> None:
        super().__init__()
        self.rng = np.random.default_rng(7)

    @property
    def kernels(self) -> KernelRegistry:
        if not len(self._only):
            self._only.register("RandomUniform", since=1)(_random_uniform)
        return self._only


def _random_uniform(ctx) -> np.ndarray:
    low, high = float(ctx.attr("low", 0.0)), float(ctx.attr("high", 1.0))
    shape = [int(d) for d in ctx.attr("shape")]
    return ctx.provider.rng.uniform(low, high, shape).astype(np.float32)


def test_random_ops_are_never_folded():
    """RandomUniform has no inputs (all of them constant): folded, every run would repeat
    the first draw. onnxruntime draws anew each run too."""
    node = helper.make_node("RandomUniform", [], ["y"], shape=[64], low=0.0, high=1.0)
    model = _model([node, helper.make_node("Identity", ["x"], ["z"])], outputs=("y", "z"))
    ort = onnxruntime.InferenceSession(
        model.SerializeToString(), providers=["CPUExecutionProvider"]
    )
    assert not np.array_equal(*(ort.run(["y"], {"x": X})[0] for _ in range(2)))
    sess = InferenceSession(model, providers=[Dice(), CPUProvider()])
    assert [s.node.op_type for s in sess.plan.steps] == ["RandomUniform", "Identity"]
    first, second = (sess.run(["y"], {"x": X})[0] for _ in range(2))
    assert not np.array_equal(first, second)
    assert first.min() >= 0.0 and first.max() < 1.0


@pytest.mark.parametrize(("limit_delta", "folded"), [(0, 1), (-1, 0)])
def test_fold_limit_is_inclusive(monkeypatch, limit_delta: int, folded: int):
    """A constant result of exactly ``FOLD_LIMIT`` bytes is folded; one byte over the limit
    the node runs instead. Either way the output is numpy's."""
    table = np.arange(64, dtype=np.float32).reshape(8, 8)
    monkeypatch.setattr(plan_module, "FOLD_LIMIT", table.nbytes + limit_delta)
    nodes = [
        helper.make_node("Transpose", ["t"], ["tt"], perm=[1, 0]),
        helper.make_node("Gather", ["tt", "i"], ["y"], axis=0),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("i", TensorProto.INT64, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(table, "t")],
    )
    sess = InferenceSession(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    assert sess.plan.folded == folded
    ids = np.array([3, 5], np.int64)
    np.testing.assert_array_equal(sess.run(None, {"i": ids})[0], table.T[ids])


# -- shape inference's copy of the model ---------------------------------------------------------


def test_shape_inference_copy_keeps_only_small_initializers_with_values():
    """Initializers up to ``SKELETON_VALUES_MAX`` elements go to shape inference with their
    values; larger ones, external ones and ones the graph declares as inputs (IR 3 style)
    do not, so no weight bytes are copied."""
    n = SKELETON_VALUES_MAX
    small = numpy_helper.from_array(np.zeros(n, np.float32), "small")
    large = numpy_helper.from_array(np.zeros(n + 1, np.float32), "large")
    declared = numpy_helper.from_array(np.zeros(n + 1, np.float32), "declared")
    external = numpy_helper.from_array(np.zeros(4, np.float32), "external")
    onnx.external_data_helper.set_external_data(external, "w.bin")
    external.ClearField("raw_data")
    nodes = [helper.make_node("Identity", [name], [f"{name}_out"]) for name in
             ("small", "large", "declared", "external")]  # fmt: skip
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("declared", TensorProto.FLOAT, [n + 1])],
        [
            helper.make_tensor_value_info(f"{v}_out", TensorProto.FLOAT, None)
            for v in ("small", "large", "declared", "external")
        ],  # fmt: skip
        [small, large, declared, external],
    )
    skeleton = _shape_skeleton(helper.make_model(graph))
    assert [i.name for i in skeleton.graph.initializer] == ["small"]
    assert numpy_helper.to_array(skeleton.graph.initializer[0]).shape == (n,)
    inputs = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim]
              for i in skeleton.graph.input}  # fmt: skip
    assert inputs == {"declared": [n + 1], "large": [n + 1], "external": [4]}
