"""Continuous batching: requests join free rows between decode steps and leave at once.

A :class:`Scheduler` owns one background thread that runs the model. ``submit`` queues a
request and returns a :class:`RequestHandle` at once; between two decode steps the thread
admits queued requests into free rows (prefilling each), steps every running row by one
token, hands each row's new text to its handle, and retires rows that finished (end of
sequence, a stop string, ``max_new_tokens``, or a cancel) so their rows take the next
request. Handles are read from any thread, or from asyncio (:meth:`RequestHandle.stream`).

The rows are stepped by a :class:`~onnx_genrt.engine.batch.BatchGenerator`: one KV cache
of ``max_batch`` rows, a decode step of all running rows at once, replaying the graph of
its batch-size bucket.
"""

from __future__ import annotations

import itertools
import threading
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from onnx_genrt.core.checks import check_bool, check_int
from onnx_genrt.core.errors import InvalidInputError, OnnxGenrtError

from .api import DEFAULT_MAX_NEW_TOKENS
from .batch import BatchGenerator
from .batch_speculation import check_batch_spec, row_speculation
from .logprobs import TokenLogprob, check_top_logprobs
from .model import GeneratorParams, Model
from .stops import StopScanner, prompt_ids, stop_strings


class QueueFullError(OnnxGenrtError):
    """The scheduler's queue holds ``max_queue`` requests already: retry later."""


class SchedulerClosedError(OnnxGenrtError):
    """The scheduler stopped admitting requests (it is shutting down)."""


#: Why a request ended, as the OpenAI API names it: ``stop`` (end of sequence or a stop
#: string), ``length`` (max_new_tokens or the context), ``cancelled``, ``error``.
FINISH_REASONS = ("stop", "length", "cancelled", "error")
#: Rows decoded together and requests that may wait for a row, unless told otherwise (the
#: server's defaults too: ``onnx-genrt serve``, ``create_app``, the Ray deployment).
DEFAULT_MAX_BATCH = 8
DEFAULT_MAX_QUEUE = 256


