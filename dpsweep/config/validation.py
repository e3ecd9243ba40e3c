"""validate(cfg): every group's checks of the ranges that need no data, in one fixed order.

The order is the order of :data:`CHECKS`, and it decides which key a config with several bad values
is refused for (the first check that fails raises). It is the order these checks have always run
in, so the same bad input names the same key; a group's checks appear more than once where other
groups' checks have always come between them. A new check goes where it leaves that order intact
for every input that passed before.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

from dpsweep.config import audit, dataset, dp, launcher, model, optimizer, sweep, task, tracking, train
from dpsweep.config.checks import ConfigError

if TYPE_CHECKING:
    from dpsweep.config.schema import Config


def check_finite(cfg: Config) -> None:
    """Every number of every input is finite (nan and inf hang or lie)."""
    for key, value in _floats(cfg, ""):
        if not math.isfinite(value):
            raise ConfigError(key, value, "a finite number")


def _floats(node: object, prefix: str) -> Iterator[tuple[str, float]]:
    """Each float of a typed config, by dotted key (a walk of the dataclasses: no OmegaConf, which
    takes about 15 ms a config, and a plan of 10,000 jobs checks each)."""
    if dataclasses.is_dataclass(node):
        for field in dataclasses.fields(node):
            yield from _floats(getattr(node, field.name), f"{prefix}{field.name}.")
    elif isinstance(node, Mapping):
        for key, value in node.items():
            yield from _floats(value, f"{prefix}{key}.")
    elif isinstance(node, list | tuple):
        for i, value in enumerate(node):
            yield from _floats(value, f"{prefix[:-1]}[{i}].")
    elif isinstance(node, float):
        yield prefix[:-1], node


CHECKS: tuple[Callable[[Config], None], ...] = (
    train.check,  # train.*, and launcher.gpu_memory for train.memory_model
    model.check,
    check_finite,  # every group's floats
    optimizer.check,
    dataset.check_split,  # digits' test_fraction
    dataset.check_ratings,  # a ratings set's sizes
    sweep.check,
    tracking.check,
    dataset.check_images,  # image_size, flowers102's downscale and train_splits
    task.check,  # task.*, what the task needs of model.* and dp.*, and the engine and audit it takes
    dataset.check_users,
    dp.check,  # dp.* with DP on: unit, ranges, clipping, secure mode
    launcher.check,  # launcher.trials_per_device, and what auto needs
    audit.check,  # audit.*, and what an audit needs of dp.*
)
# What the run's mechanism and engine need (dpsweep.mechanisms.engines.check) is asked where the run is
# planned (dpsweep.plan.prepare): the config sits below the mechanisms (the import layers of pyproject.toml).


def validate(cfg: Config) -> None:
    """Check the ranges that need no data. Raises :class:`ConfigError` on the first bad value."""
    for check in CHECKS:
        check(cfg)
