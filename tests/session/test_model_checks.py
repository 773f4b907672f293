"""Models the runtime must not run as if nothing were wrong: opsets newer than it knows,
initializers with negative dims, outputs whose computed type differs from the declared one.
onnxruntime (the reference) refuses each of them too."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper

from onnx_genrt.core.errors import InvalidInputError, KernelError, ModelLoadError
from onnx_genrt.session import InferenceSession
from onnx_genrt.session.loader import supported_opsets

X = np.array([-1.0, 2.0], np.float32)


def _relu(opset: int, domain: str = "", out_type: int = TensorProto.FLOAT) -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"], name="relu")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", out_type, [2])],
    )
    imports = [helper.make_opsetid("", opset if domain == "" else 17)]
    if domain:
        imports.append(helper.make_opsetid(domain, opset))
    return helper.make_model(graph, opset_imports=imports)


def _ort_refuses(model: onnx.ModelProto, feeds: dict) -> None:
    with pytest.raises(Exception):  # noqa: B017 - onnxruntime's own error types
        sess = onnxruntime.InferenceSession(
            model.SerializeToString(), providers=["CPUExecutionProvider"]
        )
        sess.run(None, feeds)


def test_the_newest_known_opset_runs():
    newest = onnx.defs.onnx_opset_version()
    assert supported_opsets()[""] == newest
    (y,) = InferenceSession(_relu(newest)).run(None, {"x": X})
    np.testing.assert_array_equal(y, np.maximum(X, 0))


@pytest.mark.parametrize(
    ("domain", "version", "message"),
    [
        ("", 999, "opset 999 of 'ai.onnx', newer than this runtime supports (1..{newest}"),
        ("", 0, "opset 0 of 'ai.onnx'; versions start at 1"),
        ("com.microsoft", 2, "opset 2 of 'com.microsoft', newer than this runtime supports (1..1"),
        ("ai.onnx.ml", 99, "opset 99 of 'ai.onnx.ml', newer than this runtime supports"),
    ],
)
def test_opsets_outside_the_known_range_are_refused(domain, version, message):
    model = _relu(version, domain)
    with pytest.raises(ModelLoadError) as info:
        InferenceSession(model)
    assert message.format(newest=onnx.defs.onnx_opset_version()) in str(info.value)
    if domain == "":
        _ort_refuses(model, {"x": X})


@pytest.mark.parametrize("dims", [[-1, 4], [2, -2]])
def test_an_initializer_with_a_negative_dim_is_refused(dims):
    init = onnx.TensorProto(name="w", data_type=TensorProto.FLOAT, dims=dims)
    graph = helper.make_graph(
        [helper.make_node("Identity", ["w"], ["y"])],
        "g",
        [],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [init],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(ModelLoadError, match=rf"initializer 'w' has dims \{dims}"):
        InferenceSession(model)
    _ort_refuses(model, {})


def test_an_output_of_another_type_than_declared_is_an_error():
    model = _relu(17, out_type=TensorProto.INT64)
    sess = InferenceSession(model)
    with pytest.raises(
        KernelError, match="output 'y' came back as float32, but the model declares int64"
    ):
        sess.run(None, {"x": X})
    # A bound run: the output buffer has the declared type, the kernel makes another one.
    b = sess.io_binding()
    b.bind_input("x", X)
    b.bind_output("y", shape=(2,))
    with pytest.raises(
        KernelError, match="output 'y' .* is float32, but the bound buffer is int64"
    ):
        sess.run_with_iobinding(b)
    with pytest.raises(
        InvalidInputError, match="output 'y' is declared int64; a buffer of float32"
    ):
        b.bind_output("y", np.zeros(2, np.float32))
    _ort_refuses(model, {"x": X})


def test_a_declared_output_type_that_matches_runs():
    (y,) = InferenceSession(_relu(17)).run(None, {"x": X})
    assert y.dtype == np.float32
