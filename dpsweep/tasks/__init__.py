"""Tasks: what a run trains, in a registry the runner looks up by ``task.name`` (the ``task`` config group).

    dpsweep task=classifier          # the default: image classification with DP-SGD

The runner (``dpsweep.run.runner``) owns everything that is the same for every task: the plan, the
MLflow run's lifecycle, checkpoints and resume, the memory stages, the per-epoch loop, pruning, the
final privacy accounting and failure handling. A task owns what differs, through two objects:

- a :class:`Task` (registered in :data:`TASKS`) builds a :class:`TaskRun` for one run, before the
  MLflow run exists, so that bad input (missing weights, an unwritable cache) leaves no run behind;
- the :class:`TaskRun` then says how its modules reach the device, how one epoch of training goes,
  how it evaluates (and whether it is done before ``train.epochs``), how the memory probe's single
  iteration goes, and which privacy events it spent (``privacy_ledger``: a
  :class:`dpsweep.privacy.ledger.Ledger` of dp-accounting ``DpEvent`` s, e.g. Poisson-subsampled Gaussian
  steps and a private clipping-norm release, which the runner's accountants turn into ε; a
  mechanism without sampling declares no sampling: no amplification).

A new task is a module in this package that registers itself (as ``dpsweep.tasks.gan.task`` does)::

    class GanTask:
        def build(self, inputs: RunInputs) -> TaskRun: ...

    TASKS.register("gan")(GanTask())

plus its module in :data:`TASK_MODULES`, a schema (a ``TaskConfig`` subclass in ``dpsweep.config``,
which names its ``objective``) and ``conf/task/<name>.yaml``; the runner is not edited.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from opacus import PrivacyEngine
from torch import nn

from dpsweep.config import Config
from dpsweep.data.loaders import DataSplits
from dpsweep.data.resident import Generators
from dpsweep.distributed import Ranks
from dpsweep.plan import RunPlan
from dpsweep.privacy import ledger
from dpsweep.privacy.streams import Streams
from dpsweep.registry import Registry
from dpsweep.tracking import Tracker


@dataclass(frozen=True)
class RunInputs:
    """What a task builds one run from: the config, its plan (σ, steps, physical batch), the data, the
    device, and which rank of the run this process is (``train.devices``)."""

    cfg: Config
    plan: RunPlan
    data: DataSplits
    device: torch.device
    streams: Streams  # the private streams: sampling, noise, canaries (dpsweep.privacy.streams)
    ranks: Ranks = field(default_factory=Ranks)


@dataclass
class Checkpointed:
    """The parts of a run a checkpoint saves and restores (``dpsweep.run.checkpoint``): the trained module,
    its optimizer, the privacy engine (its accountant) and the generator the batches are drawn from."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    engine: PrivacyEngine | None
    generator: torch.Generator | Generators


class Marks(Protocol):
    def mark(self, stage: str) -> None:
        """Record the memory level at ``stage`` (batch_load, backward, optimizer_step) during the first
        iteration, or the peak so far at a split of it (forward: ``dpsweep.memory.stages.PEAK_SPLITS``)."""


class Stages(Marks, Protocol):
    """The runner's memory-stage log, as a task sees it (see ``dpsweep.memory.stages``)."""

    def stepped(self) -> None:
        """An optimizer step happened (counted; the first completes the four stages)."""


class TaskRun(Protocol):
    """One run of a task, built before the MLflow run and started inside it."""

    # Metrics of train_epoch computed from private examples without noise (e.g. train_loss): with DP
    # the runner keeps them in TrainResult but neither logs nor prints them.
    private_metrics: tuple[str, ...]
    # Whether the first iteration's memory stages follow the size of private data (e.g. the training
    # users' ratings): with DP the runner then logs none of them (a probe, which only measures, does).
    private_stages: bool

    def tags(self) -> dict[str, Any]:
        """Tags about the task's modules, set when the MLflow run is created (e.g. model.trainable_params)."""

    def start(self, run: Tracker) -> Checkpointed:
        """Put the modules on the device and make them private; returns what checkpoints hold."""

    def train_epoch(self, epoch: int, stages: Stages) -> dict[str, float]:
        """Train one epoch; returns the epoch's training metrics (e.g. train_loss)."""

    def evaluate(self, epoch: int, final: bool) -> dict[str, float]:
        """The metrics after ``epoch``; after the ``final`` one (the last, or where :meth:`done` ended
        training) they include the task's objective."""

    def done(self) -> bool:
        """Training ended before train.epochs (e.g. task=gan's privacy budget is spent): the runner
        evaluates this epoch as the final one and stops."""

    def probe(self, stages: Stages) -> dict[str, float]:
        """Run one training iteration on exactly ``train.batch_size`` examples (memory probe)."""

    def memory_iteration(self, stages: Marks) -> None:
        """DP runs, before training: the memory stages of one iteration on exactly ``train.batch_size``
        examples, then undo it (parameters, optimizer state, accountant history, RNG), so that training
        is as without it. A Poisson batch's size is private; B is not."""

    def released_model(self) -> tuple[nn.Module, np.ndarray]:
        """What a run releases as its model: the trained module without any DP wrapper (only the
        trained parameters: no public frozen backbone), and a synthetic input example (never a
        training example)."""

    def trained_model(self) -> nn.Module:
        """The whole trained module, without any DP wrapper, on its device (returned by ``train``)."""

    def privacy_ledger(self) -> ledger.Ledger:
        """Every privacy-spending release so far, in order (empty without DP)."""

    def params(self) -> dict[str, Any]:
        """Parameters the task decided at start and the run logs (e.g. dp.max_grad_norm_chosen)."""


class Task(Protocol):
    # The metric a sweeper optimises is the task config's ``objective`` (dpsweep.config.TaskConfig).

    def build(self, inputs: RunInputs) -> TaskRun:
        """Build one run's modules; raise InputError for bad input (before any MLflow run exists)."""


TASKS: Registry[Task] = Registry("task")

# Modules that register tasks; imported on first lookup, so ``import dpsweep.tasks`` stays light.
TASK_MODULES = (  # a new task adds its module here
    "dpsweep.tasks.classifier.task", "dpsweep.tasks.gan.task", "dpsweep.tasks.recommender.task",
)  # fmt: skip


def get(name: str) -> Task:
    """The task ``task.name`` names; an unknown name lists the valid ones."""
    for module in TASK_MODULES:
        importlib.import_module(module)
    return TASKS.get(name, key="task.name")
