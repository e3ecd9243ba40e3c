"""The white-box audit's Dirac canaries (dpsweep.audit.white_box): where their gradients go, how they
are scored and guessed, what a checkpoint keeps, and which tests are fixed before training."""

from __future__ import annotations

import math

import pytest
import torch

from dpsweep.audit import bound, white_box


def _canaries(count: int = 40, seed: int = 0) -> tuple[list[torch.Tensor], white_box.DiracCanaries]:
    params = [torch.zeros(3, 4), torch.zeros(5), torch.zeros(2, 2, 3), torch.zeros(30)]  # 59 coordinates
    return params, white_box.DiracCanaries(params, count, 1.0, (0.1, 1.0), magnitude=100.0, seed=seed)


def _per_parameter(release: torch.Tensor) -> list[torch.Tensor]:
    """A release over the 59 flattened coordinates, as one tensor per parameter of :func:`_canaries`."""
    shapes = [(3, 4), (5,), (2, 2, 3), (30,)]
    sizes = [math.prod(shape) for shape in shapes]
    return [part.reshape(shape) for part, shape in zip(release.split(sizes), shapes, strict=True)]


def test_a_canarys_gradient_row_is_its_magnitude_at_its_coordinate_and_zero_elsewhere() -> None:
    params, canaries = _canaries()
    sampled = torch.tensor([0, 5, 17])
    rows = canaries.rows(sampled)
    assert [tuple(r.shape) for r in rows] == [(3, *p.shape) for p in params]
    flat = torch.cat([r.reshape(3, -1) for r in rows], dim=1)  # each row over the flattened parameters
    for i, k in enumerate(sampled.tolist()):
        expected = torch.zeros(flat.shape[1])
        expected[canaries.coordinates[k]] = 100.0
        assert torch.equal(flat[i], expected)
    assert len(set(canaries.coordinates.tolist())) == canaries.count  # distinct coordinates


def test_only_included_canaries_are_sampled_at_about_the_rate() -> None:
    _, canaries = _canaries(count=59)
    draws = [canaries.sample(0.3) for _ in range(2000)]
    assert all(bool(canaries.included[d].all()) for d in draws)
    mean = sum(len(d) for d in draws) / 2000
    assert abs(mean - 0.3 * int(canaries.included.sum())) < 0.3


def test_releases_with_the_included_canaries_spikes_are_guessed_right() -> None:
    """Releases of N(0, σ²) noise (units of C) plus 1 at each included canary's coordinate in the steps
    it was sampled: every guess is right at small σ, about half at large σ."""
    params, quiet = _canaries(count=58, seed=1)
    generator = torch.Generator().manual_seed(0)
    for sigma, canaries in ((0.05, quiet), (50.0, _canaries(count=58, seed=1)[1])):
        canaries.noise_multiplier = sigma
        for _ in range(100):
            sampled = canaries.sample(0.1)
            release = torch.randn(sum(p.numel() for p in params), generator=generator) * sigma
            release[canaries.coordinates[sampled]] += 1.0
            canaries.record(_per_parameter(release))
        right = canaries.right_guesses(20, centred=False)
        assert right == 20 if sigma < 1 else 4 <= right <= 16, (sigma, right)


def test_reused_noise_is_seen_by_the_centred_score_only() -> None:
    params, canaries = _canaries(count=58, seed=2)
    noise = torch.randn(sum(p.numel() for p in params), generator=torch.Generator().manual_seed(3)) * 3.0
    for _ in range(200):
        release = noise.clone()  # drawn once, reused at every step
        release[canaries.coordinates[canaries.sample(0.1)]] += 1.0
        canaries.record(_per_parameter(release))
    assert canaries.right_guesses(40, centred=True) == 40
    assert canaries.right_guesses(40, centred=False) < 36


