"""The CUDA provider's kernel modules import and register every op the engine relies on,
checked without a GPU (CuPy replaced by a stub in a child process): a module that loses a
registration fails here, not only in the GPU lane."""

from __future__ import annotations

from tests.cuda_stub import run_with_cupy_stub

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
    ("onnx_genrt", "SampleTokens"),
}

_CHILD = """
import json
from onnx_genrt.providers.cuda.kernels import REGISTRY  # the package registers every module
print(json.dumps(REGISTRY.ops()))
"""


def test_cuda_kernel_modules_register_the_ops_llms_need():
    ops = {tuple(op) for op in run_with_cupy_stub(_CHILD)}
    assert REQUIRED - ops == set()
