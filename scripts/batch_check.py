"""Batched greedy rows against each prompt alone, for N in a list of batch sizes (a GPU
check: ``python scripts/batch_check.py MODEL_DIR --provider cuda --streams 1,4,16,32``)."""

from __future__ import annotations

import argparse

import numpy as np

from onnx_genrt.engine import Model, generate, generate_batch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("model")
    p.add_argument("--provider", default="cuda")
    p.add_argument("--streams", default="1,4,16,32")
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--max-graph-rows", type=int, default=None, help="rows per captured piece")
    a = p.parse_args()
    if a.max_graph_rows is not None:
        from onnx_genrt.engine.batch import BatchGenerator

        BatchGenerator.__init__.__kwdefaults__["max_graph_rows"] = a.max_graph_rows
    model = Model(a.model, a.provider)
    rng = np.random.default_rng(0)
    for n in [int(x) for x in a.streams.split(",")]:
        vocab = model.config.vocab_size
        prompts = [rng.integers(1, vocab, 4 + i % 5).tolist() for i in range(n)]
        try:
            rows = generate_batch(model, prompts, a.tokens, ignore_eos=True)
        except Exception as exc:  # report and go on to the next size
            print(f"{n} streams: {type(exc).__name__}: {exc}")
            continue
        wrong = [
            i
            for i, (pr, r) in enumerate(zip(prompts, rows, strict=True))
            if r.tokens != generate(model, pr, a.tokens, ignore_eos=True).tokens
        ]
        stats = model.session.all_graph_stats()["primary"]
        print(
            f"{n} streams: rows differing from alone: {wrong[:8]} of {n}; "
            f"captures {stats['captures']} fallbacks {stats['fallbacks']}"
        )


if __name__ == "__main__":
    main()
