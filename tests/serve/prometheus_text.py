"""A strict reader of Prometheus' text exposition format (0.0.4), written from the format's
specification for the tests (prometheus_client is not a dependency)."""

from __future__ import annotations

import math
import re

NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
LABEL = r'[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\[\\"n])*"'
VALUE = r"[-+]?(?:[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?|Inf|NaN)"
SAMPLE = re.compile(rf"^({NAME})(?:\{{((?:{LABEL})(?:,{LABEL})*)?\}})? ({VALUE})(?: -?[0-9]+)?$")
COMMENT = re.compile(rf"^# (HELP|TYPE) ({NAME}) (.*)$")
TYPES = {"counter", "gauge", "histogram", "summary", "untyped"}
SUFFIXES = {"histogram": ("_bucket", "_sum", "_count"), "summary": ("", "_sum", "_count")}


def parse(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample as ``{(name, sorted labels): value}``; AssertionError on any line that
    breaks the format, a sample of an undeclared family, or a family declared twice."""
    assert text.endswith("\n"), "the exposition must end with a newline"
    types: dict[str, str] = {}
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line:
            continue
        comment = COMMENT.match(line)
        if comment:
            kind, name, rest = comment.groups()
            if kind == "TYPE":
                assert rest in TYPES, f"line {number}: unknown type {rest!r}"
                assert name not in types, f"line {number}: {name} declared twice"
                types[name] = rest
            continue
        assert not line.startswith("#"), f"line {number}: malformed comment {line!r}"
        sample = SAMPLE.match(line)
        assert sample, f"line {number}: not a sample: {line!r}"
        name, labels, value = sample.groups()
        family = _family(name, types)
        assert family is not None, f"line {number}: {name} has no TYPE line before it"
        pairs = tuple(
            sorted(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', labels or ""))
        )
        key = (name, pairs)
        assert key not in samples, f"line {number}: duplicate sample {line!r}"
        samples[key] = float(value.replace("Inf", "inf"))
    for family, kind in types.items():
        if kind == "histogram":
            _check_histogram(family, samples)
    return samples


def _family(name: str, types: dict[str, str]) -> str | None:
    if name in types:
        return name
    for family, kind in types.items():
        if any(name == family + s for s in SUFFIXES.get(kind, ())):
            return family
    return None


def _check_histogram(family: str, samples) -> None:
    buckets = sorted(
        (float(dict(labels)["le"].replace("Inf", "inf")), value)
        for (name, labels), value in samples.items()
        if name == f"{family}_bucket"
    )
    assert buckets and math.isinf(buckets[-1][0]), f"{family}: no +Inf bucket"
    counts = [value for _, value in buckets]
    assert counts == sorted(counts), f"{family}: bucket counts are not cumulative"
    assert samples[(f"{family}_count", ())] == counts[-1], f"{family}: _count != +Inf bucket"


def value(samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]
