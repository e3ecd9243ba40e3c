"""Poisson sampling across ranks: every example in a step's batch with probability q, independently,
on exactly one rank, and every rank taking every step.

    sampler = PoissonAcrossRanks(n=1437, sample_rate=1 / 23, steps=23, ranks=Ranks(1, 2, 1), seed=0)
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=...)   # this rank's share of each step

The examples are dealt to the ranks by a permutation that depends on ``seed`` alone (not on the data):
rank r owns every world_size-th example of it, from the r-th. At each step, each rank includes each
example it owns with probability q, from a generator of its own: ``drawn`` (a run passes its rank's
private sampling stream, ``dpsweep.privacy.streams``), or one seeded by ``seed`` and its rank.
The union over the ranks is then one Poisson sample of the whole training set at rate q (each
example in independently, with probability q), which is what the accountant's amplification by
Poisson subsampling assumes (Mironov, Talwar & Zhang 2019; the same sampling as one process's
Opacus loader).

Opacus's ``DistributedUniformWithReplacementSampler`` deals the examples the same way, but (Opacus
1.6) a rank whose share of a step is empty skips the step, so the ranks' steps fall out of line and
their all-reduce pairs different steps' gradients; and with no generator given, each rank draws from
torch's default one, seeded alike on every rank by ``train.seed``, so the ranks' draws are the same
and the examples at the same place on two ranks are in or out together. Here every rank yields every
step, an empty share included, and each rank's draws are its own.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler

from dpsweep.distributed.ranks import Ranks

RANK_STREAMS = 1 << 20  # a rank's generator is seeded seed·RANK_STREAMS + rank: distinct for every (seed, rank)


class PoissonAcrossRanks(Sampler[list[int]]):
    """This rank's share of each step's Poisson batch (module doc): ``steps`` batches an epoch."""

    def __init__(
        self, n: int, sample_rate: float, steps: int, ranks: Ranks, seed: int, drawn: torch.Generator | None = None
    ) -> None:
        if not 0 < sample_rate <= 1:
            raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
        if not 0 <= ranks.rank < ranks.world_size or ranks.world_size > RANK_STREAMS:
            raise ValueError(f"rank {ranks.rank} of {ranks.world_size}: no such rank")
        self.sample_rate, self.steps = sample_rate, steps
        dealt = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
        self.owned = dealt[ranks.rank :: ranks.world_size]
        self.generator = drawn if drawn is not None else torch.Generator().manual_seed(seed * RANK_STREAMS + ranks.rank)

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[list[int]]:
        for _ in range(self.steps):
            drawn = torch.rand(len(self.owned), generator=self.generator) < self.sample_rate
            yield self.owned[drawn].tolist()
