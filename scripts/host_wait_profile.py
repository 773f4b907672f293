"""Where a generation's host time goes: waiting on the device vs everything else, per step.

    python scripts/host_wait_profile.py --provider cuda [--spec mtp] [--tokens 256]

Times ``PendingStep.wait`` (the host blocked on the device's results) during a timed
generation after warm-up runs. A step whose wait is a large share of its time is bound by the
device (fewer or cheaper kernels help); a small share means the host is the bottleneck.
``--cprofile N`` also prints the top N functions of one more generation by own time.

``--rows N`` times a batched greedy generation of N rows instead (``generate_batch``, random
prompts of 32 tokens), with the batch's look-ahead on and off: per step, the time in
``DecoderRunner.finish_rows`` (mostly waiting on the device) and in ``launch_rows``.
``--events`` (CUDA) also times, on the device, what each step queues on the stream: the
input upload, the token copy, the graph, the read-back, and the time between one step's
read-back and the next step's upload (the device idle, or other work).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

from onnx_genrt.engine import Model, generate
from onnx_genrt.engine import decoder as decoder_module
from onnx_genrt.generate_cli import default_model_dir


class _StreamEvents:
    """CUDA events recorded on the session's stream around the engine's per-step calls
    (``DeviceIO.write`` / ``copy`` / ``read_later`` and the graph run), outside captures."""

    LABELS = ("upload", "token copy", "graph", "read-back", "between steps")

    def __init__(self, model: Model) -> None:
        import cupy

        from onnx_genrt.session import InferenceSession
        from onnx_genrt.session.device_io import DeviceIO

        self.cupy, self.provider = cupy, model.session.main_provider
        self.marks: list[tuple[str, object]] = []
        self.on = False
        for cls, name, label in (
            (DeviceIO, "write", "upload"),
            (DeviceIO, "copy", "token copy"),
            (InferenceSession, "run_with_iobinding", "graph"),
            (DeviceIO, "read_later", "read-back"),
        ):
            self._wrap(cls, name, label)

    def _mark(self, label: str) -> None:
        if self.on and self.provider.capturing is None:
            event = self.cupy.cuda.Event()
            event.record(self.provider.stream)
            self.marks.append((label, event))

    def _wrap(self, cls: type, name: str, label: str) -> None:
        original = getattr(cls, name)

        def wrapped(*args, **kwargs):
            if label == "upload":
                self._mark("start")
            result = original(*args, **kwargs)
            self._mark(label)
            return result

        setattr(cls, name, wrapped)

    def report(self, steps: int) -> str:
        """Device ms per step in each part (events paired in stream order)."""
        self.provider.synchronize()
        spent = dict.fromkeys(self.LABELS, 0.0)
        for (_, a), (label, b) in zip(self.marks, self.marks[1:], strict=False):
            key = "between steps" if label == "start" else label
            spent[key] += self.cupy.cuda.get_elapsed_time(a, b)
        self.marks.clear()
        return ", ".join(f"{k} {v / steps:.3f}" for k, v in spent.items())


def _batch(model: Model, rows: int, tokens: int, cprofile: int, events: bool = False) -> None:
    """The ``--rows`` report (see the module docstring)."""
    import numpy as np

    from onnx_genrt.engine import generate_batch
    from onnx_genrt.engine.batch import BatchGenerator
    from onnx_genrt.engine.decoder import DecoderRunner

    spent: dict[str, list[float]] = {"finish_rows": [0.0, 0], "launch_rows": [0.0, 0]}
    for name, tally in spent.items():
        original = getattr(DecoderRunner, name)

        def timed(*args, _original=original, _tally=tally, **kwargs):
            t = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                _tally[0] += time.perf_counter() - t
                _tally[1] += 1

        setattr(DecoderRunner, name, timed)
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
        if marks is not None:
            print(f"  on the device, ms a step (prompts included): {marks.report(steps)}")
    BatchGenerator.look_ahead = None
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
