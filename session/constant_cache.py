"""A plan's constants on the providers that read them, each made once and shared.

A step reads a constant input either in its kernel's own layout (the kernel's ``prepack``:
a transposed weight, say) or uploaded as it is. Both are made the first time a step asks
and kept for the session's life, keyed by provider, so steps reading the same weight on
the same provider share one array. Once every step that reads a constant has it, a
constant that no step reads as it is has its host array released (at once, so that a
large model never holds every weight twice while it is prepacked): a weight is held
once, in the layout its kernels read.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Sequence
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

    def __init__(
        self, host: dict[str, Any], steps: Sequence[Any] = (), keep: Collection[str] = ()
    ) -> None:
        """``host``: the plan's constants (released ones are replaced in it); ``steps``: the
        plan's steps, whose readings of each constant are counted down by :meth:`for_step`;
        ``keep``: constants never released (graph outputs, read as they are)."""
        self._host = host
        self._keep = set(keep)
        #: (provider id, name) -> plain upload; (provider id, name, prepack) -> packed
        #: layout, or None where the prepack declined (then the plain upload is used).
        self._made: dict[tuple[Any, ...], Any] = {}
        #: Readings of each constant by the steps that have not asked for it yet.
        self._unread = Counter(name for step in steps for name in step.inputs if name in host)

    def __contains__(self, name: object) -> bool:
        return name in self._host

    def host(self, name: str) -> Any:
        """Constant ``name`` as the plan holds it (a host array)."""
        return self._held(name)

    def for_step(self, step: Any, index: int, name: str) -> Any:
        """Constant input ``index`` (``name``) of ``step`` on the step's provider, in the
        kernel's prepacked layout when it has one that takes this input."""
        provider, prepack = step.provider, step.kernel.prepack
        value = None
        if prepack is not None:
            key = (id(provider), name, prepack)
            if key not in self._made:
                self._made[key] = prepack(provider, step.node, index, self._held(name))
            value = self._made[key]
        if value is None:
            value = self.on(provider, name)
        self._unread[name] -= 1
        if self._unread[name] == 0:
            self._release(name)
        return value

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

    def _release(self, name: str) -> None:
        """Release constant ``name``'s host array when it was prepacked and is read as it is
        by no step and not kept: a :class:`ReleasedConstant` takes its place in the plan,
        and a weight mapped from its file has its pages dropped (``session.weights``).
        Returns the bytes released."""
        array = self._host[name]
        if name in self._keep or isinstance(array, ReleasedConstant):
            return
        packed = any(len(k) == 3 and k[1] == name and v is not None for k, v in self._made.items())
        if not packed or name in self.plain_names():
            return
        release_pages(array)
        self._host[name] = ReleasedConstant(name, tuple(array.shape), array.dtype)

    def _held(self, name: str) -> Any:
        value = self._host[name]
        if isinstance(value, ReleasedConstant):
            raise RuntimeError(
                f"constant {name!r} was released after prepacking; a step that reads it as it "
                "is must ask for it before its last reader does (an onnx-genrt bug)"
            )
        return value
