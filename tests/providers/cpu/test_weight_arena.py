"""The CPU provider's weight arena: prepacked weights copied into 2 MB-aligned blocks so that
they sit in transparent huge pages (``providers/cpu/kernels/_weight_arena.py``)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_genrt.providers.cpu.kernels import _weight_arena as wa
from onnx_genrt.providers.cpu.kernels._skinny_matmul import TiledWeight
from onnx_genrt.session import InferenceSession

F32 = np.float32
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _block_start(a: np.ndarray) -> int:
    """The data address of the block an arena array was carved from."""
    base = a
    while isinstance(base.base, np.ndarray):
        base = base.base
    return int(base.ctypes.data) + (-int(base.ctypes.data)) % wa.HUGE_PAGE


def test_zeros_carves_large_arrays_from_aligned_blocks_and_leaves_small_ones():
    arena = wa.WeightArena(block_bytes=4 << 20)
    small = arena.zeros((100,), F32)
    assert small.base is None and not small.any()  # numpy's own array
    shapes = [((300, 1000), F32), ((700, 1000), np.uint8), ((2, 1000, 1000), F32)]  # 8 MB last
    made = [arena.zeros(shape, dtype) for shape, dtype in shapes]
    for (shape, dtype), a in zip(shapes, made, strict=True):
        assert a.shape == shape and a.dtype == dtype and not a.any()
        assert a.flags.c_contiguous and a.flags.writeable
        assert a.ctypes.data % wa.ALIGN == 0
        a[...] = 7  # each has memory of its own
    assert all((a == 7).all() for a in made)
    assert made[0].ctypes.data % wa.HUGE_PAGE == 0  # the first array opens a block
    after_first = -(-made[0].nbytes // wa.ALIGN) * wa.ALIGN  # the next 4096-byte boundary
    assert made[1].ctypes.data == made[0].ctypes.data + after_first
    assert _block_start(made[1]) == _block_start(made[0])
    assert made[2].ctypes.data % wa.HUGE_PAGE == 0  # too large: a block of its own
    assert _block_start(made[2]) != _block_start(made[0])


def _matmul_model(k: int, n: int) -> tuple[object, np.ndarray]:
    w = np.random.default_rng(1).standard_normal((k, n)).astype(F32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"])],
        "mm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", n])],
        [numpy_helper.from_array(w, "W")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), w


def _huge_kb_at(address: int) -> int:
    """AnonHugePages of the mapping that holds ``address``."""
    found = None
    for line in Path(f"/proc/{os.getpid()}/smaps").read_text().splitlines():
        span = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if span:
            found = int(span[1], 16) <= address < int(span[2], 16)
        elif found and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def test_a_sessions_prepacked_weight_lives_in_its_providers_arena():
    """A session's tiled MatMul weight is a copy in its CPU provider's arena (2 MB-aligned),
    and the session still computes x @ W; where the kernel gives transparent huge pages on
    request, the weight's pages are huge."""
    model, w = _matmul_model(768, 3072)  # 9.4 MB
    sess = InferenceSession(model, providers=["cpu"])
    (tiled,) = [v for v in sess.executor.constants._made.values() if isinstance(v, TiledWeight)]
    assert tiled.tiles.ctypes.data % wa.HUGE_PAGE == 0
    x = np.random.default_rng(2).standard_normal((3, 768)).astype(F32)
    (y,) = sess.run(None, {"x": x})
    np.testing.assert_allclose(y, x.astype(np.float64) @ w, rtol=1e-4, atol=1e-4)
    if not THP.is_file() or "[never]" in THP.read_text():
        pytest.skip("no transparent huge pages on this system")
    assert _huge_kb_at(tiled.tiles.ctypes.data) >= 2048


def test_prepacked_4bit_weights_are_held_in_the_arena():
    """MatMulNBits' prepacked tiles go into the provider's arena, the same bytes as without
    one."""
    from types import SimpleNamespace

    from onnx_genrt.core.kernels import MS_DOMAIN, NodeInfo
    from onnx_genrt.providers.cpu.kernels.contrib_quant import prepack_int4

    k, n, block = 768, 1024, 32
    attrs = {"K": k, "N": n, "bits": 4, "block_size": block, "accuracy_level": 4}
    node = NodeInfo("MatMulNBits", "q", MS_DOMAIN, 1, attrs, ("A", "B", "scales"), ("Y",))
    blob = np.random.default_rng(3).integers(0, 256, (n, k // block, block // 2), np.uint8)
    provider = SimpleNamespace(weight_arena=wa.WeightArena(), option=lambda name: None,
                               options=())  # fmt: skip
    held = prepack_int4(provider, node, 1, blob)
    plain = prepack_int4(SimpleNamespace(option=lambda name: None, options=()), node, 1, blob)
    assert held.packed.ctypes.data % wa.HUGE_PAGE == 0
    np.testing.assert_array_equal(held.packed, plain.packed)
