"""Numba kernels compile once: a second process loads them from the on-disk cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys

SCRIPT = r"""
import json
import numpy as np
from onnx import TensorProto, helper
from onnx_genrt.session import InferenceSession
from onnx_genrt.providers.cpu.kernels import _nn_common

node = helper.make_node("Softmax", ["x"], ["y"], axis=-1)
graph = helper.make_graph(
    [node], "g",
    [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 5])],
    [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 5])],
)
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
(y,) = InferenceSession(model).run(None, {"x": np.arange(15, dtype=np.float32).reshape(3, 5)})
assert np.allclose(y.sum(-1), 1.0)
stats = {}
for name in dir(_nn_common):
    fn = getattr(_nn_common, name)
    if hasattr(fn, "stats") and hasattr(fn, "signatures") and fn.signatures:
        stats[name] = [sum(fn.stats.cache_hits.values()), sum(fn.stats.cache_misses.values())]
print(json.dumps(stats))
"""


def _run(cache_dir) -> dict[str, list[int]]:
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache_dir)}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, check=False
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_second_process_loads_compiled_kernels_from_disk(tmp_path):
    first = _run(tmp_path)
    assert first, "the softmax path compiled no Numba function"
    assert sum(misses for _, misses in first.values()) > 0
    second = _run(tmp_path)
    assert second, "nothing was loaded in the second process"
    for name, (hits, misses) in second.items():
        assert misses == 0, (name, hits, misses)
    assert sum(hits for hits, _ in second.values()) > 0
