"""Decode tokens per CPU second of the calling thread: one sequence against N streams.

On a machine shared with other work, wall-clock rates (``onnx-genrt bench``) swing with the
load; the CPU time the generating thread spends moves much less (it still feels cache and
memory contention). Each row is one ``generate`` (the single sequence) or ``generate_batch``
of N copies of the prompt, timed with ``time.thread_time`` around the whole call (prefill
included), rows round-robin, one warm-up each; the figure is new tokens after each row's
first over that time. The CPU provider must run on the calling thread (``threads`` 1, its
default), or the time of its other threads is not counted.

    python scripts/batch_cpu_time.py --tokens 64 --repeats 15 --streams 1,4,8 \
        --prompt "    def __init__(self"
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from onnx_genrt.engine import Model, generate, generate_batch
from onnx_genrt.models import default_model_path


def _timed(run: Callable[[], int]) -> float:
    """Tokens per CPU second of one call of ``run`` (which returns the tokens it counts)."""
    start = time.thread_time()
    tokens = run()
    return tokens / (time.thread_time() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(default_model_path()))
    parser.add_argument("--prompt", default="    def __init__(self")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per row")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--streams", default="1,4,8", help="comma-separated row counts")
    args = parser.parse_args()
    model = Model(args.model)
    ids = model.tokenizer.encode(args.prompt)
    longest = len(ids) + args.tokens

    def single() -> int:
        result = generate(model, ids, args.tokens, min_length=longest)
        return result.new_tokens - 1

    def streams(n: int) -> Callable[[], int]:
        def run() -> int:
            results = generate_batch(model, [ids] * n, args.tokens, min_length=longest)
            return sum(r.new_tokens - 1 for r in results)

        return run

    rows = {"single sequence": single}
    rows |= {f"{n} streams": streams(n) for n in map(int, args.streams.split(","))}
    for run in rows.values():
        run()
    rates: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(args.repeats):
        for name, run in rows.items():
            rates[name].append(_timed(run))
    base = statistics.median(rates["single sequence"])
    print(f"{'row':<16} {'tok/CPU-s median':>17} {'min':>8} {'max':>8} {'vs single':>10}")
    for name, values in rates.items():
        mid = statistics.median(values)
        print(
            f"{name:<16} {mid:>17.1f} {min(values):>8.1f} {max(values):>8.1f} {mid / base:>9.2f}x"
        )


if __name__ == "__main__":
    main()
