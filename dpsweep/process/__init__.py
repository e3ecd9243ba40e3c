"""This process: its identity and liveness, its CPU cores, and how a command's process ends."""

from __future__ import annotations

import os


def cpu_cores() -> int:
    """The CPU cores this process may run on (its affinity: ``taskset``, a scheduler's cpuset)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
