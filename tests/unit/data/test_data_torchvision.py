"""dpsweep.data.loaders's MNIST, CIFAR-10 and Flowers-102 loaders, run through the real torchvision classes.

Each test fabricates a tiny copy of the dataset in its real on-disk format under ``tmp_path`` (see
``tests/fabricate.py``) and calls :func:`dpsweep.data.loaders.build`, so torchvision's own file checks,
parsers and image decoding all run. torchvision is not mocked: the only monkeypatching replaces the
md5 checksums that torchvision keeps as class attributes (``CIFAR10.train_list``/``test_list``/
``meta`` and ``Flowers102._file_dict``) with the md5s of the fabricated files, so that the real
integrity check passes against them (and still fails when a file is then altered).
"""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest
import torch
from fabricate import (
    CIFAR10_TRAIN_BATCHES,
    FLOWERS_JPEG_SIZE,
    FakeCIFAR10,
    FakeFlowers102,
    FakeMNIST,
    fabricate_cifar10,
    fabricate_flowers102,
    fabricate_mnist,
    flowers_colour,
    patch_cifar10_md5s,
    patch_flowers102_md5s,
    write_idx_images,
)

from dpsweep.config import Flowers102Config, TorchvisionDatasetConfig
from dpsweep.data.loaders import (
    CIFAR10_MEAN_STD,
    IMAGENET_MEAN_STD,
    MNIST_MEAN_STD,
    DatasetNotFoundError,
    DataSplits,
    build,
)


def _all_labels(dataset: torch.utils.data.Dataset[tuple[torch.Tensor, int]]) -> list[int]:
    return [int(dataset[i][1]) for i in range(len(dataset))]  # type: ignore[arg-type]


def _assert_not_found(cfg: TorchvisionDatasetConfig, expected_dir: Path, word: str) -> None:
    with pytest.raises(DatasetNotFoundError) as info:
        build(cfg)
    message = str(info.value)
    assert str(expected_dir) in message
    assert "download" in message
    assert word in message


# ---------------------------------------------------------------------------------------------
# MNIST
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def mnist(tmp_path: Path) -> FakeMNIST:
    return fabricate_mnist(tmp_path, n_train=6, n_test=4)


def _mnist_cfg(root: Path, image_size: int | None = None) -> TorchvisionDatasetConfig:
    return TorchvisionDatasetConfig(name="mnist", root=str(root), download=False, image_size=image_size)


def test_mnist_split_sizes_shapes_and_labels(mnist: FakeMNIST, tmp_path: Path) -> None:
    splits = build(_mnist_cfg(tmp_path))

    assert isinstance(splits, DataSplits)
    assert splits.n_train == 6
    assert len(splits.test) == 4  # type: ignore[arg-type]
    assert splits.num_classes == 10
    assert splits.input_shape == (1, 28, 28)
    x, y = splits.test[3]
    assert tuple(x.shape) == splits.input_shape
    assert x.dtype == torch.float32
    assert isinstance(y, int)
    assert _all_labels(splits.train) == mnist.train_labels.tolist()
    assert _all_labels(splits.test) == mnist.test_labels.tolist()


def test_mnist_pixels_round_trip_normalised(mnist: FakeMNIST, tmp_path: Path) -> None:
    splits = build(_mnist_cfg(tmp_path))
    (mean,), (std,) = MNIST_MEAN_STD

    for split, images in ((splits.train, mnist.train_images), (splits.test, mnist.test_images)):
        for i in (0, len(images) - 1):
            x, _ = split[i]
            expected = (torch.from_numpy(images[i]).float() / 255 - mean) / std
            torch.testing.assert_close(x[0], expected, rtol=0, atol=1e-5)

    # One pixel spelled out: train image 2, row 5, column 11 holds (7*2 + 3*5 + 5*11) % 256 = 84.
    assert mnist.train_images[2, 5, 11] == 84
    assert splits.train[2][0][0, 5, 11].item() == pytest.approx((84 / 255 - mean) / std, abs=1e-5)


