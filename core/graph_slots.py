"""Named slots a provider can hold captured device graphs in."""

from __future__ import annotations

import enum


class DeviceGraphSlot(enum.Enum):
    """Which captured graph a capture, replay or reset refers to.

    ``PRIMARY`` holds the M=1 decode step and ``VERIFY`` the fixed-shape M=k+1 speculative
    verify step. ``DRAFT`` holds a proposer's own step (an MTP head or a draft model).
    Slots are independent: resetting one never touches another.
    """

    PRIMARY = "primary"
    VERIFY = "verify"
    DRAFT = "draft"

    def __str__(self) -> str:
        return self.value
