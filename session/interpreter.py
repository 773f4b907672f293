"""The interpreter: runs a plan's steps once, eagerly, segment by segment.

Each step's kernel is launched on its provider with its inputs (constants prepared once by
the ``ConstantCache``) and a ``KernelContext`` that hands out the planned output buffers
of a ``Layout`` (or fresh ones on a first run). Values a segment reads from another
provider are copied in first (through the host, the one currency every provider speaks);
results bound to buffers are written there. The same walk serves a first run that records
shapes, a planned run and a capture (``CaptureProgram``).

Launch hooks (:meth:`Interpreter.on_launch`) see every kernel launch of those walks, in
order, with the node; a graph replay launches nothing here, so hooks see none of it.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import numpy as np

from onnx_genrt.core.errors import KernelError
from onnx_genrt.core.kernels import KernelContext, NodeInfo
from onnx_genrt.core.provider import ExecutionProvider

from .constant_cache import ConstantCache
from .layout import Layout, Record
from .plan import GraphPlan, Step, describe_value
from .row_tail import RowTail
from .segments import Segment
from .slot_state import CaptureProgram

#: Called with the node of each kernel launch; the context manager it returns is entered
#: right before the launch and exited right after it (with the launch's exception, if any).
LaunchHook = Callable[[NodeInfo], AbstractContextManager[Any]]


@dataclass
class _Walk:
    """One walk over the plan: its values and what it writes, records or captures."""

    env: dict[str, Any]
    layout: Layout | None
    outs: Mapping[str, Any]
    record: Record | None
    tail: RowTail | None
    capture: CaptureProgram | None
    hooks: tuple[LaunchHook, ...]


class Interpreter:
    """Runs a plan's steps eagerly on planned (or, on a first run, fresh) buffers."""

    def __init__(
        self,
        plan: GraphPlan,
        segments: Sequence[Segment],
        constants: ConstantCache,
        free_after: Sequence[Sequence[str]],
    ) -> None:
        self.segments = segments
        self.providers: list[ExecutionProvider] = plan.providers
        self.main_provider = plan.providers[0] if plan.providers else None
        self._steps = plan.steps
        self._constants = constants
        self._free_after = free_after
        self._graph_inputs = {i.name for i in plan.inputs}
        #: Per step: (input name, the constant's prepared array or None) per input.
        self._step_args: list[list[tuple[str, Any]]] = [
            [
                (name, constants.for_step(step, index, name) if name in constants else None)
                for index, name in enumerate(step.inputs)
            ]
            for step in plan.steps
        ]
        self._launch_hooks: tuple[LaunchHook, ...] = ()

    # -- launch hooks -----------------------------------------------------------
    @contextlib.contextmanager
    def on_launch(self, hook: LaunchHook) -> Iterator[None]:
        """Call ``hook(node)`` around every kernel launch while the block runs.

        The context manager ``hook`` returns is entered right before the node's kernel is
        launched and exited right after it; hooks nest in the order they were added. A walk
        takes the hooks present when it starts. Hooks see the launches of every thread's
        runs; without hooks a launch goes straight to the provider.
        """
        self._launch_hooks = (*self._launch_hooks, hook)
        try:
            yield
        finally:
            hooks = list(self._launch_hooks)
            last = max(i for i, h in enumerate(hooks) if h is hook)
            self._launch_hooks = (*hooks[:last], *hooks[last + 1 :])

    def _launch_hooked(
        self,
        hooks: tuple[LaunchHook, ...],
        provider: ExecutionProvider,
        step: Step,
        ctx: KernelContext,
        args: list[Any],
    ) -> Any:
        with contextlib.ExitStack() as stack:
            for hook in hooks:
                stack.enter_context(hook(step.node))
            return _launch(provider, step, ctx, args)

    # -- walks --------------------------------------------------------------------
    def first_run(
        self, env: dict[str, Any], outs: Mapping[str, Any], tail: RowTail | None = None
    ) -> Record:
        """An eager run on fresh buffers that records every value's shape (for planning)."""
        record = Record()
        self.execute(env, None, outs, record, tail)
        return record

    def execute(
        self,
        env: dict[str, Any],
        layout: Layout | None,
        outs: Mapping[str, Any],
        record: Record | None = None,
        tail: RowTail | None = None,
        capture: CaptureProgram | None = None,
    ) -> None:
        """Run every step, segment by segment; ``env`` starts with the inputs and ends with
        every live value. With ``tail``, its first step reads the last row of its row
        inputs only. With ``capture``, each segment is captured as a part of its
        provider's graph and the replay program is collected."""
        walk = _Walk(env, layout, outs, record, tail, capture, self._launch_hooks)
        for segment in self.segments:
            self._run_segment(segment, walk)
        self._write_unmade_outputs(walk)

    def _run_segment(self, segment: Segment, walk: _Walk) -> None:
        provider, env, capture = segment.provider, walk.env, walk.capture
        moved = self._bring_in(segment, env, walk.layout, capture)
        if capture is not None:
            capture.begin(segment)
        contexts = walk.layout.contexts if walk.layout is not None else None
        crossing: list[Callable[[], None]] = []
        for i in range(segment.start, segment.stop):
            step = self._steps[i]
            args = self._args(i, step, env, moved, walk.tail)
            ctx = contexts[i] if contexts else KernelContext(step.node, provider)
            if walk.hooks:
                result = self._launch_hooked(walk.hooks, provider, step, ctx, args)
            else:
                result = _launch(provider, step, ctx, args)
            results = result if type(result) in (tuple, list) else (result,)
            if walk.record is not None:
                walk.record.step(i, step, args, results)
            self._keep_results(step, provider, results, walk, crossing)
            for name in self._free_after[i]:
                env.pop(name, None)
        if capture is not None:
            capture.end(segment)
        for copy in crossing:
            copy()
            if capture is not None:
                capture.program.append(capture.counted(copy))

    def _args(
        self,
        i: int,
        step: Step,
        env: Mapping[str, Any],
        moved: Mapping[str, Any],
        tail: RowTail | None,
    ) -> list[Any]:
        """Step ``i``'s inputs: constants, copies brought in, or values of ``env``."""
        try:
            args = [
                (const if const is not None else moved.get(name, env[name])) if name else None
                for name, const in self._step_args[i]
            ]
        except KeyError as missing:
            raise KernelError(
                f"value {missing.args[0]!r} is needed by {step.node.describe()} but was "
                "not computed or fed"
            ) from None
        if tail is not None and i == tail.start:  # its row inputs: every non-constant
            for index, (name, const) in enumerate(self._step_args[i]):
                if name and const is None:
                    args[index] = _last_row(args[index], step)
        return args

    def _keep_results(
        self,
        step: Step,
        provider: ExecutionProvider,
        results: Sequence[Any],
        walk: _Walk,
        crossing: list[Callable[[], None]],
    ) -> None:
        """Put a step's results in ``walk.env``; bound ones are written into their buffers
        (a buffer of another provider after the segment, through ``crossing``)."""
        for name, value in zip(step.outputs, results, strict=False):
            if not name:
                continue
            target = walk.outs.get(name)
            if target is not None and value is not target:
                _check_fits(value, target, step, name)
                if provider.holds(target):
                    _copy(provider, value, target)
                    value = target
                else:
                    crossing.append(self._transfer(value, provider, target))
            walk.env[name] = value

    def _write_unmade_outputs(self, walk: _Walk) -> None:
        """Write the bound outputs no step makes: graph inputs that are also outputs, and
        constant outputs."""
        for name, target in walk.outs.items():
            if name in self._graph_inputs and walk.env.get(name) is not target:
                value, where = walk.env[name], "graph input"
            elif name not in walk.env and name in self._constants:
                value, where = self._constants.on(self.main_provider, name), "constant"
            else:
                continue
            _check_fits(value, target, None, name, where)
            copy = functools.partial(_copy, self.main_provider, value, target)
            copy()
            if walk.capture is not None:  # a replay writes the binding too
                walk.capture.program.append(copy)

    # -- values crossing providers ------------------------------------------------
    def _bring_in(
        self,
        segment: Segment,
        env: Mapping[str, Any],
        layout: Layout | None,
        capture: CaptureProgram | None,
    ) -> dict[str, Any]:
        """The segment's copies of values it reads that its provider does not hold (fed
        host arrays, other providers' results), each in a buffer kept in ``layout``."""
        provider = segment.provider
        moved: dict[str, Any] = {}
        for name in segment.reads:
            value = env.get(name)
            if value is None or provider.holds(value):
                continue
            if layout is None:  # a first run: no planned buffers yet
                moved[name] = provider.upload(self.to_host(value))
                continue
            key = (name, segment.index)
            dst = layout.edges.get(key)
            if dst is None or tuple(dst.shape) != tuple(value.shape) or dst.dtype != value.dtype:
                dst = provider.empty(tuple(value.shape), value.dtype)
                layout.edges[key] = dst
            copy = self._transfer(value, self._holder(value), dst)
            copy()
            if capture is not None:
                capture.program.append(capture.counted(copy))
            moved[name] = dst
        return moved

    def _holder(self, value: Any) -> ExecutionProvider | None:
        """The plan's provider that holds ``value``; None for a host array no provider
        claims."""
        for provider in self.providers:
            if provider.holds(value):
                return provider
        if isinstance(value, np.ndarray):
            return None
        raise KernelError(
            f"a {type(value).__name__} was fed or bound, but no provider of this session "
            f"({', '.join(p.name for p in self.providers)}) holds that array type"
        )

    def to_host(self, value: Any) -> np.ndarray:
        """``value`` (any provider's array of this plan, or a host array) as a numpy array."""
        holder = self._holder(value)
        return (
            np.asarray(value)
            if holder is None or isinstance(value, np.ndarray)
            else holder.read([value])[0]
        )

    def _transfer(
        self, src: Any, src_holder: ExecutionProvider | None, dst: Any
    ) -> Callable[[], None]:
        """A copy of ``src`` into ``dst`` (a buffer of another provider, or a host array),
        through the host: the one currency every provider speaks."""
        dst_holder = self._holder(dst)

        def read() -> np.ndarray:
            return np.asarray(src) if src_holder is None else src_holder.read([src])[0]

        if dst_holder is None:
            return lambda: np.copyto(dst, read(), casting="unsafe")
        return lambda: dst_holder.upload(read(), out=dst)


