"""Graph variants of one slot, and slot resets, in ``session.slot_runner`` (found by a
mutation run: no session test used more than one variant, and resetting a whole slot with
several variants had no test). Every output is checked against numpy float64."""

from __future__ import annotations

import numpy as np

from onnx_genrt.core.graph_slots import DeviceGraphSlot
from onnx_genrt.providers.cpu.provider import CPUProvider
from onnx_genrt.session import InferenceSession
from onnx_genrt.session.slot_runner import VARIANT_PARTS

from ..models import mlp, mlp_reference

PRIMARY, VERIFY = DeviceGraphSlot.PRIMARY, DeviceGraphSlot.VERIFY
HIDDEN = 8


def _bind(sess: InferenceSession, rows: int):
    binding = sess.io_binding()
    x = binding.bind_input("x", np.zeros((rows, HIDDEN), np.float32))
    y = binding.bind_output("y", shape=(rows, HIDDEN))
    return binding, x, y


def _step(sess, model, bound, rng, slot=PRIMARY, variant=0) -> None:
    """One bound run on new inputs; the output must equal numpy's."""
    binding, x, y = bound
    x[...] = rng.standard_normal(x.shape)
    y[...] = np.nan
    sess.run_with_iobinding(binding, slot, variant)
    np.testing.assert_allclose(y, mlp_reference(model, x), rtol=1e-5, atol=1e-5)


def _two_variants(rounds: int = 4):
    """A session whose PRIMARY slot holds variant 0 (one row), planned, captured and
    replayed once alone, then variant 1 (three rows) beside it: ``rounds`` runs of each,
    taking turns (variant 1's first two plan and capture)."""
    model = mlp(hidden=HIDDEN, seed=4)
    sess = InferenceSession(model, providers=["cpu"])
    one, three = _bind(sess, 1), _bind(sess, 3)
    rng = np.random.default_rng(0)
    for _ in range(3):
        _step(sess, model, one, rng, variant=0)
    for _ in range(rounds):
        _step(sess, model, one, rng, variant=0)
        _step(sess, model, three, rng, variant=1)
    return model, sess, one, three, rng


def test_variants_of_a_slot_keep_their_own_graphs_side_by_side():
    """Variant 1's first runs (and its capture) leave variant 0's graph replaying; each
    variant's parts are numbered from ``variant * VARIANT_PARTS``."""
    model, sess, one, three, rng = _two_variants(rounds=6)
    stats = sess.graph_stats(PRIMARY)
    assert (stats.captures, stats.replays, stats.invalidations) == (2, 7 + 4, 0), stats
    assert sess.executor.slots.variants(PRIMARY) == [0, 1]
    assert sess.executor.slots.variants(VERIFY) == []
    assert sess.main_provider.graph_parts(PRIMARY) == {0, VARIANT_PARTS}


def test_a_new_signature_in_one_variant_drops_only_that_variants_graph():
    model, sess, one, three, rng = _two_variants()
    provider = sess.main_provider
    binding, _, y = one
    x = binding.bind_input("x", np.zeros((1, HIDDEN), np.float32))  # a new buffer
    one = (binding, x, y)
    _step(sess, model, one, rng, variant=0)  # plans again, eagerly
    assert provider.graph_parts(PRIMARY) == {VARIANT_PARTS}  # variant 0's part is gone
    assert sess.executor.slots.variants(PRIMARY) == [1]
    replays = sess.graph_stats(PRIMARY).replays
    _step(sess, model, three, rng, variant=1)  # still replays its own graph
    assert sess.graph_stats(PRIMARY).replays == replays + 1
    for _ in range(3):
        _step(sess, model, one, rng, variant=0)
        _step(sess, model, three, rng, variant=1)
    stats = sess.graph_stats(PRIMARY)
    assert (stats.captures, stats.invalidations) == (3, 1), stats
    assert provider.graph_parts(PRIMARY) == {0, VARIANT_PARTS}


def test_resetting_a_slot_drops_every_variant_and_leaves_other_slots():
    model, sess, one, three, rng = _two_variants()
    verify = _bind(sess, 2)
    for _ in range(3):
        _step(sess, model, verify, rng, slot=VERIFY)
    provider = sess.main_provider
    sess.executor.reset_slot(PRIMARY)
    assert provider.graph_parts(PRIMARY) == frozenset()
    assert provider.graph_parts(VERIFY) == {0}
    assert sess.executor.slots.variants(PRIMARY) == []
    assert sess.executor.slots.variants(VERIFY) == [0]
    assert sess.graph_stats(PRIMARY).invalidations == 2  # one per captured variant
    eager = sess.graph_stats(PRIMARY).eager_runs
    for _ in range(3):  # planned, captured, replayed: each variant again
        _step(sess, model, one, rng, variant=0)
        _step(sess, model, three, rng, variant=1)
        _step(sess, model, verify, rng, slot=VERIFY)
    stats = sess.graph_stats(PRIMARY)
    assert (stats.captures, stats.eager_runs - eager) == (4, 2), stats
    verify_stats = sess.graph_stats(VERIFY)
    assert (verify_stats.captures, verify_stats.invalidations) == (1, 0), verify_stats
    assert verify_stats.replays == 4


class FirstCaptureFailsCPU(CPUProvider):
    """A CPU provider whose first graph capture fails (as an uncapturable kernel would);
    later captures work."""

    name = "first-capture-fails"

    def __init__(self) -> None:
        super().__init__()
        self.failures_left = 1

    def graph_end(self, slot, part):
        super().graph_end(slot, part)
        if self.failures_left:
            self.failures_left -= 1
            raise RuntimeError("operation not permitted when stream is capturing")


def test_a_new_signature_clears_a_failed_capture_latch_while_another_slot_holds_a_graph():
    """The latch of a failed capture lasts until the slot's signature changes; then the
    next run tries to capture again (here it works), whatever other slots hold."""
    model = mlp(hidden=HIDDEN, seed=6)
    provider = FirstCaptureFailsCPU()
    sess = InferenceSession(model, providers=[provider])
    rng = np.random.default_rng(1)
    decode = _bind(sess, 1)
    for _ in range(4):  # planned, the capture fails, then the latch: eager
        _step(sess, model, decode, rng)
    assert provider.capture_error(PRIMARY) is not None
    verify = _bind(sess, 2)
    for _ in range(3):  # VERIFY captures (the one failure is spent)
        _step(sess, model, verify, rng, slot=VERIFY)
    assert sess.executor.slots.variants(VERIFY) == [0]
    stats = sess.graph_stats(PRIMARY)
    assert (stats.captures, stats.fallbacks) == (0, 3), stats
    binding, _, y = decode
    decode = (binding, binding.bind_input("x", np.zeros((1, HIDDEN), np.float32)), y)
    for _ in range(3):  # planned, captured, replayed
        _step(sess, model, decode, rng)
    assert provider.capture_error(PRIMARY) is None
    stats = sess.graph_stats(PRIMARY)
    assert (stats.captures, stats.replays, stats.fallbacks) == (1, 1, 3), stats
