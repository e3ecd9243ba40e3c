"""The private-step protocol: where what is attached to a private run (the runner's one-run audit, a
test's planted bug) observes and extends its DP step, whatever the engine (Opacus's DP optimizer, the
steps that noise their own gradients, the fused step, a GAN's critic).

    run.wrap_training_set(canaries)          # before start: the set the loaders are built from
    parts = run.start(tracker)
    step = run.private_step()                # after start
    step.wrappers.append(wrapper)            # before training: units(), released(), stepped() at every step
    ... train ...
    score = run.example_score()              # the final model's per-example score

As jax_privacy enters its canaries (``data_loader_with_fixed_rate_canaries`` wraps the data loader,
``CanaryGradientForwardFnWrapper`` the function that gives the per-example gradients): nothing of an audit
is written in a task. At each step an engine

1. asks its wrappers for rows to add to the step's per-unit gradients (:meth:`StepWrapper.units`: a
   white-box canary's Dirac gradient), and clips them with its real units, by its own clipping;
2. sums the clipped rows and adds its own noise, then shows the wrappers the :class:`Release` (the
   clipped sum and the noisy one, both over the step's divisor), which they may read (the audit's
   scores) or change in place (a test's planted bug) before the optimizer steps with it;
3. tells them the optimizer stepped (:meth:`StepWrapper.stepped`: DP-FTRL's release is the model).

A run's sample rate is the real one of its batches (:attr:`PrivateStep.sample_rate`), so a canary is in
a step as often as a unit of the run is; DP-FTRL samples nothing and says so (:class:`FixedOrder`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor
from torch.utils.data import Dataset

from dpsweep.privacy.ledger import Ledger

Score = Callable[[Tensor, Tensor], Tensor]  # per-example score of (inputs, labels): higher, more likely trained on


@dataclass
class Release:
    """One step's release, by parameter name, everything over ``divisor`` (the step's public divisor):
    ``clipped``, the sum of the clipped per-unit gradients (the wrappers' rows among them); ``noisy``, that
    sum plus the step's noise, what the optimizer steps with (DP-FTRL: the noisy prefix sum of its tree).
    A wrapper may change ``noisy`` in place. ``units``: the per-unit gradients before clipping (unit ×
    the parameter's shape), where the engine holds them anyway (Opacus's ``grad_sample``), else None.
    ``clipped`` is None where the step says only what it releases (a mechanism's own rule that returns
    its noisy gradient alone). ``batch_units``: how many of the run's units (examples, or users at
    dp.unit=user) the step's logical batch held, a wrapper's rows not among them, counted once however
    many physical passes it took; None where the engine does not say (the sampling check,
    :mod:`dpsweep.privacy.sampling`, reads it). Where no wrapper reads gradients
    (:attr:`StepWrapper.reads_gradients`), an engine may leave ``clipped``, ``noisy`` and ``units`` empty."""

    step: int
    clipped: dict[str, Tensor] | None
    noisy: dict[str, Tensor]
    divisor: float
    units: dict[str, Tensor] | None = None
    batch_units: int | None = None


class StepWrapper:
    """What wraps a private step (a white-box audit's canaries, a test's planted bug); each method does
    nothing unless a subclass says otherwise."""

    reads_gradients = True  # False: it reads a release's step and batch_units only (the sampling check)

    def units(self, step: int) -> dict[str, Tensor] | None:
        """Rows to add to step ``step``'s (0-based in the run) per-unit gradients before the step clips
        them, ``{name: (k, *shape)}`` for every trainable parameter; None: none."""
        return None

    def released(self, release: Release) -> None:
        """The step's release, before the optimizer steps with it."""
        return None

    def stepped(self, step: int) -> None:
        """After the optimizer's step ``step``."""
        return None


def extra_units(wrappers: Sequence[StepWrapper], step: int) -> dict[str, Tensor] | None:
    """The rows every wrapper adds to step ``step``'s units, concatenated; None where none adds any."""
    parts = [rows for rows in (w.units(step) for w in wrappers) if rows is not None]
    if not parts:
        return None
    return {name: torch.cat([rows[name] for rows in parts]) for name in parts[0]}


def show(wrappers: Sequence[StepWrapper], release: Release) -> None:
    """Show every wrapper the step's ``release``, in the order they were attached."""
    for wrapper in wrappers:
        wrapper.released(release)


def stepped(wrappers: Sequence[StepWrapper], step: int) -> None:
    for wrapper in wrappers:
        wrapper.stepped(step)


