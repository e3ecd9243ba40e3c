"""The runner: one run of one config, whatever its task, logged to one MLflow run.

    from hydra import compose, initialize_config_module
    from dpsweep.run.runner import train
    with initialize_config_module("dpsweep.conf", version_base="1.3"):
        result = train(compose("config", overrides=["train.epochs=2"]))

It owns what every task shares (``dpsweep.tasks`` owns what differs):

1. before the MLflow run exists, everything that can reject the input: the config ranges, the
   dataset files, the plan (``dpsweep.plan.prepare``: σ, steps, budget, physical batch, hash), a
   checkpoint of another config, and the task's modules (pretrained weights, cache directories), so
   bad input leaves no run behind; a config over ``sweep.max_epsilon`` raises :class:`OverBudget`;
2. the MLflow run (``dpsweep.tracking.tracked_run``): tags, params and ``config.yaml``, reopened on
   resume; it always ends FINISHED, FAILED or KILLED (SIGTERM included);
3. the epoch loop: the task's epoch, its evaluation, ε so far, the run's memory peak, the Optuna
   pruner, and a checkpoint after every epoch (``dpsweep.run.checkpoint``: a resumed run continues from
   the last completed epoch, its accountant restored);
4. the memory stages of the first iteration (``dpsweep.memory.stages``), or only them for a probe;
5. the final ε over the steps actually taken, under every accountant, from the task's ledger, with its
   interval, μ-GDP and attack risk (``dpsweep.run.records.certainty_figures``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import signal
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn
from tqdm.auto import tqdm

from dpsweep import distributed, tasks
from dpsweep.config import (
    Config,
    ConfigError,
    Device,
    TrackingConfig,
    to_config,
    world_size,
)
from dpsweep.data import loaders
from dpsweep.data.facts import DatasetFacts
from dpsweep.mechanisms import engines
from dpsweep.mechanisms.private_step import Attachment
from dpsweep.memory import tables
from dpsweep.memory.stages import MemoryMonitor, StageRecorder, backend_for, monitor_for
from dpsweep.memory.tables import per_rank, to_logged
from dpsweep.plan import MemoryFiles, RunPlan, accounting, mechanism_of, prepare
from dpsweep.privacy import ledger
from dpsweep.privacy.ledger import Ledger
from dpsweep.privacy.streams import Streams
from dpsweep.process.shutdown import Terminated
from dpsweep.run import checkpoint, divergence, records, reporting, seeds
from dpsweep.run.attached import Attached
from dpsweep.tracking import (
    PRIVACY_LEDGER,
    TERMINATED,
    Claim,
    RunEnded,
    SilentTracker,
    Tracker,
    close_dead_of_config,
    credentials,
    open_store,
    run_finished,
    system_metrics,
    terminate_as_interrupt,
    tracked_run,
)


class OverBudget(Exception):
    """A config whose planned ε exceeds ``sweep.max_epsilon``; ``dpsweep -m`` skips it."""


@dataclass
class TrainResult:
    run_id: str
    test_accuracy: float  # after the last epoch (nan for a task scored otherwise)
    train_loss: float  # mean over the last epoch's examples (nan for a task without it)
    n_train: int  # N
    steps: int  # optimizer steps actually taken
    epsilon: float | None = None  # final ε under dp.accountant; None without DP
    epsilons: dict[str, float] = field(default_factory=dict)  # final ε by accountant: rdp, prv, pld
    delta: float | None = None
    epsilon_lower: float | None = None  # a sound lower end of ε: the true ε is in [this, epsilons["pld"]]
    mu_gdp: float | None = None  # the run is μ-GDP ...
    gdp_delta_allowance: float | None = None  # ... down to this δ (dpsweep.privacy.certainty.mu_gdp)
    attack_risk: dict[str, float] = field(default_factory=dict)  # tpr_at_1pct, tpr_at_10pct, advantage
    noise_multiplier: float | None = None  # σ used (calibrated when dp.target_epsilon is set)
    sample_rate: float | None = None  # q the accountant used
    accountant_history: list[tuple[float, float, int]] = field(default_factory=list)  # DP-SGD's (σ, q, steps)
    ledger: Ledger = field(default_factory=Ledger)  # every privacy-spending release (dpsweep.privacy.ledger)
    epochs: list[dict[str, float]] = field(default_factory=list)  # per-epoch metrics
    memory_backend: str = ""  # cuda, or the CPU twin cpu-tensors
    model: nn.Module | None = None  # the trained module, without any DP wrapper (None for a probe)
    objective: str = "test_accuracy"  # the task's objective (dpsweep.config.TaskConfig.objective) ...
    score: float = math.nan  # ... and its value after the last epoch
    diverged: str | None = None  # why the run diverged (dpsweep.run.divergence); None: it did not


def resolve_device(requested: Device) -> torch.device:
    if requested == Device.auto:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested == Device.cuda and not torch.cuda.is_available():
        raise ConfigError("train.device", requested.value, "cpu or auto: no CUDA device is available here")
    return torch.device(requested.value)


def train(cfg: DictConfig | Config, attach: Sequence[Attachment] = ()) -> TrainResult:
    """Train one config and log it to MLflow; returns the final metrics and privacy cost. ``attach``: what
    is attached to the private run before it trains, through its private step
    (:mod:`dpsweep.mechanisms.private_step`), ahead of the audit ``audit.mode`` asks for (which then sees it)."""
    start = _start(cfg)
    monitor = monitor_for(start.device)  # baseline before the model exists
    try:
        return _tracked(start, monitor, attach)
    finally:
        monitor.close()  # the CPU twin's frozen baseline (dpsweep.memory.stages)
        if start.ranks.distributed:
            distributed.leave()


def check_launch(cfg: DictConfig | Config) -> str:
    """What the ``dpsweep`` command checks before it starts a run's ranks (``train.devices`` > 1): the
    config, the devices this machine has, the dataset, the plan and the store, as a run would; bad
    input raises before any rank starts. Returns the run's config hash (tag ``config.hash``)."""
    config, device = _checked_config(cfg)
    return _planned(config, device)[1].config_hash


