#!/usr/bin/env python3
"""CPU skinny float32 MatMul against numpy/OpenBLAS, at one thread and on the worker pool.

Each call reads the next of enough copies of the weight to fill ``--cache-mb`` MB: 8 keeps
them in a 32 MB last-level cache, as the embedded model's 16 MB of weights are in a decode
step; 256 reads them from DRAM. Prints the median time per call and weight GB/s (weight
bytes / time) for numpy, the skinny kernel on the calling thread, and the skinny kernel at
each ``--threads`` count above 1 (the worker pool, ``providers/cpu/kernels/_worker_pool``).
``--overhead`` first times an empty Numba ``prange`` region and an empty pool job per call.

    python scripts/skinny_matmul_bench.py [--threads 1 2] [--m 1 5] [--cache-mb 8 256]
        [--shapes 256x768 256x4096 896x4864 ...] [--overhead]
"""

from __future__ import annotations

import argparse
import time

import numba
import numpy as np

from onnx_genrt.providers.cpu.kernels import _worker_pool as wp
from onnx_genrt.providers.cpu.kernels._skinny_matmul import (
    pack_weight,
    skinny_chunks,
    skinny_matmul,
)
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


@numba.njit(parallel=True)
def _empty_region(out, parts):
    for p in numba.prange(parts):
        out[p] += 1.0


def _no_chunk(args, chunk, mode):
    return 0


@numba.njit(nogil=True)
def _empty_job(ctrl, runner, chunks):
    if wp.enter(ctrl):
        wp.run_job(ctrl, runner, chunks)


def overhead(threads: int) -> None:
    """Per call: an empty prange region over ``threads`` Numba threads and an empty pool job
    of ``threads`` chunks."""
    set_threads(threads)
    out = np.zeros(64)
    runner = numba.cfunc(wp.RUNNER_SIGNATURE)(_no_chunk).address
    ctrl = wp.worker_pool().ctrl
    rows = [
        ("empty prange region", lambda: _empty_region(out, threads)),
        ("empty pool job", lambda: _empty_job(ctrl, runner, threads)),
    ]
    for name, fn in rows:
        print(f"threads {threads}: {name:22s} {_median_s(fn) * 1e6:6.2f} us per call", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--m", type=int, nargs="+", default=[1, 5])
    p.add_argument("--shapes", nargs="+", default=["256x768", "256x4096", "896x4864"])
    p.add_argument("--cache-mb", type=int, nargs="+", default=[8, 256], help="weight copies")
    p.add_argument("--overhead", action="store_true", help="time empty parallel calls first")
    a = p.parse_args()
    if a.overhead:
        for t in a.threads:
            if t > 1:
                overhead(t)
    rng = np.random.default_rng(0)
    for shape in a.shapes:
        k, n = (int(v) for v in shape.split("x"))
        gb = k * n * 4 / 1e9
        for mb in a.cache_mb:
            copies = max(1, (mb << 20) // (k * n * 4))
            ws = [rng.standard_normal((k, n), dtype=np.float32) for _ in range(copies)]
            packed = [pack_weight(w) for w in ws]
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

                set_threads(1)
                cells = [("numpy", _median_s(numpy_call))]
                for t in a.threads:
                    set_threads(t)
                    cells.append((f"{t}t/{skinny_chunks(m, k, n)}ch", _median_s(skinny_call)))
                text = " | ".join(
                    f"{name} {s * 1e6:7.1f} us {gb / s:5.1f} GB/s" for name, s in cells
                )
                print(f"[{k}x{n}] {mb:3d} MB M={m:<2d} {text}", flush=True)


if __name__ == "__main__":
    main()
