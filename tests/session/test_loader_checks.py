"""Edges of ``session.loader`` (found by a mutation run: external data without a length,
external node attributes with mapping on, a missing external file, external data given
without a path, the model file size limit's boundary, an empty file, a model importing no
opset, a graph output nothing makes, the onnx_genrt domain's version and an initializer with
a zero dim had no test). Values are checked against numpy float64 (``mlp_reference``), the
arrays the model was made from and onnxruntime."""

from __future__ import annotations

import copy

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_genrt.core.errors import ModelLoadError
from onnx_genrt.session import InferenceSession, load_model, open_model
from onnx_genrt.session import loader as loader_module

from ..models import mlp, mlp_reference
from .test_session import (
    _constants_in_attributes_model,
    _externalize,
    _model_with_external_weight,
    _then_constant,
)

X = np.random.default_rng(7).standard_normal((3, 8)).astype(np.float32)


def _point_at(tensor: TensorProto, **fields: str) -> None:
    """Make ``tensor`` external data with exactly ``fields`` (no bytes in the proto)."""
    tensor.ClearField("float_data")
    tensor.ClearField("raw_data")
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in fields.items():
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value


def test_external_data_without_a_length_runs_to_the_end_of_its_file(tmp_path):
    """No ``length`` means the rest of the file after ``offset`` (ONNX's rule): w1 is a
    whole file with no offset either, w2 the end of a file after 12 bytes of padding."""
    model = mlp(hidden=8)
    ref = copy.deepcopy(model)
    folder = tmp_path / "m"
    folder.mkdir()
    w1, _, w2, _ = model.graph.initializer
    (folder / "w1.bin").write_bytes(numpy_helper.to_array(w1).tobytes())
    (folder / "rest.bin").write_bytes(b"\x7f" * 12 + numpy_helper.to_array(w2).tobytes())
    _point_at(w1, location="w1.bin")
    _point_at(w2, location="rest.bin", offset="12")
    (folder / "model.onnx").write_bytes(model.SerializeToString())
    loaded = {t.name: numpy_helper.to_array(t) for t in load_model(folder).graph.initializer}
    for tensor in ref.graph.initializer:
        np.testing.assert_array_equal(loaded[tensor.name], numpy_helper.to_array(tensor))
    (y,) = InferenceSession(folder).run(None, {"x": X})  # w1 mapped, w2 read (misaligned)
    np.testing.assert_allclose(y, mlp_reference(ref, X), rtol=1e-5, atol=1e-6)


def test_external_node_attributes_are_read_into_the_proto_when_weights_are_mapped(tmp_path):
    """Only graph initializers are mapped; an external Constant attribute (in a subgraph or
    not) is read into its proto, and a session runs on its values."""
    model, values = _constants_in_attributes_model()
    folder = tmp_path / "m"
    folder.mkdir()
    _externalize(_then_constant(model), folder, "a.bin")
    _externalize(model.graph.node[1].attribute[0].t, folder, "c.bin")
    (folder / "model.onnx").write_bytes(model.SerializeToString())
    opened = open_model(folder)
    assert opened.weights == {}
    for name, tensor in (
        ("a", _then_constant(opened.proto)),
        ("c", opened.proto.graph.node[1].attribute[0].t),
    ):
        assert tensor.data_location == TensorProto.DEFAULT and not tensor.external_data
        np.testing.assert_array_equal(numpy_helper.to_array(tensor), values[name])
    # The CPU provider has no If: run y = x + Constant c on its own.
    shift = np.linspace(-1, 1, 8, dtype=np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(shift, "c")),
            helper.make_node("Add", ["x", "c"], ["y"]),
        ],
        "shifted",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 8])],
    )
    shifted = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    _externalize(shifted.graph.node[0].attribute[0].t, folder, "shift.bin")
    (folder / "shifted.onnx").write_bytes(shifted.SerializeToString())
    (y,) = InferenceSession(folder / "shifted.onnx").run(None, {"x": X})
    np.testing.assert_allclose(y, X.astype(np.float64) + shift, rtol=1e-6)


@pytest.mark.parametrize("what", ["missing.bin", "a_folder"])
def test_an_external_data_location_that_is_no_file_is_named(tmp_path, what):
    _, folder = _model_with_external_weight(tmp_path, what)
    (folder / "a_folder").mkdir()
    with pytest.raises(
        ModelLoadError, match=rf"tensor 'w1': external data file missing: .*m/{what}$"
    ):
        InferenceSession(folder / "model.onnx")