def _checked_config(cfg: DictConfig | Config) -> tuple[Config, torch.device]:
    """The config checked (its ranges, and what its task, mechanism and engine declare: before any data is
    read, as every entry point checks it), and its device, with as many of them as ``train.devices`` asks for."""
    config = to_config(cfg)
    engines.checked(config)
    credentials.clean_stores(config)  # no param, tag or artifact of the run holds a store's secret
    device = resolve_device(config.train.device)
    devices = config.train.devices
    if devices > 1 and devices > (have := distributed.visible_devices(device.type)):
        cpu = "gloo ranks on the CPU (4 a core: more would only share the cores thinner)"
        where = "CUDA devices visible" if device.type == "cuda" else cpu
        raise ConfigError("train.devices", devices, f"at most the {have} {where}")
    return config, device


def _planned(config: Config, device: torch.device) -> tuple[loaders.DataSplits, RunPlan]:
    """The dataset and the plan (OverBudget over ``sweep.max_epsilon``); the tracking store opened."""
    data = loaders.build(config.dataset)
    facts = DatasetFacts(data.n_train, data.input_shape, data.num_classes)
    plan = prepare(config, facts, MemoryFiles().budget(config, backend_for(device)))
    if plan.over_budget is not None:
        raise OverBudget(plan.over_budget)
    open_store(config.tracking.uri)  # a store that is not one, or cannot be written, is bad input here
    return data, plan


def _ranks_of(config: Config) -> distributed.Ranks:
    """This process's rank, where ``train.devices`` ranks were started for it (by the dpsweep command)."""
    ranks, devices = distributed.current(), config.train.devices
    if ranks.world_size != world_size(config.train):
        raise ConfigError("train.devices", devices, f"{ranks.world_size} here: a run across devices is started by "
                          "the dpsweep command (its ranks under torchrun, or Slurm tasks)")  # fmt: skip
    return ranks


@dataclass
class _Start:
    """What a run settles before its MLflow run exists: the checked config, device, data and plan, and
    the checkpoint to resume from (``resume``; None: start afresh)."""

    config: Config
    device: torch.device
    data: loaders.DataSplits
    plan: RunPlan
    ckpt_dir: Path | None
    found: checkpoint.Found
    resume: checkpoint.TrainingState | None
    streams: Streams
    ranks: distributed.Ranks = field(default_factory=distributed.Ranks)


