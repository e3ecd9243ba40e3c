"""Fabricate tiny MNIST, CIFAR-10 and Flowers-102 copies in each dataset's real on-disk format.

The files are read by the real torchvision loaders, so tests exercise the same code paths as the
real datasets, offline and in milliseconds:

* MNIST: ``root/MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte``, big-endian IDX files.
* CIFAR-10: ``root/cifar-10-batches-py/{data_batch_1..5,test_batch,batches.meta}``, pickled dicts.
* Flowers-102: ``root/flowers-102/{jpg/image_NNNNN.jpg,imagelabels.mat,setid.mat}``.

CIFAR-10 and Flowers-102 are checked by torchvision against the md5s of the real files; the writers
return the md5s of the fabricated files so that a test can monkeypatch torchvision's md5 class
attributes (and nothing else) with :func:`patch_cifar10_md5s` / :func:`patch_flowers102_md5s`.
"""

from __future__ import annotations

import hashlib
import pickle
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
import scipy.io
from PIL import Image
from torchvision import datasets as tvd

U8 = npt.NDArray[np.uint8]

CIFAR10_TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR10_LABEL_NAMES = (
    "airplane",
    "automobile",
    "bird",
    "cat",
    "deer",
    "dog",
    "frog",
    "horse",
    "ship",
    "truck",
)


def md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


# ---------------------------------------------------------------------------------------------
# MNIST
# ---------------------------------------------------------------------------------------------
IDX_IMAGES_MAGIC = 2051  # 0x00000803: unsigned byte, 3 dimensions
IDX_LABELS_MAGIC = 2049  # 0x00000801: unsigned byte, 1 dimension


def write_idx_images(path: Path, images: U8) -> None:
    """IDX3 file: magic 2051, then N, rows, cols as big-endian uint32, then the pixels row-major."""
    n, rows, cols = images.shape
    path.write_bytes(struct.pack(">IIII", IDX_IMAGES_MAGIC, n, rows, cols) + images.astype(np.uint8).tobytes())


def write_idx_labels(path: Path, labels: U8) -> None:
    """IDX1 file: magic 2049, then N as big-endian uint32, then one byte per label."""
    path.write_bytes(struct.pack(">II", IDX_LABELS_MAGIC, len(labels)) + labels.astype(np.uint8).tobytes())


@dataclass(frozen=True)
class FakeMNIST:
    raw: Path  # root/MNIST/raw
    train_images: U8  # (N, 28, 28)
    train_labels: U8  # (N,)
    test_images: U8
    test_labels: U8


def mnist_images(n: int, offset: int = 0) -> U8:
    """A known, position-dependent pattern: pixel (i, r, c) = (7(i+offset) + 3r + 5c) mod 256."""
    i, r, c = np.meshgrid(np.arange(n) + offset, np.arange(28), np.arange(28), indexing="ij")
    return ((7 * i + 3 * r + 5 * c) % 256).astype(np.uint8)


def fabricate_mnist(root: Path, n_train: int = 6, n_test: int = 4) -> FakeMNIST:
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    train_images, test_images = mnist_images(n_train), mnist_images(n_test, offset=1000)
    train_labels = (np.arange(n_train) * 3 % 10).astype(np.uint8)
    test_labels = ((np.arange(n_test) * 7 + 1) % 10).astype(np.uint8)
    write_idx_images(raw / "train-images-idx3-ubyte", train_images)
    write_idx_labels(raw / "train-labels-idx1-ubyte", train_labels)
    write_idx_images(raw / "t10k-images-idx3-ubyte", test_images)
    write_idx_labels(raw / "t10k-labels-idx1-ubyte", test_labels)
    return FakeMNIST(raw, train_images, train_labels, test_images, test_labels)


# ---------------------------------------------------------------------------------------------
# CIFAR-10
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FakeCIFAR10:
    folder: Path  # root/cifar-10-batches-py
    train_data: U8  # (N, 3072): the five training batches concatenated in order
    train_labels: list[int]
    test_data: U8
    test_labels: list[int]
    md5s: dict[str, str]  # file name -> md5 of the fabricated file


