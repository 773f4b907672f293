"""Shared helpers: run ONNX's bundled single-node backend cases against one CPU kernel."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Iterable
from typing import Any

import numpy as np

from onnx_genrt.core.kernels import KernelContext, NodeInfo, normalize_domain
from onnx_genrt.providers.cpu.kernels import REGISTRY


@functools.lru_cache(maxsize=1)
def collect_testcases() -> tuple[Any, ...]:
    """All node test cases shipped with the onnx wheel (collected once, ~9 s)."""
    from onnx.backend.test.case.node import collect_testcases as _collect

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tuple(_collect())


def single_node_cases(op_types: Iterable[str], domain: str = "") -> list[Any]:
    """Cases whose graph is a single node of one of ``op_types`` (no ``_expanded`` ones)."""
    wanted = set(op_types)
    dom = normalize_domain(domain)
    out = []
    for case in collect_testcases():
        if case.name.endswith("_expanded") or "_expanded_" in case.name:
            continue
        nodes = case.model.graph.node
        if len(nodes) != 1:
            continue
        node = nodes[0]
        if node.op_type in wanted and normalize_domain(node.domain) == dom:
            out.append(case)
    return sorted(out, key=lambda c: c.name)


def case_opset(case: Any) -> int:
    """The opset the case's model imports for its node's domain."""
    dom = normalize_domain(case.model.graph.node[0].domain)
    for imp in case.model.opset_import:
        if normalize_domain(imp.domain) == dom:
            return int(imp.version)
    raise ValueError(f"{case.name}: no opset import for domain {dom!r}")


def run_kernel(case: Any, inputs: list[np.ndarray]) -> tuple[np.ndarray, ...]:
    """Run the case's single node through the registered kernel; always a tuple of outputs."""
    node = case.model.graph.node[0]
    opset = case_opset(case)
    kdef = REGISTRY.lookup(node.domain, node.op_type, opset)
    assert kdef is not None, f"{case.name}: no kernel for {node.op_type} at opset {opset}"
    feeds = {vi.name: arr for vi, arr in zip(case.model.graph.input, inputs, strict=False)}
    args: list[np.ndarray | None] = [feeds[n] if n else None for n in node.input]
    while args and args[-1] is None:  # trailing absent optionals are not passed
        args.pop()
    ctx = KernelContext(NodeInfo.from_proto(node, opset))
    result = kdef.fn(ctx, *args)
    return result if isinstance(result, tuple) else (result,)


def _comparable(a: np.ndarray) -> np.ndarray:
    """A view numpy's testing helpers can compare (ml_dtypes floats/ints widened)."""
    if a.dtype.kind == "V" or a.dtype.__class__.__module__.startswith("ml_dtypes"):
        return a.astype(np.float64)
    if a.dtype.kind == "f" and a.dtype.itemsize < 4:
        return a.astype(np.float32)
    return a


def assert_output_matches(name: str, got: Any, want: np.ndarray, rtol: float, atol: float) -> None:
    """Same type, dtype and shape; values equal (ints, bools) or close (floats, NaN == NaN)."""
    want = np.asarray(want)
    assert isinstance(got, np.ndarray), f"{name}: returned {type(got).__name__}, not ndarray"
    assert got.dtype == want.dtype, f"{name}: dtype {got.dtype} != expected {want.dtype}"
    assert got.shape == want.shape, f"{name}: shape {got.shape} != expected {want.shape}"
    g, w = _comparable(got), _comparable(want)
    if g.dtype.kind in "fc":
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, equal_nan=True, err_msg=name)
    else:
        np.testing.assert_array_equal(g, w, err_msg=name)


def run_case_with_kernel(case: Any) -> None:
    """Run every data set of ``case`` through its kernel and check each output."""
    n_out = len(case.model.graph.output)
    for i, (inputs, outputs) in enumerate(case.data_sets):
        got = run_kernel(case, list(inputs))
        assert len(got) == n_out, f"{case.name}: {len(got)} outputs, expected {n_out}"
        for j, want in enumerate(outputs):
            assert_output_matches(
                f"{case.name}[set {i}] output {j}", got[j], want, case.rtol, case.atol
            )


def call_kernel(op: str, *inputs: Any, opset: int, n_out: int = 1, **attrs: Any) -> Any:
    """Call the CPU kernel for ai.onnx ``op`` directly on ``inputs`` with ``attrs``."""
    from onnx import helper

    node = helper.make_node(
        op, [f"i{k}" for k in range(len(inputs))], [f"o{k}" for k in range(n_out)], **attrs
    )
    kdef = REGISTRY.lookup("", op, opset)
    assert kdef is not None, op
    return kdef.fn(KernelContext(NodeInfo.from_proto(node, opset)), *inputs)
