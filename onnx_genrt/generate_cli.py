"""``onnx-genrt generate``: stream text from a model folder."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .cli_args import (
    FINITE,
    NON_NEGATIVE,
    NON_NEGATIVE_INT,
    POSITIVE,
    POSITIVE_INT,
    Once,
    add_threads_argument,
    provider_list,
)
from .models import default_model_path


def default_model_dir() -> Path:
    """The embedded default model shipped in the package (:func:`onnx_genrt.models.default_model_path`)."""
    return default_model_path()


def provider_arg(name: str, threads: int | None):
    """``name``, or ``(name, {"threads": n})`` for the CPU provider when --threads is given."""
    return (name, {"threads": threads}) if threads is not None and name == "cpu" else name


def provider_args(names: list[str], threads: int | None) -> list:
    """``--provider a,b`` as a session's provider list (``--threads`` goes to the CPU one)."""
    return [provider_arg(name, threads) for name in names]


def add_provider_argument(p: argparse.ArgumentParser, default: str = "cpu") -> None:
    """``--provider a,b``: once, a comma-separated priority list."""
    p.add_argument(
        "--provider",
        type=provider_list,
        action=Once,
        default=[default],
        help=f"execution providers in priority order, comma-separated (default: {default}); "
        "nodes none of them runs go to the CPU provider",
    )


def add_spec_arguments(p: argparse.ArgumentParser) -> None:
    """``--spec`` (a proposer of one sequence's speculative decoding) and ``-k``."""
    from onnx_genrt.engine.api import SPEC_CHOICES

    p.add_argument(
        "--spec",
        choices=SPEC_CHOICES,
        default=None,
        help="speculative decoding with this proposer; auto: the model's own proposer (MTP "
        "head, else draft model, else prompt lookup), used only while it measurably beats "
        "plain steps",
    )
    add_drafts_argument(p)


def add_drafts_argument(p: argparse.ArgumentParser) -> None:
    """``-k``: drafts per speculative step, None for the model's own count."""
    p.add_argument(
        "-k",
        type=POSITIVE_INT,
        default=None,
        help="drafts per speculative step (default: the model's speculative.json, else 4)",
    )


