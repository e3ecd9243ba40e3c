"""Datasets: a registry of loaders that return train and test splits as torch Datasets.

``digits`` (scikit-learn, offline) is the default; ``mnist``, ``cifar10`` and ``flowers102`` use the
real torchvision loaders, reading from ``dataset.root`` and downloading only with ``download=true``.

    python -c "from dpsweep import config, data; print(data.build(config.DigitsConfig()))"
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import ConcatDataset, Dataset, TensorDataset

from dpsweep.config import (
    DatasetConfig,
    DigitsConfig,
    Flowers102Config,
    MovieLensConfig,
    PlantedRatingsConfig,
    RatingsConfig,
    TorchvisionDatasetConfig,
)
from dpsweep.data.facts import flowers102_image_size
from dpsweep.data.movielens import MovieLensNotFound, read_movielens
from dpsweep.data.ratings import HeldOut, PlantedSpec, Ratings, planted_ratings, split_users
from dpsweep.errors import InputError
from dpsweep.interop import torchvision_private
from dpsweep.registry import Registry

if TYPE_CHECKING:  # torchvision is imported by the loaders that use it: digits runs never load it
    from torchvision import transforms as T

# Per-channel normalisation constants (the ones the datasets' reference code uses).
MNIST_MEAN_STD = ((0.1307,), (0.3081,))
CIFAR10_MEAN_STD = ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
IMAGENET_MEAN_STD = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
DIGITS_MEAN_STD = (0.5, 0.5)  # data-independent: pixel values 0..16 -> [0, 1] -> [-1, 1]
# The single-channel datasets' normalisation, by name: what a generator's output range must match.
SINGLE_CHANNEL_MEAN_STD = {"digits": DIGITS_MEAN_STD, "mnist": (MNIST_MEAN_STD[0][0], MNIST_MEAN_STD[1][0])}


def value_range(name: str) -> tuple[float, float]:
    """The range of a normalised pixel of single-channel dataset ``name``: (0 - mean)/std to (1 - mean)/std."""
    mean, std = SINGLE_CHANNEL_MEAN_STD[name]
    return (0.0 - mean) / std, (1.0 - mean) / std


class DatasetNotFoundError(InputError, FileNotFoundError):
    """Dataset files are missing (or corrupt) and ``download`` is off: ``dataset.root`` is bad input."""


@dataclass(frozen=True)
class DataSplits:
    train: Dataset[Any]
    test: Dataset[Any]
    num_classes: int
    input_shape: tuple[int, int, int]  # (channels, height, width) of one example

    @property
    def n_train(self) -> int:
        """N, the training-set size: the population that the privacy guarantee is about."""
        return len(self.train)  # type: ignore[arg-type]


DatasetLoader = Callable[[Any], DataSplits]
DATASETS: Registry[DatasetLoader] = Registry("dataset")


def build(cfg: DatasetConfig) -> DataSplits:
    """Load the dataset that ``cfg.name`` names. The last one loaded is kept for the next run of
    this process with the same dataset config and the same files under ``dataset.root`` (the jobs
    of an inline sweep): nothing trains in place on the splits, so they are shared as they are."""
    key = repr(cfg) + _files_fingerprint(getattr(cfg, "root", None))  # a dataclass's repr: its type and fields
    if _LAST.get("key") != key:
        _LAST.clear()
        _LAST.update(key=key, splits=DATASETS.get(cfg.name, key="dataset.name")(cfg))
    splits: DataSplits = _LAST["splits"]
    return splits


_LAST: dict[str, Any] = {}  # the last dataset built: its key and its splits


def _files_fingerprint(root: str | None) -> str:
    """A digest of the path, size and modification time of every file under ``root`` (a fixed text
    where there is no such directory): a dataset whose files changed, appeared or went is loaded again."""
    if root is None or not Path(root).is_dir():
        return f"|{root}: none"
    found = []
    for path in sorted(Path(root).rglob("*")):
        if path.is_file():
            stat = path.stat()
            found.append(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}")
    return "|" + hashlib.sha256(";".join(found).encode()).hexdigest()


def _splits(train: Dataset[Any], test: Dataset[Any], num_classes: int) -> DataSplits:
    x0 = train[0][0]
    return DataSplits(train, test, num_classes, tuple(x0.shape))


# ---------------------------------------------------------------------------------------------
# digits: scikit-learn, offline
# ---------------------------------------------------------------------------------------------
@DATASETS.register("digits")
def load_digits_splits(cfg: DigitsConfig) -> DataSplits:
    """Digits as float tensors (N, 1, S, S), S = image_size, scaled to [-1, 1]."""
    bunch = load_digits()
    x = bunch.images.astype(np.float32) / 16.0  # pixel values 0..16 -> [0, 1]
    y = bunch.target.astype(np.int64)
    try:
        x_tr, x_te, y_tr, y_te = train_test_split(
            x, y, test_size=cfg.test_fraction, stratify=y, random_state=cfg.split_seed
        )
    except ValueError as err:  # a split too small to hold every class once (stratified)
        classes, n = len(np.unique(y)), len(y)
        raise InputError(
            "dataset.test_fraction", cfg.test_fraction,
            f"a share leaving each of the {classes} classes in both splits: between {classes / n:.3g} and "
            f"{1 - classes / n:.3g} of the {n} images ({err})",
        ) from err  # fmt: skip
    size = cfg.image_size or 8

    def tensor(a: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(a).unsqueeze(1)
        if size != t.shape[-1]:
            t = F.interpolate(t, size=(size, size), mode="bilinear", align_corners=False)
        return t

    # Fixed, data-independent scaling to [-1, 1]: statistics of the private training split would
    # leak into every released model outside the DP guarantee.
    mean, std = DIGITS_MEAN_STD
    train = TensorDataset((tensor(x_tr) - mean) / std, torch.from_numpy(y_tr))
    test = TensorDataset((tensor(x_te) - mean) / std, torch.from_numpy(y_te))
    return _splits(train, test, num_classes=10)


# ---------------------------------------------------------------------------------------------
# ratings: users' rows over the items (task=recommender)
# ---------------------------------------------------------------------------------------------
class RatingsUsers(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """The users of a ratings set, one example each: a user's row, (items, stars)
    (``dpsweep.data.ratings``). ``ratings`` holds them all; ``held_out`` the held-out users' history and
    target (the test split), or None (the training split)."""

    def __init__(self, ratings: Ratings, held_out: HeldOut | None = None) -> None:
        self.ratings, self.held_out = ratings, held_out

    def __len__(self) -> int:
        return self.ratings.n_users

    def __getitem__(self, user: int) -> tuple[torch.Tensor, torch.Tensor]:
        items, values = self.ratings.row(user)
        return torch.from_numpy(items), torch.from_numpy(values)


@DATASETS.register("planted_ratings")
def load_planted_ratings(cfg: PlantedRatingsConfig) -> DataSplits:
    """The planted set of num_users + held_out_users users, split into the training users and the
    held-out ones (their history and target), all seeded by dataset.data_seed."""
    spec = PlantedSpec(
        users=cfg.num_users + cfg.held_out_users, items=cfg.items, rank=cfg.rank, features=cfg.features,
        mean_ratings=cfg.mean_ratings, min_ratings=cfg.min_ratings, zipf=cfg.zipf, taste=cfg.taste,
    )  # fmt: skip
    return _ratings_splits(planted_ratings(spec, cfg.data_seed), cfg)


@DATASETS.register("movielens")
def load_movielens(cfg: MovieLensConfig) -> DataSplits:
    """MovieLens from dataset.root (``dpsweep.data.movielens``), split into the training users and
    dataset.held_out_users held-out ones, seeded by dataset.data_seed; dataset.num_users must be the
    training users (N of the guarantee)."""
    root = Path(cfg.root)
    try:
        data, path = read_movielens(root)
    except MovieLensNotFound as err:
        raise DatasetNotFoundError(err.key, err.value, err.allowed) from err
    eligible = int((data.counts >= 2).sum())  # a held-out user needs a history and a target
    if cfg.held_out_users > eligible:
        raise InputError(
            "dataset.held_out_users",
            cfg.held_out_users,
            f"at most {eligible}: the users of {path} with 2 or more ratings",
        )
    n_train = data.n_users - cfg.held_out_users
    if cfg.num_users != n_train:
        raise InputError(
            "dataset.num_users", cfg.num_users,
            f"{n_train}: the training users of {path} ({data.n_users} users less dataset.held_out_users="
            f"{cfg.held_out_users}), N of the user-level guarantee",
        )  # fmt: skip
    return _ratings_splits(data, cfg)


def _ratings_splits(data: Ratings, cfg: RatingsConfig) -> DataSplits:
    """The training users and the dataset.held_out_users held-out ones (their history the test split's
    rows), seeded by dataset.data_seed; one example is a user's row over the items."""
    train, held = split_users(data, cfg.held_out_users, cfg.target_fraction, cfg.data_seed)
    return DataSplits(RatingsUsers(train), RatingsUsers(held.history, held), data.n_items, (1, 1, data.n_items))


