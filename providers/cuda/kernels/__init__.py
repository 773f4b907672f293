"""CUDA kernels (CuPy ElementwiseKernels and RawKernels), one module per op family.

The registry is built here: each kernel module registers its ops into ``_registry.REGISTRY``
when imported, and ``KERNEL_MODULES`` lists every one of them. A family has the same module
name as in the CPU provider (``matmul``, ``softmax``, ``reduce``, ``constants``, ``genrt``
for the runtime's own ops, ...). Modules starting with ``_`` hold helpers.

Every kernel is written to be captured into a CUDA graph: no cuBLAS, no host sync and no
allocation while the provider's stream is capturing (see ``_common.out``).
"""

from importlib import import_module

from ._registry import REGISTRY

#: Every module that registers CUDA kernels, imported (and so registered) here: a new
#: module is added to this list, or it registers nothing.
KERNEL_MODULES = tuple(
    import_module(f"{__name__}.{name}")
    for name in (
        "constants",
        "contrib_attention",
        "contrib_norm",
        "contrib_quant",
        "elementwise",
        "genrt",
        "matmul",
        "normalization",
        "reduce",
        "shape_ops",
        "softmax",
    )
)

__all__ = ["KERNEL_MODULES", "REGISTRY"]
