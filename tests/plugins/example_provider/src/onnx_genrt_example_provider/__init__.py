"""Example third-party provider: host memory, a few numpy kernels, one recorded graph."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from onnx_genrt.core.device import Device
from onnx_genrt.core.dtypes import DType
from onnx_genrt.core.graph_slots import DeviceGraphSlot
from onnx_genrt.core.hookspecs import hookimpl
from onnx_genrt.core.kernels import KernelRegistry
from onnx_genrt.core.provider import ExecutionProvider
from onnx_genrt.core.registry import ProviderSpec
from onnx_genrt.core.tensor import Tensor

KERNELS = KernelRegistry()


@KERNELS.register("Add", since=7)
def add(ctx, a, b):
    return np.add(a, b)


@KERNELS.register("Mul", since=7)
def mul(ctx, a, b):
    return np.multiply(a, b)


@KERNELS.register("Relu", since=6)
def relu(ctx, x):
    return np.maximum(x, np.zeros((), x.dtype))


@KERNELS.register("MatMul", since=1)
def matmul(ctx, a, b):
    return np.matmul(a, b)


class ExampleProvider(ExecutionProvider):
    """Runs on the host under the device name ``example``; holds a single graph."""

    name = "example"
    CAPTURE_EXECUTES = True

    def __init__(self) -> None:
        super().__init__()
        self._calls: list = []
        self._recording: list | None = None
        self.launches = 0

    @property
    def device(self) -> Device:
        return Device("cpu")

    @property
    def kernels(self) -> KernelRegistry:
        return KERNELS

    def allocate(self, shape: Sequence[int], dtype: DType) -> Tensor:
        return Tensor(np.empty(tuple(shape), dtype.numpy), dtype, self.device)

    def copy_from_host(self, array, out=None):
        if out is None:
            return Tensor.from_numpy(np.array(array))
        np.copyto(out.buffer, array)
        return out

    def copy_to_host(self, tensor, out=None):
        return np.array(tensor.buffer) if out is None else np.copyto(out, tensor.buffer)

    def copy(self, src, dst):
        np.copyto(dst.buffer, src.buffer)
        if self._recording is not None:
            self._recording.append(lambda s=src.buffer, d=dst.buffer: np.copyto(d, s))

    def launch(self, kdef, ctx, inputs):
        self.launches += 1
        result = kdef.fn(ctx, *inputs)
        if self._recording is not None:
            args = tuple(inputs)

            def call(fn=kdef.fn, ctx=ctx, args=args, out=result):
                np.copyto(out, fn(ctx, *args))

            self._recording.append(call)
        return result

    # One graph only: overriding these hooks routes PRIMARY here by default.
    def graph_begin(self, slot: DeviceGraphSlot, part: int) -> None:
        self._recording = []

    def graph_end(self, slot: DeviceGraphSlot, part: int) -> None:
        self._calls, self._recording = self._recording or [], None

    def graph_abort(self, slot: DeviceGraphSlot, part: int) -> None:
        self._recording = None

    def graph_replay(self, slot: DeviceGraphSlot, part: int) -> None:
        for call in self._calls:
            call()

    def graph_reset(self, slot: DeviceGraphSlot, part: int) -> None:
        self._calls = []

    def graph_exists(self, slot: DeviceGraphSlot, part: int) -> bool:
        return bool(self._calls)


@hookimpl
def register_providers(register) -> None:
    register(
        ProviderSpec(
            "example",
            factory=ExampleProvider,
            description="example plugin",
            # The provider API this plugin was written for (onnx_genrt.core.PROVIDER_API_VERSION
            # of the onnx-genrt it was checked against); a newer minor of the runtime loads it.
            api_version=(1, 0),
        )
    )
