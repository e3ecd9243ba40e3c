"""Bugs users have met in DP-SGD, planted by tests to check that an audit sees them: attachments of the
private-step protocol (dpsweep.mechanisms.private_step), passed to the runner as the audit is.

    result = train(cfg, attach=[planted.bug("noise_tenth", monkeypatch)])

The run's ledger does not know the bug, so it claims the ε of a correct run; an audit (white or black
box) should find more. Attached before the audit, so that the audit sees the broken release:

- ``noise_tenth``: the noise of each release is a tenth of σC (the ledger's σ unchanged);
- ``reused_noise``: the first release's noise is added again at every step (DP-FTRL: in every node of its tree);
- ``half_sample_rate``: the sample rate the ledger records is half the real one: the batches are drawn at
  twice the planned rate, with the planned steps per epoch (Opacus's Poisson sampler and dpsweep's
  device-resident Poisson batches, through ``monkeypatch``; DP-FTRL samples nothing and is unchanged). The
  step's ``sample_rate`` is the real rate, so that the white-box canaries are in a step as often as an example;
- ``no_clipping``: per-unit gradients are summed unclipped. Where the step holds them (Opacus's
  ``grad_sample``, :attr:`Release.units`), the release is their unclipped sum plus its noise; the steps that
  never hold them (the fused step, and with it dpsweep's own steps and the GAN's critic) get their own
  clipping function replaced by one that clips nothing, through ``monkeypatch`` (undone after the test).
- ``fixed_size_batches``: shuffled batches of exactly round(N·q) examples instead of Poisson batches
  (Opacus's sampler and the device-resident Poisson batches, through ``monkeypatch``): the rate the ledger
  records, on average, but batches too regular for Poisson sampling (not an audit's to catch: the sampling
  check's, :mod:`dpsweep.privacy.sampling`).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from opacus.utils.uniform_sampler import UniformWithReplacementSampler
from torch import Tensor

from dpsweep.data import resident, users
from dpsweep.mechanisms import fused
from dpsweep.mechanisms.private_step import Attachment, FixedOrder, PrivateRun, PrivateStep, Release, StepWrapper
from dpsweep.tasks.gan import critic

BUGS = ("noise_tenth", "no_clipping", "reused_noise", "half_sample_rate")
SAMPLING_BUGS = ("half_sample_rate", "fixed_size_batches")  # what the sampling check must catch


class NoiseTenth(StepWrapper):
    def released(self, release: Release) -> None:
        assert release.clipped is not None
        for k, noisy in release.noisy.items():
            clipped = release.clipped[k]
            noisy.copy_(clipped + (noisy - clipped) / 10)


class ReusedNoise(StepWrapper):
    """Noise drawn once and added again: each step's release gets the first step's noise; DP-FTRL's (whose
    release is the prefix sum of a tree) gets the first node's noise in every node of its tree, so that the
    prefix sum of local step t holds it popcount(t) times (t's binary decomposition into nodes)."""

    def __init__(self) -> None:
        self.first: dict[str, Tensor] | None = None
        self.order: FixedOrder | None = None  # DP-FTRL's, where the step has one

    def released(self, release: Release) -> None:
        assert release.clipped is not None
        clipped = release.clipped
        if self.first is None:
            self.first = {k: (noisy - clipped[k]).clone() for k, noisy in release.noisy.items()}
        times = 1
        if self.order is not None:  # the nodes of the prefix sum at this step of its tree
            local = release.step - max(s for s in self.order.tree_starts if s <= release.step) + 1
            times = bin(local).count("1")
        for k, noisy in release.noisy.items():
            noisy.copy_(clipped[k] + times * self.first[k])


class UnclippedSum(StepWrapper):
    """Where the step shows its per-unit gradients: the release is their unclipped sum plus the step's noise."""

    def released(self, release: Release) -> None:
        if release.units is None:
            return
        assert release.clipped is not None
        for k, noisy in release.noisy.items():
            noisy.add_(release.units[k].sum(dim=0) / release.divisor - release.clipped[k])


def clips_nothing(norms: Tensor, max_grad_norm: float) -> Tensor:
    """A clipping factor of 1 for every row: no clipping."""
    return torch.ones_like(norms)


def sampling_twice_as_often(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Poisson samplers built from now on (until the test ends) draw at twice the rate they were given
    (at most 1), their steps per epoch those of the given rate: the ledger's q is then half the real one."""
    for sampler in (UniformWithReplacementSampler, resident.PoissonBatches):
        built = sampler.__init__

        def doubled(self: Any, *args: Any, _built: Any = built, **kwargs: Any) -> None:
            _built(self, *args, **kwargs)
            self.sample_rate = min(1.0, 2 * self.sample_rate)

        monkeypatch.setattr(sampler, "__init__", doubled)


def fixed_size_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Poisson samplers iterated from now on (until the test ends) yield shuffled batches of exactly
    round(N·q) examples, their steps per epoch unchanged."""

    def opacus_batches(self: UniformWithReplacementSampler) -> Any:
        size = round(self.num_samples * self.sample_rate)
        for _ in range(self.steps):
            yield torch.randperm(self.num_samples, generator=self.generator)[:size].tolist()

    def resident_batches(self: resident.PoissonBatches) -> Any:
        size = round(self.num_samples * self.sample_rate)
        for _ in range(self.steps_per_epoch):
            pick = torch.randperm(self.num_samples, generator=self.generator, device=self.device)[:size]
            yield self.x[pick], self.y[pick]

    monkeypatch.setattr(UniformWithReplacementSampler, "__iter__", opacus_batches)
    monkeypatch.setattr(resident.PoissonBatches, "__iter__", resident_batches)


class Planted(Attachment):
    """One bug, planted in the run's private step before training."""

    def __init__(self, wrapper: StepWrapper) -> None:
        self.wrapper = wrapper

    def after_start(self, run: PrivateRun, step: PrivateStep) -> None:
        if isinstance(self.wrapper, ReusedNoise):
            self.wrapper.order = step.fixed_order
        step.wrappers.append(self.wrapper)


def bug(name: str, monkeypatch: pytest.MonkeyPatch) -> Planted:
    """The attachment that plants ``name`` (one of :data:`BUGS`)."""
    if name == "noise_tenth":
        return Planted(NoiseTenth())
    if name == "reused_noise":
        return Planted(ReusedNoise())
    if name == "no_clipping":
        for module in (users, fused, critic):  # the steps that clip units they never show
            monkeypatch.setattr(module, "clip_factors", clips_nothing)
        return Planted(UnclippedSum())
    if name == "half_sample_rate":
        sampling_twice_as_often(monkeypatch)
        return Planted(StepWrapper())  # the batches are the bug; the release is the step's own
    if name == "fixed_size_batches":
        fixed_size_batches(monkeypatch)
        return Planted(StepWrapper())
    raise ValueError(f"{name}: one of {', '.join(BUGS + SAMPLING_BUGS[1:])}")
