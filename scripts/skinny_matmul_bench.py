#!/usr/bin/env python3
"""CPU skinny float32 MatMul against numpy/OpenBLAS: time and weight GB/s per shape.

Weights are cold, as in a decode step: each call reads the next of enough copies of the
weight to overflow the last-level cache. Prints median us and GB/s (weight bytes / time).

    python scripts/skinny_matmul_bench.py [--threads 1] [--m 1 5] [--shapes 512x32000 ...]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from onnx_genrt.providers.cpu.kernels._skinny_matmul import pack_weight, skinny_matmul
from onnx_genrt.providers.cpu.provider import set_threads


def _median_s(fn, budget_s: float = 0.05, runs: int = 7) -> float:
    fn()
    times = []
    for _ in range(runs):
        start, calls = time.perf_counter(), 0
        while True:
            fn()
            calls += 1
            if time.perf_counter() - start > budget_s:
                break
        times.append((time.perf_counter() - start) / calls)
    return sorted(times)[runs // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--m", type=int, nargs="+", default=[1, 5])
    p.add_argument("--shapes", nargs="+", default=["512x32000", "512x3072", "1536x512"])
    p.add_argument("--cache-mb", type=int, default=96, help="weight copies cycled through")
    a = p.parse_args()
    set_threads(a.threads)
    rng = np.random.default_rng(0)
    print(f"threads {a.threads}")
    for shape in a.shapes:
        k, n = (int(v) for v in shape.split("x"))
        copies = max(1, (a.cache_mb << 20) // (k * n * 4))
        ws = [rng.standard_normal((k, n), dtype=np.float32) for _ in range(copies)]
        packed = [pack_weight(w) for w in ws]
        gb = k * n * 4 / 1e9
        for m in a.m:
            x = rng.standard_normal((m, k), dtype=np.float32)
            out = np.empty((m, n), np.float32)
            turn = [0]

            def numpy_call(x=x, out=out, turn=turn, ws=ws):
                turn[0] = (turn[0] + 1) % len(ws)
                np.matmul(x, ws[turn[0]], out=out)

            def skinny_call(x=x, out=out, turn=turn, packed=packed):
                turn[0] = (turn[0] + 1) % len(packed)
                skinny_matmul(x, packed[turn[0]], out)

            t_np = _median_s(numpy_call)
            t_sk = _median_s(skinny_call)
            print(
                f"[{k}x{n}] M={m:<2d} numpy {t_np * 1e6:8.1f} us {gb / t_np:5.1f} GB/s | "
                f"skinny {t_sk * 1e6:8.1f} us {gb / t_sk:5.1f} GB/s | {t_np / t_sk:4.2f}x",
                flush=True,
            )


if __name__ == "__main__":
    main()
