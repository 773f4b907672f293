"""Several sequences decoded together: one KV cache of ``max_batch`` rows, one step for all.

Each row has its own prompt, length, search options, random generator and end of sequence.
A row is filled by an eager prefill of its prompt into its part of the cache (the other
rows are untouched), then every decode step feeds all running rows at once, each at its
own position (the length lives in the row's attention mask). A step of ``n`` rows runs the
smallest bucket (a power of two, or ``max_batch``) holding the highest running row, and
replays that bucket's graph in slot PRIMARY: changing the number of rows never recaptures.
Free rows inside the bucket run a one-token dummy sequence that nothing reads. With
:meth:`BatchGenerator.speculate`, a step may instead verify each row's drafts in one step of
``k + 1`` tokens a row (slot VERIFY; ``engine/batch_speculation.py``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from onnx_genrt.core.checks import check_bool, check_int
from onnx_genrt.core.errors import InvalidInputError
from onnx_genrt.core.graph_slots import DeviceGraphSlot
from onnx_genrt.core.locking import SingleUser

from .batch_speculation import RowSpeculation, row_speculation
from .config import SearchOptions
from .decoder import DecoderRunner, PendingRows, StepOutput
from .device_sampler import SampleInputs, draws_on_device, sample_inputs
from .logprobs import TokenLogprob, check_top_logprobs, token_logprob
from .model import GeneratorParams, Model
from .sampling import choose, plain_greedy

#: The most rows one captured step holds by default; a larger step runs as pieces of this
#: many rows. The CUDA provider's matmuls capture up to 64 rows (tensor cores, or GEMV
#: kernels in pieces of 16 rows); more would need cuBLAS, which CuPy refuses inside a
#: stream capture.
MAX_GRAPH_ROWS = 64
#: Widest graphed prompt chunk of a batch row. Every row keeps its own prompt graphs (one
#: per width, each with logits of ``width`` rows: a 151936-token vocabulary in float32
#: takes 0.6 MB a row), so wider chunks (up to 512 rows where the session captures them)
#: are left to single sequences: rows stay at 8-64 (120 rows of logits each), and a prompt
#: of more than 4 x 64 tokens prefills eagerly, as before cuBLAS captured.
ROW_PREFILL_MAX_WIDTH = 64
#: Prompt tokens fed per eager step of a row that scores its prompt (``add(...,
#: prompt_logprobs=True)``): such a step reads every token's logits, ``[tokens, vocab]``.
PROMPT_LOGPROBS_CHUNK = 64


def buckets(max_batch: int, max_graph_rows: int = MAX_GRAPH_ROWS) -> tuple[int, ...]:
    """The step sizes a batch of up to ``max_batch`` rows runs at: powers of two up to
    ``max_graph_rows``, then multiples of it (run as pieces), and ``max_batch`` itself."""
    sizes = []
    size = 1
    while size < min(max_batch, max_graph_rows):
        sizes.append(size)
        size *= 2
    size = max_graph_rows
    while size < max_batch:
        sizes.append(size)
        size += max_graph_rows
    return (*sizes, max_batch)


#: A step queued ahead: its pending rows, and the decoding rows, bucket size and device-drawn
#: rows it was queued for.
_Ahead = tuple[PendingRows, frozenset[int], int, frozenset[int]]


@dataclass
class _Row:
    """One sequence: its tokens (the last one pending: chosen, not yet fed), options."""

    tokens: list[int]
    prompt_length: int
    search: SearchOptions
    eos: set[int]
    rng: np.random.Generator
    new: list[int] = field(default_factory=list)
    #: Prompt tokens in the cache so far; below ``prompt_length`` the row is still
    #: prefilling (chunk by chunk) and decode steps skip it.
    prefilled: int = 0
    #: The target's hidden state that predicted the pending token (kept while the batch's
    #: drafts come from an MTP head).
    hidden: np.ndarray | None = None
    #: The key of the row's draws on the device (its seed, or one drawn from its generator).
    sample_seed: int = 0
    #: Alternatives listed with each generated token's log-probability (None: none kept).
    logprobs: int | None = None
    #: Each generated token's log-probability, in order (with ``logprobs``).
    token_logprobs: list[TokenLogprob] = field(default_factory=list)
    #: The log-probability of each prompt token after the first (None: not asked for).
    prompt_logprobs: list[TokenLogprob] | None = None

    @property
    def prefilling(self) -> bool:
        return self.prefilled < self.prompt_length

    def record(self, tokens: Sequence[int], logits: Sequence[np.ndarray] | np.ndarray) -> None:
        """Keep the log-probabilities of ``tokens``, token j picked from ``logits[j]``."""
        if self.logprobs is not None:
            for token, row in zip(tokens, logits, strict=False):
                self.token_logprobs.append(token_logprob(row, token, self.logprobs))


class BatchGenerator:
    """Decodes up to ``max_batch`` sequences of up to ``max_length`` tokens together.

    ``add`` prefills a prompt into a free row and picks its first token; ``step`` adds one
    token to every row; ``remove`` frees a row. Rows are independent: each row's greedy
    output equals the same prompt generated alone. One thread drives it at a time (the
    :class:`~onnx_genrt.engine.scheduler.Scheduler`'s does); a second thread entering it
    meanwhile gets ``ConcurrentUseError``. Its steps take turns with other users of the
    model's session.

    Steps of greedy and device-drawn rows look ahead where read-backs are asynchronous (a
    GPU): the next step is queued, fed the tokens this step chose on the device (argmax or
    drawn), before this one is read back, so the device never waits for the host's
    picking. ``look_ahead`` True or False forces it on or off.
    """

    #: Queue the next step of greedy and device-drawn rows before reading this one (None:
    #: where reads are async).
    look_ahead: bool | None = None
    #: Draw the tokens of rows that sample by temperature and top-k on the device
    #: (``engine/device_sampler.py``: Philox noise keyed by the row's seed, one token read
    #: back per row instead of its logits); False: the host sampler for every row; None
    #: (the default): where reads are async (a GPU, where the host's draws cost 2.5x at one
    #: row and 25x at 32: docs/performance.md). For a seed its draws differ from the host
    #: sampler's (and so from the single-sequence ``Generator``'s).
    device_sampling: bool | None = None
    #: Prompts as graphed chunks of padded rows (``DecoderRunner.prefill``): None where
    #: reads are async (a GPU), True or False to force it. Each row keeps one graph per
    #: chunk width.
    graph_prefill: bool | None = None

    def __init__(
        self,
        model: Model,
        max_batch: int,
        max_length: int | None = None,
        *,
        max_graph_rows: int = MAX_GRAPH_ROWS,
    ) -> None:
        self.model = model
        self.max_batch = check_int(max_batch, "max_batch", minimum=1)
        self.max_graph_rows = check_int(max_graph_rows, "max_graph_rows", minimum=1)
        context = model.config.context_length
        length = context if max_length is None else max_length
        self.max_length = check_int(length, "max_length", minimum=2, maximum=context)
        self.buckets = buckets(self.max_batch, self.max_graph_rows)
        self.runner = DecoderRunner(
            model.session, model.config, self.max_length, rows=self.max_batch
        )
        self.runner.variant_base = model.graph_variant_base()
        self._row_runners: dict[int, DecoderRunner] = {}
        self._pieces: dict[tuple[int, int], DecoderRunner] = {}
        self.rows: dict[int, _Row] = {}
        self._user = SingleUser("this BatchGenerator")
        #: The step queued ahead (see the class docstring), valid for this set of decoding
        #: rows at this bucket size; and how many steps were taken from one so far.
        self._ahead: _Ahead | None = None
        self.steps_ahead = 0
        #: Speculation per row (``speculate``); None: plain steps only.
        self.speculation: RowSpeculation | None = None

    def speculate(self, spec: str | None, k: int | None = None) -> None:
        """Verify drafts in the steps from now on: each row proposes up to ``k`` tokens
        continuing its own text (prompt lookup), and one step of ``k + 1`` tokens a row
        (slot VERIFY, one graph per bucket) keeps each row's drafts while they agree with
        it: a greedy row's output stays what plain steps give, a sampled row's keeps its
        distribution (``engine/batch_speculation.py``). ``"ngram"`` verifies whenever a row
        has drafts, ``"auto"`` only while it measurably pays (a wide step of many rows can
        cost more than it gains), None turns it off. A step runs plain when no row has
        drafts, or when the wide step would exceed ``max_graph_rows`` rows of tokens or a
        row's cache."""
        with self._user:
            self.speculation = None if spec is None else row_speculation(self.model, spec, k)
            self._ahead = None

    # -- rows ---------------------------------------------------------------------
    def free_rows(self) -> int:
        return self.max_batch - len(self.rows)

    def add(
        self,
        prompt: Sequence[int],
        params: GeneratorParams,
        *,
        ignore_eos: bool = False,
        chunk: int | None = None,
        logprobs: int | None = None,
        prompt_logprobs: bool = False,
    ) -> int:
        """Take the lowest free row for ``prompt`` and return it. The row ends at
        ``params``' max_length (at most this batch's). With ``logprobs`` (0-20), the row
        keeps each generated token's log-probability and that many likeliest alternatives
        (:meth:`last_logprobs`); its steps then read its logits back. ``prompt_logprobs``
        (with ``logprobs``) scores the prompt too (:meth:`prompt_logprobs`): it is fed
        eagerly, ``PROMPT_LOGPROBS_CHUNK`` tokens a step, every token's logits read.

        Without ``chunk`` (or with a prompt of at most ``chunk`` tokens) the prompt is
        prefilled now and the row's first token picked. Otherwise the row prefills
        ``chunk`` tokens per :meth:`prefill_step`, between the decode steps of the
        others, and joins them once its prompt is in (``prefilling(row)`` until then)."""
        if len(self.rows) >= self.max_batch:
            raise InvalidInputError(f"all {self.max_batch} rows are in use")
        ids = [check_int(t, f"token id {i}", minimum=0) for i, t in enumerate(prompt)]
        vocab = self.model.config.vocab_size
        if not ids or max(ids) >= vocab:
            raise InvalidInputError(
                "the prompt is empty"
                if not ids
                else f"token ids {[t for t in ids if t >= vocab][:5]} are outside the vocabulary "
                f"of {vocab}"
            )
        search = params.search
        if search.max_length > self.max_length:
            raise InvalidInputError(
                f"max_length {search.max_length} exceeds the batch's max_length {self.max_length}"
            )
        if len(ids) >= search.max_length:
            raise InvalidInputError(
                f"a prompt of {len(ids)} tokens leaves no room below max_length {search.max_length}"
            )
        if chunk is not None:
            chunk = check_int(chunk, "prefill chunk", minimum=1)
        top = check_top_logprobs(logprobs)
        if check_bool(prompt_logprobs, "prompt_logprobs") and top is None:
            raise InvalidInputError("prompt_logprobs needs logprobs (the alternatives listed)")
        with self._user:
            index = min(set(range(self.max_batch)) - self.rows.keys())
            eos = set(self.model.config.eos_token_ids)
            if check_bool(ignore_eos, "ignore_eos"):
                eos = set()
            row = _Row(list(ids), len(ids), search, eos, np.random.default_rng(search.seed))
            row.sample_seed = (
                search.seed if search.seed is not None else int(row.rng.integers(0, 2**63 - 1))
            )
            row.logprobs = top
            row.prompt_logprobs = [] if prompt_logprobs else None
            self._ahead = None  # queued for the rows before: a new row must not reuse it
            self._row_runner(index).rewind_to(0)
            self.rows[index] = row
            try:
                self._prefill(index, len(ids) if chunk is None else chunk)
            except BaseException:
                del self.rows[index]  # a prompt that cannot go in leaves its row free
                raise
            return index

    def prefilling(self, index: int) -> bool:
        """Whether row ``index`` still has prompt tokens to prefill."""
        return self.rows[index].prefilling

    def prefill_step(self, chunk: int) -> int | None:
        """Prefill the next ``chunk`` prompt tokens of the first row still prefilling;
        returns that row when its prompt is now all in (its first token picked), else
        None."""
        with self._user:
            waiting = [i for i, r in self.rows.items() if r.prefilling]
            if not waiting:
                return None
            index = min(waiting, key=lambda i: self.rows[i].prefilled)
            self._prefill(index, check_int(chunk, "prefill chunk", minimum=1))
            return None if self.rows[index].prefilling else index

    def _prefill(self, index: int, chunk: int) -> None:
        """Feed row ``index``'s next ``chunk`` prompt tokens; after the last, pick its first
        token."""
        row = self.rows[index]
        part = row.tokens[row.prefilled : min(row.prompt_length, row.prefilled + chunk)]
        runner = self._row_runner(index)
        graphed = runner.io.auto(self.graph_prefill)
        if row.prompt_logprobs is not None:
            out, last = self._prefill_scored(row, runner, part)
        else:
            with self.model.session.exclusive():
                out, last = runner.prefill(part, graphed and self.model.enable_graphs)
        row.prefilled += len(part)
        if not row.prefilling:
            token = self._pick(row, out.tokens[-1], lambda: out.logits[-1])
            row.tokens.append(token)
            row.new = [token]
            row.record(row.new, out.logits[-1:])
            spec = self.speculation
            if spec is not None and spec.needs_hidden and out.hidden is not None:
                row.hidden = np.array(out.hidden[last])

    def _prefill_scored(
        self, row: _Row, runner: DecoderRunner, part: list[int]
    ) -> tuple[StepOutput, int]:
        """Feed ``part`` (from ``row.prefilled`` on) eagerly, ``PROMPT_LOGPROBS_CHUNK``
        tokens a step with every token's logits, keeping the log-probability of each prompt
        token they predict; returns the last step's output and its last row."""
        assert row.prompt_logprobs is not None and row.logprobs is not None
        every_row, runner.prefill_last_row = runner.prefill_last_row, False
        try:
            for first in range(0, len(part), PROMPT_LOGPROBS_CHUNK):
                piece = part[first : first + PROMPT_LOGPROBS_CHUNK]
                with self.model.session.exclusive():
                    out = runner.forward(piece, None)
                at = row.prefilled + first + 1  # the prompt position the first row predicts
                scored = row.tokens[at : min(at + len(piece), row.prompt_length)]
                row.prompt_logprobs += [
                    token_logprob(logits, token, row.logprobs)
                    for token, logits in zip(scored, out.logits, strict=False)
                ]
        finally:
            runner.prefill_last_row = every_row
        return out, len(piece) - 1

    def remove(self, index: int) -> None:
        """Free row ``index`` (its cache positions are overwritten by the next prompt)."""
        with self._user:
            if index not in self.rows:
                raise InvalidInputError(f"row {index} is not in use")
            del self.rows[index]
            self._ahead = None

    def clear(self) -> None:
        """Free every row and turn speculation off."""
        with self._user:
            self.rows.clear()
            self._ahead = None
            self.speculation = None

    def _row_runner(self, index: int) -> DecoderRunner:
        runner = self._row_runners.get(index)
        if runner is None:
            runner = DecoderRunner(
                self.model.session,
                self.model.config,
                self.max_length,
                cache=self.runner.cache.row(index),
            )
            # its prompt graphs beside every other row's (``DecoderRunner.prefill``)
            runner.variant_base = self.runner.variant_base + (index + 1) * 1024
            runner.prefill_max_width = ROW_PREFILL_MAX_WIDTH
            self._row_runners[index] = runner
        return runner

    # -- stepping -----------------------------------------------------------------
    def bucket(self) -> int:
        """The number of rows the next step runs (covers the highest decoding row)."""
        top = max(i for i, r in self.rows.items() if not r.prefilling) + 1
        return next(size for size in self.buckets if size >= top)

    def step(self) -> dict[int, list[int]]:
        """One token for every running row that is not done; returns the new token of each
        row stepped."""
        with self._user:
            return self._step()

    def _step(self) -> dict[int, list[int]]:
        live = {i: r for i, r in self.rows.items() if not r.prefilling and not self.is_done(i)}
        ahead, self._ahead = self._ahead, None
        if not live:
            return {}
        size = self.bucket()
        spec = self.speculation
        if spec is None or not self._may_verify(spec, live, size):
            return self._plain_step(live, size, ahead)
        started = time.perf_counter()
        new = self._verify_step(spec, live, size) if spec.wanted() else None
        verified = new is not None
        if new is None:
            new = self._plain_step(live, size, None)
        spec.record(verified, sum(len(t) for t in new.values()), time.perf_counter() - started)
        return new

    def _plain_step(
        self,
        live: dict[int, _Row],
        size: int,
        ahead: _Ahead | None,
    ) -> dict[int, list[int]]:
        """One token for every live row, in a step of ``size`` rows (slot PRIMARY)."""
        lengths = self._row_starts(live, size)
        tokens = np.zeros(size, np.int64)
        for i, row in live.items():
            tokens[i] = row.tokens[-1]
        # Greedy rows take the device argmax; one whose argmax is end of sequence before its
        # min_length reads its own logits row after the step (``_row_logits``). Rows that
        # sample by temperature and top-k draw on the device when the batch does
        # (``device_sampling``).
        drawn = self._device_drawn(live)
        need_logits = any(
            (not plain_greedy(r.search) and i not in drawn) or r.logprobs is not None
            for i, r in live.items()
        )
        sample = self._sample_inputs(live, drawn, size) if drawn else None
        spec = self.speculation
        need_hidden = spec is not None and spec.needs_hidden
        key = (frozenset(live), size, frozenset(drawn))
        with self.model.session.exclusive():
            if ahead is not None and ahead[1:] == key:
                pending = ahead[0]  # queued last step with these tokens, fed on the device
                self.steps_ahead += 1
            else:
                pending = self._launch(tokens, lengths, need_logits, need_hidden, sample)
            queued = None
            if self._may_look_ahead(live, size, lengths, need_logits):
                after = lengths.copy()
                after[list(live)] += 1
                fed_by = pending[0] if isinstance(pending, list) else pending  # one piece
                next_sample = self._sample_inputs(live, drawn, size, 1) if drawn else None
                queued = (
                    self.runner.launch_rows(
                        None,
                        after,
                        DeviceGraphSlot.PRIMARY,
                        feed_token_of=fed_by,
                        read_hidden=need_hidden,
                        sample=next_sample,
                    ),
                    *key,
                )
            # on an error the queued step is dropped
            argmax, logits, hidden = self._finish(pending)
            sampled = self._sampled(pending) if sample is not None else None
            fed = argmax if sampled is None else sampled  # what a queued step was fed
            if queued is not None and any(self._masks(r, int(argmax[i])) for i, r in live.items()):
                # A masked pick reads this step's logits, which the queued step overwrote:
                # drop it and run this step again (the same keys and values).
                queued = None
                argmax, logits, hidden = self._finish(
                    self._launch(tokens, lengths, need_logits, need_hidden)
                )
            new = {}
            for i, row in live.items():
                if sampled is not None and i in drawn:
                    token = int(sampled[i])
                else:
                    token = self._pick(
                        row,
                        int(argmax[i]),
                        lambda i=i, lg=logits: (
                            lg[i] if lg is not None else self._row_logits(size, i)
                        ),
                    )
                row.tokens.append(token)
                row.new = [token]
                new[i] = [token]
                if row.logprobs is not None:
                    row.record(row.new, [logits[i]])
                if hidden is not None:
                    row.hidden = np.array(hidden[i, 0])
                if token != int(fed[i]):  # the queued step was fed another token
                    queued = None
            self._ahead = queued
        return new

    def _device_drawn(self, live: dict[int, _Row]) -> set[int]:
        """The live rows whose next token is drawn on the device: with ``device_sampling``,
        those sampling by temperature and top-k and free to end (past their min_length)."""
        if not self.runner.io.auto(self.device_sampling):
            return set()
        return {i for i, r in live.items() if draws_on_device(r.search, r.eos, len(r.tokens))}

    @staticmethod
    def _sample_inputs(
        live: dict[int, _Row], drawn: set[int], size: int, ahead: int = 0
    ) -> SampleInputs:
        """The drawn rows' sampling inputs for the step ``ahead`` steps from now: each with
        its seed at the index its token will have in its sequence."""
        rows = {
            i: (live[i].search, live[i].sample_seed, len(live[i].tokens) + ahead) for i in drawn
        }
        return sample_inputs(size, rows)

    @property
    def queues_ahead(self) -> bool:
        """Whether steps are queued one ahead where they can be (``look_ahead``, by default
        on a provider with asynchronous reads): the host's work between steps then runs
        while the device computes, rather than adding to each step."""
        return self.runner.io.auto(self.look_ahead)

    def _may_look_ahead(
        self, live: dict[int, _Row], size: int, lengths: np.ndarray, need_logits: bool
    ) -> bool:
        """Whether to queue the next step now: every decoding row plain greedy or drawn on
        the device (its next token too: a row past its min_length stays so), one graph
        of rows, room in the cache, on a provider with asynchronous reads (unless forced),
        and, while the batch speculates, no verify step possible next (too many rows of
        tokens or too little room)."""
        if not self.queues_ahead or need_logits or size > self.max_graph_rows:
            return False
        spec = self.speculation
        if spec is not None and self._may_verify(spec, live, size):
            return False  # the next step may verify instead
        if not self.runner.device_argmax:
            return False
        return int(np.max(lengths)) + 2 <= self.max_length

    def _may_verify(self, spec: RowSpeculation, live: dict[int, _Row], size: int) -> bool:
        """Whether this step may verify drafts: the wide step one graph, and room in every
        row's cache."""
        if size * spec.width > self.max_graph_rows:
            return False
        return self._row_starts(live, size).max() + spec.width <= self.max_length

    def _row_starts(self, live: dict[int, _Row], size: int) -> np.ndarray:
        """Each row's first position in the next step: a live row's pending token's; a row
        still prefilling runs dummy tokens from its next prompt position, which its next
        chunk overwrites (its prompt so far stays intact); free rows from 0."""
        starts = np.zeros(size, np.int64)
        for i, row in self.rows.items():
            if i < size and row.prefilling:
                starts[i] = row.prefilled
        for i, row in live.items():
            starts[i] = len(row.tokens) - 1
        return starts

    def _verify_step(
        self, spec: RowSpeculation, live: dict[int, _Row], size: int
    ) -> dict[int, list[int]] | None:
        """One step of ``k + 1`` tokens a row: each live row's pending token and drafts
        (padded); a row that takes its device argmax keeps what
        :meth:`RowSpeculation.accept` gives, up to an end of sequence, any other what
        :meth:`RowSpeculation.accept_by_logits` gives (its rows of the step's logits are
        read back then, only those).
        None, having run nothing, when no row has drafts."""
        rows = [
            (i, row.tokens, row.search.max_length - len(row.tokens) - 1, row.hidden)
            for i, row in live.items()
        ]
        by_logits = {i for i, r in live.items() if not self._takes_argmax(r)}
        with self.model.session.exclusive():  # the MTP head runs on the model's providers
            drafts = spec.drafts(rows)
            if not any(drafts.values()):
                return None
            tokens = np.zeros((size, spec.width), np.int64)
            for i, row in live.items():
                tokens[i, 0] = row.tokens[-1]
                tokens[i, 1 : 1 + len(drafts[i])] = drafts[i]
            pending = self.runner.launch_rows(
                tokens,
                self._row_starts(live, size),
                DeviceGraphSlot.VERIFY,
                read_hidden=spec.needs_hidden,
            )
            argmax, logits = self.runner.finish_rows(pending)
            if logits is None and by_logits:  # only the rows that pick from them
                order = sorted(by_logits)
                read = self.runner.io.read([pending.bufs.logits[i] for i in order])
                logits = dict(zip(order, read, strict=True))
        new = {}
        for i, row in live.items():
            if i in by_logits:
                kept = spec.accept_by_logits(
                    drafts[i],
                    logits[i],
                    row.tokens,
                    row.search,
                    row.eos,
                    row.rng,
                    row.prompt_length,
                )
            else:
                kept = spec.accept(drafts[i], argmax[i])
                end = next((j for j, t in enumerate(kept) if t in row.eos), None)
                kept = kept if end is None else kept[: end + 1]
            if pending.hidden is not None:  # the state that predicted the last token kept
                row.hidden = np.array(pending.hidden[i, len(kept) - 1])
            row.tokens.extend(kept)
            row.new = kept
            new[i] = kept
            if row.logprobs is not None:
                row.record(kept, logits[i])
        return new

    @staticmethod
    def _takes_argmax(row: _Row) -> bool:
        """Whether every pick of the row's next tokens is the raw argmax, with nothing else
        read: plain greedy, with no end of sequence that ``min_length`` masks, and no
        log-probabilities kept."""
        masks = bool(row.eos) and len(row.tokens) < row.search.min_length
        return plain_greedy(row.search) and not masks and row.logprobs is None

    @staticmethod
    def _masks(row: _Row, argmax: int) -> bool:
        """Whether the row's pick is not its argmax: an end-of-sequence argmax before its
        ``min_length`` is masked and the pick made from the logits."""
        return bool(row.eos) and argmax in row.eos and len(row.tokens) < row.search.min_length

    def _row_logits(self, size: int, index: int) -> np.ndarray:
        """Row ``index``'s logits [vocab] from the last step of ``size`` rows (read now)."""
        most = self.max_graph_rows
        if size <= most:
            return self.runner.row_logits(size, index)
        start = index - index % most
        piece = self.runner if start == 0 else self._piece(start, min(size, start + most) - start)
        return piece.row_logits(min(size, start + most) - start, index - start)

    def _launch(
        self,
        tokens: np.ndarray,
        lengths: np.ndarray,
        need_logits: bool,
        need_hidden: bool = False,
        sample: SampleInputs | None = None,
    ) -> list[PendingRows]:
        """Queue the step of ``len(tokens)`` rows as graphs of at most ``max_graph_rows``
        rows, each replayed on its own rows of the cache; ``_finish`` reads them back.
        ``sample``: each row's (temperature, seed, offset, top_k) for draws on the device."""
        size, most = len(tokens), self.max_graph_rows
        pieces = []
        for start in range(0, size, most):
            stop = min(size, start + most)
            piece = self.runner if start == 0 else self._piece(start, stop - start)
            pieces.append(
                piece.launch_rows(
                    tokens[start:stop],
                    lengths[start:stop],
                    DeviceGraphSlot.PRIMARY,
                    need_logits,
                    read_hidden=need_hidden,
                    sample=None if sample is None else tuple(a[start:stop] for a in sample),
                )
            )
        return pieces

    @staticmethod
    def _sampled(pending: PendingRows | list[PendingRows]) -> np.ndarray:
        """The tokens drawn on the device by a step ``_finish`` has read."""
        pieces = pending if isinstance(pending, list) else [pending]
        return np.concatenate([p.sampled for p in pieces])

    def _finish(
        self, pending: PendingRows | list[PendingRows]
    ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
        """The argmax (and logits and hidden states, when read) of a step queued by
        ``_launch`` or ahead."""
        pieces = pending if isinstance(pending, list) else [pending]
        done = [self.runner.finish_rows(p) for p in pieces]
        argmax = np.concatenate([a for a, _ in done])
        logits = [lg for _, lg in done]
        hidden = None if pieces[0].hidden is None else np.concatenate([p.hidden for p in pieces])
        return argmax, None if logits[0] is None else np.concatenate(logits), hidden

    def _piece(self, start: int, count: int) -> DecoderRunner:
        runner = self._pieces.get((start, count))
        if runner is None:
            runner = DecoderRunner(
                self.model.session,
                self.model.config,
                self.max_length,
                cache=self.runner.cache.rows_view(start, count),
            )
            runner.variant_base = self.runner.variant_base + start * 1024  # beside row 0's
            self._pieces[start, count] = runner
        return runner

    @staticmethod
    def _pick(row: _Row, argmax: int, logits) -> int:
        history = row.tokens
        return choose(int(argmax), logits, history, row.search, row.eos, row.rng, row.prompt_length)

    # -- reading ------------------------------------------------------------------
    def sequence(self, index: int) -> list[int]:
        """Row ``index``'s tokens: its prompt and what was generated."""
        return list(self.rows[index].tokens)

    def last_tokens(self, index: int) -> list[int]:
        """The tokens the last ``add`` or ``step`` gave row ``index``."""
        return list(self.rows[index].new)

    def prompt_logprobs(self, index: int) -> list[TokenLogprob] | None:
        """The log-probability of each prompt token after the first, under the model given
        the tokens before it (rows added with ``prompt_logprobs``; else None)."""
        row = self.rows[index]
        return None if row.prompt_logprobs is None else list(row.prompt_logprobs)

    def all_logprobs(self, index: int) -> list[TokenLogprob] | None:
        """The log-probabilities of every token row ``index`` generated (None: it keeps none)."""
        row = self.rows[index]
        return None if row.logprobs is None else list(row.token_logprobs)

    def last_logprobs(self, index: int) -> list[TokenLogprob] | None:
        """The log-probabilities of :meth:`last_tokens` (None: the row keeps none)."""
        row = self.rows[index]
        if row.logprobs is None:
            return None
        return row.token_logprobs[len(row.token_logprobs) - len(row.new) :]

    def ended_by_eos(self, index: int) -> bool:
        row = self.rows[index]
        if row.prefilling:
            return False
        return (
            bool(row.eos) and row.tokens[-1] in row.eos and len(row.tokens) >= row.search.min_length
        )

    def is_done(self, index: int) -> bool:
        """Whether row ``index`` reached end of sequence or its max_length."""
        row = self.rows[index]
        return len(row.tokens) >= row.search.max_length or self.ended_by_eos(index)

    def graph_stats(self) -> dict[str, dict]:
        return self.model.session.all_graph_stats()


class SequencesGenerator:
    """``batch_size`` sequences with the :class:`~onnx_genrt.engine.Generator` calls: what
    ``Generator(model, params)`` makes when the search options ask for ``batch_size > 1``
    (onnxruntime-genai's shape of the API). One row of a pooled :class:`BatchGenerator` per
    sequence; each row's greedy output equals its prompt generated alone.

    ``append_tokens`` takes the prompts once (one token list per sequence, lengths may
    differ); each ``generate_next_token`` adds a token to every sequence not done;
    ``get_next_tokens`` gives one token per sequence (the pad token for a sequence that was
    done before the call: genai_config's ``pad_token_id``, else the smallest end-of-sequence
    id, else 0); ``is_done`` is true when every sequence is. One thread at a time.
    """

    def __init__(self, model: Model, params: GeneratorParams) -> None:
        self.model = model
        self.params = params
        self.search = params.search
        self.batch_size = self.search.batch_size
        self.eos = set(model.config.eos_token_ids)
        pad = model.config.pad_token_id
        self.pad_token_id = pad if pad is not None else min(self.eos, default=0)
        self._batch: BatchGenerator | None = model.take_batch(
            self.batch_size, self.search.max_length
        )
        self._rows: list[int] = []
        self._new: list[int] = []
        self._first_pending = False  # the prompts' first tokens are picked, not yet given

    def __enter__(self) -> SequencesGenerator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Hand the rows back to the model's pool (the sequences stay readable)."""
        if self._batch is not None:
            self._sequences = [self._batch.sequence(i) for i in self._rows]
            self.model.give_back_batch(self._batch)
            self._batch = None

    def _open(self) -> BatchGenerator:
        if self._batch is None:
            raise InvalidInputError("this generator is closed; create a new one")
        return self._batch

    def append_tokens(self, prompts: Sequence[Sequence[int]]) -> None:
        """The prompts, one token list per sequence (``batch_size`` of them), once."""
        batch = self._open()
        if self._rows:
            raise InvalidInputError(
                "a batched generator takes its prompts once; create a new one to continue"
            )
        rows = [list(p) for p in prompts]  # a 2-D array: each row whole
        if len(rows) != self.batch_size:
            raise InvalidInputError(
                f"append_tokens needs one prompt per sequence: batch_size is "
                f"{self.batch_size}, got {len(rows)}"
            )
        try:
            for ids in rows:
                self._rows.append(batch.add(ids, self.params))
        except Exception:
            for index in self._rows:
                batch.remove(index)
            self._rows = []
            raise
        self._first_pending = True

    def generate_next_token(self) -> None:
        """One token for every sequence that is not done."""
        batch = self._open()
        if not self._rows:
            raise InvalidInputError("append_tokens first: there are no prompts")
        if self.is_done():
            raise InvalidInputError("generation is done (every sequence ended)")
        if self._first_pending:  # picked when the prompts were prefilled
            self._first_pending = False
            self._new = [batch.last_tokens(i)[-1] for i in self._rows]
            return
        stepped = batch.step()
        self._new = [stepped[i][-1] if i in stepped else self.pad_token_id for i in self._rows]

    def get_next_tokens(self) -> list[int]:
        """The token each sequence got from the last ``generate_next_token``."""
        return list(self._new)

    def is_done(self) -> bool:
        """Whether every sequence ended (end of sequence or max_length); a closed generator
        is done."""
        if self._batch is None:
            return True
        if not self._rows or self._first_pending:
            return False
        return all(self._batch.is_done(i) for i in self._rows)

    def get_sequence(self, index: int) -> list[int]:
        """Sequence ``index``: its prompt and the tokens generated so far."""
        index = check_int(index, "sequence index", minimum=0, maximum=self.batch_size - 1)
        if self._batch is None:
            return list(self._sequences[index]) if self._rows else []
        if not self._rows:
            return []
        tokens = self._batch.sequence(self._rows[index])
        return tokens[:-1] if self._first_pending else tokens
