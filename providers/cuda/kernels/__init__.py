"""CUDA kernels (CuPy ElementwiseKernels and RawKernels). Importing registers them all.

Every kernel is written to be captured into a CUDA graph: no cuBLAS, no host sync and no
allocation while the provider's stream is capturing (see ``_common.out``).
"""

from . import (  # noqa: F401  (register on import)
    constants,
    contrib_attention,
    contrib_norm,
    contrib_quant,
    elementwise,
    matmul,
    mtp,
    nn,
    norm_matmul,
    normalization,
    reduce,
    shape_ops,
)
from ._registry import REGISTRY

__all__ = ["REGISTRY"]
