"""pytest-benchmark: one 4-bit MatMulNBits (K=768, N=3584: the merged gate and up projection
of a hidden-768 model) at the decode (M=1) and verify (M=5) sizes, accuracy_level 4 and 1, in
onnx-genrt's CPU provider and in onnxruntime, single-threaded.

``pytest tests/bench --benchmark-enable`` times them; the normal test run executes each body
once and checks it against onnxruntime at the same accuracy level. Each call is a whole
``session.run``: onnx-genrt's eager run adds its own per-call cost (about 30 µs on the 2-core
CPU, docs/performance.md), which decode steps replaying a graph do not pay.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper, numpy_helper

K, N, BLOCK = 768, 3584, 32


def _model(level: int):
    rng = np.random.default_rng(0)
    nb = K // BLOCK
    weights = {
        "B": rng.integers(0, 256, (N, nb, BLOCK // 2), dtype=np.uint8),
        "scales": (rng.random((N, nb)) * 0.02).astype(np.float32),
    }
    node = helper.make_node(
        "MatMulNBits",
        ["A", "B", "scales"],
        ["Y"],
        domain="com.microsoft",
        K=K,
        N=N,
        bits=4,
        block_size=BLOCK,
        accuracy_level=level,
    )
    graph = helper.make_graph(
        [node],
        "nbits",
        [helper.make_tensor_value_info("A", 1, ["m", K])],
        [helper.make_tensor_value_info("Y", 1, None)],
        [numpy_helper.from_array(v, k) for k, v in weights.items()],
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)],
    )
    model.ir_version = 10
    return model


def _ours(model):
    from onnx_genrt.session import InferenceSession

    sess = InferenceSession(model, providers=[("cpu", {"threads": 1})])
    return lambda a: sess.run(None, {"A": a})[0]


def _onnxruntime(model):
    ort = pytest.importorskip("onnxruntime")
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    sess = ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    return lambda a: sess.run(None, {"A": a})[0]


RUNTIMES = {"onnx-genrt": _ours, "onnxruntime": _onnxruntime}


@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("level", [4, 1])
@pytest.mark.parametrize("runtime", list(RUNTIMES))
def test_matmul_nbits(benchmark, runtime, level, m):
    benchmark.group = f"matmul-nbits-4bit-K{K}-N{N}-m{m}-level{level}"
    model = _model(level)
    run = RUNTIMES[runtime](model)
    a = np.random.default_rng(m).standard_normal((m, K)).astype(np.float32)
    run(a)  # warm-up: prepares the weight, compiles
    y = benchmark(run, a)
    want = _onnxruntime(model)(a)
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
