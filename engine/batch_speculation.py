"""Speculation per row of a batch: each row proposes tokens that continue its own text
(prompt lookup), or the model's MTP head proposes for every row in one run of its chain,
and one step of ``k + 1`` tokens a row verifies every row's drafts.

A greedy row keeps the longest prefix of its drafts that its own argmax agrees with, and
the argmax after it: what plain greedy steps would give, token for token. Any other row
(sampling, a repetition penalty, an end of sequence masked before ``min_length``) goes
through its drafts with the standard rejection rule on its logits (:func:`accept_draft`),
which keeps its distribution. Rows without drafts feed padding and keep one token, as a
plain step would have given them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from onnx_genrt.core.checks import check_int
from onnx_genrt.core.errors import InvalidInputError

from .config import SearchOptions
from .proposers import MTPProposer, PromptLookupProposer
from .sampling import masked_logits
from .speculative import DEFAULT_K, PayoffPolicy, accept_draft

if TYPE_CHECKING:
    from .model import Model

#: What a batch can speculate with: prompt lookup (``"ngram"``), the model's MTP head
#: (``"mtp"``), always; or the MTP head where the model has one, else prompt lookup, while it
#: measurably pays (``"auto"``). A draft model runs one sequence.
BATCH_SPEC_KINDS = ("ngram", "mtp", "auto")


def check_batch_spec(spec: str | None, k: int | None) -> None:
    """Refuse a kind a batch cannot speculate with, a bad ``k``, or ``k`` without a kind."""
    if spec is None:
        if k is not None:
            raise InvalidInputError(
                f"k={k!r} needs a speculation kind ({', '.join(repr(s) for s in BATCH_SPEC_KINDS)})"
            )
        return
    if spec not in BATCH_SPEC_KINDS:
        raise InvalidInputError(
            f"a batch speculates by prompt lookup or an MTP head: spec={spec!r}; choose one "
            f"of {', '.join(repr(s) for s in BATCH_SPEC_KINDS)}, or generate one sequence at "
            "a time to use a draft model"
        )
    if k is not None:
        check_int(k, "k (drafts per row)", minimum=1)


def row_speculation(model: Model, spec: str, k: int | None = None) -> RowSpeculation:
    """The speculation of ``model``'s batches for ``spec`` (see :data:`BATCH_SPEC_KINDS`):
    ``k`` by default from the model's speculative.json (else 4), the MTP head's chain shared
    with the model's single-sequence generators."""
    from .api import default_k, make_proposer  # the API builds on batches: imported on use

    check_batch_spec(spec, k)
    kind = spec
    if spec == "auto":
        kind = "mtp" if model.config.speculative.get("mtp") else "ngram"
    mtp = make_proposer(model, "mtp", model.config.context_length) if kind == "mtp" else None
    assert mtp is None or isinstance(mtp, MTPProposer)
    return RowSpeculation(spec, default_k(model, kind, k), mtp)


