#!/usr/bin/env python3
"""Accuracy-level-4 MatMulNBits kernels side by side: the int16 kernel on row tiles
(``_int8_activations.int4_int8_matmul``) against the VNNI kernel on VNNI tiles
(``_int4_vnni.int4_vnni_matmul``), blocks of 32, no zero points.

Per shape, rows M and thread count, the two kernels and a ``np.copyto`` of the packed weight
bytes are called in turn, ``--calls`` times, in one process; prints the median µs per call
and the VNNI kernel's GB/s of packed weight bytes (the weight stays in the caches between
calls) beside ``np.copyto``'s, as a Markdown table. Checks that both kernels give the same
bits first.

    python scripts/int4_vnni_bench.py [--threads 1 2] [--m 1 4] [--calls 400]
        [--shapes 768x768 768x3072 3072x768 896x4864 4864x896]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from onnx_genrt.providers.cpu.kernels import _int4_matmul as im
from onnx_genrt.providers.cpu.kernels import _int4_vnni as vn
from onnx_genrt.providers.cpu.kernels import _int8_activations as q8
from onnx_genrt.providers.cpu.kernels import _worker_pool as wp

BLOCK = 32


def _row(k: int, n: int, m: int, threads: int, calls: int) -> str:
    rng = np.random.default_rng(k + n)
    nb = k // BLOCK
    packed = rng.integers(0, 256, (n, nb, BLOCK // 2), dtype=np.uint8)
    scales = (rng.random((n, nb)) * 0.02 + 0.001).astype(np.float32)
    rows = im.pack_int4(packed, scales, None, n, BLOCK, q8.ROWS)
    vnni = im.pack_int4(packed, scales, None, n, BLOCK, vn.PANEL, vnni=True)
    x = rng.standard_normal((m, k)).astype(np.float32)
    y_rows, y_vnni = np.empty((m, n), np.float32), np.empty((m, n), np.float32)
    src = packed.reshape(-1).copy()
    dst = np.empty_like(src)
    wp.set_pool_threads(threads)
    runs = (
        lambda: q8.int4_int8_matmul(x, rows, y_rows),
        lambda: vn.int4_vnni_matmul(x, vnni, y_vnni),
        lambda: np.copyto(dst, src),
    )
    for _ in range(20):
        for run in runs:
            run()
    if not np.array_equal(y_rows, y_vnni):
        raise SystemExit(f"{k}x{n} M={m}: the kernels' outputs differ")
    times: list[list[float]] = [[], [], []]
    for _ in range(calls):
        for spent, run in zip(times, runs, strict=True):
            start = time.perf_counter()
            run()
            spent.append(time.perf_counter() - start)
    int16, vnni_us, copy = (float(np.median(t)) * 1e6 for t in times)
    gbs = [packed.nbytes / us / 1e3 for us in (vnni_us, copy)]
    return (
        f"| {k}x{n} | {m} | {threads} | {int16:.1f} | {vnni_us:.1f} | {int16 / vnni_us:.2f}x | "
        f"{gbs[0]:.1f} | {gbs[1]:.1f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--m", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument(
        "--shapes", nargs="+", default=["768x768", "768x3072", "3072x768", "896x4864", "4864x896"]
    )
    args = parser.parse_args()
    if not vn.HOST_VNNI:
        raise SystemExit("this CPU (or NUMBA_CPU_FEATURES) lacks AVX-512 VNNI")
    print("| K x N | M | threads | int16 µs | VNNI µs | speed-up | VNNI GB/s | np.copyto GB/s |")
    print("|---|---|---|---|---|---|---|---|")
    for threads in args.threads:
        for shape in args.shapes:
            k, n = (int(v) for v in shape.split("x"))
            for m in args.m:
                print(_row(k, n, m, threads, args.calls), flush=True)


if __name__ == "__main__":
    main()
