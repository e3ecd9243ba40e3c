"""One gather per batch for in-memory tensors: the DataLoader that training and its DP wrapper use.

    loader = gathered.loader(train, batch_size=64, shuffle=False, generator=torch.Generator())

Over a ``TensorDataset`` (digits, cached VGG16 maps), torch's default fetch indexes one example at a time
and ``default_collate`` stacks them again: two copies and a Python call per example. Here the dataset
answers the DataLoader's ``__getitems__`` with each tensor indexed once by the batch's indices
(``torch.utils.data._utils.fetch._MapDatasetFetcher``), and :func:`collate` passes those tensors on. The
batches hold the same values in the same order as before, as the same ``[x, y]`` list, and the sampler
is untouched: Opacus's ``DPDataLoader.from_data_loader`` keeps its Poisson sampler, copies this
collate and wraps it for empty batches (``opacus.data_loader.CollateFnWithEmpty``), so sampling and
the accounting are those of the DataLoader it replaces (tested batch for batch). Other datasets
(torchvision's, read from files) are fetched and collated as torch does.

Measured on the 2-core VM (one torch thread), 1,437 cached 224 px maps (512 x 7 x 7), B=256 through
Opacus's DPDataLoader: 58 ms an epoch example by example, 20 ms gathered.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset, default_collate


class GatheredBatch(list[None]):
    """A batch already gathered, as ``__getitems__`` returns it: its length is the number of
    examples (what Opacus's empty-batch check reads), ``tensors`` the batch itself."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        super().__init__([None] * len(tensors[0]))
        self.tensors = tensors


class GatheredTensors(TensorDataset):
    """A ``TensorDataset`` whose batches are gathered with one index per tensor."""

    def __getitems__(self, indices: Sequence[int]) -> GatheredBatch | list[Any]:
        if len(indices) == 0:
            return []  # an empty Poisson batch: Opacus's collate makes its empty tensors
        index = torch.as_tensor(indices, dtype=torch.long)
        return GatheredBatch([t[index] for t in self.tensors])


def collate(batch: GatheredBatch | list[Any]) -> Any:
    """The gathered tensors as ``default_collate`` would give them (a list), or ``default_collate``."""
    if isinstance(batch, GatheredBatch):
        return list(batch.tensors)
    return default_collate(batch)


def gathering(dataset: Dataset[Any]) -> Dataset[Any]:
    """``dataset`` as a :class:`GatheredTensors` when it is a ``TensorDataset``; else itself."""
    if isinstance(dataset, TensorDataset) and not isinstance(dataset, GatheredTensors):
        return GatheredTensors(*dataset.tensors)
    return dataset


def loader(dataset: Dataset[Any], batch_size: int, shuffle: bool, generator: torch.Generator) -> DataLoader[Any]:
    """The training DataLoader of ``dataset`` (``make_private`` turns it into Opacus's Poisson loader)."""
    return DataLoader(gathering(dataset), batch_size=batch_size, shuffle=shuffle, generator=generator,
                      collate_fn=collate)  # fmt: skip
