"""A bounded load test of an OpenAI-compatible server with the official ``openai`` client.

    python scripts/serve_load.py --url http://127.0.0.1:8000 --requests 64 --clients 16

Each client thread sends streamed completions one after another; time to first token is
measured at the client (from sending the request to the first chunk with text). Prints the
p50/p99 time to first token, the requests' mean latency and the aggregate tokens per second
(completion tokens of all requests over the wall time of the run). Greedy (temperature 0).
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai

PROMPTS = ("def add(a, b):", "import os", "class Foo:", "for i in range(10):")


def one_request(client: openai.OpenAI, model: str, prompt: str, max_tokens: int):
    start = time.perf_counter()
    first = None
    tokens = 0
    stream = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].text:
            first = time.perf_counter() - start
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return first, time.perf_counter() - start, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="default")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    args = parser.parse_args()
    client = openai.OpenAI(
        base_url=f"{args.url}/v1", api_key="unused", max_retries=0, timeout=args.timeout
    )
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.requests)]
    wall = time.perf_counter()
    with ThreadPoolExecutor(args.clients) as pool:
        results = list(
            pool.map(lambda p: one_request(client, args.model, p, args.max_tokens), prompts)
        )
    wall = time.perf_counter() - wall
    ttft = np.array([r[0] for r in results if r[0] is not None])
    tokens = sum(r[2] for r in results)
    print(
        f"{args.requests} requests, {args.clients} clients, max_tokens {args.max_tokens}: "
        f"TTFT p50 {np.percentile(ttft, 50) * 1e3:.0f} ms, p99 {np.percentile(ttft, 99) * 1e3:.0f} ms; "
        f"latency mean {statistics.mean(r[1] for r in results):.2f} s; "
        f"{tokens} tokens in {wall:.1f} s = {tokens / wall:.0f} tok/s aggregate"
    )


if __name__ == "__main__":
    main()
