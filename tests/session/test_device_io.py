"""The session's transfer door (session/device_io.py), the engine's only road to memory."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from onnx_genrt.session import InferenceSession


def _session() -> InferenceSession:
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    return InferenceSession(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]))


def test_upload_copies_write_read_and_copy():
    io = _session().device_io
    host = np.arange(6, dtype=np.float32).reshape(2, 3)
    a = io.upload(host)
    host[:] = -1  # the upload is a copy, not a view of the host array
    np.testing.assert_array_equal(io.read([a])[0], np.arange(6, dtype=np.float32).reshape(2, 3))
    b = io.upload(np.zeros((2, 3), np.float32))
    io.write(b, np.full((2, 3), 7, np.float32))
    io.copy(b[0], a[1])
    later = io.read_later([a, b])
    got_a, got_b = later()
    np.testing.assert_array_equal(got_a, [[0, 1, 2], [7, 7, 7]])
    np.testing.assert_array_equal(got_b, np.full((2, 3), 7))
    assert io.holds(a) and not io.holds([1, 2])
    assert io.reads_async is False
    assert io.memory_limit() is None or io.memory_limit() > 0


def test_sibling_shares_the_provider_instances():
    sess = _session()
    other = sess.sibling(sess.model)
    assert other.providers == sess.providers
    assert other.main_provider is sess.main_provider
    x = np.array([-1.0, 2.0], np.float32)
    np.testing.assert_array_equal(other.run(None, {"x": x})[0], np.maximum(x, 0))
