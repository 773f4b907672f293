"""The MTP chain's fused bookkeeping ops (MTPAccept, MTPNextInputs) on a real GPU, against
their standard-op bodies (``core.genrt_ops``) on a CPU provider without those kernels.

Marked ``gpu``: skipped without a usable GPU, failed instead when ONNX_GENRT_REQUIRE_GPU=1.
"""

from __future__ import annotations

import numpy as np
import pytest

from onnx_genrt.engine.mtp_chain import (
    ACCEPTED,
    CONFIDENCES,
    DRAFTS,
    NEXT_COUNT,
    NEXT_IDS,
    NEXT_MASK,
    NEXT_POSITIONS,
    NEXT_START,
    after_verify,
    with_next_inputs,
)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("seed", range(6))
def test_fused_chain_bookkeeping_matches_standard_ops_on_cpu(cp, seed):
    from onnx_genrt.session import InferenceSession
    from tests.models import mtp_chain_case, standard_ops_cpu

    k, length, min_conf = 4, 64, 0.2
    chain, feeds = mtp_chain_case(seed, k)
    names = [ACCEPTED, DRAFTS, CONFIDENCES, NEXT_START, NEXT_IDS, NEXT_COUNT, NEXT_POSITIONS]
    names.append(NEXT_MASK)
    model = with_next_inputs(after_verify(chain, k), k, min_conf, length, True)
    bodies = InferenceSession(model, providers=[standard_ops_cpu()], cpu_fallback=False)
    assert not {s.node.op_type for s in bodies.plan.steps} & {"MTPAccept", "MTPNextInputs"}
    want = bodies.run(names, feeds)
    sess = InferenceSession(model, providers=["cuda"])
    assert {"MTPAccept", "MTPNextInputs"} <= {s.node.op_type for s in sess.plan.steps}
    got = sess.run(names, feeds)
    for name, g, w in zip(names, got, want, strict=True):
        if name == CONFIDENCES:
            np.testing.assert_allclose(np.asarray(g), w, rtol=1e-5, atol=1e-6)
        else:
            np.testing.assert_array_equal(np.asarray(g), w, err_msg=name)
