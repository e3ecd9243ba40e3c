"""Device-resident data: materialize in order, and Poisson batches with Opacus's sampling semantics."""

from __future__ import annotations

import math

import pytest
import torch
from opacus import PrivacyEngine
from opacus.data_loader import DPDataLoader
from opacus.utils.uniform_sampler import UniformWithReplacementSampler
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from dpsweep.data.resident import PoissonBatches, device_generator, materialize
from dpsweep.privacy.schedule import poisson_schedule

CPU = torch.device("cpu")


def _batches(n: int, sample_rate: float, seed: int = 0, dim: int = 1) -> PoissonBatches:
    """Batches over x = the example's index (so a row names its example), y = index mod 10."""
    x = torch.arange(n, dtype=torch.float32).unsqueeze(1).expand(n, dim).contiguous()
    y = torch.arange(n) % 10
    return PoissonBatches(x, y, sample_rate=sample_rate, device=CPU, generator=device_generator(CPU, seed))


def _sizes(batches: PoissonBatches, epochs: int) -> torch.Tensor:
    return torch.tensor([len(yb) for _ in range(epochs) for _, yb in batches], dtype=torch.float64)


def test_batch_size_is_binomial() -> None:
    n, q = 200, 0.1
    sizes = _sizes(_batches(n, q), epochs=300)  # 3,000 steps
    steps, var = len(sizes), n * q * (1 - q)
    assert abs(sizes.mean().item() - n * q) < 5 * math.sqrt(var / steps)
    # variance of the sample variance of a near-normal variable: 2·var² / (steps − 1)
    assert abs(sizes.var().item() - var) < 5 * var * math.sqrt(2 / (steps - 1))
    assert len(set(sizes.tolist())) > 5  # the batch size varies; it is not B every step


def test_empty_batches_keep_their_shape() -> None:
    n, q = 20, 1 / 20  # P(empty) = 0.95^20 ≈ 0.36
    batches = _batches(n, q, dim=3)
    empty = [(xb, yb) for _ in range(5) for xb, yb in batches if len(yb) == 0]
    assert len(empty) > 10
    xb, yb = empty[0]
    assert xb.shape == (0, 3) and xb.dtype == torch.float32
    assert yb.shape == (0,) and yb.dtype == torch.int64


@pytest.mark.parametrize(
    ("n", "batch_size"),
    [(1437, 64), (1437, 1), (60, 7), (60, 60), (20, 25), (1480, 16), (930, 10)],  # k = 93: int(1/(1/93)) = 92
)
def test_steps_per_epoch_follow_the_privacy_schedule(n: int, batch_size: int) -> None:
    loader = DataLoader(TensorDataset(torch.zeros(n, 1), torch.zeros(n, dtype=torch.int64)), batch_size=batch_size)
    batches = _batches(n, 1 / len(loader))
    schedule = poisson_schedule(n, batch_size)
    assert len(batches) == schedule.steps_per_epoch == len(DPDataLoader.from_data_loader(loader))
    assert sum(1 for _ in batches) == len(batches)
    assert batches.sample_rate == schedule.inclusion_probability
    if len(loader) == 93:
        assert len(batches) == 92  # the float quirk the accountant also uses


def test_same_seed_same_batches_and_other_seed_other_batches() -> None:
    def epoch(seed: int) -> list[list[int]]:
        batches = _batches(50, 0.2, seed=seed)
        return [yb.tolist() for _ in range(2) for _, yb in batches]

    assert epoch(3) == epoch(3)
    first, second = epoch(3)[:5], epoch(3)[5:]
    assert first != second  # the generator carries on from one epoch to the next
    assert epoch(3) != epoch(4)


def test_cpu_batches_equal_opacus_sampler_indices() -> None:
    n, q, seed = 50, 1 / 7, 11
    ours = [xb[:, 0].long().tolist() for xb, _ in _batches(n, q, seed=seed)]
    opacus = list(
        UniformWithReplacementSampler(num_samples=n, sample_rate=q, generator=torch.Generator().manual_seed(seed))
    )
    assert ours == opacus


def test_every_example_can_be_drawn() -> None:
    n = 40
    batches = _batches(n, 0.1)
    seen = {int(i) for _ in range(10) for xb, _ in batches for i in xb[:, 0]}
    assert seen == set(range(n))


def test_labels_travel_with_their_inputs() -> None:
    for xb, yb in _batches(30, 0.3):
        assert torch.equal(yb, xb[:, 0].long() % 10)


@pytest.mark.parametrize("q", [0.0, -0.1, 1.5])
def test_rejects_sample_rates_outside_0_1(q: float) -> None:
    with pytest.raises(ValueError, match="sample_rate"):
        _batches(10, q)


class _Pairs(Dataset[tuple[torch.Tensor, int]]):
    """A map-style dataset that is not a TensorDataset (images and Python int labels)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.full((1, 4, 4), float(i)), (3 * i) % 10


def test_materialize_keeps_dataset_order() -> None:
    x, y = materialize(_Pairs(23), batch_size=5)  # 5 does not divide 23
    assert x.shape == (23, 1, 4, 4) and x.dtype == torch.float32
    assert y.dtype == torch.int64
    assert torch.equal(x[:, 0, 0, 0], torch.arange(23, dtype=torch.float32))
    assert torch.equal(y, (3 * torch.arange(23)) % 10)


def test_materialize_takes_a_tensor_datasets_tensors() -> None:
    inputs, labels = torch.randn(9, 2), torch.arange(9)
    x, y = materialize(TensorDataset(inputs, labels))
    assert x is inputs and y is labels
    _, y32 = materialize(TensorDataset(inputs, labels.int()))
    assert y32.dtype == torch.int64 and torch.equal(y32, labels)


def test_opacus_trains_on_poisson_batches_with_empty_steps() -> None:
    """make_private on an ordinary loader sets q and the accountant; the steps come from PoissonBatches."""
    n, batch_size, sigma = 20, 1, 1.0
    torch.manual_seed(0)
    x, y = torch.randn(n, 5), torch.randint(0, 3, (n,))
    loader = DataLoader(TensorDataset(x, y), batch_size=batch_size)
    model = nn.Linear(5, 3)
    engine = PrivacyEngine(accountant="rdp")
    model, optimizer, private_loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=loader,
        noise_multiplier=sigma,
        max_grad_norm=1.0,
        poisson_sampling=True,
    )
    batches = PoissonBatches(x, y, sample_rate=private_loader.sample_rate, device=CPU,
                             generator=device_generator(CPU, 0))  # fmt: skip
    sizes = []
    for xb, yb in batches:
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(xb), yb).backward()
        optimizer.step()
        sizes.append(len(yb))
    assert 0 in sizes and len(sizes) == len(private_loader)
    assert engine.accountant.history == [(sigma, 1 / len(private_loader), len(private_loader))]
    assert all(torch.isfinite(p).all() for p in model.parameters())
