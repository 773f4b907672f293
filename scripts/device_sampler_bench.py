"""Time one ``DeviceSampler.launch`` (``engine/device_sampler.py``): the one-node
``SampleTokens`` session run eagerly after a batched step, on the embedded model's vocabulary.

    python scripts/device_sampler_bench.py [--provider cpu] [--calls 2000] [--rounds 5] [--sync]

Prints microseconds per launch for each round (the sampler's own cost plus the session's
eager-run overhead; on a GPU the launch is queued, so this is the host's share unless
``--sync`` reads each drawn token back before the next launch).
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--provider", default="cpu", help="execution provider (default: cpu)")
    parser.add_argument("--calls", type=int, default=2000, help="launches a round (2000)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds (5)")
    parser.add_argument("--top-k", type=int, default=50, help="the row's top_k (50; 0: none)")
    parser.add_argument(
        "--sync", action="store_true", help="read each token back (the launch's whole latency)"
    )
    args = parser.parse_args()

    from onnx_genrt.engine import Model
    from onnx_genrt.engine.device_sampler import DeviceSampler
    from onnx_genrt.generate_cli import default_model_dir

    model = Model(default_model_dir(), args.provider)
    vocab = model.config.vocab_size
    sampler = DeviceSampler(model.session, vocab, np.float32)
    rng = np.random.default_rng(0)
    logits = model.session.device_io.upload(rng.standard_normal((1, 1, vocab)).astype(np.float32))
    inputs = (
        np.array([1.0], np.float32),
        np.array([3], np.int64),
        np.array([10], np.int64),
        np.array([args.top_k], np.int64),
    )
    io = model.session.device_io

    def launch() -> None:
        tokens = sampler.launch(logits, *inputs)
        if args.sync:
            io.read([tokens])

    for _ in range(200):
        launch()
    io.read([sampler.launch(logits, *inputs)])
    rounds = []
    for _ in range(args.rounds):
        started = time.perf_counter()
        for _ in range(args.calls):
            launch()
        rounds.append((time.perf_counter() - started) / args.calls * 1e6)
    print("us per launch:", " ".join(f"{r:.1f}" for r in rounds))


if __name__ == "__main__":
    main()
