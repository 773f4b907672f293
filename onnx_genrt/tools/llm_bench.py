"""``onnx-genrt bench``: prefill and decode speed, side by side with onnxruntime-genai and a
plain onnxruntime loop on the same model files, measured in one run."""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from onnx_genrt.cli_args import (
    NON_NEGATIVE_INT,
    POSITIVE,
    POSITIVE_INT,
    add_threads_argument,
    positive_int_list,
    provider_list,
)
from onnx_genrt.core.errors import InvalidInputError
from onnx_genrt.generate_cli import add_drafts_argument


@dataclass
class BenchRow:
    runtime: str
    prefill_ms: float
    decode_tok_s: float
    tokens: list[int] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    #: (fastest - slowest) / median of the timed runs' decode tok/s (0 for one run).
    decode_spread: float = 0.0


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _interleaved(
    cases: list[tuple[str, Callable[[], tuple[float, float, list[int], dict]]]],
    repeats: int,
    profile_top: int = 0,
) -> list[BenchRow]:
    """Each case's median over ``repeats`` timed runs, after one warm-up run each (compiles,
    captures). The timed runs go round-robin over the cases, so a drift of the machine
    (clocks, other load) shows in every row alike instead of in whichever row ran then.
    ``profile_top > 0`` profiles each case's timed runs and prints that many functions."""
    labels = [label for label, _ in cases]
    if len(set(labels)) != len(labels):
        twice = sorted({label for label in labels if labels.count(label) > 1})
        raise ValueError(f"bench rows need distinct labels; given twice: {', '.join(twice)}")
    results: dict[str, dict[str, Any]] = {}
    profilers = {label: cProfile.Profile() for label, _ in cases} if profile_top > 0 else {}
    for label, fn in cases:
        _progress(f"  {label}: warm-up")
        fn()
        results[label] = {"prefill": [], "decode": [], "tokens": [], "extra": {}}
    for i in range(repeats):
        _progress(f"  timed round {i + 1}/{repeats}")
        for label, fn in cases:
            profiler = profilers.get(label)
            if profiler is not None:
                profiler.enable()
            try:
                p, d, tokens, extra = fn()
            finally:
                if profiler is not None:
                    profiler.disable()
            got = results[label]
            got["prefill"].append(p)
            got["decode"].append(d)
            got["tokens"], got["extra"] = tokens, extra
    for label, profiler in profilers.items():
        _print_profile(profiler, label, profile_top)
    return [
        BenchRow(
            label,
            statistics.median(r["prefill"]) * 1e3,
            statistics.median(r["decode"]),
            r["tokens"],
            r["extra"],
            _spread(r["decode"]),
        )
        for label, r in results.items()
    ]


def _spread(values: list[float]) -> float:
    """(max - min) / median: how far apart the timed runs were."""
    mid = statistics.median(values)
    return (max(values) - min(values)) / mid if mid else 0.0


def _print_profile(profiler: cProfile.Profile, label: str, top: int) -> None:
    """The host-side hot spots of one row's timed runs (profiled runs are slower)."""
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(top)
    _progress(f"--- cProfile, {label} (timed runs, by own time) ---")
    _progress(text.getvalue().split("\n\n", 1)[-1].rstrip())


def bench_ours(
    folder: Path,
    prompt: list[int],
    new: int,
    providers: list[Any],
    spec: str | None,
    k: int | None,
    graphs: bool,
    overlap: bool = True,
    graph_prompts: bool | None = None,
):
    """One timed generation per call. ``overlap=False`` turns greedy look-ahead and
    pipelined verify steps off: the host reads each step back before queuing the next.
    ``graph_prompts`` sets ``Generator.graph_prefill`` for the call (None: its default)."""
    from onnx_genrt.engine import Generator, Model, SpeculativeGenerator, generate

    model = Model(folder, providers, enable_graphs=graphs)

    def once():
        saved = Generator.look_ahead, SpeculativeGenerator.pipeline, Generator.graph_prefill
        if not overlap:
            Generator.look_ahead = SpeculativeGenerator.pipeline = False
        if graph_prompts is not None:
            Generator.graph_prefill = graph_prompts
        try:
            # min_length = the full length: eos is ruled out, as in the onnxruntime-genai row.
            res = generate(
                model, prompt, new, spec=spec, k=k if spec else None, min_length=len(prompt) + new
            )
        finally:
            Generator.look_ahead, SpeculativeGenerator.pipeline, Generator.graph_prefill = saved
        return (
            res.prefill_seconds,
            res.decode_tokens_per_second,
            res.tokens,
            {
                "speculation": res.speculation,
                "graph_stats": res.graph_stats,
            },
        )

    return once


