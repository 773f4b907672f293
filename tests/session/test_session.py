"""Loading, planning and running models through InferenceSession."""

from __future__ import annotations

import copy

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_genrt.core.errors import (
    InvalidInputError,
    KernelError,
    ModelLoadError,
    UnsupportedOpError,
)
from onnx_genrt.session import InferenceSession
from onnx_genrt.session.loader import load_model

from ..models import mlp, mlp_reference


def test_mlp_matches_numpy_float64_and_onnxruntime():
    model = mlp(hidden=32)
    x = np.random.default_rng(0).standard_normal((5, 32)).astype(np.float32)
    (y,) = InferenceSession(model).run(None, {"x": x})
    np.testing.assert_allclose(y, mlp_reference(model, x), rtol=1e-5, atol=1e-5)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(y, ref.run(None, {"x": x})[0], rtol=1e-5, atol=1e-6)


def test_repeated_runs_with_new_shapes_reuse_nothing_stale():
    model = mlp(hidden=16)
    sess = InferenceSession(model)
    rng = np.random.default_rng(3)
    for batch in (1, 4, 1, 7, 4):
        x = rng.standard_normal((batch, 16)).astype(np.float32)
        (y,) = sess.run(["y"], {"x": x})
        np.testing.assert_allclose(y, mlp_reference(model, x), rtol=1e-5, atol=1e-5)


def test_outputs_returned_from_run_are_not_overwritten_by_the_next_run():
    model = mlp(hidden=8)
    sess = InferenceSession(model)
    x1 = np.ones((2, 8), np.float32)
    (y1,) = sess.run(None, {"x": x1})
    keep = y1.copy()
    sess.run(None, {"x": x1 * 5})
    np.testing.assert_array_equal(y1, keep)


def test_memory_plan_reuses_buffers_and_reports_peak():
    from ..models import chain

    sess = InferenceSession(chain(30, width=256))
    binding = sess.io_binding()
    binding.bind_input("x", np.zeros((1, 256), np.float32))
    binding.bind_output("y", shape=(1, 256))
    sess.run_with_iobinding(binding)
    arena, naive = sess.executor.peak_bytes()
    assert naive == 29 * 1024  # 29 intermediates of 1 KiB
    assert arena == 2 * 1024  # a chain needs only two live buffers


@pytest.mark.parametrize(
    ("feeds", "message"),
    [
        ({"z": np.zeros((1, 8), np.float32)}, "model has no input 'z'"),
        ({"x": np.zeros((1, 8), np.int64)}, "input 'x' expects float32, got int64"),
        ({"x": np.zeros((8,), np.float32)}, "input 'x' has rank 1"),
        ({"x": np.zeros((2, 9), np.float32)}, "input 'x' dimension 1 is 9, model declares 8"),
        ({}, r"missing inputs \['x'\]"),
    ],
)
def test_bad_feeds_get_clear_errors(feeds, message):
    with pytest.raises(InvalidInputError, match=message):
        InferenceSession(mlp(hidden=8)).run(None, feeds)


def test_unknown_output_name_is_refused():
    with pytest.raises(InvalidInputError, match="model has no output 'nope'"):
        InferenceSession(mlp(hidden=8)).run(["nope"], {"x": np.zeros((1, 8), np.float32)})


def test_malformed_model_file_gives_a_clear_error(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x08\x07this is not protobuf\xff\xff\xff")
    with pytest.raises(ModelLoadError, match=str(bad.name)):
        InferenceSession(bad)
    with pytest.raises(ModelLoadError, match="model file not found"):
        InferenceSession(tmp_path / "missing.onnx")


def test_node_reading_an_unknown_value_is_named():
    model = mlp(hidden=4)
    model.graph.node[2].input[0] = "ghost"
    with pytest.raises(ModelLoadError, match="node 'relu' \\(Relu\\) reads 'ghost'"):
        InferenceSession(model)


def test_unsupported_op_names_node_and_op():
    node = helper.make_node("FancyOp", ["x"], ["y"], name="fancy", domain="acme")
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("acme", 1)]
    )
    with pytest.raises(
        UnsupportedOpError, match=r"node 'fancy' \(acme::FancyOp, opset 1\).*no kernel"
    ):
        InferenceSession(model)