def _start(cfg: DictConfig | Config) -> _Start:
    """Everything that can reject the input, before any MLflow run: the config, the dataset, the plan
    (OverBudget over ``sweep.max_epsilon``), the tracking store, and a stale checkpoint removed. A rank
    of a run across devices joins its process group; rank 0 reads the run's one checkpoint for all."""
    config, device = _checked_config(cfg)
    ranks = _ranks_of(config)
    seeds.seed_everything(config.train.seed)  # public: the initial model, alike on every rank
    if ranks.distributed:
        device = distributed.join(ranks, device.type)
    data, plan = _planned(config, device)
    ckpt_dir = Path(config.train.checkpoint_dir) if config.train.checkpoint_dir and not config.train.probe else None
    found = _found(config, plan, ckpt_dir) if ranks.leader else None
    if ranks.distributed:  # one checkpoint a run, rank 0's, holding every rank's generators: read once
        found = distributed.from_leader(found)
    assert found is not None
    if ranks.leader and not config.train.probe:  # this config's runs left RUNNING by a killed process: KILLED
        t, resumed = config.tracking, found.state.run_id if found.state is not None else ""
        close_dead_of_config(t.uri, t.experiment_name, plan.config_hash, keep=resumed)
    streams = seeds.streams_of(config, plan, found.state, ranks)
    return _Start(config, device, data, plan, ckpt_dir, found, found.state, streams, ranks)


def _found(config: Config, plan: RunPlan, ckpt_dir: Path | None) -> checkpoint.Found:
    """The checkpoint to resume from, if any (one of another config, unreadable, or whose counters are out of
    its plan's range is set aside)."""
    found = checkpoint.peek(ckpt_dir, plan.config_hash, plan) if ckpt_dir else checkpoint.Found(None)
    if ckpt_dir is not None and found.state is not None and run_finished(config.tracking.uri, found.state.run_id):
        # stale: its run FINISHED (and died before removing it, or another process finished it): start
        # afresh; a sweep job's claim then finds the run done
        checkpoint.remove(ckpt_dir)
        return dataclasses.replace(found, state=None)
    return found


@contextlib.contextmanager
def _rank_run(
    start: _Start, tracking: TrackingConfig, tags: Mapping[str, Any], claim: Claim | None
) -> Iterator[Tracker]:
    """The run's MLflow run: begun (or reopened) and ended by rank 0 (:func:`dpsweep.tracking.tracked_run`),
    its id passed to the other ranks, which log nothing (:class:`dpsweep.tracking.SilentTracker`)."""
    resume_id = start.resume.run_id if start.resume else None
    if not start.ranks.distributed:
        with tracked_run(tracking, tags, resume_id, claim) as run:
            yield run
    elif start.ranks.leader:
        with contextlib.ExitStack() as stack:
            try:
                run = stack.enter_context(tracked_run(tracking, tags, resume_id, claim))
            except Exception as err:  # e.g. Claimed: the other ranks, waiting for the run's id, raise it too
                distributed.from_leader(err)
                raise
            distributed.from_leader(run.run_id)
            yield run
    else:
        shared: str | Exception = distributed.from_leader(None)
        if isinstance(shared, Exception):
            raise shared
        yield SilentTracker(tracking.uri, shared)


