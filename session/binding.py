"""Persistent I/O bindings: buffers bound by name, written in place between runs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from onnx_genrt.core.errors import InvalidInputError
from onnx_genrt.core.tensor import Tensor, buffer_address

if TYPE_CHECKING:
    from .inference_session import InferenceSession

Signature = tuple[tuple[str, str, tuple[int, ...], int], ...]


class IOBinding:
    """Inputs and outputs bound to fixed buffers on the session's provider.

    The binding signature (name, dtype, physical shape and address of every binding) keys a
    captured graph: while it is unchanged, a graph captured for it stays valid. Write new
    input values *into* the bound buffers (``binding.input(name)[...] = ...``) rather than
    rebinding, so the signature stays equal.
    """

    def __init__(self, session: InferenceSession) -> None:
        self._session = session
        self._provider = session.main_provider
        self.inputs: dict[str, Any] = {}
        self.outputs: dict[str, Any] = {}
        self._signature: Signature | None = None
        self._checked: Signature | None = None  # the signature check_complete last passed

    def bind_input(self, name: str, value: Any) -> Any:
        """Bind ``value`` (a host array is copied to the device once). Returns the bound buffer."""
        spec = self._session.input_spec(name)
        buf = self._to_device(value)
        if spec.dtype is not None and buf.dtype != spec.dtype:
            raise InvalidInputError(
                f"input {name!r} expects {spec.dtype}, bound buffer is {buf.dtype}"
            )
        self._session.check_shape(name, tuple(buf.shape), spec.shape)
        self.inputs[name] = buf
        self._signature = None
        return buf

    def bind_output(
        self, name: str, value: Any = None, shape: Sequence[int] | None = None, dtype: Any = None
    ) -> Any:
        """Bind an output to ``value``, or allocate one of ``shape`` on the session's provider."""
        spec = self._session.output_spec(name)
        if value is None:
            if shape is None:
                raise InvalidInputError(f"bind_output({name!r}) needs a buffer or a shape")
            dt = np.dtype(dtype) if dtype is not None else spec.dtype
            if dt is None:
                raise InvalidInputError(f"output {name!r} has no declared dtype; pass dtype=")
            value = self._provider.empty(tuple(shape), dt)
        else:
            value = self._to_device(value)
        if spec.dtype is not None and np.dtype(value.dtype) != spec.dtype:
            raise InvalidInputError(
                f"output {name!r} is declared {spec.dtype}; a buffer of {np.dtype(value.dtype)} "
                "cannot hold it"
            )
        self.outputs[name] = value
        self._signature = None
        return value

    def input(self, name: str) -> Any:
        return self.inputs[name]

    def output(self, name: str) -> Any:
        return self.outputs[name]

    def get_outputs(self) -> dict[str, np.ndarray]:
        """Bound outputs copied to host numpy arrays."""
        return dict(
            zip(self.outputs, self._provider.read(list(self.outputs.values())), strict=True)
        )

    def check_complete(self, inputs: Sequence[str], outputs: Sequence[str]) -> None:
        """Raise ``InvalidInputError`` unless every one of ``inputs`` and ``outputs`` is
        bound; checked again only after a binding changed."""
        sig = self.signature()
        if self._checked is sig:
            return
        missing = [n for n in inputs if n not in self.inputs]
        if missing:
            raise InvalidInputError(f"unbound inputs {missing}")
        unbound = [n for n in outputs if n not in self.outputs]
        if unbound:
            raise InvalidInputError(
                f"unbound outputs {unbound}; bind every output before a bound run"
            )
        self._checked = sig

    def signature(self) -> Signature:
        if self._signature is None:
            items = [("in", n, b) for n, b in self.inputs.items()]
            items += [("out", n, b) for n, b in self.outputs.items()]
            self._signature = tuple(
                (f"{kind}:{n}", str(b.dtype), tuple(int(d) for d in b.shape), buffer_address(b))
                for kind, n, b in sorted(items, key=lambda x: (x[0], x[1]))
            )
        return self._signature

    def _to_device(self, value: Any) -> Any:
        """``value`` as one of the provider's arrays: kept when the provider holds it (so
        in-place writes reach the run), copied once when it is a host array."""
        if isinstance(value, Tensor):
            value = value.buffer
        if self._provider.holds(value):
            if isinstance(value, np.ndarray) and not value.flags.c_contiguous:
                raise InvalidInputError("bound host arrays must be C-contiguous")
            return value
        if isinstance(value, np.ndarray):
            return self._provider.upload(value)
        raise InvalidInputError(
            f"cannot bind a {type(value).__name__} on provider {self._provider.name!r}: give a "
            "numpy array or one of the provider's own arrays"
        )
