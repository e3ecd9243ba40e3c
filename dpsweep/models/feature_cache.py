"""Frozen-feature cache for ``vgg16_frozen``: compute the VGG16 features once, train the head on them.

With the convolutional part of :class:`~dpsweep.models.classifiers.FrozenVGG16` frozen, every epoch would
recompute the same features. They depend only on the data split, the image size and the frozen
weights, so they are computed once, stored on disk under a content key, and DP-SGD then trains only
the pool and head (:class:`~dpsweep.models.classifiers.PooledHead`) on rows of (flattened maps, label)::

    from dpsweep.models.feature_cache import cached_splits
    cached = cached_splits(model, data, dataclasses.asdict(cfg.dataset),
                           root=Path("cache/features"), batch_size=256, device=device)
    cached.train            # TensorDataset of (maps float32 (512·H/32·W/32,), label int64)
    cached.status           # {"train": "hit", "test": "built"}, or "rebuilt (<reason>)"
    cached.head(model)(z)   # == model(x): the same logits (tested)

What is stored is the convolutional maps *before* torchvision's adaptive 7x7 average pool, which has
no parameters and is applied to each batch: 25,088 values per image at 224 px, but 512 at 32 px
(MNIST, CIFAR-10), where the pool would copy the single position 49 times. Flowers-102's 1,020
training images take 102 MB at 224 px; CIFAR-10's 50,000 take 102 MB at 32 px.

This is valid because dpsweep's transforms are deterministic (resize, crop, normalise): with random
augmentation the features would differ per epoch and must not be cached.

One feature row is one example, so Poisson sampling over the rows samples examples exactly as over
the images: N, the sample rate, the steps and ε are unchanged.

Content key (:func:`cache_key`): sha256 of a canonical JSON of :data:`FORMAT_VERSION`, the dataset
config (less :data:`CONTENT_FREE_KEYS` such as ``download``), the split, the input shape (C, H, W),
the frozen weights' fingerprint (:func:`weights_fingerprint`) and torch's major.minor version. A change
to any of them gives a new file; nothing is ever looked up by a name that could mean other content.
``dataset.root`` stays in the key: two roots may hold different files. Features computed on a GPU
and on the CPU differ in the last bits; the key leaves the device out, so a file built on one serves both.

Files: ``<root>/<key>.pt``, a ``torch.save`` dict ``{"format", "key", "describe", "features",
"labels", "sha256"}``, written atomically (temporary file in the same directory, then
``os.replace``), so concurrent sweep jobs building the same key each leave a whole file. Each load
checks that the file unpickles (``weights_only=True``), that its format and stored key are the
expected ones (an older format, or a file copied or renamed from another key), the shapes and
dtypes (N rows of features and labels) and the checksum of the tensors' bytes. Any failure logs a
warning naming the file and the reason, and the features are rebuilt and the file overwritten.

Memory stages when the cache is on (``memory.STAGES``): only the pool and head are trained on the
device; the backbone runs once, before training, to extract the maps, and is not on the device
during training.

- ``model_load``: the head (25088·h + h + h·classes + classes parameters) and its DP wrapper; not
  the 14.7 M backbone parameters.
- ``batch_load``: one batch of flattened maps, B × 512·H/32·W/32 float32, and its labels; not B images.
- ``backward``: the head's gradients and, under DP, its per-sample gradients (B × head parameters);
  no activations of the convolutional layers.
- ``optimizer_step``: after clipping, noise and the update of the head's parameters (and optimizer
  state).

So memory models fitted to probes with the cache on predict runs with the cache on; probe with
``model.feature_cache=false`` to model the uncached setting.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, TensorDataset

from dpsweep.data.loaders import DataSplits
from dpsweep.models.classifiers import FrozenVGG16, PooledHead

log = logging.getLogger(__name__)

FORMAT_VERSION = 2  # 2: maps before the pool; bump when the layout or what extract_features computes changes
CONTENT_FREE_KEYS = frozenset({"download"})  # dataset config keys that do not change the examples
SPLITS = ("train", "test")

Features = tuple[Tensor, Tensor]  # (features float32 (N, D), labels int64 (N,))


class CacheFileError(ValueError):
    """A cache file is unreadable, stale or corrupt; the message is the reason."""


def _digest_tensors(h: Any, named: list[tuple[str, Tensor]]) -> None:
    """Feed name, dtype, shape and raw bytes of each tensor into the hash ``h`` (in list order)."""
    for name, t in named:
        flat = t.detach().to("cpu").contiguous().reshape(-1)
        h.update(f"{name}|{flat.dtype}|{tuple(t.shape)}|".encode())
        h.update(flat.view(torch.uint8).numpy().data)


def weights_fingerprint(model: FrozenVGG16) -> str:
    """sha256 (hex) of the frozen parts' state: ``features`` and ``avgpool`` state_dicts (names,
    shapes, dtypes, bytes). Any change to a frozen weight changes it; the trained head does not."""
    h = hashlib.sha256()
    for prefix, module in (("features", model.features), ("avgpool", model.avgpool)):
        state = module.state_dict()
        _digest_tensors(h, [(f"{prefix}.{name}", state[name]) for name in sorted(state)])
    return h.hexdigest()


def _torch_minor() -> str:
    """torch's ``major.minor``, e.g. ``"2.5"`` for ``2.5.1+cu124``."""
    return ".".join(torch.__version__.split("+")[0].split(".")[:2])


