"""The shared executor: eager runs, memory-planned runs and per-slot graph capture/replay.

Per slot it keeps host capture state (binding signature, warm-up count, captured graph,
planned memory, counters), so a decode graph in PRIMARY and a verify graph in VERIFY live
side by side and both replay. The state machine for one bound run in slot ``s``::

    signature changed          -> reset s's graph (invalidations += 1), start over
    graph captured             -> run s's replay program (each provider's parts) (replays += 1)
    first run                  -> eager, record shapes, plan memory
    warm-up not done           -> eager on planned memory
    capture impossible/latched -> eager (fallbacks += 1, reason kept)
    otherwise                  -> capture into s                           (captures += 1)

Variants: a slot holds one graph per *variant* (an integer the caller picks, 0 by
default), each with its own signature, memory plan and program: a batched decode step
keeps one graph per batch-size bucket in PRIMARY, and switching buckets replays instead
of recapturing. Variant ``v``'s parts are numbered from ``v * VARIANT_PARTS`` in the
providers' graphs; the slot's counters are shared by its variants.

Mixed placement: a plan whose steps alternate providers is cut into segments
(``session.segments``). Each provider captures its segments as parts of its graph in ``s``;
values that cross between segments are copied into buffers planned on the reading provider
(an *edge*), before that segment runs. A captured run replays as a program: part replays
with the edge copies between them. Every provider keeps its own memory arena.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from onnx_genrt.core.errors import KernelError
from onnx_genrt.core.graph_slots import DeviceGraphSlot
from onnx_genrt.core.kernels import KernelContext
from onnx_genrt.core.locking import hold
from onnx_genrt.core.provider import ExecutionProvider

from .binding import IOBinding, Signature
from .layout import Layout, Record, plan_layout
from .plan import GraphPlan, describe_value
from .row_tail import RowTail, find_row_tail
from .segments import Segment, split_segments
from .slot_state import CaptureProgram, SlotState, SlotStats

__all__ = ["Executor", "Layout", "SlotState", "SlotStats"]

#: Part numbers reserved for each variant of a slot (segments of one variant count up from
#: ``variant * VARIANT_PARTS``).
VARIANT_PARTS = 1 << 16

#: Eager (unslotted) runs keep memory plans for this many distinct input shapes.
EAGER_PLAN_CACHE = 8


class Executor:
    """Runs a :class:`GraphPlan`; shared by every session API (run, bindings, slots)."""

    def __init__(self, plan: GraphPlan, *, graphs: bool = True, warmup_runs: int = 1) -> None:
        self.plan = plan
        self.graphs_enabled = graphs
        self.warmup_runs = max(1, warmup_runs)
        self.main_provider = plan.providers[0] if plan.providers else None
        self._slot = DeviceGraphSlot.PRIMARY
        self._states: dict[tuple[DeviceGraphSlot, int], SlotState] = {}
        self._stats: dict[DeviceGraphSlot, SlotStats] = {}
        self._eager_layouts: OrderedDict[tuple, Layout] = OrderedDict()
        self._graph_outputs = {o.name for o in plan.outputs}
        self._graph_inputs = {i.name for i in plan.inputs}
        self._consts: dict[tuple[int, str], Any] = {}
        self._step_args: list[list[tuple[str, Any]]] = []
        self._last_use: dict[str, int] = {}
        self._free_after: list[list[str]] = [[] for _ in plan.steps]
        self._row_tails: dict[str, RowTail | None] = {}
        self.segments: list[Segment] = split_segments(plan.steps, plan.constants)
        #: The providers the plan's steps run on (computed once: every run asks).
        self.providers: list[ExecutionProvider] = plan.providers
        self._prepare()

    # -- setup --------------------------------------------------------------
    def _prepare(self) -> None:
        for i, step in enumerate(self.plan.steps):
            args = []
            for index, name in enumerate(step.inputs):
                const = None
                if name and name in self.plan.constants:
                    const = self._constant_arg(step, index, name)
                args.append((name, const))
                if name and const is None:
                    self._last_use[name] = i
            self._step_args.append(args)
        for name, i in self._last_use.items():
            if name not in self._graph_outputs:
                self._free_after[i].append(name)

    def _constant_arg(self, step: Any, index: int, name: str) -> Any:
        """A constant input on the step's provider, in the kernel's prepacked layout if any.

        Each layout is made once per provider and shared by every step that asks for it.
        """
        provider, host = step.provider, self.plan.constants[name]
        prepack = step.kernel.prepack
        if prepack is not None:
            key = (id(provider), name, prepack)
            if key not in self._consts:
                self._consts[key] = prepack(provider, step.node, index, host)
            if self._consts[key] is not None:
                return self._consts[key]
        key = (id(provider), name)
        if key not in self._consts:
            self._consts[key] = provider.upload(host)
        return self._consts[key]

    # -- slots ----------------------------------------------------------------
    @property
    def graph_slot(self) -> DeviceGraphSlot:
        return self._slot

    def set_graph_slot(self, slot: DeviceGraphSlot) -> None:
        """Route later bound runs to ``slot``. Other slots keep their graphs."""
        self._slot = slot

    def state(self, slot: DeviceGraphSlot | None = None, variant: int = 0) -> SlotState:
        slot = self._slot if slot is None else slot
        state = self._states.get((slot, variant))
        if state is None:
            stats = self._stats.setdefault(slot, SlotStats())
            state = self._states[slot, variant] = SlotState(stats=stats)
        return state

    def stats(self, slot: DeviceGraphSlot | None = None) -> SlotStats:
        """The counters of ``slot`` (all its variants together)."""
        slot = self._slot if slot is None else slot
        return self._stats.setdefault(slot, SlotStats())

    def all_stats(self) -> dict[str, dict[str, Any]]:
        return {s.value: st.as_dict() for s, st in self._stats.items()}

    def variants(self, slot: DeviceGraphSlot) -> list[int]:
        """The variants of ``slot`` holding a captured graph."""
        return sorted(v for (s, v), st in self._states.items() if s == slot and st.captured)

    def reset_slot(
        self, slot: DeviceGraphSlot, signature: Signature | None = None, variant: int | None = None
    ) -> None:
        """Drop the slot's graph (every provider's parts), latch and planned memory, for
        one variant or (``variant=None``) all of them; other slots are untouched. Dropping
        a captured graph counts as an invalidation."""
        others = [v for v in self.variants(slot) if v != variant]
        if variant is not None and others:  # the other variants keep their graphs
            parts = range(variant * VARIANT_PARTS, (variant + 1) * VARIANT_PARTS)
            for provider in self.providers:
                if slot in provider.graph_slots:
                    provider.reset_parts(slot, parts)
            self._forget(slot, variant, signature)
            return
        # The whole slot: every part, and the latch of a failed capture (the next run
        # tries again).
        for provider in self.providers:
            if slot in provider.graph_slots:
                provider.reset_graph(slot)
        forget = [v for s, v in self._states if s == slot] if variant is None else [variant]
        for v in forget:
            self._forget(slot, v, signature)

    def _forget(self, slot: DeviceGraphSlot, variant: int, signature: Signature | None) -> None:
        state = self.state(slot, variant)
        if state.captured:
            state.stats.invalidations += 1
        state.captured = False
        state.signature = signature
        state.warmups = 0
        state.layout = None
        state.program = []

    def capture_blocker(self, slot: DeviceGraphSlot) -> str | None:
        """Why ``slot`` cannot be captured, or None when it can: every provider the plan
        runs on must hold the slot, and none may be latched after a failed capture."""
        for provider in self.providers:
            if slot not in provider.graph_slots:
                declared = ", ".join(sorted(s.value for s in provider.graph_slots)) or "none"
                return (
                    f"provider {provider.name!r} has no graph slot {slot.value!r} "
                    f"(declares: {declared})"
                )
            latched = provider.capture_error(slot)
            if latched:
                return f"capture failed earlier on {provider.name!r}: {latched}"
        return None

    # -- bound runs -----------------------------------------------------------
    def run_bound(
        self, binding: IOBinding, slot: DeviceGraphSlot | None = None, variant: int = 0
    ) -> None:
        """Run with persistent bindings in ``slot`` (default: the current graph slot), as
        the slot's graph ``variant``.

        Thread-safe: runs hold the locks of the plan's providers, one run at a time."""
        with hold(self.providers):
            self._run_bound(binding, self._slot if slot is None else slot, variant)

    def _run_bound(self, binding: IOBinding, slot: DeviceGraphSlot, variant: int) -> None:
        state = self.state(slot, variant)
        sig = binding.signature()
        if sig != state.signature:
            self.reset_slot(slot, sig, variant)
        env = dict(binding.inputs)
        outs = binding.outputs
        if state.captured and any(p.graph_owner(slot) is not self for p in self.providers):
            # Another session on a provider captured into the slot since: our graph is
            # gone (and the slot's pinned workspace may have moved). Capture again.
            state.captured = False
            state.stats.invalidations += 1
            state.stats.displaced += 1
        if state.captured:
            for action in state.program:
                action()
            state.stats.replays += 1
            return
        if state.layout is None:
            state.layout = self._execute_and_plan(env, outs)
            state.warmups = 1
            state.stats.eager_runs += 1
            return
        if not self.graphs_enabled or state.warmups < self.warmup_runs:
            self._execute(env, state.layout, outs)
            state.warmups += 1
            state.stats.eager_runs += 1
            return
        blocker = self.capture_blocker(slot)
        if blocker is not None:
            state.stats.fallbacks += 1
            state.stats.fallback_reasons[blocker] += 1
            state.stats.eager_runs += 1
            self._execute(env, state.layout, outs)
            return
        self._capture(slot, variant, state, env, outs)

    def _capture(
        self, slot: DeviceGraphSlot, variant: int, state: SlotState, env: dict, outs: Mapping
    ) -> None:
        """Capture every segment as a part of its provider's graph in ``slot`` (running the
        step once), and keep the replay program; on failure latch, drop the parts captured
        so far and run eagerly."""
        providers = self.providers
        for provider in providers:
            provider.workspace.pin(slot)
        capture = CaptureProgram(slot, self, state.stats, variant * VARIANT_PARTS)
        try:
            self._execute(dict(env), state.layout, outs, capture=capture)
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}"
            for provider in providers:
                if provider is capture.provider:
                    provider.abort_capture(slot, reason)
                provider.reset_parts(slot, capture.parts(provider))
                provider.workspace.unpin(slot)
            state.stats.fallbacks += 1
            state.stats.fallback_reasons[f"capture failed: {reason}"] += 1
            state.stats.eager_runs += 1
            self._execute(env, state.layout, outs)
            return
        state.program = capture.program
        state.captured = True
        state.stats.captures += 1

    # -- eager runs -------------------------------------------------------------
    def run(self, feeds: Mapping[str, Any], output_names: Sequence[str]) -> list[Any]:
        """Eager run on fresh outputs; memory planned per distinct input-shape set.

        Thread-safe (the provider locks are held): results never come from another run."""
        with hold(self.providers):
            return self._run(feeds, output_names)

    def _run(self, feeds: Mapping[str, Any], output_names: Sequence[str]) -> list[Any]:
        env = dict(feeds)
        layout = self._eager_run(env, {})
        results = []
        for name in output_names:
            value = env[name] if name in env else self._constant(name)
            # A host view into an arena would be overwritten by the next run; device
            # values are copied to the host by the caller before anything else runs.
            if isinstance(value, np.ndarray) and any(
                isinstance(arena, np.ndarray) and np.may_share_memory(value, arena)
                for arena in layout.arenas
            ):
                value = value.copy()
            results.append(value)
        return results

    def row_tail(self, output: str) -> RowTail | None:
        """The steps that make graph output ``output`` row by row from one projection, and
        the graph outputs they make (``session.row_tail``); None where there are none."""
        if output not in self._row_tails:
            self._row_tails[output] = find_row_tail(
                self.plan.steps, self.plan.constants, self._graph_outputs, output
            )
        return self._row_tails[output]

    def run_bound_eager(self, binding: IOBinding, last_row_of: str | None = None) -> None:
        """Run on bound buffers without any graph slot (prefill-like, varying shapes).

        ``last_row_of``: the steps of that output's :meth:`row_tail` see only the last row
        (token) of their input, so the tail's outputs are bound with one row; every other
        value is computed for all rows. A prefill wants the last row's logits only.
        """
        tail = None
        if last_row_of is not None:
            tail = self.row_tail(last_row_of)
            if tail is None:
                raise KernelError(
                    f"output {last_row_of!r} is not made row by row from one projection "
                    "(a MatMul on a constant weight, a MatMulNBits or a norm fused into one, "
                    "then row-local ops), so it cannot be computed for the last row alone"
                )
        with hold(self.providers):
            self._eager_run(dict(binding.inputs), binding.outputs, tail)

    def _eager_run(
        self, env: dict[str, Any], outs: Mapping[str, Any], tail: RowTail | None = None
    ) -> Layout:
        shapes = tuple((n, str(v.dtype), tuple(v.shape)) for n, v in sorted(env.items()))
        key = (tail, shapes)
        layout = self._eager_layouts.get(key)
        if layout is None:
            layout = self._execute_and_plan(env, outs, bind_outputs=False, tail=tail)
            self._eager_layouts[key] = layout
            if len(self._eager_layouts) > EAGER_PLAN_CACHE:
                self._eager_layouts.popitem(last=False)
        else:
            self._eager_layouts.move_to_end(key)
            self._execute(env, layout, outs, tail=tail)
        return layout

    def _constant(self, name: str) -> Any:
        return self.plan.constants[name]

    def _execute(
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
        contexts = layout.contexts if layout is not None else None
        steps = self.plan.steps
        for segment in self.segments:
            provider = segment.provider
            moved = self._bring_in(segment, env, layout, capture)
            if capture is not None:
                capture.begin(segment)
            crossing: list[Callable[[], None]] = []
            for i in range(segment.start, segment.stop):
                step = steps[i]
                try:
                    args = [
                        (const if const is not None else moved.get(name, env[name]))
                        if name
                        else None
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
                ctx = contexts[i] if contexts else KernelContext(step.node, provider)
                try:
                    result = provider.launch(step.kernel, ctx, args)
                except Exception as exc:
                    inputs = ", ".join(
                        f"{n}={describe_value(a)}" for n, a in zip(step.inputs, args, strict=False)
                    )
                    raise KernelError(
                        f"{step.node.describe()} failed: {type(exc).__name__}: {exc} "
                        f"(inputs: {inputs})"
                    ) from exc
                results = result if type(result) in (tuple, list) else (result,)
                if record is not None:
                    record.step(i, step, args, results)
                for name, value in zip(step.outputs, results, strict=False):
                    if not name:
                        continue
                    target = outs.get(name)
                    if target is not None and value is not target:
                        _check_fits(value, target, step, name)
                        if provider.holds(target):
                            _copy(provider, value, target)
                            value = target
                        else:  # a bound buffer of another provider: after the segment
                            crossing.append(self._transfer(value, provider, target))
                    env[name] = value
                for name in self._free_after[i]:
                    env.pop(name, None)
            if capture is not None:
                capture.end(segment)
            for copy in crossing:
                copy()
                if capture is not None:
                    capture.program.append(capture.counted(copy))
        for name, target in outs.items():
            if name in self._graph_inputs and env.get(name) is not target:
                value, where = env[name], "graph input"  # an input that is also an output
            elif name not in env and name in self.plan.constants:
                value, where = self._const_for(name), "constant"
            else:
                continue
            _check_fits(value, target, None, name, where)
            copy = functools.partial(_copy, self.main_provider, value, target)
            copy()
            if capture is not None:  # a replay writes the binding too
                capture.program.append(copy)

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

    def _const_for(self, name: str) -> Any:
        key = (id(self.main_provider), name)
        if key not in self._consts:
            self._consts[key] = self.main_provider.upload(self.plan.constants[name])
        return self._consts[key]

    # -- planning ---------------------------------------------------------------
    def _execute_and_plan(
        self,
        env: dict[str, Any],
        outs: Mapping[str, Any],
        bind_outputs: bool = True,
        tail: RowTail | None = None,
    ) -> Layout:
        """Eager run that records every value's shape, then plans memory from them."""
        inputs = set(env)
        record = Record()
        self._execute(env, None, outs, record, tail)
        bound = outs if bind_outputs else {}
        return plan_layout(
            record,
            self.plan.steps,
            self.segments,
            inputs,
            self._graph_outputs,
            self._last_use,
            bound,
        )

    def peak_bytes(self, slot: DeviceGraphSlot | None = None) -> tuple[int, int] | None:
        """(arena bytes, naive bytes) of the slot's memory plans, all providers, once
        planned."""
        layout = self.state(slot).layout
        if layout is None:
            return None
        return (
            sum(m.arena_bytes for _, m in layout.memory),
            sum(m.naive_bytes for _, m in layout.memory),
        )


def _check_fits(value: Any, target: Any, step: Any, name: str, where: str = "") -> None:
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


def _last_row(value: Any, step: Any) -> Any:
    """The last row (axis -2) of an activation, as a view."""
    if value is None or len(value.shape) < 2:
        shape = None if value is None else list(value.shape)
        raise KernelError(f"{step.node.describe()}: no rows to take the last of in {shape}")
    return value[..., -1:, :]
