"""pytest-benchmark: per-node dispatch, eager against replayed, on the same model.

Run with ``pytest tests/bench --benchmark-enable``; in the normal test run each benchmark
body runs once, as a test, and its results are checked against a float64 reference.
"""

from __future__ import annotations

import numpy as np
import pytest

from onnx_genrt.core.graph_slots import DeviceGraphSlot
from onnx_genrt.tools.dispatch_bench import bound_session, elementwise_chain

from ..models import chain_reference

NODES = 200


@pytest.mark.benchmark(group="dispatch-cpu-200-nodes")
@pytest.mark.parametrize("mode", ["eager", "replay"])
def test_dispatch(benchmark, mode):
    sess, binding = bound_session(elementwise_chain(NODES), "cpu", graphs=mode == "replay")
    benchmark.extra_info["nodes"] = NODES
    benchmark(sess.run_with_iobinding, binding, DeviceGraphSlot.PRIMARY)
    x = binding.input("x")
    np.testing.assert_allclose(binding.output("y"), chain_reference(NODES, x), rtol=1e-4)
    stats = sess.graph_stats()
    if mode == "replay":
        assert stats.captures == 1 and stats.replays >= 1
    else:
        assert stats.captures == 0


def test_bench_dispatch_command_runs_the_cpu_without_provider(capsys):
    """``onnx-genrt bench --dispatch``: the CPU when no --provider is given, one row per
    --provider flag, each on the chain of --nodes."""
    from onnx_genrt.cli import main

    assert main(["bench", "--dispatch", "--nodes", "8"]) == 0
    rows = capsys.readouterr().out.splitlines()[1:]
    assert [row.split()[:2] for row in rows] == [["cpu", "8"]]
    assert (
        main(["bench", "--dispatch", "--nodes", "6", "--provider", "cpu", "--provider", "cpu"]) == 0
    )
    rows = capsys.readouterr().out.splitlines()[1:]
    assert [row.split()[:2] for row in rows] == [["cpu", "6"], ["cpu", "6"]]
