"""The CUDA provider's kernel modules import and register every op the engine relies on,
checked without a GPU (CuPy replaced by a stub in a child process): a module that loses a
registration fails here, not only in the GPU lane."""

from __future__ import annotations

import json
import subprocess
import sys

#: Ops the LLM graphs (builder, dynamo export, MTP chain, fusions) need on CUDA.
REQUIRED = {
    ("", "Gather"),
    ("", "Slice"),
    ("", "Concat"),
    ("", "Reshape"),
    ("", "Transpose"),
    ("", "MatMul"),
    ("", "ArgMax"),
    ("", "Softmax"),
    ("", "Cast"),
    ("", "Add"),
    ("", "SimplifiedLayerNormalization"),
    ("com.microsoft", "GroupQueryAttention"),
    ("com.microsoft", "MatMulNBits"),
    ("com.microsoft", "SkipSimplifiedLayerNormalization"),
    ("com.microsoft", "GatherBlockQuantized"),
    ("onnx_genrt", "SiluMul"),
    ("onnx_genrt", "ArgMaxProb"),
    ("onnx_genrt", "NormMatMul"),
    ("onnx_genrt", "NormMatMulNBits"),
    ("onnx_genrt", "SiluMulMatMul"),
    ("onnx_genrt", "SiluMulMatMulNBits"),
    ("onnx_genrt", "MTPAccept"),
    ("onnx_genrt", "MTPNextInputs"),
}

_CHILD = """
import json, sys
from unittest import mock
class Stub(mock.MagicMock):
    def _get_child_mock(self, **kw):
        child = Stub(**kw)
        child.__name__ = str(kw.get("name") or "stub")
        return child
sys.modules["cupy"] = Stub()
from onnx_genrt.providers.cuda.kernels import REGISTRY  # the package registers every module
print(json.dumps(REGISTRY.ops()))
"""


def test_cuda_kernel_modules_register_the_ops_llms_need():
    done = subprocess.run(
        [sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    ops = {tuple(op) for op in json.loads(done.stdout.strip().splitlines()[-1])}
    assert REQUIRED - ops == set()
