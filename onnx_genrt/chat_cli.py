"""``onnx-genrt chat``: an interactive conversation in the terminal (or through a pipe).

Each line read from stdin is a user message; the reply is rendered with the model's chat
template over the whole conversation and streamed to stdout, one reply per line block.
``/reset`` forgets the conversation (the system message stays), ``/exit`` or end of input
ends the session.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .cli_args import add_threads_argument
from .generate_cli import (
    add_provider_argument,
    add_search_arguments,
    add_spec_arguments,
    search_kwargs,
    stats_text,
)

COMMANDS = {"/reset": "forget the conversation", "/exit": "end the session"}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "chat",
        help="chat with a model in the terminal (its chat template; /reset, /exit)",
        description="Read user messages from stdin, one per line, and stream the model's "
        "replies to stdout, keeping the conversation. Commands: "
        + ", ".join(f"{c} ({what})" for c, what in COMMANDS.items())
        + "; end of input ends the session.",
    )
    p.add_argument(
        "--model", type=Path, default=None, help="model folder (default: the embedded model)"
    )
    add_provider_argument(p)
    p.add_argument("--system", default=None, help="a system message that opens the conversation")
    add_spec_arguments(p)
    p.add_argument(
        "--stats", action="store_true", help="print each reply's timings and speculation to stderr"
    )
    add_threads_argument(p)
    add_search_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from onnx_genrt.core.errors import InvalidInputError
    from onnx_genrt.engine import Model, stream

    from .generate_cli import default_model_dir, provider_args

    model = Model(args.model or default_model_dir(), provider_args(args.provider, args.threads))
    opening = [{"role": "system", "content": args.system}] if args.system else []
    # Check the template and the system message before the first line is read.
    model.tokenizer.apply_chat_template(opening or [{"role": "user", "content": ""}])
    messages = list(opening)
    interactive = sys.stdin.isatty()
    if interactive:
        print("onnx-genrt chat: /reset forgets the conversation, /exit ends", file=sys.stderr)
    while True:
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:  # end of input
            return 0
        text = line.rstrip("\r\n")
        command = text.strip()
        if command == "/exit":
            return 0
        if command == "/reset":
            messages = list(opening)
            print("(conversation reset)", file=sys.stderr, flush=True)
            continue
        if not command:
            continue
        attempt = [*messages, {"role": "user", "content": text}]
        prompt = model.tokenizer.apply_chat_template(attempt, add_generation_prompt=True)
        results: list = []
        try:
            pieces = stream(
                model,
                prompt,
                args.max_new_tokens,
                stop=tuple(args.stop),
                ignore_eos=args.ignore_eos,
                spec=args.spec,
                k=args.k,
                result=results,
                **search_kwargs(args),
            )
        except InvalidInputError as exc:  # the conversation outgrew the context
            print(
                f"onnx-genrt chat: error: {exc}; /reset to start over", file=sys.stderr, flush=True
            )
            continue
        reply = []
        for piece in pieces:
            reply.append(piece)
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        sys.stdout.flush()
        if args.stats and results:
            print(stats_text(results[0]), file=sys.stderr, flush=True)
        messages = [*attempt, {"role": "assistant", "content": "".join(reply)}]
