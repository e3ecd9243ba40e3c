"""Frozen-feature cache: same logits as the full model, content keys, hits, and rebuilds of bad files."""

from __future__ import annotations

import copy
import logging
import shutil
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

from dpsweep.config import DigitsConfig
from dpsweep.data.loaders import DataSplits, load_digits_splits
from dpsweep.models import feature_cache
from dpsweep.models.classifiers import FrozenVGG16

CPU = torch.device("cpu")
DATASET_CFG = {"name": "synthetic", "root": "data", "download": False, "image_size": 32}


@pytest.fixture(scope="module")
def vgg() -> FrozenVGG16:
    torch.manual_seed(0)
    return FrozenVGG16(num_classes=3, hidden_units=8, pretrained=False)


@pytest.fixture(scope="module")
def splits() -> DataSplits:
    g = torch.Generator().manual_seed(1)
    train = TensorDataset(torch.randn(24, 1, 32, 32, generator=g), torch.randint(0, 3, (24,), generator=g))
    test = TensorDataset(torch.randn(10, 1, 32, 32, generator=g), torch.randint(0, 3, (10,), generator=g))
    return DataSplits(train, test, num_classes=3, input_shape=(1, 32, 32))


class CountingBuild:
    """A build callable that counts its calls."""

    def __init__(self, features: torch.Tensor, labels: torch.Tensor) -> None:
        self.features, self.labels, self.calls = features, labels, 0

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls += 1
        return self.features.clone(), self.labels.clone()


def _tensors(n: int = 6, dim: int = 5, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, dim, generator=g), torch.randint(0, 10, (n,), generator=g)


def test_head_on_cached_features_gives_the_models_logits(vgg: FrozenVGG16, splits: DataSplits, tmp_path: Path) -> None:
    cached = feature_cache.cached_splits(vgg, splits, DATASET_CFG, root=tmp_path, batch_size=7, device=CPU)
    assert cached.status == {"train": "built", "test": "built"}
    assert cached.map_shape == (512, 1, 1) and cached.feature_dim == 512  # 32 px: before the 7x7 pool
    assert cached.num_classes == 3 and cached.n_train == 24
    x_train, y_train = splits.train.tensors  # type: ignore[attr-defined]
    features, labels = cached.train.tensors
    assert features.dtype == torch.float32 and features.shape == (24, 512)
    assert labels.dtype == torch.int64 and torch.equal(labels, y_train)  # dataset order
    vgg.eval()
    with torch.no_grad():
        head = cached.head(vgg)
        assert torch.allclose(head(features), vgg(x_train), atol=1e-5, rtol=1e-4)
        x_test, _ = splits.test.tensors  # type: ignore[attr-defined]
        assert torch.allclose(head(cached.test.tensors[0]), vgg(x_test), atol=1e-5, rtol=1e-4)

    again = feature_cache.cached_splits(vgg, splits, DATASET_CFG, root=tmp_path, batch_size=5, device=CPU)
    assert again.status == {"train": "hit", "test": "hit"}
    assert again.keys == cached.keys and again.keys["train"] != again.keys["test"]
    assert torch.equal(again.train.tensors[0], features)


def test_extract_features_is_in_dataset_order_and_restores_mode(vgg: FrozenVGG16, splits: DataSplits) -> None:
    vgg.train()
    features, labels = feature_cache.extract_features(vgg, splits.test, batch_size=3, device=CPU)
    assert vgg.training
    x, y = splits.test.tensors  # type: ignore[attr-defined]
    assert torch.equal(labels, y)
    assert torch.allclose(features, vgg.feature_maps(x).flatten(1), atol=1e-6)


def _key(vgg: FrozenVGG16, **overrides: object) -> str:
    args: dict[str, object] = {
        "dataset": DATASET_CFG,
        "split": "train",
        "input_shape": (1, 32, 32),
        "weights": feature_cache.weights_fingerprint(vgg),
    }
    return feature_cache.cache_key(**(args | overrides))  # type: ignore[arg-type]


