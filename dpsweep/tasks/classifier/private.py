"""The classifier's private step through Opacus, as what is attached to the run sees it
(:mod:`dpsweep.mechanisms.private_step`), its sampling kept to the plan's when its training set is another,
and the final model's per-example score.

    opacus = OpacusStep(optimizer, model, max_grad_norm, lambda: loader.sample_rate, engine)
    trainer = Trainer(model, optimizer, criterion, device, before_step=opacus.before_step)
    step = opacus.step                                 # a PrivateStep: wrappers are appended to it

Through Opacus's documented extension points only, no method of the optimizer replaced: the wrappers'
rows join the per-sample gradients Opacus's hooks left in each parameter's ``grad_sample`` after the
backward pass, before ``optimizer.step()`` (so Opacus's own ``clip_and_accumulate`` clips them with the
real examples', and its ``add_noise`` noises their sum); the release is read by a step hook
(``DPOptimizer.attach_step_hook``, after the noise and the division by the expected batch), chained
after the accountant's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from opacus import PrivacyEngine
from opacus.data_loader import DPDataLoader
from opacus.optimizers import DPOptimizer
from torch import Tensor, nn

from dpsweep.mechanisms.private_step import PrivateStep, Release, Score, extra_units, show


class OpacusStep:
    """Opacus's DP optimizer as a :class:`dpsweep.mechanisms.private_step.PrivateStep` (module doc)."""

    def __init__(
        self,
        optimizer: DPOptimizer,
        model: nn.Module,
        max_grad_norm: float,
        sample_rate: Callable[[], float],
        engine: PrivacyEngine,
    ) -> None:
        """``model``: the module whose parameters ``optimizer`` steps (their names); ``max_grad_norm``: the C
        it clips at; ``sample_rate``: its loader's real rate; ``engine``: its privacy engine, whose accountant
        numbers the steps (:attr:`steps`)."""
        names = {id(p): k for k, p in model.named_parameters()}
        self.optimizer, self.engine = optimizer, engine
        self.batch_units = 0  # the examples of the logical batch so far, over its physical passes
        self.names = [names[id(p)] for p in optimizer.params]
        self.step = PrivateStep(dict(zip(self.names, optimizer.params, strict=True)), max_grad_norm, sample_rate)
        accountant = optimizer.step_hook

        def hook(opacus: DPOptimizer) -> None:
            if accountant is not None:
                accountant(opacus)
            self._released()

        optimizer.attach_step_hook(hook)

    @property
    def steps(self) -> int:
        """The steps the run has taken before the one under way: its engine accountant's (a checkpoint
        restores them on resume; a memory iteration's step is taken out of them again), so that a step's
        index is its 0-based place in the run, as the ledger's."""
        return sum(int(steps) for _, _, steps in self.engine.accountant.history)

    def before_step(self, examples: int, last: bool) -> None:
        """After the backward pass of each physical pass: its ``examples`` are counted (from the batch, not
        from per-sample gradients, which ghost clipping never keeps), and before the logical batch's
        ``optimizer.step()`` (``last``) the wrappers' rows join the per-sample gradients."""
        self.batch_units += examples
        if not last:
            return
        rows = extra_units(self.step.wrappers, self.steps) if self.step.wrappers else None
        if rows is None:
            return
        for name, p in zip(self.names, self.optimizer.params, strict=True):
            grad_sample: Any = p.grad_sample  # set by Opacus's hooks
            p.grad_sample = torch.cat([grad_sample, rows[name].to(grad_sample.device, grad_sample.dtype)])

    def _released(self) -> None:
        """Opacus's step hook, after ``add_noise`` and ``scale_grad``: each ``p.grad`` is the noisy sum over the
        expected batch (``loss_reduction="mean"``), ``p.summed_grad`` the clipped sum."""
        steps = self.steps - 1  # the accountant's hook, called before this one, has counted this step
        counted, self.batch_units = self.batch_units, 0
        if not self.step.wrappers:
            return
        opacus = self.optimizer
        divisor = float(opacus.expected_batch_size * opacus.accumulated_iterations)
        if opacus.loss_reduction != "mean":
            divisor = 1.0
        if not any(w.reads_gradients for w in self.step.wrappers):  # the sampling check alone: no copies
            show(self.step.wrappers, Release(steps, None, {}, divisor, batch_units=counted))
            return
        params = list(zip(self.names, opacus.params, strict=True))
        clipped = {k: p.summed_grad / divisor for k, p in params}
        noisy: dict[str, Tensor] = {k: p.grad for k, p in params if p.grad is not None}
        units = dict(zip(self.names, opacus.grad_samples, strict=True))
        show(self.step.wrappers, Release(steps, clipped, noisy, divisor, units, batch_units=counted))


def keep_planned_sampling(
    engine: PrivacyEngine,
    optimizer: DPOptimizer,
    loader: DPDataLoader,
    sample_rate: float,
    steps_per_epoch: int,
) -> None:
    """Sample a training set other than the plan's (a black-box audit's, with canaries in and out) at the
    plan's rate and steps per epoch (those of the plan's N examples), and record that rate in the accountant:
    each example is then sampled as a plain run's would be, and the ledger is the plain run's. The noisy sum
    stays over the config's B, which :func:`~dpsweep.mechanisms.opacus_engine.make_private` set, whatever
    set is sampled: a public constant, not the expected batch of the N examples (issue 58, item 5; cf. arXiv
    2605.15648)."""
    sampler: Any = loader.batch_sampler
    sampler.sample_rate, sampler.steps = sample_rate, steps_per_epoch
    loader.sample_rate = sample_rate
    optimizer.attach_step_hook(engine.accountant.get_optimizer_hook_fn(sample_rate=sample_rate))


def minus_loss(model: nn.Module) -> Score:
    """The classifier's per-example score: minus its cross-entropy (a model that trained on an example fits
    its label better, a wrong one included)."""
    model.eval()
    return lambda x, y: -nn.functional.cross_entropy(model(x), y, reduction="none")
