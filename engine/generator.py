"""Token-by-token generation over a static KV cache (greedy or sampled)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from onnx_genrt.core.checks import check_int
from onnx_genrt.core.errors import InvalidInputError
from onnx_genrt.core.graph_slots import DeviceGraphSlot
from onnx_genrt.core.locking import SingleUser

from .decoder import DRAWN, HiddenState, PendingStep, StepOutput
from .device_sampler import SampleInputs, draws_on_device, sample_inputs
from .model import GeneratorParams, Model
from .sampling import choose, masked_logits, plain_greedy

Method = TypeVar("Method", bound=Callable[..., Any])


def one_thread(method: Method) -> Method:
    """A generator method that changes the sequence or runs the model: refused while another
    thread is inside this generator, and holding the model's session for the whole call
    (steps of other generators on the same model wait; see ``core.locking``)."""

    @functools.wraps(method)
    def guarded(self: Generator, *args: Any, **kwargs: Any) -> Any:
        with self._user, self.model.session.exclusive():
            return method(self, *args, **kwargs)

    return guarded  # type: ignore[return-value]


class Generator:
    """Holds one sequence. ``append_tokens`` feeds a prompt; ``generate_next_token`` adds one.

    The last token of the sequence is *pending*: chosen but not yet fed to the model. The KV
    cache therefore holds ``len(sequence) - 1`` positions between calls, and rewinding is
    a matter of lowering that length.

    Threads: a generator serves one thread at a time; a second thread that calls it while
    the first is inside gets ``ConcurrentUseError``. Generators of one shared ``Model`` may
    run in different threads: their steps take turns on the model's providers.
    """

    #: Queue the next greedy or device-drawn step before this one is read back: None
    #: (default) where the provider reads asynchronously (a GPU), True or False to force it.
    look_ahead: bool | None = None
    #: Prompts as graphed chunks of padded rows (True), eagerly (False), or where reads are
    #: asynchronous (None: a GPU). See ``DecoderRunner.prefill``.
    graph_prefill: bool | None = None
    #: Draw a search's tokens that sample by temperature and top-k on the device, as
    #: ``BatchGenerator.device_sampling`` does (the same rule, seed and offsets, so a seed
    #: gives the same tokens here as in a batch or from the server): None (default) where
    #: reads are asynchronous (a GPU), True or False to force it. The token after the prompt
    #: and those before ``min_length`` (an end masked) are drawn on the host, as in a batch.
    device_sampling: bool | None = None

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        """``Generator(model, params)`` with ``batch_size > 1`` in the search options: a
        generator of that many sequences (:class:`~onnx_genrt.engine.batch.SequencesGenerator`,
        the same calls)."""
        params = kwargs.get("params", args[1] if len(args) > 1 else None)
        search = getattr(params, "search", None)
        if search is not None and search.batch_size > 1:
            if cls is not Generator:
                raise InvalidInputError(
                    f"{cls.__name__} holds one sequence (batch_size "
                    f"{params.search.batch_size}); speculative decoding runs one at a time"
                )
            from .batch import SequencesGenerator

            return SequencesGenerator(args[0] if args else kwargs["model"], params)
        return super().__new__(cls)

    def __init__(self, model: Model, params: GeneratorParams, spare: int = 0) -> None:
        self._user = SingleUser("this Generator")
        self.model = model
        self.params = params
        self.search = params.search
        cfg = model.config
        self.runner = model.acquire_runner(self, self.search.max_length + spare)
        self.rng = np.random.default_rng(self.search.seed)
        #: The seed of the draws made on the device (``device_sampling``), as a batch row's.
        self.sample_seed = (
            self.search.seed
            if self.search.seed is not None
            else int(self.rng.integers(0, 2**63 - 1))
        )
        self.tokens: list[int] = []
        #: Tokens given by ``append_tokens`` up to its last call: the presence and frequency
        #: penalties count only what follows (the tokens generated since).
        self._prompt_end = 0
        # The step whose last row predicts the next token (None until the pending token is fed).
        self._next: StepOutput | None = None
        # The step and row whose hidden state predicted the pending token (for MTP).
        self._hidden_at: tuple[StepOutput, int] | None = None
        self._new: list[int] = []
        self.eos = set(cfg.eos_token_ids)
        self._closed = False
        # The next step, queued before this one was read back (see _may_look_ahead).
        self._ahead: PendingStep | None = None

    @one_thread
    def close(self) -> None:
        """Hand the KV cache back to the model's pool, so the next generation reuses it and
        the graphs captured on it. The sequence stays readable; stepping raises."""
        if not self._closed:
            self._cancel_ahead()
            self._closed = True
            self.model.release_runner(self)

    def __enter__(self) -> Generator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidInputError("this generator is closed; create a new one")

    # -- feeding -----------------------------------------------------------------
    @one_thread
    def append_tokens(self, ids: Sequence[int]) -> None:
        """Feed tokens (a prompt or a continuation); afterwards the next token can be picked."""
        self._check_open()
        ids = [check_int(t, f"token id {i}") for i, t in enumerate(ids)]
        if not ids:
            raise InvalidInputError("append_tokens needs at least one token")
        vocab = self.model.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidInputError(f"token ids {bad[:5]} are outside the vocabulary of {vocab}")
        total = len(self.tokens) + len(ids)
        if total > self.search.max_length:
            raise InvalidInputError(
                f"{total} tokens exceed max_length {self.search.max_length} "
                f"(context length {self.model.config.context_length})"
            )
        self._cancel_ahead()
        feed = self._take_pending() + ids
        self.tokens.extend(ids)
        self._prompt_end = len(self.tokens)
        self._run(feed)

    def _take_pending(self) -> list[int]:
        """The pending token, if the cache does not hold it yet."""
        if self.tokens and self.runner.cache.length == len(self.tokens) - 1:
            return [self.tokens[-1]]
        return []

    def _run(self, feed: list[int]) -> None:
        if len(feed) == 1:
            out, last = self.runner.forward(feed, DeviceGraphSlot.PRIMARY), 0
        else:
            out, last = self.runner.prefill(feed, self._graphed_prefill())
        self._next = out
        self._hidden_at = (out, last)

    def _graphed_prefill(self) -> bool:
        """Whether prompts run as graphed chunks (``DecoderRunner.prefill``): where reads
        are asynchronous (a GPU, whose eager dispatch costs more than a replay of padded
        rows) unless ``graph_prefill`` says otherwise, and never with graphs off."""
        return self.runner.io.auto(self.graph_prefill) and self.model.enable_graphs

    # -- stepping ----------------------------------------------------------------
    @one_thread
    def generate_next_token(self) -> None:
        self._check_open()
        if self.is_done():
            raise InvalidInputError("generation is done (eos or max_length reached)")
        if not self.tokens:
            raise InvalidInputError("append_tokens first: there is no prompt")
        if self._next is None:
            step, self._ahead = self._ahead, None  # queued last time, fed on the device
            if step is None:
                drawn = self._draws_on_device()
                after = self.runner.draw_after(self._sample_inputs()) if drawn else None
                step = self.runner.launch(
                    self._take_pending(), DeviceGraphSlot.PRIMARY, after=after
                )
            drawn = step.drawn is not None
            if self._may_look_ahead(drawn):
                # fed this step's token on the device, drawing the next one as this did
                after = self.runner.draw_after(self._sample_inputs(1)) if drawn else None
                self._ahead = self.runner.launch(
                    [0], DeviceGraphSlot.PRIMARY, after=after, feed_token_of=step
                )
            self._next = step.wait()
            self._hidden_at = (self._next, step.n - 1)
            if drawn:
                self._append(int(np.asarray(self._next.extra[DRAWN]).reshape(-1)[0]))
                if self._ahead is not None and self.is_done():
                    self._cancel_ahead()
                return
        out = self._next
        if self._ahead is not None and self._masks_argmax(out):
            # The queued step overwrote this step's logits, which the masked pick reads:
            # drop it and run this step again.
            self._cancel_ahead()
            self.runner.rewind_to(self.runner.cache.length - 1)
            out = self._next = self.runner.forward(self._take_pending(), DeviceGraphSlot.PRIMARY)
        token = self._choose(out, -1, self.tokens)
        self._append(token)
        if self._ahead is not None and (token != int(out.tokens[-1]) or self.is_done()):
            self._cancel_ahead()

    def _append(self, token: int) -> None:
        self.tokens.append(token)
        self._next = None
        self._new = [token]

    def _draws_on_device(self, ahead: int = 0) -> bool:
        """Whether the step ``ahead`` steps from now draws its token on the device
        (``device_sampling``): a search that samples by temperature and top-k only, free
        to end (past ``min_length``)."""
        length = len(self.tokens) + ahead
        wanted = self.runner.io.auto(self.device_sampling)
        return wanted and draws_on_device(self.search, self.eos, length)

    def _sample_inputs(self, ahead: int = 0) -> SampleInputs:
        """The one row's sampling inputs for the step ``ahead`` steps from now, as a batch
        row's: the token's index is ``len(tokens) + ahead``."""
        at = len(self.tokens) + ahead
        return sample_inputs(1, {0: (self.search, self.sample_seed, at)})

    def _may_look_ahead(self, drawn: bool) -> bool:
        """Whether to queue the next step (fed the token this step chose on the device)
        before reading this one back, on a provider whose reads are asynchronous, while
        another token will follow: plain greedy (fed the device argmax), or a step that
        drew its token on the device (``drawn``) followed by another that does. The queued
        step overwrites this step's buffers, which is fine as only its argmax or drawn
        token is read (see ``_masks_argmax`` for the exception)."""
        wanted = self.runner.io.auto(self.look_ahead)
        if drawn:
            chosen_on_device = self._draws_on_device(1)
        else:
            chosen_on_device = self._plain_greedy and self.runner.device_argmax
        if not wanted or not chosen_on_device:
            return False
        room = len(self.tokens) + 2 <= self.search.max_length
        return room and self.runner.cache.length + 1 <= self.runner.max_length

    def _masks_argmax(self, out: StepOutput) -> bool:
        """Whether the pick from ``out`` is not its argmax: an end-of-sequence argmax before
        ``min_length`` is masked, and the pick is made from the logits."""
        if not self.eos or len(self.tokens) >= self.search.min_length:
            return False
        return int(out.tokens[-1]) in self.eos

    def _cancel_ahead(self) -> None:
        """Drop the queued step: its position is rewound and later steps overwrite it."""
        step, self._ahead = self._ahead, None
        if step is not None:
            self.runner.rewind_to(step.start)

    @property
    def _plain_greedy(self) -> bool:
        return plain_greedy(self.search)

    def _choose(self, out: StepOutput, row: int, history: Sequence[int]) -> int:
        """Next token from one row: the device argmax when plain greedy, else from logits."""
        argmax = int(out.tokens[row]) if self._plain_greedy else None
        return choose(
            argmax,
            lambda: out.logits[row],
            history,
            self.search,
            self.eos,
            self.rng,
            self._prompt_end,
        )

    def row_logits(self, out: StepOutput, row: int, history: Sequence[int]) -> np.ndarray:
        """One row's logits after the repetition penalty and, before ``min_length``, with
        end-of-sequence tokens ruled out (as onnxruntime-genai does)."""
        return masked_logits(out.logits[row], history, self.search, self.eos, self._prompt_end)

    @property
    def _last_hidden(self) -> HiddenState | None:
        """The hidden state that predicted the pending token (left on the device)."""
        if self._hidden_at is None:
            return None
        out, row = self._hidden_at
        return out.hidden_state(row)

    def get_next_tokens(self) -> list[int]:
        """Tokens added by the last ``generate_next_token`` call."""
        return list(self._new)

    def is_done(self) -> bool:
        if not self.tokens:
            return False
        if len(self.tokens) >= self.search.max_length:
            return True
        return (
            bool(self._new)
            and self._new[-1] in self.eos
            and len(self.tokens) >= self.search.min_length
        )

    def get_sequence(self, index: int = 0) -> list[int]:
        if index != 0:
            raise IndexError("this generator holds a single sequence (index 0)")
        return list(self.tokens)

    @one_thread
    def rewind_to(self, length: int) -> None:
        """Keep the first ``length`` tokens; the next step recomputes from there."""
        self._check_open()
        self._cancel_ahead()
        length = check_int(length, "rewind length")
        if not 0 <= length <= len(self.tokens):
            raise InvalidInputError(
                f"cannot rewind to {length}: the sequence has {len(self.tokens)}"
            )
        self.tokens = self.tokens[:length]
        self._prompt_end = min(self._prompt_end, length)
        self.runner.rewind_to(min(self.runner.cache.length, max(length - 1, 0)))
        self._next = None
        self._hidden_at = None
        self._new = []

    def graph_stats(self) -> dict[str, dict]:
        return self.model.session.all_graph_stats()
