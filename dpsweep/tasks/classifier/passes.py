"""The classifier's passes: one forward/backward pass of a batch, top-1 accuracy, and per-example
gradient norms (the private clipping norm's input).

    from dpsweep.tasks.classifier.passes import Trainer, train_pass
    loss, stepped = train_pass(Trainer(model, optimizer, nn.CrossEntropyLoss(), device), (x, y), marks)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from opacus.grad_sample.gsm_exp_weights import GradSampleModuleExpandedWeights
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset

from dpsweep.data import resident, users
from dpsweep.interop import opacus_private
from dpsweep.mechanisms.batches import Batch
from dpsweep.tasks import Marks


@dataclass(frozen=True)
class Trainer:
    """What one training pass needs: the (private) model, its optimizer and loss, and the device; and what
    runs after the backward pass of each pass, told the pass's examples and whether the optimizer steps
    next (a DP run's ``OpacusStep.before_step``: the logical batch's examples are counted, and what wraps
    its private step adds its rows to the per-sample gradients before the step)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    criterion: nn.Module
    device: torch.device
    before_step: Callable[[int, bool], None] | None = None


def train_pass(
    trainer: Trainer, batch: Batch, stages: Marks, split: tuple[bool, bool, float] = (True, True, 1.0)
) -> tuple[torch.Tensor, bool]:
    """One forward/backward pass of ``batch``; ``split`` is ``(first, last, weight)`` of the pass in its
    logical batch (``dpsweep.mechanisms.batches``): zero the gradients when first, step when last, weight the
    loss. Returns the mean loss, a detached 0-d tensor on the device (reading it waits for the GPU,
    so callers sum it there and read once per epoch), and whether a real optimizer step happened (a
    DPOptimizer skips it inside a logical batch)."""
    model, optimizer, criterion = trainer.model, trainer.optimizer, trainer.criterion
    first, last, weight = split
    x, y = (t.to(trainer.device, non_blocking=True) for t in batch)
    stages.mark("batch_load")
    if first:
        optimizer.zero_grad(set_to_none=True)
    if len(y) == 0 and isinstance(model, GradSampleModuleExpandedWeights):
        # torch's ExpandedWeights refuse an empty batch; its per-sample gradients are an empty
        # stack, and the step must still add noise and be accounted (Poisson sampling).
        for p in model.parameters():
            if p.requires_grad:
                p.grad_sample = p.new_zeros((0, *p.shape))
        loss = torch.zeros(())
    else:
        loss = criterion(model(x), y)
        stages.mark("forward")  # the forward activations' peak, apart from the backward's
        (loss * weight if weight != 1.0 else loss).backward()
    stages.mark("backward")
    if trainer.before_step is not None:
        trainer.before_step(len(y), last)
    if not last:
        return loss.detach(), False
    optimizer.step()  # with DP: clip per sample, add noise, account for the step
    stepped = not opacus_private.last_step_skipped(optimizer)
    if stepped:  # the level right after the step, while the batch is still on the device
        stages.mark("optimizer_step")
    return loss.detach(), stepped


@torch.no_grad()
def evaluate(
    model: nn.Module, dataset: Dataset[Any], batch_size: int, device: torch.device, device_resident: bool = False
) -> float:
    """Top-1 accuracy on ``dataset`` (``device_resident``: copied to the device once and batched there)."""
    model.eval()
    correct = total = 0
    if device_resident:
        xs, ys = (t.to(device) for t in resident.materialize(dataset))
        batches: Iterable[Batch] = (
            (xs[i : i + batch_size], ys[i : i + batch_size]) for i in range(0, len(ys), batch_size)
        )
    else:  # a generator of its own: iterating a loader draws a seed, which must not shift training's RNG
        batches = DataLoader(dataset, batch_size=batch_size, generator=torch.Generator())
    for x, y in batches:
        pred = model(x.to(device)).argmax(dim=1)
        correct += int((pred == y.to(device)).sum())
        total += len(y)
    return correct / max(total, 1)


def per_example_grad_norms(
    model: nn.Module,
    criterion: nn.Module,
    dataset: Dataset[Any],
    indices: list[int],
    device: torch.device,
    chunk: int = 256,
) -> np.ndarray:
    """The L2 norm of each listed example's loss gradient with respect to the trainable parameters,
    in chunks of ``chunk`` examples (``dpsweep.data.users.per_example_gradients``: torch.func; the model
    is not changed)."""
    was_training = model.training
    model.eval()  # dropout off: the norms at initialisation, deterministic
    norms: list[np.ndarray] = []
    for start in range(0, len(indices), chunk):
        part = indices[start : start + chunk]
        x, y = next(iter(DataLoader(Subset(dataset, part), batch_size=len(part))))
        grads = users.per_example_gradients(model, criterion, x.to(device), y.to(device))
        squared = sum(g.flatten(1).pow(2).sum(1) for g in grads.values())
        norms.append(torch.as_tensor(squared).sqrt().cpu().numpy())
    model.train(was_training)
    return np.concatenate(norms) if norms else np.zeros(0)