def cache_key(*, dataset: Mapping[str, Any], split: str, input_shape: tuple[int, int, int], weights: str) -> str:
    """Content key (sha256 hex) of one split's features.

    ``dataset`` is the dataset config as a plain dict (``dataclasses.asdict`` or
    ``OmegaConf.to_container(cfg.dataset, resolve=True)``); keys in :data:`CONTENT_FREE_KEYS` are
    dropped. ``split`` is ``"train"`` or ``"test"``, ``input_shape`` the (C, H, W) of one image and
    ``weights`` the :func:`weights_fingerprint`.
    """
    if split not in SPLITS:
        raise ValueError(f"split={split!r}: expected one of {SPLITS}")
    content = {
        "format": FORMAT_VERSION,
        "dataset": {k: v for k, v in dataset.items() if k not in CONTENT_FREE_KEYS},
        "split": split,
        "input_shape": [int(s) for s in input_shape],
        "weights": weights,
        "torch": _torch_minor(),
    }
    canonical = json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


def map_shape(model: FrozenVGG16, input_shape: tuple[int, int, int]) -> tuple[int, int, int]:
    """(512, H/32, W/32): one example's convolutional maps, as the cache stores them (flattened).
    Each of VGG16's 2x2, stride-2 max-pools halves the size, rounding down."""
    _, height, width = input_shape
    for layer in model.features:
        if isinstance(layer, torch.nn.MaxPool2d):
            height, width = height // 2, width // 2
    channels = [m.out_channels for m in model.features if isinstance(m, torch.nn.Conv2d)][-1]
    return (int(channels), height, width)


@torch.no_grad()
def extract_features(model: FrozenVGG16, dataset: Dataset[Any], *, batch_size: int, device: torch.device) -> Features:
    """Frozen convolutional maps of every example, flattened, in dataset order: float32
    (N, 512·H/32·W/32) and int64 labels (N,), both on the CPU. Runs ``model.feature_maps`` on
    ``device`` in eval mode over a non-shuffling DataLoader, then returns the backbone to the CPU
    (training needs only the head on the device) and restores the model's train/eval mode."""
    n = len(dataset)  # type: ignore[arg-type]
    features: Tensor | None = None
    labels = torch.empty(n, dtype=torch.int64)
    was_training = model.training
    model.features.to(device)
    model.eval()
    row = 0
    try:
        for x, y in DataLoader(dataset, batch_size=batch_size, shuffle=False):
            f = model.feature_maps(x.to(device)).flatten(1)
            if features is None:
                features = torch.empty((n, f.shape[1]), dtype=torch.float32)
            features[row : row + len(f)] = f.to("cpu", torch.float32)
            labels[row : row + len(f)] = torch.as_tensor(y, dtype=torch.int64)
            row += len(f)
    finally:
        model.features.to("cpu")
        model.train(was_training)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the training run's reserved figures must not include extraction
    if row != n or features is None:
        raise RuntimeError(f"dataset yielded {row} examples, but len(dataset) = {n}")
    return features, labels


