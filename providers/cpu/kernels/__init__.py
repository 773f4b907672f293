"""CPU kernels (numpy, numpy's BLAS and Numba), one module per op family.

The registry is built here: each kernel module registers its ops into ``_registry.REGISTRY``
when imported, and ``KERNEL_MODULES`` lists every one of them. A family present in several
providers has the same module name in each (``matmul``, ``softmax``, ``reduce``,
``constants``, ``genrt`` for the runtime's own ops, ...). Modules starting with ``_`` hold
helpers and register nothing.
"""

from importlib import import_module

from ._registry import REGISTRY

#: Every module that registers CPU kernels, imported (and so registered) here: a new
#: module is added to this list, or it registers nothing.
KERNEL_MODULES = tuple(
    import_module(f"{__name__}.{name}")
    for name in (
        "attention",
        "constants",
        "contrib",
        "contrib_attention",
        "contrib_norm",
        "contrib_quant",
        "conv",
        "detection",
        "elementwise",
        "genrt",
        "loss",
        "matmul",
        "normalization",
        "pool",
        "quant",
        "quant_linear",
        "recurrent",
        "reduce",
        "sampling",
        "sequence_mixers",
        "shape_ops",
        "softmax",
        "spectral",
        "strings",
        "tensor_math",
        "tfidf",
        "training",
    )
)

__all__ = ["KERNEL_MODULES", "REGISTRY"]
