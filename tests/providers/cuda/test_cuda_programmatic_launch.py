"""Programmatic dependent launch (PDL) on a real GPU: the provider's kernels give the same
values with ``programmatic_launch`` on and off, eager and replayed from CUDA graphs, and the
launches go through ``cuLaunchKernelEx`` exactly when it is on.

Marked ``gpu``. The PDL rows need sm_90+ and a driver with ``cuFuncGetParamInfo`` (12.4);
elsewhere they skip with the provider's reason (``programmatic_launch_problem``), and the
provider is checked to say so. Values with PDL are compared with the same kernels launched
the ordinary way (same arithmetic: the PDL build differs by the wait, the trigger and L2
prefetches), and both with float64 numpy or the CPU provider's reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from onnx_genrt.core.graph_slots import DeviceGraphSlot
from onnx_genrt.core.kernels import KernelContext, NodeInfo

from .test_cuda_llm_kernels import BUILDER_MODELS, _fixture

pytestmark = pytest.mark.gpu

PRIMARY, DRAFT = DeviceGraphSlot.PRIMARY, DeviceGraphSlot.DRAFT


def _pdl_provider(cp, **options):
    """A CUDA provider with programmatic launch on, or a skip saying why it cannot be."""
    from onnx_genrt.providers.cuda.provider import CUDAProvider

    prov = CUDAProvider(programmatic_launch=True, **options)
    if not prov.programmatic_launch:
        pytest.skip(f"no programmatic launch here: {prov.programmatic_launch_problem}")
    return prov


def test_the_provider_says_whether_programmatic_launch_is_on(cp, monkeypatch):
    from onnx_genrt.providers.cuda import driver as cuda_driver
    from onnx_genrt.providers.cuda.provider import CUDAProvider

    for var in ("PROGRAMMATIC_LAUNCH", "PDL_PREFETCH", "PDL_EARLY_LAUNCH"):
        monkeypatch.delenv(f"ONNX_GENRT_{var}", raising=False)
    cc = int(cp.cuda.Device(0).compute_capability)
    drv = cuda_driver.load()
    supported = cc >= 90 and not isinstance(drv, str)
    assert CUDAProvider().programmatic_launch == supported  # on by default where it can be
    prov = CUDAProvider(programmatic_launch=True)
    assert prov.programmatic_launch == supported
    (note,) = prov.status_notes()
    if prov.programmatic_launch:
        assert note == "programmatic launch: on (with L2 weight prefetch, early launch 1)"
    else:
        assert note == f"programmatic launch: {prov.programmatic_launch_problem}"
    off = CUDAProvider(programmatic_launch=False)
    assert not off.programmatic_launch and "off" in off.status_notes()[0]


def test_driver_parameter_table_of_a_real_kernel(cp):
    """cuFuncGetParamInfo of gemv_nk matches its C signature: three pointers, four ints,
    three pointers, a float and an int."""
    from onnx_genrt.providers.cuda import driver as cuda_driver
    from onnx_genrt.providers.cuda.kernels import matmul
    from onnx_genrt.providers.cuda.kernels._common import function

    drv = cuda_driver.load()
    if isinstance(drv, str):
        pytest.skip(drv)
    fn = function(matmul._SOURCE, "gemv_nk<half_t, 1, 1, 0, 0>")
    table = drv.param_table(int(fn.raw.kernel.ptr))
    sizes = [8, 8, 8, 4, 4, 4, 4, 8, 8, 8, 4, 4]
    offsets = [0, 8, 16, 24, 28, 32, 36, 40, 48, 56, 64, 68]
    assert table == tuple(zip(offsets, sizes, strict=True))


# ----------------------------------------------------------------------------- a chain


class _Chain:
    """x <- RMSNorm(x @ W) * gamma, ``steps`` times, in fp16 on the provider's own kernels
    (prepacked MatMul on gemv_nk, SimplifiedLayerNormalization): every kernel reads what the
    one before it wrote, and each norm overwrites the buffer the previous GEMV read."""

    def __init__(self, cp, prov, rng, k=2048, steps=12):
        from onnx_genrt.providers.cuda.kernels.matmul import transpose_weight

        self.cp, self.prov, self.steps = cp, prov, steps
        self.x0 = rng.standard_normal((1, k)).astype(np.float16)
        self.w = (rng.standard_normal((k, k)) / np.sqrt(k)).astype(np.float16)
        self.gamma = (1 + 0.1 * rng.standard_normal(k)).astype(np.float16)
        mm = NodeInfo("MatMul", "mm", "", 13, {}, ("a", "b"), ("y",))
        norm = NodeInfo(
            "SimplifiedLayerNormalization", "n", "", 1, {"epsilon": 1e-5, "axis": -1},
            ("y", "g"), ("x",),
        )  # fmt: skip
        self.mm = (prov.get_kernel("", "MatMul", 13), mm)
        self.norm = (prov.get_kernel("", "SimplifiedLayerNormalization", 1), norm)
        self.wt = transpose_weight(prov, mm, 1, self.w)
        with prov.stream:
            self.x = cp.asarray(self.x0)
            self.y = cp.empty((1, k), np.float16)
            self.g = cp.asarray(self.gamma)

    def reset(self):
        self.x.set(self.x0, stream=self.prov.stream)
        self.prov.synchronize()

    def run(self):
        for _ in range(self.steps):
            kdef, info = self.mm
            self.prov.launch(kdef, KernelContext(info, self.prov, [self.y]), [self.x, self.wt])
            kdef, info = self.norm
            self.prov.launch(kdef, KernelContext(info, self.prov, [self.x]), [self.y, self.g])

    def result(self):
        self.prov.synchronize()
        return self.cp.asnumpy(self.x).astype(np.float64)

    def reference(self):
        """float64 math, rounded to fp16 where the kernels store."""
        x = self.x0.astype(np.float64)
        for _ in range(self.steps):
            y = (x @ self.w.astype(np.float64)).astype(np.float16).astype(np.float64)
            inv = 1 / np.sqrt((y * y).mean(axis=-1, keepdims=True) + 1e-5)
            x = (y * inv * self.gamma.astype(np.float64)).astype(np.float16).astype(np.float64)
        return x


def _chain_runs(cp, prov, rng_seed):
    """(eager result, replayed result) of the chain on ``prov``."""
    from onnx_genrt.providers.cuda import launch

    chain = _Chain(cp, prov, np.random.default_rng(rng_seed))
    chain.reset()
    launch.reset_launch_counts()
    chain.run()
    eager = chain.result()
    eager_counts = launch.launch_counts()
    chain.reset()
    prov.begin_capture(DRAFT)
    chain.run()
    prov.end_capture(DRAFT)
    for _ in range(3):  # replays from the same start: the same values each time
        chain.reset()
        prov.replay(DRAFT)
    replayed = chain.result()
    prov.reset_graph(DRAFT)
    return chain, eager, replayed, eager_counts


@pytest.mark.parametrize("mma_min_rows", [0, 1], ids=["gemv", "tensor-cores"])
def test_a_chain_of_dependent_kernels_matches_with_pdl_on_and_off(cp, mma_min_rows):
    """The one-row MatMul on ``gemv_nk`` (two launches a step with the norm), or on the
    tensor cores (``gemm_mma``, and ``splitk_sum`` where K is split)."""
    from onnx_genrt.providers.cuda.provider import CUDAProvider

    on = _pdl_provider(cp, mma_min_rows=mma_min_rows)
    chain, eager_on, replay_on, counts_on = _chain_runs(cp, on, 5)
    _, eager_off, replay_off, counts_off = _chain_runs(
        cp, CUDAProvider(programmatic_launch=False, mma_min_rows=mma_min_rows), 5
    )
    ref = chain.reference()
    np.testing.assert_allclose(eager_off, ref, atol=0.05, rtol=0.05)  # fp16 over 12 steps
    # the same kernels and arithmetic either way: only a race would make these differ
    np.testing.assert_array_equal(eager_on, eager_off)
    np.testing.assert_array_equal(replay_on, eager_off)
    np.testing.assert_array_equal(replay_off, eager_off)
    assert counts_on.unready == 0 and counts_off.programmatic == 0
    if mma_min_rows == 0:
        assert counts_on.programmatic == 2 * chain.steps
    else:
        assert counts_on.programmatic >= 2 * chain.steps
    assert counts_off.ordinary >= counts_on.programmatic


# ----------------------------------------------------------------------------- whole models


@dataclass
class _Decoded:
    """What one builder model run gives (``_decode``)."""

    prefill: np.ndarray  # logits of every prompt row (eager)
    eager: np.ndarray  # logits of the teacher-forced steps, eager
    replayed: np.ndarray  # the same steps replayed from the PRIMARY graph
    tokens: list[int]  # greedy generation
    counts: Any  # launch counts of the eager part (prefill and eager steps)
    programmatic: bool  # the provider's programmatic_launch


def _decode(folder, options, prompt, tokens) -> _Decoded:
    """A builder model on a CUDA provider with ``options``: prefill, eager steps, graphed
    steps and greedy tokens."""
    from onnx_genrt.engine import Generator, GeneratorParams, Model
    from onnx_genrt.engine.decoder import DecoderRunner
    from onnx_genrt.providers.cuda import launch

    model = Model(folder, provider=[("cuda", options)])
    length = len(prompt) + len(tokens) + 1
    launch.reset_launch_counts()
    runner = DecoderRunner(model.session, model.config, length)
    runner.prefill_last_row = False
    prefill = np.asarray(runner.forward(prompt, None).logits, np.float64)
    eager = [np.asarray(runner.forward([t], None).logits[0], np.float64) for t in tokens[:-1]]
    counts = launch.launch_counts()
    runner = DecoderRunner(model.session, model.config, length)
    runner.forward(prompt, None)
    replayed = [np.asarray(runner.forward([t], PRIMARY).logits[0], np.float64) for t in tokens[:-1]]
    stats = model.session.graph_stats(PRIMARY)
    assert stats.captures == 1 and stats.fallbacks == 0, dict(stats.fallback_reasons)
    params = GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + len(tokens))
    gen = Generator(model, params)
    gen.append_tokens(prompt)
    while not gen.is_done():
        gen.generate_next_token()
    return _Decoded(
        prefill, np.array(eager), np.array(replayed), gen.get_sequence()[len(prompt) :], counts,
        model.session.main_provider.programmatic_launch,
    )  # fmt: skip


@pytest.mark.parametrize("name", BUILDER_MODELS)
def test_builder_model_decodes_the_same_with_pdl_on_and_off(cp, name):
    """Prefill, eager decode steps and graph replays of a builder model: the logits with
    programmatic launch equal those without (and both match the CPU reference), the greedy
    tokens are the same, and only the PDL run launched through cuLaunchKernelEx, every
    kernel of its steps PDL-ready."""
    folder = _fixture(name)
    _pdl_provider(cp)  # skips where it cannot be on
    ref = np.load(folder / "reference.npz")
    prompt, tokens = ref["prompt"].tolist(), ref["tokens"].tolist()
    on = _decode(folder, {"programmatic_launch": True}, prompt, tokens)
    off = _decode(folder, {"programmatic_launch": False}, prompt, tokens)
    assert on.programmatic and not off.programmatic
    assert on.counts.programmatic > 0 and on.counts.unready == 0, on.counts
    assert off.counts.programmatic == 0 and off.counts.ordinary > 0, off.counts
    tol = 0.06 * float(np.abs(ref["prefill"]).max()) if name == "qwen2-bf16" else 1e-3
    for what, want in (
        ("prefill", ref["prefill"]),
        ("eager", ref["steps"]),
        ("replayed", ref["steps"]),
    ):
        got_on, got_off = getattr(on, what), getattr(off, what)
        np.testing.assert_allclose(got_off, want, atol=tol, rtol=0, err_msg=what)
        np.testing.assert_array_equal(got_on, got_off, err_msg=f"{what}: PDL on against off")
    assert on.tokens == off.tokens
