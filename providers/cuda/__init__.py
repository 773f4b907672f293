"""CUDA execution provider (CuPy)."""
