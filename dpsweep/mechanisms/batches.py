"""Logical batches split into physical passes: the memory of a pass is capped, the step and its
privacy accounting stay those of the logical batch.

    with physical_batches(loader, physical_batch_size, optimizer) as passes:
        for x, y, first, last, weight in passes: ...

With DP and a DataLoader this is Opacus's ``BatchMemoryManager``: the DPOptimizer clips and
accumulates each pass and steps (adds noise, accounts one step) only at the end of the logical
batch. Device-resident batches (``dpsweep.data.resident``) are split the same way, signalling the
DPOptimizer as Opacus's ``BatchSplittingSampler`` does. Without DP the loss of each pass is weighted
by its share of the examples (``first``: zero the gradients; ``last``: step).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from opacus.optimizers import DPOptimizer
from opacus.utils.batch_memory_manager import BatchMemoryManager
from torch.utils.data import DataLoader

Batch = tuple[torch.Tensor, torch.Tensor]
Pass = tuple[torch.Tensor, torch.Tensor, bool, bool, float]  # x, y, first, last, weight


@contextmanager
def physical_batches(
    loader: Iterable[Batch], physical_batch_size: int | None, optimizer: torch.optim.Optimizer
) -> Iterator[Iterable[Pass]]:
    """Yield ``(x, y, first, last, weight)`` passes of at most ``physical_batch_size`` examples per
    logical batch (see the module doc); None: one pass per logical batch."""
    if physical_batch_size is None:
        yield ((x, y, True, True, 1.0) for x, y in loader)
    elif isinstance(optimizer, DPOptimizer) and isinstance(loader, DataLoader):
        with BatchMemoryManager(
            data_loader=loader, max_physical_batch_size=physical_batch_size, optimizer=optimizer
        ) as split_loader:
            yield ((x, y, True, True, 1.0) for x, y in split_loader)  # the DPOptimizer skips inner steps
    else:
        yield split(loader, physical_batch_size, optimizer)


def split(loader: Iterable[Batch], size: int, optimizer: torch.optim.Optimizer) -> Iterator[Pass]:
    """Passes of at most ``size`` examples of batches that are already tensors. With DP, as Opacus's
    BatchSplittingSampler: every pass but a logical batch's last tells the DPOptimizer to skip its
    step (it only clips and accumulates). Without DP each pass's loss is weighted by its share."""
    for x, y in loader:
        starts = range(0, max(len(y), 1), size)
        for i in starts:
            part, last = y[i : i + size], i == starts[-1]
            if isinstance(optimizer, DPOptimizer):
                optimizer.signal_skip_step(do_skip=not last)
                yield x[i : i + size], part, True, True, 1.0
            else:
                yield x[i : i + size], part, i == 0, last, len(part) / max(len(y), 1)
