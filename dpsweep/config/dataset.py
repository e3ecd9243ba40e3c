"""The dataset/ group: which data a run trains on, its users, and the checks of ``dataset.*``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from omegaconf import MISSING

from dpsweep.config import audit
from dpsweep.config.checks import require
from dpsweep.config.dp import PrivacyUnit
from dpsweep.privacy import ranges

if TYPE_CHECKING:
    from dpsweep.config.schema import Config

# Which user each training example belongs to (dataset.users): none (no users: example-level DP
# only), natural (the data carries a user id), partition (dataset.num_users users, a seeded
# Dirichlet(dataset.user_label_skew) label skew). A string, not an enum: str.partition is a method.
USER_ASSIGNMENTS = ("none", "natural", "partition")

NATURAL_USER_DATASETS: tuple[str, ...] = ("planted_ratings", "movielens")  # datasets whose examples carry a user id


@dataclass
class DatasetConfig:
    name: str = MISSING
    # Side length in pixels the images are served at (square); null keeps the dataset's own size.
    image_size: int | None = None
    # Users, for dp.unit=user (dpsweep.data.users): partition splits the training set into num_users
    # non-iid users, each class's examples shared out by proportions ~ Dirichlet(user_label_skew)
    # (Hsu et al. 2019; small: each user holds few classes), seeded by users_seed.
    users: str = "none"  # none | natural | partition (USER_ASSIGNMENTS)
    num_users: int = 100
    user_label_skew: float = 1.0
    users_seed: int = 0


@dataclass
class DigitsConfig(DatasetConfig):
    """scikit-learn's 8x8 handwritten digits (1,797 images, ships offline)."""

    name: str = "digits"
    image_size: int | None = 28  # upsampled from 8x8 so the MNIST CNN applies unchanged
    test_fraction: float = 0.2  # share of the data held out, stratified by class: 1,437 train / 360 test images
    split_seed: int = 0  # fixed split: the same train/test partition in every run (not train.seed)


@dataclass
class TorchvisionDatasetConfig(DatasetConfig):
    """A dataset read by a torchvision loader from ``root``."""

    root: str = "data"
    download: bool = False  # true fetches the files into root (needs internet)


@dataclass
class Flowers102Config(TorchvisionDatasetConfig):
    name: str = "flowers102"
    downscale: int = 1  # F: images are served at 224/F pixels unless image_size is set (2 -> 112, 4 -> 56)
    # Official splits to train on; the official train split holds only 1,020 images, so
    # [train, val] (2,040 images) is common. The N used is logged as the tag dataset.n_train.
    train_splits: list[str] = field(default_factory=lambda: ["train"])


@dataclass
class RatingsConfig(DatasetConfig):
    """Users' ratings of items (task=recommender's data): dataset.num_users training users, each a
    natural user (all their ratings are theirs), and held_out_users more, whose history is folded in and
    whose target ratings score the model. One example is a user's row of ratings over the items."""

    users: str = "natural"
    held_out_users: int = 100  # scored by fold-in, never trained on
    target_fraction: float = 0.2  # of a held-out user's ratings, scored (the rest: their history)
    data_seed: int = 0  # which users are held out and their split (and a synthetic set's draw; not train.seed)


@dataclass
class PlantedRatingsConfig(RatingsConfig):
    """A seeded synthetic planted low-rank ratings set (``dpsweep.data.ratings``; offline)."""

    name: str = "planted_ratings"
    num_users: int = 5400  # training users: N of the user-level guarantee
    held_out_users: int = 600
    items: int = 1000
    rank: int = 8  # of the planted factors (the model's rank is task.rank)
    features: int = 16  # public item features
    mean_ratings: float = 30.0  # median ratings per user
    min_ratings: int = 5
    zipf: float = 0.8  # item popularity exponent
    taste: float = 1.5  # how much a user's taste decides which items they rate


@dataclass
class MovieLensConfig(RatingsConfig):
    """MovieLens ratings read from ``root`` (``dpsweep.data.movielens``: ml-100k, ml-1m, ml-latest, ml-20m,
    ml-25m, ...; users download them). dataset.num_users must be all its users less the held-out ones:
    the training users, N of the user-level guarantee (a run that finds another number says which). The
    movies file (u.item, movies.dat or movies.csv) is required: it makes the item set public, where the
    rated ids would tell whether a user was an item's only rater."""

    name: str = "movielens"
    root: str = "data/movielens"  # a folder holding ratings.csv, ratings.dat or u.data, and the movies file
    num_users: int = 843  # ml-100k's 943 users less the 100 held out


