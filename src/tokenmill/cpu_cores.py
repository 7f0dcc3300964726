"""How many CPU cores this process may run on (its affinity mask where the OS has one)."""

from __future__ import annotations

import os


def usable_cores() -> int:
    """Cores in this process's affinity mask (a container's or `taskset`'s limit), else the
    machine's count; at least 1."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1
