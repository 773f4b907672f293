"""Mixed placement on a real GPU: a CUDA provider that claims Add and Relu only, beside the
CPU provider. Each captures its segments as parts of its graph in PRIMARY and VERIFY; the
values crossing between device and host are copied between the part replays. Every step
is compared with numpy float64. Marked ``gpu``."""

from __future__ import annotations

import numpy as np
import pytest

from onnx_genrt.core.graph_slots import DeviceGraphSlot
from tests.models import mlp, mlp_reference

pytestmark = pytest.mark.gpu

PRIMARY, VERIFY = DeviceGraphSlot.PRIMARY, DeviceGraphSlot.VERIFY


@pytest.fixture
def partial_cuda(cp):
    from onnx_genrt.core.kernels import KernelRegistry
    from onnx_genrt.providers.cuda.kernels import REGISTRY
    from onnx_genrt.providers.cuda.provider import CUDAProvider

    class AddReluCUDA(CUDAProvider):
        name = "cuda-add-relu"

        @property
        def kernels(self) -> KernelRegistry:
            reg = KernelRegistry()
            for op in ("Add", "Relu"):
                reg.add(REGISTRY.lookup("", op, 21))
            return reg

    return AddReluCUDA()


def test_cuda_and_cpu_segments_capture_and_replay_in_two_slots(cp, partial_cuda):
    from onnx_genrt.session import InferenceSession

    hidden = 32
    model = mlp(hidden=hidden, seed=4)
    sess = InferenceSession(model, providers=[partial_cuda, "cpu"])
    runs = [(s.provider.name, s.part) for s in sess.executor.segments]
    assert runs == [("cpu", 0), ("cuda-add-relu", 0), ("cpu", 1), ("cuda-add-relu", 1)]
    bindings = {}
    for slot, rows in ((PRIMARY, 1), (VERIFY, 5)):
        b = sess.io_binding()
        x = b.bind_input("x", np.zeros((rows, hidden), np.float32))
        y = b.bind_output("y", shape=(rows, hidden))
        bindings[slot] = (b, x, y)
    rng = np.random.default_rng(0)
    for _ in range(6):
        for slot, (b, x, y) in bindings.items():
            host = rng.standard_normal(x.shape).astype(np.float32)
            sess.main_provider.write_from_host(x, host)
            sess.run_with_iobinding(b, slot)
            got = sess.main_provider.to_numpy(y)
            np.testing.assert_allclose(got, mlp_reference(model, host), rtol=1e-4, atol=1e-4)
    for slot in (PRIMARY, VERIFY):
        stats = sess.graph_stats(slot)
        assert (stats.captures, stats.replays, stats.fallbacks) == (1, 4, 0), stats
        assert stats.provider_replays == {"cpu": 8, "cuda-add-relu": 8}
        assert partial_cuda.graph_parts(slot) == {0, 1}
