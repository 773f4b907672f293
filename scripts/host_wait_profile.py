"""Where a generation's host time goes: waiting on the device vs everything else, per step.

    python scripts/host_wait_profile.py --provider cuda [--spec mtp] [--tokens 256]

Times ``PendingStep.wait`` (the host blocked on the device's results) during a timed
generation after warm-up runs. A step whose wait is a large share of its time is bound by the
device (fewer or cheaper kernels help); a small share means the host is the bottleneck.
``--cprofile N`` also prints the top N functions of one more generation by own time.

``--rows N`` times a batched greedy generation of N rows instead (``generate_batch``, random
prompts of 32 tokens), with the batch's look-ahead on and off: per step, the time in
``DecoderRunner.finish_rows`` (mostly waiting on the device) and in ``launch_rows``.
``--events`` (CUDA) also times, on the device, what each decode step queues on the stream
(medians over the steps): the input upload, the token copy, the wait for the graph's launch,
the graph, the read-back, and the time between one step's read-back and the next step's
upload (the device idle, or other work); then the same graph replayed alone, back to back.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import time

from onnx_genrt.engine import Model, generate
from onnx_genrt.engine import decoder as decoder_module
from onnx_genrt.generate_cli import default_model_dir


class _StreamEvents:
    """CUDA events recorded on the session's stream around the engine's per-step calls
    (``DeviceIO.write`` / ``copy`` / ``read_later`` and the provider's graph replay), outside
    captures; each upload starts a step's record."""

    LABELS = ("upload", "token copy", "before graph", "graph", "read-back", "between steps")

    def __init__(self, model: Model) -> None:
        import cupy

        from onnx_genrt.session.device_io import DeviceIO

        self.cupy, self.provider = cupy, model.session.main_provider
        #: per step: the (slot, part) of the graph it replayed, and its (label, event) marks
        self.steps: list[tuple[list, list[tuple[str, object]]]] = []
        self.on = False
        for cls, name, label in (
            (DeviceIO, "write", "upload"),
            (DeviceIO, "copy", "token copy"),
            (DeviceIO, "read_later", "read-back"),
        ):
            self._wrap(cls, name, label)
        replay = self.provider.graph_replay

        def graph_replay(slot, part):
            self._mark("before graph")
            if self.on and self.steps:
                self.steps[-1][0][:] = [slot, part]
            replay(slot, part)
            self._mark("graph")

        self.provider.graph_replay = graph_replay

    def _mark(self, label: str) -> None:
        if not self.on or self.provider.capturing is not None:
            return
        if label == "start":
            self.steps.append(([], []))
        if self.steps:
            event = self.cupy.cuda.Event()
            event.record(self.provider.stream)
            self.steps[-1][1].append((label, event))

    def _wrap(self, cls: type, name: str, label: str) -> None:
        original = getattr(cls, name)

        def wrapped(*args, **kwargs):
            if label == "upload":
                self._mark("start")
            result = original(*args, **kwargs)
            self._mark(label)
            return result

        setattr(cls, name, wrapped)

    def report(self) -> str:
        """Median device ms of each part over the steps that replayed the most common
        graph (the decode step: prompts left out), and that graph replayed alone."""
        import statistics

        self.provider.synchronize()
        replayed = [tuple(part) for part, _ in self.steps if part]
        common = max(set(replayed), key=replayed.count)
        spent: dict[str, list[float]] = {k: [] for k in self.LABELS}
        whole = []
        for i, (part, marks) in enumerate(self.steps):
            if tuple(part) != common or i + 1 >= len(self.steps):
                continue
            nxt = self.steps[i + 1][1][0][1]
            for (_, a), (label, b) in zip(marks, marks[1:], strict=False):
                spent[label].append(self.cupy.cuda.get_elapsed_time(a, b))
            spent["between steps"].append(self.cupy.cuda.get_elapsed_time(marks[-1][1], nxt))
            whole.append(self.cupy.cuda.get_elapsed_time(marks[0][1], nxt))
        n = len(whole)
        self.steps.clear()
        alone = self._replay_alone(*common)
        parts = ", ".join(f"{k} {statistics.median(v):.3f}" for k, v in spent.items() if v)
        return (
            f"{n} steps, median ms: whole {statistics.median(whole):.3f} (mean "
            f"{statistics.mean(whole):.3f}, max {max(whole):.3f}); {parts}; "
            f"the graph replayed alone {alone:.3f}"
        )

    def _replay_alone(self, slot, part, times: int = 50) -> float:
        """Mean device ms of ``times`` back-to-back replays of one graph."""
        stream = self.provider.stream
        self.provider.synchronize()
        a, b = self.cupy.cuda.Event(), self.cupy.cuda.Event()
        a.record(stream)
        for _ in range(times):
            self.provider.graph_replay(slot, part)
        b.record(stream)
        b.synchronize()
        return self.cupy.cuda.get_elapsed_time(a, b) / times


def _batch(model: Model, rows: int, tokens: int, cprofile: int, events: bool = False) -> None:
    """The ``--rows`` report (see the module docstring)."""
    import numpy as np

    from onnx_genrt.engine import generate_batch
    from onnx_genrt.engine.batch import BatchGenerator
    from onnx_genrt.engine.decoder import DecoderRunner

    spent: dict[str, list[float]] = {"finish_rows": [0.0, 0], "launch_rows": [0.0, 0]}
    finished: list[float] = []  # when each finish_rows returned
    for name, tally in spent.items():
        original = getattr(DecoderRunner, name)

        def timed(*args, _original=original, _tally=tally, _name=name, **kwargs):
            t = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                done = time.perf_counter()
                _tally[0] += done - t
                _tally[1] += 1
                if _name == "finish_rows":
                    finished.append(done)

        setattr(DecoderRunner, name, timed)
    collected: list[list[float]] = [[0.0, 0] for _ in range(3)]  # per generation: s, count
    began = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            collected[info["generation"]][0] += time.perf_counter() - began[0]
            collected[info["generation"]][1] += 1

    gc.callbacks.append(on_gc)
    marks = _StreamEvents(model) if events else None
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    prompts = [rng.integers(1, vocab, 32).tolist() for _ in range(rows)]
    kwargs = {"min_length": 32 + tokens}
    for ahead in (None, False):
        BatchGenerator.look_ahead = ahead
        generate_batch(model, prompts, tokens, **kwargs)
        for tally in spent.values():
            tally[:] = [0.0, 0]
        for tally in collected:
            tally[:] = [0.0, 0]
        finished.clear()
        if marks is not None:
            marks.on = True
        res = generate_batch(model, prompts, tokens, **kwargs)[0]
        if marks is not None:
            marks.on = False
        steps = tokens - 1
        parts = ", ".join(
            f"{name} {t / steps * 1e3:.3f} ms ({n} calls)" for name, (t, n) in spent.items()
        )
        print(
            f"{rows} rows, look-ahead {'auto' if ahead is None else 'off'}: "
            f"{rows * steps / res.decode_seconds:.1f} tok/s, "
            f"{res.decode_seconds / steps * 1e3:.3f} ms a step; per step: {parts}"
        )
        gaps = np.diff(finished) * 1e3
        print(
            f"  between finish_rows returns, ms: median {np.median(gaps):.3f}, mean "
            f"{gaps.mean():.3f}, max {gaps.max():.3f}; first to last {np.sum(gaps):.1f} of "
            f"{res.decode_seconds * 1e3:.1f} ms decoding; garbage collections (generation: "
            "count, ms): "
            + ", ".join(f"{g}: {n}, {t * 1e3:.1f}" for g, (t, n) in enumerate(collected))
        )
        if marks is not None:
            print(f"  on the device: {marks.report()}")
    BatchGenerator.look_ahead = None
    gc.callbacks.remove(on_gc)
    if cprofile:
        profiler = cProfile.Profile()
        profiler.enable()
        generate_batch(model, prompts, tokens, **kwargs)
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(cprofile)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model folder (default: the embedded model)")
    p.add_argument("--provider", default="cuda")
    p.add_argument("--spec", action="append", default=None, help="none, mtp, draft or ngram")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--prompt", default="    def __init__(self")
    p.add_argument("--cprofile", type=int, default=0, metavar="N")
    p.add_argument("--rows", type=int, default=0, help="a batched generation of N rows")
    p.add_argument("--events", action="store_true", help="with --rows: device time per part")
    a = p.parse_args(argv)
    model = Model(a.model or default_model_dir(), a.provider)
    if a.rows:
        _batch(model, a.rows, a.tokens, a.cprofile, a.events)
        return
    waited = [0.0, 0]
    original = decoder_module.PendingStep.wait

    def timed_wait(self):
        t = time.perf_counter()
        try:
            return original(self)
        finally:
            waited[0] += time.perf_counter() - t
            waited[1] += 1

    decoder_module.PendingStep.wait = timed_wait
    for name in a.spec or ["none", "mtp"]:
        spec = None if name == "none" else name
        kwargs = {"max_new_tokens": a.tokens, "ignore_eos": True, "spec": spec}
        for _ in range(2):
            generate(model, a.prompt, **kwargs)
        waited[:] = [0.0, 0]
        t = time.perf_counter()
        res = generate(model, a.prompt, **kwargs)
        total = time.perf_counter() - t
        stats = res.speculation
        steps = stats.get("verify_steps", 0) + stats.get("plain_steps", 0) or a.tokens
        print(
            f"{name}: {res.decode_tokens_per_second:.0f} tok/s, {steps} steps, "
            f"{total / steps * 1e6:.0f} us a step, {waited[0] / steps * 1e6:.0f} us of it "
            f"waiting on the device ({waited[1]} waits)"
        )
        if a.cprofile:
            profiler = cProfile.Profile()
            profiler.enable()
            generate(model, a.prompt, **kwargs)
            profiler.disable()
            pstats.Stats(profiler).sort_stats("tottime").print_stats(a.cprofile)


if __name__ == "__main__":
    main()
