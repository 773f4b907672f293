"""A plan's constants on the providers that read them, each made once and shared.

A step reads a constant input either in its kernel's own layout (the kernel's ``prepack``:
a transposed weight, say) or uploaded as it is. Both are made the first time a step asks
and kept for the session's life, keyed by provider, so steps reading the same weight on
the same provider share one array. Once every step has its inputs, a constant that no
step reads as it is has its host array released (:meth:`ConstantCache.release_packed`):
a weight is held once, in the layout its kernels read.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import numpy as np

from onnx_genrt.core.provider import ExecutionProvider

from .weights import release_pages


@dataclass(frozen=True)
class ReleasedConstant:
    """A constant whose host array was released because every step reads it prepacked:
    its shape and dtype only (which liveness, row tails and tools still ask)."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)


class ConstantCache:
    """The plan's constants (host arrays by name) as each provider's arrays."""

    def __init__(self, host: dict[str, Any]) -> None:
        self._host = host
        #: (provider id, name) -> plain upload; (provider id, name, prepack) -> packed
        #: layout, or None where the prepack declined (then the plain upload is used).
        self._made: dict[tuple[Any, ...], Any] = {}

    def __contains__(self, name: object) -> bool:
        return name in self._host

    def host(self, name: str) -> Any:
        """Constant ``name`` as the plan holds it (a host array)."""
        return self._held(name)

    def for_step(self, step: Any, index: int, name: str) -> Any:
        """Constant input ``index`` (``name``) of ``step`` on the step's provider, in the
        kernel's prepacked layout when it has one that takes this input."""
        provider, prepack = step.provider, step.kernel.prepack
        if prepack is not None:
            key = (id(provider), name, prepack)
            if key not in self._made:
                self._made[key] = prepack(provider, step.node, index, self._held(name))
            if self._made[key] is not None:
                return self._made[key]
        return self.on(provider, name)

    def on(self, provider: ExecutionProvider, name: str) -> Any:
        """Constant ``name`` uploaded to ``provider`` as it is."""
        key = (id(provider), name)
        if key not in self._made:
            self._made[key] = provider.upload(self._held(name))
        return self._made[key]

    def values(self) -> list[Any]:
        """Every array made so far: prepacked layouts and plain uploads."""
        return [value for value in self._made.values() if value is not None]

    def plain_names(self) -> set[str]:
        """The constants uploaded as they are (on any provider), not in a packed layout."""
        return {key[1] for key in self._made if len(key) == 2}

    def release_packed(self, keep: Collection[str] = ()) -> int:
        """Release the host arrays of the constants read only in prepacked layouts (none
        plainly, none named in ``keep``), leaving a :class:`ReleasedConstant` in the plan;
        a weight mapped from its file has its pages dropped (``session.weights``). Call it
        once every step has its inputs. Returns the host bytes released."""
        packed = {
            key[1] for key, value in self._made.items() if len(key) == 3 and value is not None
        }
        released = 0
        for name in packed - self.plain_names() - set(keep):
            array = self._host[name]
            if isinstance(array, ReleasedConstant):
                continue
            release_pages(array)
            released += array.nbytes
            self._host[name] = ReleasedConstant(name, tuple(array.shape), array.dtype)
        return released

    def _held(self, name: str) -> Any:
        value = self._host[name]
        if isinstance(value, ReleasedConstant):
            raise RuntimeError(
                f"constant {name!r} was released after prepacking; a step that reads it as it "
                "is must ask before ConstantCache.release_packed (an onnx-genrt bug)"
            )
        return value
