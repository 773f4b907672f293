"""A bounded load test of an OpenAI-compatible server, read by the official ``openai`` client
or by a plain httpx line reader.

    python scripts/serve_load.py --url http://127.0.0.1:8000 --requests 64 --clients 16
    python scripts/serve_load.py --url http://127.0.0.1:8000 --requests 16 --clients 1 --reader httpx

Each client thread sends streamed completions one after another; time to first token is
measured at the client (from sending the request to the first chunk with text). First, each
client sends ``--warmup`` untimed requests (a fresh server's first requests compile kernels
and capture graphs: that is time to first token, not throughput). Prints the p50/p99 time
to first token, the requests' mean latency, the aggregate tokens per second (completion
tokens of all requests over the wall time of the timed run) and the CPU this process spent
per token (the load generator's own cost: on a machine of few cores it competes with the
server). Greedy (temperature 0).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai

PROMPTS = ("def add(a, b):", "import os", "class Foo:", "for i in range(10):")

#: One request: (time to first text, latency, completion tokens).
Outcome = tuple[float | None, float, int]


def openai_reader(url: str, timeout: float) -> Callable[[str, str, int], Outcome]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=timeout)

    def one_request(model: str, prompt: str, max_tokens: int) -> Outcome:
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

    return one_request


def httpx_reader(url: str, timeout: float) -> Callable[[str, str, int], Outcome]:
    client = httpx.Client(timeout=timeout, limits=httpx.Limits(max_connections=None))

    def one_request(model: str, prompt: str, max_tokens: int) -> Outcome:
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        start = time.perf_counter()
        first = None
        tokens = 0
        with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if first is None and chunk["choices"] and chunk["choices"][0]["text"]:
                    first = time.perf_counter() - start
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
        return first, time.perf_counter() - start, tokens

    return one_request


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="default")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    parser.add_argument(
        "--reader",
        choices=("openai", "httpx"),
        default="openai",
        help="the official openai client (default) or a plain httpx line reader",
    )
    parser.add_argument(
        "--warmup", type=int, default=1, help="untimed requests per client first (default 1)"
    )
    args = parser.parse_args()
    make = openai_reader if args.reader == "openai" else httpx_reader
    one_request = make(args.url, args.timeout)

    def run(prompts: list[str]) -> list[Outcome]:
        with ThreadPoolExecutor(args.clients) as pool:
            return list(pool.map(lambda p: one_request(args.model, p, args.max_tokens), prompts))

    if args.warmup:
        run([PROMPTS[i % len(PROMPTS)] for i in range(args.warmup * args.clients)])
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.requests)]
    cpu, wall = cpu_seconds(), time.perf_counter()
    results = run(prompts)
    wall, cpu = time.perf_counter() - wall, cpu_seconds() - cpu
    ttft = np.array([r[0] for r in results if r[0] is not None])
    tokens = sum(r[2] for r in results)
    print(
        f"{args.requests} requests, {args.clients} clients, max_tokens {args.max_tokens}, "
        f"{args.reader}: TTFT p50 {np.percentile(ttft, 50) * 1e3:.0f} ms, "
        f"p99 {np.percentile(ttft, 99) * 1e3:.0f} ms; "
        f"latency mean {statistics.mean(r[1] for r in results):.2f} s; "
        f"{tokens} tokens in {wall:.1f} s = {tokens / wall:.0f} tok/s aggregate; "
        f"client CPU {cpu / tokens * 1e6:.0f} us/token"
    )


if __name__ == "__main__":
    main()
