"""Speculative decoding: propose k drafts, verify them in one fixed-width step, keep the
longest agreeing prefix. The output equals plain decoding's (greedy) or follows the same
distribution (sampling, by the standard rejection rule).

Steps with drafts run the target at width ``k + 1`` (drafts padded) in slot ``VERIFY``;
steps without drafts run width 1 in slot ``PRIMARY``. Rejected drafts are rewound by
lowering the cache length: nothing is copied and no graph is reset.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from onnx_genrt.core.checks import check_int
from onnx_genrt.core.errors import InvalidInputError
from onnx_genrt.core.graph_slots import DeviceGraphSlot

from .config import SearchOptions
from .decoder import PendingStep
from .generator import Generator, one_thread
from .model import GeneratorParams, Model
from .proposers import Proposer
from .sampling import distribution, draw

#: Drafts per speculative step when neither the call nor the model's speculative.json says.
DEFAULT_K = 4


@dataclass
class SpeculationStats:
    verify_steps: int = 0
    plain_steps: int = 0
    proposed: int = 0
    accepted: int = 0
    accepted_lengths: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted(self) -> float:
        return float(np.mean(self.accepted_lengths)) if self.accepted_lengths else 0.0

    def as_dict(self) -> dict[str, float | int]:
        return {
            "verify_steps": self.verify_steps,
            "plain_steps": self.plain_steps,
            "proposed": self.proposed,
            "accepted": self.accepted,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted_length": round(self.mean_accepted, 3),
        }


class PayoffPolicy:
    """Speculate only while it pays: verify steps must add tokens faster than plain steps.

    Both rates come from the measured wall time of the last ``window`` steps of each kind
    (the tokens a step added over its time: one for a plain step of one sequence, one a row
    for a batch's). While
    speculating, a plain step now and then keeps the plain rate fresh; while not, a verify
    step now and then measures the drafts again (acceptance changes with the text). Each
    probe that confirms the choice doubles the gap to the next (from ``probe`` up to
    ``max_probe`` steps, staggered so probes do not keep landing on the same phase of a
    repetitive text); a switch starts again from ``probe``. Greedy output is the same
    either way; only the speed differs.
    """

    def __init__(
        self, window: int = 8, probe: int = 16, skip: int = 2, max_probe: int = 256
    ) -> None:
        """``skip``: the first steps of each kind not counted (their graphs are still
        being planned and captured, which would make that kind look slow)."""
        self.window, self.probe, self.max_probe = window, probe, max(probe, max_probe)
        self._skip = {True: skip, False: skip}
        self._plain: deque[tuple[int, float]] = deque(maxlen=window)
        self._verify: deque[tuple[int, float]] = deque(maxlen=window)
        self._since_switch = 0
        self._gap = probe  # steps until the next probe
        self._probing = False  # the step being taken is a probe
        self.probes = 0
        self.switches = 0

    @property
    def plain_rate(self) -> float | None:
        return _rate(self._plain)

    @property
    def verify_rate(self) -> float | None:
        return _rate(self._verify)

    def pays(self) -> bool | None:
        """Whether speculation is the faster of the two so far (None: not measured yet)."""
        plain, verify = self.plain_rate, self.verify_rate
        return None if plain is None or verify is None else verify >= plain

    def speculate(self) -> bool:
        """Whether the next step should verify drafts."""
        pays = self.pays()
        if pays is None:  # measure the kind with no sample yet (plain first)
            return self.plain_rate is not None
        self._since_switch += 1
        if self._since_switch >= self._gap:
            self._since_switch = 0
            self._probing = True
            self.probes += 1
            return not pays  # a probe of the other kind
        return pays

    def record(self, verified: bool, tokens: int, seconds: float) -> None:
        """A step's measured time and the tokens it added (a verify or a plain step)."""
        probing, self._probing = self._probing, False
        if seconds <= 0:
            return
        if self._skip[verified] > 0:
            self._skip[verified] -= 1
            return
        before = self.pays()
        (self._verify if verified else self._plain).append((tokens, seconds))
        if before is not None and self.pays() != before:
            self.switches += 1
            self._gap = self.probe
        elif probing:  # the probe confirmed the choice: probe half as often, staggered
            self._gap = min(2 * self._gap, self.max_probe) + self.probes % 3

    def as_dict(self) -> dict[str, float | int | bool | None]:
        plain, verify = self.plain_rate, self.verify_rate
        return {
            "plain_tok_s": round(plain, 1) if plain else None,
            "verify_tok_s": round(verify, 1) if verify else None,
            "speculation_pays": self.pays(),
            "switches": self.switches,
            "probes": self.probes,
        }


def _rate(steps: deque[tuple[int, float]]) -> float | None:
    """Tokens a second over ``steps`` of (tokens, seconds); None when there are none."""
    return sum(n for n, _ in steps) / sum(t for _, t in steps) if steps else None


class SpeculativeGenerator(Generator):
    """A Generator whose ``generate_next_token`` may add several tokens at once."""

    #: Sampled verify steps accept or redraw on the host (``_accept``), so its plain steps
    #: draw there too.
    device_sampling = False

    def __init__(
        self,
        model: Model,
        params: GeneratorParams,
        proposer: Proposer,
        k: int = DEFAULT_K,
        *,
        payoff: PayoffPolicy | None = None,
    ):
        """``payoff``: speculate only while it measurably pays (see :class:`PayoffPolicy`);
        None always speculates."""
        k = check_int(k, "k (drafts per speculative step)", minimum=1)
        super().__init__(model, params, spare=k)
        self.proposer = proposer
        self.k = k
        self.spec = SpeculationStats()
        self.payoff = payoff
        # Drafts the proposer already made on the device right after the last verify.
        self._chained: list[int] | None = None
        # The next verify, queued before the last one was read (its inputs written on the
        # device by the MTP chain); see _may_pipeline.
        self._queued: PendingStep | None = None
        self._hidden_stale = False
        if self._plain_greedy:  # the proposer's set-up now, not inside the first steps
            proposer.prepare(self.runner, k, self._pipelining)

    # Plain steps must keep their buffers (the MTP head reads the hidden row).
    look_ahead = False
    #: Queue the next verify step before this one is read back (greedy MTP): None (default)
    #: where the provider reads asynchronously (a GPU), True or False to force it.
    pipeline: bool | None = None

    @one_thread
    def close(self) -> None:
        self._queued = None
        super().close()
        self.proposer.close()

    @one_thread
    def generate_next_token(self) -> None:
        self._check_open()
        if self.is_done():
            super().generate_next_token()  # raises the usual error
        if not self.tokens:
            raise InvalidInputError("append_tokens first: there is no prompt")
        if self._next is not None:  # right after a prompt: its logits are ready
            return super().generate_next_token()
        started = time.perf_counter()
        verified = self._step()
        if self.payoff is not None:
            self.payoff.record(verified, len(self._new), time.perf_counter() - started)

    def _step(self) -> bool:
        """One verify step (True) or plain step (False)."""
        room = self.search.max_length - len(self.tokens) - 1
        fits = self.runner.cache.length + self.k + 1 <= self.runner.max_length
        k = min(self.k, room) if fits else 0
        chained, self._chained = self._chained, None
        queued, self._queued = self._queued, None
        if queued is not None:  # its inputs are the pending token and ``chained``
            self._verify(chained or [], queued)
            return True
        stale, self._hidden_stale = self._hidden_stale, False
        if k <= 0 or stale or (self.payoff is not None and not self.payoff.speculate()):
            drafts = []
        elif chained is not None:
            drafts = chained
        else:
            drafts = self.proposer.propose(self.tokens, self._last_hidden, k)
        drafts = drafts[:k]
        if not drafts:
            self.spec.plain_steps += 1
            super().generate_next_token()
            return False
        self._verify(drafts)
        return True

    def _verify(self, drafts: list[int], queued: PendingStep | None = None) -> None:
        pending = self.tokens[-1]
        start = self.runner.cache.length
        chain_hook = self.proposer.chain_hook if self._plain_greedy else None
        if queued is not None:  # fed on the device from [pending, *drafts]
            self.runner.cache.length = start + 1 + len(drafts)
            step = queued
        else:
            hook = (
                chain_hook(self.runner, self.k, len(drafts), start, self._pipelining)
                if chain_hook
                else None
            )
            step = self.runner.launch(
                [pending, *drafts], DeviceGraphSlot.VERIFY, width=self.k + 1, after=hook
            )
        if chain_hook is not None and self._may_pipeline():
            hook = chain_hook(self.runner, self.k, None, None, True)
            if hook is not None:
                self._queued = self.runner.launch(
                    None, DeviceGraphSlot.VERIFY, width=self.k + 1, after=hook
                )
        out = step.wait()
        if self._queued is not None and self._masks_a_row(out, len(drafts)):
            # The queued step overwrote this one's logits, which a masked pick reads.
            self._queued = None  # it runs first (same stream); the rerun then overwrites
            self.runner.rewind_to(start)
            hook = chain_hook(self.runner, self.k, len(drafts), start, True)
            out = self.runner.forward(
                [pending, *drafts], DeviceGraphSlot.VERIFY, width=self.k + 1, after=hook
            )
        history = list(self.tokens)
        new: list[int] = []
        accepted = 0
        greedy_tokens = out.tokens if self._plain_greedy else None
        for i in range(len(drafts) + 1):
            draft = drafts[i] if i < len(drafts) else None
            if greedy_tokens is not None:  # k+1 ids read back; acceptance is a compare
                token = self._choose(out, i, history)
                ok = draft is not None and draft == token
            else:
                logits = self.row_logits(out, i, history)
                token, ok = accept_draft(logits, draft, self.search, self.rng)
            new.append(token)
            history.append(token)
            if not ok or token in self.eos:
                break
            accepted += 1
        accepted = min(accepted, len(drafts))
        # Positions pending..pending+accepted are valid; the rest is rewound.
        self.runner.rewind_to(start + 1 + accepted)
        self._hidden_at = (out, accepted)
        room = self.search.max_length - len(self.tokens)
        new = new[:room]
        self.tokens.extend(new)
        self._new = new
        self._next = None
        self.spec.verify_steps += 1
        self.spec.proposed += len(drafts)
        self.spec.accepted += accepted
        self.spec.accepted_lengths.append(accepted)
        if out.extra:
            self._take_chained(out, accepted, new)
        if self._queued is not None and (self._chained is None or self.is_done()):
            # It runs on past the length (later steps overwrite that), but it rewrites this
            # step's hidden states, so the next proposal waits for a plain step's.
            self._queued = None
            self._hidden_stale = True

    def _may_pipeline(self) -> bool:
        """Whether to queue the next verify before reading this one: on an asynchronous
        provider, while two more full steps surely fit."""
        room = 2 * (self.k + 1)
        return (
            self._pipelining
            and len(self.tokens) + room <= self.search.max_length
            and self.runner.cache.length + room <= self.runner.max_length
        )

    @property
    def _pipelining(self) -> bool:
        """Whether this generator pipelines verify steps at all (see ``pipeline``)."""
        return self.runner.io.auto(self.pipeline)

    def _masks_a_row(self, out, n_drafts: int) -> bool:
        """Whether some row's pick may differ from its argmax (end-of-sequence masked before
        ``min_length``), so the host would read that row's logits."""
        if not self.eos:
            return False
        rows = out.tokens[: n_drafts + 1].tolist()
        return any(
            t in self.eos and len(self.tokens) + i < self.search.min_length
            for i, t in enumerate(rows)
        )

    def _take_chained(self, out, accepted: int, new: list[int]) -> None:
        """Keep the drafts chained on the device when they continue from what was emitted:
        the device counted the same acceptance and the new pending token is its argmax."""
        device_accepted = int(out.extra["accepted"].reshape(-1)[0])
        same = device_accepted == accepted and len(new) == accepted + 1
        if same and new[-1] == int(out.tokens[accepted]):
            self._chained = self.proposer.confident(
                out.extra["drafts"].reshape(-1), out.extra["confidences"].reshape(-1)
            )

    @one_thread
    def append_tokens(self, ids) -> None:
        self._chained = None
        self._queued = None
        super().append_tokens(ids)

    @one_thread
    def rewind_to(self, length: int) -> None:
        self._chained = None
        self._queued = None
        super().rewind_to(length)


def accept_draft(
    logits: np.ndarray, draft: int | None, search: SearchOptions, rng: np.random.Generator
) -> tuple[int, bool]:
    """(token to emit, whether it was the draft) for one position's ``logits``. Greedy:
    the argmax, the draft kept when it is that.

    Sampling with a deterministic draft q = onehot(d): accept d with probability p(d);
    otherwise sample from p with d removed and renormalised. This keeps the target
    distribution exactly.
    """
    if not search.do_sample:
        target = int(np.argmax(logits))
        return target, draft is not None and draft == target
    p = distribution(logits, search)
    if draft is None:
        return draw(p, rng), False
    if rng.random() < p[draft]:
        return draft, True
    residual = p.copy()
    residual[draft] = 0.0
    total = residual.sum()
    if total <= 0.0:
        return draft, True
    residual /= total
    return draw(residual, rng), False