def test_mnist_image_size_resizes(mnist: FakeMNIST, tmp_path: Path) -> None:
    # Make one training image constant: any resampling must leave every pixel at that value.
    mnist.train_images[1] = 200
    write_idx_images(mnist.raw / "train-images-idx3-ubyte", mnist.train_images)

    splits = build(_mnist_cfg(tmp_path, image_size=32))

    assert splits.input_shape == (1, 32, 32)
    assert tuple(splits.test[0][0].shape) == (1, 32, 32)
    (mean,), (std,) = MNIST_MEAN_STD
    x, y = splits.train[1]
    torch.testing.assert_close(x, torch.full((1, 32, 32), (200 / 255 - mean) / std), rtol=0, atol=1e-5)
    assert y == int(mnist.train_labels[1])
    assert splits.n_train == 6


def test_mnist_missing_raises_with_where_and_how(tmp_path: Path) -> None:
    _assert_not_found(_mnist_cfg(tmp_path), tmp_path / "MNIST" / "raw", "none found under")


def test_mnist_missing_file_in_existing_dir_raises(mnist: FakeMNIST, tmp_path: Path) -> None:
    (mnist.raw / "t10k-labels-idx1-ubyte").unlink()
    _assert_not_found(_mnist_cfg(tmp_path), mnist.raw, "missing or corrupt")


def test_mnist_truncated_file_raises_corrupt(mnist: FakeMNIST, tmp_path: Path) -> None:
    path = mnist.raw / "train-images-idx3-ubyte"
    path.write_bytes(path.read_bytes()[:-100])  # header still says 6 images of 28x28
    _assert_not_found(_mnist_cfg(tmp_path), mnist.raw, "corrupt")


# ---------------------------------------------------------------------------------------------
# CIFAR-10
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def cifar10(tmp_path: Path) -> FakeCIFAR10:
    return fabricate_cifar10(tmp_path, batch_sizes=(2, 1, 3, 1, 2), n_test=3)


def _cifar_cfg(root: Path, image_size: int | None = None) -> TorchvisionDatasetConfig:
    return TorchvisionDatasetConfig(name="cifar10", root=str(root), download=False, image_size=image_size)


def _cifar_expected(row: np.ndarray) -> torch.Tensor:
    """A CIFAR row (R plane, G plane, B plane; each 32x32 row-major) as the normalised CHW tensor."""
    mean, std = (torch.tensor(v).view(3, 1, 1) for v in CIFAR10_MEAN_STD)
    return (torch.from_numpy(row.reshape(3, 32, 32).astype(np.float32)) / 255 - mean) / std


