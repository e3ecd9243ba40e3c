"""The white-box audit's canaries in a private step (dpsweep.audit.white_box.PoissonCanaries,
dpsweep.audit.own_steps.TreeCanaries): rows that join the step's units, which the step clips with its own
clipping, the releases recorded, DP-FTRL's tree nodes recovered from the model after every step."""

from __future__ import annotations

import pytest
import torch

from dpsweep.audit import own_steps, white_box
from dpsweep.data import users
from dpsweep.data.users import clip_factors
from dpsweep.mechanisms.dpftrl_accounting import restart_after_epoch
from dpsweep.mechanisms.ftrl import FTRLOptimizer, TreeAggregator
from dpsweep.mechanisms.private_step import FixedOrder, Release


def _poisson(count: int = 30) -> tuple[dict[str, torch.Tensor], white_box.PoissonCanaries]:
    params = {"a": torch.zeros(4), "b": torch.zeros(8, 8)}
    canaries = white_box.DiracCanaries(list(params.values()), count, 1.0, (0.5, 1.0), magnitude=100.0, seed=0)
    return params, white_box.PoissonCanaries(canaries, list(params), lambda: 0.5)


def test_the_sampled_canaries_rows_join_the_step_and_its_release_is_recorded_in_units_of_c() -> None:
    params, hook = _poisson()
    assert hook.units(0) is None  # inactive: no row, nothing recorded
    hook.released(Release(0, None, {k: torch.ones_like(p) for k, p in params.items()}, 4.0))
    assert not hook.canaries.releases
    hook.canaries.active = True
    rows = hook.units(0)
    assert rows is not None and set(rows) == {"a", "b"}
    flat = torch.cat([rows[k].reshape(len(rows[k]), -1) for k in params], dim=1)  # a row per sampled canary
    c = hook.canaries
    assert len(flat) > 0 and torch.all(c.coordinates >= 4)  # the 64 weights are the largest tensor
    for row in flat:  # the canary's magnitude at its coordinate, 0 elsewhere, unclipped: the step clips it
        [where] = torch.nonzero(row).flatten().tolist()
        assert row[where] == 100.0 and bool(c.included[c.coordinates == where].all())
    noisy = {k: torch.full_like(p, 0.25) for k, p in params.items()}
    hook.released(Release(0, None, noisy, 4.0))
    assert torch.allclose(c.releases[0], torch.full((c.count,), 1.0, dtype=torch.float64))  # 0.25 · 4 / C


def test_a_canary_row_is_clipped_by_the_steps_own_clipping() -> None:
    """user_contributions clips the extra rows as the users' (DP-FTRL's and user-level DP-SGD's steps)."""
    model = torch.nn.Linear(3, 2)
    x, y, segment = torch.randn(4, 3), torch.tensor([0, 1, 0, 1]), torch.tensor([0, 0, 1, 1])
    extra = {k: torch.zeros(1, *p.shape) for k, p in model.named_parameters()}
    extra["weight"][0, 1, 2] = 100.0
    parts = users.user_contributions(model, torch.nn.CrossEntropyLoss(), x, y, segment, 2, 1.0, extra=extra)
    assert parts["weight"].shape == (3, 2, 3)  # the two users, then the canary
    assert float(parts["weight"][2, 1, 2]) == pytest.approx(100 / (100 + 1e-6))  # clipped to C = 1