def test_kernel_failure_names_node_op_and_inputs():
    node = helper.make_node("Reshape", ["x", "shape"], ["y"], name="bad_reshape")
    graph = helper.make_graph(
        [node],
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
            helper.make_tensor_value_info("shape", TensorProto.INT64, [1]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    sess = InferenceSession(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]))
    with pytest.raises(
        KernelError, match=r"node 'bad_reshape' \(ai.onnx::Reshape.*x=float32\[2, 3\]"
    ):
        sess.run(None, {"x": np.zeros((2, 3), np.float32), "shape": np.array([7], np.int64)})


def _save_with_external_data(model: onnx.ModelProto, folder, location: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    onnx.save_model(
        copy.deepcopy(model),
        str(folder / "model.onnx"),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=location,
        size_threshold=0,
    )


def test_external_data_inside_the_folder_loads(tmp_path):
    model = mlp(hidden=8)
    _save_with_external_data(model, tmp_path / "m", "weights.bin")
    x = np.ones((1, 8), np.float32)
    (y,) = InferenceSession(tmp_path / "m").run(None, {"x": x})
    np.testing.assert_allclose(y, mlp_reference(model, x), rtol=1e-5, atol=1e-6)


def _model_with_external_weight(tmp_path, location: str, **fields: str):
    """mlp() whose first weight is external data at ``location`` (its bytes are written to
    ``tmp_path/outside.bin``), saved as ``tmp_path/m/model.onnx``."""
    model = mlp(hidden=8)
    w = model.graph.initializer[0]
    data = numpy_helper.to_array(w).tobytes()
    (tmp_path / "outside.bin").write_bytes(data)
    w.ClearField("float_data")
    w.ClearField("raw_data")
    w.data_location = TensorProto.EXTERNAL
    for key, value in {"location": location, "length": str(len(data)), **fields}.items():
        entry = w.external_data.add()
        entry.key, entry.value = key, value
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "model.onnx").write_bytes(model.SerializeToString())
    return model, folder


@pytest.mark.parametrize(
    ("location", "why"),
    [("../outside.bin", "outside the model folder"), ("/etc/passwd", "is an absolute path")],
)
def test_external_data_escaping_the_folder_is_refused(tmp_path, location, why):
    _, folder = _model_with_external_weight(tmp_path, location)
    with pytest.raises(ModelLoadError, match=f"'w1'.*{location!r}.*{why}"):
        InferenceSession(folder / "model.onnx")


def test_external_data_symlinked_out_of_the_folder_is_refused(tmp_path):
    # The link sits inside the folder, but the bytes it points at do not.
    _, folder = _model_with_external_weight(tmp_path, "weights.bin")
    (folder / "weights.bin").symlink_to(tmp_path / "outside.bin")
    with pytest.raises(ModelLoadError, match=r"'weights.bin' resolves to .*outside\.bin, outside"):
        InferenceSession(folder / "model.onnx")
    # A link that stays inside the folder is fine.
    (folder / "weights.bin").unlink()
    (tmp_path / "outside.bin").rename(folder / "real.bin")
    (folder / "weights.bin").symlink_to(folder / "real.bin")
    x = np.ones((1, 8), np.float32)
    (y,) = InferenceSession(folder / "model.onnx").run(None, {"x": x})
    np.testing.assert_allclose(y, mlp_reference(mlp(hidden=8), x), rtol=1e-5, atol=1e-6)


def test_external_data_in_a_symlinked_directory_out_of_the_folder_is_refused(tmp_path):
    _, folder = _model_with_external_weight(tmp_path, "sub/outside.bin")
    (folder / "sub").symlink_to(tmp_path, target_is_directory=True)
    with pytest.raises(ModelLoadError, match=r"'sub/outside.bin' resolves to .*, outside"):
        InferenceSession(folder / "model.onnx")