def _cifar_batch(path: Path, name: str, data: U8, labels: list[int]) -> None:
    entry = {
        "batch_label": name,
        "labels": labels,
        "data": data,
        "filenames": [f"img_{i:05d}.png" for i in range(len(labels))],
    }
    with path.open("wb") as f:
        pickle.dump(entry, f, protocol=2)


def fabricate_cifar10(root: Path, batch_sizes: tuple[int, ...] = (2, 1, 3, 1, 2), n_test: int = 3) -> FakeCIFAR10:
    """Five training batches of ``batch_sizes`` images and a test batch of ``n_test`` random images."""
    assert len(batch_sizes) == len(CIFAR10_TRAIN_BATCHES)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    n_train = sum(batch_sizes)
    train_data = rng.integers(0, 256, size=(n_train, 3072), dtype=np.uint8)
    train_labels = [(3 * i + 2) % 10 for i in range(n_train)]
    test_data = rng.integers(0, 256, size=(n_test, 3072), dtype=np.uint8)
    test_labels = [(5 * i + 1) % 10 for i in range(n_test)]

    start = 0
    for name, size in zip(CIFAR10_TRAIN_BATCHES, batch_sizes, strict=True):
        part = slice(start, start + size)
        _cifar_batch(folder / name, name, train_data[part], train_labels[part])
        start += size
    _cifar_batch(folder / "test_batch", "testing batch 1 of 1", test_data, test_labels)
    with (folder / "batches.meta").open("wb") as f:
        meta = {
            "label_names": list(CIFAR10_LABEL_NAMES),
            "num_cases_per_batch": max(batch_sizes),
            "num_vis": 3072,
        }
        pickle.dump(meta, f, protocol=2)

    md5s = {p.name: md5(p) for p in folder.iterdir()}
    return FakeCIFAR10(folder, train_data, train_labels, test_data, test_labels, md5s)


def patch_cifar10_md5s(monkeypatch: pytest.MonkeyPatch, md5s: dict[str, str]) -> None:
    """Point torchvision's CIFAR10 integrity check at the fabricated files' md5s.

    Only the md5 class attributes are replaced; the real check (``check_integrity``) still runs.
    """
    monkeypatch.setattr(tvd.CIFAR10, "train_list", [[n, md5s[n]] for n in CIFAR10_TRAIN_BATCHES])
    monkeypatch.setattr(tvd.CIFAR10, "test_list", [["test_batch", md5s["test_batch"]]])
    monkeypatch.setattr(tvd.CIFAR10, "meta", {**tvd.CIFAR10.meta, "md5": md5s["batches.meta"]})


# ---------------------------------------------------------------------------------------------
# Flowers-102
# ---------------------------------------------------------------------------------------------
FLOWERS_JPEG_SIZE = (40, 30)  # (width, height): small and non-square, like the real (landscape) photos


def flowers_colour(image_id: int) -> tuple[int, int, int]:
    """The solid RGB colour of fabricated image ``image_id`` (1-based), distinct per image."""
    return (20 * image_id % 256, 255 - 20 * image_id % 256, 40 + 10 * image_id % 200)


@dataclass(frozen=True)
class FakeFlowers102:
    folder: Path  # root/flowers-102
    labels: list[int]  # 1-based, as in imagelabels.mat; labels[k - 1] is image k's label
    trnid: list[int]  # 1-based image ids
    valid: list[int]
    tstid: list[int]
    md5s: dict[str, str]  # imagelabels.mat and setid.mat -> md5


def fabricate_flowers102(
    root: Path,
    labels: tuple[int, ...] = (1, 2, 102, 2, 1, 102, 1, 2, 2, 1, 102),
    trnid: tuple[int, ...] = (3, 1, 4),
    valid: tuple[int, ...] = (2, 5),
    tstid: tuple[int, ...] = (11, 6, 7, 8, 9, 10),
) -> FakeFlowers102:
    """One solid-colour JPEG per label, plus the two .mat files in the layout of the real ones.

    Every split needs at least 2 ids: torchvision loads setid.mat with ``squeeze_me=True``, which
    turns a 1-element id list into a scalar.
    """
    folder = root / "flowers-102"
    (folder / "jpg").mkdir(parents=True)
    for image_id in range(1, len(labels) + 1):
        image = Image.new("RGB", FLOWERS_JPEG_SIZE, flowers_colour(image_id))
        image.save(folder / "jpg" / f"image_{image_id:05d}.jpg", quality=95)

    scipy.io.savemat(folder / "imagelabels.mat", {"labels": np.array([labels], dtype=np.uint8)})
    ids = {"trnid": trnid, "valid": valid, "tstid": tstid}
    scipy.io.savemat(folder / "setid.mat", {k: np.array([v], dtype=np.uint16) for k, v in ids.items()})

    md5s = {name: md5(folder / name) for name in ("imagelabels.mat", "setid.mat")}
    return FakeFlowers102(folder, list(labels), list(trnid), list(valid), list(tstid), md5s)