def test_cifar10_split_sizes_shapes_labels_and_pixels(
    cifar10: FakeCIFAR10, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    patch_cifar10_md5s(monkeypatch, cifar10.md5s)
    splits = build(_cifar_cfg(tmp_path))

    assert splits.n_train == 2 + 1 + 3 + 1 + 2
    assert len(splits.test) == 3  # type: ignore[arg-type]
    assert splits.num_classes == 10
    assert splits.input_shape == (3, 32, 32)
    assert tuple(splits.test[2][0].shape) == (3, 32, 32)
    # The five batches are concatenated in order: index 5 is the last image of data_batch_3.
    assert _all_labels(splits.train) == cifar10.train_labels
    assert _all_labels(splits.test) == cifar10.test_labels
    for split, data in ((splits.train, cifar10.train_data), (splits.test, cifar10.test_data)):
        for i in (0, len(data) - 1):
            torch.testing.assert_close(split[i][0], _cifar_expected(data[i]), rtol=0, atol=1e-5)
    x5, y5 = splits.train[5]
    assert y5 == cifar10.train_labels[5] == 7
    torch.testing.assert_close(x5, _cifar_expected(cifar10.train_data[5]), rtol=0, atol=1e-5)


def test_cifar10_image_size_resizes(cifar10: FakeCIFAR10, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    patch_cifar10_md5s(monkeypatch, cifar10.md5s)
    splits = build(_cifar_cfg(tmp_path, image_size=16))
    assert splits.input_shape == (3, 16, 16)
    assert tuple(splits.test[0][0].shape) == (3, 16, 16)
    assert splits.n_train == 9


def test_cifar10_missing_raises_with_where_and_how(tmp_path: Path) -> None:
    _assert_not_found(_cifar_cfg(tmp_path), tmp_path / "cifar-10-batches-py", "none found under")


def test_cifar10_unpatched_md5_mismatch_raises_corrupt(cifar10: FakeCIFAR10, tmp_path: Path) -> None:
    # No monkeypatch: torchvision compares the fabricated files with the real CIFAR-10 md5s.
    _assert_not_found(_cifar_cfg(tmp_path), cifar10.folder, "corrupt")


@pytest.mark.parametrize("name", [*CIFAR10_TRAIN_BATCHES[2:3], "test_batch", "batches.meta"])
def test_cifar10_one_corrupt_file_raises_corrupt(
    cifar10: FakeCIFAR10, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    patch_cifar10_md5s(monkeypatch, cifar10.md5s)
    build(_cifar_cfg(tmp_path))  # intact: loads
    with (cifar10.folder / name).open("ab") as f:
        f.write(b"\0")  # one byte appended: the md5 no longer matches
    _assert_not_found(_cifar_cfg(tmp_path), cifar10.folder, "corrupt")


def test_cifar10_missing_batch_raises(cifar10: FakeCIFAR10, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    patch_cifar10_md5s(monkeypatch, cifar10.md5s)
    (cifar10.folder / "data_batch_5").unlink()
    _assert_not_found(_cifar_cfg(tmp_path), cifar10.folder, "missing or corrupt")


# ---------------------------------------------------------------------------------------------
# Flowers-102
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def flowers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeFlowers102:
    fake = fabricate_flowers102(tmp_path)
    patch_flowers102_md5s(monkeypatch, fake.md5s)
    return fake


def _flowers_cfg(root: Path, **kwargs: object) -> Flowers102Config:
    return Flowers102Config(root=str(root), download=False, **kwargs)  # type: ignore[arg-type]


def _flowers_expected(image_id: int, size: int) -> torch.Tensor:
    """The normalised tensor of a fabricated (solid-colour) image: constant per channel."""
    colour = torch.tensor(flowers_colour(image_id), dtype=torch.float32).view(3, 1, 1) / 255
    mean, std = (torch.tensor(v).view(3, 1, 1) for v in IMAGENET_MEAN_STD)
    return ((colour - mean) / std).expand(3, size, size)


def _assert_flowers_split(
    split: torch.utils.data.Dataset[tuple[torch.Tensor, int]], ids: list[int], fake: FakeFlowers102, size: int
) -> None:
    assert len(split) == len(ids)  # type: ignore[arg-type]
    for i, image_id in enumerate(ids):
        x, y = split[i]
        assert y == fake.labels[image_id - 1] - 1  # 1-based in imagelabels.mat, 0-based here
        assert tuple(x.shape) == (3, size, size)
        # JPEG is lossy: a solid colour comes back within a couple of grey levels (/255, /std).
        torch.testing.assert_close(x, _flowers_expected(image_id, size), rtol=0, atol=0.05)


@pytest.mark.parametrize(("downscale", "size"), [(1, 224), (4, 56), (7, 32)])
def test_flowers102_train_split_and_downscale(
    flowers: FakeFlowers102, tmp_path: Path, downscale: int, size: int
) -> None:
    splits = build(_flowers_cfg(tmp_path, downscale=downscale))

    assert splits.n_train == len(flowers.trnid) == 3
    assert len(splits.test) == len(flowers.tstid) == 6  # type: ignore[arg-type]
    assert splits.num_classes == 102
    assert splits.input_shape == (3, size, size)
    _assert_flowers_split(splits.train, flowers.trnid, flowers, size)
    _assert_flowers_split(splits.test, flowers.tstid, flowers, size)


def test_flowers102_labels_are_zero_based(flowers: FakeFlowers102, tmp_path: Path) -> None:
    splits = build(_flowers_cfg(tmp_path, downscale=8))
    # trnid = (3, 1, 4): labels 102, 1, 2 in imagelabels.mat.
    assert _all_labels(splits.train) == [101, 0, 1]
    assert set(_all_labels(splits.test)) == {0, 1, 101}
    assert all(0 <= y < splits.num_classes for y in _all_labels(splits.test))


def test_flowers102_image_size_overrides_downscale(flowers: FakeFlowers102, tmp_path: Path) -> None:
    assert FLOWERS_JPEG_SIZE[0] != FLOWERS_JPEG_SIZE[1]  # non-square source: the crop must square it
    splits = build(_flowers_cfg(tmp_path, downscale=4, image_size=20))
    assert splits.input_shape == (3, 20, 20)
    _assert_flowers_split(splits.test, flowers.tstid, flowers, 20)


def test_flowers102_train_and_val(flowers: FakeFlowers102, tmp_path: Path) -> None:
    splits = build(_flowers_cfg(tmp_path, downscale=8, train_splits=["train", "val"]))

    assert splits.n_train == len(flowers.trnid) + len(flowers.valid) == 5
    assert len(splits.test) == len(flowers.tstid)  # type: ignore[arg-type]
    assert splits.input_shape == (3, 28, 28)
    # train first, then val, in the order setid.mat lists them
    _assert_flowers_split(splits.train, flowers.trnid + flowers.valid, flowers, 28)


def test_flowers102_missing_raises_with_where_and_how(tmp_path: Path) -> None:
    _assert_not_found(_flowers_cfg(tmp_path), tmp_path / "flowers-102", "none found under")


def test_flowers102_unpatched_md5_mismatch_raises_corrupt(tmp_path: Path) -> None:
    fake = fabricate_flowers102(tmp_path)  # no monkeypatch: compared with the real .mat md5s
    _assert_not_found(_flowers_cfg(tmp_path), fake.folder, "corrupt")


def test_flowers102_corrupt_setid_raises_corrupt(flowers: FakeFlowers102, tmp_path: Path) -> None:
    with (flowers.folder / "setid.mat").open("ab") as f:
        f.write(b"\0")
    _assert_not_found(_flowers_cfg(tmp_path), flowers.folder, "corrupt")


def test_flowers102_missing_jpg_dir_raises(flowers: FakeFlowers102, tmp_path: Path) -> None:
    for jpg in (flowers.folder / "jpg").iterdir():
        jpg.unlink()
    (flowers.folder / "jpg").rmdir()
    _assert_not_found(_flowers_cfg(tmp_path), flowers.folder, "missing or corrupt")


# ---------------------------------------------------------------------------------------------
# Malformed files and missing images are reported when the dataset is built, not mid-training
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("content", ["gzip", "html"])
def test_mnist_file_in_wrong_format_raises_corrupt(mnist: FakeMNIST, tmp_path: Path, content: str) -> None:
    path = mnist.raw / "train-images-idx3-ubyte"
    if content == "gzip":  # the distributed .gz copied under the uncompressed name
        path.write_bytes(gzip.compress(path.read_bytes()))
    else:  # an error page saved by a failed manual download
        path.write_bytes(b"<html><body>403 Forbidden</body></html>")
    _assert_not_found(_mnist_cfg(tmp_path), mnist.raw, "corrupt")


def test_flowers102_missing_jpeg_raises_at_build(flowers: FakeFlowers102, tmp_path: Path) -> None:
    (flowers.folder / "jpg" / f"image_{flowers.tstid[-1]:05d}.jpg").unlink()  # last test image
    _assert_not_found(_flowers_cfg(tmp_path), flowers.folder, "missing")
