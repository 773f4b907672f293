"""The MTP chain's fused bookkeeping ops (MTPAccept, MTPNextInputs) on a real GPU, against
the same chain spelled in standard ops on the CPU provider.

Marked ``gpu``: skipped without a usable GPU, failed instead when ONNX_GENRT_REQUIRE_GPU=1.
"""

from __future__ import annotations

import numpy as np
import pytest

from onnx_genrt.engine.mtp_chain import (
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

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cp():
    from onnx_genrt.providers.cuda.plugin import cuda_unavailable_reason

    reason = cuda_unavailable_reason()
    if reason is not None:
        pytest.fail(f"ONNX_GENRT_REQUIRE_GPU=1 but no GPU is usable: {reason}")
    import cupy

    return cupy


@pytest.mark.parametrize("seed", range(6))
def test_fused_chain_bookkeeping_matches_standard_ops_on_cpu(cp, seed):
    from onnx_genrt.generate_cli import default_model_dir
    from onnx_genrt.session import InferenceSession, load_model

    head = load_model(default_model_dir() / "mtp" / "model.onnx")
    k, length, min_conf = 4, 64, 0.2
    chain = unroll_mtp_head(head, k)
    rng = np.random.default_rng(seed)
    hidden_size = int(InferenceSession(chain).input_spec("hidden_states").shape[-1])
    feeds = {
        VERIFY_IDS: rng.integers(0, 50, (1, k + 1)).astype(np.int64),
        VERIFY_ARGMAX: rng.integers(0, 50, (1, k + 1)).astype(np.int64),
        VERIFY_HIDDEN: rng.standard_normal((1, k + 1, hidden_size)).astype(np.float32),
        DRAFT_COUNT: np.array([int(rng.integers(0, k + 1))], np.int64),
        VERIFY_START: np.array([int(rng.integers(0, 40))], np.int64),
    }
    matches = int(rng.integers(0, k + 1))
    feeds[VERIFY_IDS][0, 1 : matches + 1] = feeds[VERIFY_ARGMAX][0, :matches]
    names = [ACCEPTED, DRAFTS, CONFIDENCES, NEXT_START, NEXT_IDS, NEXT_COUNT, NEXT_POSITIONS]
    names.append(NEXT_MASK)
    standard = with_next_inputs(after_verify(chain, k), k, min_conf, length, True)
    fused = with_next_inputs(
        after_verify(chain, k, fused=True), k, min_conf, length, True, fused=True
    )
    want = InferenceSession(standard, providers=["cpu"]).run(names, feeds)
    sess = InferenceSession(fused, providers=["cuda"])
    assert {"MTPAccept", "MTPNextInputs"} <= {s.node.op_type for s in sess.plan.steps}
    got = sess.run(names, feeds)
    for name, g, w in zip(names, got, want, strict=True):
        if name == CONFIDENCES:
            np.testing.assert_allclose(np.asarray(g), w, rtol=1e-5, atol=1e-6)
        else:
            np.testing.assert_array_equal(np.asarray(g), w, err_msg=name)
