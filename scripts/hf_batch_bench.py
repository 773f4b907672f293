"""HF transformers batched greedy decode: aggregate tokens per second at several batch sizes.

The counterpart of ``onnx-genrt bench --streams 1,4,16,32`` on the same weights: each row of
the batch is a random prompt of the same length (no padding), ``generate`` runs greedily for
exactly ``--tokens`` new tokens with a static KV cache, and the decode rate is the batch's
tokens after the first over the decode time (a ``max_new_tokens=1`` call is the first-token
time, subtracted). Median of ``--repeats`` timed runs after a warm-up.

    python scripts/hf_batch_bench.py --model HF_DIR --device cuda --dtype float16 --batch 1,4,16,32

Needs torch and transformers (the test extra). Prints one table; ``--json`` writes it too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_bench import eos_ids, load_model, one_line, sync  # noqa: E402


def timed_generate(model, ids: torch.Tensor, new: int, cache: str | None) -> float:
    """Seconds for one greedy ``generate`` of exactly ``new`` tokens."""
    extra = {"cache_implementation": cache} if cache else {}
    sync(ids.device)
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=(eos_ids(model) or [0])[0],
            **extra,
        )
    sync(ids.device)
    return time.perf_counter() - start


def bench_batch(model, batch: int, prompt_len: int, new: int, repeats: int, cache: str | None):
    vocab = model.get_output_embeddings().weight.shape[0]
    gen = torch.Generator().manual_seed(batch)
    ids = torch.randint(0, vocab, (batch, prompt_len), generator=gen).to(model.device)
    timed_generate(model, ids, new, cache)  # warm-up (and the static cache's allocation)
    totals, firsts = [], []
    for _ in range(repeats):
        totals.append(timed_generate(model, ids, new, cache))
        firsts.append(timed_generate(model, ids, 1, cache))
    total, first = statistics.median(totals), statistics.median(firsts)
    decode = total - first
    return {
        "batch": batch,
        "cache": cache or "dynamic",
        "ttft_ms": first * 1e3,
        "decode_tok_s": batch * (new - 1) / decode if decode > 0 else None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="folder written by save_pretrained")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    ap.add_argument("--batch", default="1,4,16,32", help="comma-separated batch sizes")
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per row (default 128)")
    ap.add_argument("--prompt-tokens", type=int, default=32, help="prompt length (default 32)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cache", default="static", help="cache_implementation ('' = dynamic)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batch.split(",") if b.strip()]
    if not batches or min(batches) < 1 or args.tokens < 2:
        ap.error("--batch needs sizes >= 1 and --tokens at least 2")
    model = load_model(args.model, args.device, getattr(torch, args.dtype))
    rows = []
    for batch in batches:
        try:
            rows.append(
                bench_batch(
                    model, batch, args.prompt_tokens, args.tokens, args.repeats, args.cache or None
                )
            )
        except Exception as exc:  # noqa: BLE001 - a row that fails is reported, the rest run
            rows.append({"batch": batch, "cache": args.cache or "dynamic", "error": one_line(exc)})
    base = next((r["decode_tok_s"] for r in rows if r.get("decode_tok_s")), None)
    print(
        f"{'HF transformers':<20} {'batch':>5} {'cache':>8} {'TTFT ms':>8} {'decode tok/s':>13} {'vs batch 1':>10}"
    )
    for r in rows:
        if "error" in r:
            print(f"{'':<20} {r['batch']:>5} {r['cache']:>8} failed: {r['error']}")
            continue
        ratio = f"{r['decode_tok_s'] / base:.2f}x" if base and r["decode_tok_s"] else "-"
        print(
            f"{'':<20} {r['batch']:>5} {r['cache']:>8} {r['ttft_ms']:>8.1f} "
            f"{r['decode_tok_s'] or 0:>13.1f} {ratio:>10}"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