@pytest.mark.parametrize("form", ["proto", "bytes"])
def test_external_data_given_without_a_path_is_refused(tmp_path, form):
    model, folder = _model_with_external_weight(tmp_path, "outside.bin")
    (tmp_path / "outside.bin").rename(folder / "outside.bin")
    source = model if form == "proto" else model.SerializeToString()
    with pytest.raises(ModelLoadError, match="refers to external data but was given without"):
        InferenceSession(source)
    (y,) = InferenceSession(folder).run(None, {"x": X})  # from its file: loads
    np.testing.assert_allclose(y, mlp_reference(mlp(hidden=8), X), rtol=1e-5, atol=1e-6)


def test_a_model_file_of_exactly_the_size_limit_is_read(tmp_path, monkeypatch):
    """The limit is the largest size protobuf parses: a file of that size loads, one byte
    more is refused before reading (the limit lowered to a small model's size)."""
    model = mlp(hidden=8)
    path = tmp_path / "model.onnx"
    path.write_bytes(model.SerializeToString())
    size = path.stat().st_size
    monkeypatch.setattr(loader_module, "MAX_PROTO_BYTES", size)
    (y,) = InferenceSession(path).run(None, {"x": X})
    np.testing.assert_allclose(y, mlp_reference(model, X), rtol=1e-5, atol=1e-6)
    monkeypatch.setattr(loader_module, "MAX_PROTO_BYTES", size - 1)
    with pytest.raises(ModelLoadError, match="an ONNX file holds at most 2 GiB"):
        InferenceSession(path)


def _relu_graph(outputs=("y",)) -> onnx.GraphProto:
    return helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"], name="relu")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 8])],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, [3, 8]) for name in outputs],
    )


def test_an_empty_file_is_a_model_without_a_graph(tmp_path):
    """Zero bytes parse as an empty ModelProto: refused for its missing graph, not for
    what an empty graph lacks further on."""
    (tmp_path / "model.onnx").write_bytes(b"")
    with pytest.raises(ModelLoadError, match=r"model.onnx is not a valid ONNX model: it has no"):
        InferenceSession(tmp_path / "model.onnx")


def test_a_model_importing_no_opset_is_refused():
    model = helper.make_model(_relu_graph(), opset_imports=[])
    with pytest.raises(ModelLoadError, match="^model imports no opset$"):
        InferenceSession(model)
    with pytest.raises(Exception):  # noqa: B017 - onnxruntime refuses it too, its own way
        ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def test_a_graph_output_nothing_makes_is_refused():
    model = helper.make_model(
        _relu_graph(outputs=("y", "ghost")), opset_imports=[helper.make_opsetid("", 21)]
    )
    with pytest.raises(ModelLoadError, match="graph output 'ghost' is produced by no node"):
        InferenceSession(model)
    with pytest.raises(Exception):  # noqa: B017
        ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _silu_mul(genrt_opset: int) -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("SiluMul", ["g", "u"], ["y"], domain="onnx_genrt")],
        "silu",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [3, 8]) for n in "gu"],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 8])],
    )
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("onnx_genrt", genrt_opset)]
    return helper.make_model(graph, opset_imports=opsets)


def test_the_onnx_genrt_domain_has_version_1_only():
    rng = np.random.default_rng(8)
    g, u = rng.standard_normal((2, 3, 8)).astype(np.float32)
    (y,) = InferenceSession(_silu_mul(1)).run(None, {"g": g, "u": u})
    g64 = g.astype(np.float64)
    np.testing.assert_allclose(y, g64 / (1 + np.exp(-g64)) * u, rtol=1e-6, atol=1e-7)
    with pytest.raises(
        ModelLoadError,
        match=r"opset 2 of 'onnx_genrt', newer than this runtime supports \(1\.\.1;",
    ):
        InferenceSession(_silu_mul(2))


def test_an_initializer_with_a_zero_dim_is_an_empty_tensor():
    """Dims of 0 are a tensor with no elements (only negative dims are refused):
    concatenated to x it leaves x, as in onnxruntime."""
    graph = helper.make_graph(
        [helper.make_node("Concat", ["x", "none"], ["y"], axis=0)],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 8])],
        [numpy_helper.from_array(np.zeros((0, 8), np.float32), "none")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    (y,) = InferenceSession(model).run(None, {"x": X})
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(y, ref.run(None, {"x": X})[0])
    np.testing.assert_array_equal(y, X)
