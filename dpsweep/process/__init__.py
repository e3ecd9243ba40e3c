"""This process: its identity and liveness, its CPU cores, whether it is a rank of a run, and how a
command's process ends."""

from __future__ import annotations

import os

# "1" in the processes the dpsweep command starts under torchrun for one run across devices
# (train.devices, dpsweep.distributed): they read torchrun's RANK, WORLD_SIZE and LOCAL_RANK.
RANKS_ENV = "DPSWEEP_RANKS"


def a_rank() -> bool:
    """Whether this process is one rank of a run across devices (started by the dpsweep command)."""
    return os.environ.get(RANKS_ENV) == "1"


def cpu_cores() -> int:
    """The CPU cores this process may run on (its affinity: ``taskset``, a scheduler's cpuset)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
