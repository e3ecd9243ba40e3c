"""DP-FTRL's fixed order (dpsweep.mechanisms.functional.FixedOrderBatches): B units a batch, each unit once
an epoch; or, for a black-box audit's smaller training set, the plan's number of batches, as even as can be."""

from __future__ import annotations

import torch

from dpsweep.mechanisms.functional import FixedOrderBatches


def _epoch(batches: FixedOrderBatches) -> list[torch.Tensor]:
    return [b.y for b in batches]  # y holds each example's index here


def test_b_units_a_batch_the_last_one_smaller_each_unit_once() -> None:
    y = torch.arange(10)
    order = FixedOrderBatches(torch.zeros(10, 1), y, None, 4, 1, 0, torch.device("cpu"))
    epoch = _epoch(order)
    assert len(order) == 3 and [len(b) for b in epoch] == [4, 4, 2]
    assert sorted(torch.cat(epoch).tolist()) == list(range(10))
    assert [b.tolist() for b in _epoch(order)] == [b.tolist() for b in epoch]  # the same order every epoch


def test_a_given_number_of_batches_splits_the_units_as_evenly_as_can_be() -> None:
    """937 units in the 23 batches of 1,437 at B = 64 (a black-box audit's split): 41 or 40 a batch."""
    y = torch.arange(937)
    order = FixedOrderBatches(torch.zeros(937, 1), y, None, 64, 1, 0, torch.device("cpu"), batches=23)
    epoch = _epoch(order)
    assert len(order) == 23 and {len(b) for b in epoch} == {40, 41}
    assert sorted(torch.cat(epoch).tolist()) == list(range(937))


def test_more_batches_than_units_leaves_the_extra_batches_empty() -> None:
    order = FixedOrderBatches(torch.zeros(3, 1), torch.arange(3), None, 1, 1, 0, torch.device("cpu"), batches=5)
    assert [len(b) for b in _epoch(order)] == [1, 1, 1, 0, 0]
