"""InferenceSession: the onnxruntime-like entry point."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from onnx_genrt.core.errors import (
    InvalidInputError,
    KernelError,
    ProviderUnavailableError,
    UnsupportedOpError,
)
from onnx_genrt.core.graph_slots import DeviceGraphSlot
from onnx_genrt.core.locking import hold
from onnx_genrt.core.provider import ExecutionProvider

from .binding import IOBinding
from .device_io import DeviceIO
from .executor import Executor, LaunchHook, SlotStats
from .plan import GraphPlan, ValueSpec, build_plan
from .row_tail import RowTail
from .weights import release_pages, trim_heap

if TYPE_CHECKING:  # onnx is imported when a model is read, not with the engine
    import onnx

    from .loader import LoadedModel

ProviderArg = str | ExecutionProvider | tuple[str, Mapping[str, Any]]


def resolve_providers(providers: Sequence[ProviderArg] | None) -> list[ExecutionProvider]:
    """Names (``"cpu"``, ``"CPUExecutionProvider"``), instances or ``(name, options)`` pairs."""
    from onnx_genrt.core.registry import get_registry

    registry = get_registry()
    if not providers:
        providers = ["cpu"]
    out: list[ExecutionProvider] = []
    for p in providers:
        if isinstance(p, ExecutionProvider):
            out.append(p)
            continue
        name, options = (p, {}) if isinstance(p, str) else (p[0], dict(p[1]))
        out.append(registry.create(_short_name(name), **options))
    if not out:
        raise ProviderUnavailableError("no provider given")
    return out


def _short_name(name: str) -> str:
    n = name.lower()
    return n[: -len("executionprovider")] if n.endswith("executionprovider") else n


def _loaded(
    model: str | os.PathLike[str] | bytes | onnx.ModelProto | LoadedModel,
) -> tuple[LoadedModel, bool]:
    """The model loaded (external weights mapped from a path), and whether the session owns
    its proto: a caller's ``ModelProto`` is read, never changed."""
    import onnx

    from .loader import LoadedModel, load_model, open_model

    if isinstance(model, LoadedModel):
        return model, True
    if isinstance(model, onnx.ModelProto):
        return LoadedModel(load_model(model)), False
    return open_model(model), True


@dataclass(frozen=True)
class PlacedNode:
    """One step of a session's plan, as :meth:`InferenceSession.placement` reports it."""

    node: str
    op: str
    provider: str
    kernel: str
    fused: bool


