"""``onnx-genrt bench --dispatch``: per-node dispatch cost, eager bound runs against graph
replay on the same model."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass

import numpy as np
import onnx

from onnx_genrt.core.graph_slots import DeviceGraphSlot
from onnx_genrt.session import InferenceSession
from onnx_genrt.testing.models import elementwise_chain


@dataclass(frozen=True)
class DispatchResult:
    provider: str
    nodes: int
    eager_us_per_node: float
    replay_us_per_node: float

    @property
    def ratio(self) -> float:
        return self.eager_us_per_node / self.replay_us_per_node


def bound_session(model: onnx.ModelProto, provider: str | list[str], graphs: bool):
    """A session and binding for the chain model, warmed up (captured when graphs=True)."""
    providers = [provider] if isinstance(provider, str) else list(provider)
    sess = InferenceSession(model, providers=providers, enable_graphs=graphs)
    binding = sess.io_binding()
    binding.bind_input("x", np.ones((1, 8), np.float32))
    binding.bind_output("y", shape=(1, 8), dtype=np.float32)
    for _ in range(3):
        sess.run_with_iobinding(binding, DeviceGraphSlot.PRIMARY)
    sess.main_provider.synchronize()
    return sess, binding


def _time_per_run(sess: InferenceSession, binding, repeats: int) -> float:
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeats):
            sess.run_with_iobinding(binding, DeviceGraphSlot.PRIMARY)
        sess.main_provider.synchronize()
        samples.append((time.perf_counter() - start) / repeats)
    return statistics.median(samples)


def measure(
    provider: str | list[str] = "cpu", nodes: int = 200, repeats: int = 50
) -> DispatchResult:
    """Median seconds per run, eager and replayed, divided by the node count (in µs)."""
    model = elementwise_chain(nodes)
    eager, eb = bound_session(model, provider, graphs=False)
    graphed, gb = bound_session(model, provider, graphs=True)
    assert graphed.graph_stats().captures == 1, graphed.graph_stats()
    t_eager = _time_per_run(eager, eb, repeats)
    t_replay = _time_per_run(graphed, gb, repeats)
    label = provider if isinstance(provider, str) else ",".join(provider)
    return DispatchResult(label, nodes, t_eager / nodes * 1e6, t_replay / nodes * 1e6)


def format_table(results: list[DispatchResult]) -> str:
    lines = [f"{'provider':<10}{'nodes':>7}{'eager us/node':>16}{'replay us/node':>16}{'ratio':>8}"]
    for r in results:
        lines.append(
            f"{r.provider:<10}{r.nodes:>7}{r.eager_us_per_node:>16.2f}"
            f"{r.replay_us_per_node:>16.2f}{r.ratio:>7.1f}x"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """``onnx-genrt bench --dispatch``: one row per ``--provider``, a chain of ``--nodes``."""
    results = []
    for providers in args.provider:
        label = ",".join(providers)
        print(f"measuring {label}: {args.nodes} nodes x 50 runs x 5 ...", file=sys.stderr)
        results.append(measure(providers, args.nodes, 50))
    print(format_table(results))
    return 0
