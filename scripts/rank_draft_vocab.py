"""Rank a draft vocabulary for the default model's MTP head: the token ids the base model
itself emits most often, greedily, after prompts cut out of its training files (the held-out
validation files and the bench's prompts are not used). Speculative decoding emits exactly
the greedy tokens, so a draft head restricted to these ids loses only the drafts of rarer
tokens, while each chained head step multiplies by an lm_head of ``--size`` columns instead
of the whole vocabulary.

    python scripts/rank_draft_vocab.py --size 512     # writes mtp/draft_vocab.json

Then name the file in speculative.json (``"mtp": {"draft_vocab": "mtp/draft_vocab.json"}``).
Needs torch (the test extra, for the prompt helpers of distill_mtp_head.py); CPU only,
deterministic for a seed.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from distill_mtp_head import MODEL, greedy_sequences, log, training_prompts  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=MODEL, help="model folder (default: embedded)")
    p.add_argument("--size", type=int, default=512, help="token ids kept")
    p.add_argument("--prompts", type=int, default=400, help="training prompts")
    p.add_argument("--new-tokens", type=int, default=96, help="greedy tokens per prompt")
    p.add_argument("--seed", type=int, default=4321)
    p.add_argument("--val-every", type=int, default=40, help="as train_default_model.py")
    p.add_argument("--out", type=Path, help="default: MODEL/mtp/draft_vocab.json")
    args = p.parse_args(argv)

    from onnx_genrt.engine import Model

    folder = args.model.resolve()
    model = Model(folder, "cpu")
    prompts = training_prompts(model.tokenizer, args.prompts, args.val_every, args.seed)
    seqs = greedy_sequences(model, prompts, args.new_tokens)
    counts = collections.Counter(
        token for prompt, seq in zip(prompts, seqs, strict=True) for token in seq[len(prompt) :]
    )
    ranked = [token for token, _ in counts.most_common(args.size)]
    total = sum(counts.values())
    covered = sum(counts[t] for t in ranked) / max(total, 1)
    log(
        f"{len(counts)} distinct ids in {total} greedy tokens; the top {len(ranked)} cover {covered:.1%}"
    )
    out = args.out or folder / "mtp" / "draft_vocab.json"
    out.write_text(json.dumps(ranked) + "\n", encoding="utf-8")
    log(f"wrote {out}")


if __name__ == "__main__":
    main()
