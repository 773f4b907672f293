"""A decoder layer's MLP half as one cooperative grid (``NormGatedMLP``,
``providers/cuda/kernels/_gated_mlp.py``) on a real GPU: against float64 numpy, eager and
replayed in a graph, each row the same bits alone as in a batch, close to the unfused CUDA
kernels, and the unfused path for rows the grid does not take.

Marked ``gpu``: skipped without a usable GPU, failed instead when ONNX_GENRT_REQUIRE_GPU=1.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from onnx_genrt.core.graph_slots import DeviceGraphSlot
from tests.models import silu_projection

from .test_cuda_gated_gemv import _check, _reference

pytestmark = pytest.mark.gpu

BF16 = ml_dtypes.bfloat16
SHAPES = {"small": (64, 40), "0.5B": (896, 4864)}


def _session(model, fused: bool):
    from onnx_genrt.providers.cuda.provider import CUDAProvider
    from onnx_genrt.session import InferenceSession

    return InferenceSession(model, providers=[CUDAProvider(gemv_prologues=True, fused_mlp=fused)])


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dtype", [np.float16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("rows", [1, 5, 8, 12])
def test_gated_mlp_matches_float64_eager_and_replayed(cp, rows, dtype, shape):
    """Rows up to 8 run the grid (one cooperative launch a call), 12 the unfused kernels;
    both eager and captured (outputs poisoned before each replay), 0 fallbacks."""
    from onnx_genrt.providers.cuda.launch import launch_counts

    hidden, inter = SHAPES[shape]
    model = silu_projection(hidden, inter, rows, seed=5, down="matmul", norm=True, dtype=dtype)
    sess = _session(model, fused=True)
    assert [s.node.op_type for s in sess.plan.steps] == ["NormGatedMLP"]
    prov = sess.main_provider
    rng = np.random.default_rng(rows)

    def feeds():
        return {k: rng.standard_normal((1, rows, hidden)).astype(dtype) for k in "xr"}

    f = feeds()
    before = launch_counts().cooperative
    _check(sess.run(["y", "h"], f), _reference(model, f["x"], f["r"]), dtype)
    assert launch_counts().cooperative - before == (1 if rows <= 8 else 0)
    slot = DeviceGraphSlot.PRIMARY if rows == 1 else DeviceGraphSlot.VERIFY
    binding = sess.io_binding()
    with prov.stream:
        ins = {k: binding.bind_input(k, cp.zeros((1, rows, hidden), dtype)) for k in "xr"}
    outs = [binding.bind_output(k, shape=(1, rows, hidden), dtype=dtype) for k in "yh"]
    for _ in range(4):
        f = feeds()
        for k, v in f.items():
            ins[k].set(v, stream=prov.stream)
        with prov.stream:
            for o in outs:
                o.fill(np.nan)
        sess.run_with_iobinding(binding, slot)
        _check([prov.to_numpy(o) for o in outs], _reference(model, f["x"], f["r"]), dtype)
    stats = sess.graph_stats(slot)
    assert stats.captures == 1 and stats.replays >= 2, stats
    assert stats.fallbacks == 0, dict(stats.fallback_reasons)


@pytest.mark.parametrize("dtype", [np.float16, BF16], ids=["fp16", "bf16"])
def test_gated_mlp_rows_are_the_same_bits_alone_and_in_a_batch(cp, dtype):
    """A row's arithmetic does not depend on the rows beside it (the batch's greedy tokens
    equal each prompt's alone)."""
    hidden, inter = SHAPES["0.5B"]
    rng = np.random.default_rng(9)
    x, r = (rng.standard_normal((1, 8, hidden)).astype(dtype) for _ in range(2))
    batch = _session(silu_projection(hidden, inter, 8, 5, "matmul", True, dtype), fused=True)
    alone = _session(silu_projection(hidden, inter, 1, 5, "matmul", True, dtype), fused=True)
    y8, h8 = (np.asarray(v) for v in batch.run(["y", "h"], {"x": x, "r": r}))
    for i in range(8):
        y1, h1 = alone.run(["y", "h"], {"x": x[:, i : i + 1], "r": r[:, i : i + 1]})
        np.testing.assert_array_equal(
            np.asarray(y1).view(np.uint16), y8[:, i : i + 1].view(np.uint16)
        )
        np.testing.assert_array_equal(
            np.asarray(h1).view(np.uint16), h8[:, i : i + 1].view(np.uint16)
        )


def test_gated_mlp_is_close_to_the_unfused_kernels(cp):
    """The grid against the kernels it replaces (the gated gate/up GEMV, the down GEMV) on
    the same fp16 weights: other summation orders, the same values to fp16 rounding."""
    hidden, inter = SHAPES["0.5B"]
    model = silu_projection(hidden, inter, 1, 7, "matmul", True, np.float16)
    fused, unfused = _session(model, fused=True), _session(model, fused=False)
    assert [s.node.op_type for s in unfused.plan.steps] == ["NormMatMulSiluMul", "MatMul"]
    rng = np.random.default_rng(11)
    for _ in range(3):
        f = {k: rng.standard_normal((1, 1, hidden)).astype(np.float16) for k in "xr"}
        got = [np.asarray(v, np.float64) for v in fused.run(["y", "h"], f)]
        want = [np.asarray(v, np.float64) for v in unfused.run(["y", "h"], f)]
        np.testing.assert_array_equal(got[1], want[1])  # the residual sum: one fp16 add
        np.testing.assert_allclose(got[0], want[0], rtol=1e-2, atol=1e-2 * np.abs(want[0]).max())


def test_builder_model_rows_with_the_fused_mlp_equal_alone(cp, monkeypatch):
    """The bf16 builder fixture with ``fused_mlp`` on: every layer's MLP is one step, the
    prompt of row 2 in a batch of 4 (other rows: random prompts of other lengths) decodes the
    tokens it decodes alone, and the bucket graph replays with no fallback."""
    from onnx_genrt.engine import Model, generate
    from onnx_genrt.engine.batch import BatchGenerator

    from .test_cuda_batch import _params
    from .test_cuda_llm_kernels import _fixture

    monkeypatch.setenv("ONNX_GENRT_FUSED_MLP", "1")
    model = Model(_fixture("qwen2-bf16"), provider="cuda")
    ops = [s.node.op_type for s in model.session.plan.steps]
    assert ops.count("NormGatedMLP") == model.config.num_layers, ops
    prompt = np.load(_fixture("qwen2-bf16") / "reference.npz")["prompt"].tolist()
    alone = generate(model, prompt, 24, ignore_eos=True).tokens
    rng = np.random.default_rng(0)
    batch = BatchGenerator(model, 4, 256)
    rows = []
    for i in range(4):
        ids = prompt if i == 2 else rng.integers(1, model.config.vocab_size, 3 + 5 * i).tolist()
        rows.append(batch.add(ids, _params(model, ids, 24), ignore_eos=True))
    while not all(batch.is_done(r) for r in rows):
        batch.step()
    assert batch.sequence(rows[2]) == alone  # the prompt and its 24 tokens
    stats = batch.graph_stats()["primary"]
    # one capture per bucket the batch ran (rows join while others still prefill)
    assert stats["fallbacks"] == 0 and stats["invalidations"] == 0, stats
    assert 1 <= stats["captures"] <= len(batch.buckets) and stats["replays"] > 20, stats
