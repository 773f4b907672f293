"""The CUDA provider's kernel registry; kernel modules register into it on import."""

from onnx_genrt.core.kernels import KernelRegistry

REGISTRY = KernelRegistry()
