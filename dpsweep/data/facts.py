"""What planning needs from a dataset without loading it (no torch): N, one example's shape and the
classes, from each dataset's official description. ``dpsweep-plan`` and the sweeper's preflight use
these; :mod:`dpsweep.data.loaders` loads the files (and is what a run trains on).

    >>> from dpsweep import config, facts
    >>> facts.described(config.DigitsConfig())
    DatasetFacts(n_train=1437, input_shape=(1, 28, 28), num_classes=10)

The digits facts are exact: scikit-learn ships its 1,797 images, and the split sizes are
scikit-learn's ``train_test_split`` rule (a test checks both against :func:`dpsweep.data.loaders.build`).
The torchvision datasets' facts are their official sizes, used before their files are downloaded.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dpsweep.config import DatasetConfig, DigitsConfig, Flowers102Config, PlantedRatingsConfig


@dataclass(frozen=True)
class DatasetFacts:
    """What planning needs from a dataset, without training: N, one example's shape, the classes."""

    n_train: int
    input_shape: tuple[int, int, int]
    num_classes: int


DIGITS_IMAGES = 1_797  # scikit-learn's load_digits: 8x8 images of 10 classes
DIGITS_CLASSES = 10
FLOWERS102_FULL_SIZE = 224  # pixels: the VGG input size that dataset.downscale divides

# Official training-set sizes, for planning before the files are downloaded (dpsweep-plan).
OFFICIAL_N_TRAIN: dict[str, Callable[[Any], int]] = {
    "mnist": lambda cfg: 60_000,
    "cifar10": lambda cfg: 50_000,
    "flowers102": lambda cfg: 1_020 * len(cfg.train_splits),  # train and val hold 1,020 images each
}


def flowers102_image_size(cfg: Flowers102Config) -> int:
    """Pixels Flowers-102 is served at: ``image_size`` if set, else 224 / ``downscale``."""
    return cfg.image_size if cfg.image_size is not None else FLOWERS102_FULL_SIZE // cfg.downscale


def _square(channels: int, default_size: int) -> Callable[[Any], tuple[int, int, int]]:
    return lambda cfg: (channels, cfg.image_size or default_size, cfg.image_size or default_size)


# Official shapes and classes, for planning before the files are downloaded (as OFFICIAL_N_TRAIN).
OFFICIAL_INPUT_SHAPE: dict[str, Callable[[Any], tuple[int, int, int]]] = {
    "mnist": _square(1, 28),
    "cifar10": _square(3, 32),
    "flowers102": lambda cfg: (3, flowers102_image_size(cfg), flowers102_image_size(cfg)),
}
OFFICIAL_NUM_CLASSES: dict[str, int] = {"mnist": 10, "cifar10": 10, "flowers102": 102}


def official_facts(cfg: DatasetConfig) -> DatasetFacts:
    """N, shape and classes from the dataset's official description (KeyError for other datasets)."""
    name = cfg.name
    return DatasetFacts(OFFICIAL_N_TRAIN[name](cfg), OFFICIAL_INPUT_SHAPE[name](cfg), OFFICIAL_NUM_CLASSES[name])


def described(cfg: DatasetConfig) -> DatasetFacts | None:
    """The facts of a dataset that need no files (digits, a planted ratings set), or None: read them from
    the files."""
    if isinstance(cfg, PlantedRatingsConfig):  # N = the training users; one example: a user's row over the items
        return DatasetFacts(cfg.num_users, (1, 1, cfg.items), cfg.items)
    if not isinstance(cfg, DigitsConfig):
        return None
    n_test = math.ceil(cfg.test_fraction * DIGITS_IMAGES)  # train_test_split's rule for a float test_size
    n_train = DIGITS_IMAGES - n_test
    if min(n_test, n_train) < DIGITS_CLASSES:  # not stratifiable: loading raises the error that says so
        return None
    size = cfg.image_size or 8
    return DatasetFacts(n_train, (1, size, size), DIGITS_CLASSES)
