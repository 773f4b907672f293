"""The server's counters and their Prometheus text exposition (format 0.0.4)."""

from __future__ import annotations

import bisect
import threading
from collections import Counter
from collections.abc import Iterable

from onnx_genrt.engine.scheduler import SchedulerMetrics

#: Upper bounds (seconds) of the time-to-first-token histogram's buckets.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
PREFIX = "onnx_genrt"


class ServerCounters:
    """What the HTTP layer counts: requests by finish reason, refusals by reason, and
    time to first token as a cumulative histogram. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.finished: Counter[str] = Counter()
        self.rejected: Counter[str] = Counter()
        self._ttft_counts = [0] * (len(TTFT_BUCKETS) + 1)
        self._ttft_sum = 0.0

    def request_finished(self, reason: str) -> None:
        with self._lock:
            self.finished[reason] += 1

    def request_rejected(self, reason: str) -> None:
        with self._lock:
            self.rejected[reason] += 1

    def first_token(self, seconds: float) -> None:
        with self._lock:
            self._ttft_counts[bisect.bisect_left(TTFT_BUCKETS, seconds)] += 1
            self._ttft_sum += seconds

    def requests(self) -> tuple[Counter[str], Counter[str]]:
        """Copies of the finished (by finish reason) and rejected (by reason) counts."""
        with self._lock:
            return Counter(self.finished), Counter(self.rejected)

    def ttft_histogram(self) -> tuple[list[int], float]:
        """Cumulative counts per bucket (the last is +Inf) and the sum of observations."""
        with self._lock:
            counts, total = list(self._ttft_counts), self._ttft_sum
        cumulative, running = [], 0
        for count in counts:
            running += count
            cumulative.append(running)
        return cumulative, total


def _family(name: str, kind: str, help_text: str, samples: Iterable[str]) -> list[str]:
    return [f"# HELP {PREFIX}_{name} {help_text}", f"# TYPE {PREFIX}_{name} {kind}", *samples]


def _sample(name: str, value: float, **labels: str) -> str:
    text = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
    return (
        f"{PREFIX}_{name}{{{text}}} {_number(value)}"
        if text
        else f"{PREFIX}_{name} {_number(value)}"
    )


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    return repr(float(value)) if isinstance(value, float) else str(int(value))


def render(
    metrics: SchedulerMetrics,
    counters: ServerCounters,
    *,
    draining: bool,
    finish_reasons: Iterable[str],
) -> str:
    """The exposition text of ``/metrics``."""
    lines: list[str] = []
    lines += _family(
        "queue_depth",
        "gauge",
        "Requests waiting for a row.",
        [_sample("queue_depth", metrics.queue_depth)],
    )
    lines += _family(
        "running_rows",
        "gauge",
        "Rows generating now.",
        [_sample("running_rows", metrics.running_rows)],
    )
    lines += _family(
        "max_batch", "gauge", "Rows of the KV cache.", [_sample("max_batch", metrics.max_batch)]
    )
    lines += _family(
        "draining",
        "gauge",
        "1 while shutting down (new requests get 503).",
        [_sample("draining", int(draining))],
    )
    lines += _family(
        "tokens_per_second",
        "gauge",
        "Tokens generated per second of the scheduler's busy time.",
        [_sample("tokens_per_second", float(metrics.tokens_per_second))],
    )
    lines += _family(
        "generated_tokens_total",
        "counter",
        "Tokens generated.",
        [_sample("generated_tokens_total", metrics.tokens_generated)],
    )
    lines += _family(
        "decode_steps_total",
        "counter",
        "Batched decode steps run.",
        [_sample("decode_steps_total", metrics.decode_steps)],
    )
    cumulative, total = counters.ttft_histogram()
    bounds = [*(f"{b:g}" for b in TTFT_BUCKETS), "+Inf"]
    lines += _family(
        "time_to_first_token_seconds",
        "histogram",
        "Seconds from a request's arrival to its first token.",
        [
            *(
                _sample("time_to_first_token_seconds_bucket", c, le=b)
                for b, c in zip(bounds, cumulative, strict=True)
            ),
            _sample("time_to_first_token_seconds_sum", float(total)),
            _sample("time_to_first_token_seconds_count", cumulative[-1]),
        ],
    )
    finished, rejected = counters.requests()
    lines += _family(
        "requests_total",
        "counter",
        "Requests served, by finish reason.",
        [_sample("requests_total", finished[r], finish_reason=r) for r in finish_reasons],
    )
    lines += _family(
        "rejected_requests_total",
        "counter",
        "Requests refused before running, by reason.",
        [
            _sample("rejected_requests_total", rejected[r], reason=r)
            for r in ("invalid", "queue_full", "draining")
        ],
    )
    for stat, help_text in (
        ("captures", "Device graphs captured"),
        ("replays", "Device graph replays"),
        ("fallbacks", "Steps that ran eagerly instead of replaying a graph"),
    ):
        name = f"graph_{stat}_total"
        lines += _family(
            name,
            "counter",
            f"{help_text}, per graph slot.",
            [
                _sample(name, int(s.get(stat, 0)), slot=slot)
                for slot, s in sorted(metrics.graph_stats.items())
            ],
        )
    spec = metrics.speculation
    for stat, help_text in (
        ("verify_steps", "Decode steps that verified drafts (--spec)"),
        ("proposed", "Draft tokens proposed (--spec)"),
        ("accepted", "Draft tokens accepted (--spec)"),
    ):
        name = f"speculation_{stat}_total"
        lines += _family(name, "counter", f"{help_text}.", [_sample(name, int(spec.get(stat, 0)))])
    return "\n".join(lines) + "\n"
