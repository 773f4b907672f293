"""``generate`` and ``stream``: the plain entry points over Model and Generator."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from onnx_genrt.core.checks import check_bool, check_int
from onnx_genrt.core.errors import InvalidInputError, ModelLoadError
from onnx_genrt.session import load_model

from .batch import BatchGenerator
from .batch_speculation import check_batch_spec
from .config import SPECULATIVE_FILE
from .generator import Generator
from .logprobs import TokenLogprob, check_top_logprobs
from .model import GeneratorParams, Model
from .mtp_chain import restrict_draft_vocab
from .proposers import DraftModelProposer, MTPProposer, PromptLookupProposer, Proposer
from .speculative import DEFAULT_K, PayoffPolicy, SpeculativeGenerator
from .stops import StopScanner, prompt_ids, stop_strings

#: New tokens a generation makes when the call does not say (``stream``, ``generate``,
#: ``generate_batch``).
DEFAULT_MAX_NEW_TOKENS = 128


@dataclass
class GenerationResult:
    """Text, tokens and what the run measured."""

    text: str
    tokens: list[int]
    prompt_tokens: int
    prefill_seconds: float
    decode_seconds: float
    stop_reason: str
    speculation: dict[str, Any] = field(default_factory=dict)
    graph_stats: dict[str, Any] = field(default_factory=dict)
    #: Each generated token's log-probability (``generate(..., logprobs=N)``), else None.
    logprobs: list[TokenLogprob] | None = None

    @property
    def new_tokens(self) -> int:
        return len(self.tokens) - self.prompt_tokens

    @property
    def decode_tokens_per_second(self) -> float:
        generated = self.new_tokens - 1  # the first token comes from the prefill
        return generated / self.decode_seconds if self.decode_seconds > 0 and generated > 0 else 0.0


#: Default confidence below which a proposer stops drafting, per kind. A draft model pays
#: one step per draft, so it stops early; the MTP chain runs all k heads in one graph and
#: the verify step has a fixed width, so every MTP draft is free to try (more tokens per verify
#: step on the embedded model: docs/performance.md).
MIN_CONFIDENCE = {"mtp": 0.0, "draft": 0.1}


def default_k(model: Model, spec: str, k: int | None = None) -> int:
    """``k`` when given, else the ``k`` of the model's speculative.json section for ``spec``
    (the model's own best, e.g. 3 for the embedded model's MTP head), else DEFAULT_K."""
    if k is not None:
        return check_int(k, "k (drafts per speculative step)", minimum=1)
    section = model.config.speculative.get(spec)
    value = section.get("k") if isinstance(section, dict) else None
    if value is None:
        return DEFAULT_K
    name = f"{model.folder}/{SPECULATIVE_FILE}: {spec}.k"
    return check_int(value, name, minimum=1, integral_floats=True, error=ModelLoadError)


def make_proposer(
    model: Model, spec: str, max_length: int, min_confidence: float | None = None
) -> Proposer:
    """The proposer named ``spec`` (mtp, draft or ngram) for ``model``; ``min_confidence``
    defaults per kind (:data:`MIN_CONFIDENCE`).

    MTP proposers and draft models are kept on the model, so later generations reuse their
    sessions and captured graphs instead of building and capturing them again.
    """
    make = PROPOSERS.get(spec)
    if make is None:
        raise InvalidInputError(f"unknown speculation kind {spec!r}; choose one of {SPEC_KINDS}")
    if min_confidence is None:
        min_confidence = MIN_CONFIDENCE.get(spec, 0.0)
    return make(model, max_length, min_confidence)


def _mtp_proposer(model: Model, _max_length: int, min_confidence: float) -> Proposer:
    key = ("mtp", min_confidence)
    with model.session.exclusive():  # one thread builds it; the others then reuse it
        if key not in model.proposers:
            model.proposers[key] = _make_mtp(model, min_confidence)
    return model.proposers[key]


def _draft_proposer(model: Model, max_length: int, min_confidence: float) -> Proposer:
    with model.session.exclusive():
        if "draft" not in model.proposers:
            model.proposers["draft"] = _draft_model(model)
    return DraftModelProposer(model.proposers["draft"], max_length, min_confidence=min_confidence)


def _prompt_lookup_proposer(_model: Model, _max_length: int, _min_confidence: float) -> Proposer:
    return PromptLookupProposer()


#: The speculation kinds and how each makes its proposer ``(model, max_length,
#: min_confidence)``; the one list the API, the CLI and the bench read.
PROPOSERS: dict[str, Callable[[Model, int, float], Proposer]] = {
    "mtp": _mtp_proposer,
    "draft": _draft_proposer,
    "ngram": _prompt_lookup_proposer,
}
SPEC_KINDS = tuple(PROPOSERS)
#: ``spec="auto"``: the model's own proposer (the first of these its speculative.json has,
#: else prompt lookup), kept only while it measurably pays (:class:`PayoffPolicy`).
AUTO = "auto"
AUTO_ORDER = ("mtp", "draft")
#: What ``spec=`` accepts: a proposer kind, or ``auto``.
SPEC_CHOICES = (*SPEC_KINDS, AUTO)


def resolve_spec(model: Model, spec: str | None) -> str | None:
    """The proposer kind ``spec`` names for ``model`` (``auto`` picks one; see AUTO_ORDER)."""
    if spec is None or spec in SPEC_KINDS:
        return spec
    if spec != AUTO:
        raise InvalidInputError(
            f"unknown speculation kind {spec!r}; choose one of {', '.join(SPEC_CHOICES)}"
        )
    return next((kind for kind in AUTO_ORDER if model.config.speculative.get(kind)), "ngram")


def _make_mtp(model: Model, min_confidence: float) -> MTPProposer:
    mtp = model.config.speculative.get("mtp")
    if not mtp:
        raise ModelLoadError(f"{model.folder}/speculative.json has no mtp section")
    inputs, outputs = mtp.get("inputs", {}), mtp.get("outputs", {})
    key = f"{SPECULATIVE_FILE}: mtp.filename"
    head_path = model.config.path_of(mtp.get("filename", "mtp/model.onnx"), key)
    head = load_model(head_path, folder=model.folder)
    vocab = _draft_vocab(model, mtp.get("draft_vocab"))
    draft_ids = None if vocab is None or isinstance(vocab, int) else vocab
    if vocab is not None:
        try:
            head = restrict_draft_vocab(head, vocab, outputs.get("logits", "logits"))
        except ValueError as exc:
            raise ModelLoadError(
                f"{model.folder}/speculative.json: mtp.draft_vocab: {exc}"
            ) from None
    return MTPProposer(
        head,
        model.session_from_proto,
        names={
            "hidden_input": inputs.get("hidden_states", "hidden_states"),
            "ids_input": inputs.get("input_ids", "input_ids"),
            "logits_output": outputs.get("logits", "logits"),
            "hidden_output": outputs.get("hidden_states", "mtp_hidden_states"),
        },
        min_confidence=min_confidence,
        draft_ids=draft_ids,
    )


def _draft_vocab(model: Model, value: Any) -> int | np.ndarray | None:
    """speculative.json's ``mtp.draft_vocab``: a count of first token ids, or the path (in
    the model folder) of a JSON list of token ids, most frequent first; checked."""
    key = f"{model.folder}/{SPECULATIVE_FILE}: mtp.draft_vocab"
    if value is None:
        return None
    if not isinstance(value, str):
        return check_int(
            value,
            key,
            minimum=1,
            maximum=model.config.vocab_size,
            integral_floats=True,
            error=ModelLoadError,
        )
    path = model.config.path_of(value, f"{SPECULATIVE_FILE}: mtp.draft_vocab")
    try:
        ids = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{key}: cannot read {path}: {exc}") from None
    vocab = model.config.vocab_size
    if (
        not isinstance(ids, list)
        or not ids
        or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
    ):
        raise ModelLoadError(f"{key}: {path} must hold a non-empty JSON list of token ids")
    bad = next((i for i in ids if not 0 <= i < vocab), None)
    if bad is not None:
        raise ModelLoadError(f"{key}: {path} lists token id {bad}, outside 0..{vocab - 1}")
    if len(set(ids)) != len(ids):
        raise ModelLoadError(f"{key}: {path} lists a token id twice")
    return np.array(ids, np.int64)


def _draft_model(model: Model) -> Model:
    draft = model.config.speculative.get("draft")
    if not draft:
        raise ModelLoadError(f"{model.folder}/speculative.json has no draft section")
    folder = model.config.path_of(draft.get("path", "draft"), f"{SPECULATIVE_FILE}: draft.path")
    if not folder.is_dir():
        raise ModelLoadError(f"{SPECULATIVE_FILE}: draft.path: no model folder at {folder}")
    return Model(folder, model.providers, enable_graphs=model.enable_graphs)


def make_generator(
    model: Model, params: GeneratorParams, spec: str | None = None, k: int | None = None
) -> Generator:
    """A generator for ``spec`` (None: plain; a proposer kind; ``auto``: the model's own
    proposer, used only while it measurably pays against plain steps)."""
    kind = resolve_spec(model, spec)
    if kind is None:
        return Generator(model, params)
    proposer = make_proposer(model, kind, params.search.max_length)
    payoff = PayoffPolicy() if spec == AUTO else None
    return SpeculativeGenerator(model, params, proposer, k=default_k(model, kind, k), payoff=payoff)


def warm_up(
    model: Model,
    max_length: int,
    spec: str | None = None,
    k: int | None = None,
    prompt_length: int = 2,
) -> float:
    """Generate a few tokens from a dummy prompt of ``prompt_length`` tokens the way a
    generation of up to ``max_length`` tokens with ``spec`` would, twice, then hand the KV
    cache back to the model's pool: kernels compile (or load from their cache), memory is
    planned (for a prompt of that length too) and the decode, verify and proposer graphs are
    captured, on the very cache the next such generation takes, which then replays from its
    first step. The second pass captures the graphs a generation runs once (the proposer's
    first drafts after the prompt), eager on their first use. Returns the seconds it took."""
    start = time.perf_counter()
    length = min(
        max(check_int(max_length, "max_length", minimum=2), 8), model.config.context_length
    )
    prompt = [0] * min(check_int(prompt_length, "prompt_length", minimum=1), length - 1)
    for _ in range(2):
        params = GeneratorParams(model)
        params.set_search_options(max_length=length)
        with make_generator(model, params, spec, k) as gen:
            gen.eos = set()
            gen.append_tokens(prompt)
            for _ in range(6):
                if gen.is_done():
                    break
                gen.generate_next_token()
    return time.perf_counter() - start


def stream(
    model: Model,
    prompt: str | list[int],
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    *,
    spec: str | None = None,
    k: int | None = None,
    stop: tuple[str, ...] = (),
    ignore_eos: bool = False,
    result: list[GenerationResult] | None = None,
    **search: Any,
) -> Iterator[str]:
    """Text pieces as tokens are generated; appends a GenerationResult to ``result``.

    ``stop``: strings that end the generation (one string or a sequence of them). Arguments
    are checked when ``stream`` is called; the model runs as the pieces are iterated."""
    return _stream(model, prompt, max_new_tokens, spec, k, stop, ignore_eos, result, search)


def _stream(
    model: Model,
    prompt: str | list[int],
    max_new_tokens: int,
    spec: str | None,
    k: int | None,
    stop: tuple[str, ...],
    ignore_eos: bool,
    result: list[GenerationResult] | None,
    search: dict[str, Any],
    pieces: bool = True,
) -> Iterator[str]:
    """:func:`stream`; ``pieces=False`` (:func:`generate`, which keeps only the result) yields
    nothing and, without stop strings, decodes the text once at the end."""
    max_new_tokens = check_int(max_new_tokens, "max_new_tokens", minimum=1)
    kind = resolve_spec(model, spec)
    if kind is not None:
        k = default_k(model, kind, k)
    elif k is not None:
        raise InvalidInputError(
            f"k={k!r} needs a speculation kind (spec='mtp', 'draft' or 'ngram')"
        )
    stop = stop_strings(stop)
    ignore_eos = check_bool(ignore_eos, "ignore_eos")
    ids = prompt_ids(model, prompt)
    context = model.config.context_length
    if len(ids) + max_new_tokens > context:
        raise InvalidInputError(
            f"prompt of {len(ids)} tokens plus max_new_tokens={max_new_tokens} exceeds the "
            f"model's context length of {context}"
        )
    params = GeneratorParams(model)
    params.set_search_options(max_length=len(ids) + max_new_tokens, **search)
    return _generation(model, params, ids, spec, k, stop, ignore_eos, result, pieces)


def _generation(
    model: Model,
    params: GeneratorParams,
    ids: list[int],
    spec: str | None,
    k: int | None,
    stop: tuple[str, ...],
    ignore_eos: bool,
    result: list[GenerationResult] | None,
    pieces: bool = True,
) -> Iterator[str]:
    """The generator behind :func:`stream`: makes the Generator on first use, closes it."""
    gen = make_generator(model, params, spec, k)
    try:
        yield from _drive(gen, model, ids, stop, ignore_eos, result, pieces)
    finally:
        gen.close()


def _drive(
    gen: Generator,
    model: Model,
    ids: list[int],
    stop: tuple[str, ...],
    ignore_eos: bool,
    result: list[GenerationResult] | None,
    pieces: bool = True,
) -> Iterator[str]:
    """The token loop of :func:`stream` (timed, stop strings, statistics). Without pieces
    to yield and without stop strings, the text is decoded once, when the loop ends (the
    same stream decoder over the same tokens), not token by token."""
    if ignore_eos:
        gen.eos = set()
    scanner = StopScanner(model.tokenizer.create_stream() if _has_tokenizer(model) else None, stop)
    by_token = pieces or bool(stop)
    t0 = time.perf_counter()
    gen.append_tokens(ids)
    gen.generate_next_token()
    t1 = time.perf_counter()
    reason = "max_new_tokens"
    dropped = 0  # tokens of a speculative step after the one that completed a stop string
    while True:
        if by_token:
            new = gen.get_next_tokens()
            piece, kept, hit = scanner.feed(new)
            if piece:
                yield piece
            if hit is not None:
                reason = f"stop string {hit!r}"
                dropped = len(new) - len(kept)
                break
        if gen.is_done():
            if gen.tokens and gen.tokens[-1] in gen.eos:
                reason = "eos"
            if not by_token:
                scanner.feed(gen.get_sequence()[len(ids) :])
            rest = scanner.flush()  # text held back as a possible start of a stop string
            if rest:
                yield rest
            break
        gen.generate_next_token()
    t2 = time.perf_counter()
    if result is not None:
        spec_stats = {}
        if isinstance(gen, SpeculativeGenerator):
            spec_stats = {"kind": gen.proposer.name, "k": gen.k, **gen.spec.as_dict()}
            if gen.payoff is not None:
                spec_stats["auto"] = gen.payoff.as_dict()
        stats = {"target": gen.graph_stats()}
        if isinstance(gen, SpeculativeGenerator):
            stats["proposer"] = gen.proposer.graph_stats()
        sequence = gen.get_sequence()
        result.append(
            GenerationResult(
                scanner.text,
                sequence[: len(sequence) - dropped],
                len(ids),
                t1 - t0,
                t2 - t1,
                reason,
                spec_stats,
                stats,
            )
        )


def generate(
    model: Model,
    prompt: str | list[int] | Sequence[str] | Sequence[Sequence[int]],
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    **kwargs: Any,
) -> GenerationResult | list[GenerationResult]:
    """Generate and return the whole result (text, tokens, timings, statistics).

    A list of prompts (strings, or lists of token ids) is decoded as one batch
    (:func:`generate_batch`) and gives a list of results, one per prompt. ``logprobs=N``
    (0-20) keeps each generated token's log-probability under the model's raw logits with
    its N likeliest alternatives (``GenerationResult.logprobs``); the batched decoder keeps
    them, so a single prompt then runs as a batch of one (the same tokens)."""
    if _is_batch(prompt):
        return generate_batch(model, prompt, max_new_tokens, **kwargs)
    if kwargs.get("logprobs") is not None:
        if kwargs.get("spec") == "draft":
            raise InvalidInputError(
                "logprobs are kept by the batched decoder, which speculates by prompt lookup "
                "or an MTP head (spec='ngram' or 'mtp'), not by a draft model"
            )
        return generate_batch(model, [prompt], max_new_tokens, **kwargs)[0]
    kwargs.pop("logprobs", None)
    out: list[GenerationResult] = []
    options = {"spec": None, "k": None, "stop": (), "ignore_eos": False}
    options |= {name: kwargs.pop(name) for name in list(options) if name in kwargs}
    for _ in _stream(
        model, prompt, max_new_tokens, **options, result=out, search=kwargs, pieces=False
    ):
        pass
    return out[0]


def _is_batch(prompt: object) -> bool:
    return (
        isinstance(prompt, list | tuple)
        and bool(prompt)
        and all(isinstance(p, str | list | tuple | np.ndarray) for p in prompt)
    )


def generate_batch(
    model: Model,
    prompts: Sequence[str] | Sequence[Sequence[int]],
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    *,
    stop: str | Sequence[str] = (),
    ignore_eos: bool = False,
    spec: str | None = None,
    k: int | None = None,
    logprobs: int | None = None,
    **search: Any,
) -> list[GenerationResult]:
    """Decode several prompts together, one row each (:class:`BatchGenerator`): each
    row's greedy output equals its prompt generated alone. ``stop``, ``ignore_eos`` and
    the search options apply to every row; each row samples with its own generator
    seeded from ``seed``. ``spec`` speculates per row (:meth:`BatchGenerator.speculate`):
    ``"ngram"`` (prompt lookup) or ``"mtp"`` (the model's MTP head) verify up to ``k``
    drafts per row in each step, ``"auto"`` only while that measurably pays; a draft model
    runs one sequence. ``logprobs``: see :func:`generate`."""
    check_batch_spec(spec, k)
    logprobs = check_top_logprobs(logprobs)  # a missing MTP head fails in batch.speculate below
    max_new_tokens = check_int(max_new_tokens, "max_new_tokens", minimum=1)
    stops = stop_strings(stop)
    ignore_eos = check_bool(ignore_eos, "ignore_eos")
    ids = [prompt_ids(model, p) for p in prompts]
    longest = max(len(i) for i in ids) + max_new_tokens
    if longest > model.config.context_length:
        raise InvalidInputError(
            f"the longest prompt plus max_new_tokens={max_new_tokens} ({longest} tokens) "
            f"exceeds the model's context length of {model.config.context_length}"
        )
    batch = model.take_batch(len(ids), longest)
    try:
        batch.speculate(spec, k)
        return _decode_batch(model, batch, ids, max_new_tokens, stops, ignore_eos, search, logprobs)
    finally:
        model.give_back_batch(batch)


def _decode_batch(
    model: Model,
    batch: BatchGenerator,
    ids: list[list[int]],
    max_new_tokens: int,
    stops: tuple[str, ...],
    ignore_eos: bool,
    search: dict[str, Any],
    logprobs: int | None = None,
) -> list[GenerationResult]:
    """The loop of :func:`generate_batch` on a batch taken from the model's pool."""
    scanners: list[StopScanner] = []
    reasons: list[str | None] = []
    rows: list[int] = []
    sequences: list[list[int]] = [[] for _ in ids]
    kept_logprobs: list[list[TokenLogprob] | None] = [None for _ in ids]
    t0 = time.perf_counter()
    for prompt in ids:
        params = GeneratorParams(model)
        params.set_search_options(max_length=len(prompt) + max_new_tokens, **search)
        rows.append(batch.add(prompt, params, ignore_eos=ignore_eos, logprobs=logprobs))
        tokenizer = model.tokenizer.create_stream() if _has_tokenizer(model) else None
        scanners.append(StopScanner(tokenizer, stops))
        reasons.append(None)
    t1 = time.perf_counter()
    live = set(range(len(rows)))
    # Text is decoded token by token in the step loop where stop strings need it, or where
    # the batch queues steps ahead (the device computes meanwhile); else a row's text is
    # decoded once, when it ends (the same stream decoder over the same tokens).
    stream = bool(stops) or batch.queues_ahead
    while True:
        for i in list(live):
            row = rows[i]
            new = batch.last_tokens(row)
            kept, hit = scanners[i].feed(new)[1:] if stream else (new, None)
            if hit is not None:
                reasons[i] = f"stop string {hit!r}"
            elif batch.ended_by_eos(row):
                reasons[i] = "eos"
            elif batch.is_done(row):
                reasons[i] = "max_new_tokens"
            if reasons[i] is not None:
                live.discard(i)
                sequence = batch.sequence(row)
                # a speculative step's tokens after the one that completed a stop string
                sequences[i] = sequence[: len(sequence) - (len(new) - len(kept))]
                probs = batch.all_logprobs(row)
                if probs is not None:
                    kept_logprobs[i] = probs[: len(sequences[i]) - len(ids[i])]
                if not stream:
                    scanners[i].feed(sequences[i][len(ids[i]) :])
                batch.remove(row)  # later steps skip the row
        if not live:
            break
        batch.step()
    t2 = time.perf_counter()
    stats = {"target": model.session.all_graph_stats()}
    spec_stats = {} if batch.speculation is None else batch.speculation.as_dict()
    return [
        GenerationResult(
            scanners[i].text,
            sequences[i],
            len(ids[i]),
            t1 - t0,
            t2 - t1,
            reasons[i],
            spec_stats,
            stats,
            kept_logprobs[i],
        )
        for i in range(len(ids))
    ]


def _has_tokenizer(model: Model) -> bool:
    return (Path(model.folder) / "tokenizer.json").is_file()