def _checksum(features: Tensor, labels: Tensor) -> str:
    h = hashlib.sha256()
    _digest_tensors(h, [("features", features), ("labels", labels)])
    return h.hexdigest()


def _check_tensors(features: Any, labels: Any) -> None:
    """Raise :class:`CacheFileError` unless float32 (N, D) features and int64 (N,) labels."""
    if not isinstance(features, Tensor) or not isinstance(labels, Tensor):
        raise CacheFileError(f"features/labels are {type(features).__name__}/{type(labels).__name__}, not tensors")
    if features.dtype != torch.float32 or features.dim() != 2:
        raise CacheFileError(f"features are {features.dtype} {tuple(features.shape)}, expected float32 (N, D)")
    if labels.dtype != torch.int64 or labels.dim() != 1:
        raise CacheFileError(f"labels are {labels.dtype} {tuple(labels.shape)}, expected int64 (N,)")
    if len(features) != len(labels):
        raise CacheFileError(f"{len(features)} feature rows but {len(labels)} labels")


class FeatureCache:
    """Feature files ``<root>/<key>.pt``, checked on every load, rebuilt when anything is off.

    ::

        cache = FeatureCache(Path("cache/features"))
        (features, labels), status = cache.load_or_build(key, build, describe={"split": "train"})
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def path_for(self, key: str) -> Path:
        """The file that holds the features of ``key``."""
        if not key or any(c in key for c in "/\\") or key.startswith("."):
            raise ValueError(f"cache key {key!r} is not a plain file name")
        return self.root / f"{key}.pt"

    def load_or_build(
        self, key: str, build: Callable[[], Features], *, describe: Mapping[str, Any], rows: int | None = None
    ) -> tuple[Features, str]:
        """The features of ``key``, and how they were obtained: ``"hit"`` (read from a valid file),
        ``"built"`` (no file yet) or ``"rebuilt (<reason>)"`` (the file was unreadable, stale or
        corrupt; a warning names it). ``build`` is called only when there is no valid file; its
        result is written with ``describe`` (plain JSON-like metadata for people reading the file).
        ``rows``: the number of examples the dataset has now; a file with another count is stale (the
        files under the dataset's root changed), whatever its key says."""
        path = self.path_for(key)
        self.root.mkdir(parents=True, exist_ok=True)
        # One builder per key: a sweep's jobs start together, and the others wait for its file
        # rather than each extracting the same features (the write itself is atomic either way).
        with open(self.root / f".{key}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            return self._load_or_build(path, key, build, describe, rows)

    def _load_or_build(
        self, path: Path, key: str, build: Callable[[], Features], describe: Mapping[str, Any], rows: int | None
    ) -> tuple[Features, str]:
        status = "built"
        if path.exists():
            try:
                features, labels = self._load(path, key)
                if rows is not None and len(labels) != rows:
                    raise CacheFileError(f"stale: holds {len(labels)} examples, the dataset has {rows}")
                return (features, labels), "hit"
            except CacheFileError as why:
                log.warning(f"feature cache file {path} is not usable ({why}); rebuilding it")
                status = f"rebuilt ({why})"
        features, labels = build()
        try:
            _check_tensors(features, labels)
        except CacheFileError as why:
            raise ValueError(f"build() for feature cache key {key} returned bad tensors: {why}") from None
        self._save(path, key, features, labels, describe)
        return (features, labels), status

    def _load(self, path: Path, key: str) -> Features:
        try:
            stored = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # truncated zip, flipped bytes, not a torch file: all mean unreadable
            raise CacheFileError(f"unreadable: {type(err).__name__}: {err}") from err
        if not isinstance(stored, dict):
            raise CacheFileError(f"unreadable: holds a {type(stored).__name__}, not a dict")
        missing = {"format", "key", "features", "labels", "sha256"} - stored.keys()
        if missing:
            raise CacheFileError(f"unreadable: missing entries {sorted(missing)}")
        if stored["format"] != FORMAT_VERSION:
            raise CacheFileError(f"stale: format {stored['format']!r}, expected {FORMAT_VERSION}")
        if stored["key"] != key:
            raise CacheFileError(f"stale: holds key {stored['key']!r}, expected {key!r}")
        features, labels = stored["features"], stored["labels"]
        _check_tensors(features, labels)
        if _checksum(features, labels) != stored["sha256"]:
            raise CacheFileError("corrupt: the tensors' sha256 does not match the stored checksum")
        return features, labels

    def _save(self, path: Path, key: str, features: Tensor, labels: Tensor, describe: Mapping[str, Any]) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        payload = {
            "format": FORMAT_VERSION,
            "key": key,
            "describe": json.loads(json.dumps(dict(describe), default=str)),  # plain types for weights_only
            "features": features.contiguous(),
            "labels": labels.contiguous(),
            "sha256": _checksum(features, labels),
        }
        fd, tmp_name = tempfile.mkstemp(dir=self.root, prefix=f".{key}.", suffix=".tmp")
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp_name, 0o666 & ~umask)  # mkstemp makes 0600: other users' jobs share the cache
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(payload, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp_name, path)
        except BaseException:
            Path(tmp_name).unlink(missing_ok=True)
            raise


@dataclass(frozen=True)
class CachedFeatures:
    """Both splits as feature rows: the stand-in for :class:`~dpsweep.data.loaders.DataSplits` when only the
    head is trained. ``status`` and ``keys`` are by split (``"train"``, ``"test"``)."""

    train: TensorDataset  # (flattened maps float32 (feature_dim,), label int64) per example
    test: TensorDataset
    num_classes: int
    map_shape: tuple[int, int, int]  # (512, H/32, W/32) of one example
    feature_dim: int  # 512·H/32·W/32: 25,088 at 224 px, 512 at 32 px
    status: dict[str, str]  # "hit" | "built" | "rebuilt (<reason>)"
    keys: dict[str, str]

    @property
    def n_train(self) -> int:
        """N, the training-set size: one feature row per training example."""
        return len(self.train)

    def head(self, model: FrozenVGG16) -> PooledHead:
        """The module to train on these rows: ``model``'s pool and head (shared parameters)."""
        return model.cached_head(self.map_shape)


def cached_splits(
    model: FrozenVGG16,
    splits: DataSplits,
    dataset_cfg: Mapping[str, Any],
    *,
    root: Path,
    batch_size: int,
    device: torch.device,
) -> CachedFeatures:
    """Features of both splits of ``splits``, from ``root`` or extracted with ``model`` on ``device``.

    ``dataset_cfg`` is the dataset config as a plain dict (see :func:`cache_key`); ``batch_size`` is
    the extraction batch size (no effect on the features or on privacy).
    """
    import torchvision  # for its version in the cache key: only runs with a feature cache load it

    cache = FeatureCache(root)
    weights = weights_fingerprint(model)
    loaded: dict[str, TensorDataset] = {}
    status: dict[str, str] = {}
    keys: dict[str, str] = {}
    for split, dataset in (("train", splits.train), ("test", splits.test)):
        content = dict(dataset_cfg) | {
            # what the config strings do not say: where the files are, and how they are transformed
            "root": str(Path(str(dataset_cfg["root"])).resolve()) if "root" in dataset_cfg else None,
            "transform": repr(getattr(dataset, "transform", None)),
            "torchvision": torchvision.__version__,
        }
        key = cache_key(dataset=content, split=split, input_shape=splits.input_shape, weights=weights)
        describe = {
            "dataset": dict(dataset_cfg),
            "split": split,
            "input_shape": list(splits.input_shape),
            "weights_sha256": weights,
            "torch": torch.__version__,
            "device": str(device),
        }

        def build(dataset: Dataset[Any] = dataset) -> Features:
            return extract_features(model, dataset, batch_size=batch_size, device=device)

        (features, labels), status[split] = cache.load_or_build(
            key,
            build,
            describe=describe,
            rows=len(dataset),  # type: ignore[arg-type]
        )
        log.info(f"features {split}: {status[split]} ({len(labels)} × {features.shape[1]}, {cache.path_for(key)})")
        loaded[split], keys[split] = TensorDataset(features, labels), key
    return CachedFeatures(
        train=loaded["train"],
        test=loaded["test"],
        num_classes=splits.num_classes,
        map_shape=map_shape(model, splits.input_shape),
        feature_dim=int(loaded["train"].tensors[0].shape[1]),
        status=status,
        keys=keys,
    )
