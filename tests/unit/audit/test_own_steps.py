"""The white-box audit of the steps that noise their own gradients (dpsweep.audit.own_steps): canaries
clipped by the run's clipping factor and added to a step's gradient, the releases recorded, DP-FTRL's
tree nodes recovered from the model after every step, and the bugs planted there."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import Composer

from dpsweep.audit import own_steps, planted, white_box
from dpsweep.config import Config, to_config
from dpsweep.data.users import UserBatches
from dpsweep.mechanisms import functional
from dpsweep.mechanisms.dpftrl_accounting import restart_after_epoch
from dpsweep.mechanisms.ftrl import FTRLOptimizer, TreeAggregator
from dpsweep.privacy.streams import Streams


def _poisson(clip: float = 1.0, count: int = 30) -> tuple[dict[str, torch.Tensor], own_steps.PoissonCanaries]:
    params = {"a": torch.zeros(4), "b": torch.zeros(8, 8)}
    canaries = white_box.DiracCanaries(list(params.values()), count, 1.0, (0.5, 1.0), magnitude=100.0, seed=0)
    return params, own_steps.PoissonCanaries(canaries, list(params), clip, lambda: 0.5)


def test_a_sampled_canary_adds_its_clipped_contribution_over_the_divisor_and_the_release_is_recorded() -> None:
    params, hook = _poisson()
    grads = {k: torch.full_like(p, 0.25) for k, p in params.items()}
    hook.gradient(grads, 4.0, 0)  # inactive: nothing changes, nothing recorded
    assert all(bool((g == 0.25).all()) for g in grads.values()) and not hook.canaries.releases
    hook.canaries.active = True
    hook.gradient(grads, 4.0, 0)
    flat = torch.cat([g.reshape(-1) for g in grads.values()])
    c = hook.canaries
    assert torch.all(c.coordinates >= 4)  # the 64 weights are the largest tensor
    spiked = torch.nonzero(flat != 0.25).flatten()
    assert len(spiked) > 0 and bool(c.included[torch.isin(c.coordinates, spiked)].all())
    # 100·C clipped to C = 1 by Opacus's factor C/(‖g‖ + 1e-6), over the divisor 4
    assert flat[spiked] == pytest.approx(torch.full((len(spiked),), 0.25 + 100 * (1 / (100 + 1e-6)) / 4))
    assert c.releases[0][torch.isin(c.coordinates, spiked)] == pytest.approx(1.0 + 1.0 * (100 / (100 + 1e-6)))


def test_without_clipping_a_canary_goes_through_at_its_magnitude() -> None:
    params, hook = _poisson(clip=1e6)
    grads = {k: torch.zeros_like(p) for k, p in params.items()}
    hook.canaries.active = True
    hook.gradient(grads, 1.0, 0)
    assert float(grads["b"].max()) == pytest.approx(100.0)


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
    canaries = own_steps.TreeCanaries(
        [weight], 300, 1.0, sigma, 100.0, seed, names=["w"], clip=1.0, steps_per_epoch=b,
        tree_starts=[0, *(e * b for e in restarts)], completion=completion, lr=0.1, momentum=0.9, divisor=2.0,
    )  # fmt: skip
    canaries.active = True
    truth = []
    step = 0
    for epoch in range(1, epochs + 1 if trained else 1):
        for _ in range(b):
            grads = {"w": torch.zeros(400)}
            canaries.gradient(grads, 2.0, step)
            weight.grad = grads["w"]
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


def _own_run(cfg: Config) -> functional.OwnRun:
    x, y = torch.randn(40, 3), torch.randint(0, 2, (40,))
    exact = functional.FixedOrderBatches(x, y, None, 4, 1, 0, torch.device("cpu"))
    return functional.OwnRun(
        cfg,
        torch.nn.Linear(3, 2),
        torch.nn.CrossEntropyLoss(),
        (x, y, None),
        exact,
        2.0,
        exact.device,
        Streams.of_run(seed=0, config_hash="0"),
    )


def test_planted_runs_keep_the_noise_the_ledger_sees_but_not_what_it_assumes(make_cfg: Composer) -> None:
    cfg = to_config(make_cfg())
    run = _own_run(cfg)
    assert planted.plant_own_run("noise_tenth", run).sigma == pytest.approx(0.2)
    unclipped = planted.plant_own_run("no_clipping", run)
    c = cfg.dp.max_grad_norm
    assert unclipped.cfg.dp.max_grad_norm == c * planted.UNCLIPPED
    assert unclipped.sigma * unclipped.cfg.dp.max_grad_norm == pytest.approx(run.sigma * c)  # σC unchanged
    assert planted.plant_own_run("half_sample_rate", run) is run


def test_a_doubled_sample_rate_and_reused_noise_are_planted_in_the_steps(make_cfg: Composer) -> None:
    x, y, users = torch.randn(40, 3), torch.randint(0, 2, (40,)), torch.arange(40) % 10
    batches = UserBatches(x, y, users, expected_users_per_step=2, max_examples_per_user=4, device="cpu",
                          generator=torch.Generator().manual_seed(0))  # fmt: skip
    setup = functional.OwnSetup(torch.optim.SGD([torch.zeros(1)], lr=0.1), batches.generator, batches, 2.0)
    planted.plant_own_steps("half_sample_rate", functional.PoissonUnits(), setup)
    assert batches.sample_rate == pytest.approx(0.4) and len(batches) == 5  # the steps the ledger counts

    class Noisy(functional.PoissonUnits):
        def gradient(self, run: functional.OwnRun, batch: object, expected_units: float) -> dict[str, torch.Tensor]:
            return {"w": torch.randn(3, generator=batches.generator)}

    rule = Noisy()
    planted.plant_own_steps("reused_noise", rule, setup)
    run = _own_run(to_config(make_cfg()))
    first, second = rule.gradient(run, None, 1.0), rule.gradient(run, None, 1.0)  # type: ignore[arg-type]
    assert torch.equal(first["w"], second["w"])
    fixed = dataclasses.replace(setup, batches=functional.FixedOrderBatches(x, y, None, 4, 1, 0, torch.device("cpu")))
    with pytest.raises(ValueError, match="samples nothing"):
        planted.plant_own_steps("half_sample_rate", functional.TreeAggregation(), fixed)