def _tracked(start: _Start, monitor: MemoryMonitor, attach: Sequence[Attachment] = ()) -> TrainResult:
    """The task built, then its MLflow run (new or resumed): the first iteration's memory stages, and
    a probe's end or the whole training; the checkpoint is removed once the run is complete."""
    config, plan, data, resume, ckpt_dir = start.config, start.plan, start.data, start.resume, start.ckpt_dir
    inputs = tasks.RunInputs(config, plan, data, start.device, start.streams, start.ranks)
    task_run = tasks.get(config.task.name).build(inputs)
    attached = Attached.of(inputs, task_run, attach)  # the audit, attached once, before training
    tags = records.run_tags(plan, data, start.device, monitor.backend) | task_run.tags() | attached.tags()
    if start.found.set_aside is not None:  # the run starts afresh; the file is kept for inspection
        tags["checkpoint.set_aside"] = str(start.found.set_aside)
        log.warning("checkpoint set aside as %s (unreadable, of another config, or out of range): starting afresh",
                    start.found.set_aside)  # fmt: skip
    claim = _claim(config, plan)
    with (
        terminate_as_interrupt(),
        _rank_run(start, records.named(config, plan), tags, claim) as run,
    ):
        if resume is None:
            records.log_config(config, plan, data, run)
        attached.before_start()
        parts = task_run.start(run)
        attached.after_start()
        if resume is None:
            run.log_params(task_run.params())
        result = TrainResult(run.run_id, float("nan"), float("nan"), data.n_train, 0, memory_backend=monitor.backend)
        state = None
        if ckpt_dir is not None and resume is not None:
            state = checkpoint.load(ckpt_dir, plan.config_hash, parts.model, parts.optimizer, parts.engine)
            # its steps and the ledger it restored must be the plan's: else set aside, and this run fails
            checkpoint.check_resumed(ckpt_dir, plan, state, task_run.privacy_ledger(), start.ranks.leader)
        # a resumed run's stages were recorded before it was interrupted
        stages = StageLog(StageRecorder(monitor, active=state is None), run, result, start.ranks)
        if state is not None:  # a rank of a run across devices: its own generators, of the run's one checkpoint
            rng = state.rng["ranks"][start.ranks.rank] if start.ranks.distributed else state.rng
            checkpoint.restore_rng(rng, parts.generator)
            result.epochs, result.steps, stages.recorder.run_peak = state.epochs, state.steps, state.run_peak_bytes
        stages.mark("model_load")
        if config.train.probe:
            result.epochs.append(_probe(task_run, stages))
            return result
        ckpts = Checkpoints(ckpt_dir, plan.config_hash, state, start.streams, start.ranks, attached)
        _train_all(config, plan, task_run, stages, parts, ckpts, n_test=len(data.test))  # type: ignore[arg-type]
    if ckpt_dir is not None and start.ranks.leader:
        checkpoint.remove(ckpt_dir)  # the run is complete; a rerun starts afresh
    return result


def _train_all(
    config: Config,
    plan: RunPlan,
    task_run: tasks.TaskRun,
    stages: StageLog,
    parts: tasks.Checkpointed,
    ckpt: Checkpoints,
    n_test: int,
) -> None:
    """A training run after its model is loaded: the DP stages of exactly B, the epochs (with system
    metrics), the final ε, whether it diverged, and the trained model kept in the result and logged."""
    result, run = stages.result, stages.run
    if config.dp.enabled and task_run.private_stages:  # sizes of private data: nothing outside the ledger
        stages.logged = True
    elif config.dp.enabled and stages.recorder.active:  # stages of exactly B, not of a private Poisson batch
        task_run.memory_iteration(stages)
        stages.log_first_iteration()
    t = config.tracking
    private = config.dp.enabled  # GPU memory would tell the Poisson batch sizes, as the peak would
    sampled = system_metrics(run.run_id, t.uri, t.system_metrics_after_s, t.system_metrics_interval_s, private)
    with sampled if run.writes else contextlib.nullcontext():  # rank 0's machine only
        _epochs(config, task_run, stages, parts, ckpt)
    if ckpt.attached is not None:  # what the final epoch's results decided (the sampling check's tags)
        ckpt.attached.finish(run)
    _finish_privacy(config, plan, task_run, result, run)
    result.model = task_run.trained_model()
    chance = 1 / plan.facts.num_classes if config.task.at_chance_is_failure else None
    finite = divergence.weights_finite(result.model.parameters())
    result.diverged = divergence.why_diverged(result.epochs, config.task.objective, chance, n_test, finite,
                                              private=config.dp.enabled)  # fmt: skip
    if result.diverged is not None:
        run.set_tags({divergence.DIVERGED_TAG: "true", divergence.REASON_TAG: result.diverged})
    if config.tracking.log_model:
        reporting.log_model(config, task_run, run)


