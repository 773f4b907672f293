#!/usr/bin/env python3
"""Where one streaming client's time goes: the serving path cut into layers, each timed alone.

    python scripts/serve_layers.py [--provider cpu] [--tokens 128] [--requests 4] [--rounds 5]

One request at a time, the same prompt and ``max_tokens`` in every row, rows interleaved
round by round (a shared machine drifts), each row preceded by an untimed request:

- ``generate``: the engine alone.
- ``scheduler stream()``: the continuous-batching ``Scheduler`` read from asyncio.
- ``service events()``: the server's SSE strings (bridge + JSON), no HTTP.
- ``asgi app``: the Starlette app called with an ASGI ``send`` that drops the bytes.
- ``http + httpx``: ``onnx-genrt serve`` as a process, read by a raw httpx line reader.
- ``http + openai``: the same server, read by the official ``openai`` client.

Prints, per row, tokens/s (median, min-max over the rounds) and CPU microseconds per token:
of this process for the in-process rows; for the HTTP rows, of the server process (its
event-loop thread and the rest) and of the client (this thread) apart. The in-process rows
and the server run one at a time: the other side is idle meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import openai

from onnx_genrt.engine import Model, generate
from onnx_genrt.engine.scheduler import Scheduler
from onnx_genrt.models import default_model_path
from onnx_genrt.serve.app import service_app
from onnx_genrt.serve.protocol import parse_request
from onnx_genrt.serve.service import Service

PROMPT = "import os"  # the embedded model goes on for hundreds of tokens after it


@dataclass
class Row:
    name: str
    rates: list[float] = field(default_factory=list)
    #: CPU microseconds per token, by part (``process``; ``server loop``, ``server rest``,
    #: ``client``).
    cpu: dict[str, list[float]] = field(default_factory=dict)

    def add(self, tokens: int, wall: float, **cpu_seconds: float) -> None:
        self.rates.append(tokens / wall)
        for part, seconds in cpu_seconds.items():
            self.cpu.setdefault(part, []).append(seconds / tokens * 1e6)

    def line(self) -> str:
        rate = f"{statistics.median(self.rates):7.0f} ({min(self.rates):.0f}-{max(self.rates):.0f})"
        cpu = ", ".join(f"{part} {statistics.median(v):.0f}" for part, v in self.cpu.items())
        return f"{self.name:20s} {rate:>20s} tok/s   CPU us/token: {cpu}"


def process_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def thread_cpu_of(pid: int) -> dict[int, float]:
    """CPU seconds of each thread of process ``pid`` (Linux /proc schedstat, nanoseconds)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/schedstat") as stat:
            out[int(tid)] = int(stat.read().split()[0]) / 1e9
    return out


def _usage_tokens(lines) -> int:
    """Completion tokens of the usage chunk among server-sent event lines."""
    tokens = 0
    for line in lines:
        if line.startswith("data: {"):
            usage = json.loads(line[6:]).get("usage")
            if usage:
                tokens = usage["completion_tokens"]
    return tokens


def timed_in_process(row: Row, run: Callable[[], int], requests: int) -> None:
    run()  # untimed
    cpu, wall = process_cpu(), time.perf_counter()
    tokens = sum(run() for _ in range(requests))
    wall = time.perf_counter() - wall
    row.add(tokens, wall, process=process_cpu() - cpu)


def timed_http(row: Row, run: Callable[[], int], requests: int, pid: int) -> None:
    run()  # untimed
    before, cpu, wall = thread_cpu_of(pid), time.thread_time(), time.perf_counter()
    tokens = sum(run() for _ in range(requests))
    wall, cpu, after = time.perf_counter() - wall, time.thread_time() - cpu, thread_cpu_of(pid)
    spent = {tid: after[tid] - before.get(tid, 0.0) for tid in after}
    loop = spent.pop(pid, 0.0)  # uvicorn's event loop runs in the main thread
    row.add(tokens, wall, **{"server loop": loop, "server rest": sum(spent.values())}, client=cpu)


