"""spec="auto": the model's own proposer, kept only while verify steps beat plain steps."""

from __future__ import annotations

import pytest

from onnx_genrt.core.errors import InvalidInputError
from onnx_genrt.engine import Model, generate
from onnx_genrt.engine.api import resolve_spec
from onnx_genrt.engine.speculative import PayoffPolicy
from onnx_genrt.generate_cli import default_model_dir


def _drive(policy: PayoffPolicy, steps: int, verify: tuple[int, float], plain: float) -> list[bool]:
    """Decisions over ``steps`` steps where a verify step adds verify[0] tokens in
    verify[1] s and a plain step takes ``plain`` s."""
    decisions = []
    for _ in range(steps):
        spec = policy.speculate()
        decisions.append(spec)
        policy.record(spec, verify[0] if spec else 1, verify[1] if spec else plain)
    return decisions


def test_policy_keeps_speculating_while_it_pays():
    policy = PayoffPolicy(window=4, probe=8, skip=0)
    decisions = _drive(policy, 64, verify=(3, 0.002), plain=0.001)  # 1500 vs 1000 tok/s
    assert decisions[:2] == [False, True]  # measure plain first, then verify
    assert sum(decisions) >= 64 - 2 - 64 // 8  # speculating, but for the plain probes
    assert policy.pays() is True and policy.as_dict()["verify_tok_s"] == 1500.0


def test_policy_stops_when_verify_steps_lose_and_probes_again():
    policy = PayoffPolicy(window=4, probe=8, skip=0)
    decisions = _drive(policy, 64, verify=(1, 0.0015), plain=0.001)  # 667 vs 1000 tok/s
    assert policy.pays() is False
    assert sum(decisions) <= 1 + 64 // 8  # the first measurement, then one probe per 8
    assert sum(decisions[-16:]) >= 1  # it keeps probing


def test_policy_follows_a_change_in_acceptance():
    policy = PayoffPolicy(window=4, probe=4, skip=0)
    _drive(policy, 32, verify=(1, 0.002), plain=0.001)
    assert policy.pays() is False
    later = _drive(policy, 64, verify=(4, 0.002), plain=0.001)  # the text became predictable
    assert policy.pays() is True and sum(later[-16:]) >= 12
    assert policy.switches >= 1


def test_policy_skips_the_first_steps_of_each_kind():
    policy = PayoffPolicy(window=4, probe=8, skip=2)
    policy.record(False, 1, 9.0)  # capture-time steps: not counted
    policy.record(False, 1, 9.0)
    policy.record(False, 1, 0.001)
    assert policy.plain_rate == 1000.0


def test_auto_picks_the_models_proposer_and_equals_greedy():
    model = Model(default_model_dir())
    assert resolve_spec(model, "auto") == "mtp"  # the embedded model has an MTP head
    greedy = generate(model, "class Foo:", 48)
    auto = generate(model, "class Foo:", 48, spec="auto")
    assert auto.tokens == greedy.tokens
    stats = auto.speculation
    assert stats["kind"] == "mtp" and stats["verify_steps"] + stats["plain_steps"] > 0
    assert set(stats["auto"]) == {
        "plain_tok_s",
        "verify_tok_s",
        "speculation_pays",
        "switches",
        "probes",
    }
    with pytest.raises(InvalidInputError, match="choose one of mtp, draft, ngram, auto"):
        generate(model, "x", 4, spec="fast")


def test_probes_back_off_while_the_choice_holds_and_do_not_alias_with_the_text():
    policy = PayoffPolicy(window=4, probe=8, skip=0, max_probe=64)
    decisions = _drive(policy, 512, verify=(1, 0.0015), plain=0.001)  # speculation loses
    probes = [i for i, spec in enumerate(decisions) if spec][1:]  # after the first measurement
    gaps = [b - a for a, b in zip(probes, probes[1:], strict=False)]
    assert gaps[:3] == sorted(gaps[:3]) and gaps[2] >= 2 * gaps[0]  # doubling
    assert max(gaps) <= 64 + 2 and len(probes) <= 512 // 64 + 6  # capped, few probes
    assert len({p % 16 for p in probes}) > 2  # not always the same phase of a 16-token cycle
    assert policy.as_dict()["probes"] == len(probes)


def test_a_switch_brings_the_probes_back_to_the_short_gap():
    policy = PayoffPolicy(window=2, probe=4, skip=0, max_probe=64)
    _drive(policy, 256, verify=(1, 0.0015), plain=0.001)  # losing: the gap grew to 64
    later = _drive(policy, 80, verify=(4, 0.002), plain=0.001)  # now speculation wins
    assert policy.switches >= 1 and policy.pays() is True
    first = later.index(True)  # the probe that found it pays (within the long gap)
    switched = first + later[first:].index(True, 1)  # speculating from here on
    assert False in later[switched : switched + 6]  # a plain probe after 4 steps, not 64