def patch_flowers102_md5s(monkeypatch: pytest.MonkeyPatch, md5s: dict[str, str]) -> None:
    """Point torchvision's Flowers102 integrity check at the fabricated .mat files' md5s.

    Only the md5s in the ``_file_dict`` class attribute are replaced; the real check still runs.
    """
    file_dict = dict(tvd.Flowers102._file_dict)
    for key in ("label", "setid"):
        filename, _ = file_dict[key]
        file_dict[key] = (filename, md5s[filename])
    monkeypatch.setattr(tvd.Flowers102, "_file_dict", file_dict)


# ---------------------------------------------------------------------------------------------
# MovieLens: its three published layouts (dpsweep.data.movielens)
# ---------------------------------------------------------------------------------------------
ML_GENRES = ("Action", "Comedy", "Drama")


def movielens_ratings(users: int = 12, items: int = 9, seed: int = 0) -> list[tuple[int, int, float, int]]:
    """(user id, item id, stars, timestamp) rows: each user rates 3 to 6 distinct items, ids from 1."""
    rng = np.random.default_rng(seed)
    rows = []
    for u in range(1, users + 1):
        for i in sorted(rng.choice(items, size=int(rng.integers(3, 7)), replace=False) + 1):
            rows.append((u, int(i), float(rng.integers(1, 11)) / 2, 881250949 + len(rows)))
    return rows


def whole(stars: float) -> int:
    """Whole stars, as ml-1m's and ml-100k's files hold them."""
    return max(1, round(stars))


def fabricate_movielens(
    root: Path, layout: str, rows: list[tuple[int, int, float, int]], items: int = 9, catalogue: bool = True
) -> Path:
    """``rows`` written in ``layout`` (ratings.csv, ratings.dat or u.data) under ``root``, with its
    catalogue of ``items`` movies (genres: ML_GENRES by item id); returns the ratings file."""
    root.mkdir(parents=True, exist_ok=True)
    genres = {i: ML_GENRES[i % 3] + ("|" + ML_GENRES[(i + 1) % 3] if i % 2 else "") for i in range(1, items + 1)}
    if layout == "ratings.csv":
        text = "userId,movieId,rating,timestamp\n" + "".join(f"{u},{i},{r},{t}\n" for u, i, r, t in rows)
        movies = "movieId,title,genres\n" + "".join(f'{i},"Film {i}, The (1999)",{g}\n' for i, g in genres.items())
        names = ("ratings.csv", "movies.csv")
    elif layout == "ratings.dat":
        text = "".join(f"{u}::{i}::{whole(r)}::{t}\n" for u, i, r, t in rows)
        movies = "".join(f"{i}::Film {i} (1999)::{g}\n" for i, g in genres.items())
        names = ("ratings.dat", "movies.dat")
    else:
        text = "".join(f"{u}\t{i}\t{whole(r)}\t{t}\n" for u, i, r, t in rows)
        flags = {i: ["0"] * 19 for i in genres}
        for i, g in genres.items():
            for name in g.split("|"):
                flags[i][1 + ML_GENRES.index(name)] = "1"
        movies = "".join(f"{i}|Film {i} (1999)|01-Jan-1999||http://x|{'|'.join(flags[i])}\n" for i in genres)
        names = ("u.data", "u.item")
    (root / names[0]).write_text(text, encoding="latin-1" if layout != "ratings.csv" else "utf-8")
    if catalogue:
        (root / names[1]).write_text(movies, encoding="latin-1" if layout != "ratings.csv" else "utf-8")
    return root / names[0]
