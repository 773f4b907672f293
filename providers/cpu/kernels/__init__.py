"""CPU kernels (numpy, numpy's BLAS and Numba). Importing this package registers them all."""

from . import (  # noqa: F401  (register on import)
    contrib,
    elementwise,
    fused,
    nn,
    reduce,
    shape_ops,
    strings,
    tensor_math,
)
from ._registry import REGISTRY

__all__ = ["REGISTRY"]
