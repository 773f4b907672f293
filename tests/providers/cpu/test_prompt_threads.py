"""Prompt-sized numpy work split over the CPU provider's threads (``_prompt_threads``):
split matmuls and prompt attention against float64 numpy and onnxruntime, with the split
forced on small shapes, and the executor after a fork."""

from __future__ import annotations

import multiprocessing
import threading
from typing import Any

import numpy as np
import pytest

from onnx_genrt.providers.cpu.kernels import _prompt_threads as pt
from onnx_genrt.providers.cpu.kernels import contrib_attention
from onnx_genrt.session import InferenceSession

from ...ops.test_contrib import _feeds, _gqa_inputs, _gqa_model, _run_ort

F32 = np.float32


@pytest.fixture
def forced_split(two_threads, monkeypatch) -> list[int]:
    """Two threads, every product split, and the part counts of each ``run_parts`` call."""
    monkeypatch.setattr(pt, "SPLIT_MIN_WORK", 0)
    calls: list[int] = []
    original = pt.run_parts

    def counting(parts):
        calls.append(len(parts))
        return original(parts)

    monkeypatch.setattr(pt, "run_parts", counting)
    monkeypatch.setattr(contrib_attention, "run_parts", counting)
    return calls


def test_run_parts_uses_other_threads_and_raises_a_parts_error(two_threads) -> None:
    seen: list[int] = []
    barrier = threading.Barrier(2, timeout=30)

    def part() -> None:  # both parts must be running at once to pass the barrier
        seen.append(threading.get_ident())
        barrier.wait()

    pt.run_parts([part, part])
    assert len(set(seen)) == 2 and threading.get_ident() in seen

    def bad() -> None:
        raise ValueError("part failed")

    with pytest.raises(ValueError, match="part failed"):
        pt.run_parts([lambda: None, bad])


@pytest.mark.parametrize("m", [4, 37])
def test_split_matmul_matches_float64(forced_split, m: int) -> None:
    rng = np.random.default_rng(m)
    a = rng.standard_normal((m, 70)).astype(F32)
    b = rng.standard_normal((70, 50)).astype(F32)
    out = np.full((m, 50), np.nan, F32)
    pt.split_matmul(a, b, out)
    assert forced_split == [2]
    want = a.astype(np.float64) @ b.astype(np.float64)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_split_matmul_keeps_small_products_whole(two_threads) -> None:
    assert not pt.splits(64, 64, 64)
    assert pt.splits(512, 896, 4864)


@pytest.mark.parametrize(
    "attrs",
    [
        pytest.param({}, id="causal"),
        pytest.param({"do_rotary": 1, "local_window_size": 9}, id="window"),
        pytest.param({"softcap": 3.0, "smooth_softmax": 1}, id="softcap-smooth"),
    ],
)
@pytest.mark.parametrize("cap", [None, 20], ids=["prompt", "after-past"])
def test_prompt_attention_split_matches_onnxruntime(forced_split, attrs: dict, cap) -> None:
    """A 40-row prompt (after 0 or 20 cached positions) through GroupQueryAttention with
    its query chunks spread over two threads."""
    seqlens = [39 + (20 if cap else 0)]
    inp = _gqa_inputs(11, F32, b=1, s=40, seqlens=seqlens, cap=cap)
    model = _gqa_model(inp, F32, num_heads=4, kv_num_heads=2, **attrs)
    feeds = _feeds(model, inp)
    ours = InferenceSession(model, providers=["cpu"]).run(None, feeds)
    assert forced_split and max(forced_split) == 2
    want = _run_ort(model, inp)
    np.testing.assert_allclose(ours[0], want[0], rtol=2e-5, atol=2e-5)
    t = seqlens[0] + 1
    for j in (1, 2):
        np.testing.assert_allclose(ours[j][:, :, :t], want[j][:, :, :t], rtol=1e-6, atol=1e-6)


def _split_in_child(queue: Any) -> None:
    pt.SPLIT_MIN_WORK = 0
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((9, 16)).astype(F32), rng.standard_normal((16, 8)).astype(F32)
    out = np.empty((9, 8), F32)
    pt.split_matmul(a, b, out)
    queue.put(float(np.abs(out - a.astype(np.float64) @ b).max()))


def test_split_after_fork(two_threads, monkeypatch) -> None:
    """A forked child starts its own threads (the parent's executor has none there)."""
    monkeypatch.setattr(pt, "SPLIT_MIN_WORK", 0)
    pt.run_parts([lambda: None, lambda: None])  # the parent's executor exists
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_split_in_child, args=(queue,))
    child.start()
    child.join(60)
    if child.is_alive():
        child.kill()
        pytest.fail("split_matmul hung in a forked child")
    assert child.exitcode == 0
    assert queue.get(timeout=5) < 1e-4


def _one_node_model(op: str, domain: str, feeds: dict, consts: dict, out_cols: int, **attrs):
    """One node reading ``feeds`` (graph inputs, rows x cols) then ``consts`` (initializers)."""
    from onnx import TensorProto, helper, numpy_helper

    inputs = [
        helper.make_tensor_value_info(name, TensorProto.FLOAT, ["r", a.shape[1]])
        for name, a in feeds.items()
    ]
    graph = helper.make_graph(
        [helper.make_node(op, [*feeds, *consts], ["y"], domain=domain, **attrs)],
        "rows",
        inputs,
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["r", out_cols])],
        [numpy_helper.from_array(v, k) for k, v in consts.items()],
    )
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid(domain, 1)]
    return helper.make_model(graph, opset_imports=opsets)


def test_row_kernels_split_over_threads_match_float64(two_threads, monkeypatch):
    """A prompt's SkipSimplifiedLayerNormalization and SiluMul (halves of one input) with
    their rows spread over two threads: each row as float64 numpy computes it."""
    monkeypatch.setattr(pt, "SPLIT_MIN_ELEMENTS", 0)
    calls: list[int] = []
    original = pt.run_parts
    monkeypatch.setattr(pt, "run_parts", lambda parts: (calls.append(len(parts)), original(parts)))
    rng = np.random.default_rng(4)
    rows, cols = 37, 96
    x = rng.standard_normal((rows, cols)).astype(F32)
    skip = rng.standard_normal((rows, cols)).astype(F32)
    gamma = rng.standard_normal(cols).astype(F32)
    norm = _one_node_model("SkipSimplifiedLayerNormalization", "com.microsoft",
                           {"x": x, "skip": skip}, {"gamma": gamma}, cols, epsilon=1e-6)  # fmt: skip
    (y,) = InferenceSession(norm, providers=["cpu"]).run(None, {"x": x, "skip": skip})
    h = x.astype(np.float64) + skip
    want = h / np.sqrt((h * h).mean(-1, keepdims=True) + 1e-6) * gamma
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    silu = _one_node_model("SiluMul", "onnx_genrt", {"gu": x}, {}, cols // 2, split=1)
    (y,) = InferenceSession(silu, providers=["cpu"]).run(None, {"gu": x})
    g, u = x[:, : cols // 2].astype(np.float64), x[:, cols // 2 :]
    np.testing.assert_allclose(y, g / (1 + np.exp(-g)) * u, rtol=1e-5, atol=1e-6)
    assert calls.count(2) >= 2  # the norm's rows and SiluMul's
