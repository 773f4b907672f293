"""ONNX's own node tests for every standard op the provider under test claims, each run on
the provider then its fallbacks and compared with the test's expected outputs."""

from __future__ import annotations

import pytest

from onnx_genrt import conformance

from .plugin import KitTarget, kit_target

#: Cases whose expected outputs are one random draw of ONNX's generator (training-mode
#: Dropout with a non-zero ratio): no provider can reproduce them, so the kit skips them.
RANDOM_OUTPUT_CASES = frozenset(
    {
        "test_training_dropout",
        "test_training_dropout_default",
        "test_training_dropout_default_mask",
        "test_training_dropout_mask",
    }
)


def claimed_cases(target: KitTarget) -> list[conformance.Case]:
    """Node test cases (not the ``_expanded`` function bodies) whose op the provider has a
    kernel for in the standard domain."""
    if target.unavailable_reason():
        return []
    provider = target.create()
    claimed = {op.lower() for domain, op in provider.kernels.ops() if domain == ""}
    return [
        case for case in conformance.load_cases(ops=claimed) if conformance.EXPANDED not in case.op
    ]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "node_case" in metafunc.fixturenames:
        cases = claimed_cases(kit_target(metafunc.config))
        metafunc.parametrize("node_case", cases, ids=[c.name for c in cases])


def test_node_case(node_case: conformance.Case, genrt_target: KitTarget) -> None:
    if node_case.name in RANDOM_OUTPUT_CASES:
        pytest.skip("random outputs: the expected values are one draw of ONNX's generator")
    result = conformance.run_case(
        node_case,
        genrt_target.stack(),
        timeout=conformance.DEFAULT_TIMEOUT,
        require_on=genrt_target.name,
    )
    if result.status is conformance.Status.SKIPPED:
        pytest.skip(result.reason)
    if result.status is conformance.Status.FAILED:
        pytest.fail(f"{node_case.name} [{node_case.op}] on {genrt_target.name}: {result.reason}")