def test_model_file_symlinked_out_of_its_folder_is_refused(tmp_path):
    model = mlp(hidden=8)
    _save_with_external_data(model, tmp_path / "elsewhere", "weights.bin")
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "model.onnx").symlink_to(tmp_path / "elsewhere" / "model.onnx")
    with pytest.raises(ModelLoadError, match=r"model file = 'model.onnx' resolves to .*elsewhere"):
        InferenceSession(folder)
    with pytest.raises(ModelLoadError, match="outside the model folder"):
        InferenceSession(folder / "model.onnx")


def test_a_symlinked_model_folder_loads(tmp_path):
    # The folder itself may be a link (a "current" release, say): its contents are inside.
    model = mlp(hidden=8)
    _save_with_external_data(model, tmp_path / "v2", "weights.bin")
    (tmp_path / "current").symlink_to(tmp_path / "v2", target_is_directory=True)
    x = np.ones((1, 8), np.float32)
    (y,) = InferenceSession(tmp_path / "current" / "model.onnx").run(None, {"x": x})
    np.testing.assert_allclose(y, mlp_reference(model, x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"offset": "-4"}, "offset must be non-negative"),
        (
            {"length": str(10**12)},
            r"wants 1000000000000 bytes at offset 0 of .*which has \d+ bytes",
        ),
        ({"offset": "64"}, r"wants \d+ bytes at offset 64"),
    ],
)
def test_external_data_ranges_are_checked_before_reading(tmp_path, fields, match):
    _, folder = _model_with_external_weight(tmp_path, "outside.bin", **fields)
    (tmp_path / "outside.bin").rename(folder / "outside.bin")
    with pytest.raises(ModelLoadError, match=match):
        InferenceSession(folder / "model.onnx")


def test_a_model_file_over_protobufs_limit_is_refused_before_reading(tmp_path):
    path = tmp_path / "model.onnx"
    with open(path, "wb") as f:  # a sparse 2 GiB file: no disk is used
        f.truncate(2**31)
    with pytest.raises(ModelLoadError, match=r"is 2.0 GiB; an ONNX file holds at most 2 GiB"):
        InferenceSession(path)


def test_constant_folding_removes_initializer_only_subgraphs():
    nodes = [
        helper.make_node("Shape", ["w"], ["ws"], name="shape_of_w"),
        helper.make_node("Reshape", ["w", "ws"], ["w2"], name="reshape_w"),
        helper.make_node("Add", ["x", "w2"], ["y"], name="add"),
    ]
    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
        [numpy_helper.from_array(w, "w")],
    )
    sess = InferenceSession(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]))
    assert sess.plan.folded == 2
    assert [s.node.name for s in sess.plan.steps] == ["add"]
    (y,) = sess.run(None, {"x": np.ones((2, 3), np.float32)})
    np.testing.assert_array_equal(y, w + 1)


def test_unsorted_graph_is_ordered_topologically():
    model = mlp(hidden=4)
    nodes = list(model.graph.node)
    del model.graph.node[:]
    model.graph.node.extend(reversed(nodes))
    x = np.ones((1, 4), np.float32)
    (y,) = InferenceSession(model).run(None, {"x": x})
    np.testing.assert_allclose(y, mlp_reference(model, x), rtol=1e-5, atol=1e-6)


