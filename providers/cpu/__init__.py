"""CPU execution provider (numpy and Numba)."""
