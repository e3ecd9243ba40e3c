"""Benchmark: training speed and peak memory of dpsweep's training paths, private and not, on CPU and GPU.

    .venv/bin/python benchmarks/training_speed.py                        # cuda if available, else cpu
    .venv/bin/python benchmarks/training_speed.py --device all           # cpu, then cuda when there is one
    .venv/bin/python benchmarks/training_speed.py --quick                # fewer timed steps (noisier figures)
    .venv/bin/python benchmarks/training_speed.py --json speed.json      # also write every figure as JSON
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/training_speed.py      # on a CPU shared with other jobs
    .venv/bin/python benchmarks/training_speed.py --device cuda --sections cache --cache-image-size 224
                                                  # the cache goal at VGG16's own input size (Flowers-102)

On a CPU that other processes keep busy, torch's intra-op threads stall waiting for each other (small steps
get tens of times slower); one thread per process gives stable figures there. The header prints the threads.

Everything runs in one process through dpsweep's own building blocks: ``data.build``, ``models.build``,
``optimizers.build_optimizer``, ``dpsgd.make_private`` (Opacus, Poisson sampling), the classifier task's
``train_pass`` (one forward/backward/step as training does it), ``device_data`` and ``feature_cache``. Only
training steps are timed: no MLflow, no evaluation, no setup. After 2 warm-up steps (the first is also the
memory iteration), either a fixed number of optimizer steps is timed one by one, steps/s = 1 / median step
time, and an epoch is extrapolated as steps-per-epoch / steps/s ("extrap"); or whole epochs are timed, each
with a fresh iterator as in training, and the epoch time is their median ("timed"). Medians resist other load.

Peak memory is that of the first iteration (model, DP wrapper, batch, backward, optimizer step), above the
level when the setting started. On CUDA it is the caching allocator's ``max_memory_allocated``; on the CPU it
is dpsweep's ``cpu-tensors`` census (``dpsweep.memory.stages``): the bytes of live tensors at the stage boundaries,
a lower bound that does not see temporaries freed inside a stage (activations, autograd buffers).

Sections (``--sections``, default all), per device:

- head: the vgg16_frozen head (``PooledHead``) on cached 56 px digits maps (512 values per image; at
  ``--cache-image-size`` px, 512 x (size // 32)^2), non-private
  vs DP hooks vs DP ghost clipping, on batches of exactly B rows (drawn with replacement on the device, as a
  memory probe does), so that every mode sees the same B. Hooks is skipped where its per-sample gradients
  (B x trainable parameters x 4 bytes) would exceed --max-grad-sample-bytes.
- cnn: the Opacus MNIST example CNN on 28 px digits, the same three modes (the goal is on hooks, dpsweep's
  default; ghost is informational: Opacus's ghost clipping of convolutions is not expected to meet it).
- cache: vgg16_frozen (random weights, head of --hidden-units) on 56 px digits (``--cache-image-size``), B=256,
  DP (--cache-dp: default ghost clipping, the mode the head goal is about; hooks materialises the head's
  B x 3.2 M (128 units) per-sample gradients, which swamps both paths): images through the frozen backbone
  every step (uncached; epoch extrapolated from a few steps) vs the head on the cached maps (whole epochs
  timed), both through the gathered DataLoader + Opacus DPDataLoader that training uses
  (``dpsweep.data.gathered``); the cached head on device-resident maps too.
  The one-off extraction (both splits, cache files written) is reported on its own.
  Then ``train.train`` runs 1 epoch each way (``model.feature_cache=true/false``, same seed, MLflow in a
  temporary sqlite store; the cached run reuses the extraction above) to compare test accuracy and ε
  (and, as a finer check, the training loss).
- resident: the cnn with DP (default hooks) on 28 px digits (N=1,437; whole epochs timed) and on an
  MNIST-sized random tensor dataset (60,000 x 1x28x28; epoch extrapolated from --mnist-steps steps):
  DataLoader + DPDataLoader vs ``device_data.PoissonBatches``. The data-only epoch (batches drawn and moved
  to the device, no model) is printed beside it.

Goals (each checked on every device measured; exit status 1 if any is missed):

1. cache: a cached frozen-feature epoch at least 20x faster than an uncached one, with the same test
   accuracy (|difference| <= 1e-9) and exactly the same ε for the same seed (``train.train``, 1 epoch).
2. head: ghost clipping at B >= 256: DP/non-DP step time at most 1.3x and peak memory at most 1.1x.
3. resident: a training epoch on device-resident digits and MNIST-sized tensors at least 3x faster than
   through a DataLoader.
4. cnn: DP (hooks) / non-DP step time at most 2x, at every batch size measured.

A goal is judged only where its section ran.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import gc
import io
import json
import logging
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import opacus
import torch
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from dpsweep import units
from dpsweep.config import CNNConfig, DigitsConfig, DPConfig, GradSampleMode, SGDConfig, VGG16FrozenConfig
from dpsweep.data import gathered, loaders, resident
from dpsweep.mechanisms.opacus_engine import make_private
from dpsweep.memory.stages import StageRecorder, backend_for, monitor_for
from dpsweep.models import classifiers, feature_cache
from dpsweep.models.optimizers import build_optimizer
from dpsweep.run.runner import train
from dpsweep.tasks.classifier.passes import Trainer, train_pass
from dpsweep.tasks.classifier.task import EXTRACT_BATCH_SIZE
from dpsweep.tracking.environment import device_name

CACHE_SPEEDUP_MIN = 20.0  # goal 1: uncached epoch / cached epoch
ACCURACY_TOLERANCE = 1e-9  # goal 1: |accuracy cached - uncached|
GHOST_TIME_RATIO_MAX = 1.3  # goal 2: DP ghost / non-DP step time
GHOST_MEMORY_RATIO_MAX = 1.1  # goal 2: DP ghost / non-DP peak memory
GHOST_MIN_BATCH = 256  # goal 2 applies at B >= this
RESIDENT_SPEEDUP_MIN = 3.0  # goal 3: DataLoader epoch / device-resident epoch
CNN_TIME_RATIO_MAX = 2.0  # goal 4: cnn DP (hooks, dpsweep's default) / non-DP step time

SIGMA = 1.0  # noise multiplier (no effect on speed)
MAX_GRAD_NORM = 1.0
SEED = 0
# Images of the cache sections (default; --cache-image-size): 224 / 4, Flowers-102 at dataset.downscale=4, a
# small VGG input. The maps before the pool are 512 x 1 x 1 here as at 32 px, so the cached head costs the
# same; the backbone costs (56/32)^2 = 3x more. At 32 px it is so cheap on a CPU that the head's first layer
# (25,088 inputs after the pool's 49 copies) bounds the cached/uncached ratio near 11x. 224 is VGG16's own
# input size (Flowers-102 at dataset.downscale=1): 16x the backbone's work of 56 px, and 7 x 7 maps to cache.
CACHE_IMAGE_SIZE = 56
SECTIONS = ("head", "cache", "cnn", "resident")
WARMUP_STEPS = 2
MNIST_N, MNIST_SHAPE = 60_000, (1, 28, 28)
MODES = ("off", "hooks", "ghost")
EXPERIMENT = "training_speed"  # MLflow experiment of the train.train check (in a temporary store)

Batch = tuple[Tensor, Tensor]
ModelFactory = Callable[[], nn.Module]


@dataclass
class Measurement:
    """One setting: throughput, epoch time and first-iteration peak memory."""

    device: str
    section: str  # head | cnn | cache | resident
    setting: str  # what is trained on what
    data: str  # fixed (B rows per step) | loader (DataLoader + DPDataLoader) | resident (device_data)
    dp: str  # off | hooks | ghost
    batch_size: int  # logical B
    steps_per_epoch: int
    steps_timed: int
    steps_per_s: float
    epoch_s: float
    epoch_basis: str  # timed (median whole epoch) | extrap (steps_per_epoch / steps_per_s)
    peak_bytes: int | None  # first iteration, above the level when the setting started
    memory_backend: str
    data_epoch_s: float | None = None  # data-only epoch: batches drawn and moved to the device, no model
    times_s: list[float] = field(default_factory=list)  # each timed step (extrap) or whole epoch (timed)


@dataclass
class Goal:
    name: str
    detail: str
    passed: bool


@dataclass
class DeviceReport:
    device: str
    device_name: str
    memory_backend: str
    measurements: list[Measurement] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    extras: dict[str, Any] = field(default_factory=dict)
    ratios: dict[str, float] = field(default_factory=dict)
    goals: list[Goal] = field(default_factory=list)


@dataclass(frozen=True)
class Plan:
    """How much to run: steps timed per setting and the batch sizes of the head section."""

    head_batch_sizes: tuple[int, ...]
    head_steps: int
    head_hooks_steps: int  # hooks on the head is slow (B x P per-sample gradients): fewer steps
    cnn_batch_sizes: tuple[int, ...]
    cnn_steps: int
    uncached_steps: int
    cached_epochs: int
    digits_epochs: int
    mnist_steps: int
    hidden_units: int
    cache_dp: str  # DP mode of the cache section and of the train.train check
    max_grad_sample_bytes: int
    train_check: bool
    cache_image_size: int = CACHE_IMAGE_SIZE  # pixels of the digits in the head and cache sections
    sections: tuple[str, ...] = SECTIONS


# ---------------------------------------------------------------------------------------------
# timing one setting
# ---------------------------------------------------------------------------------------------
class FixedBatches:
    """Endless batches of exactly ``batch_size`` rows drawn with replacement from device-resident ``x``, ``y``
    (as a memory probe does): every mode of a comparison sees the same B."""

    def __init__(self, x: Tensor, y: Tensor, batch_size: int, device: torch.device) -> None:
        self.x, self.y, self.batch_size, self.device = x, y, batch_size, device
        self.generator = resident.device_generator(device, SEED)

    def __iter__(self) -> Iterator[Batch]:
        while True:
            index = torch.randint(len(self.x), (self.batch_size,), generator=self.generator, device=self.device)
            yield self.x[index], self.y[index]


def _cycle(batches: Iterable[Batch]) -> Iterator[Batch]:
    """Epoch after epoch (a fresh iterator each time, as training does)."""
    while True:
        yield from batches


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure(
    *,
    device: torch.device,
    section: str,
    setting: str,
    make_model: ModelFactory,
    dataset: TensorDataset,
    batch_size: int,
    dp: str,
    data: str,
    steps: int | None = None,
    epochs: int | None = None,
    data_epochs: int = 0,
) -> Measurement:
    """Build the setting as the classifier task (``dpsweep.tasks.classifier``) does, record the first
    iteration's memory, warm up, then time ``steps`` optimizer steps or ``epochs`` whole epochs (and
    ``data_epochs`` data-only epochs)."""
    _free(device)
    fixed_xy = None
    if data == "fixed":  # on the device before the baseline: the same for every mode, not part of the peak
        fixed_xy = (dataset.tensors[0].to(device), dataset.tensors[1].to(device))
    torch.manual_seed(SEED)
    monitor = monitor_for(device)
    start_bytes = monitor.allocated_bytes()
    model = make_model().to(device)
    optimizer = build_optimizer(SGDConfig(), model)
    generator = torch.Generator().manual_seed(SEED)
    loader = gathered.loader(dataset, batch_size, shuffle=dp == "off", generator=generator)  # as training's
    criterion: nn.Module = nn.CrossEntropyLoss()
    if dp != "off":
        dp_cfg = DPConfig(noise_multiplier=SIGMA, max_grad_norm=MAX_GRAD_NORM, grad_sample_mode=GradSampleMode(dp))
        _, model, optimizer, criterion, loader = make_private(
            dp_cfg, SIGMA, dp_cfg.max_grad_norm, model, optimizer, loader, criterion
        )
    batches: Iterable[Batch]
    if fixed_xy is not None:
        batches = FixedBatches(*fixed_xy, batch_size, device)
        steps_per_epoch = len(loader)
    elif data == "resident":
        x, y = resident.materialize(dataset)
        gen = resident.device_generator(device, SEED)
        if dp != "off":
            q = float(loader.sample_rate)  # type: ignore[attr-defined]  # Opacus's DPDataLoader
            poisson = resident.PoissonBatches(x, y, sample_rate=q, device=device, generator=gen)
            batches, steps_per_epoch = poisson, len(poisson)
        else:
            shuffled = resident.ShuffledBatches(x, y, batch_size=batch_size, device=device, generator=gen)
            batches, steps_per_epoch = shuffled, len(shuffled)
    else:
        batches, steps_per_epoch = loader, len(loader)

    model.train()
    trainer = Trainer(model, optimizer, criterion, device)
    stages = StageRecorder(monitor)
    stages.mark("model_load")
    stream = _cycle(batches)
    x, y = next(stream)
    train_pass(trainer, (x, y), stages)
    stages.mark("optimizer_step")
    peak_bytes = stages.figures()["iteration_peak_bytes"] - start_bytes
    idle = StageRecorder(monitor, active=False)
    for _ in range(WARMUP_STEPS - 1):
        x, y = next(stream)
        train_pass(trainer, (x, y), idle)

    times_s: list[float] = []  # per epoch (epochs) or per step (steps)
    if epochs is not None:  # whole epochs, each with a fresh iterator as in training
        del stream
        for _ in range(epochs):
            _sync(device)
            start = time.perf_counter()
            for x, y in batches:
                train_pass(trainer, (x, y), idle)
            _sync(device)
            times_s.append(time.perf_counter() - start)
        taken = epochs * steps_per_epoch
        epoch_s, basis = statistics.median(times_s), "timed"
        steps_per_s = steps_per_epoch / epoch_s
    else:
        assert steps is not None
        taken = steps
        for _ in range(steps):
            _sync(device)
            start = time.perf_counter()
            x, y = next(stream)
            train_pass(trainer, (x, y), idle)
            _sync(device)
            times_s.append(time.perf_counter() - start)
        steps_per_s = 1 / statistics.median(times_s)
        epoch_s, basis = steps_per_epoch / steps_per_s, "extrap"
        del stream

    data_times_s = []
    for _ in range(data_epochs):
        _sync(device)
        start = time.perf_counter()
        for x, y in batches:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        _sync(device)
        data_times_s.append(time.perf_counter() - start)
    data_epoch_s = statistics.median(data_times_s) if data_times_s else None
    del model, optimizer, criterion, loader, batches, x, y, stages, idle, fixed_xy
    _free(device)
    return Measurement(
        device=str(device), section=section, setting=setting, data=data, dp=dp, batch_size=batch_size,
        steps_per_epoch=steps_per_epoch, steps_timed=taken, steps_per_s=steps_per_s, epoch_s=epoch_s,
        epoch_basis=basis, peak_bytes=peak_bytes, memory_backend=monitor.backend, data_epoch_s=data_epoch_s,
        times_s=times_s,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# sections
# ---------------------------------------------------------------------------------------------
def _find(ms: list[Measurement], **match: Any) -> Measurement | None:
    for m in ms:
        if all(getattr(m, k) == v for k, v in match.items()):
            return m
    return None


def _ratio(a: float | None, b: float | None) -> float:
    return float(a) / float(b) if a is not None and b else float("nan")


def run_device(device: torch.device, plan: Plan, work: Path) -> DeviceReport:
    report = DeviceReport(str(device), device_name(device), backend_for(device))
    print(f"\n== device {device}: {report.device_name}; memory backend {report.memory_backend}", flush=True)
    print(HEADER, flush=True)
    if {"head", "cache"} & set(plan.sections):
        vgg16_sections(device, plan, work, report)
    if {"cnn", "resident"} & set(plan.sections):
        cnn_sections(device, plan, report)
    if plan.train_check:
        report.extras["train_check"] = train_check(device, plan, work)
    evaluate_goals(report, plan.sections)
    return report


def vgg16_sections(device: torch.device, plan: Plan, work: Path, report: DeviceReport) -> None:
    """head (the ghost goal) and cache (the cache goal), on digits of ``plan.cache_image_size`` px (56 by
    default) and their cached VGG16 maps."""
    ms = report.measurements
    size = plan.cache_image_size
    # vgg16_frozen on the small digits: the model, and its cached maps (the one-off extraction, timed)
    digits_small = loaders.build(DigitsConfig(image_size=size))
    vgg_cfg = VGG16FrozenConfig(hidden_units=plan.hidden_units, pretrained=False)
    torch.manual_seed(SEED)
    vgg = classifiers.build(vgg_cfg, digits_small.input_shape, digits_small.num_classes)
    assert isinstance(vgg, classifiers.FrozenVGG16)
    _sync(device)
    start = time.perf_counter()
    cached = feature_cache.cached_splits(
        vgg, digits_small, dataclasses.asdict(DigitsConfig(image_size=size)),
        root=_features_dir(work, device), batch_size=EXTRACT_BATCH_SIZE, device=device,
    )  # fmt: skip
    _sync(device)
    extraction_s = time.perf_counter() - start
    head_template = cached.head(vgg).cpu()
    head_params = classifiers.trainable_parameters(head_template)
    report.extras |= {
        "extraction_s": extraction_s, "extraction_images": cached.n_train + len(cached.test),
        "feature_dim": cached.feature_dim, "head_trainable_params": head_params, "n_train_digits": cached.n_train,
        "hidden_units": plan.hidden_units, "cache_image_size": size,
    }  # fmt: skip
    print(
        f"feature cache: extracted {cached.n_train} + {len(cached.test)} images ({size} px) "
        f"in {extraction_s:.2f} s "
        f"(one-off, not in any epoch); {cached.feature_dim} values per image; head has {head_params:,} parameters",
        flush=True,
    )

    def head() -> nn.Module:
        return copy.deepcopy(head_template)

    def backbone_and_head() -> nn.Module:
        return copy.deepcopy(vgg)

    # head: ghost goal
    for b in plan.head_batch_sizes if "head" in plan.sections else ():
        for mode in MODES:
            grad_sample_bytes = b * head_params * 4
            if mode == "hooks" and grad_sample_bytes > plan.max_grad_sample_bytes:
                why = (f"head B={b} hooks: skipped, its per-sample gradients would take "
                       f"{units.format_bytes(grad_sample_bytes)} (> --max-grad-sample-bytes)")  # fmt: skip
                report.skipped.append(why)
                print(f"  {why}", flush=True)
                continue
            ms.append(measure(
                device=device, section="head", setting="vgg16_frozen head on cached maps", make_model=head,
                dataset=cached.train, batch_size=b, dp=mode, data="fixed",
                steps=plan.head_hooks_steps if mode == "hooks" else plan.head_steps,
            ))  # fmt: skip
            _print_row(ms[-1])

    # cache: uncached (images through the backbone) vs cached (head on maps), DP, B=256
    if "cache" not in plan.sections:
        return
    b = 256
    train_small = digits_small.train
    assert isinstance(train_small, TensorDataset)
    ms.append(measure(
        device=device, section="cache", setting="vgg16_frozen uncached (images)", make_model=backbone_and_head,
        dataset=train_small, batch_size=b, dp=plan.cache_dp, data="loader", steps=plan.uncached_steps,
    ))  # fmt: skip
    _print_row(ms[-1])
    for data in ("loader", "resident"):
        ms.append(measure(
            device=device, section="cache", setting="vgg16_frozen cached (maps)", make_model=head,
            dataset=cached.train, batch_size=b, dp=plan.cache_dp, data=data, epochs=plan.cached_epochs,
        ))  # fmt: skip
        _print_row(ms[-1])


def cnn_sections(device: torch.device, plan: Plan, report: DeviceReport) -> None:
    """cnn (informational DP overheads) and resident (the device-resident goal), cnn on digits and MNIST-sized."""
    ms = report.measurements
    digits28 = loaders.build(DigitsConfig(image_size=28))
    cnn_cfg = CNNConfig()
    train28 = digits28.train
    assert isinstance(train28, TensorDataset)

    def cnn() -> nn.Module:
        return classifiers.build(cnn_cfg, digits28.input_shape, digits28.num_classes)

    for b in plan.cnn_batch_sizes if "cnn" in plan.sections else ():
        for mode in MODES:
            ms.append(measure(
                device=device, section="cnn", setting="cnn on digits 28 px", make_model=cnn,
                dataset=train28, batch_size=b, dp=mode, data="fixed", steps=plan.cnn_steps,
            ))  # fmt: skip
            _print_row(ms[-1])

    # resident: DataLoader vs device-resident, cnn with DP hooks, B=64 (dpsweep's default)
    if "resident" not in plan.sections:
        return
    b = 64
    for data in ("loader", "resident"):
        ms.append(measure(
            device=device, section="resident", setting="cnn DP, digits 28 px", make_model=cnn, dataset=train28,
            batch_size=b, dp="hooks", data=data, epochs=plan.digits_epochs, data_epochs=plan.digits_epochs,
        ))  # fmt: skip
        _print_row(ms[-1])
    g = torch.Generator().manual_seed(SEED)
    mnist = TensorDataset(
        torch.randn((MNIST_N, *MNIST_SHAPE), generator=g), torch.randint(0, 10, (MNIST_N,), generator=g)
    )
    for data in ("loader", "resident"):
        ms.append(measure(
            device=device, section="resident", setting="cnn DP, MNIST-sized random", make_model=cnn, dataset=mnist,
            batch_size=b, dp="hooks", data=data, steps=plan.mnist_steps, data_epochs=1,
        ))  # fmt: skip
        _print_row(ms[-1])


def _features_dir(work: Path, device: torch.device) -> Path:
    """The feature cache of one device's run: the benchmark's extraction fills it, train.train reuses it
    (the same seed gives the same random VGG16 weights, hence the same content key)."""
    return work / f"features-{device.type}"


def train_check(device: torch.device, plan: Plan, work: Path) -> dict[str, Any]:
    """``train.train`` for 1 epoch with the feature cache on and off, same seed: test accuracy and ε."""
    from hydra import compose, initialize_config_module
    from mlflow.tracking import MlflowClient

    out: dict[str, Any] = {}
    uri = f"sqlite:///{work / 'bench.db'}"
    client = MlflowClient(uri)  # artifacts (config.yaml) go to the temporary directory, not ./mlruns
    if client.get_experiment_by_name(EXPERIMENT) is None:
        client.create_experiment(EXPERIMENT, artifact_location=(work / "artifacts").as_uri())
    base = [
        "model=vgg16_frozen", "model.pretrained=false", f"model.hidden_units={plan.hidden_units}",
        f"dataset.image_size={plan.cache_image_size}", "train.batch_size=256", "train.epochs=1", "train.progress=false",
        f"train.device={device.type}", f"train.seed={SEED}", f"tracking.uri={uri}",
        f"tracking.experiment_name={EXPERIMENT}", f"model.feature_cache_dir={_features_dir(work, device)}",
        f"dp.grad_sample_mode={plan.cache_dp}",
    ]  # fmt: skip
    for cache in (True, False):
        overrides = [*base, f"model.feature_cache={str(cache).lower()}"]
        printed = io.StringIO()
        start = time.perf_counter()
        with initialize_config_module("dpsweep.conf", version_base="1.3"), contextlib.redirect_stdout(printed):
            result = train(compose("config", overrides=overrides))
        wall_s = time.perf_counter() - start
        tags = client.get_run(result.run_id).data.tags
        status = tags.get("feature_cache.train", "off") if cache else "off"
        out["cached" if cache else "uncached"] = {
            "test_accuracy": result.test_accuracy, "train_loss": result.train_loss, "epsilon": result.epsilon,
            "steps": result.steps,
            "feature_cache_train": status, "wall_s": wall_s, "printed": printed.getvalue().strip(),
        }  # fmt: skip
        print(f"train.train 1 epoch, model.feature_cache={str(cache).lower()} (feature cache: {status}): "
              f"test_accuracy={result.test_accuracy!r} train_loss={result.train_loss!r} ε={result.epsilon!r} "
              f"steps={result.steps} "
              f"({wall_s:.1f} s with setup, evaluation, MLflow)", flush=True)  # fmt: skip
    out["overrides"] = base
    return out


# ---------------------------------------------------------------------------------------------
# ratios and goals
# ---------------------------------------------------------------------------------------------
def evaluate_goals(report: DeviceReport, sections: tuple[str, ...] = SECTIONS) -> None:
    """The ratios, and a verdict for each goal whose section ran."""
    ms, r, goals = report.measurements, report.ratios, report.goals
    for section in ("head", "cnn"):
        for b in sorted({m.batch_size for m in ms if m.section == section}):
            base = _find(ms, section=section, batch_size=b, dp="off")
            for mode in ("hooks", "ghost"):
                m = _find(ms, section=section, batch_size=b, dp=mode)
                if base is None or m is None:
                    continue
                r[f"{section}.B{b}.{mode}.time_ratio"] = _ratio(base.steps_per_s, m.steps_per_s)
                r[f"{section}.B{b}.{mode}.memory_ratio"] = _ratio(m.peak_bytes, base.peak_bytes)

    uncached = _find(ms, section="cache", setting="vgg16_frozen uncached (images)")
    cached = _find(ms, section="cache", setting="vgg16_frozen cached (maps)", data="loader")
    cached_resident = _find(ms, section="cache", setting="vgg16_frozen cached (maps)", data="resident")
    if uncached and cached:
        r["cache.speedup_loader"] = _ratio(uncached.epoch_s, cached.epoch_s)
    if uncached and cached_resident:
        r["cache.speedup_resident"] = _ratio(uncached.epoch_s, cached_resident.epoch_s)
    for setting, name in (("cnn DP, digits 28 px", "digits"), ("cnn DP, MNIST-sized random", "mnist")):
        loader = _find(ms, section="resident", setting=setting, data="loader")
        on_device = _find(ms, section="resident", setting=setting, data="resident")
        if loader and on_device:
            r[f"resident.{name}.epoch_speedup"] = _ratio(loader.epoch_s, on_device.epoch_s)
            r[f"resident.{name}.data_epoch_speedup"] = _ratio(loader.data_epoch_s, on_device.data_epoch_s)

    if "cache" in sections:
        goals.append(_cache_goal(report))
    if "head" in sections:
        goals.append(_ratio_goal(report, "head", "ghost", "2 ghost head", GHOST_TIME_RATIO_MAX, GHOST_MEMORY_RATIO_MAX,
                                 min_batch=GHOST_MIN_BATCH))  # fmt: skip
    if "cnn" in sections:
        goals.append(_ratio_goal(report, "cnn", "hooks", "4 cnn", CNN_TIME_RATIO_MAX, None))
    if "resident" in sections:
        goals.append(_resident_goal(r))


def _cache_goal(report: DeviceReport) -> Goal:
    r = report.ratios
    speedup = r.get("cache.speedup_loader", float("nan"))
    check = report.extras.get("train_check")
    detail = f"uncached/cached epoch {speedup:.1f}x (goal >= {CACHE_SPEEDUP_MIN:g}x)"
    ok = speedup >= CACHE_SPEEDUP_MIN
    if check:
        a_c, a_u = check["cached"]["test_accuracy"], check["uncached"]["test_accuracy"]
        e_c, e_u = check["cached"]["epsilon"], check["uncached"]["epsilon"]
        acc_ok, eps_ok = abs(a_c - a_u) <= ACCURACY_TOLERANCE, e_c == e_u
        loss_diff = check["cached"]["train_loss"] - check["uncached"]["train_loss"]
        detail += (
            f"; test accuracy {a_c:.6f} vs {a_u:.6f} (diff {a_c - a_u:+.2e}) {'equal' if acc_ok else 'DIFFER'}; "
            f"ε {e_c!r} vs {e_u!r} {'equal' if eps_ok else 'DIFFER'}; train loss diff {loss_diff:+.2e} (informational)"
        )
        ok = ok and acc_ok and eps_ok
    else:
        detail += "; accuracy/ε check not run (--no-train-check)"
        ok = False
    return Goal("1 cache", detail, ok)


def _ratio_goal(report: DeviceReport, section: str, mode: str, name: str, time_max: float,
                memory_max: float | None, min_batch: int = 0) -> Goal:  # fmt: skip
    """DP (``mode``) / non-private step time, and peak memory where ``memory_max`` is given, at every
    batch size of ``section`` measured from ``min_batch`` up."""
    r, parts, ok, seen = report.ratios, [], True, False
    for b in sorted({m.batch_size for m in report.measurements if m.section == section}):
        if b < min_batch or f"{section}.B{b}.{mode}.time_ratio" not in r:
            continue
        seen = True
        t, mem = r[f"{section}.B{b}.{mode}.time_ratio"], r[f"{section}.B{b}.{mode}.memory_ratio"]
        ok = ok and t <= time_max and (memory_max is None or mem <= memory_max)
        parts.append(f"B={b}: time {t:.2f}x" + (f", memory {mem:.2f}x" if memory_max is not None else ""))
    goal = f"goals <= {time_max:g}x time" + (f", <= {memory_max:g}x memory" if memory_max is not None else "")
    return Goal(name, f"DP {mode}: " + "; ".join(parts) + f" ({goal})", ok and seen)


def _resident_goal(r: dict[str, float]) -> Goal:
    parts, ok, seen = [], True, False
    for name in ("digits", "mnist"):
        key = f"resident.{name}.epoch_speedup"
        if key in r:
            seen = True
            ok = ok and r[key] >= RESIDENT_SPEEDUP_MIN
            parts.append(
                f"{name}: training epoch {r[key]:.2f}x (data only {r[f'resident.{name}.data_epoch_speedup']:.1f}x)"
            )
    return Goal("3 resident", "; ".join(parts) + f" (goal >= {RESIDENT_SPEEDUP_MIN:g}x)", ok and seen)


# ---------------------------------------------------------------------------------------------
# printing
# ---------------------------------------------------------------------------------------------
HEADER = (
    f"{'section':<9}{'setting':<33}{'data':<9}{'dp':<6}{'B':>5}{'steps':>6}{'steps/s':>9}"
    f"{'epoch s':>10} {'basis':<13}{'peak':>11}{'data-only epoch':>17}"
)


def _print_row(m: Measurement) -> None:
    peak = units.format_bytes(m.peak_bytes) if m.peak_bytes is not None else "-"
    data_only = f"{m.data_epoch_s:.4f} s" if m.data_epoch_s is not None else ""
    basis = f"{m.epoch_basis} {m.steps_per_epoch}st"
    print(
        f"{m.section:<9}{m.setting:<33}{m.data:<9}{m.dp:<6}{m.batch_size:>5}{m.steps_timed:>6}{m.steps_per_s:>9.2f}"
        f"{m.epoch_s:>10.3f} {basis:<13}{peak:>11}{data_only:>17}",
        flush=True,
    )


def print_report(report: DeviceReport) -> None:
    print(f"\n-- {report.device}: {report.device_name}")
    print(
        f"peak = first iteration above the setting's starting level ({report.memory_backend} backend"
        + ("; live tensors at stage boundaries: a lower bound)" if report.memory_backend == "cpu-tensors" else ")")
    )
    print(HEADER)
    for m in report.measurements:
        _print_row(m)
    for why in report.skipped:
        print(f"  {why}")
    r = report.ratios
    print("ratios DP / non-DP (step time = non-DP steps/s over DP steps/s; memory = peak over peak):")
    for section in ("head", "cnn"):
        for b in sorted({m.batch_size for m in report.measurements if m.section == section}):
            cells = [
                f"{mode}: time {r[f'{section}.B{b}.{mode}.time_ratio']:.2f}x, memory "
                f"{r[f'{section}.B{b}.{mode}.memory_ratio']:.2f}x"
                for mode in ("hooks", "ghost")
                if f"{section}.B{b}.{mode}.time_ratio" in r
            ]
            print(f"  {section:<5} B={b:<5} " + "   ".join(cells))
    print("speed-ups:")
    if "cache.speedup_loader" in r:
        print(f"  cache: uncached epoch / cached epoch = {r['cache.speedup_loader']:.1f}x through the DataLoader, "
              f"{r.get('cache.speedup_resident', float('nan')):.1f}x with the cached maps device-resident "
              f"(uncached epoch extrapolated; extraction {report.extras['extraction_s']:.2f} s once)")  # fmt: skip
    for name in ("digits", "mnist"):
        if f"resident.{name}.epoch_speedup" in r:
            print(f"  resident {name}: DataLoader epoch / device-resident epoch = "
                  f"{r[f'resident.{name}.epoch_speedup']:.2f}x training, "
                  f"{r[f'resident.{name}.data_epoch_speedup']:.1f}x data only")  # fmt: skip
    print("goals:")
    for g in report.goals:
        print(f"  goal {g.name}: {g.detail}  {'PASS' if g.passed else 'FAIL'}")


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------
def _devices(requested: str) -> list[torch.device]:
    if requested == "all":
        return [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    if requested == "auto":
        return [torch.device("cuda" if torch.cuda.is_available() else "cpu")]
    if requested == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available here")
    return [torch.device(requested)]


def _plan(args: argparse.Namespace) -> Plan:
    quick = args.quick
    sections = tuple(args.sections.split(",")) if args.sections else SECTIONS
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        raise SystemExit(f"--sections: unknown {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    if args.cache_image_size < 32:
        raise SystemExit(f"--cache-image-size: {args.cache_image_size} is below VGG16's smallest input, 32 px")
    return Plan(
        head_batch_sizes=tuple(args.head_batch_sizes),
        head_steps=args.head_steps or (4 if quick else 10),
        head_hooks_steps=2 if quick else 3,
        cnn_batch_sizes=(64, 256),
        cnn_steps=8 if quick else 20,
        uncached_steps=args.uncached_steps or (2 if quick else 3),
        cached_epochs=2 if quick else 4,
        digits_epochs=1 if quick else 2,
        mnist_steps=args.mnist_steps or (15 if quick else 40),
        hidden_units=args.hidden_units,
        cache_dp=args.cache_dp,
        max_grad_sample_bytes=units.parse_bytes(args.max_grad_sample_bytes, key="--max-grad-sample-bytes"),
        train_check=not args.no_train_check and "cache" in sections,
        cache_image_size=args.cache_image_size,
        sections=sections,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "all"],
                        help="auto: cuda if available, else cpu; all: cpu, then cuda if available")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="fewer timed steps and epochs (noisier)")
    parser.add_argument("--head-batch-sizes", type=int, nargs="+", default=[256, 1024], metavar="B")
    parser.add_argument("--head-steps", type=int, help="timed steps per head setting (default 10; quick 4; hooks 3)")
    parser.add_argument("--uncached-steps", type=int, help="timed uncached VGG16 steps (default 3; quick 2)")
    parser.add_argument("--mnist-steps", type=int, help="timed MNIST-sized steps (default 40; quick 15)")
    parser.add_argument("--hidden-units", type=int, default=128, help="vgg16_frozen head width (default 128)")
    parser.add_argument("--cache-dp", default="ghost", choices=["ghost", "hooks"],
                        help="DP mode of the cache comparison and its train.train check (default ghost)")  # fmt: skip
    parser.add_argument("--max-grad-sample-bytes", default="4GiB",
                        help="skip hooks settings whose per-sample gradients exceed this (default 4GiB)")  # fmt: skip
    parser.add_argument("--no-train-check", action="store_true", help="skip the train.train accuracy/ε check")
    parser.add_argument("--cache-image-size", type=int, default=CACHE_IMAGE_SIZE,
                        help=f"digits' pixels in the head and cache sections (default {CACHE_IMAGE_SIZE}; 224: "
                             "VGG16's own input, Flowers-102 at dataset.downscale=1)")  # fmt: skip
    parser.add_argument("--sections", help=f"comma-separated, default all: {','.join(SECTIONS)}")
    parser.add_argument("--json", type=Path, help="write every figure here as JSON")
    args = parser.parse_args()
    plan = _plan(args)

    warnings.filterwarnings("ignore", message="Optimal order is the largest alpha")
    warnings.filterwarnings("ignore", message=".*Using a non-full backward hook.*")
    logging.getLogger("dpsweep").setLevel(logging.WARNING)
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    print(f"training speed benchmark: torch {torch.__version__}, opacus {opacus.__version__}, "
          f"{os.cpu_count()} CPU cores, {torch.get_num_threads()} torch threads")  # fmt: skip
    wall_start = time.perf_counter()
    reports: list[DeviceReport] = []
    with tempfile.TemporaryDirectory(prefix="dpsweep-speed-") as tmp:
        for device in _devices(args.device):
            reports.append(run_device(device, plan, Path(tmp)))
    for report in reports:
        print_report(report)
    wall_s = time.perf_counter() - wall_start
    passed = all(g.passed for rep in reports for g in rep.goals)
    print(f"\nwall time {wall_s:.1f} s; {'PASS' if passed else 'FAIL: a goal was missed'}")
    if args.json:
        payload = {
            "benchmark": "training_speed", "torch": torch.__version__, "opacus": opacus.__version__,
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "plan": dataclasses.asdict(plan),
            "goals_spec": {
                "cache_speedup_min": CACHE_SPEEDUP_MIN, "accuracy_tolerance": ACCURACY_TOLERANCE,
                "ghost_time_ratio_max": GHOST_TIME_RATIO_MAX, "ghost_memory_ratio_max": GHOST_MEMORY_RATIO_MAX,
                "ghost_min_batch": GHOST_MIN_BATCH, "resident_speedup_min": RESIDENT_SPEEDUP_MIN,
                "cnn_time_ratio_max": CNN_TIME_RATIO_MAX,
            },
            "devices": [dataclasses.asdict(rep) for rep in reports], "wall_s": wall_s, "passed": passed,
        }  # fmt: skip
        args.json.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