def _gated_mlp(keep_act: bool) -> onnx.ModelProto:
    """y = (g * sigmoid(g)) * u with g = x @ wg, u = x @ wu; optionally exposing the act."""
    rng = np.random.default_rng(11)
    wg = rng.standard_normal((8, 12)).astype(np.float32)
    wu = rng.standard_normal((8, 12)).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "wg"], ["g"], name="gate"),
        helper.make_node("MatMul", ["x", "wu"], ["u"], name="up"),
        helper.make_node("Sigmoid", ["g"], ["s"], name="sig"),
        helper.make_node("Mul", ["s", "g"], ["act"], name="act"),  # operands swapped on purpose
        helper.make_node("Mul", ["u", "act"], ["y"], name="mul"),
    ]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 12])]
    if keep_act:
        outputs.append(helper.make_tensor_value_info("act", TensorProto.FLOAT, ["b", 12]))
    graph = helper.make_graph(
        nodes,
        "gated",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 8])],
        outputs,
        [numpy_helper.from_array(wg, "wg"), numpy_helper.from_array(wu, "wu")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


@pytest.mark.parametrize("keep_act", [False, True])
def test_gated_mlp_fuses_unless_the_act_is_an_output(keep_act):
    model = _gated_mlp(keep_act)
    sess = InferenceSession(model)
    ops = [s.node.op_type for s in sess.plan.steps]
    if keep_act:
        assert sess.plan.fused == 0 and ops.count("Sigmoid") == 1
    else:  # SiluMul, then gate and up as one projection onto [wg | wu]
        assert sess.plan.fused == 2 and ops == ["MatMul", "SiluMul"]
        assert "wg" not in sess.plan.constants and "wu" not in sess.plan.constants
    x = np.random.default_rng(5).standard_normal((3, 8)).astype(np.float32)
    (y,) = sess.run(["y"], {"x": x})
    w = {i.name: numpy_helper.to_array(i).astype(np.float64) for i in model.graph.initializer}
    g, u = x.astype(np.float64) @ w["wg"], x.astype(np.float64) @ w["wu"]
    np.testing.assert_allclose(y, g / (1 + np.exp(-g)) * u, rtol=1e-5, atol=1e-5)


def _decomposed_rms_norm(variant: str) -> onnx.ModelProto:
    """y = w * (x * 1 / sqrt(mean(x^2, -1) + eps)), as torch's dynamo exporter writes it."""
    rng = np.random.default_rng(12)
    w = rng.standard_normal(16).astype(np.float32)
    axes = [0] if variant == "first_axis" else [-1]
    inits = [
        numpy_helper.from_array(w, "w"),
        numpy_helper.from_array(np.array(2.0, np.float32), "two"),
        numpy_helper.from_array(np.array(1e-6, np.float32), "eps"),
        numpy_helper.from_array(np.array(1.0, np.float32), "one"),
        numpy_helper.from_array(np.array(axes, np.int64), "axes"),
    ]
    inv = [helper.make_node("Reciprocal", ["root"], ["inv"])]
    if variant == "div":
        inv = [helper.make_node("Div", ["one", "root"], ["inv"])]
    nodes = [
        helper.make_node("Pow", ["x", "two"], ["sq"]),
        helper.make_node("ReduceMean", ["sq", "axes"], ["mean"], keepdims=1),
        helper.make_node("Add", ["mean", "eps"], ["var"]),
        helper.make_node("Sqrt", ["var"], ["root"]),
        *inv,
        helper.make_node("Mul", ["x", "inv"], ["normed"]),
        helper.make_node("Mul", ["w", "normed"], ["y"]),
    ]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 16])]
    if variant == "mean_is_output":
        outputs.append(helper.make_tensor_value_info("mean", TensorProto.FLOAT, [3, 1]))
    graph = helper.make_graph(
        nodes,
        "rms",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 16])],
        outputs,
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize("variant", ["reciprocal", "div", "first_axis", "mean_is_output"])
def test_decomposed_rms_norm_fuses_into_one_step(variant):
    model = _decomposed_rms_norm(variant)
    sess = InferenceSession(model)
    ops = [s.node.op_type for s in sess.plan.steps]
    if variant in ("reciprocal", "div"):
        assert ops == ["SimplifiedLayerNormalization"] and sess.plan.fused == 1
    else:  # another axis, or an intermediate the caller wants: left as written
        assert "SimplifiedLayerNormalization" not in ops and len(ops) == 7
    x = np.random.default_rng(6).standard_normal((3, 16)).astype(np.float32)
    y = sess.run(["y"], {"x": x})[0]
    w = numpy_helper.to_array(model.graph.initializer[0]).astype(np.float64)
    x64 = x.astype(np.float64)
    axis = 0 if variant == "first_axis" else -1
    want = w * x64 / np.sqrt(np.mean(x64**2, axis=axis, keepdims=True) + 1e-6)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sum_is_read", [False, True])
