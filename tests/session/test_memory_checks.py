"""``session.memory.plan_memory`` on cases with a known best arena (found by a mutation run:
the hypothesis test checks only that live values never overlap, so the alignment, a gap that
fits exactly, zero-byte values and an empty plan had no test). The reference for each arena
is the peak of bytes live at one step, which no plan can go below."""

from __future__ import annotations

from onnx_genrt.session.memory import ALIGNMENT, Lifetime, plan_memory


def _slot(nbytes: int) -> int:
    """The aligned bytes a value of ``nbytes`` takes: at least one byte, rounded up to 64."""
    return -(-max(nbytes, 1) // ALIGNMENT) * ALIGNMENT


def _peak(lifetimes: list[Lifetime]) -> int:
    steps = range(min(lt.first for lt in lifetimes), max(lt.last for lt in lifetimes) + 1)
    return max(sum(_slot(lt.nbytes) for lt in lifetimes if lt.first <= t <= lt.last) for t in steps)


def test_an_empty_plan_has_no_arena():
    plan = plan_memory([])
    assert (plan.offsets, plan.arena_bytes, plan.naive_bytes) == ({}, 0, 0)
    assert plan.saved_fraction == 0.0


def test_values_live_at_once_share_nothing_and_each_takes_an_aligned_slot():
    """Zero bytes and 64 bytes take one 64-byte slot, 65 bytes two."""
    sizes = [0, 1, 63, 64, 65, 128]
    lifetimes = [Lifetime(f"v{i}", n, 0, 3) for i, n in enumerate(sizes)]
    plan = plan_memory(lifetimes)
    assert ALIGNMENT == 64
    assert plan.arena_bytes == plan.naive_bytes == _peak(lifetimes) == 64 * 8
    spans = sorted((plan.offsets[lt.name], _slot(lt.nbytes)) for lt in lifetimes)
    for (start, size), (after, _) in zip(spans, spans[1:], strict=False):
        assert start % 64 == 0 and start + size <= after
    assert plan.saved_fraction == 0.0


def test_a_gap_of_exactly_the_size_is_reused():
    """b ends at step 0; e (from step 1) fits exactly between a and c."""
    lifetimes = [
        Lifetime("a", 64, 0, 2),
        Lifetime("b", 64, 0, 0),
        Lifetime("c", 64, 0, 2),
        Lifetime("e", 64, 1, 2),
    ]
    plan = plan_memory(lifetimes)
    assert plan.arena_bytes == _peak(lifetimes) == 192
    assert plan.offsets["e"] == plan.offsets["b"] == 64
    assert plan.naive_bytes == 256 and plan.saved_fraction == 0.25


def test_values_never_live_together_share_one_offset():
    lifetimes = [Lifetime(f"v{i}", 100 * (i + 1), i, i) for i in range(4)]
    plan = plan_memory(lifetimes)
    assert set(plan.offsets.values()) == {0}
    assert plan.arena_bytes == _peak(lifetimes) == _slot(400)
