"""Property-based fuzzing of loading, planning and running on the CPU provider.

Valid seed models are mutated (dims, element types, attributes, edges, initializer bytes,
opsets, op types, serialized bytes) and run through ``InferenceSession``. Each mutated
model must either give a result or raise one of the project's errors
(:class:`~onnx_genrt.core.errors.OnnxGenrtError`): never another exception type, a crash
or a hang (each example runs under a hard time limit and an address-space cap).
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
from collections.abc import Iterator

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from onnx_genrt.core.errors import OnnxGenrtError
from onnx_genrt.session import InferenceSession

from .mutations import MUTATIONS, mutate_bytes
from .seeds import feeds_for, seed_models

SEEDS = seed_models()
SERIALIZED = [m.SerializeToString() for m in SEEDS]
#: Mutated models per run: 2000 in CI; set ONNX_GENRT_FUZZ_EXAMPLES for a longer search.
EXAMPLES = int(os.environ.get("ONNX_GENRT_FUZZ_EXAMPLES", "2000"))
#: Seconds one mutated model may take to load, plan and run before it counts as a hang.
TIME_LIMIT_S = 20
#: Address space one mutated model may add to the process: a larger allocation is a
#: MemoryError (which must surface as the project's error), not the machine's OOM killer.
MEMORY_LIMIT_BYTES = 4 << 30


class Hang(Exception):
    """A mutated model ran past the time limit."""


@contextlib.contextmanager
def time_limit(seconds: int) -> Iterator[None]:
    def expire(signum, frame):
        raise Hang(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@contextlib.contextmanager
def memory_limit(extra_bytes: int) -> Iterator[None]:
    """Cap the process's address space at its current size plus ``extra_bytes``."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/statm") as f:
        current = int(f.read().split()[0]) * resource.getpagesize()
    cap = current + extra_bytes
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def load_plan_run(source: bytes | onnx.ModelProto, feeds: dict[str, np.ndarray]) -> object:
    """The outcome: the outputs, or the project's error. Anything else propagates."""
    with time_limit(TIME_LIMIT_S), memory_limit(MEMORY_LIMIT_BYTES):
        try:
            session = InferenceSession(source, enable_graphs=False)
            return session.run(None, feeds)
        except OnnxGenrtError as exc:
            return exc


@pytest.mark.parametrize("index", range(len(SEEDS)))
def test_seeds_run_and_match_the_onnx_reference(index):
    from onnx.reference import ReferenceEvaluator

    feeds = feeds_for(SEEDS[index], np.random.default_rng(0))
    outcome = load_plan_run(SERIALIZED[index], feeds)
    assert not isinstance(outcome, Exception), outcome
    expected = ReferenceEvaluator(SEEDS[index]).run(None, feeds)
    for got, want in zip(outcome, expected, strict=True):
        assert got.dtype == want.dtype
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@settings(
    max_examples=EXAMPLES,
    deadline=None,  # a hard SIGALRM limit per example instead (a loaded CI machine varies)
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data())
def test_mutated_models_give_a_result_or_a_project_error(data):
    index = data.draw(st.integers(0, len(SEEDS) - 1), label="seed")
    model = onnx.ModelProto()
    model.CopyFrom(SEEDS[index])
    for mutation in data.draw(st.lists(st.sampled_from(MUTATIONS), min_size=1, max_size=3)):
        mutation(model, data.draw)
    feeds = feeds_for(model if data.draw(st.booleans()) else SEEDS[index], np.random.default_rng(0))
    source = model.SerializeToString()
    if data.draw(st.integers(0, 9)) == 0:
        source = mutate_bytes(source, data.draw)
    outcome = load_plan_run(source, feeds)
    event(f"outcome: {type(outcome).__name__ if isinstance(outcome, Exception) else 'result'}")