def _launch(provider: ExecutionProvider, step: Step, ctx: KernelContext, args: list[Any]) -> Any:
    """``provider.launch`` of the step's kernel; a failure becomes a ``KernelError`` naming
    the node and describing its inputs."""
    try:
        return provider.launch(step.kernel, ctx, args)
    except Exception as exc:
        inputs = ", ".join(
            f"{n}={describe_value(a)}" for n, a in zip(step.inputs, args, strict=False)
        )
        raise KernelError(
            f"{step.node.describe()} failed: {type(exc).__name__}: {exc} (inputs: {inputs})"
        ) from exc


def _check_fits(value: Any, target: Any, step: Step | None, name: str, where: str = "") -> None:
    where = step.node.describe() if step is not None else where
    if tuple(value.shape) != tuple(target.shape):
        raise KernelError(
            f"output {name!r} of {where} has shape {list(value.shape)}, but the bound buffer "
            f"has shape {list(target.shape)}"
        )
    if value.dtype != target.dtype:
        raise KernelError(
            f"output {name!r} of {where} is {value.dtype}, but the bound buffer is {target.dtype}"
        )


def _copy(provider: ExecutionProvider, value: Any, target: Any) -> None:
    provider.copy(value, target)


def _last_row(value: Any, step: Step) -> Any:
    """The last row (axis -2) of an activation, as a view."""
    if value is None or len(value.shape) < 2:
        shape = None if value is None else list(value.shape)
        raise KernelError(f"{step.node.describe()}: no rows to take the last of in {shape}")
    return value[..., -1:, :]
