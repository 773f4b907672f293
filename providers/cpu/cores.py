"""The CPU provider's default thread count: the physical cores this process may run on."""

from __future__ import annotations

import os
from pathlib import Path

SYSFS_CPUS = Path("/sys/devices/system/cpu")


def usable_cpus() -> set[int]:
    """Logical CPUs this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


def physical_cores(cpus: set[int] | None = None, sysfs: Path = SYSFS_CPUS) -> int:
    """Physical cores among ``cpus`` (default: ``usable_cpus()``), as onnxruntime counts
    them for its default intra-op threads: hyper-threads of one core (the same
    ``topology/thread_siblings_list`` in sysfs) count once. Where sysfs does not say
    (not Linux, a restricted container), every logical CPU counts."""
    cpus = usable_cpus() if cpus is None else cpus
    cores: set[str] = set()
    for cpu in cpus:
        try:
            siblings = (sysfs / f"cpu{cpu}" / "topology" / "thread_siblings_list").read_text()
        except OSError:
            return max(1, len(cpus))
        cores.add(siblings.strip())
    return max(1, len(cores))