def bench_onnxruntime_genai(
    folder: Path,
    prompt: list[int],
    new: int,
    threads: int | None = None,
    speculative: dict[str, Any] | None = None,
):
    """onnxruntime-genai's own greedy loop; ``threads`` its intra-op threads (None: its
    default, one per physical core); ``speculative``: its ``set_speculative_options``."""
    import json

    import onnxruntime_genai as og

    config = og.Config(str(folder))
    if threads is not None:
        options = {"intra_op_num_threads": threads}
        config.overlay(json.dumps({"model": {"decoder": {"session_options": options}}}))
    model = og.Model(config)

    def once():
        params = og.GeneratorParams(model)
        total = len(prompt) + new
        params.set_search_options(max_length=total, min_length=total, do_sample=False)
        if speculative:
            params.set_speculative_options(**speculative)
        gen = og.Generator(model, params)
        t0 = time.perf_counter()
        gen.append_tokens(prompt)
        gen.generate_next_token()
        t1 = time.perf_counter()
        while not gen.is_done():
            gen.generate_next_token()
        t2 = time.perf_counter()
        tokens = [int(t) for t in gen.get_sequence(0)]
        return t1 - t0, (len(tokens) - len(prompt) - 1) / (t2 - t1), tokens, {}

    return once


def bench_onnxruntime_loop(folder: Path, prompt: list[int], new: int, threads: int | None = None):
    """A plain onnxruntime greedy loop: growing KV cache fed back as numpy arrays;
    ``threads`` its intra-op threads (None: onnxruntime's default)."""
    import onnxruntime as ort

    from onnx_genrt.engine.config import load_config

    cfg = load_config(folder)
    options = ort.SessionOptions()
    if threads is not None:
        options.intra_op_num_threads = threads
    sess = ort.InferenceSession(str(cfg.model_path), options, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    past_names = [i.name for i in sess.get_inputs() if i.name.startswith("past_key_values")]
    dtype = np.float16 if "float16" in sess.get_inputs()[-1].type else np.float32

    def once():
        past = {n: np.zeros((1, cfg.num_kv_heads, 0, cfg.head_size), dtype) for n in past_names}
        ids = list(prompt)
        feed = list(prompt)
        t0 = time.perf_counter()
        t1 = t0
        for step in range(new):
            outs = dict(
                zip(
                    names,
                    sess.run(
                        None,
                        {
                            cfg.io.input_ids: np.array([feed], np.int64),
                            cfg.io.attention_mask: np.ones((1, len(ids)), np.int64),
                            **past,
                        },
                    ),
                    strict=True,
                )
            )
            row = outs[cfg.io.logits][0, -1].astype(np.float32)
            row[list(cfg.eos_token_ids)] = -np.inf  # min_length = full length, like the others
            token = int(np.argmax(row))
            ids.append(token)
            feed = [token]
            past = {n: outs[n.replace("past_key_values", "present")] for n in past_names}
            if step == 0:
                t1 = time.perf_counter()
        t2 = time.perf_counter()
        return t1 - t0, (new - 1) / (t2 - t1), ids, {}

    return once


#: onnxruntime-genai's own prompt-lookup speculation, as close to ``--spec ngram`` as its
#: options go: n-grams of 3 (ours: 3 down to 1), 4 drafts a step (ours: k, default 4).
GENAI_NGRAM = {"ngram_size": 3, "max_draft_tokens": 4}


def bench_onnxruntime_genai_ngram(
    folder: Path, prompt: list[int], new: int, threads: int | None = None
):
    """:func:`bench_onnxruntime_genai` with its n-gram speculation (``GENAI_NGRAM``)."""
    return bench_onnxruntime_genai(folder, prompt, new, threads, GENAI_NGRAM)


#: Reference rows by label: the function that builds one timed run.
REFERENCES = {
    "onnxruntime-genai": bench_onnxruntime_genai,
    "onnxruntime loop": bench_onnxruntime_loop,
    "onnxruntime-genai ngram": bench_onnxruntime_genai_ngram,
}
#: Reference rows run only beside a ``--spec`` kind: that kind's counterpart.
SPEC_REFERENCES = {"onnxruntime-genai ngram": "ngram"}


def _reference_child(conn, label: str, folder: Path, prompt: list[int], new: int, threads) -> None:
    """A child process's loop: build the reference, then one timed run per message."""
    try:
        once = REFERENCES[label](folder, prompt, new, threads)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which re-raises
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", None))
    while conn.recv() == "run":
        try:
            conn.send(("ok", once()))
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which re-raises
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


def reference_in_child(label: str, folder: Path, prompt: list[int], new: int, threads: int | None):
    """A reference row run in its own process, stopped (SIGSTOP) between its runs, so its
    thread pool and ours never share the cores: onnxruntime's intra-op threads spin on after
    a run, and in one process (or a live child) they took the core our workers run on.
    Returns ``once`` as the in-process builders do, with ``once.close()`` ending the child
    (else it ends when this process does); raises ImportError (and the like) as they would."""
    import atexit
    import multiprocessing
    import os
    import signal

    pause = getattr(signal, "SIGSTOP", None)  # POSIX; elsewhere the child is left running

    def signal_child(sig) -> None:
        if sig is not None and proc.is_alive():
            os.kill(proc.pid, sig)

    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(
        target=_reference_child, args=(child, label, folder, prompt, new, threads), daemon=True
    )
    proc.start()
    kind, detail = parent.recv()
    if kind == "error":
        proc.join()
        if detail.startswith(("ImportError", "ModuleNotFoundError")):
            raise ImportError(detail)
        raise RuntimeError(f"{label}: {detail}")

    signal_child(pause)

    def stop() -> None:
        if proc.is_alive():
            signal_child(getattr(signal, "SIGCONT", None))
            parent.send("stop")
            proc.join(5)

    atexit.register(stop)

    def once():
        signal_child(getattr(signal, "SIGCONT", None))
        parent.send("run")
        kind, result = parent.recv()
        signal_child(pause)
        if kind == "error":
            raise RuntimeError(f"{label}: {result}")
        return result

    once.close = stop  # type: ignore[attr-defined]
    return once


#: The search options of ``--sampled`` rows: OpenAI's default temperature and the top_k that
#: onnxruntime-genai's builder writes into genai_config.json.
SAMPLED_SEARCH = {"do_sample": True, "temperature": 1.0, "top_k": 50, "seed": 0}


def bench_batch(
    folder: Path,
    prompts: list[list[int]],
    new: int,
    providers: list[Any],
    graphs: bool = True,
    overlap: bool = True,
    spec: str | None = None,
    k: int | None = None,
    sampled: str | None = None,
):
    """One timed batched generation per call (``generate_batch``, one row per prompt): the
    decode rate is every row's tokens after its first, over the decode time (aggregate).
    ``overlap=False`` turns the batched greedy look-ahead off for the call; ``spec``
    (``"ngram"`` or ``"auto"``) speculates per row; ``sampled`` (``"host"`` or ``"device"``)
    samples every row (SAMPLED_SEARCH) with its tokens drawn there
    (``BatchGenerator.device_sampling``)."""
    from onnx_genrt.engine import Model, generate_batch
    from onnx_genrt.engine.batch import BatchGenerator

    model = Model(folder, providers, enable_graphs=graphs)
    longest = max(len(p) for p in prompts) + new
    # Sampled rows ignore the end of sequence (an end masked before min_length would be
    # drawn on the host); greedy rows keep min_length, as they always did.
    search = {**SAMPLED_SEARCH, "ignore_eos": True} if sampled else {"min_length": longest}

    def once():
        saved = BatchGenerator.look_ahead, BatchGenerator.device_sampling
        if not overlap:
            BatchGenerator.look_ahead = False
        BatchGenerator.device_sampling = sampled == "device"
        try:
            results = generate_batch(model, prompts, new, spec=spec, k=k, **search)
        finally:
            BatchGenerator.look_ahead, BatchGenerator.device_sampling = saved
        decoded = sum(r.new_tokens - 1 for r in results)
        seconds = results[0].decode_seconds
        return (
            results[0].prefill_seconds,
            decoded / seconds if seconds > 0 else 0.0,
            results[0].tokens,
            {
                "graph_stats": results[0].graph_stats,
                "streams": len(prompts),
                "speculation": results[0].speculation,
                "sampled": sampled,
            },
        )

    return once


def run(args: argparse.Namespace) -> int:
    """``onnx-genrt bench``: the LLM rows, or with ``--dispatch`` the dispatch-cost table;
    one row (or set of rows) per ``--provider``, the CPU when none is given."""
    if not args.provider:
        args.provider = [["cpu"]]
    if args.dispatch:
        from . import dispatch_bench

        return dispatch_bench.run(args)
    return run_bench(args)


def _stream_cases(
    args: argparse.Namespace,
    folder: Path,
    tag: str,
    prompt: list[int],
    new: int,
    providers: list[Any],
    rng: np.random.Generator,
    vocab: int,
) -> list[tuple[str, Any]]:
    """The ``--streams`` rows of one provider: row 0 is the bench prompt, the others random
    prompts of its length (the same text with ``--prompt``); with ``--compare-serial`` each
    also without the batched look-ahead; with ``--spec ngram`` (or ``auto``) each also
    speculating per row."""
    from onnx_genrt.engine.batch_speculation import BATCH_SPEC_KINDS

    specs = [_spec_entry(e, args.k) + (e,) for e in args.spec]
    cases = []
    for streams in args.streams:
        others = [
            prompt if args.prompt is not None else rng.integers(1, vocab, len(prompt)).tolist()
            for _ in range(streams - 1)
        ]
        prompts = [prompt, *others]
        for overlap in (True, False) if args.compare_serial else (True,):
            label = f"onnx-genrt[{tag},{streams} streams{'' if overlap else ',serial'}]"
            cases.append((label, bench_batch(folder, prompts, new, providers, overlap=overlap)))
        for spec, k, entry in specs:
            if spec in BATCH_SPEC_KINDS:
                label = f"onnx-genrt[{tag},{streams} streams,{entry}]"
                cases.append((label, bench_batch(folder, prompts, new, providers, spec=spec, k=k)))
        for where in ("host", "device") if args.sampled else ():
            label = f"onnx-genrt[{tag},{streams} streams,sampled on the {where}]"
            cases.append((label, bench_batch(folder, prompts, new, providers, sampled=where)))
    return cases


def run_bench(args: argparse.Namespace) -> int:
    """The LLM rows: ours per provider (and per ``--spec``, ``--streams``, comparison), then
    onnxruntime-genai and the onnxruntime loop on the same files."""
    from onnx_genrt.generate_cli import default_model_dir, provider_args

    folder = Path(args.model or default_model_dir())
    rng = np.random.default_rng(0)
    from onnx_genrt.engine.config import load_config

    cfg = load_config(folder)
    if args.prompt is not None:  # a real prompt: what a trained model's acceptance depends on
        from onnx_genrt.engine.tokenizer import Tokenizer

        prompt = list(Tokenizer(folder).encode(args.prompt))
    else:
        prompt = rng.integers(1, cfg.vocab_size, args.prompt_tokens).tolist()
    new = args.tokens
    if args.cold:
        from .cold_start import run_cold

        _progress(
            f"bench --cold: {folder.name}, prompt {len(prompt)} tokens, {new} new tokens, "
            f"{args.repeats} new processes per row (median)"
        )
        return run_cold(args, folder, prompt, new)
    _progress(
        f"bench: {folder.name}, prompt {len(prompt)} tokens, {new} new tokens, median of {args.repeats} "
        "(spread: fastest minus slowest run over the median)"
    )
    cases: list[tuple[str, Callable]] = []
    from onnx_genrt.providers.cpu.cores import physical_cores

    cpu_threads = args.threads or physical_cores()
    for names in args.provider:
        tag = ",".join(names)
        tag = f"{tag},{args.threads}t" if args.threads and "cpu" in names else tag

        def ours(
            spec: str | None,
            k: int | None,
            graphs: bool = True,
            overlap: bool = True,
            names: list[str] = names,
        ):
            return bench_ours(
                folder,
                prompt,
                new,
                provider_args(names, args.threads),
                spec,
                k,
                graphs,
                overlap,
            )

        for graphs in [True, False] if args.compare_eager else [True]:
            cases.append(
                (f"onnx-genrt[{tag}{'' if graphs else ',eager'}]", ours(None, None, graphs))
            )
        if len(set(args.spec)) != len(args.spec):
            raise InvalidInputError(f"--spec: each entry once, got {' '.join(args.spec)}")
        for entry in args.spec:
            spec, k = _spec_entry(entry, args.k)
            for overlap in [True, False] if args.compare_serial else [True]:
                label = f"onnx-genrt[{tag},{entry}{'' if overlap else ',serial'}]"
                cases.append((label, ours(spec, k, True, overlap)))
        if args.compare_serial:
            cases.append((f"onnx-genrt[{tag},serial]", ours(None, None, True, False)))
        if args.compare_eager_prompts:
            eager_prompts = bench_ours(
                folder, prompt, new, provider_args(names, args.threads), None, None, True,
                graph_prompts=False,
            )  # fmt: skip
            cases.append((f"onnx-genrt[{tag},eager prompts]", eager_prompts))
        providers = provider_args(names, args.threads)
        cases += _stream_cases(args, folder, tag, prompt, new, providers, rng, cfg.vocab_size)
    used = {name for names in args.provider for name in names}
    # The references get the CPU provider's thread count when it runs (the same cores).
    ref_threads = cpu_threads if "cpu" in used else None
    if not args.no_reference:
        kinds = {_spec_entry(entry, args.k)[0] for entry in args.spec}
        for label in REFERENCES:
            if label in SPEC_REFERENCES and SPEC_REFERENCES[label] not in kinds:
                continue
            try:
                cases.append((label, reference_in_child(label, folder, prompt, new, ref_threads)))
            except ImportError as exc:
                _progress(f"  {label} skipped: {exc}")
    rows = _interleaved(cases, args.repeats, args.cprofile)
    print(format_rows(rows))
    if "cpu" in used and any(label.startswith("onnxruntime") for label, _ in cases):
        print(
            f"threads: onnx-genrt[cpu] {cpu_threads} (--threads); the onnxruntime rows "
            f"{ref_threads} intra-op threads each, each in its own process (run in turn)"
        )
    if "cpu" in used and rows:
        print(cpu_roofline(weight_bytes_per_token(cfg.model_path), cpu_threads, rows))
    if "cuda" in used:
        _print_cuda_summary(cfg.model_path, args.bandwidth)
    return 0


def read_gb_s(nbytes: int, threads: int, repeats: int = 5) -> float:
    """GB/s of a plain read of ``nbytes`` (best of ``repeats``): float32 dot products of the
    bytes with themselves (BLAS, one thread each), cut into ``threads`` parts read at once on
    their own threads (numpy releases the GIL). A copy would also write them (and read the
    destination first), moving two to three times the bytes."""
    from concurrent.futures import ThreadPoolExecutor

    data = np.ones(max(1, nbytes // 4), np.float32)
    edges = np.linspace(0, data.size, max(1, threads) + 1).astype(int)
    parts = [data[a:b] for a, b in zip(edges[:-1], edges[1:], strict=True)]
    best = float("inf")
    with ThreadPoolExecutor(len(parts)) as pool:
        for _ in range(repeats + 1):  # the first pass faults the pages in
            t0 = time.perf_counter()
            list(pool.map(lambda part: np.dot(part, part), parts))
            best = min(best, time.perf_counter() - t0)
    return data.nbytes / best / 1e9


def cpu_roofline(nbytes: int, threads: int, rows: list[BenchRow]) -> str:
    """The CPU's weight-bandwidth line: the matmul weights a decode token reads, a plain
    read of as many bytes at ``threads`` threads (``read_gb_s``, measured now: the machine's
    bandwidth moves with its neighbours), the ceiling that gives, and the weight GB/s of the
    first row (ours, greedy) and of onnxruntime-genai's row where there is one."""
    read = read_gb_s(nbytes, threads)
    line = (
        f"roofline (cpu, {threads} threads): {nbytes / 1e6:.1f} MB of matmul weights read per "
        f"decode token; a plain read of as many bytes runs at {read:.1f} GB/s, a ceiling of "
        f"{read * 1e9 / nbytes:.0f} tok/s"
    )
    shown = [rows[0], *(r for r in rows[1:] if r.runtime == "onnxruntime-genai")]
    reads = [
        f"{r.runtime} {r.decode_tok_s * nbytes / 1e9:.1f} GB/s "
        f"({r.decode_tok_s * nbytes / 1e9 / read:.0%} of the plain read)"
        for r in shown
    ]
    return line + "; " + ", ".join(reads)


def _print_cuda_summary(model_path: Path, bandwidth: float) -> None:
    """The weight-bandwidth ceiling of a decode token, and what the CUDA provider says of
    itself (``status_notes``: whether programmatic launch is on)."""
    from onnx_genrt.core.registry import get_registry

    nbytes = weight_bytes_per_token(model_path)
    ceiling = bandwidth * 1e9 / nbytes if nbytes else float("nan")
    print(
        f"roofline: {nbytes / 1e6:.1f} MB of matmul weights read per decode token; at "
        f"{bandwidth:.0f} GB/s the ceiling is {ceiling:.0f} tok/s"
    )
    notes = get_registry().create("cuda").status_notes()
    if notes:
        print("cuda: " + "; ".join(notes))


def _spec_entry(entry: str, k: int | None) -> tuple[str, int | None]:
    """``kind`` or ``kind:k`` of ``--spec`` as (kind, k); a bare kind takes ``-k``."""
    from onnx_genrt.engine.api import SPEC_KINDS

    kind, _, drafts = entry.partition(":")
    if kind not in SPEC_KINDS:
        raise InvalidInputError(
            f"--spec {entry!r}: the kind must be one of {', '.join(SPEC_KINDS)}"
        )
    if not drafts:
        return kind, k
    if not drafts.isdigit() or int(drafts) < 1:
        raise InvalidInputError(f"--spec {entry!r}: k must be a positive integer")
    return kind, int(drafts)


def weight_bytes_per_token(model_path: Path) -> int:
    """Bytes of the initializers that MatMul, Gemm and MatMulNBits nodes read (each once)."""
    import onnx

    model = onnx.load(str(model_path), load_external_data=False)
    sizes = {}
    for init in model.graph.initializer:
        itemsize = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(init.data_type)).itemsize
        sizes[init.name] = int(np.prod(init.dims, dtype=np.int64)) * itemsize
    read = {
        name
        for node in model.graph.node
        if node.op_type in ("MatMul", "Gemm", "MatMulNBits")
        for name in node.input[1:]
        if name in sizes
    }
    return sum(sizes[name] for name in read)


def format_rows(rows: list[BenchRow]) -> str:
    ref = {r.runtime: r for r in rows}
    genai = ref.get("onnxruntime-genai")
    loop = ref.get("onnxruntime loop")
    base = rows[0].tokens if rows else []
    w = max([28, *(len(r.runtime) + 1 for r in rows)])
    lines = [
        f"{'runtime':<{w}}{'prefill ms':>11}{'decode tok/s':>14}{'spread':>8}{'vs genai':>10}{'vs ort loop':>13}  same tokens  notes"
    ]
    for r in rows:
        vs_genai = f"{r.decode_tok_s / genai.decode_tok_s:.2f}x" if genai else "-"
        vs_loop = f"{r.decode_tok_s / loop.decode_tok_s:.2f}x" if loop else "-"
        same = "yes" if r.tokens == base else "NO"
        if r.extra.get("sampled"):
            same = "-"  # sampled: other tokens than greedy decoding by design
        notes = []
        spec = r.extra.get("speculation")
        if spec:
            notes.append(
                f"k {spec.get('k', '?')}, acceptance {spec['acceptance_rate']:.0%}, "
                f"mean accepted {spec['mean_accepted_length']:.2f}"
            )
            for label, kind in SPEC_REFERENCES.items():  # the runtime's own speculation
                other = ref.get(label)
                if other is not None and kind == spec.get("kind"):
                    notes.append(f"{r.decode_tok_s / other.decode_tok_s:.2f}x {label}")
        for who, slots in r.extra.get("graph_stats", {}).items():
            for slot, st in slots.items():
                notes.append(
                    f"{who}/{slot} c{st['captures']} r{st['replays']} f{st['fallbacks']} i{st['invalidations']}"
                )
        lines.append(
            f"{r.runtime:<{w}}{r.prefill_ms:>11.2f}{r.decode_tok_s:>14.1f}{r.decode_spread:>8.1%}{vs_genai:>10}{vs_loop:>13}  {same:<11}  {'; '.join(notes)}"
        )
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", type=Path, default=None, help="model folder (default: the embedded model)"
    )
    p.add_argument(
        "--provider",
        action="append",
        type=provider_list,
        default=None,
        help="one row per flag, each a comma-separated priority list such as cuda,cpu "
        "(repeatable; default: cpu)",
    )
    p.add_argument(
        "--spec",
        action="append",
        default=[],
        metavar="KIND[:K]",
        help="also time speculation: mtp, draft or ngram, optionally with its drafts per step "
        "(mtp:3); repeat to compare; with --streams, mtp and ngram also time each stream "
        "count speculating per row",
    )
    add_drafts_argument(p)
    p.add_argument(
        "--tokens", type=POSITIVE_INT, default=128, help="new tokens per run (eos ignored)"
    )
    p.add_argument("--prompt-tokens", type=POSITIVE_INT, default=16, help="random prompt length")
    p.add_argument("--prompt", default=None, help="prompt text instead of random ids")
    p.add_argument("--repeats", type=POSITIVE_INT, default=3, help="timed runs per row (median)")
    p.add_argument("--compare-eager", action="store_true", help="also time with graphs off")
    p.add_argument(
        "--streams",
        type=positive_int_list,
        default=[],
        metavar="N[,N...]",
        help="also time batched decoding of N prompts at once (one row per prompt; decode "
        "tok/s is the aggregate of all rows), e.g. --streams 4,8",
    )
    p.add_argument(
        "--sampled",
        action="store_true",
        help="with --streams, also time each stream count sampling every row (temperature 1, "
        "top_k 50, a seed per run) with the tokens drawn on the host and on the device",
    )
    p.add_argument(
        "--compare-serial",
        action="store_true",
        help="also time with greedy look-ahead (single and batched) and pipelined verify steps off",
    )
    p.add_argument(
        "--compare-eager-prompts",
        action="store_true",
        help="also time with prompts run eagerly, not as graphed chunks (the GPU's default)",
    )
    p.add_argument(
        "--cold",
        action="store_true",
        help="the first generation in a new process instead (imports, model load, first "
        "token, decode rate), ours per --provider and --spec beside onnxruntime-genai",
    )
    p.add_argument(
        "--no-reference",
        action="store_true",
        help="skip onnxruntime-genai and the onnxruntime loop",
    )
    p.add_argument(
        "--cprofile",
        type=NON_NEGATIVE_INT,
        default=0,
        metavar="N",
        help="profile the host side of our timed runs; print the top N functions (stderr)",
    )
    add_threads_argument(p)
    p.add_argument(
        "--bandwidth",
        type=POSITIVE,
        default=4300.0,
        help="GB/s for the CUDA roofline line (H200 device-to-device copy: about 4300)",
    )
    p.add_argument(
        "--dispatch", action="store_true", help="per-node dispatch cost instead (eager vs replay)"
    )
    p.add_argument(
        "--nodes", type=POSITIVE_INT, default=200, help="--dispatch: nodes in the chain model"
    )


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="decode speed side by side with onnxruntime-genai and an onnxruntime loop (--dispatch: per-node cost)",
    )
    add_arguments(p)
    p.set_defaults(func=run)
