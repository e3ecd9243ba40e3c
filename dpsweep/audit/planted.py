"""Bugs users have met in DP-SGD, planted by tests to check that an audit sees them (tests only).

    DPSWEEP_TEST_PLANTED_BUG=no_clipping dpsweep audit.mode=white_box dp.target_epsilon=1

The run's ledger does not know the bug, so it claims the ε of a correct run; an audit (white or black
box) should find more. :func:`plant` breaks Opacus's DP optimizer and its loader through their public
methods and attributes; :func:`plant_own_run` and :func:`plant_own_steps` break the steps that noise their
own gradients (``dpsweep.mechanisms.functional``: DP-FTRL, user-level DP-SGD, the fused step) through
what they are built from:

- ``noise_tenth``: the noise drawn is a tenth of σC (the ledger's σ unchanged);
- ``no_clipping``: per-example gradients are summed unclipped;
- ``half_sample_rate``: the loader samples at twice the rate the ledger records (DP-FTRL samples
  nothing: refused there);
- ``reused_noise``: the noise is drawn once and added again at every step (DP-FTRL: every node of the
  tree gets the same noise).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from opacus.data_loader import DPDataLoader
from opacus.optimizers import DPOptimizer
from torch import Tensor

from dpsweep.data.device import Generators

if TYPE_CHECKING:
    from dpsweep.mechanisms.functional import OwnRule, OwnRun, OwnSetup

PLANTED_BUGS = ("noise_tenth", "no_clipping", "half_sample_rate", "reused_noise")
PLANTED_BUG_ENV = "DPSWEEP_TEST_PLANTED_BUG"
UNCLIPPED = 1e6  # no_clipping in own steps: C this many times larger, σ as many times smaller (σC unchanged)


def planted_bug() -> str | None:
    """The bug a test asked for (``DPSWEEP_TEST_PLANTED_BUG``), or None."""
    bug = os.environ.get(PLANTED_BUG_ENV) or None
    if bug is not None and bug not in PLANTED_BUGS:
        raise ValueError(f"{PLANTED_BUG_ENV}={bug}: one of {', '.join(PLANTED_BUGS)}")
    return bug


def plant(bug: str, optimizer: DPOptimizer, loader: DPDataLoader) -> None:
    """Break ``optimizer`` and ``loader`` as ``bug`` says (before an audit wraps them)."""
    clip_and_accumulate, add_noise = optimizer.clip_and_accumulate, optimizer.add_noise
    if bug == "half_sample_rate":
        sampler = loader.batch_sampler
        sampler.sample_rate *= 2
        loader.sample_rate = sampler.sample_rate  # device-resident batches read it
    elif bug == "no_clipping":

        def unclipped() -> None:
            clip, optimizer.max_grad_norm = optimizer.max_grad_norm, float("inf")
            clip_and_accumulate()
            optimizer.max_grad_norm = clip

        optimizer.clip_and_accumulate = unclipped
    elif bug == "noise_tenth":

        def tenth() -> None:
            add_noise()
            for p in optimizer.params:
                p.grad = p.summed_grad + (p.grad - p.summed_grad) / 10

        optimizer.add_noise = tenth
    elif bug == "reused_noise":  # Opacus draws its noise from the run's noise generator (or the default one)
        optimizer.add_noise = _reusing([optimizer.generator or torch.default_generator], add_noise)


def plant_own_run(bug: str, run: OwnRun) -> OwnRun:
    """The run a rule sets up from, broken (before ``setup``): ``noise_tenth`` makes σ a tenth;
    ``no_clipping`` clips at C·:data:`UNCLIPPED` with σ/:data:`UNCLIPPED`, so the noise σC is unchanged."""
    if bug == "noise_tenth":
        return dataclasses.replace(run, sigma=run.sigma / 10)
    if bug == "no_clipping":
        dp = dataclasses.replace(run.cfg.dp, max_grad_norm=run.cfg.dp.max_grad_norm * UNCLIPPED)
        return dataclasses.replace(run, cfg=dataclasses.replace(run.cfg, dp=dp), sigma=run.sigma / UNCLIPPED)
    return run


def plant_own_steps(bug: str, rule: OwnRule, setup: OwnSetup) -> None:
    """The rule's batches and noise, broken (after ``setup``): ``half_sample_rate`` doubles the batches'
    rate; ``reused_noise`` draws every step's noise from the first step's generator states (the run's
    and the default one; DP-FTRL: the tree's, at every optimizer step)."""
    if bug == "half_sample_rate":
        batches: Any = setup.batches
        if not hasattr(batches, "sample_rate"):
            raise ValueError(f"{PLANTED_BUG_ENV}={bug}: this run samples nothing (DP-FTRL's fixed order)")
        batches.sample_rate *= 2
    elif bug == "reused_noise":
        tree = getattr(setup.optimizer, "noise", None)  # DP-FTRL's tree aggregation
        if tree is not None:
            setup.optimizer.step = _reusing([tree.generator], setup.optimizer.step)  # type: ignore[method-assign]
        else:  # the run's generators (its noise among them)
            generators = [setup.generator, torch.default_generator]
            rule.gradient = _reusing(generators, rule.gradient)  # type: ignore[method-assign]


def _reusing(generators: Sequence[torch.Generator | Generators], draw: Callable[..., Any]) -> Callable[..., Any]:
    """``draw`` called from the ``generators``' states of its first call every time (their states then
    restored)."""
    first: list[list[Tensor]] = []

    def reused(*args: Any, **kwargs: Any) -> Any:
        states = [g.get_state() for g in generators]
        if not first:
            first.append(states)
        for g, state in zip(generators, first[0], strict=True):
            g.set_state(state)
        try:
            return draw(*args, **kwargs)
        finally:
            for g, state in zip(generators, states, strict=True):
                g.set_state(state)

    return reused


def plant_critic(
    bug: str, step: Any, draw: Callable[..., Any], batches: Any, noise: torch.Generator
) -> tuple[Any, Callable[..., Any]]:
    """The GAN's private critic step broken (``step``: its ``CriticStep``; ``draw``: the function that draws
    its noisy gradient from ``noise``; ``batches``: its Poisson batches): the step, the draw."""
    if bug == "noise_tenth":
        step = dataclasses.replace(step, noise_multiplier=step.noise_multiplier / 10)
    elif bug == "no_clipping":
        clip, sigma = step.max_grad_norm * UNCLIPPED, step.noise_multiplier / UNCLIPPED
        step = dataclasses.replace(step, max_grad_norm=clip, noise_multiplier=sigma)
    elif bug == "half_sample_rate":
        batches.sample_rate *= 2
    elif bug == "reused_noise":
        draw = _reusing([noise], draw)
    return step, draw