@dataclass(frozen=True)
class TokenEvent:
    """New output of one request: its text piece, the token ids behind it, and, on the last
    event only, why it finished."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    #: The log-probability of each of ``token_ids`` (requests submitted with ``logprobs``).
    logprobs: tuple[TokenLogprob, ...] = ()
    #: On the first event of a request submitted with ``prompt_logprobs``: the
    #: log-probability of each prompt token after the first.
    prompt_logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class RequestResult:
    """A finished request."""

    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    #: Seconds from submission to the first token, None if none came.
    time_to_first_token: float | None
    error: str | None = None
    #: Each generated token's log-probability (None: not asked for).
    logprobs: list[TokenLogprob] | None = None
    #: Each prompt token's after the first (None: not asked for).
    prompt_logprobs: list[TokenLogprob] | None = None

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


class _LoopWaker:
    """Wakes, from the scheduler's thread, the futures one event loop's consumers wait on:
    one ``call_soon_threadsafe`` (a write to the loop's self-pipe) for every future added
    since the loop last ran the wake-up, however many handles and tokens they stand for."""

    def __init__(self, loop: Any) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._futures: list[Any] = []
        self._called = False  # a wake-up is on its way to the loop

    def add(self, future: Any) -> None:
        with self._lock:
            self._futures.append(future)

    def flush(self) -> None:
        """Ask the loop to wake the futures added so far (nothing if a call is pending)."""
        with self._lock:
            if self._called or not self._futures:
                return
            self._called = True
        try:
            self._loop.call_soon_threadsafe(self._wake)
        except RuntimeError:  # the loop is closed: the consumers waiting on it are gone
            with self._lock:
                self._futures.clear()
                self._called = False

    def _wake(self) -> None:  # in the loop
        with self._lock:
            futures, self._futures, self._called = self._futures, [], False
        for future in futures:
            if not future.done():  # a consumer that stopped waiting cancelled its own
                future.set_result(None)


_loop_wakers: weakref.WeakKeyDictionary[Any, _LoopWaker] = weakref.WeakKeyDictionary()
_loop_wakers_lock = threading.Lock()


def _loop_waker(loop: Any) -> _LoopWaker:
    with _loop_wakers_lock:
        waker = _loop_wakers.get(loop)
        if waker is None:
            waker = _loop_wakers[loop] = _LoopWaker(loop)
        return waker


class RequestHandle:
    """One submitted request: its events as they come, its result, and a way to cancel it.

    Read it from one consumer: :meth:`events` (blocking, any thread), :meth:`stream_batches`
    or :meth:`stream` (asyncio), or :meth:`result` (blocks until it finishes).
    """

    def __init__(self, request_id: str, prompt_tokens: int, submitted: float) -> None:
        self.id = request_id
        self.prompt_tokens = prompt_tokens
        self.submitted = submitted
        self._lock = threading.Lock()
        #: Events not yet taken by the consumer.
        self._pending: list[TokenEvent] = []
        self._ready = threading.Condition(self._lock)
        #: Set while an asyncio consumer waits: the waker of its loop and its future.
        self._armed: tuple[_LoopWaker, Any] | None = None
        self._done = threading.Event()
        self._cancel = threading.Event()
        self._text: list[str] = []
        self._tokens: list[int] = []
        self._logprobs: list[TokenLogprob] | None = None
        self._prompt_logprobs: list[TokenLogprob] | None = None
        self._first: float | None = None
        self._result: RequestResult | None = None

    # -- consumer side ----------------------------------------------------------
    def events(self, timeout: float | None = None) -> Iterator[TokenEvent]:
        """Events until the last one (which has ``finish_reason``); ``timeout`` seconds at
        most between two events (``TimeoutError`` after)."""
        while True:
            with self._lock:
                if not self._ready.wait_for(lambda: self._pending, timeout):
                    raise TimeoutError(f"request {self.id}: no event for {timeout} s")
                batch, self._pending = self._pending, []
            yield from batch
            if batch[-1].finish_reason is not None:
                return

    async def stream_batches(self) -> AsyncIterator[list[TokenEvent]]:
        """The events in asyncio, as lists of every event ready when the consumer asks (one
        or more; the last list ends with the event that has ``finish_reason``). A consumer
        that falls behind gets the tokens made meanwhile together. The scheduler wakes the
        loop once per step for all of its waiting consumers, without a thread per request."""
        import asyncio  # only where a handle is read from asyncio

        loop = asyncio.get_running_loop()
        waker = _loop_waker(loop)
        try:
            while True:
                with self._lock:
                    batch, self._pending = self._pending, []
                    if not batch:
                        future = loop.create_future()
                        self._armed = (waker, future)
                if not batch:
                    await future
                    continue
                yield batch
                if batch[-1].finish_reason is not None:
                    return
        finally:
            with self._lock:
                self._armed = None

    async def stream(self) -> AsyncIterator[TokenEvent]:
        """The events in asyncio, one at a time (see :meth:`stream_batches`)."""
        async for batch in self.stream_batches():
            for event in batch:
                yield event

    def result(self, timeout: float | None = None) -> RequestResult:
        """Wait for the request to finish and return its result."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.id} did not finish within {timeout} s")
        assert self._result is not None
        return self._result

    def cancel(self) -> None:
        """Stop the request: its row is freed at the next step (a queued one never runs)."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    # -- scheduler side ---------------------------------------------------------
    def _emit(
        self,
        text: str,
        tokens: Sequence[int],
        finish: str | None = None,
        error: str | None = None,
        *,
        logprobs: Sequence[TokenLogprob] | None = None,
        prompt_logprobs: Sequence[TokenLogprob] | None = None,
        wakes: set[_LoopWaker] | None = None,
    ) -> None:
        """Hand the consumer an event (``logprobs``: of ``tokens``, when kept). An asyncio
        consumer's loop is woken now, or, given ``wakes``, added to it for the caller to
        flush once for all its handles."""
        if tokens and self._first is None:
            self._first = time.perf_counter() - self.submitted
        self._text.append(text)
        self._tokens.extend(tokens)
        if logprobs is not None:
            self._logprobs = [*(self._logprobs or []), *logprobs]
        if prompt_logprobs is not None:
            self._prompt_logprobs = list(prompt_logprobs)
        event = TokenEvent(
            text, tuple(tokens), finish, tuple(logprobs or ()), tuple(prompt_logprobs or ())
        )
        if finish is not None:
            self._result = RequestResult(
                "".join(self._text),
                list(self._tokens),
                finish,
                self.prompt_tokens,
                self._first,
                error,
                None if self._logprobs is None else list(self._logprobs),
                self._prompt_logprobs,
            )
        with self._lock:
            self._pending.append(event)
            self._ready.notify()
            armed, self._armed = self._armed, None
        if armed is not None:
            waker, future = armed
            waker.add(future)
            if wakes is None:
                waker.flush()
            else:
                wakes.add(waker)
        if finish is not None:
            self._done.set()


@dataclass
class SchedulerMetrics:
    """A snapshot of what the scheduler has done (the server's ``/metrics``)."""

    queue_depth: int
    running_rows: int
    max_batch: int
    requests_finished: int
    requests_cancelled: int
    requests_failed: int
    tokens_generated: int
    decode_steps: int
    #: Seconds from submission to first token of the most recent requests (up to 1024).
    time_to_first_token: list[float] = field(default_factory=list)
    #: Tokens generated per second over the scheduler's busy time.
    tokens_per_second: float = 0.0
    #: Graph statistics of the model's session, per slot (captures, replays, fallbacks).
    graph_stats: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: Speculation per row (``RowSpeculation.as_dict``); empty when off.
    speculation: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Pending:
    handle: RequestHandle
    ids: list[int]
    params: GeneratorParams
    max_new_tokens: int
    stop: tuple[str, ...]
    ignore_eos: bool
    logprobs: int | None = None
    prompt_logprobs: bool = False


class _Running:
    """A request in a row: its scanner for stop strings and its token count."""

    def __init__(self, pending: _Pending, scanner: StopScanner) -> None:
        self.pending, self.scanner = pending, scanner
        self.generated = 0

    @property
    def handle(self) -> RequestHandle:
        return self.pending.handle


class Scheduler:
    """Serves many requests on one model by continuous batching (see the module docstring).

    ``max_batch`` rows share one KV cache of ``max_length`` positions per row (default: the
    model's context length); at most ``max_queue`` requests wait for a row, and one more
    is refused with :class:`QueueFullError`. Prompts longer than ``prefill_chunk`` tokens are
    prefilled a chunk per step, so running rows keep decoding meanwhile. Start it with ``with Scheduler(...) as s`` or
    :meth:`start`; :meth:`close` stops admitting and finishes (or cancels) what runs.
    ``spec`` (``"ngram"``, ``"mtp"`` or ``"auto"``, ``k`` drafts a row) verifies drafts of
    every row in each step (:meth:`BatchGenerator.speculate`). ``device_sampling`` draws
    the tokens of requests that sample by temperature and top-k on the device (None:
    where reads are async, a GPU; :attr:`BatchGenerator.device_sampling`).
    """

    def __init__(
        self,
        model: Model,
        *,
        max_batch: int = DEFAULT_MAX_BATCH,
        max_queue: int = DEFAULT_MAX_QUEUE,
        max_length: int | None = None,
        prefill_chunk: int | None = 256,
        spec: str | None = None,
        k: int | None = None,
        device_sampling: bool | None = None,
    ) -> None:
        self.model = model
        check_batch_spec(spec, k)
        self.device_sampling = (
            None if device_sampling is None else check_bool(device_sampling, "device_sampling")
        )
        if spec is not None:  # a missing MTP head fails here, not in the model thread
            row_speculation(model, spec, k)
        self.spec, self.k = spec, k
        self.max_batch = check_int(max_batch, "max_batch", minimum=1)
        self.max_queue = check_int(max_queue, "max_queue", minimum=0)
        #: Prompt tokens prefilled per scheduler step: a long prompt is prefilled in chunks
        #: between the decode steps of running rows, which go on meanwhile (None: whole).
        self.prefill_chunk = (
            None if prefill_chunk is None else check_int(prefill_chunk, "prefill_chunk", minimum=1)
        )
        context = model.config.context_length
        self.max_length = check_int(
            context if max_length is None else max_length,
            "max_length",
            minimum=2,
            maximum=context,
        )
        self._queue: deque[_Pending] = deque()
        self._rows: dict[int, _Running] = {}
        #: Requests taken from the queue and not yet in a row (or dropped): rows not free.
        self._taking = 0
        self._cv = threading.Condition()
        self._admitting = True
        self._stopping = False
        self._cancel_on_stop = False
        self._thread: threading.Thread | None = None
        self._ids = itertools.count(1)
        self._batch: BatchGenerator | None = None
        self._finished = self._cancelled = self._failed = 0
        self._tokens = self._steps = 0
        self._busy = 0.0
        self._ttft: deque[float] = deque(maxlen=1024)
        self._has_tokenizer = (model.folder / "tokenizer.json").is_file()
        #: Loops of asyncio consumers given events since the last flush (one wake-up each).
        self._wakes: set[_LoopWaker] = set()

    # -- life cycle ---------------------------------------------------------------
    def start(self) -> Scheduler:
        """Start the thread that runs the model (idempotent)."""
        with self._cv:
            if self._thread is None:
                self._batch = BatchGenerator(self.model, self.max_batch, self.max_length)
                self._batch.speculate(self.spec, self.k)
                self._batch.device_sampling = self.device_sampling
                self._thread = threading.Thread(
                    target=self._loop, name="onnx-genrt-scheduler", daemon=True
                )
                self._thread.start()
        return self

    def close(self, *, cancel: bool = False, timeout: float | None = None) -> None:
        """Stop admitting; let running and queued requests finish (``cancel=True``: cancel
        them, each ending with ``finish_reason='cancelled'``) and stop the thread."""
        with self._cv:
            self._admitting = False
            self._stopping = True
            self._cancel_on_stop = cancel
            self._cv.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)
        else:  # never started: nothing ran, cancel what was queued
            self._cancel_queued()

    def __enter__(self) -> Scheduler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close(cancel=exc[0] is not None)

    @property
    def admitting(self) -> bool:
        return self._admitting

    # -- requests -----------------------------------------------------------------
    def submit(
        self,
        prompt: str | Sequence[int],
        *,
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        stop: str | Sequence[str] = (),
        ignore_eos: bool = False,
        logprobs: int | None = None,
        prompt_logprobs: bool = False,
        **search: Any,
    ) -> RequestHandle:
        """Queue a request and return its handle. ``search``: the search options of
        :meth:`GeneratorParams.set_search_options` (``temperature``, ``top_p``, ``seed``,
        ``do_sample``...), checked here, as are the prompt and ``max_new_tokens``.
        ``logprobs`` (0-20): every event carries its tokens' log-probabilities under the
        model's raw logits, each with that many likeliest alternatives;
        ``prompt_logprobs`` (with ``logprobs``): the first event also carries the prompt's
        (``BatchGenerator.add``)."""
        max_new_tokens = check_int(max_new_tokens, "max_new_tokens", minimum=1)
        logprobs = check_top_logprobs(logprobs)
        if check_bool(prompt_logprobs, "prompt_logprobs") and logprobs is None:
            raise InvalidInputError("prompt_logprobs needs logprobs (the alternatives listed)")
        stops = stop_strings(stop)
        ignore_eos = check_bool(ignore_eos, "ignore_eos")
        ids = prompt_ids(self.model, prompt)
        if len(ids) + max_new_tokens > self.max_length:
            raise InvalidInputError(
                f"prompt of {len(ids)} tokens plus max_new_tokens={max_new_tokens} exceeds "
                f"the scheduler's max_length of {self.max_length}"
            )
        params = GeneratorParams(self.model)
        params.set_search_options(max_length=len(ids) + max_new_tokens, **search)
        handle = RequestHandle(f"req-{next(self._ids)}", len(ids), time.perf_counter())
        with self._cv:
            if not self._admitting:
                raise SchedulerClosedError("the scheduler is shutting down; not admitting")
            free = self.max_batch - len(self._rows) - self._taking
            waiting = len(self._queue) - free  # queued requests that will find no free row
            if waiting >= self.max_queue:
                raise QueueFullError(
                    f"{waiting} requests already wait for a free row "
                    f"(max_queue={self.max_queue}); retry later"
                )
            self._queue.append(
                _Pending(
                    handle,
                    ids,
                    params,
                    max_new_tokens,
                    stops,
                    ignore_eos,
                    logprobs,
                    prompt_logprobs,
                )
            )
            self._cv.notify_all()
        return handle

    def metrics(self) -> SchedulerMetrics:
        """A snapshot (waits for the decode step in flight: its graph counters move)."""
        with self.model.session.exclusive():
            graph_stats = self.model.session.all_graph_stats()
            batch = self._batch
            spec = batch.speculation if batch is not None else None
            speculation = {} if spec is None else spec.as_dict()
        with self._cv:
            busy = self._busy
            return SchedulerMetrics(
                queue_depth=len(self._queue),
                running_rows=len(self._rows),
                max_batch=self.max_batch,
                requests_finished=self._finished,
                requests_cancelled=self._cancelled,
                requests_failed=self._failed,
                tokens_generated=self._tokens,
                decode_steps=self._steps,
                time_to_first_token=list(self._ttft),
                tokens_per_second=self._tokens / busy if busy > 0 else 0.0,
                graph_stats=graph_stats,
                speculation=speculation,
            )

    # -- the model thread ---------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._rows and not self._stopping:
                    self._cv.wait()
                if self._stopping and self._cancel_on_stop:
                    self._cancel_queued()
                    for row in list(self._rows):
                        self._rows[row].handle.cancel()
                if self._stopping and not self._queue and not self._rows:
                    return
            start = time.perf_counter()
            try:
                self._admit()
                self._step()
            except Exception as exc:  # a fault of the model run: fail every running row
                self._fail_all(f"{type(exc).__name__}: {exc}")
            finally:  # events handed out before a fault still reach their consumers
                self._flush_wakes()
            with self._cv:
                self._busy += time.perf_counter() - start

    def _admit(self) -> None:
        """Move queued requests into free rows (prefilling each); drop cancelled ones."""
        batch = self._batch
        assert batch is not None
        while True:
            with self._cv:
                if not self._queue or batch.free_rows() == 0:
                    return
                pending = self._queue.popleft()
                self._taking += 1
            placed = None
            try:
                placed = self._place(batch, pending)
            finally:
                with self._cv:
                    self._taking -= 1
                    if placed is not None:
                        self._rows[placed[0]] = placed[1]
            if placed is not None and not batch.prefilling(placed[0]):
                self._deliver(*placed, batch.last_tokens(placed[0]))
                self._flush_wakes()  # its first token goes out before the next prefill

    def _place(self, batch: BatchGenerator, pending: _Pending) -> tuple[int, _Running] | None:
        """Put ``pending`` in a free row (prefilling its prompt or its first chunk); None
        when it was cancelled or the batch refused it (its handle is told)."""
        handle = pending.handle
        if handle.cancelled:
            self._retire_pending(pending, "cancelled")
            return None
        try:
            row = batch.add(
                pending.ids,
                pending.params,
                ignore_eos=pending.ignore_eos,
                chunk=self.prefill_chunk,
                logprobs=pending.logprobs,
                prompt_logprobs=pending.prompt_logprobs,
            )
        except Exception as exc:  # this prompt failed (its row stays free); others go on
            with self._cv:
                self._failed += 1
            handle._emit("", (), "error", f"{type(exc).__name__}: {exc}")
            return None
        scanner = StopScanner(
            self.model.tokenizer.create_stream() if self._has_tokenizer else None, pending.stop
        )
        return row, _Running(pending, scanner)

    def _step(self) -> None:
        """One decode step of every running row; retire cancelled rows first."""
        batch = self._batch
        assert batch is not None
        for row, running in list(self._rows.items()):
            if running.handle.cancelled:
                self._retire(row, "cancelled")
        if not self._rows:
            return
        if self.prefill_chunk is not None:
            done = batch.prefill_step(self.prefill_chunk)
            if done is not None:
                self._deliver(done, self._rows[done], batch.last_tokens(done))
                self._flush_wakes()
        new = batch.step()
        with self._cv:
            self._steps += 1
        for row, tokens in new.items():
            running = self._rows.get(row)
            if running is not None:
                self._deliver(row, running, tokens)
        self._flush_wakes()

    def _flush_wakes(self) -> None:
        """Wake each event loop whose consumers got events, once for all of them."""
        while self._wakes:
            self._wakes.pop().flush()

    def _deliver(self, row: int, running: _Running, tokens: list[int]) -> None:
        """Hand a row's new tokens to its handle; retire the row if it finished."""
        batch = self._batch
        assert batch is not None
        pending = running.pending
        text, tokens, hit = running.scanner.feed(tokens)
        logprobs = batch.last_logprobs(row)
        if logprobs is not None:  # those of the tokens kept (a stop string may cut them)
            logprobs = logprobs[: len(tokens)]
        prompt = batch.prompt_logprobs(row) if running.generated == 0 else None
        running.generated += len(tokens)
        with self._cv:
            self._tokens += len(tokens)
            if running.generated == len(tokens) and tokens:
                self._ttft.append(time.perf_counter() - pending.handle.submitted)
        finish = None
        if hit or batch.ended_by_eos(row):
            finish = "stop"
        elif running.generated >= pending.max_new_tokens or batch.is_done(row):
            finish = "length"
        if finish is None:
            if text or tokens:
                pending.handle._emit(
                    text, tokens, logprobs=logprobs, prompt_logprobs=prompt, wakes=self._wakes
                )
            return
        if not hit:  # text held back as a possible start of a stop string
            text += running.scanner.flush()
        pending.handle._emit(
            text, tokens, finish, logprobs=logprobs, prompt_logprobs=prompt, wakes=self._wakes
        )
        self._release(row, finished=True)

    def _retire(self, row: int, reason: str) -> None:
        running = self._rows[row]
        running.handle._emit("", (), reason)
        self._release(row, finished=reason != "cancelled")
        if reason == "cancelled":
            with self._cv:
                self._cancelled += 1

    def _release(self, row: int, finished: bool) -> None:
        assert self._batch is not None
        self._batch.remove(row)
        with self._cv:
            del self._rows[row]
            if finished:
                self._finished += 1

    def _retire_pending(self, pending: _Pending, reason: str) -> None:
        pending.handle._emit("", (), reason)
        with self._cv:
            self._cancelled += 1

    def _cancel_queued(self) -> None:
        while True:
            with self._cv:
                if not self._queue:
                    return
                pending = self._queue.popleft()
            self._retire_pending(pending, "cancelled")

    def _fail_all(self, message: str) -> None:
        for row, running in list(self._rows.items()):
            running.handle._emit("", (), "error", message)
            try:
                self._release(row, finished=False)
            except Exception:  # the batch is broken: forget the row
                with self._cv:
                    self._rows.pop(row, None)
            with self._cv:
                self._failed += 1