def dataset_schemas() -> dict[str, type[DatasetConfig]]:
    """Dataset name -> its schema: each DatasetConfig subclass that names its dataset (``name``'s
    default), read now, so that a dataset defined after this import is included."""
    out: dict[str, type[DatasetConfig]] = {}
    stack = list(DatasetConfig.__subclasses__())
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        name = cls.__dataclass_fields__["name"].default
        if isinstance(name, str) and name != MISSING:
            out[name] = cls
    return out


def check_ratings(cfg: Config) -> None:
    """A ratings set's sizes and shares."""
    d = cfg.dataset
    if not isinstance(d, RatingsConfig):
        return
    require(d.num_users >= 2, "dataset.num_users", d.num_users, "2 or more training users")
    require(d.held_out_users >= 1, "dataset.held_out_users", d.held_out_users, "1 or more held-out users")
    require(0 < d.target_fraction < 1, "dataset.target_fraction", d.target_fraction, "a share in (0, 1)")
    if not isinstance(d, PlantedRatingsConfig):
        return
    require(d.items >= 2, "dataset.items", d.items, "2 or more items")
    require(d.rank >= 1, "dataset.rank", d.rank, "a planted rank of 1 or more")
    require(d.features >= 1, "dataset.features", d.features, "1 or more item features")
    require(
        2 <= d.min_ratings <= d.items, "dataset.min_ratings", d.min_ratings,
        f"2 to dataset.items={d.items} ratings (a held-out user needs a history and a target)",
    )  # fmt: skip
    require(d.mean_ratings >= d.min_ratings, "dataset.mean_ratings", d.mean_ratings,
            f"at least dataset.min_ratings={d.min_ratings}")  # fmt: skip
    require(d.zipf >= 0, "dataset.zipf", d.zipf, "an exponent >= 0 (0: every item as popular)")


def check_split(cfg: Config) -> None:
    """digits: the held-out share of its fixed train/test split."""
    if isinstance(cfg.dataset, DigitsConfig):
        frac = cfg.dataset.test_fraction
        require(0 < frac < 1, "dataset.test_fraction", frac, "a share of the data in (0, 1)")


def check_images(cfg: Config) -> None:
    """The size images are served at, and flowers102's downscaling and training splits."""
    img = cfg.dataset.image_size
    require(img is None or img > 0, "dataset.image_size", img, "a positive number of pixels or null")
    if isinstance(cfg.dataset, Flowers102Config):
        require(cfg.dataset.downscale > 0, "dataset.downscale", cfg.dataset.downscale, "a positive integer")
        allowed_splits = {"train", "val"}
        bad = [s for s in cfg.dataset.train_splits if s not in allowed_splits]
        splits = list(cfg.dataset.train_splits)
        require(
            bool(splits) and not bad and len(set(splits)) == len(splits),
            "dataset.train_splits",
            list(cfg.dataset.train_splits),
            "a non-empty subset of [train, val] without repeats (test is held out; a repeat would count images twice)",
        )


def check_users(cfg: Config) -> None:
    """dataset.users: an assignment this dataset supports, and a sane partition (dp.unit=user: dpsweep.config.dp)."""
    d = cfg.dataset
    require(d.users in USER_ASSIGNMENTS, "dataset.users", d.users, f"one of {', '.join(USER_ASSIGNMENTS)}")
    require(
        d.users != "natural" or d.name in NATURAL_USER_DATASETS, "dataset.users", d.users,
        f"none or partition: {d.name} carries no user ids (partition splits it into dataset.num_users users)",
    )  # fmt: skip
    if d.users == "partition":
        require(d.num_users >= 2, "dataset.num_users", d.num_users, "2 or more users (at most N)")
        require(
            d.user_label_skew > 0, "dataset.user_label_skew", d.user_label_skew,
            "a positive Dirichlet concentration α (small: users hold few classes; large: iid)",
        )  # fmt: skip


def validate_for_dataset(cfg: Config, n_train: int) -> None:
    """Check the ranges that depend on the training-set size N (and, with dp.unit=user, the users)."""
    d = cfg.dataset
    audit.check_for_dataset(cfg, n_train)
    if d.users == "partition":
        require(d.num_users <= n_train, "dataset.num_users", d.num_users, f"2 to N={n_train} users (one example each)")
    if cfg.dp.enabled and cfg.dp.unit == PrivacyUnit.user:
        n_train = d.num_users  # the population of the guarantee: B users per step, δ < 1/users
    ranges.check_batch_size("train.batch_size", cfg.train.batch_size, n_train)
    if cfg.dp.enabled:
        ranges.check_delta("dp.delta", cfg.dp.delta, n_train, cfg.dp.allow_large_delta, "dp.allow_large_delta=true")
