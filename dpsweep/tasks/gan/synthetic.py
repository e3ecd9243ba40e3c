"""Evaluating a generator's synthetic data without leaking the real data: TSTR, memorisation, grids.

    from dpsweep.tasks.gan.synthetic import sample, tstr_accuracy, memorisation_share, image_grid
    x, y = sample([gan.generator], n=1437, num_classes=10, rng=torch.Generator().manual_seed(0))
    result = tstr_accuracy(build_classifier, (x, y), real_test, Recipe(epochs=15, lr=0.05, batch_size=64,
                           val_fraction=0.2), seed=0, device=torch.device("cpu"))

- **TSTR** (train on synthetic, test on real; Esteban, Hyland & Rätsch 2017): a classifier trained
  on a labelled synthetic set with a fixed recipe, the epoch kept by its accuracy on a held-out
  *synthetic* split; only the kept model's accuracy on the real test split is reported. Selecting
  on real data would leak it and inflate the score (DPImageBench, Chen et al. 2025, arXiv 2503.14681).
- **Memorisation share**: of synthetic samples, the share whose nearest training image (L2) is
  nearer than their nearest test image (a distance-to-closest-record check, as in DPImageBench's
  and synthcity's privacy metrics). A sample independent of the training set is as likely to be
  nearest to any of the n_train + n_test real images (exchangeability), so it scores
  n_train / (n_train + n_test) on average (``memorisation_baseline``); memorised ones score 1. It
  reads the training data without noise.
- **Image grids**: 10 samples of each class, one class per row, as a uint8 image for MLflow.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from dpsweep.tasks.gan.models import Generator


@torch.no_grad()
def sample(
    generators: Sequence[Generator],
    n: int,
    num_classes: int,
    rng: torch.Generator,
    device: torch.device | None = None,
    batch_size: int = 512,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` labelled samples on the CPU from a uniform mixture of K ``generators`` (one: that
    generator): classes balanced (class i % num_classes) in a shuffled order, and the k-th generator
    makes the samples at positions k, k + K, k + 2K, ... (n/K each)."""
    labels = (torch.arange(n) % num_classes)[torch.randperm(n, generator=rng)]
    images = torch.zeros(n, 1, 28, 28)
    k = len(generators)
    for member, generator in enumerate(generators):
        at = torch.arange(member, n, k)
        was_training = generator.training
        generator.eval()
        for start in range(0, len(at), batch_size):
            rows = at[start : start + batch_size]
            z = torch.randn(len(rows), generator.latent_dim, generator=rng)
            images[rows] = generator(z.to(device or z.device), labels[rows].to(device or z.device)).cpu()
        generator.train(was_training)
    return images, labels


@dataclass(frozen=True)
class Recipe:
    """The TSTR classifier's fixed training recipe (``gan.tstr_*``): SGD with momentum 0.9."""

    epochs: int
    lr: float
    batch_size: int
    val_fraction: float  # of the synthetic set, held out to choose the epoch
    momentum: float = 0.9


@dataclass(frozen=True)
class Tstr:
    accuracy: float  # of the kept classifier on the real test split
    val_accuracy: float  # its accuracy on the held-out synthetic split (what chose it)
    epoch: int  # the epoch kept


def tstr_accuracy(
    build: Callable[[], nn.Module],
    train: tuple[torch.Tensor, torch.Tensor],
    test: tuple[torch.Tensor, torch.Tensor],
    recipe: Recipe,
    seed: int,
    device: torch.device,
    progress: Callable[[int, float], None] | None = None,
) -> Tstr:
    """Train ``build()`` on ``train`` (minus a held-out share, which chooses the epoch), then score the
    chosen epoch's model on ``test``, once. With real ``train`` this is the real-data baseline.
    ``progress(epoch, held-out accuracy)`` is told of each epoch as it ends."""
    x, y = train
    rng = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(y), generator=rng)
    n_val = max(1, round(recipe.val_fraction * len(y)))
    val, fit = order[:n_val], order[n_val:]
    torch.manual_seed(seed)
    model = build().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=recipe.lr, momentum=recipe.momentum)
    loss_fn = nn.CrossEntropyLoss()
    best = Tstr(float("nan"), -1.0, 0)
    best_state = copy.deepcopy(model.state_dict())
    for epoch in range(1, recipe.epochs + 1):
        model.train()
        shuffled = fit[torch.randperm(len(fit), generator=rng)]
        for start in range(0, len(shuffled), recipe.batch_size):
            pick = shuffled[start : start + recipe.batch_size]
            optimizer.zero_grad(set_to_none=True)
            loss_fn(model(x[pick].to(device)), y[pick].to(device)).backward()
            optimizer.step()
        val_accuracy = accuracy(model, x[val], y[val], device)
        if progress is not None:
            progress(epoch, val_accuracy)
        if val_accuracy > best.val_accuracy:
            best = Tstr(float("nan"), val_accuracy, epoch)
            best_state = copy.deepcopy(model.state_dict())
    model.load_state_dict(best_state)
    return Tstr(accuracy(model, *test, device), best.val_accuracy, best.epoch)


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, device: torch.device, batch_size: int = 1024) -> float:
    """Top-1 accuracy of ``model`` on the tensors ``x``, ``y``."""
    model.eval()
    correct = sum(
        int((model(x[i : i + batch_size].to(device)).argmax(1).cpu() == y[i : i + batch_size]).sum())
        for i in range(0, len(y), batch_size)
    )
    return correct / max(len(y), 1)


def memorisation_baseline(n_train: int, n_test: int) -> float:
    """The expected memorisation share of samples independent of the training set."""
    return n_train / (n_train + n_test)


@torch.no_grad()
def memorisation_share(
    synthetic: torch.Tensor, train: torch.Tensor, test: torch.Tensor, samples: int, rng: torch.Generator
) -> float:
    """The share of (up to ``samples``, drawn at random) synthetic images nearer (L2) to a training
    image than to any test image: :func:`memorisation_baseline` on average for samples independent
    of the training set, 1 for memorised ones."""
    real_train, real_test = train.flatten(1), test.flatten(1)
    picked = synthetic[torch.randperm(len(synthetic), generator=rng)[: min(samples, len(synthetic))]].flatten(1)
    nearer = 0
    for start in range(0, len(picked), 256):
        chunk = picked[start : start + 256]
        to_train = torch.cdist(chunk, real_train).min(dim=1).values
        to_test = torch.cdist(chunk, real_test).min(dim=1).values
        nearer += int((to_train < to_test).sum())
    return nearer / max(len(picked), 1)


@torch.no_grad()
def image_grid(
    generator: Generator, num_classes: int, rng: torch.Generator, device: torch.device, per_class: int = 10
) -> np.ndarray:
    """``per_class`` samples of each class, a row per class, as an (H, W) uint8 image (white digits
    on black, 2-pixel gaps)."""
    from torchvision.utils import make_grid

    labels = torch.arange(num_classes).repeat_interleave(per_class)
    z = torch.randn(len(labels), generator.latent_dim, generator=rng)
    was_training = generator.training
    generator.eval()
    images = generator(z.to(device), labels.to(device)).cpu()
    generator.train(was_training)
    low, high = float(generator.low), float(generator.high)
    grid = make_grid(images, nrow=per_class, padding=2, normalize=True, value_range=(low, high), pad_value=0.0)
    return (grid[0] * 255).round().clamp(0, 255).to(torch.uint8).numpy()