def test_the_centred_score_reads_reused_noise_against_the_noise_left_not_the_claimed_sigma() -> None:
    """Reused noise plus the other examples' gradient, a jitter far below σ: read against the claimed
    σ, the jitter summed over the steps blurs the included canaries' few spikes into the excluded
    ones' scores; read against σ̂ (the jitter's own scale) the spikes stand out, and every included
    canary scores above every excluded one."""
    params, canaries = _canaries(count=58, seed=5)
    canaries.noise_multiplier = 1.0
    generator = torch.Generator().manual_seed(6)
    size = sum(p.numel() for p in params)
    noise = torch.randn(size, generator=generator)
    for _ in range(300):
        release = noise + 0.1 * torch.randn(size, generator=generator)  # the data's jitter: 0.1 C
        release[canaries.coordinates[canaries.sample(0.02)]] += 1.0
        canaries.record(_per_parameter(release))
    inside, outside = canaries.included, ~canaries.included
    centred = canaries.scores(centred=True)
    assert centred[inside].min() > centred[outside].max()  # every included canary above every excluded one
    x = torch.stack(canaries.releases)
    x = x - x.median(dim=0).values
    spike = math.log(0.02) + (2 * x - 1) / 2  # the same score at the claimed σ = 1
    claimed = torch.logaddexp(torch.full_like(x, math.log1p(-0.02)), spike).sum(dim=0)
    assert claimed[inside].min() < claimed[outside].max()


def test_a_checkpoint_keeps_the_releases_and_the_sampling_generator() -> None:
    _, a = _canaries(seed=4)
    _, b = _canaries(seed=4)
    for _ in range(3):
        a.sample(0.5)
        a.record(_per_parameter(torch.randn(59)))
    b.load(a.state())
    assert torch.equal(a.scores(centred=False), b.scores(centred=False))
    assert torch.equal(a.sample(0.5), b.sample(0.5))


def test_the_tests_are_fixed_before_training_and_their_confidence_shared() -> None:
    assert white_box.planned_tests(100, 1000) == [("raw", False, 100), ("raw", False, 1000), ("centred", True, 1000)]
    assert white_box.planned_tests(1000, 1000) == [("raw", False, 1000), ("centred", True, 1000)]
    _, canaries = _canaries(count=40, seed=2)  # 21 included: not half, within split_guesses' window (16 to 24)
    for _ in range(50):
        release = torch.zeros(59)
        release[canaries.coordinates[canaries.sample(0.2)]] = 1.0
        canaries.record(_per_parameter(release))
    metrics = white_box.result(canaries, 10, 0.0, 0.95)
    assert metrics["audit.tests"] == 3 and metrics["audit.correct_raw_10"] == 10
    # a guess on every canary, split where the scores' gap is: all right, though the included are not 20
    assert int(canaries.included.sum()) != 20 and metrics["audit.correct_raw_40"] == 40
    each = [bound.epsilon_lower(40, r, int(metrics[f"audit.correct_{s}_{r}"]), 0.0, 1 - 0.05 / 3)
            for s, r in (("raw", 10), ("raw", 40), ("centred", 40))]  # fmt: skip
    assert metrics["audit.epsilon_lower"] == max(each) > 0
    q = (0.05 / 3) ** (1 / 10)  # 10 of 10 right, δ = 0: the closed form, at the shared confidence
    assert each[0] == pytest.approx(math.log(q / (1 - q)), rel=1e-6)


def test_canaries_sit_in_the_largest_parameter_where_it_holds_them_all() -> None:
    params = [torch.zeros(10), torch.zeros(8, 8), torch.zeros(3)]  # the 64 weights start at coordinate 10
    inside = white_box.DiracCanaries(params, 50, 1.0, (0.1, 1.0), magnitude=10.0, seed=0).coordinates
    assert bool(((inside >= 10) & (inside < 74)).all()) and len(set(inside.tolist())) == 50
    spread = white_box.DiracCanaries(params, 70, 1.0, (0.1, 1.0), magnitude=10.0, seed=0).coordinates
    assert sorted(spread.tolist()) == sorted(set(spread.tolist())) and not bool(((spread >= 10) & (spread < 74)).all())
