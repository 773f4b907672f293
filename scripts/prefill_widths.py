"""Per prompt-chunk width: a prompt of that many tokens prefilled eagerly and as a graphed
chunk (``DecoderRunner.prefill``), and the device memory that width's graph holds. A GPU
check, to set ``PREFILL_WIDTHS`` and ``PREFILL_GRAPH_MAX_TOKENS`` (``engine/decoder.py``) by
measurement:

    python scripts/prefill_widths.py MODEL_DIR [--provider cuda] [--repeats 5]
    ONNX_GENRT_CUBLAS_IN_GRAPHS=0 python scripts/prefill_widths.py MODEL_DIR   # widths <= 64

Rows: width, eager ms (median), graphed ms (median of replays, after the width's first run
and capture), whether the last row's greedy pick agrees, and the memory the width added:
CuPy's pool (planned activations, the bound logits of ``width`` rows, the dequantized 4-bit
weights a first wide run makes) and the device's free memory (also the instantiated graph).
Timings include the read-back of the last row's logits, as a prompt's first token does.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from onnx_genrt.engine import Model
from onnx_genrt.engine.decoder import DecoderRunner


def _timed(runner: DecoderRunner, tokens: list[int], graphed: bool) -> tuple[float, int]:
    """Milliseconds of one prefill from an empty cache, and its last row's greedy pick."""
    runner.rewind_to(0)
    start = time.perf_counter()
    out, _ = runner.prefill(tokens, graphed)
    pick = int(np.argmax(out.logits[-1]))
    return (time.perf_counter() - start) * 1e3, pick


def _device_bytes() -> tuple[int, int]:
    """(CuPy pool bytes in use, device bytes in use) after the queued work."""
    import cupy

    cupy.cuda.Device().synchronize()
    free, total = cupy.cuda.runtime.memGetInfo()
    return cupy.get_default_memory_pool().used_bytes(), total - free


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("model")
    p.add_argument("--provider", default="cuda")
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    model = Model(a.model, a.provider)
    runner = DecoderRunner(model.session, model.config, min(model.config.context_length, 2048))
    widths = [w for w in runner.prefill_widths() if w <= runner.prefill_graph_max_tokens()]
    print(
        f"session graph_max_rows {model.session.graph_max_rows}; widths {widths}; graphed "
        f"prompts up to {runner.prefill_graph_max_tokens()} tokens"
    )
    print("| width | eager ms | graphed ms | same pick | pool MiB | device MiB |")
    print("|---|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    gpu = a.provider == "cuda"
    for width in widths:
        tokens = rng.integers(1, model.config.vocab_size, width).tolist()
        eager = [_timed(runner, tokens, False) for _ in range(a.repeats + 1)][1:]
        before = _device_bytes() if gpu else (0, 0)
        _timed(runner, tokens, True)  # the width's first run: eager, plans its memory
        _timed(runner, tokens, True)  # its capture
        after = _device_bytes() if gpu else (0, 0)
        graphed = [_timed(runner, tokens, True) for _ in range(a.repeats)]
        same = all(pick == eager[0][1] for _, pick in graphed)
        pool, device = ((y - x) / 2**20 for x, y in zip(before, after, strict=True))
        print(
            f"| {width} | {statistics.median(t for t, _ in eager):.2f} | "
            f"{statistics.median(t for t, _ in graphed):.2f} | {same} | {pool:.1f} | "
            f"{device:.1f} |"
        )
    stats = model.session.graph_stats("verify")
    print(f"verify slot: {stats.as_dict()}")


if __name__ == "__main__":
    main()
