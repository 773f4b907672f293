"""Example third-party provider on the v1 contract (provider API 1.1).

A host-memory device named ``example`` with its own array type, five float kernels
(Add, Mul, MatMul, Relu, Softmax), and recorded graphs in three slots, one recording per
(slot, part). Everything else a model needs runs on the fallback provider.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from onnx_genrt.core.device import Device
from onnx_genrt.core.graph_slots import DeviceGraphSlot
from onnx_genrt.core.hookspecs import hookimpl
from onnx_genrt.core.kernels import KernelContext, KernelDef, KernelRegistry, NodeInfo, TensorType
from onnx_genrt.core.provider import ExecutionProvider
from onnx_genrt.core.registry import ProviderSpec

#: The element types these kernels take.
FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


class ExampleArray(np.ndarray):
    """Memory of the ``example`` device: host bytes that other providers must copy in."""


def floats_only(node: NodeInfo, input_types: Sequence[TensorType | None]) -> str | None:
    """Refuse a node whose inputs are known not to be float32 or float64."""
    for index, t in enumerate(input_types):
        if t is not None and t.dtype is not None and np.dtype(t.dtype) not in FLOATS:
            return (
                f"{node.describe()}: input {index} is {np.dtype(t.dtype)}; "
                "the example kernels take float32 and float64 only"
            )
    return None


KERNELS = KernelRegistry()


@KERNELS.register("Add", since=7, check=floats_only)
def add(ctx: KernelContext, a: ExampleArray, b: ExampleArray) -> ExampleArray:
    return np.add(a, b)


@KERNELS.register("Mul", since=7, check=floats_only)
def mul(ctx: KernelContext, a: ExampleArray, b: ExampleArray) -> ExampleArray:
    return np.multiply(a, b)


@KERNELS.register("Relu", since=6, check=floats_only)
def relu(ctx: KernelContext, x: ExampleArray) -> ExampleArray:
    return np.maximum(x, np.zeros((), x.dtype))


@KERNELS.register("MatMul", since=1, check=floats_only)
def matmul(ctx: KernelContext, a: ExampleArray, b: ExampleArray) -> ExampleArray:
    return np.matmul(a, b)


@KERNELS.register("Softmax", since=13, check=floats_only)
def softmax(ctx: KernelContext, x: ExampleArray) -> ExampleArray:
    axis = ctx.attr("axis", -1)
    shifted = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return shifted / np.sum(shifted, axis=axis, keepdims=True)


class ExampleProvider(ExecutionProvider):
    """Runs on the host under the device name ``example`` and records graphs in three slots.

    A graph here is the list of kernel launches and copies made while capturing; a replay
    runs them again on the same buffers, writing each result where it was first written.
    """

    name = "example"
    GRAPH_SLOTS = frozenset(DeviceGraphSlot)
    CAPTURE_EXECUTES = True
    ARRAY_TYPES = (ExampleArray,)

    def __init__(self) -> None:
        super().__init__()
        self._graphs: dict[tuple[DeviceGraphSlot, int], list[Callable[[], None]]] = {}
        self._recording: list[Callable[[], None]] | None = None

    # -- memory and transfer ----------------------------------------------------
    @property
    def device(self) -> Device:
        return Device("example")

    @property
    def kernels(self) -> KernelRegistry:
        return KERNELS

    def empty(self, shape: Sequence[int], dtype: Any) -> ExampleArray:
        return np.empty(tuple(shape), np.dtype(dtype)).view(ExampleArray)

    def upload(self, host: Any, out: ExampleArray | None = None) -> ExampleArray:
        if isinstance(host, ExampleArray) and out is None:
            return host
        if out is None:
            return np.array(host, copy=True, order="C").view(ExampleArray)
        np.copyto(out, host, casting="unsafe")
        return out

    def read(self, arrays: Sequence[Any]) -> list[np.ndarray]:
        return [np.array(a, copy=True).view(np.ndarray) for a in arrays]

    def copy(self, src: ExampleArray, dst: ExampleArray) -> None:
        np.copyto(dst, src)
        if self._recording is not None:
            self._recording.append(lambda s=src, d=dst: np.copyto(d, s))

    # -- kernels ------------------------------------------------------------------
    def launch(self, kdef: KernelDef, ctx: KernelContext, inputs: Sequence[Any]) -> Any:
        result = kdef.fn(ctx, *inputs)
        if self._recording is not None:

            def again(fn=kdef.fn, ctx=ctx, args=tuple(inputs), out=result) -> None:
                np.copyto(out, fn(ctx, *args))

            self._recording.append(again)
        return result

    # -- graphs: one recording per (slot, part) -----------------------------------
    def graph_begin(self, slot: DeviceGraphSlot, part: int) -> None:
        self._recording = []

    def graph_end(self, slot: DeviceGraphSlot, part: int) -> None:
        self._graphs[(slot, part)] = self._recording or []
        self._recording = None

    def graph_abort(self, slot: DeviceGraphSlot, part: int) -> None:
        self._recording = None

    def graph_replay(self, slot: DeviceGraphSlot, part: int) -> None:
        for call in self._graphs[(slot, part)]:
            call()

    def graph_reset(self, slot: DeviceGraphSlot, part: int) -> None:
        self._graphs.pop((slot, part), None)

    def graph_exists(self, slot: DeviceGraphSlot, part: int) -> bool:
        return (slot, part) in self._graphs


@hookimpl
def register_providers(register: Callable[[ProviderSpec], None]) -> None:
    """The entry point's hook: one provider named ``example``, written for provider API 1.1
    (``onnx_genrt.core.PROVIDER_API_VERSION``; a newer minor of the runtime loads it)."""
    register(
        ProviderSpec(
            "example", factory=ExampleProvider, description="example plugin", api_version=(1, 1)
        )
    )