def add_search_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("search options")
    g.add_argument(
        "--max-new-tokens", type=POSITIVE_INT, default=128, help="tokens to generate (default 128)"
    )
    g.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    g.add_argument("--temperature", type=NON_NEGATIVE, default=1.0)
    g.add_argument("--top-k", type=NON_NEGATIVE_INT, default=0, help="0 = off")
    g.add_argument("--top-p", type=POSITIVE, default=1.0)
    g.add_argument("--min-p", type=NON_NEGATIVE, default=0.0)
    g.add_argument("--repetition-penalty", type=POSITIVE, default=1.0)
    g.add_argument(
        "--presence-penalty",
        type=FINITE,
        default=0.0,
        help="subtracted once from the logit of each token generated so far ([-2, 2])",
    )
    g.add_argument(
        "--frequency-penalty",
        type=FINITE,
        default=0.0,
        help="times its count, subtracted from the logit of each token generated so far",
    )
    g.add_argument("--seed", type=NON_NEGATIVE_INT, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument(
        "--ignore-eos", action="store_true", help="generate max-new-tokens regardless of eos"
    )


def search_kwargs(args: argparse.Namespace) -> dict:
    return {
        "do_sample": args.do_sample,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "min_p": args.min_p,
        "repetition_penalty": args.repetition_penalty,
        "presence_penalty": args.presence_penalty,
        "frequency_penalty": args.frequency_penalty,
        "seed": args.seed,
    }


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text from a model folder (streams tokens)")
    p.add_argument(
        "--model", type=Path, default=None, help="model folder (default: the embedded model)"
    )
    p.add_argument("--prompt", required=True, help="prompt text")
    add_provider_argument(p)
    add_spec_arguments(p)
    p.add_argument(
        "--no-graphs", action="store_true", help="disable graph capture (for comparison)"
    )
    add_threads_argument(p)
    p.add_argument(
        "--stats", action="store_true", help="print timings and graph statistics to stderr"
    )
    p.add_argument("--json", action="store_true", help="print one JSON result instead of streaming")
    p.add_argument(
        "--logprobs",
        type=NON_NEGATIVE_INT,
        default=None,
        metavar="N",
        help="also print each generated token's log-probability under the model's raw logits "
        "and its N likeliest alternatives (0-20; the text is then printed when it is done, "
        "not streamed)",
    )
    add_search_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from onnx_genrt.engine import Model, generate, stream, warm_up

    folder = args.model or default_model_dir()
    loading = time.perf_counter()
    model = Model(
        folder, provider_args(args.provider, args.threads), enable_graphs=not args.no_graphs
    )
    loaded = time.perf_counter() - loading
    # Compile (or load) kernels and capture the decode graph before the prompt is timed.
    prompt_length = len(model.tokenizer.encode(args.prompt)) if args.prompt else 1
    warmed = warm_up(model, prompt_length + args.max_new_tokens, args.spec, args.k, prompt_length)
    results: list = []
    options = dict(spec=args.spec, k=args.k, stop=tuple(args.stop), ignore_eos=args.ignore_eos)
    if args.logprobs is not None:  # the batched decoder keeps them: no pieces to stream
        whole = generate(
            model, args.prompt, args.max_new_tokens, logprobs=args.logprobs, **options,
            **search_kwargs(args),
        )  # fmt: skip
        results.append(whole)
        pieces = iter([whole.text])
    else:
        pieces = stream(
            model, args.prompt, args.max_new_tokens, result=results, **options,
            **search_kwargs(args),
        )  # fmt: skip
    started = False
    for piece in pieces:
        if not args.json:
            if not started:
                sys.stdout.write(args.prompt)
                started = True
            sys.stdout.write(piece)
            sys.stdout.flush()
    res = results[0]
    if args.json:
        print(json.dumps(_as_json(res, model), indent=2))
    else:
        print()
        if res.logprobs is not None:
            print(logprobs_text(res, model))
    if args.stats:
        print(f"model load {loaded * 1e3:.0f} ms, warm-up {warmed * 1e3:.0f} ms", file=sys.stderr)
        print(stats_text(res), file=sys.stderr)
    return 0


def logprobs_text(res, model) -> str:
    """One line per generated token: its log-probability, its text, then its alternatives."""
    lines = []
    for entry in res.logprobs:
        top = ", ".join(f"{model.tokenizer.token_text(t)!r} {lp:.3f}" for t, lp in entry.top)
        line = f"{entry.logprob:9.3f}  {model.tokenizer.token_text(entry.token)!r}"
        lines.append(line + (f"  [{top}]" if top else ""))
    return "\n".join(lines)


def _as_json(res, model) -> dict:
    logprobs = None
    if res.logprobs is not None:
        logprobs = [
            {
                "token": e.token,
                "text": model.tokenizer.token_text(e.token),
                "logprob": e.logprob,
                "top": [[t, lp] for t, lp in e.top],
            }
            for e in res.logprobs
        ]
    return {
        "text": res.text,
        "tokens": res.tokens,
        "prompt_tokens": res.prompt_tokens,
        "new_tokens": res.new_tokens,
        "prefill_seconds": res.prefill_seconds,
        "decode_seconds": res.decode_seconds,
        "decode_tokens_per_second": res.decode_tokens_per_second,
        "stop_reason": res.stop_reason,
        "speculation": res.speculation,
        "graph_stats": res.graph_stats,
        "logprobs": logprobs,
    }


def stats_text(res) -> str:
    """A generation's timings, speculation and graph statistics, a few lines."""
    lines = [
        f"prompt {res.prompt_tokens} tokens, prefill {res.prefill_seconds * 1e3:.1f} ms; "
        f"{res.new_tokens} new tokens at {res.decode_tokens_per_second:.1f} tok/s; stop: {res.stop_reason}"
    ]
    if res.speculation:
        s = res.speculation
        lines.append(
            f"speculation: {s.get('kind', '?')}, k {s.get('k', '?')}, acceptance "
            f"{s['acceptance_rate']:.1%}, mean accepted {s['mean_accepted_length']:.2f}, "
            f"{s['verify_steps']} verify + {s['plain_steps']} plain steps"
        )
        auto = s.get("auto")
        if auto:
            verdict = {True: "pays", False: "does not pay", None: "not measured"}
            lines.append(
                f"auto: verify steps {auto['verify_tok_s']} tok/s against plain steps "
                f"{auto['plain_tok_s']} tok/s (last steps measured): speculation "
                f"{verdict[auto['speculation_pays']]}; {auto['switches']} switches"
            )
    for who, slots in res.graph_stats.items():
        for slot, st in slots.items():
            lines.append(
                f"{who}/{slot}: captures {st['captures']}, replays {st['replays']}, "
                f"fallbacks {st['fallbacks']}, invalidations {st['invalidations']}"
            )
            for reason, count in st["fallback_reasons"].items():
                lines.append(f"  fallback x{count}: {reason}")
    return "\n".join(lines)
