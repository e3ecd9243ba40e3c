"""The offline default dataset: scikit-learn's digits with a fixed stratified split."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from fabricate import fabricate_mnist

from dpsweep.config import DigitsConfig, TorchvisionDatasetConfig
from dpsweep.data import loaders
from dpsweep.data.loaders import DatasetNotFoundError
from dpsweep.registry import UnknownNameError


def test_digits_split_is_fixed_stratified_and_28px() -> None:
    splits = loaders.build(DigitsConfig())
    assert (splits.n_train, len(splits.test)) == (1437, 360)  # type: ignore[arg-type]
    assert splits.input_shape == (1, 28, 28) and splits.num_classes == 10
    y_train = splits.train.tensors[1].numpy()  # type: ignore[attr-defined]
    y_test = splits.test.tensors[1].numpy()  # type: ignore[attr-defined]
    train_share = np.bincount(y_train) / len(y_train)
    test_share = np.bincount(y_test) / len(y_test)
    assert np.abs(train_share - test_share).max() < 0.01  # stratified
    again = loaders.build(DigitsConfig())
    assert torch.equal(again.train.tensors[0], splits.train.tensors[0])  # type: ignore[attr-defined]


def test_digits_native_size_and_data_independent_scaling() -> None:
    splits = loaders.build(DigitsConfig(image_size=8))
    x = splits.train.tensors[0]  # type: ignore[attr-defined]
    assert x.shape == (1437, 1, 8, 8)
    assert float(x.min()) == -1.0 and float(x.max()) == 1.0  # 0 -> -1, 16 -> 1: no statistics of the data
    values = set(np.unique(x.numpy()).round(6))
    assert values <= {round((v / 16 - 0.5) / 0.5, 6) for v in range(17)}


def test_split_seed_changes_the_split() -> None:
    a = loaders.build(DigitsConfig(split_seed=0)).test.tensors[1]  # type: ignore[attr-defined]
    b = loaders.build(DigitsConfig(split_seed=1)).test.tensors[1]  # type: ignore[attr-defined]
    assert not torch.equal(a, b)


def test_unknown_dataset_names_the_key_and_the_valid_ones() -> None:
    with pytest.raises(UnknownNameError) as info:
        loaders.build(DigitsConfig(name="imagenet"))
    assert str(info.value) == (
        "dataset.name='imagenet' is invalid: unknown dataset 'imagenet'; "
        "valid: cifar10, digits, flowers102, mnist, movielens, planted_ratings"
    )


@pytest.mark.parametrize(("fraction", "size"), [(0.2, 28), (0.5, None), (0.01, 16)])
def test_digits_facts_need_no_files_and_equal_the_loaded_splits(fraction: float, size: int | None) -> None:
    from dpsweep.data import facts

    cfg = DigitsConfig(test_fraction=fraction, image_size=size)
    splits = loaders.build(cfg)
    assert facts.described(cfg) == facts.DatasetFacts(splits.n_train, splits.input_shape, splits.num_classes)


def test_a_dataset_is_loaded_once_per_process_for_the_same_config_and_files(tmp_path: Path) -> None:
    """The jobs of an inline sweep share the splits; another config, or changed files under
    dataset.root, load them again."""
    first = loaders.build(DigitsConfig())
    assert loaders.build(DigitsConfig()) is first
    other = loaders.build(DigitsConfig(split_seed=1))
    assert other is not first and loaders.build(DigitsConfig()) is not other
    mnist = fabricate_mnist(tmp_path, n_train=6, n_test=4)
    cfg = TorchvisionDatasetConfig(name="mnist", root=str(tmp_path), download=False)
    loaded = loaders.build(cfg)
    assert loaders.build(cfg) is loaded
    (mnist.raw / "t10k-labels-idx1-ubyte").write_bytes((mnist.raw / "t10k-labels-idx1-ubyte").read_bytes()[:-1])
    with pytest.raises(DatasetNotFoundError, match="corrupt"):  # read again: the change is seen
        loaders.build(cfg)
