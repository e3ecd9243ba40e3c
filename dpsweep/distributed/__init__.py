"""One run across several processes (``train.devices``): which rank this process is, the Poisson
sampler each rank draws its share of a step's batch with, and the ``torchrun`` command that starts
the ranks (:mod:`dpsweep.distributed.ranks`, :mod:`~dpsweep.distributed.sampler`,
:mod:`~dpsweep.distributed.launch`)."""

from dpsweep.distributed.launch import run_ranks, torchrun_command
from dpsweep.distributed.ranks import (
    Ranks,
    current,
    from_leader,
    gathered,
    join,
    leave,
    visible_devices,
)
from dpsweep.distributed.sampler import PoissonAcrossRanks

__all__ = [
    "PoissonAcrossRanks",
    "Ranks",
    "current",
    "from_leader",
    "gathered",
    "join",
    "leave",
    "run_ranks",
    "torchrun_command",
    "visible_devices",
]  # fmt: skip
