"""CUDA kernels (CuPy ElementwiseKernels and RawKernels). Importing registers them all.

Every kernel is written to be captured into a CUDA graph: no cuBLAS, no host sync and no
allocation while the provider's stream is capturing (see ``_common.out``).
"""

from . import elementwise, matmul, nn, normalization, shape_ops  # noqa: F401  (register on import)
from ._registry import REGISTRY

__all__ = ["REGISTRY"]
