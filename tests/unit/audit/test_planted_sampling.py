"""``half_sample_rate`` (tests/planted.py): the batches are really drawn at twice the rate the ledger
records, by Opacus's Poisson sampler and by dpsweep's device-resident batches alike, with the planned
steps per epoch; undone when the test ends."""

from __future__ import annotations

import planted
import pytest
import torch
from opacus.utils.uniform_sampler import UniformWithReplacementSampler

from dpsweep.data import resident

N, Q, EPOCHS = 2000, 0.05, 20  # 400 batches of about 100 (200 planted): far apart against sampling noise


def _mean_batch(sizes: list[int]) -> float:
    return sum(sizes) / len(sizes)


def _sizes(planting: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[list[int], list[int], int, int]:
    if planting:
        planted.bug("half_sample_rate", monkeypatch)
    opacus = UniformWithReplacementSampler(num_samples=N, sample_rate=Q, generator=torch.Generator().manual_seed(0))
    x, y = torch.zeros(N, 1), torch.zeros(N, dtype=torch.long)
    batches = resident.PoissonBatches(
        x, y, sample_rate=Q, device=torch.device("cpu"), generator=torch.Generator().manual_seed(1)
    )
    opacus_sizes = [len(batch) for _ in range(EPOCHS) for batch in opacus]
    resident_sizes = [len(by) for _ in range(EPOCHS) for _, by in batches]
    return opacus_sizes, resident_sizes, len(opacus), len(batches)


def test_half_sample_rate_draws_batches_at_twice_the_claimed_rate(monkeypatch: pytest.MonkeyPatch) -> None:
    opacus, device, steps_opacus, steps_device = _sizes(True, monkeypatch)
    assert steps_opacus == steps_device == int(1 / Q)  # the planned steps per epoch
    for sizes in (opacus, device):
        assert _mean_batch(sizes) == pytest.approx(2 * Q * N, rel=0.05)


def test_without_the_bug_the_batches_are_drawn_at_the_claimed_rate(monkeypatch: pytest.MonkeyPatch) -> None:
    opacus, device, _, _ = _sizes(False, monkeypatch)
    for sizes in (opacus, device):
        assert _mean_batch(sizes) == pytest.approx(Q * N, rel=0.05)
