"""Draft proposers for speculative decoding: prompt lookup, a draft model, an MTP head."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from onnx_genrt.core.dtypes import DType
from onnx_genrt.core.errors import InvalidInputError, ModelLoadError
from onnx_genrt.core.graph_slots import DeviceGraphSlot
from onnx_genrt.session import InferenceSession
from onnx_genrt.session.device_io import DeviceIO

from .decoder import HiddenState, StepBuffers
from .model import Model
from .mtp_chain import (
    ACCEPTED,
    CONFIDENCES,
    DRAFT_COUNT,
    DRAFTS,
    NEXT_COUNT,
    NEXT_IDS,
    NEXT_MASK,
    NEXT_POSITIONS,
    NEXT_START,
    VERIFY_ARGMAX,
    VERIFY_HIDDEN,
    VERIFY_IDS,
    VERIFY_START,
    after_verify,
    unroll_mtp_head,
    with_next_inputs,
)

if TYPE_CHECKING:  # onnx is imported when a model is read, not with the engine
    import onnx


def _confidence(logits: np.ndarray) -> tuple[int, float]:
    """Argmax token and its softmax probability."""
    x = np.asarray(logits, dtype=np.float64)
    top = int(np.argmax(x))
    p = 1.0 / np.exp(x - x[top]).sum()
    return top, float(p)


class Proposer(ABC):
    """Proposes up to ``k`` tokens to follow ``tokens`` (whose last token is pending)."""

    name: str = ""

    @abstractmethod
    def propose(self, tokens: Sequence[int], hidden: HiddenState | None, k: int) -> list[int]:
        """Drafts; ``hidden`` is the target's hidden state that predicted the pending token."""

    def graph_stats(self) -> dict[str, dict]:
        return {}

    def prepare(self, runner: Any, k: int, pipelined: bool) -> None:
        """Build what drafting ``k`` tokens for ``runner``'s model needs (sessions, chained
        graphs) before the first step, so a generation's decode time holds no set-up.
        ``pipelined``: verify steps will be queued back to back (the chain that writes the
        next inputs is the one built). Default: nothing to build."""

    def close(self) -> None:
        """Release what this proposer holds for one generation (a draft model's KV cache)."""

    def chain_hook(
        self,
        runner: Any,
        k: int,
        n_drafts: int | None,
        start: int | None = None,
        next_inputs: bool | None = None,
    ) -> Callable[[StepBuffers], dict[str, Any]] | None:
        """A call that drafts on the device right after a verify step of width ``k + 1``
        (see :meth:`MTPProposer.chain_hook`); None, the default, drafts on the host."""
        return None

    def confident(self, drafts: np.ndarray, confs: np.ndarray) -> list[int]:
        """Drafts made by :meth:`chain_hook` that the proposer keeps (default: all)."""
        return [int(t) for t in drafts.tolist()]


class PromptLookupProposer(Proposer):
    """n-gram lookup: continue the longest recent suffix that already occurred in the text.

    For each n it keeps the last start of every n-gram that lies before the text's last
    token, updated as the text grows (a text that is not the last one extended is indexed
    again), so a proposal is a few dictionary lookups, not a scan of the text."""

    name = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self._text: list[int] = []
        self._last: dict[int, dict[tuple[int, ...], int]] = {}

    def propose(self, tokens: Sequence[int], hidden: HiddenState | None, k: int) -> list[int]:
        text = self._index(tokens.tolist() if isinstance(tokens, np.ndarray) else tokens)
        n_tokens = len(text)
        for n in range(min(self.max_ngram, n_tokens - 1), self.min_ngram - 1, -1):
            start = self._last[n].get(tuple(text[n_tokens - n :]))
            if start is not None:
                return text[start + n : start + n + k]
        return []

    def _index(self, tokens: Sequence[int]) -> list[int]:
        """The text of ``tokens`` with its n-grams before its last token indexed: only the
        new ones when ``tokens`` extends the text indexed last (else all again)."""
        done = len(self._text)
        if done > len(tokens) or tokens[:done] != self._text:
            self._last, self._text, done = {}, [], 0
        text = self._text
        text.extend(int(t) for t in tokens[done:])
        for n in range(self.min_ngram, self.max_ngram + 1):
            last = self._last.setdefault(n, {})
            # windows text[i : i + n] with i + n <= len(text) - 1 not indexed yet
            for i in range(max(0, done - n), len(text) - n):
                last[tuple(text[i : i + n])] = i
        return text