class RowSpeculation:
    """The drafts, acceptance and statistics of a batch's speculative steps: ``mtp`` (an
    :class:`MTPProposer`) proposes for every row at once, else each row looks up its own
    text."""

    def __init__(self, spec: str, k: int | None = None, mtp: MTPProposer | None = None) -> None:
        check_batch_spec(spec, k)
        if spec == "mtp" and mtp is None:
            raise InvalidInputError("spec='mtp' needs the model's MTP head (row_speculation)")
        self.spec = spec
        self.k = DEFAULT_K if k is None else k
        self.mtp = mtp
        #: None but for ``"auto"``: every eligible step verifies.
        self.payoff = PayoffPolicy() if spec == "auto" else None
        #: Counts since :meth:`BatchGenerator.speculate`: steps of each kind, drafts proposed
        #: and kept, rows that had drafts in a verify step (a server runs for days: no
        #: per-step history is kept).
        self.verify_steps = self.plain_steps = 0
        self.proposed = self.accepted = self.drafting_rows = 0
        self._proposers: dict[int, PromptLookupProposer] = {}

    @property
    def width(self) -> int:
        """Tokens a row feeds in a verify step: its pending token and ``k`` drafts."""
        return self.k + 1

    def wanted(self) -> bool:
        """Whether the next eligible step should verify drafts."""
        return self.payoff is None or self.payoff.speculate()

    @property
    def needs_hidden(self) -> bool:
        """Whether drafts come from the hidden states (every step reads them back)."""
        return self.mtp is not None

    def drafts(
        self, rows: Sequence[tuple[int, Sequence[int], int, np.ndarray | None]]
    ) -> dict[int, list[int]]:
        """Each row's drafts, at most ``min(k, room)``, from its (index, tokens, room,
        hidden state that predicted its last token). The MTP head runs once for the rows
        with room and a hidden state; prompt lookup continues each row's own text."""
        out: dict[int, list[int]] = {index: [] for index, *_ in rows}
        ready = [r for r in rows if r[2] > 0 and (self.mtp is None or r[3] is not None)]
        if self.mtp is None:
            for index, tokens, room, _ in ready:
                proposer = self._proposers.get(index)
                if proposer is None:
                    proposer = self._proposers[index] = PromptLookupProposer()
                out[index] = proposer.propose(tokens, None, min(self.k, room))
        elif ready:
            # padded to a power of two rows: a few chain graphs serve any number of rows
            size = 1 << (len(ready) - 1).bit_length()
            hidden = np.zeros((size, *np.shape(ready[0][3])), np.asarray(ready[0][3]).dtype)
            hidden[: len(ready)] = [r[3] for r in ready]
            last = np.zeros(size, np.int64)
            last[: len(ready)] = [r[1][-1] for r in ready]
            proposed = self.mtp.propose_rows(hidden, last, self.k)
            for (index, _, room, _), drafts in zip(ready, proposed, strict=False):
                out[index] = drafts[:room]
        return out

    def accept(self, drafts: list[int], argmax: np.ndarray) -> list[int]:
        """The tokens a plain-greedy row keeps: its drafts while they equal the argmax before
        them, then the argmax after the last one kept."""
        n = 0
        while n < len(drafts) and drafts[n] == int(argmax[n]):
            n += 1
        self._count(drafts, n)
        return [int(t) for t in argmax[: n + 1]]

    def accept_by_logits(
        self,
        drafts: list[int],
        logits: np.ndarray,
        history: Sequence[int],
        search: SearchOptions,
        eos: set[int],
        rng: np.random.Generator,
        prompt_length: int = 0,
    ) -> list[int]:
        """The tokens any other row keeps, from its verify logits ``[k + 1, vocab]``: at each
        position the logits after the penalties and ``min_length`` mask of the text so far
        (the generated tokens begin at ``prompt_length``), the draft accepted or replaced by
        :func:`accept_draft`; it stops after the first replaced draft or end of sequence."""
        text = list(history)
        kept: list[int] = []
        accepted = 0
        for j in range(len(drafts) + 1):
            draft = drafts[j] if j < len(drafts) else None
            token, ok = accept_draft(
                masked_logits(logits[j], text, search, eos, prompt_length), draft, search, rng
            )
            kept.append(token)
            text.append(token)
            accepted += ok
            if not ok or token in eos:
                break
        self._count(drafts, accepted)
        return kept

    def _count(self, drafts: list[int], accepted: int) -> None:
        self.proposed += len(drafts)
        self.accepted += accepted
        self.drafting_rows += bool(drafts)

    def record(self, verified: bool, tokens: int, seconds: float) -> None:
        """A step's time and the tokens it added over all rows (for ``"auto"``)."""
        if verified:
            self.verify_steps += 1
        else:
            self.plain_steps += 1
        if self.payoff is not None:
            self.payoff.record(verified, tokens, seconds)

    def as_dict(self) -> dict:
        """The counts, with the shares the single-sequence statistics also give."""
        out = {
            "kind": self.spec,
            "k": self.k,
            "verify_steps": self.verify_steps,
            "plain_steps": self.plain_steps,
            "proposed": self.proposed,
            "accepted": self.accepted,
            "acceptance_rate": round(self.accepted / self.proposed, 4) if self.proposed else 0.0,
            "mean_accepted_length": (
                round(self.accepted / self.drafting_rows, 3) if self.drafting_rows else 0.0
            ),
        }
        if self.payoff is not None:
            out["auto"] = self.payoff.as_dict()
        return out
