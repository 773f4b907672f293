"""Work splits of the CUDA GEMV kernels, in plain Python (no CuPy) so CPU tests can check them."""

from __future__ import annotations

#: Rows of at most this many 16-byte chunks (K <= 2048 at 4 bits) may run on
#: ``nbits4_gemv16_small_k``; longer rows give every lane of a warp-per-column kernel at least
#: two chunks, so its one warp-wide sum per column is already spread over enough bytes.
SMALL_K_MAX_CHUNKS = 64
#: Most chunks one lane of ``nbits4_gemv16_small_k`` holds: 6 registers each (4 words, scale,
#: zero), all loaded before the math.
SMALL_K_MAX_CPL = 8
#: Warps of a GEMV block (blocks are (32, 8)).
BLOCK_WARPS = 8


def nbits4_small_k_split(chunks: int, n: int, sms: int) -> tuple[int, int] | None:
    """(lanes per column, chunks per lane) of ``nbits4_gemv16_small_k`` for rows of ``chunks``
    16-byte chunks and ``n`` columns, or None when the warp-per-column kernel fits better.

    As few lanes a column as keep a lane at most ``SMALL_K_MAX_CPL`` chunks (more columns share
    a warp and its activation loads, a column's sum takes fewer shuffles), but at least 2 (a
    load then reads 32 contiguous bytes of each column: whole sectors); more while the grid has
    fewer than 2 blocks per SM. 32 lanes a column is the warp-per-column kernel: None.
    """
    if not 0 < chunks <= SMALL_K_MAX_CHUNKS or n <= 0:
        return None
    lpc = 2
    while chunks > SMALL_K_MAX_CPL * lpc:
        lpc *= 2
    while lpc < 32 and small_k_blocks(n, lpc) < 2 * sms:
        lpc *= 2
    if lpc >= 32:
        return None
    return lpc, -(-chunks // lpc)


def small_k_blocks(n: int, lpc: int) -> int:
    """Grid size of ``nbits4_gemv16_small_k``: 32 / lpc columns a warp, 8 warps a block."""
    return -(-n * lpc // (32 * BLOCK_WARPS))