# ---------------------------------------------------------------------------------------------
# torchvision datasets
# ---------------------------------------------------------------------------------------------
def _transform(image_size: int | None, mean_std: tuple[tuple[float, ...], tuple[float, ...]]) -> T.Compose:
    from torchvision import transforms as T

    steps: list[Any] = []
    if image_size is not None:
        steps += [T.Resize(image_size), T.CenterCrop(image_size)]
    steps += [T.ToTensor(), T.Normalize(*mean_std)]
    return T.Compose(steps)


def _open(
    name: str,
    cfg: TorchvisionDatasetConfig,
    expected: Path,
    how: str,
    factory: Callable[[], DataSplits],
) -> DataSplits:
    """Run a torchvision loader; turn its 'not found' into an error that says where and how."""
    if not cfg.download and not expected.exists():
        raise DatasetNotFoundError(
            "dataset.root", cfg.root,
            f"a directory holding the {name} files; none found under {expected}. "
            f"Set dataset.download=true to download them (needs internet), or {how}.",
        )  # fmt: skip
    try:
        return factory()
    # torchvision says "Dataset not found or corrupted." (RuntimeError); malformed files surface as
    # assertion, parsing or unpickling errors.
    except (
        RuntimeError,
        AssertionError,
        ValueError,
        TypeError,
        OSError,
        EOFError,
        pickle.UnpicklingError,
    ) as err:
        if cfg.download:
            raise
        raise DatasetNotFoundError(
            "dataset.root", cfg.root,
            f"a directory holding intact {name} files; those under {expected} are missing or corrupt "
            f"({err}). Set dataset.download=true to download them again, or {how}.",
        ) from err  # fmt: skip


