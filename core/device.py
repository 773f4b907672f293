"""Devices that tensors live on."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Device:
    """A device kind (``"cpu"``, ``"cuda"``, or a plugin's own) and its index."""

    kind: str
    index: int = 0

    def __str__(self) -> str:
        return self.kind if self.kind == "cpu" else f"{self.kind}:{self.index}"


CPU = Device("cpu")