class DraftModelProposer(Proposer):
    """A smaller model with the same tokenizer, kept in step with the accepted text.

    Catching up on accepted tokens runs at a fixed width ``k + 1`` (padded) in the draft
    session's ``VERIFY`` slot; each further draft token runs at width 1 in ``DRAFT``.
    """

    name = "draft"

    def __init__(self, model: Model, max_length: int, min_confidence: float = 0.0) -> None:
        self.model = model
        self.runner = model.acquire_runner(self, max_length)
        self.fed: list[int] = []
        self.min_confidence = min_confidence
        self._logits: np.ndarray | None = None
        self._width = 0

    def close(self) -> None:
        self.model.release_runner(self)

    def propose(self, tokens: Sequence[int], hidden: HiddenState | None, k: int) -> list[int]:
        tokens = list(tokens)
        common = 0
        limit = min(len(self.fed), len(tokens))
        while common < limit and self.fed[common] == tokens[common]:
            common += 1
        if common == len(tokens) and (common < len(self.fed) or self._logits is None):
            common -= 1  # re-feed the last token to get its logits back
        self.runner.rewind_to(common)
        self.fed = tokens[:common]
        todo = tokens[common:]
        # One catch-up width for the whole generation (k shrinks near max_length, and a new
        # width would be a new binding: a VERIFY graph captured again).
        self._width = max(self._width, k + 1)
        width = self._width
        if common + width > self.runner.max_length:
            width = k + 1
        if len(tokens) + k > self.runner.max_length:
            return []
        if len(todo) > width:  # a prompt: one eager prefill
            self._logits = self.runner.forward(todo, None).logits[-1]
        elif todo:  # accepted tokens since the last call: fixed width, graphed
            self._logits = self.runner.forward(todo, DeviceGraphSlot.VERIFY, width).logits[-1]
        self.fed.extend(todo)
        if self._logits is None:
            return []
        logits = self._logits
        drafts: list[int] = []
        for i in range(k):
            token, p = _confidence(logits)
            if p < self.min_confidence:
                break
            drafts.append(token)
            if i == k - 1 or len(self.fed) + 1 > self.runner.max_length:
                break
            logits = self.runner.forward([token], DeviceGraphSlot.DRAFT).logits[-1]
            self.fed.append(token)
            self._logits = logits
        return drafts

    def graph_stats(self) -> dict[str, dict]:
        return self.model.session.all_graph_stats()


