"""CPU kernels (numpy, numpy's BLAS and Numba). Importing this package registers them all."""

from . import (  # noqa: F401  (register on import)
    contrib,
    detection,
    elementwise,
    fused,
    nn,
    reduce,
    sampling,
    sequence_mixers,
    shape_ops,
    spectral,
    strings,
    tensor_math,
    tfidf,
    training,
)
from ._registry import REGISTRY

__all__ = ["REGISTRY"]
