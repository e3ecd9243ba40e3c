"""Which rank of a run this process is, and its process group.

    ranks = current()             # Ranks(rank=1, world_size=2, local_rank=1) under dpsweep's torchrun
    join(ranks, "cpu")            # gloo on the CPU, NCCL on CUDA devices (one per local rank)
    ...
    leave()

A process is a rank of a run only when dpsweep started it (``dpsweep.process.RANKS_ENV``, set by
:func:`dpsweep.run.across_devices.launch`): a Slurm job or an outer ``torchrun`` may set
``RANK`` and ``WORLD_SIZE`` for reasons of its own, and a run must not join a group it did not ask for.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from dpsweep.process import a_rank, cpu_cores

T = TypeVar("T")
TIMEOUT = timedelta(minutes=10)  # a collective that waits this long for a dead rank fails the run


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def leader(self) -> bool:
        """Rank 0: the one that writes the MLflow run and draws the noise."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def current() -> Ranks:
    """This process's ranks: torchrun's ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` under dpsweep's launch,
    else a single process."""
    if not a_rank():
        return Ranks()
    env = os.environ
    return Ranks(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", env["RANK"])))


def join(ranks: Ranks, device_type: str) -> torch.device:
    """Join the run's process group (torchrun's rendezvous in the environment): gloo on the CPU, NCCL
    with one CUDA device per local rank; returns this rank's device."""
    if device_type == "cuda":
        torch.cuda.set_device(ranks.local_rank)
        device = torch.device("cuda", ranks.local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        dist.init_process_group(backend, rank=ranks.rank, world_size=ranks.world_size, timeout=TIMEOUT)
    return device


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


RANKS_PER_CORE = 4  # on the CPU: gloo ranks share the cores; more than this a core only slows a run down


def visible_devices(device_type: str) -> int:
    """How many ranks this machine can run: one a CUDA device, or on the CPU up to :data:`RANKS_PER_CORE`
    gloo ranks a core this process may run on (a test of 4 ranks runs on 2 cores)."""
    if device_type == "cuda":
        return torch.cuda.device_count()
    return RANKS_PER_CORE * cpu_cores()


def from_leader(value: T | None) -> T:
    """Rank 0's ``value`` on every rank (the others pass None)."""
    box: list[Any] = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gathered(value: T) -> list[T]:
    """Every rank's ``value``, in rank order, on every rank (e.g. each rank's generator states)."""
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def summed_by_step(counts: Sequence[tuple[int, int | None]]) -> list[tuple[int, int | None]]:
    """Over every rank, each step's counts summed: ``counts`` is this rank's (step, units) of each step it
    took (its share of the step's batch; None: it did not count it); returns, on every rank alike, (step,
    the ranks' sum) in step order, None where any rank did not count the step. A collective: every rank
    calls it, with an empty ``counts`` too. Aligned by step index, so a step that one rank did not take
    adds nothing there (under :class:`~dpsweep.distributed.PoissonAcrossRanks` every rank yields every
    step, an empty share included, so the ranks' steps are the same)."""
    return sum_by_step(gathered([(int(t), None if b is None else int(b)) for t, b in counts]))


def sum_by_step(per_rank: Sequence[Sequence[tuple[int, int | None]]]) -> list[tuple[int, int | None]]:
    """:func:`summed_by_step`'s sum of every rank's ``counts`` (in rank order), by step."""
    summed: dict[int, int | None] = {}
    for mine in per_rank:
        for t, b in mine:
            so_far = summed.get(t, 0)
            summed[t] = None if so_far is None or b is None else so_far + b
    return sorted(summed.items())