class StageLog:
    """The memory stages of the first iteration, logged once complete; counts the optimizer steps."""

    def __init__(self, recorder: StageRecorder, run: Tracker, result: TrainResult, ranks: distributed.Ranks) -> None:
        self.recorder, self.run, self.result, self.ranks = recorder, run, result, ranks
        self.logged = not recorder.active  # a resumed run logged its stages before

    def mark(self, stage: str) -> None:
        self.recorder.mark(stage)

    def stepped(self) -> None:
        self.result.steps += 1
        self.log_first_iteration()

    def log_first_iteration(self) -> None:
        """Log the four stages once, after the first optimizer step."""
        if not self.logged:
            self.recorder.mark("optimizer_step")  # if the task did not mark it right after the step
            stages = self.recorder.metrics()
            if self.ranks.distributed:  # each rank's stages (its share of B), apart from one process's at B
                every = enumerate(distributed.gathered(stages))  # that memory models are fitted to
                stages = {per_rank(k, r): v for r, mine in every for k, v in mine.items()}
            self.run.log_metrics(stages, step=0)
            self.logged = True


def _claim(cfg: Config, plan: RunPlan) -> Claim | None:
    """A grid sweep's job claims its config, so that of two identical sweeps started together only one
    trains it; not a single run, a forced re-run, a probe, or an Optuna trial (its study decides)."""
    s = cfg.sweep
    if s.id is None or s.force or s.trial is not None or cfg.train.probe:
        return None
    return Claim(plan.config_hash, owner=s.id)  # a requeued job of this sweep is the same owner


@dataclass
class Checkpoints:
    directory: Path | None
    config_hash: str
    restored: checkpoint.TrainingState | None
    streams: Streams
    ranks: distributed.Ranks = field(default_factory=distributed.Ranks)
    attached: Attached | None = None  # what is attached to the run (its audit): told of each epoch


def _epochs(
    cfg: Config, task_run: tasks.TaskRun, stages: StageLog, parts: tasks.Checkpointed, ckpt: Checkpoints
) -> None:
    """The epoch loop: train, evaluate, ε so far, prune, checkpoint."""
    result, run = stages.result, stages.run
    reporter = None
    if cfg.sweep.prunes:
        from dpsweep.run.pruning import TrialReporter  # optuna: only in a pruned study's jobs

        reporter = TrialReporter(cfg.sweep)
    first = ckpt.restored.epoch + 1 if ckpt.restored is not None else 1
    show = None if cfg.train.progress and run.writes else True  # one bar a run: rank 0's
    bar = tqdm(range(first, cfg.train.epochs + 1), desc="epochs", disable=show, file=sys.stderr)
    for epoch in bar:
        if TERMINATED.is_set():  # a SIGTERM whose exception was ignored where it landed (a weakref callback)
            raise Terminated(signal.SIGTERM)
        started = time.monotonic()
        metrics, final = _epoch(cfg, task_run, stages, parts, ckpt.attached or Attached(task_run, ()), epoch)
        if not cfg.dp.enabled:  # with DP the peak of the Poisson batches would tell their (private) sizes
            metrics[tables.metric("peak_bytes")] = to_logged(stages.recorder.observe())  # in MiB
        if cfg.dp.enabled:  # ε so far, from the same ledger and accountant as the final ε (before the
            how = accounting(cfg.dp)  # last epoch, PLD on its coarser interval: an upper bound, 7x faster)
            spent = ledger.epsilon(task_run.privacy_ledger(), cfg.dp.delta, how if final else ledger.coarse(how))
            metrics["epsilon"] = spent.epsilon
        # With DP, statistics of the private examples that no mechanism noised (the training loss) are
        # kept in this process (TrainResult) but never logged or printed: no accountant covers them.
        private = set(task_run.private_metrics) if cfg.dp.enabled else set()
        released = {k: v for k, v in metrics.items() if k not in private}
        run.log_metrics(released, step=epoch)
        result.epochs.append({"epoch": float(epoch), **metrics})
        if run.writes:  # one line an epoch: rank 0's
            reporting.report_epoch(f"epoch {epoch}/{cfg.train.epochs}", released, time.monotonic() - started, bar)
        objective = cfg.task.objective
        if reporter is not None and objective in metrics and reporter.should_prune(epoch, metrics[objective]):
            raise RunEnded(
                f"pruned by the {cfg.sweep.pruner} pruner after epoch {epoch}",
                status="KILLED",
                tags={"optuna.pruned": "true", "failure.kind": "pruned"},
            )
        if ckpt.directory is not None:
            rng = checkpoint.capture_rng(parts.generator)
            seeds.keep_entropy(rng, ckpt.streams)
            if ckpt.ranks.distributed:  # one checkpoint a run: the model, optimizer and accountant are alike on
                rng = {"ranks": distributed.gathered(rng)}  # every rank; rank 0 writes them, with every rank's RNG
            saved = checkpoint.TrainingState(
                ckpt.config_hash, run.run_id, epoch, result.steps, result.epochs, stages.recorder.run_peak, rng
            )
            if ckpt.ranks.leader:
                checkpoint.save(ckpt.directory, saved, parts.model, parts.optimizer, parts.engine)
        if final:
            break
    last = result.epochs[-1]
    result.test_accuracy, result.train_loss = last.get("test_accuracy", math.nan), last.get("train_loss", math.nan)
    result.objective = cfg.task.objective
    result.score = last.get(result.objective, math.nan)


