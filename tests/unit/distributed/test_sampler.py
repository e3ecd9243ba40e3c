"""Poisson sampling across ranks (dpsweep.distributed.sampler): the ranks deal the examples between
them, every rank takes every step, and the union of their shares is one Poisson sample of the whole
training set (the accountant's assumption), with each rank's draws its own."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from dpsweep.distributed import PoissonAcrossRanks, Ranks


def _ranks(n: int, q: float, steps: int, world: int, seed: int = 0) -> list[PoissonAcrossRanks]:
    return [PoissonAcrossRanks(n, q, steps, Ranks(r, world, r), seed) for r in range(world)]


@pytest.mark.parametrize("world", [1, 2, 4, 7])
def test_the_ranks_own_every_example_exactly_once(world: int) -> None:
    owned = torch.cat([s.owned for s in _ranks(103, 0.1, 1, world)])
    assert sorted(owned.tolist()) == list(range(103))


def test_every_rank_takes_every_step_an_empty_share_included() -> None:
    """Opacus 1.6's distributed sampler skips a step whose share is empty, and the ranks fall out of
    step; here each rank yields all of them."""
    for sampler in _ranks(40, 0.01, 500, 4):
        shares = list(sampler)
        assert len(shares) == 500 == len(sampler)
        assert sum(1 for s in shares if not s) > 400  # about 0.99^10 of them: empty, and still taken


def test_the_union_over_ranks_is_one_poisson_sample_of_the_training_set() -> None:
    """The global batch of each step: its size Binomial(N, q) (χ² against the exact pmf), every example
    in a step with probability q, and two examples at the same place on two ranks in together with
    probability q², not q (draws of their own, not one generator seeded alike)."""
    n, q, steps, world = 60, 0.1, 4000, 4
    samplers = _ranks(n, q, steps, world, seed=3)
    inside = np.zeros((steps, n), dtype=bool)
    for sampler in samplers:
        for t, share in enumerate(sampler):
            assert not inside[t, share].any()  # no example twice in one step
            inside[t, share] = True
    sizes = inside.sum(axis=1)
    edges = [0, 3, 4, 5, 6, 7, 8, 9, 11, n + 1]  # bins of Binomial(60, 0.1), each expected >= 5% of steps
    observed = np.histogram(sizes, bins=edges)[0]
    expected = np.diff(stats.binom.cdf(np.array(edges) - 1, n, q))
    assert stats.chisquare(observed, expected * steps).pvalue > 1e-3, (observed, expected * steps)
    assert abs(inside.mean() - q) < 0.005
    first, second = samplers[0].owned[0], samplers[1].owned[0]  # the same place on two ranks
    together = (inside[:, first] & inside[:, second]).mean()
    assert together < 0.03, together  # q² = 0.01 (q = 0.1 if they drew alike)


def test_each_rank_draws_from_a_generator_of_its_own_seeded_by_the_run() -> None:
    a, b = _ranks(50, 0.3, 20, 2, seed=1)
    again = _ranks(50, 0.3, 20, 2, seed=1)[1]
    assert list(b) == list(again)  # seeded: a rerun draws the same batches
    draws = [torch.rand(5, generator=s.generator) for s in _ranks(50, 0.3, 20, 2, seed=1)]
    assert not torch.equal(draws[0], draws[1])
    assert list(a) != list(_ranks(50, 0.3, 20, 2, seed=2)[0])


def test_a_rank_outside_the_world_or_a_rate_outside_0_1_is_refused() -> None:
    with pytest.raises(ValueError, match="rank 2 of 2"):
        PoissonAcrossRanks(10, 0.1, 1, Ranks(2, 2, 2), 0)
    with pytest.raises(ValueError, match="sample_rate"):
        PoissonAcrossRanks(10, 1.5, 1, Ranks(0, 1, 0), 0)