def test_residual_add_and_rms_norm_fuse_into_skip_norm(sum_is_read):
    rng = np.random.default_rng(13)
    w = rng.standard_normal(16).astype(np.float32)
    nodes = [
        helper.make_node("Add", ["a", "b"], ["r"]),
        helper.make_node("SimplifiedLayerNormalization", ["r", "w"], ["y"], axis=-1, epsilon=1e-5),
    ]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, 16])]
    if sum_is_read:  # the residual stream goes on: the fused step keeps the sum as output 3
        nodes.append(helper.make_node("Mul", ["r", "r"], ["z"]))
        outputs.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, [2, 3, 16]))
    value = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3, 16]) for n in "ab"]
    graph = helper.make_graph(nodes, "skip", value, outputs, [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    sess = InferenceSession(model)
    ops = [s.node.op_type for s in sess.plan.steps]
    assert ops[0] == "SkipSimplifiedLayerNormalization" and "Add" not in ops
    a, b = (rng.standard_normal((2, 3, 16)).astype(np.float32) for _ in range(2))
    got = sess.run(None, {"a": a, "b": b})
    r = a.astype(np.float64) + b
    want = w * r / np.sqrt(np.mean(r * r, axis=-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-5)
    if sum_is_read:
        np.testing.assert_allclose(got[1], r * r, rtol=1e-5, atol=1e-5)


def test_exporter_style_head_fuses_to_three_steps_and_matches_float64():
    from tests.models import decomposed_head, decomposed_head_reference

    model = decomposed_head()
    sess = InferenceSession(model)
    ops = [s.node.op_type for s in sess.plan.steps]
    assert ops == ["SkipSimplifiedLayerNormalization", "MatMul", "ArgMaxProb"], ops
    rng = np.random.default_rng(3)
    a, b = (rng.standard_normal((1, 2, 24)).astype(np.float32) for _ in range(2))
    draft, conf = sess.run(None, {"a": a, "b": b})
    logits, want_draft, want_conf = decomposed_head_reference(model, a, b)
    top2 = np.sort(logits, axis=-1)[..., -2:]
    assert np.all(top2[..., 1] - top2[..., 0] > 1e-4), "fixture has a near tie"
    np.testing.assert_array_equal(draft, want_draft)
    np.testing.assert_allclose(conf, want_conf, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("sum_is_read", [False, True])
def test_replayed_skip_norm_and_silu_mul_match_float64(sum_is_read):
    """The prebound replay calls of SkipSimplifiedLayerNormalization (with and without its
    sum output) and SiluMul give float64 results step after step, on new inputs."""
    from onnx_genrt.core.graph_slots import DeviceGraphSlot

    rng = np.random.default_rng(21)
    w = rng.standard_normal(16).astype(np.float32)
    nodes = [
        helper.make_node("Add", ["a", "b"], ["r"]),
        helper.make_node("SimplifiedLayerNormalization", ["r", "w"], ["n"], axis=-1, epsilon=1e-5),
        helper.make_node("Sigmoid", ["n"], ["s"]),
        helper.make_node("Mul", ["n", "s"], ["act"]),
        helper.make_node("Mul", ["act", "a"], ["y"]),
    ]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 16])]
    if sum_is_read:
        nodes.append(helper.make_node("Mul", ["r", "r"], ["z"]))
        outputs.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, 3, 16]))
    value = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 3, 16]) for n in "ab"]
    graph = helper.make_graph(nodes, "blk", value, outputs, [numpy_helper.from_array(w, "w")])
    sess = InferenceSession(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    assert [s.node.op_type for s in sess.plan.steps][:2] == [
        "SkipSimplifiedLayerNormalization",
        "SiluMul",
    ]
    binding = sess.io_binding()
    a = binding.bind_input("a", np.zeros((1, 3, 16), np.float32))
    b = binding.bind_input("b", np.zeros((1, 3, 16), np.float32))
    outs = {o.name: binding.bind_output(o.name, shape=(1, 3, 16)) for o in outputs}
    for _ in range(5):
        a[...] = rng.standard_normal(a.shape)
        b[...] = rng.standard_normal(b.shape)
        sess.run_with_iobinding(binding, DeviceGraphSlot.PRIMARY)
        r = a.astype(np.float64) + b
        n = w * r / np.sqrt(np.mean(r * r, axis=-1, keepdims=True) + 1e-5)
        np.testing.assert_allclose(outs["y"], n / (1 + np.exp(-n)) * a, rtol=1e-5, atol=1e-5)
        if sum_is_read:
            np.testing.assert_allclose(outs["z"], r * r, rtol=1e-5, atol=1e-5)
    stats = sess.graph_stats(DeviceGraphSlot.PRIMARY)
    assert stats.replays >= 3 and stats.fallbacks == 0
    graph_calls = sess.main_provider.recorded_graph(DeviceGraphSlot.PRIMARY)
    assert graph_calls.bound == len(graph_calls.calls)  # every call prebound


def _constants_in_attributes_model() -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """y = If(cond, then: Constant a, else: Constant b) + Constant c: every weight is a node
    attribute, two of them inside subgraphs."""
    rng = np.random.default_rng(4)
    values = {n: rng.standard_normal(64).astype(np.float32) for n in "abc"}

    def branch(name: str) -> onnx.GraphProto:
        const = numpy_helper.from_array(values[name], name)
        node = helper.make_node("Constant", [], [name], value=const)
        out = helper.make_tensor_value_info(name, TensorProto.FLOAT, [64])
        return helper.make_graph([node], f"{name}_branch", [], [out])

    nodes = [
        helper.make_node(
            "If", ["cond"], ["picked"], then_branch=branch("a"), else_branch=branch("b")
        ),
        helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(values["c"], "c")),
        helper.make_node("Add", ["picked", "c"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "attr_consts",
        [helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [64])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), values


def _externalize(tensor: TensorProto, folder, location: str) -> None:
    """Move ``tensor``'s bytes to ``folder/location`` and point it there."""
    data = numpy_helper.to_array(tensor).tobytes()
    (folder / location).write_bytes(data)
    tensor.ClearField("raw_data")
    tensor.ClearField("float_data")
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in {"location": location, "length": str(len(data))}.items():
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value


def _then_constant(model: onnx.ModelProto) -> TensorProto:
    branches = {a.name: a.g for a in model.graph.node[0].attribute}
    return branches["then_branch"].node[0].attribute[0].t


def test_external_data_of_attribute_and_subgraph_tensors_loads_and_is_contained(tmp_path):
    model, values = _constants_in_attributes_model()
    folder = tmp_path / "m"
    folder.mkdir()
    _externalize(_then_constant(model), folder, "a.bin")
    _externalize(model.graph.node[1].attribute[0].t, folder, "c.bin")
    (folder / "model.onnx").write_bytes(model.SerializeToString())
    loaded = load_model(folder / "model.onnx")
    for name, tensor in (("a", _then_constant(loaded)), ("c", loaded.graph.node[1].attribute[0].t)):
        assert tensor.data_location == TensorProto.DEFAULT and not tensor.external_data
        np.testing.assert_array_equal(numpy_helper.to_array(tensor), values[name])
    # The subgraph's tensor pointing outside the folder: refused.
    (tmp_path / "outside.bin").write_bytes((folder / "a.bin").read_bytes())
    for entry in _then_constant(model).external_data:
        if entry.key == "location":
            entry.value = "../outside.bin"
    (folder / "model.onnx").write_bytes(model.SerializeToString())
    with pytest.raises(ModelLoadError, match=r"'a'.*'\.\./outside\.bin'.*outside the model folder"):
        load_model(folder / "model.onnx")


def test_graph_stats_take_a_slot_or_its_name_and_refuse_an_unknown_name():
    from onnx_genrt.core.graph_slots import DeviceGraphSlot

    sess = InferenceSession(mlp(hidden=4), providers=["cpu"])
    binding = sess.io_binding()
    binding.bind_input("x", np.ones((2, 4), np.float32))
    binding.bind_output("y", shape=(2, 4), dtype=np.float32)
    for _ in range(3):
        sess.run_with_iobinding(binding, DeviceGraphSlot.VERIFY)
    by_name, by_slot = sess.graph_stats("verify"), sess.graph_stats(DeviceGraphSlot.VERIFY)
    assert by_name == by_slot and by_slot.replays >= 1
    with pytest.raises(InvalidInputError, match=r"no graph slot 'Verify'.*\['primary', 'verify'"):
        sess.graph_stats("Verify")
    assert set(sess.all_graph_stats()) <= {s.value for s in DeviceGraphSlot}