def _epoch(
    cfg: Config, task_run: tasks.TaskRun, stages: StageLog, parts: tasks.Checkpointed, attached: Attached, epoch: int
) -> tuple[dict[str, float], bool]:
    """One epoch trained (what is attached to the run told before and after it) and evaluated, and whether
    it is the final one; after the final one, what is attached adds its metrics (the audit's bounds)."""
    attached.begin_epoch(parts.optimizer)
    metrics = task_run.train_epoch(epoch, stages)
    attached.end_epoch(parts.optimizer)
    final = epoch == cfg.train.epochs or task_run.done()  # done: e.g. a budget spent before the last epoch
    if final or epoch % cfg.train.eval_every == 0:
        metrics = task_run.evaluate(epoch, final) | metrics
    if final:
        metrics |= attached.result(task_run)
    return metrics, final


def _probe(task_run: tasks.TaskRun, stages: StageLog) -> dict[str, float]:
    """Memory probe: one iteration, the four stages and the peak; no evaluation, no ε."""
    measured = task_run.probe(stages) | {tables.metric("peak_bytes"): to_logged(stages.recorder.observe())}
    stages.run.log_metrics(measured, step=0)  # the stages were logged by stages.stepped()
    return stages.recorder.metrics() | measured


log = logging.getLogger("dpsweep")


def _finish_privacy(cfg: Config, plan: RunPlan, task_run: tasks.TaskRun, result: TrainResult, run: Tracker) -> None:
    """Final ε of the task's ledger over the releases and steps actually made, under every
    accountant, with its interval, μ-GDP and attack risk (computed once, by rank 0: the whole ledger, a
    resumed run's included), and the ledger itself as the ``privacy_ledger.json`` artifact."""
    if plan.privacy is None:
        return
    bill = task_run.privacy_ledger()
    how = accounting(cfg.dp)
    delta = cfg.dp.delta
    result.ledger = bill
    result.accountant_history = bill.dpsgd_segments()
    result.epsilons = ledger.epsilons(bill, delta, how.orders)
    result.epsilon = result.epsilons[cfg.dp.accountant.value]
    result.delta, result.noise_multiplier = delta, plan.privacy.noise_multiplier
    result.sample_rate = plan.privacy.sample_rate
    figures = records.certainty_figures(bill, delta) if run.writes and "pld" in result.epsilons else {}
    if figures:
        result.epsilon_lower, result.mu_gdp = figures["epsilon_lower"], figures["mu_gdp"]
        result.gdp_delta_allowance = figures["gdp_delta_allowance"]
        result.attack_risk = records.attack_risk_of(figures)
        run.set_tags({"epsilon_interval.accountant": records.INTERVAL_ACCOUNTANT})
    run.log_metrics({f"epsilon_{name}": eps for name, eps in result.epsilons.items()} | figures, step=cfg.train.epochs)
    unit, neighbours = cfg.dp.unit.value, mechanism_of(cfg).neighbours
    record = ledger.to_json(bill, delta, how, result.epsilons, unit=unit, neighbours=neighbours)
    if figures:
        record["certainty"] = records.certainty_record(figures, result.epsilons["pld"])
    run.log_text(json.dumps(record, indent=2), PRIVACY_LEDGER)
    run.set_tags({
        "dp.steps": result.steps, "dp.sample_rate": result.sample_rate, "dp.conversion": how.conversion,
        "dp.unit": unit, "dp.neighbours": neighbours, "dp.events": len(bill.entries),
        "dp.mechanism": cfg.dp.mechanism,
    })  # fmt: skip
