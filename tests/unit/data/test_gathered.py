"""dpsweep.data.gathered: batches gathered with one index per tensor are those of torch's default fetch and
collate, through Opacus's Poisson loader too (empty batches included)."""

from __future__ import annotations

from typing import Any

import torch
from opacus.data_loader import DPDataLoader
from torch.utils.data import DataLoader, TensorDataset

from dpsweep.data import gathered


def _dataset(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 3, 4, 4, generator=g), torch.randint(0, 10, (n,), generator=g))


def _batches(loader: Any) -> list[list[torch.Tensor]]:
    return [list(b) for b in loader]


def _assert_same(got: list[list[torch.Tensor]], want: list[list[torch.Tensor]]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert len(a) == len(b) == 2
        for x, y in zip(a, b, strict=True):
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)


def test_poisson_batches_are_those_of_the_default_loader_empty_ones_included() -> None:
    data = _dataset(30)
    for seed in range(3):
        plain = DPDataLoader.from_data_loader(
            DataLoader(data, batch_size=6), generator=torch.Generator().manual_seed(seed)
        )
        ours = DPDataLoader.from_data_loader(
            gathered.loader(data, 6, shuffle=False, generator=torch.Generator()),
            generator=torch.Generator().manual_seed(seed),
        )
        assert isinstance(ours.dataset, gathered.GatheredTensors) and ours.sample_rate == plain.sample_rate
        _assert_same(_batches(ours), _batches(plain))
    # q = 1/30: most Poisson batches are empty; both loaders give the same zero-length tensors
    plain = DPDataLoader.from_data_loader(DataLoader(data, batch_size=1), generator=torch.Generator().manual_seed(0))
    ours = DPDataLoader.from_data_loader(
        gathered.loader(data, 1, shuffle=False, generator=torch.Generator()), generator=torch.Generator().manual_seed(0)
    )
    got, want = _batches(ours), _batches(plain)
    assert any(len(b[0]) == 0 for b in want) and any(len(b[0]) > 0 for b in want)
    _assert_same(got, want)


def test_shuffled_batches_are_those_of_the_default_loader() -> None:
    data = _dataset(23)
    plain = DataLoader(data, batch_size=5, shuffle=True, generator=torch.Generator().manual_seed(4))
    ours = gathered.loader(data, 5, shuffle=True, generator=torch.Generator().manual_seed(4))
    _assert_same(_batches(ours), _batches(plain))


def test_other_datasets_are_fetched_and_collated_as_torch_does() -> None:
    examples = [(torch.full((2,), float(i)), i) for i in range(7)]
    ours = gathered.loader(examples, 3, shuffle=False, generator=torch.Generator())  # type: ignore[arg-type]
    assert ours.dataset is examples
    _assert_same(_batches(ours), _batches(DataLoader(examples, batch_size=3)))  # type: ignore[arg-type]
