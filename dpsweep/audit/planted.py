"""Bugs users have met in DP-SGD, planted by tests to check that an audit sees them (tests only).

    DPSWEEP_TEST_PLANTED_BUG=no_clipping dpsweep audit.mode=white_box dp.target_epsilon=1

The run's ledger does not know the bug, so it claims the ε of a correct run; an audit (white or black
box) should find more. :func:`plant` breaks a DP optimizer and its loader through their public
methods and attributes:

- ``noise_tenth``: the noise drawn is a tenth of σC (the ledger's σ unchanged);
- ``no_clipping``: per-example gradients are summed unclipped;
- ``half_sample_rate``: the loader samples at twice the rate the ledger records;
- ``reused_noise``: the noise is drawn once and added again at every step.
"""

from __future__ import annotations

import os

import torch
from opacus.data_loader import DPDataLoader
from opacus.optimizers import DPOptimizer
from torch import Tensor

PLANTED_BUGS = ("noise_tenth", "no_clipping", "half_sample_rate", "reused_noise")
PLANTED_BUG_ENV = "DPSWEEP_TEST_PLANTED_BUG"


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
    elif bug == "reused_noise":
        first: list[Tensor] = []  # the RNG state the first step's noise was drawn from

        def reused() -> None:
            state = torch.get_rng_state()
            if not first:
                first.append(state)
            torch.set_rng_state(first[0])
            add_noise()
            torch.set_rng_state(state)

        optimizer.add_noise = reused