def _ftrl(
    sigma: float, restart_every: int | None, completion: bool, epochs: int = 6, seed: int = 0, trained: bool = True
) -> tuple[own_steps.TreeCanaries, torch.Tensor]:
    """Train one parameter of 400 coordinates by DP-FTRL (momentum 0.9) on the canaries alone, 5 steps an
    epoch (or not, unless ``trained``); return the canaries and each step's true prefix sum G_t + N_t at
    their coordinates."""
    b, weight = 5, torch.zeros(400)
    tree = TreeAggregator.for_params(
        [weight], std=sigma / 2, generator=torch.Generator().manual_seed(seed), tree_completion=completion
    )  # σC/B with C = 1 and B = 2
    optimizer = FTRLOptimizer([weight], lr=0.1, momentum=0.9, noise=tree)
    restarts = [e for e in range(1, epochs + 1) if restart_after_epoch(e, epochs, restart_every)]
    order = FixedOrder(b, (0, *(e * b for e in restarts)), completion, lr=0.1, momentum=0.9, divisor=2.0)
    canaries = own_steps.TreeCanaries([weight], 300, 1.0, sigma, 100.0, seed, names=["w"], order=order)
    canaries.active = True
    truth = []
    step = 0
    for epoch in range(1, epochs + 1 if trained else 1):
        for _ in range(b):
            rows = canaries.units(step)
            assert rows is not None
            clipped = rows["w"] * clip_factors(rows["w"].norm(dim=1), 1.0)[:, None]  # the step's clipping at C = 1
            weight.grad = clipped.sum(dim=0) / 2.0  # the clipped sum over B
            optimizer.step()
            canaries.stepped(step)
            p = optimizer.state[weight]["grad_sum"] + tree.noise[0]
            truth.append(p[canaries.coordinates].to(torch.float64) * 2.0)  # units of C: times B / C
            step += 1
        if restart_after_epoch(epoch, epochs, restart_every):
            optimizer.restart()
    return canaries, torch.stack(truth) if truth else torch.zeros(0, canaries.count)


@pytest.mark.parametrize(("restart_every", "completion"), [(None, False), (2, False), (2, True), (4, True)])
def test_the_prefix_sums_come_back_from_the_model_after_every_step(restart_every: int | None, completion: bool) -> None:
    canaries, truth = _ftrl(1.0, restart_every, completion)
    assert torch.allclose(canaries.prefix_sums(), truth, atol=1e-3)


def test_each_included_canary_is_in_its_place_once_an_epoch() -> None:
    canaries, truth = _ftrl(0.0, None, False, epochs=3)
    leaves = torch.diff(truth, dim=0, prepend=torch.zeros(1, canaries.count, dtype=torch.float64))
    per_epoch = leaves.reshape(3, 5, canaries.count)  # epochs × steps × canaries
    for k in range(canaries.count):
        expected = torch.zeros(5, dtype=torch.float64)
        if canaries.included[k]:
            expected[canaries.position[k]] = 1.0
        assert all(torch.allclose(per_epoch[e, :, k], expected, atol=1e-4) for e in range(3)), k


@pytest.mark.parametrize(("restart_every", "completion"), [(None, False), (2, True), (4, True)])
def test_every_guess_is_right_at_small_noise_and_about_half_at_large(
    restart_every: int | None, completion: bool
) -> None:
    quiet, _ = _ftrl(0.05, restart_every, completion)
    assert quiet.right_guesses(100, centred=False) == 100
    loud, _ = _ftrl(200.0, restart_every, completion, seed=1)
    assert 30 <= loud.right_guesses(100, centred=False) <= 70


def test_the_nodes_after_a_completed_trees_restart_skip_the_unseen_baseline() -> None:
    """6 epochs of 5 steps, restarts after epochs 2 and 4: trees of 10 steps, not powers of two. With
    completion the later trees' nodes that start at their first step (steps 1, 2, 4, 8) are not seen."""
    seen, _ = _ftrl(1.0, 2, False)
    completed, _ = _ftrl(1.0, 2, True)
    assert len(seen.nodes()[0]) == 30 and len(completed.nodes()[0]) == 30 - 2 * 4


def test_a_tree_canarys_checkpoint_keeps_its_initial_model_and_releases() -> None:
    canaries, _ = _ftrl(1.0, 2, True)
    fresh, _ = _ftrl(1.0, 2, True, trained=False)
    fresh.load(canaries.state())
    assert torch.equal(fresh.scores(centred=False), canaries.scores(centred=False))
