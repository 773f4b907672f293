#!/usr/bin/env python3
"""One request at a time: ``generate`` against the continuous-batching ``Scheduler``, read
from a thread (``events``) and from asyncio (``stream``, as the server reads it). The gap
between the rows is the scheduler's cost per token at batch 1, without HTTP.

    python scripts/scheduler_overhead.py [--model DIR] [--provider cuda] [--tokens 64] [--requests 8]
"""

from __future__ import annotations

import argparse
import asyncio
import time

from onnx_genrt.engine import Model, generate
from onnx_genrt.engine.scheduler import Scheduler
from onnx_genrt.models import default_model_path

PROMPT = "def add(a, b):"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model folder (default: the embedded model)")
    p.add_argument("--provider", default="cpu")
    p.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    p.add_argument("--requests", type=int, default=8, help="timed requests per row")
    args = p.parse_args()
    model = Model(args.model or default_model_path(), args.provider)
    n, reqs = args.tokens, args.requests

    def timed(run) -> float:
        run()  # warm-up
        start = time.perf_counter()
        tokens = sum(run() for _ in range(reqs))
        return tokens / (time.perf_counter() - start)

    def plain() -> int:
        return generate(model, PROMPT, max_new_tokens=n, ignore_eos=True).new_tokens

    print(f"generate           {timed(plain):9.1f} tok/s")
    with Scheduler(model, max_batch=16) as sched:

        def threaded() -> int:
            events = sched.submit(PROMPT, max_new_tokens=n, ignore_eos=True).events()
            return sum(len(e.token_ids) for e in events)

        async def streamed() -> int:
            handle = sched.submit(PROMPT, max_new_tokens=n, ignore_eos=True)
            return sum([len(e.token_ids) async for e in handle.stream()])

        print(f"scheduler events() {timed(threaded):9.1f} tok/s")
        print(f"scheduler stream() {timed(lambda: asyncio.run(streamed())):9.1f} tok/s")


if __name__ == "__main__":
    main()
