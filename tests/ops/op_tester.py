"""One op test on every provider: the ``tester`` fixture's ``OpTester`` runs a node, or a
small model, on the provider under test, as a session would, and hands the outputs back as
numpy arrays for the test to compare with its independent reference.

``run``/``call`` launch one node's kernel directly: the provider's kernel for the node's op
and opset, the inputs uploaded to its memory, its ``launch``, every output read back (an
output that is not an array of the provider fails the test). ``session``/``run_model`` build
an ``InferenceSession`` on the provider under test and its fallbacks and require every node
to be placed on the provider under test.

The CPU provider is the reference provider of these tests: it must run every op they use, so
a missing kernel or a refusal fails there. Any other provider without a kernel for the op, or
whose kernel refuses the node's inputs (dtype, attributes), skips the test with the reason.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np
import onnx
import pytest
from onnx import helper

from onnx_genrt.core.errors import UnsupportedOpError
from onnx_genrt.core.kernels import KernelContext, KernelDef, NodeInfo, TensorType, normalize_domain
from onnx_genrt.core.provider import ExecutionProvider
from onnx_genrt.session import InferenceSession

#: The provider every op test was written against: it must claim each op they use.
REFERENCE_PROVIDER = "cpu"


def tensor_type(value: Any) -> TensorType | None:
    """What placement would know of ``value``: its dtype and shape (None for absent inputs
    and sequences)."""
    if value is None or isinstance(value, list):
        return None
    array = np.asarray(value)
    return TensorType(array.dtype, tuple(array.shape))


@dataclass
class OpTester:
    """Runs op tests on ``name`` (with ``stack``, its session's provider list: ``name``
    then its fallbacks); ``provider`` is the instance that direct kernel launches use;
    ``fallback_problem`` says why a fallback cannot run here (sessions then skip)."""

    name: str
    stack: Sequence[str]
    provider: ExecutionProvider
    fallback_problem: str = ""

    @property
    def is_reference(self) -> bool:
        """Whether this is the reference provider (which must run every op tested)."""
        return self.name == REFERENCE_PROVIDER

    def unclaimed(self, reason: str) -> NoReturn:
        """Skip: the provider under test does not run this node (fail on the reference)."""
        if self.is_reference:
            pytest.fail(f"{self.name} must run every op of the op tests: {reason}", pytrace=False)
        pytest.skip(f"{self.name} does not run it: {reason}")

    # -- one node, launched directly ------------------------------------------------------
    def node_info(self, node: onnx.NodeProto | NodeInfo, opset: int) -> NodeInfo:
        """``node`` as the provider sees it, at ``opset``."""
        return node if isinstance(node, NodeInfo) else NodeInfo.from_proto(node, opset)

    def kernel(
        self,
        node: onnx.NodeProto | NodeInfo,
        opset: int,
        inputs: Sequence[Any] | None = None,
    ) -> tuple[NodeInfo, KernelDef]:
        """The node and the provider's kernel for it; with ``inputs``, the provider must also
        accept the node for those inputs' types (``supports``, as placement asks)."""
        info = self.node_info(node, opset)
        kdef = self.provider.get_kernel(info.domain, info.op_type, info.opset)
        if kdef is None:
            self.unclaimed(self.provider.supports(info, ())[1])
        if inputs is not None:
            ok, reason = self.provider.supports(info, [tensor_type(x) for x in inputs])
            if not ok:
                self.unclaimed(reason)
        return info, kdef

    def upload(self, value: Any) -> Any:
        """``value`` in the provider's memory (None stays None, a sequence element-wise)."""
        if value is None:
            return None
        if isinstance(value, list):
            return [self.upload(v) for v in value]
        return self.provider.upload(np.asarray(value))

    def launch(
        self,
        info: NodeInfo,
        kdef: KernelDef,
        inputs: Sequence[Any],
        planned: Sequence[Any] = (),
    ) -> tuple[Any, ...]:
        """The kernel's outputs as the provider holds them (trailing absent inputs dropped)."""
        args = [self.upload(x) for x in inputs]
        while args and args[-1] is None:
            args.pop()
        ctx = KernelContext(info, self.provider, list(planned))
        result = self.provider.launch(kdef, ctx, args)
        self.provider.synchronize()
        return result if isinstance(result, tuple) else (result,)

    def to_host(self, values: Iterable[Any], label: str = "") -> tuple[Any, ...]:
        """Host copies of a kernel's outputs; each must be an array of the provider (or
        None, or a sequence of such arrays)."""
        out = []
        for index, value in enumerate(values):
            if value is None:
                out.append(None)
            elif isinstance(value, list):
                out.append(list(self.to_host(value, f"{label} output {index}")))
            elif self.provider.holds(value):
                out.append(self.provider.read([value])[0])
            else:
                kinds = ", ".join(t.__name__ for t in self.provider.ARRAY_TYPES)
                pytest.fail(
                    f"{self.name}: {label} output {index} is a {type(value).__name__}, not an "
                    f"array of the provider ({kinds})",
                    pytrace=False,
                )
        return tuple(out)

    def run(
        self,
        node: onnx.NodeProto | NodeInfo,
        opset: int,
        *inputs: Any,
        planned: Sequence[Any] = (),
    ) -> tuple[Any, ...]:
        """Run ``node`` at ``opset`` on ``inputs``; always a tuple of host outputs."""
        info, kdef = self.kernel(node, opset, inputs)
        return self.to_host(self.launch(info, kdef, inputs, planned), info.describe())

    def call(
        self, op: str, *inputs: Any, opset: int, n_out: int = 1, domain: str = "", **attrs: Any
    ) -> Any:
        """Run ``domain::op`` with ``attrs`` on ``inputs`` (None: an absent input); the output,
        or the tuple of them when the kernel returns several."""
        node = helper.make_node(
            op,
            ["" if x is None else f"i{k}" for k, x in enumerate(inputs)],
            [f"o{k}" for k in range(n_out)],
            domain=domain,
            **attrs,
        )
        outputs = self.run(node, opset, *inputs)
        return outputs[0] if len(outputs) == 1 else outputs

    # -- a model, through a session ---------------------------------------------------------
    def session_providers(self) -> list[str]:
        """The provider list of this test's sessions (skips when a fallback cannot run)."""
        if self.fallback_problem:
            pytest.skip(self.fallback_problem)
        return list(self.stack)

    def session(self, model: onnx.ModelProto, **options: Any) -> InferenceSession:
        """A session on the provider under test and its fallbacks that places every node on
        the provider under test (the fallbacks can only hold what it leaves: nothing)."""
        try:
            session = InferenceSession(model, providers=self.session_providers(), **options)
        except UnsupportedOpError as exc:
            if self.is_reference:
                raise
            self.unclaimed(str(exc))
        placed = session.placement()
        elsewhere = [f"{p.node or p.op} on {p.provider}" for p in placed if p.provider != self.name]
        if elsewhere:
            self.unclaimed(f"nodes placed elsewhere: {', '.join(elsewhere)}")
        if not any(p.provider == self.name for p in placed):
            pytest.fail(f"no node of the model runs on {self.name} (all folded?)", pytrace=False)
        return session

    def run_model(self, model: onnx.ModelProto, feeds: dict[str, Any]) -> list[np.ndarray]:
        """``session(model).run(None, feeds)``."""
        return self.session(model).run(None, feeds)

    def session_alone(self, model: onnx.ModelProto, **options: Any) -> InferenceSession:
        """A session on the provider under test alone (no fallback), for tests that expect it
        to refuse the model: skipped first when the provider has no kernel for some node's op
        at all (a refusal then would say nothing of its rules)."""
        opsets = {normalize_domain(i.domain): int(i.version) for i in model.opset_import}
        for node in model.graph.node:
            self.kernel(node, opsets.get(normalize_domain(node.domain), 1))
        return InferenceSession(model, providers=[self.name], cpu_fallback=False, **options)


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


def run_case_node(tester: OpTester, case: Any, inputs: list[Any]) -> tuple[Any, ...]:
    """Run the case's single node on the tester's provider; always a tuple of outputs."""
    node = case.model.graph.node[0]
    feeds = {vi.name: arr for vi, arr in zip(case.model.graph.input, inputs, strict=False)}
    args = [feeds[n] if n else None for n in node.input]
    return tester.run(node, case_opset(case), *args)


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


def run_case_on(tester: OpTester, case: Any) -> None:
    """Run every data set of ``case`` on the tester's provider and check each output."""
    n_out = len(case.model.graph.output)
    for i, (inputs, outputs) in enumerate(case.data_sets):
        got = run_case_node(tester, case, list(inputs))
        assert len(got) == n_out, f"{case.name}: {len(got)} outputs, expected {n_out}"
        for j, want in enumerate(outputs):
            assert_output_matches(
                f"{case.name}[set {i}] output {j}", got[j], want, case.rtol, case.atol
            )
