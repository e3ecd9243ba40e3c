"""Training: one DP-SGD (or non-private baseline) run of one config, logged to one MLflow run.

    dpsweep                                          # one run on the defaults (digits, cnn, DP-SGD)
    dpsweep dp.noise_multiplier=1.3 train.epochs=5   # one run with overrides
    dpsweep -m experiment=demo                       # the README's demo sweep (4 runs)

From Python, without the CLI::

    from hydra import compose, initialize_config_module
    from dpsweep.train import train
    with initialize_config_module("dpsweep.conf", version_base="1.3"):
        result = train(compose("config", overrides=["train.epochs=2"]))

Order of work: every check that can reject the input (config ranges, dataset files, N-dependent
ranges, pretrained weights, σ calibration) runs before the MLflow run is created, so bad input
leaves no run behind. Once the run exists, it always ends FINISHED, FAILED or KILLED.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hydra
import numpy as np
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from opacus import PrivacyEngine
from opacus.grad_sample.gsm_exp_weights import GradSampleModuleExpandedWeights
from opacus.optimizers import DPOptimizer
from opacus.utils.batch_memory_manager import BatchMemoryManager
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset
from tqdm.auto import tqdm

from dpsweep import checkpoint, device_data, feature_cache, memory, privacy
from dpsweep import data as datasets
from dpsweep import models as model_zoo
from dpsweep.config import (
    AdamConfig,
    Config,
    ConfigError,
    Device,
    DPConfig,
    GradSampleMode,
    OptimizerConfig,
    SGDConfig,
    flatten,
    identity,
    register_hydra_plugins,
    to_config,
    validate,
    validate_for_dataset,
)
from dpsweep.data import DatasetNotFoundError
from dpsweep.models import PretrainedWeightsError
from dpsweep.plan import OverBudget, check_budget, resolve_noise
from dpsweep.registry import Registry, UnknownNameError
from dpsweep.search import TrialReporter
from dpsweep.tracking import RunEnded, Tracker, environment_tags, terminate_as_interrupt, tracked_run

log = logging.getLogger("dpsweep")

# Known, understood warnings: secure_mode is off (recorded as the tag dp.secure_mode), and Opacus's
# backward hooks fire on modules whose inputs need no gradient (the images).
warnings.filterwarnings("ignore", message="Secure RNG turned off")
warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed")

# Errors that mean "the input is wrong": reported in one line, exit code 2.
INPUT_ERRORS = (ConfigError, UnknownNameError, DatasetNotFoundError, PretrainedWeightsError)

EXTRACT_BATCH_SIZE = 64  # images per forward pass of the frozen backbone when the feature cache is built

OptimizerFactory = Callable[[Any, Iterable[nn.Parameter]], torch.optim.Optimizer]
OPTIMIZERS: Registry[OptimizerFactory] = Registry("optimizer")


@OPTIMIZERS.register("sgd")
def _sgd(cfg: SGDConfig, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


@OPTIMIZERS.register("adam")
def _adam(cfg: AdamConfig, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    b1, b2 = cfg.betas
    return torch.optim.Adam(params, lr=cfg.lr, betas=(b1, b2), weight_decay=cfg.weight_decay)


def build_optimizer(cfg: OptimizerConfig, model: nn.Module) -> torch.optim.Optimizer:
    trainable = [p for p in model.parameters() if p.requires_grad]
    return OPTIMIZERS.get(cfg.name, key="optimizer.name")(cfg, trainable)


@dataclass
class TrainResult:
    run_id: str
    test_accuracy: float  # after the last epoch
    train_loss: float  # mean over the last epoch's examples
    n_train: int  # N
    steps: int  # optimizer steps actually taken
    epsilon: float | None = None  # final ε under dp.accountant; None without DP
    epsilons: dict[str, float] = field(default_factory=dict)  # final ε by accountant: rdp, prv
    delta: float | None = None
    noise_multiplier: float | None = None  # σ used (calibrated when dp.target_epsilon is set)
    sample_rate: float | None = None  # q the accountant used
    accountant_history: list[tuple[float, float, int]] = field(default_factory=list)
    epochs: list[dict[str, float]] = field(default_factory=list)  # per-epoch metrics


def resolve_device(requested: Device) -> torch.device:
    if requested == Device.auto:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested == Device.cuda and not torch.cuda.is_available():
        raise ConfigError("train.device", requested.value, "cpu or auto: no CUDA device is available here")
    return torch.device(requested.value)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def run_name(cfg: Config, sigma: float | None) -> str:
    """A readable MLflow run name, e.g. ``digits-cnn-σ1.1-C1-B64-e10-s0`` (``nodp`` without DP)."""
    privacy_part = f"σ{sigma:.3g}-C{cfg.dp.max_grad_norm:g}" if sigma is not None else "nodp"
    t = cfg.train
    name = f"{cfg.dataset.name}-{cfg.model.name}-{privacy_part}-B{t.batch_size}-e{t.epochs}-s{t.seed}"
    return name if cfg.sweep.trial is None else f"trial{cfg.sweep.trial}-{name}"


def sweep_tags(cfg: Config) -> dict[str, Any]:
    """Tags that place a run in its sweep: the sweep id, the parent run (so MLflow shows a tree),
    and the Optuna study and trial."""
    s = cfg.sweep
    tags = {
        "sweep.id": s.id,
        "mlflow.parentRunId": s.parent_run_id,
        "optuna.study": s.study,
        "optuna.trial": s.trial,
    }
    return {k: v for k, v in tags.items() if v is not None}


def run_params(cfg: Config, noise_multiplier: float | None) -> dict[str, Any]:
    """MLflow params: the flattened resolved config. Without DP only ``dp.enabled`` is kept,
    since σ, C, δ and the accountant have no effect on a non-private run."""
    params = flatten(cfg)
    if not cfg.dp.enabled:
        params = {k: v for k, v in params.items() if not k.startswith("dp.") or k == "dp.enabled"}
    else:
        params["dp.noise_multiplier"] = noise_multiplier
    return params


def train(cfg: DictConfig | Config) -> TrainResult:
    """Train one config and log it to MLflow; returns the final metrics and privacy cost."""
    config = to_config(cfg)
    validate(config)
    seed_everything(config.train.seed)
    device = resolve_device(config.train.device)
    data = datasets.build(config.dataset)
    validate_for_dataset(config, data.n_train)
    sigma = resolve_noise(config, data.n_train)
    if not config.train.probe:  # a probe takes one step and reports no ε: no budget applies
        check_budget(config, data.n_train, sigma)
    run_hash = checkpoint.config_hash(identity(flatten(config)))
    ckpt_dir = Path(config.train.checkpoint_dir) if config.train.checkpoint_dir else None
    resume = checkpoint.peek(ckpt_dir, run_hash) if ckpt_dir and not config.train.probe else None
    facts = datasets.DatasetFacts(data.n_train, data.input_shape, data.num_classes)
    physical = physical_batch_size(config, facts, memory.backend_for(device))
    if getattr(config.model, "feature_cache", False):
        _check_writable(Path(config.model.feature_cache_dir), "model.feature_cache_dir")
    monitor = memory.monitor_for(device)  # baseline before the model exists
    model = model_zoo.build(config.model, data.input_shape, data.num_classes)

    tags: dict[str, Any] = {
        **environment_tags(device),
        "memory.backend": monitor.backend,
        "dataset.n_train": data.n_train,
        "dataset.n_test": len(data.test),  # type: ignore[arg-type]
        "model.trainable_params": model_zoo.trainable_parameters(model),
        "dataset.input_shape": "x".join(map(str, data.input_shape)),  # C x H x W of one example
        "dp.enabled": config.dp.enabled,
        "config.hash": run_hash,
    }
    if config.train.probe:
        tags["probe"] = "true"
    if physical is not None:
        tags["train.physical_batch_size_used"] = physical
    tags |= sweep_tags(config)
    if config.dp.enabled:
        tags |= {
            "dp.delta": config.dp.delta,
            "dp.accountant": config.dp.accountant.value,
            "dp.secure_mode": False,
            "dp.grad_sample_mode": config.dp.grad_sample_mode.value,
        }
        if config.dp.target_epsilon is not None:
            tags["dp.noise_multiplier_calibrated"] = sigma
    resume_id = resume.run_id if resume else None
    tracking = config.tracking
    if tracking.run_name is None:  # MLflow's random names repeat here: seeding resets Python's RNG
        prefix = "probe-" if config.train.probe else ""
        tracking = dataclasses.replace(tracking, run_name=prefix + run_name(config, sigma))
    with terminate_as_interrupt(), tracked_run(tracking, tags, resume_run_id=resume_id) as run:
        if resume is None:
            run.log_params(run_params(config, sigma))
            resolved = OmegaConf.structured(config)
            if sigma is not None:
                resolved.dp.noise_multiplier = sigma
            run.log_text(OmegaConf.to_yaml(resolved), "config.yaml")
        else:
            log.info(f"resuming run {resume.run_id} after epoch {resume.epoch} from {ckpt_dir}")
        trained, splits = model, data
        if isinstance(model, model_zoo.FrozenVGG16) and getattr(config.model, "feature_cache", False):
            trained, splits = _cached_features(config, model, data, device, run)
            del model  # the backbone is not needed on any device from here on
        result = _fit(config, splits, trained, device, sigma, monitor, run, ckpt_dir, run_hash, physical)
    if ckpt_dir is not None and not config.train.probe:
        checkpoint.remove(ckpt_dir)  # the run is complete; a rerun starts afresh
    if config.train.probe:
        _print_probe(config, result, monitor.backend)
    else:
        _print_summary(config, result)
    return result


def _check_writable(directory: Path, key: str) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(key, str(directory), f"a directory dpsweep can create and write ({err})") from err
    if not os.access(directory, os.W_OK):
        raise ConfigError(key, str(directory), "a directory dpsweep can write (permission denied)")


def _cached_features(
    cfg: Config, model: model_zoo.FrozenVGG16, data: datasets.DataSplits, device: torch.device, run: Tracker
) -> tuple[nn.Module, datasets.DataSplits]:
    """The frozen features of both splits from the cache (built on ``device`` when missing), and the
    module to train on them: the pool and head (see dpsweep.feature_cache). N is unchanged."""
    cached = feature_cache.cached_splits(
        model, data, dataclasses.asdict(cfg.dataset), root=Path(cfg.model.feature_cache_dir),
        batch_size=EXTRACT_BATCH_SIZE, device=device,
    )  # fmt: skip
    run.set_tags({
        "feature_cache.train": cached.status["train"], "feature_cache.test": cached.status["test"],
        "feature_cache.key": cached.keys["train"], "feature_cache.map_shape": "x".join(map(str, cached.map_shape)),
    })  # fmt: skip
    splits = datasets.DataSplits(cached.train, cached.test, cached.num_classes, data.input_shape)
    return cached.head(model), splits


def physical_batch_size(cfg: Config, facts: datasets.DatasetFacts, backend: str) -> int | None:
    """Examples per forward/backward pass: ``train.physical_batch_size``, else the largest pass the
    memory model (``train.memory_model``) predicts to fit ``launcher.gpu_memory``, else None (the
    whole logical batch). Raises ConfigError when not even one example is predicted to fit."""
    t = cfg.train
    if t.physical_batch_size is not None or t.probe:
        return t.physical_batch_size
    if t.memory_model is None or cfg.launcher.gpu_memory is None:
        return None
    from dpsweep.analysis import memory_model, memory_predict  # pandas and scipy: only when used

    try:
        fitted = memory_predict.model_for(memory_model.load_models(t.memory_model), memory.model_key(cfg), backend)
        largest = memory_predict.chosen_physical_batch(fitted, cfg, facts)
    except memory_model.MemoryModelError as err:
        raise ConfigError("train.memory_model", t.memory_model, str(err)) from err
    if largest is None:
        raise ConfigError(
            "launcher.gpu_memory",
            cfg.launcher.gpu_memory,
            f"room for at least one example: {t.memory_model} predicts more for a pass of 1 example",
        )
    return largest  # BatchMemoryManager caps every pass, Poisson batches larger than B included


def make_private(
    dp: DPConfig,
    noise_multiplier: float,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loader: DataLoader[Any],
    criterion: nn.Module,
) -> tuple[PrivacyEngine, nn.Module, DPOptimizer, nn.Module, DataLoader[Any]]:
    """Opacus DP-SGD: per-sample clipping to ``dp.max_grad_norm``, Gaussian noise of std σ·C,
    Poisson sampling at rate 1/len(loader), every step recorded by ``dp.accountant``.

    ``dp.grad_sample_mode`` picks how per-sample gradients are obtained; ghost clipping also wraps the
    criterion (its loss runs Opacus's two backward passes), so the criterion to use is returned."""
    engine = PrivacyEngine(accountant=dp.accountant.value)
    made = engine.make_private(
        module=model,
        optimizer=optimizer,
        data_loader=loader,
        noise_multiplier=noise_multiplier,
        max_grad_norm=dp.max_grad_norm,
        poisson_sampling=True,  # the accountants analyse Poisson subsampling
        grad_sample_mode=dp.grad_sample_mode.value,
        criterion=criterion,
    )
    if dp.grad_sample_mode == GradSampleMode.ghost:
        private_model, private_optimizer, criterion, private_loader = made
    else:
        private_model, private_optimizer, private_loader = made
    return engine, private_model, private_optimizer, criterion, private_loader


Batch = tuple[torch.Tensor, torch.Tensor]
Pass = tuple[torch.Tensor, torch.Tensor, bool, bool, float]  # x, y, first, last, weight


@contextmanager
def physical_batches(
    loader: Iterable[Batch], physical_batch_size: int | None, optimizer: torch.optim.Optimizer
) -> Iterator[Iterable[Pass]]:
    """Yield ``(x, y, first, last, weight)`` passes of at most ``physical_batch_size`` examples per logical batch.

    With DP and a DataLoader this is Opacus's BatchMemoryManager: the DPOptimizer clips and
    accumulates each pass and steps (adds noise, accounts one step) only at the end of the logical
    batch, so sampling and accounting are those of the logical batch. Device-resident batches are
    split the same way, signalling the DPOptimizer as Opacus's BatchSplittingSampler does. Without DP
    the loss of each pass is weighted by its share of the examples (``first``: zero the gradients;
    ``last``: step)."""
    if physical_batch_size is None:
        yield ((x, y, True, True, 1.0) for x, y in loader)
    elif isinstance(optimizer, DPOptimizer) and isinstance(loader, DataLoader):
        with BatchMemoryManager(
            data_loader=loader, max_physical_batch_size=physical_batch_size, optimizer=optimizer
        ) as split_loader:
            yield ((x, y, True, True, 1.0) for x, y in split_loader)  # the DPOptimizer skips inner steps
    else:
        yield _split(loader, physical_batch_size, optimizer)


def _split(loader: Iterable[Batch], size: int, optimizer: torch.optim.Optimizer) -> Iterator[Pass]:
    """Passes of at most ``size`` examples of batches that are already tensors. With DP, as Opacus's
    BatchSplittingSampler: every pass but a logical batch's last tells the DPOptimizer to skip its
    step (it only clips and accumulates). Without DP each pass's loss is weighted by its share."""
    for x, y in loader:
        starts = range(0, max(len(y), 1), size)
        for i in starts:
            part, last = y[i : i + size], i == starts[-1]
            if isinstance(optimizer, DPOptimizer):
                optimizer.signal_skip_step(do_skip=not last)
                yield x[i : i + size], part, True, True, 1.0
            else:
                yield x[i : i + size], part, i == 0, last, len(part) / max(len(y), 1)


def _fit(
    cfg: Config,
    data: datasets.DataSplits,
    model: nn.Module,
    device: torch.device,
    sigma: float | None,
    monitor: memory.MemoryMonitor,
    run: Tracker,
    ckpt_dir: Path | None = None,
    run_hash: str = "",
    physical_batch_size: int | None = None,
) -> TrainResult:
    model = model.to(device)
    optimizer = build_optimizer(cfg.optimizer, model)
    generator = torch.Generator().manual_seed(cfg.train.seed)
    loader: DataLoader[Any] = DataLoader(
        data.train, batch_size=cfg.train.batch_size, shuffle=not cfg.dp.enabled, generator=generator
    )
    criterion: nn.Module = nn.CrossEntropyLoss()
    engine: PrivacyEngine | None = None
    if cfg.dp.enabled:
        assert sigma is not None
        engine, model, optimizer, criterion, loader = make_private(cfg.dp, sigma, model, optimizer, loader, criterion)
    result = TrainResult(
        run_id=run.run_id, test_accuracy=float("nan"), train_loss=float("nan"), n_train=data.n_train, steps=0
    )
    if cfg.train.probe:
        return _probe(cfg, data, model, optimizer, criterion, device, monitor, run, generator, result)
    batches: Iterable[Batch] = loader
    test: Dataset[Any] = data.test
    if cfg.train.device_resident:
        batches, generator = _device_batches(cfg, data, loader, device)  # generator: checkpointed below
        test = TensorDataset(*(t.to(device) for t in device_data.materialize(data.test)))  # once per run
    state = checkpoint.load(ckpt_dir, run_hash, model, optimizer, engine) if ckpt_dir else None
    stages = memory.StageRecorder(monitor, active=state is None)  # a resumed run recorded them before
    first_epoch = 1
    if state is not None:
        checkpoint.restore_rng(state.rng, generator)
        result.epochs, result.steps, stages.run_peak = state.epochs, state.steps, state.run_peak_bytes
        first_epoch = state.epoch + 1
    stages.mark("model_load")

    reporter = TrialReporter(cfg.sweep) if TrialReporter.enabled(cfg.sweep) else None
    show = cfg.train.progress
    for epoch in tqdm(
        range(first_epoch, cfg.train.epochs + 1), desc="epochs", disable=None if show else True, file=sys.stderr
    ):
        model.train()
        loss_sum, seen = 0.0, 0
        with physical_batches(batches, physical_batch_size, optimizer) as passes:
            for x, y, first, last, weight in tqdm(
                passes, desc=f"epoch {epoch} steps", leave=False, disable=None if show else True, file=sys.stderr
            ):
                loss, stepped = _train_pass(model, optimizer, criterion, x, y, device, stages, first, last, weight)
                if stepped:
                    result.steps += 1
                    if not stages.complete:
                        stages.mark("optimizer_step")
                        run.log_metrics(stages.metrics(), step=0)
                if len(y):  # a Poisson batch may be empty
                    loss_sum += loss * len(y)
                    seen += len(y)
        optimizer.zero_grad(set_to_none=True)  # gradients and per-sample gradients are not needed now
        plain = getattr(model, "_module", model)  # evaluate without Opacus's per-sample machinery
        metrics = {
            "test_accuracy": evaluate(plain, test, cfg.train.eval_batch_size, device, cfg.train.device_resident),
            "train_loss": loss_sum / max(seen, 1),
            "memory.peak_bytes": float(stages.observe()),
        }
        if engine is not None:
            metrics["epsilon"] = engine.get_epsilon(cfg.dp.delta)
        run.log_metrics(metrics, step=epoch)
        result.epochs.append({"epoch": float(epoch), **metrics})
        if reporter is not None and reporter.should_prune(epoch, metrics["test_accuracy"]):
            raise RunEnded(
                f"pruned by the {cfg.sweep.pruner} pruner after epoch {epoch}",
                status="KILLED",
                tags={"optuna.pruned": "true", "failure.kind": "pruned"},
            )
        if ckpt_dir is not None:
            saved = checkpoint.TrainingState(
                run_hash,
                run.run_id,
                epoch,
                result.steps,
                result.epochs,
                stages.run_peak,
                checkpoint.capture_rng(generator),
            )
            checkpoint.save(ckpt_dir, saved, model, optimizer, engine)

    result.test_accuracy = result.epochs[-1]["test_accuracy"]
    result.train_loss = result.epochs[-1]["train_loss"]
    if engine is not None:
        _finish_privacy(cfg, engine, sigma, result, run)
    return result


def _device_batches(
    cfg: Config, data: datasets.DataSplits, loader: DataLoader[Any], device: torch.device
) -> tuple[Iterable[Batch], torch.Generator]:
    """The training split on the device, batched there: Poisson batches at the sample rate of the
    DP loader Opacus made (so the accountant's q and the steps per epoch are those of the loader),
    or shuffled batches without DP. Returns the batches and their generator (checkpointed)."""
    x, y = device_data.materialize(data.train)
    generator = device_data.device_generator(device, cfg.train.seed)
    if cfg.dp.enabled:
        q = float(loader.sample_rate)  # type: ignore[attr-defined]  # Opacus's DPDataLoader
        return device_data.PoissonBatches(x, y, sample_rate=q, device=device, generator=generator), generator
    size = cfg.train.batch_size
    return device_data.ShuffledBatches(x, y, batch_size=size, device=device, generator=generator), generator


def _train_pass(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    criterion: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    device: torch.device,
    stages: memory.StageRecorder,
    first: bool = True,
    last: bool = True,
    weight: float = 1.0,
) -> tuple[float, bool]:
    """One forward/backward pass; steps the optimizer when ``last``. Returns the mean loss and
    whether a real optimizer step happened (a DPOptimizer skips it inside a logical batch)."""
    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    stages.mark("batch_load")
    if first:
        optimizer.zero_grad(set_to_none=True)
    if len(y) == 0 and isinstance(model, GradSampleModuleExpandedWeights):
        # torch's ExpandedWeights refuse an empty batch; its per-sample gradients are an empty
        # stack, and the step must still add noise and be accounted (Poisson sampling).
        for p in model.parameters():
            if p.requires_grad:
                p.grad_sample = p.new_zeros((0, *p.shape))
        loss = torch.zeros(())
    else:
        loss = criterion(model(x), y)
        (loss * weight if weight != 1.0 else loss).backward()
    stages.mark("backward")
    if not last:
        return float(loss.detach()), False
    optimizer.step()  # with DP: clip per sample, add noise, account for the step
    stepped = not getattr(optimizer, "_is_last_step_skipped", False)
    return float(loss.detach()), stepped


def _probe(
    cfg: Config,
    data: datasets.DataSplits,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    criterion: nn.Module,
    device: torch.device,
    monitor: memory.MemoryMonitor,
    run: Tracker,
    generator: torch.Generator,
    result: TrainResult,
) -> TrainResult:
    """Memory probe: the first iteration only, on exactly ``train.batch_size`` examples (a Poisson
    batch would make the measured batch random), recording the four stages."""
    stages = memory.StageRecorder(monitor)
    stages.mark("model_load")
    pick = torch.randperm(data.n_train, generator=generator)[: cfg.train.batch_size].tolist()
    x, y = next(iter(DataLoader(torch.utils.data.Subset(data.train, pick), batch_size=len(pick))))
    model.train()
    loss, _ = _train_pass(model, optimizer, criterion, x, y, device, stages)
    result.steps = 1
    stages.mark("optimizer_step")
    metrics = stages.metrics() | {"memory.peak_bytes": float(stages.observe()), "probe.loss": loss}
    run.log_metrics(metrics, step=0)
    result.epochs.append(metrics)
    return result


def _finish_privacy(cfg: Config, engine: PrivacyEngine, sigma: float | None, result: TrainResult, run: Tracker) -> None:
    """Final ε over the steps actually taken, under both accountants, from the engine's history."""
    history = [(float(s), float(q), int(n)) for s, q, n in engine.accountant.history]
    delta = cfg.dp.delta
    result.accountant_history = history
    result.epsilons = {name: privacy.epsilon_from_history(history, delta, name)[0] for name in ("rdp", "prv")}
    result.epsilon = result.epsilons[cfg.dp.accountant.value]
    result.delta, result.noise_multiplier = delta, sigma
    result.sample_rate = history[0][1] if history else None
    run.log_metrics({f"epsilon_{name}": eps for name, eps in result.epsilons.items()}, step=cfg.train.epochs)
    run.set_tags({"dp.steps": result.steps, "dp.sample_rate": result.sample_rate, "dp.conversion": "improved"})


@torch.no_grad()
def evaluate(
    model: nn.Module, dataset: Dataset[Any], batch_size: int, device: torch.device, resident: bool = False
) -> float:
    """Top-1 accuracy on ``dataset`` (``resident``: copied to the device once and batched there)."""
    model.eval()
    correct = total = 0
    if resident:
        xs, ys = (t.to(device) for t in device_data.materialize(dataset))
        batches: Iterable[Batch] = (
            (xs[i : i + batch_size], ys[i : i + batch_size]) for i in range(0, len(ys), batch_size)
        )
    else:
        batches = DataLoader(dataset, batch_size=batch_size)
    for x, y in batches:
        pred = model(x.to(device)).argmax(dim=1)
        correct += int((pred == y.to(device)).sum())
        total += len(y)
    return correct / max(total, 1)


def _print_probe(cfg: Config, r: TrainResult, backend: str) -> None:
    m = r.epochs[-1]
    stages = "  ".join(f"{s}={memory.format_bytes(m[f'memory.{s}_bytes'])}" for s in memory.STAGES)
    print(
        f"dpsweep: probe {r.run_id[:8]} {cfg.dataset.name}/{cfg.model.name} B={cfg.train.batch_size} "
        f"dp={cfg.dp.enabled}  {stages}  peak={memory.format_bytes(m['memory.iteration_peak_bytes'])} ({backend})",
        flush=True,
    )


def _print_summary(cfg: Config, r: TrainResult) -> None:
    if cfg.dp.enabled:
        privacy_text = (
            f"ε={r.epsilon:.3f} ({cfg.dp.accountant.value}, δ={cfg.dp.delta:g}; "
            f"rdp {r.epsilons['rdp']:.3f}, prv {r.epsilons['prv']:.3f})  "
            f"σ={r.noise_multiplier:.3g} C={cfg.dp.max_grad_norm:g}"
        )
    else:
        privacy_text = "non-private (no ε)"
    print(
        f"dpsweep: run {r.run_id[:8]} {cfg.dataset.name}/{cfg.model.name} B={cfg.train.batch_size} "
        f"epochs={cfg.train.epochs}  test_accuracy={r.test_accuracy:.4f}  {privacy_text}",
        flush=True,
    )


def _job_overrides() -> str:
    try:
        return " ".join(HydraConfig.get().overrides.task) or "(defaults)"
    except ValueError:  # not running under Hydra
        return "(config)"


register_hydra_plugins()


@hydra.main(version_base="1.3", config_path="pkg://dpsweep.conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    """Console entry point ``dpsweep``; returns the metric a sweeper optimises."""
    hydra_cfg = HydraConfig.get()
    if cfg.train.checkpoint_dir is None:  # the job's own directory: stable when a cluster requeues it
        cfg.train.checkpoint_dir = str(Path(hydra_cfg.runtime.output_dir) / "checkpoint")
    try:
        return train(cfg).test_accuracy
    except OverBudget as why:  # not an error: the sweep goes on without this config
        print(f"dpsweep: skip {_job_overrides()}: {why}", flush=True)
        return None
    except INPUT_ERRORS as err:
        if hydra_cfg.mode == RunMode.MULTIRUN:
            raise  # the sweeper records this job as failed and goes on
        print(f"dpsweep: error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(2) from err


if __name__ == "__main__":
    main()