class InferenceSession:
    """Load an ONNX model, plan it and run it: ``InferenceSession(path).run(None, feeds)``.

    ``providers`` is a priority list, as in onnxruntime: a node runs on the first that
    supports it (asked with the node and its input types), and values are copied where
    they cross providers. When some node is supported by none of them, the CPU provider is
    appended as the fallback (``cpu_fallback=False`` refuses instead); :meth:`placement`
    says where each node runs. ``enable_graphs`` turns graph capture of bound runs on
    (default) or off, for comparison.

    Threads: a session may be shared. Runs hold the locks of its providers, so they run one
    at a time and each returns its own results. An :class:`IOBinding` is its caller's set of
    buffers: threads that share one share its values.
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | bytes | onnx.ModelProto | LoadedModel,
        providers: Sequence[ProviderArg] | None = None,
        *,
        enable_graphs: bool = True,
        warmup_runs: int = 1,
        cpu_fallback: bool = True,
    ) -> None:
        loaded, owned = _loaded(model)
        self.model = loaded.proto
        self.providers = resolve_providers(providers)
        try:
            self.plan: GraphPlan = build_plan(self.model, self.providers, loaded.weights)
        except UnsupportedOpError:
            if not cpu_fallback or any(p.name == "cpu" for p in self.providers):
                raise
            self.providers.append(resolve_providers(["cpu"])[0])
            self.plan = build_plan(self.model, self.providers, loaded.weights)
        for name, array in loaded.weights.items():
            if self.plan.constants.get(name) is not array:  # fused or folded into another
                release_pages(array)
        del loaded  # the plan holds the mapped weights it uses
        if owned:  # the plan holds the weights: the proto's copies of them can go
            from .loader import without_initializer_bytes

            self.model = without_initializer_bytes(self.model)
        self.executor = Executor(self.plan, graphs=enable_graphs, warmup_runs=warmup_runs)
        self._inputs = {s.name: s for s in self.plan.inputs}
        self._outputs = {s.name: s for s in self.plan.outputs}
        #: Host <-> device transfers on this session's main provider (the engine's road).
        self.device_io = DeviceIO(self.main_provider)
        self._enable_graphs, self._warmup_runs = enable_graphs, warmup_runs
        trim_heap()  # what loading freed (the proto's weight bytes, prepack temporaries)

    def sibling(
        self, model: str | os.PathLike[str] | bytes | onnx.ModelProto | LoadedModel
    ) -> InferenceSession:
        """A session for another model on this session's provider instances (their streams
        and graph slots), with the same graph settings: its bound runs may read this
        session's buffers."""
        return InferenceSession(
            model,
            providers=list(self.providers),
            enable_graphs=self._enable_graphs,
            warmup_runs=self._warmup_runs,
        )

    # -- metadata ---------------------------------------------------------------
    @property
    def main_provider(self) -> ExecutionProvider:
        return self.executor.main_provider or self.providers[0]

    def get_inputs(self) -> list[ValueSpec]:
        return list(self.plan.inputs)

    def get_outputs(self) -> list[ValueSpec]:
        return list(self.plan.outputs)

    def get_providers(self) -> list[str]:
        return [p.name for p in self.providers]

    def placement(self) -> list[PlacedNode]:
        """Where each step of the plan runs, in order: node, op, provider, kernel, and
        whether the step is a fusion of several of the model's nodes (a node of the body
        that runs an ``onnx_genrt`` node no provider has is not)."""
        original = {n.name for n in self.model.graph.node} | set(self.plan.bodies)
        return [
            PlacedNode(
                node=s.node.name,
                op=f"{s.node.domain or 'ai.onnx'}::{s.node.op_type}",
                provider=s.provider.name,
                kernel=getattr(s.kernel.fn, "__qualname__", repr(s.kernel.fn)),
                fused=s.node.name not in original,
            )
            for s in self.plan.steps
        ]

    def input_spec(self, name: str) -> ValueSpec:
        try:
            return self._inputs[name]
        except KeyError:
            raise InvalidInputError(
                f"model has no input {name!r}; inputs are {sorted(self._inputs)}"
            ) from None

    def output_spec(self, name: str) -> ValueSpec:
        try:
            return self._outputs[name]
        except KeyError:
            raise InvalidInputError(
                f"model has no output {name!r}; outputs are {sorted(self._outputs)}"
            ) from None

    @staticmethod
    def check_shape(name: str, shape: tuple[int, ...], declared: tuple | None) -> None:
        """Refuse a feed whose rank or fixed dims differ from the declaration. A dim of 0 is
        fixed (an empty axis); a named or negative one is free, as in onnxruntime."""
        if declared is None:
            return
        if len(shape) != len(declared):
            raise InvalidInputError(
                f"input {name!r} has rank {len(shape)} (shape {list(shape)}), model declares "
                f"rank {len(declared)} ({list(declared)})"
            )
        for axis, (got, want) in enumerate(zip(shape, declared, strict=True)):
            if isinstance(want, int) and want >= 0 and got != want:
                raise InvalidInputError(
                    f"input {name!r} dimension {axis} is {got}, model declares {want} "
                    f"(shape {list(shape)} vs {list(declared)})"
                )

    # -- running ------------------------------------------------------------------
    def exclusive(self) -> AbstractContextManager[None]:
        """Hold this session's providers for a sequence of runs and reads (re-entrant).

        Every run already holds them; a caller that runs and then reads bound outputs (a
        decode step) holds them across both, so no other thread's run comes in between.
        """
        return hold(self.providers)

    def run(self, output_names: Sequence[str] | None, feeds: Mapping[str, Any]) -> list[np.ndarray]:
        """Run once on host feeds; returns host numpy arrays in ``output_names`` order."""
        names = list(output_names) if output_names else [o.name for o in self.plan.outputs]
        for n in names:
            self.output_spec(n)
        checked = {name: self._check_feed(name, value) for name, value in feeds.items()}
        missing = [n for n in self._inputs if n not in checked]
        if missing:
            raise InvalidInputError(
                f"missing inputs {missing}; the model needs {sorted(self._inputs)}"
            )
        with self.exclusive():  # device results may live in the run's arena until read
            results = self.executor.run(checked, names)
            host = [self.executor.to_host(r) for r in results]
        for name, value in zip(names, host, strict=True):
            self._check_result(name, value)
        return host

    def _check_result(self, name: str, value: np.ndarray) -> None:
        """A result must have the element type the model declares for that output."""
        declared = self._outputs[name].dtype
        if declared is not None and value.dtype != declared:
            raise KernelError(
                f"output {name!r} came back as {value.dtype}, but the model declares {declared}: "
                "the graph computes another type than its output says (fix the output's "
                "declared type or add a Cast)"
            )

    def _check_feed(self, name: str, value: Any) -> Any:
        spec = self.input_spec(name)
        arr = value if hasattr(value, "dtype") and hasattr(value, "shape") else np.asarray(value)
        if spec.dtype is not None and arr.dtype != spec.dtype:
            raise InvalidInputError(f"input {name!r} expects {spec.dtype}, got {arr.dtype}")
        self.check_shape(name, tuple(int(d) for d in arr.shape), spec.shape)
        return arr

    def io_binding(self) -> IOBinding:
        return IOBinding(self)

    def run_with_iobinding(
        self, binding: IOBinding, slot: DeviceGraphSlot | None = None, variant: int = 0
    ) -> None:
        """Run on bound buffers, replaying the slot's graph when its signature is unchanged.

        ``variant`` picks one of several graphs the slot keeps side by side (one per batch
        bucket of a batched decode step, say); each is captured once and replayed."""
        binding.check_complete(self._inputs, self._outputs)
        self.executor.run_bound(binding, slot, variant)

    def run_eager_with_iobinding(self, binding: IOBinding, last_row_of: str | None = None) -> None:
        """Run on bound buffers without a graph slot (a prefill: shapes vary). With
        ``last_row_of``, that output and those of its :meth:`row_tail` are computed for the
        last row only (bind them with one row)."""
        self.executor.run_bound_eager(binding, last_row_of)

    def row_tail(self, output: str) -> RowTail | None:
        """The steps that make ``output`` row by row from one projection, and the outputs
        they make; None where the output is not made so (see :meth:`run_eager_with_iobinding`)."""
        return self.executor.row_tail(output)

    def on_launch(self, hook: LaunchHook) -> AbstractContextManager[None]:
        """Call ``hook(node)`` around every kernel launch of this session while the
        returned context manager is open: the context manager ``hook`` returns is entered
        right before each launch and exited right after it.

        Hooks see the eager runs (``run``, prefills, warm-up and capture runs) node by
        node, in plan order; a replayed graph launches no kernel one by one, so they see
        none of it. A profiler times nodes this way::

            with session.on_launch(timed):  # timed(node) -> a context manager
                session.run(None, feeds)
        """
        return self.executor.on_launch(hook)

    # -- graph slots ---------------------------------------------------------------
    def set_graph_slot(self, slot: DeviceGraphSlot) -> None:
        self.executor.set_graph_slot(slot)

    @property
    def graph_max_rows(self) -> int | None:
        """The most rows (tokens of one step, batch rows folded in) a graph of this session
        can record on every provider it captures on (``ExecutionProvider.graph_max_rows``);
        None when any number can. A wider step still runs, eagerly, as a counted fallback."""
        limits = [
            p.graph_max_rows
            for p in self.executor.providers
            if p.graph_slots and p.graph_max_rows is not None
        ]
        return min(limits) if limits else None

    def graph_stats(self, slot: DeviceGraphSlot | str | None = None) -> SlotStats:
        """The counters of ``slot`` (a slot or its name, such as ``"verify"``; default: the
        current slot), all its variants together. The object is live (later runs update
        it): copy it, or read ``all_graph_stats()``, to compare before and after."""
        return self.executor.stats(slot)

    def all_graph_stats(self) -> dict[str, dict[str, Any]]:
        """The counters of every slot used so far, by slot name."""
        return self.executor.all_stats()