def test_key_changes_with_weights_split_and_size_but_not_download(vgg: FrozenVGG16) -> None:
    base = _key(vgg)
    assert len(base) == 64 and base == _key(vgg)

    perturbed = copy.deepcopy(vgg)
    with torch.no_grad():
        perturbed.features[0].weight[0, 0, 0, 0] += 1e-3
    assert feature_cache.weights_fingerprint(perturbed) != feature_cache.weights_fingerprint(vgg)
    assert _key(perturbed) != base

    head_changed = copy.deepcopy(vgg)  # the trained head does not shape the features
    with torch.no_grad():
        head_changed.head[0].weight.add_(1.0)
    assert _key(head_changed) == base

    assert _key(vgg, split="test") != base
    assert _key(vgg, input_shape=(1, 40, 40)) != base
    assert _key(vgg, dataset=DATASET_CFG | {"download": True}) == base
    assert _key(vgg, dataset=dict(reversed(DATASET_CFG.items()))) == base  # canonical JSON
    assert _key(vgg, dataset=DATASET_CFG | {"root": "elsewhere"}) != base
    with pytest.raises(ValueError, match="split='val'"):
        _key(vgg, split="val")


def test_key_of_the_same_dataset_at_32_and_40_px(vgg: FrozenVGG16) -> None:
    keys = set()
    for size in (32, 40):
        cfg = DigitsConfig(image_size=size)
        data = load_digits_splits(cfg)
        assert data.input_shape == (1, size, size)
        keys.add(_key(vgg, dataset=vars(cfg), input_shape=data.input_shape))
    assert len(keys) == 2


def test_second_load_is_a_hit_and_does_not_build(tmp_path: Path) -> None:
    cache = feature_cache.FeatureCache(tmp_path / "cache")
    build = CountingBuild(*_tensors())
    (f1, l1), status1 = cache.load_or_build("a" * 64, build, describe={"split": "train", "shape": (1, 32, 32)})
    (f2, l2), status2 = cache.load_or_build("a" * 64, build, describe={})
    assert (status1, status2, build.calls) == ("built", "hit", 1)
    assert torch.equal(f1, f2) and torch.equal(l1, l2) and torch.equal(f2, build.features)
    stored = torch.load(cache.path_for("a" * 64), weights_only=True)
    assert stored["format"] == feature_cache.FORMAT_VERSION and stored["key"] == "a" * 64
    assert stored["describe"] == {"split": "train", "shape": [1, 32, 32]}
    files = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert files == ["." + "a" * 64 + ".lock", "a" * 64 + ".pt"]  # the lock, and no temporary files left


