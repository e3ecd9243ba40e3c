"""validate(cfg): every group's checks of the ranges that need no data, in one fixed order.

The order is the order of :data:`CHECKS`, and it decides which key a config with several bad values
is refused for (the first check that fails raises). It is the order these checks have always run
in, so the same bad input names the same key; a group's checks appear more than once where other
groups' checks have always come between them. A new check goes where it leaves that order intact
for every input that passed before.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from dpsweep.config import dataset, dp, model, optimizer, sweep, task, tracking, train
from dpsweep.config.checks import ConfigError
from dpsweep.config.schema import flatten

if TYPE_CHECKING:
    from dpsweep.config.schema import Config


def check_finite(cfg: Config) -> None:
    """Every number of every input is finite (nan and inf hang or lie)."""
    for key, value in flatten(cfg).items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(key, value, "a finite number")


CHECKS: tuple[Callable[[Config], None], ...] = (
    train.check,  # train.*, and launcher.gpu_memory for train.memory_model
    model.check,
    check_finite,  # every group's floats
    optimizer.check,
    dataset.check_split,  # digits' test_fraction
    sweep.check,
    tracking.check,
    dataset.check_images,  # image_size, flowers102's downscale and train_splits
    task.check,  # task.*, and what the task needs of model.* and dp.*
    dataset.check_users,
    dp.check,  # dp.* with DP on: unit, mechanism, ranges, clipping, secure mode
)


def validate(cfg: Config) -> None:
    """Check the ranges that need no data. Raises :class:`ConfigError` on the first bad value."""
    for check in CHECKS:
        check(cfg)