class MTPProposer(Proposer):
    """A multi-token-prediction head: from the target's hidden state at t and token t+1,
    predict t+2; chained by feeding back its own hidden state and its draft.

    The head is unrolled ``k`` times into one graph (see ``mtp_chain``), which runs in the
    ``DRAFT`` slot: one replay per speculative step, 2k numbers read back. Drafts stop at the
    first one whose probability is below ``min_confidence``.
    """

    name = "mtp"

    def __init__(
        self,
        head: onnx.ModelProto,
        make_session: Callable[[onnx.ModelProto], InferenceSession],
        names: dict[str, str] | None = None,
        min_confidence: float = 0.0,
        draft_ids: np.ndarray | None = None,
    ) -> None:
        self.head = head
        self.make_session = make_session
        self.names = names or {}
        self.min_confidence = min_confidence
        self.draft_ids = draft_ids  # token id per logit column of a ranked draft vocabulary
        self._chains: dict[int, tuple[InferenceSession, Any, Any, Any, Any]] = {}
        #: Bindings of a chain for several rows at once: (chain k, rows) -> buffers.
        self._row_bindings: dict[tuple[int, int], tuple[Any, Any, Any, Any, Any]] = {}
        self._after: dict[tuple[int, int], Any] = {}
        self._after_sessions: list[InferenceSession] = []

    def _chain(self, k: int):
        """The chain for up to ``k`` drafts; a longer one already built serves shorter asks."""
        longer = [size for size in self._chains if size >= k]
        if longer:
            return self._chains[min(longer)]
        if k not in self._chains:
            model = unroll_mtp_head(self.head, k, draft_ids=self.draft_ids, **self.names)
            session = self.make_session(model)
            hidden_name = self.names.get("hidden_input", "hidden_states")
            hidden_size = int(session.input_spec(hidden_name).shape[-1])
            b = session.io_binding()
            hidden = b.bind_input(hidden_name, np.zeros((1, 1, hidden_size), np.float32))
            ids = b.bind_input(self.names.get("ids_input", "input_ids"), np.zeros((1, 1), np.int64))
            drafts = b.bind_output(DRAFTS, shape=(1, k), dtype=np.int64)
            confs = b.bind_output(CONFIDENCES, shape=(1, k), dtype=np.float32)
            self._chains[k] = (session, b, hidden, ids, (drafts, confs))
        return self._chains[k]

    def propose(self, tokens: Sequence[int], hidden: HiddenState | None, k: int) -> list[int]:
        if hidden is None:
            raise ModelLoadError("the MTP proposer needs the target model's hidden states output")
        session, binding, hidden_buf, ids_buf, (drafts_buf, confs_buf) = self._chain(k)
        io = session.device_io
        self._feed_hidden(io, hidden, hidden_buf)
        io.write(ids_buf, np.array([[int(tokens[-1])]], np.int64))
        session.run_with_iobinding(binding, DeviceGraphSlot.DRAFT)
        drafts, confs = io.read([drafts_buf, confs_buf])
        return self.confident(drafts[0, :k], confs[0, :k])

    def propose_rows(self, hidden: np.ndarray, last: np.ndarray, k: int) -> list[list[int]]:
        """Drafts for several sequences at once (a batch's rows): ``hidden`` ``[rows, H]``
        (the target's hidden state that predicted each row's last token), ``last``
        ``[rows]`` (those tokens). One run of the chain over all rows (slot DRAFT, a graph
        per row count); each row's drafts stop at its first below ``min_confidence``."""
        self._chain(k)
        size = min(s for s in self._chains if s >= k)
        session = self._chains[size][0]
        rows = len(last)
        bound = self._row_bindings.get((size, rows))
        if bound is None:
            hidden_name = self.names.get("hidden_input", "hidden_states")
            spec = session.input_spec(hidden_name)
            b = session.io_binding()
            h = b.bind_input(
                hidden_name, np.zeros((rows, 1, int(spec.shape[-1])), spec.dtype or np.float32)
            )
            ids = b.bind_input(
                self.names.get("ids_input", "input_ids"), np.zeros((rows, 1), np.int64)
            )
            drafts = b.bind_output(DRAFTS, shape=(rows, size), dtype=np.int64)
            confs = b.bind_output(CONFIDENCES, shape=(rows, size), dtype=np.float32)
            bound = self._row_bindings[size, rows] = (b, h, ids, drafts, confs)
        binding, h, ids, drafts_buf, confs_buf = bound
        io = session.device_io
        io.write(h, np.asarray(hidden, dtype=h.dtype).reshape(h.shape))
        io.write(ids, np.asarray(last, np.int64).reshape(rows, 1))
        session.run_with_iobinding(binding, DeviceGraphSlot.DRAFT, variant=rows)
        drafts, confs = io.read([drafts_buf, confs_buf])
        return [self.confident(drafts[r, :k], confs[r, :k]) for r in range(rows)]

    def prepare(self, runner: Any, k: int, pipelined: bool) -> None:
        """Build the head's chain for ``k`` drafts and the chain that runs after a verify
        step of ``runner`` (sessions and their bindings; graphs capture on first use)."""
        self._chain(k)
        self.chain_hook(runner, k, 0, 0, pipelined)

    def confident(self, drafts: np.ndarray, confs: np.ndarray) -> list[int]:
        """The drafts up to the first one below ``min_confidence``."""
        out: list[int] = []
        for token, p in zip(drafts.tolist(), confs.tolist(), strict=True):
            if p < self.min_confidence:
                break
            out.append(int(token))
        return out

    def chain_hook(
        self,
        runner: Any,
        k: int,
        n_drafts: int | None,
        start: int | None = None,
        next_inputs: bool | None = None,
    ) -> Callable[[StepBuffers], dict[str, Any]] | None:
        """For ``runner.forward(..., after=hook)`` on a verify step of width ``k + 1``: runs
        the chain on that step's outputs on the device (``mtp_chain.after_verify``), on the
        target's own provider and stream, so the verify and the next drafts come back in one
        read. The chain also writes the next verify's inputs into the runner's buffers
        (``mtp_chain.with_next_inputs``), so that step can be queued before this one is read.

        ``n_drafts`` and ``start`` (the verify's first position) are uploaded for a step
        whose inputs the host wrote; both None means the inputs came from the previous
        chain on the device. ``next_inputs`` (default: where the provider reads
        asynchronously, i.e. where steps are pipelined) chooses the graph that writes the next
        step's inputs; without it the chain skips that work. None when the runner has no
        hidden-states or argmax outputs.
        """
        if next_inputs is None:
            next_inputs = runner.io.reads_async
        if n_drafts is None and not next_inputs:
            raise InvalidInputError("a verify step fed on the device needs the chain's next inputs")
        key = (id(runner), k, bool(next_inputs))
        if key not in self._after:
            bufs = runner.step_buffers(k + 1)
            if bufs.hidden is None or bufs.argmax is None:
                self._after[key] = None
            else:
                self._after[key] = self._build_after(runner, bufs, k, bool(next_inputs))
        built = self._after[key]
        if built is None:
            return None
        session, binding, control, outs = built
        io = session.device_io
        host = None
        if n_drafts is not None:
            if start is None:
                raise InvalidInputError("a host-fed verify step needs its start position")
            host = np.array([n_drafts, start], np.int64)

        def hook(_bufs: StepBuffers) -> dict[str, Any]:
            if host is not None:
                io.write(control, host)
            session.run_with_iobinding(binding, DeviceGraphSlot.DRAFT)
            return outs

        return hook

    def _build_after(self, runner: Any, bufs: StepBuffers, k: int, next_inputs: bool):
        names = {n: v for n, v in self.names.items()}
        chain = unroll_mtp_head(self.head, k, draft_ids=self.draft_ids, **names)
        hidden_type = DType.from_numpy(bufs.hidden.dtype).value
        ids_input = names.get("ids_input", "input_ids")
        model = after_verify(
            chain,
            k,
            names.get("hidden_input", "hidden_states"),
            ids_input,
            verify_hidden_type=hidden_type,
        )
        if next_inputs:
            mask_length = int(bufs.mask.shape[-1]) if bufs.mask is not None else None
            model = with_next_inputs(
                model, k, self.min_confidence, mask_length, bufs.pos is not None, ids_input
            )
        session = runner.session.sibling(model)
        b = session.io_binding()
        b.bind_input(VERIFY_IDS, bufs.ids)
        b.bind_input(VERIFY_ARGMAX, bufs.argmax)
        b.bind_input(VERIFY_HIDDEN, bufs.hidden)
        # [draft count, verify start]: uploaded together by a host-fed step, advanced in
        # place by the chain (inputs and outputs share the buffers, like a KV cache).
        control = runner.io.upload(np.zeros(2, np.int64))
        count, start = control[0:1], control[1:2]
        b.bind_input(DRAFT_COUNT, count)
        if next_inputs:
            b.bind_input(VERIFY_START, start)
            b.bind_output(NEXT_COUNT, count)
            b.bind_output(NEXT_START, start)
            b.bind_output(NEXT_IDS, bufs.ids)
            if bufs.pos is not None:
                b.bind_output(NEXT_POSITIONS, bufs.pos)
            if bufs.mask is not None:
                b.bind_output(NEXT_MASK, bufs.mask)
        outs = {
            "drafts": b.bind_output(DRAFTS, shape=(1, k), dtype=np.int64),
            "confidences": b.bind_output(CONFIDENCES, shape=(1, k), dtype=np.float32),
            "accepted": b.bind_output(ACCEPTED, shape=(1,), dtype=np.int64),
        }
        self._after_sessions.append(session)
        return session, b, control, outs

    @staticmethod
    def _feed_hidden(io: DeviceIO, hidden: HiddenState | np.ndarray, dst: Any) -> None:
        """The target's hidden row into the chain's input: device to device when the
        chain's device holds it and the dtypes match, else through the host."""
        if isinstance(hidden, HiddenState):
            src = hidden.device_row()
            if io.holds(src) and src.dtype == dst.dtype and src.size == dst.size:
                # The target's step was read back already, so its output is complete.
                io.copy(src.reshape(dst.shape), dst)
                return
            hidden = hidden.numpy()
        io.write(dst, np.asarray(hidden, dtype=dst.dtype).reshape(dst.shape))

    def graph_stats(self) -> dict[str, dict]:
        stats: dict[str, dict] = {}
        for k, (session, *_rest) in self._chains.items():
            for slot, st in session.all_graph_stats().items():
                stats[slot if len(self._chains) == 1 else f"{slot}(k={k})"] = st
        for i, session in enumerate(self._after_sessions):
            for slot, st in session.all_graph_stats().items():
                stats[f"{slot}(after verify{'' if i == 0 else i})"] = st
        return stats