class Server:
    """``onnx-genrt serve`` on 127.0.0.1 at a free port, stopped by its pid."""

    def __init__(self, provider: str, log: str) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "onnx_genrt", "serve", "--provider", provider]
        command += ["--max-batch", "16", "--port", str(self.port)]
        with open(log, "wb") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and self.process.poll() is None:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.3)
        raise SystemExit(f"the server did not start; see {log}")

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(60)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--provider", default="cpu")
    p.add_argument("--tokens", type=int, default=128, help="max_tokens of every request")
    p.add_argument("--requests", type=int, default=4, help="timed requests per row and round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--log", default="/tmp/serve_layers_server.log")
    args = p.parse_args()
    n, reqs = args.tokens, args.requests
    body = {"model": "default", "prompt": PROMPT, "max_tokens": n, "temperature": 0}
    stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}

    model = Model(default_model_path(), args.provider)
    service = Service(
        model,
        model_name="default",
        max_batch=16,
        max_queue=256,
        max_length=None,
        grace_period=5,
        warmup=True,
    )
    service.start()
    scheduler: Scheduler = service.scheduler
    server = Server(args.provider, args.log)
    http = httpx.Client(timeout=120)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)

    def plain() -> int:
        return generate(model, PROMPT, max_new_tokens=n).new_tokens

    async def streamed() -> int:
        handle = scheduler.submit(PROMPT, max_new_tokens=n)
        return sum([len(e.token_ids) async for e in handle.stream()])

    async def service_events() -> int:
        request = parse_request(stream_body, chat=False)
        handle = service.submit(request)
        async for sse in service.events(request, handle, time.perf_counter()):
            assert sse.startswith("data: ")
        return handle.result(timeout=60).completion_tokens

    app = service_app(service)  # called without its lifespan: the service runs already

    async def asgi_app() -> int:
        bodies: list[bytes] = []
        messages = [{"type": "http.request", "body": json.dumps(stream_body).encode()}]

        async def receive() -> dict:
            if messages:
                return messages.pop()
            await asyncio.Event().wait()  # no disconnect: the response ends the call
            raise AssertionError

        async def send(message: dict) -> None:
            bodies.append(message.get("body", b""))

        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": "/v1/completions",
            "raw_path": b"/v1/completions",
            "query_string": b"",
            "headers": [(b"content-type", b"application/json")],
            "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 80),
        }
        await app(scope, receive, send)
        return _usage_tokens(b"".join(bodies).decode().splitlines())

    def raw_httpx() -> int:
        with http.stream("POST", f"{server.url}/v1/completions", json=stream_body) as response:
            return _usage_tokens(response.iter_lines())

    def with_openai() -> int:
        tokens = 0
        for chunk in client.completions.create(**stream_body):
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return tokens

    rows = {
        name: Row(name)
        for name in (
            "generate",
            "scheduler stream()",
            "service events()",
            "asgi app",
            "http + httpx",
            "http + openai",
        )
    }
    try:
        for round_ in range(args.rounds):
            timed_in_process(rows["generate"], plain, reqs)
            timed_in_process(rows["scheduler stream()"], lambda: asyncio.run(streamed()), reqs)
            timed_in_process(rows["service events()"], lambda: asyncio.run(service_events()), reqs)
            timed_in_process(rows["asgi app"], lambda: asyncio.run(asgi_app()), reqs)
            timed_http(rows["http + httpx"], raw_httpx, reqs, server.process.pid)
            timed_http(rows["http + openai"], with_openai, reqs, server.process.pid)
            print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    finally:
        server.stop()
        service.drain(0)
    print(
        f"{args.provider}, {reqs} requests of {n} tokens per row and round, "
        f"{args.rounds} rounds; median (min-max):"
    )
    for row in rows.values():
        print(row.line())


if __name__ == "__main__":
    main()
