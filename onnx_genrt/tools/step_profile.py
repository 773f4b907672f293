"""``onnx-genrt profile``: where one decode step's time goes: the whole step, the graph
replay alone, and each op.

    onnx-genrt profile --model DIR --provider cuda [--width 1 | --rows N] [--top 12]

``--rows N`` times a batched decode step instead: N rows of one token each, every row at
``--context`` cached positions (a continuous batch's step, ``BatchGenerator``).

- ``step``: a graphed step as generation runs it (write ids and mask, replay, read back the
  token ids and the non-finite probe);
- ``replay``: back-to-back replays of the captured graph, one sync at the end: the device
  time of the graph, launch gaps included;
- per op: every node run eagerly and timed alone. On a device with a stream, a spin kernel
  keeps the device busy while the node's launches are queued, so the events around the
  node measure its kernels, not the host's launch cost.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from onnx_genrt.cli_args import POSITIVE_INT
from onnx_genrt.core.errors import InvalidInputError
from onnx_genrt.core.graph_slots import DeviceGraphSlot

from .step_options import RunnerOwner, add_step_arguments, model_folder, step_providers

_SPIN = r"""
extern "C" __global__ void spin(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {}
}
"""


@dataclass
class NodeTime:
    op: str
    name: str
    ms: float


def _timer(provider: Any):
    """(start, stop) functions timing work queued on ``provider`` between them, in ms."""
    stream = getattr(provider, "stream", None)
    if stream is None:
        state: dict[str, float] = {}

        def start() -> None:
            state["t"] = time.perf_counter()

        def stop() -> float:
            return (time.perf_counter() - state["t"]) * 1e3

        return start, stop, lambda: None

    import cupy

    spin = cupy.RawKernel(_SPIN, "spin")
    clock_khz = cupy.cuda.Device().attributes["ClockRate"]
    events: dict[str, Any] = {}

    def start() -> None:
        with stream:
            # ~0.5 ms of device work, so the node's launches queue up behind it.
            spin((1,), (1,), (cupy.int64(clock_khz * 0.5),))
        events["a"] = stream.record()

    def stop() -> float:
        b = stream.record()
        b.synchronize()
        return cupy.cuda.get_elapsed_time(events["a"], b)

    return start, stop, stream.synchronize


def profile_nodes(
    runner: Any,
    width: int,
    repeats: int,
    then: Callable[[], None] | None = None,
    then_session: Any = None,
    step: Callable[[], None] | None = None,
) -> list[NodeTime]:
    """Each node of one eager step of ``width`` tokens, timed alone; median of ``repeats``.

    ``then()`` runs more eager work after the step (the MTP chain) on ``then_session``,
    whose nodes are timed the same way. ``step()``: the eager step itself, instead of one
    of ``width`` tokens after the runner's cache (a batched step, say). Nodes are timed
    through the sessions' launch hooks (``InferenceSession.on_launch``)."""
    provider = runner.session.main_provider
    start, stop, sync = _timer(provider)
    times: dict[int, list[float]] = defaultdict(list)
    names: dict[int, tuple[str, str]] = {}
    position = {"next": 0}

    @contextmanager
    def timed(node: Any) -> Iterator[None]:
        i = position["next"]
        position["next"] += 1
        start()
        yield
        times[i].append(stop())
        names[i] = (node.op_type, node.name)

    sessions = [runner.session] if then_session is None else [runner.session, then_session]
    length = runner.cache.length
    try:
        with ExitStack() as hooks:
            for session in sessions:
                hooks.enter_context(session.on_launch(timed))
            for _ in range(repeats):
                position["next"] = 0
                runner.rewind_to(length)
                if step is None:
                    runner.forward(list(range(7, 7 + width)), None, width)
                else:
                    step()
                if then is not None:
                    then()
                sync()
    finally:
        runner.rewind_to(length)
    return [NodeTime(*names[i], statistics.median(t)) for i, t in sorted(times.items())]


def profile_step(
    folder: Path, provider: Any, width: int, context: int, steps: int, mtp: bool = False
) -> dict[str, Any]:
    """``mtp``: the step is a verify of ``width`` tokens with the model's MTP chain of
    ``width - 1`` drafts queued after it (as speculative decoding runs it)."""
    if mtp and width < 2:
        raise InvalidInputError(f"--mtp needs --width k+1 >= 2, got --width {width}")
    from onnx_genrt.engine import Model
    from onnx_genrt.engine.api import make_proposer

    model = Model(folder, provider)
    owner = RunnerOwner()
    runner = model.acquire_runner(owner, context + width + 2)
    runner.forward(list(range(1, context + 1)), None)
    slot = DeviceGraphSlot.PRIMARY if width == 1 else DeviceGraphSlot.VERIFY
    hook, then, chain_session = None, None, None
    if mtp:
        proposer = make_proposer(model, "mtp", context + width + 2)
        hook = proposer.chain_hook(runner, width - 1, width - 1, context)
        if hook is None:
            raise InvalidInputError(
                f"--mtp: {folder} has no MTP head fed by a hidden-states output; "
                "leave --mtp out or give a model with one"
            )
        key = (id(runner), width - 1, bool(runner.io.reads_async))
        chain_session, chain_binding = proposer._after[key][:2]

        def then() -> None:
            chain_session.run_eager_with_iobinding(chain_binding)

    tokens = list(range(7, 7 + width))
    step_times = []
    for i in range(steps + 3):
        runner.rewind_to(context)
        t0 = time.perf_counter()
        _ = runner.forward(tokens, slot, width, after=hook).tokens
        if i >= 3:
            step_times.append((time.perf_counter() - t0) * 1e3)
    prov = runner.session.main_provider
    replay_ms = float("nan")
    if prov.has_graph(slot):
        prov.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            prov.replay(slot)
        prov.synchronize()
        replay_ms = (time.perf_counter() - t0) * 1e3 / steps
    runner.rewind_to(context)
    nodes = profile_nodes(runner, width, repeats=5, then=then, then_session=chain_session)
    return {
        "step_ms": statistics.median(step_times),
        "replay_ms": replay_ms,
        "nodes": nodes,
        "stats": model.session.all_graph_stats().get(slot.value, {}),
    }


