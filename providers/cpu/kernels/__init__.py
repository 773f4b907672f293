"""CPU kernels (numpy, numpy's BLAS and Numba). Importing this package registers them all."""

from . import contrib, elementwise, fused, nn, reduce, shape_ops, strings  # noqa: F401  (register on import)
from ._registry import REGISTRY

__all__ = ["REGISTRY"]
