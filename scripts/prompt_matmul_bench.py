"""Prompt-sized matmuls on the CPU: the packed kernels against BLAS, by rows.

For each thread count, weight shape and number of rows M, times (best of ``--repeats``):

* float32: the skinny kernel on the tiled weight (what a prepacked MatMul runs) against
  ``split_matmul`` on a dense copy made per call (the old prompt path) and on a plain weight;
* 4-bit (``--int4``): the float 4-bit kernel on its tiles against dequantizing the tiles and
  ``split_matmul`` (MatMulNBits' prompt path at accuracy levels 0-3).

    python scripts/prompt_matmul_bench.py [--threads 1 2] [--m 16 32 64 128 512] [--int4]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
from threadpoolctl import threadpool_limits

from onnx_genrt.providers.cpu.kernels import _int4_matmul as im
from onnx_genrt.providers.cpu.kernels import _skinny_matmul as sk
from onnx_genrt.providers.cpu.kernels._prompt_threads import split_matmul
from onnx_genrt.providers.cpu.kernels._worker_pool import set_pool_threads


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def float_rows(k: int, n: int, ms: list[int], repeats: int, rng: np.random.Generator) -> None:
    w = rng.standard_normal((k, n)).astype(np.float32)
    tiled = sk.pack_weight(w)
    for m in ms:
        x = rng.standard_normal((m, k)).astype(np.float32)
        out = np.empty((m, n), np.float32)
        skinny = best_ms(lambda x=x, out=out: sk.skinny_matmul(x, tiled, out), repeats)
        dense = best_ms(lambda x=x, out=out: split_matmul(x, tiled.dense(), out), repeats)
        plain = best_ms(lambda x=x, out=out: split_matmul(x, w, out), repeats)
        gf = 2 * m * k * n / 1e6
        print(
            f"  float32 K={k} N={n} M={m}: skinny {skinny:.2f} ms ({gf / skinny:.0f} GF/s), "
            f"BLAS on a dense copy {dense:.2f}, BLAS on a plain weight {plain:.2f} "
            f"({gf / plain:.0f} GF/s)"
        )


def int4_rows(k: int, n: int, ms: list[int], repeats: int, rng: np.random.Generator) -> None:
    block = 32
    nb = k // block
    packed = rng.integers(0, 256, (n, nb, block // 2), dtype=np.uint8)
    scales = (rng.random((n, nb)) * 0.1).astype(np.float32)
    zeros = np.zeros((n, nb), np.float32)
    w4 = im.pack_int4(packed, scales, zeros, n, block, im.tile_rows(n))
    for m in ms:
        x = rng.standard_normal((m, k)).astype(np.float32)
        out = np.empty((m, n), np.float32)
        kernel = best_ms(lambda x=x, out=out: im.int4_matmul(x, w4, out), repeats)
        dequant = best_ms(
            lambda x=x, out=out: split_matmul(x, im.dequantize_tiles(w4, k), out), repeats
        )
        print(f"  4-bit K={k} N={n} M={m}: packed {kernel:.2f} ms, dequantize + BLAS {dequant:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--m", type=int, nargs="+", default=[16, 32, 64, 128, 512])
    parser.add_argument("--shapes", nargs="+", default=["768x3072", "3072x768"], help="KxN")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--int4", action="store_true", help="the 4-bit rows instead")
    args = parser.parse_args()
    threadpool_limits(1, user_api="blas")  # the CPU provider's default
    rng = np.random.default_rng(0)
    for threads in args.threads:
        set_pool_threads(threads)
        print(f"threads {threads}")
        for shape in args.shapes:
            k, n = (int(v) for v in shape.split("x"))
            (int4_rows if args.int4 else float_rows)(k, n, args.m, args.repeats, rng)


if __name__ == "__main__":
    main()