def _rebuilt(
    cache: feature_cache.FeatureCache, key: str, build: CountingBuild, caplog: pytest.LogCaptureFixture
) -> str:
    """Load ``key`` once more, expecting a logged rebuild; return the reason; check the new file."""
    calls = build.calls
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dpsweep"):
        (features, labels), status = cache.load_or_build(key, build, describe={})
    assert build.calls == calls + 1
    assert status.startswith("rebuilt (") and status.endswith(")")
    assert torch.equal(features, build.features) and torch.equal(labels, build.labels)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(cache.path_for(key)) in warnings[0]
    assert cache.load_or_build(key, build, describe={})[1] == "hit"  # the overwritten file is good
    return status[len("rebuilt (") : -1]


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage"])
def test_corrupt_file_is_detected_and_rebuilt(damage: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cache, key = feature_cache.FeatureCache(tmp_path), "c" * 64
    build = CountingBuild(*_tensors(n=64, dim=512))  # the features are most of the file
    cache.load_or_build(key, build, describe={})
    path = cache.path_for(key)
    raw = bytearray(path.read_bytes())
    if damage == "flip":
        middle = len(raw) // 2  # inside the features' payload
        raw[middle : middle + 8] = bytes(b ^ 0xFF for b in raw[middle : middle + 8])
    elif damage == "truncate":
        raw = raw[: len(raw) // 2]
    else:
        raw = bytearray(b"not a torch file")
    path.write_bytes(bytes(raw))
    reason = _rebuilt(cache, key, build, caplog)
    assert reason.startswith(("corrupt", "unreadable"))


def test_checksum_mismatch_is_corrupt(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cache, key = feature_cache.FeatureCache(tmp_path), "d" * 64
    build = CountingBuild(*_tensors())
    cache.load_or_build(key, build, describe={})
    stored = torch.load(cache.path_for(key), weights_only=True)
    stored["features"][0, 0] += 1.0  # the same layout, different numbers
    torch.save(stored, cache.path_for(key))
    assert _rebuilt(cache, key, build, caplog).startswith("corrupt: the tensors' sha256")


def test_inconsistent_shapes_are_detected(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cache, key = feature_cache.FeatureCache(tmp_path), "e" * 64
    build = CountingBuild(*_tensors())
    cache.load_or_build(key, build, describe={})
    stored = torch.load(cache.path_for(key), weights_only=True)
    stored["labels"] = stored["labels"][:-1]
    torch.save(stored, cache.path_for(key))
    assert "6 feature rows but 5 labels" in _rebuilt(cache, key, build, caplog)


def test_stale_file_copied_from_another_key_is_rebuilt(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cache, key_a, key_b = feature_cache.FeatureCache(tmp_path), "a" * 64, "b" * 64
    build_a, build_b = CountingBuild(*_tensors(seed=1)), CountingBuild(*_tensors(seed=2))
    cache.load_or_build(key_a, build_a, describe={})
    shutil.copyfile(cache.path_for(key_a), cache.path_for(key_b))
    reason = _rebuilt(cache, key_b, build_b, caplog)
    assert reason == f"stale: holds key {key_a!r}, expected {key_b!r}"
    assert cache.load_or_build(key_a, build_a, describe={})[1] == "hit"  # A's own file is untouched


def test_older_format_is_stale(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cache, key = feature_cache.FeatureCache(tmp_path), "f" * 64
    build = CountingBuild(*_tensors())
    cache.load_or_build(key, build, describe={})
    stored = torch.load(cache.path_for(key), weights_only=True)
    stored["format"] = feature_cache.FORMAT_VERSION - 1
    torch.save(stored, cache.path_for(key))
    assert _rebuilt(cache, key, build, caplog).startswith(f"stale: format {feature_cache.FORMAT_VERSION - 1}")


def test_bad_build_output_is_refused_and_not_written(tmp_path: Path) -> None:
    cache = feature_cache.FeatureCache(tmp_path)
    with pytest.raises(ValueError, match="bad tensors: 3 feature rows but 2 labels"):
        cache.load_or_build("g" * 64, lambda: (torch.zeros(3, 4), torch.zeros(2, dtype=torch.int64)), describe={})
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []  # nothing written
    with pytest.raises(ValueError, match="not a plain file name"):
        cache.path_for("../escape")


def test_a_cache_of_another_number_of_examples_is_stale(
    vgg: FrozenVGG16, splits: DataSplits, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The files under a dataset's root changed (the config did not): the rows no longer match N."""
    feature_cache.cached_splits(vgg, splits, DATASET_CFG, root=tmp_path, batch_size=8, device=CPU)
    x, y = splits.train.tensors  # type: ignore[attr-defined]
    fewer = DataSplits(TensorDataset(x[:20], y[:20]), splits.test, num_classes=3, input_shape=(1, 32, 32))
    with caplog.at_level("WARNING", logger="dpsweep.models.feature_cache"):
        cached = feature_cache.cached_splits(vgg, fewer, DATASET_CFG, root=tmp_path, batch_size=8, device=CPU)
    assert cached.status["train"] == "rebuilt (stale: holds 24 examples, the dataset has 20)"
    assert cached.status["test"] == "hit" and cached.n_train == 20
    assert "not usable" in caplog.text


def _build_slowly(root: str, log: str) -> str:
    """In another process: load or build one key whose build takes a while and leaves a trace."""
    import time

    def build() -> tuple[torch.Tensor, torch.Tensor]:
        with open(log, "a") as f:
            f.write("built\n")
        time.sleep(1.0)
        return _tensors()

    _, status = feature_cache.FeatureCache(Path(root)).load_or_build("k" * 64, build, describe={})
    return status


@pytest.mark.slow
def test_concurrent_jobs_build_a_key_once(tmp_path: Path) -> None:
    import multiprocessing

    log = tmp_path / "builds.log"
    with multiprocessing.get_context("spawn").Pool(3) as pool:
        statuses = pool.starmap(_build_slowly, [(str(tmp_path / "cache"), str(log))] * 3)
    assert sorted(statuses) == ["built", "hit", "hit"]
    assert log.read_text() == "built\n"