@dataclass(frozen=True)
class FixedOrder:
    """DP-FTRL's steps (Kairouz et al. 2021): no sampling; ``steps_per_epoch`` batches in one fixed
    order, a tree of noise restarted at the steps ``tree_starts`` (0 first), completed before a restart
    or not (``completion``); its optimizer's ``lr`` and ``momentum``, and ``divisor``, the public B the
    clipped sum is divided by: what reading its releases from the model after each step needs."""

    steps_per_epoch: int
    tree_starts: tuple[int, ...]
    completion: bool
    lr: float
    momentum: float
    divisor: float


@dataclass
class PrivateStep:
    """A private run's DP step, as what is attached to it sees it: the trainable parameters it releases
    gradients of (by name, in the step's order), the C its ledger claims (the unit of its releases), the
    real rate of its Poisson batches (None: it samples nothing, ``fixed_order`` says how it goes), and the
    wrappers it calls at every step (:class:`StepWrapper`), which are appended here before training."""

    params: Mapping[str, Tensor]
    max_grad_norm: float
    sample_rate: Callable[[], float] | None
    fixed_order: FixedOrder | None = None
    wrappers: list[StepWrapper] = field(default_factory=list)


class TrainingSet(Protocol):
    """What replaces a private run's training set before its loaders are built (a black-box audit's
    canaries among the examples)."""

    def training_set(self, train: Dataset[Any]) -> Dataset[Any]:
        """The set to train on, from the run's own ``train``."""

    def units(self, units: Tensor) -> Tensor:
        """At user level: each example's user in the new set, from the original examples' ``units``."""


@runtime_checkable
class PrivateRun(Protocol):
    """What a private task's run (a :class:`dpsweep.tasks.TaskRun`) exposes to what is attached to it."""

    def wrap_training_set(self, wrapper: TrainingSet) -> None:
        """Before ``start``: train on ``wrapper.training_set(train)``, sampled at the plan's rate and steps
        (the plan priced the original set's units, and the ledger records the plan's)."""

    def private_step(self) -> PrivateStep:
        """After ``start`` (a DP run): its step, which calls the wrappers appended to it."""

    def example_score(self) -> Score:
        """After training: a per-example score of the final model (higher: more likely trained on)."""


@runtime_checkable
class SampledUnits(Protocol):
    """What a task's run that is not a :class:`PrivateRun` (no private step for attachments to wrap, e.g.
    the recommender's DPAM) exposes so that its Poisson batches are still checked against its ledger's
    sampling (``dpsweep.run.attached.SamplingCheck``, :mod:`dpsweep.privacy.sampling`)."""

    def sampled_units(self) -> Sequence[tuple[int, int]]:
        """(step, units) of each logical step this process took in training epochs since it started or
        resumed: the step's 0-based index in the run, and how many of the run's units (examples, or users
        at dp.unit=user) its batch held."""


class Attachment:
    """What the runner attaches to a private run before training and reads at its end (``dpsweep.run.runner``:
    the one-run audit of ``audit.mode``, and what a caller passes to ``train(cfg, attach=...)``, e.g. a
    test's planted bug). Each method does nothing unless a subclass says otherwise."""

    def tags(self) -> dict[str, str]:
        """Tags of the run (set when its MLflow run is created)."""
        return {}

    def before_start(self, run: PrivateRun) -> None:
        """Before the task starts: e.g. ``run.wrap_training_set(...)``."""
        return None

    def after_start(self, run: PrivateRun, step: PrivateStep) -> None:
        """After it started, before training: e.g. ``step.wrappers.append(...)``."""
        return None

    def begin_epoch(self, optimizer: torch.optim.Optimizer) -> None:
        """Before each training epoch (not the memory iteration or a probe); ``optimizer`` holds what a
        checkpoint restored."""
        return None

    def end_epoch(self, optimizer: torch.optim.Optimizer) -> None:
        """After each training epoch, before its checkpoint (kept in ``optimizer``'s state, saved with it)."""
        return None

    def result(self, run: PrivateRun, claim: Ledger) -> dict[str, float]:
        """Metrics logged after the final epoch (``claim``: the run's ledger)."""
        return {}

    def end_tags(self) -> dict[str, str]:
        """Tags of the run once :meth:`result` has read it (e.g. the sampling check's verdict)."""
        return {}

    def sampled_population(self, planned: int) -> int:
        """How many units (examples, or users) the set the run samples from holds, given ``planned``: the
        plan's N, or what the attachments before this one made it. ``planned`` unless this attachment
        changes the training set (:meth:`PrivateRun.wrap_training_set`: a black-box audit's canaries); read
        after training by the sampling check, whose Binomial(N, q) is of that set."""
        return planned
