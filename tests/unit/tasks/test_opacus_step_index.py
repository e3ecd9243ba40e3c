"""The classifier's Opacus step numbers each step by its 0-based place in the run, as the ledger does
(dpsweep.tasks.classifier.private.OpacusStep.steps): from its engine accountant's steps, which a
checkpoint restores on resume and a memory iteration leaves as they were. The sampling check reads each
step's rate from the ledger by that index (dpsweep.run.attached)."""

from __future__ import annotations

import pytest
import torch
from helpers import Composer
from opacus import PrivacyEngine
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpsweep.mechanisms.private_step import Attachment, PrivateRun, PrivateStep, Release, StepWrapper
from dpsweep.run.runner import train
from dpsweep.tasks.classifier.private import OpacusStep


class Steps(StepWrapper):
    reads_gradients = False

    def __init__(self) -> None:
        self.active = False
        self.seen: list[int] = []

    def released(self, release: Release) -> None:
        if self.active:
            self.seen.append(release.step)


class RecordSteps(Attachment):
    """The index of every training step's release (not a memory iteration's or a probe's)."""

    def __init__(self) -> None:
        self.steps = Steps()

    def after_start(self, run: PrivateRun, step: PrivateStep) -> None:
        step.wrappers.append(self.steps)

    def begin_epoch(self, optimizer: torch.optim.Optimizer) -> None:
        self.steps.active = True

    def end_epoch(self, optimizer: torch.optim.Optimizer) -> None:
        self.steps.active = False


def test_a_runs_first_training_step_is_step_0_after_its_memory_iteration(make_cfg: Composer) -> None:
    record = RecordSteps()
    result = train(make_cfg("train.epochs=1"), attach=[record])
    assert record.steps.seen == list(range(result.steps)), record.steps.seen[:5]


@pytest.mark.parametrize("restored", [0, 7])
def test_a_resumed_runs_steps_go_on_from_its_accountants_count(restored: int) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    loader = DataLoader(TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,))), batch_size=8)
    engine = PrivacyEngine()
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=loader,
        noise_multiplier=1.0, max_grad_norm=1.0,
    )  # fmt: skip
    if restored:
        engine.accountant.history = [(1.0, 0.25, restored)]  # as a checkpoint restores it
    step = OpacusStep(optimizer, model._module, 1.0, lambda: 0.25, engine)
    seen = Steps()
    seen.active = True
    step.step.wrappers.append(seen)
    for x, y in list(loader)[:3]:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        step.before_step(len(x), last=True)
        optimizer.step()
    assert seen.seen == [restored, restored + 1, restored + 2]
