"""Batched greedy rows against each prompt alone, for N in a list of batch sizes (a GPU
check: ``python scripts/batch_check.py MODEL_DIR --provider cuda --streams 1,4,16,32``).

Prompts are random token ids, 4-8 tokens by default or ``--prompt-tokens`` each (the bench's
``--prompt-tokens``). A row that differs from its prompt alone is reported with the first
generated token where they part and, with ``--logprobs``, the log-probabilities of both
runs' tokens there and how many steps before it already differed in their bits (a rounding
difference that a near tie finally turned into another token, or a different computation
from the first step: the prompt's last logits). ``--logprobs`` runs both sides through the
batched decoder with logits read back each step, which turns its look-ahead off."""

from __future__ import annotations

import argparse

import numpy as np

from onnx_genrt.engine import GenerationResult, Model, generate, generate_batch


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where the token lists differ (or where one ends), or None."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def describe(prompt_len: int, batched: GenerationResult, alone: GenerationResult) -> str:
    """Where a batched row parts from its prompt alone (generated-token index), with the
    two runs' log-probabilities there when they were kept."""
    at = first_difference(batched.tokens, alone.tokens)
    if at is None:
        return "same"
    step = at - prompt_len
    text = f"parts at generated token {step}: {batched.tokens[at]} against {alone.tokens[at]}"
    if batched.logprobs is None or alone.logprobs is None or step < 0:
        return text
    mine, theirs = batched.logprobs[: step + 1], alone.logprobs[: step + 1]
    bits = [i for i, (x, y) in enumerate(zip(mine, theirs, strict=True)) if x.logprob != y.logprob]
    first = f"first at generated token {bits[0]}" if bits else "none before"
    here = f"logprob {mine[step].logprob:.6f} against {theirs[step].logprob:.6f}"
    return f"{text} ({here}; chosen-token logprobs differing: {len(bits)} of {step + 1}, {first})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("model")
    p.add_argument("--provider", default="cuda")
    p.add_argument("--streams", default="1,4,16,32")
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--prompt-tokens", type=int, default=None, help="every prompt this long")
    p.add_argument("--logprobs", action="store_true", help="keep logprobs (see above)")
    p.add_argument("--max-graph-rows", type=int, default=None, help="rows per captured piece")
    a = p.parse_args()
    if a.max_graph_rows is not None:
        from onnx_genrt.engine.batch import BatchGenerator

        BatchGenerator.__init__.__kwdefaults__["max_graph_rows"] = a.max_graph_rows
    model = Model(a.model, a.provider)
    rng = np.random.default_rng(0)
    extra = {"logprobs": 1} if a.logprobs else {}
    for n in [int(x) for x in a.streams.split(",")]:
        vocab = model.config.vocab_size
        prompts = [rng.integers(1, vocab, a.prompt_tokens or 4 + i % 5).tolist() for i in range(n)]
        try:
            rows = generate_batch(model, prompts, a.tokens, ignore_eos=True, **extra)
        except Exception as exc:  # report and go on to the next size
            print(f"{n} streams: {type(exc).__name__}: {exc}")
            continue
        wrong = {}
        for i, (prompt, row) in enumerate(zip(prompts, rows, strict=True)):
            alone = generate(model, prompt, a.tokens, ignore_eos=True, **extra)
            if row.tokens != alone.tokens:
                wrong[i] = describe(len(prompt), row, alone)
        stats = model.session.all_graph_stats()["primary"]
        print(
            f"{n} streams: rows differing from alone: {sorted(wrong)[:8]} of {n}; "
            f"captures {stats['captures']} fallbacks {stats['fallbacks']}"
        )
        for i in sorted(wrong)[:4]:
            print(f"  row {i}: {wrong[i]}")


if __name__ == "__main__":
    main()