def profile_rows(
    folder: Path, provider: Any, rows: int, context: int, steps: int
) -> dict[str, Any]:
    """A batched decode step of ``rows`` rows, one token each, every row after ``context``
    cached positions: timed as a batch runs it (graphed, its argmax read back), its graph
    replayed alone, and its nodes run eagerly and timed alone."""
    import numpy as np

    from onnx_genrt.engine import Model
    from onnx_genrt.session.slot_runner import VARIANT_PARTS

    model = Model(folder, provider)
    batch = model.take_batch(rows, context + 2)
    runner = batch.runner
    prompt = np.tile(np.arange(1, context + 1, dtype=np.int64), (rows, 1))
    runner.finish_rows(runner.launch_rows(prompt, np.zeros(rows, np.int64), None))
    tokens = np.full(rows, 7, np.int64)
    lengths = np.full(rows, context, np.int64)
    slot = DeviceGraphSlot.PRIMARY
    step_times = []
    for i in range(steps + 3):
        t0 = time.perf_counter()
        runner.finish_rows(runner.launch_rows(tokens, lengths, slot))
        if i >= 3:
            step_times.append((time.perf_counter() - t0) * 1e3)
    prov = runner.session.main_provider
    part = (runner.variant_base + rows) * VARIANT_PARTS  # a one-token step of ``rows`` rows
    replay_ms = float("nan")
    if prov.has_graph(slot, part):
        prov.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            prov.replay(slot, part)
        prov.synchronize()
        replay_ms = (time.perf_counter() - t0) * 1e3 / steps

    def step() -> None:
        runner.finish_rows(runner.launch_rows(tokens, lengths, None))

    nodes = profile_nodes(runner, 1, repeats=5, step=step)
    return {
        "step_ms": statistics.median(step_times),
        "replay_ms": replay_ms,
        "nodes": nodes,
        "stats": model.session.all_graph_stats().get(slot.value, {}),
    }


def report(result: dict[str, Any], top: int) -> str:
    nodes: list[NodeTime] = result["nodes"]
    total = sum(n.ms for n in nodes)
    by_op: dict[str, list[float]] = defaultdict(list)
    for n in nodes:
        by_op[n.op].append(n.ms)
    lines = [
        f"step {result['step_ms']:.3f} ms | graph replay alone {result['replay_ms']:.3f} ms | "
        f"sum of {len(nodes)} nodes timed alone {total:.3f} ms",
        f"{'op':<34} {'nodes':>5} {'ms':>8} {'share':>6} {'us/node':>8}",
    ]
    for op, ts in sorted(by_op.items(), key=lambda kv: -sum(kv[1])):
        s = sum(ts)
        lines.append(
            f"{op:<34} {len(ts):>5} {s:>8.3f} {100 * s / total:>5.1f}% {1e3 * s / len(ts):>8.1f}"
        )
    lines.append(f"top {top} nodes:")
    for n in sorted(nodes, key=lambda n: -n.ms)[:top]:
        lines.append(f"  {n.ms * 1e3:>8.1f} us  {n.op:<28} {n.name}")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The step flags, then the step's width, the nodes listed and ``--mtp``."""
    add_step_arguments(p)
    p.add_argument("--width", type=POSITIVE_INT, default=1, help="tokens per step (1 = decode)")
    p.add_argument(
        "--rows",
        type=POSITIVE_INT,
        default=None,
        help="a batched decode step of this many rows instead, one token each, every row "
        "after --context cached positions",
    )
    p.add_argument("--top", type=POSITIVE_INT, default=12, help="slowest nodes listed")
    p.add_argument("--mtp", action="store_true", help="verify step + the MTP chain after it")


def run(a: argparse.Namespace) -> int:
    """``onnx-genrt profile``: time the step, print the report."""
    if a.rows is not None:
        if a.width != 1 or a.mtp:
            raise InvalidInputError(
                "--rows times one-token decode steps: leave out --width and --mtp"
            )
        result = profile_rows(model_folder(a), step_providers(a), a.rows, a.context, a.steps)
    else:
        result = profile_step(
            model_folder(a), step_providers(a), a.width, a.context, a.steps, a.mtp
        )
    print(report(result, a.top))
    return 0


DESCRIPTION = (
    "Where one decode (or verify) step's time goes on a provider: the step as generation "
    "runs it, the captured graph replayed alone, and every node run eagerly and timed alone "
    "(device time on a GPU), summed per op."
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "profile",
        help="time one decode or verify step: graph replay and per op",
        description=DESCRIPTION,
    )
    add_arguments(p)
    p.set_defaults(func=run)