def _train_test(
    dataset_class: Callable[..., Dataset[Any]], cfg: TorchvisionDatasetConfig, tf: T.Compose, num_classes: int
) -> Callable[[], DataSplits]:
    """A loader for torchvision datasets with a ``train=True/False`` switch (MNIST, CIFAR-10)."""

    def make() -> DataSplits:
        train = dataset_class(cfg.root, train=True, transform=tf, download=cfg.download)
        test = dataset_class(cfg.root, train=False, transform=tf, download=cfg.download)
        return _splits(train, test, num_classes)

    return make


@DATASETS.register("mnist")
def load_mnist(cfg: TorchvisionDatasetConfig) -> DataSplits:
    from torchvision import datasets as tvd

    root = Path(cfg.root)
    make = _train_test(tvd.MNIST, cfg, _transform(cfg.image_size, MNIST_MEAN_STD), num_classes=10)
    how = (
        "copy train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte and t10k-labels-idx1-ubyte there"
    )
    return _open("MNIST", cfg, root / "MNIST" / "raw", how, make)


@DATASETS.register("cifar10")
def load_cifar10(cfg: TorchvisionDatasetConfig) -> DataSplits:
    from torchvision import datasets as tvd

    root = Path(cfg.root)
    make = _train_test(tvd.CIFAR10, cfg, _transform(cfg.image_size, CIFAR10_MEAN_STD), num_classes=10)
    how = "unpack cifar-10-python.tar.gz into dataset.root"
    return _open("CIFAR-10", cfg, root / "cifar-10-batches-py", how, make)


@DATASETS.register("flowers102")
def load_flowers102(cfg: Flowers102Config) -> DataSplits:
    from torchvision import datasets as tvd

    root = Path(cfg.root)
    tf = _transform(flowers102_image_size(cfg), IMAGENET_MEAN_STD)

    def make() -> DataSplits:
        parts = [tvd.Flowers102(str(root), split=s, transform=tf, download=cfg.download) for s in cfg.train_splits]
        train: Dataset[Any] = parts[0] if len(parts) == 1 else ConcatDataset(parts)
        test = tvd.Flowers102(str(root), split="test", transform=tf, download=cfg.download)
        # torchvision opens each JPEG only when it is read: check them all now, not mid-training.
        missing = [f for ds in [*parts, test] for f in torchvision_private.image_files(ds) if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{len(missing)} images listed in setid.mat are missing, e.g. {missing[0]}")
        return _splits(train, test, num_classes=102)

    how = "copy jpg/, imagelabels.mat and setid.mat from the Oxford VGG site there"
    return _open("Flowers-102", cfg, root / "flowers-102", how, make)
