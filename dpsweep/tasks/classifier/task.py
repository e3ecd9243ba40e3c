"""``task=classifier``: image classification trained with DP-SGD (or without DP), scored by top-1 test accuracy.

    dpsweep task=classifier model=cnn dp.noise_multiplier=1.1   # task=classifier is the default

One run: the model (``dpsweep.models.classifiers``) on the device, the optimizer
(``dpsweep.models.optimizers``), a loader of logical batches of ``train.batch_size`` (shuffled without
DP; with DP, Opacus's Poisson sampling through ``dpsweep.mechanisms.opacus_engine.make_private``), optionally
held on the device (``train.device_resident``) and split into physical passes
(``dpsweep.mechanisms.batches``). With ``model=vgg16_frozen`` and ``model.feature_cache`` the frozen
features come from ``dpsweep.models.feature_cache`` and only the pool and head are trained on them. The
memory probe runs one iteration on exactly ``train.batch_size`` examples.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import os
import sys
from collections.abc import Iterable, Sized
from pathlib import Path
from typing import Any

import numpy as np
import torch
from opacus import PrivacyEngine
from opacus.data_loader import DPDataLoader
from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP
from opacus.optimizers import DPOptimizer
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset
from tqdm.auto import tqdm

from dpsweep.config import Clipping, ConfigError, population
from dpsweep.data import gathered, loaders, resident, users
from dpsweep.distributed import PoissonAcrossRanks, Ranks
from dpsweep.interop import opacus_private
from dpsweep.mechanisms import engines, functional, opacus_engine
from dpsweep.mechanisms.batches import Batch, physical_batches
from dpsweep.mechanisms.private_step import PrivateStep, Score, TrainingSet
from dpsweep.models import classifiers, feature_cache
from dpsweep.models.optimizers import build_optimizer
from dpsweep.plan import mechanism_of, setting
from dpsweep.privacy import clipping, ledger
from dpsweep.privacy.schedule import poisson_schedule
from dpsweep.privacy.streams import Purpose
from dpsweep.tasks import TASKS, Checkpointed, Marks, RunInputs, Stages
from dpsweep.tasks.classifier.passes import Trainer, evaluate, per_example_grad_norms, train_pass
from dpsweep.tasks.classifier.private import OpacusStep, keep_planned_sampling, minus_loss
from dpsweep.tracking import Tracker

EXTRACT_BATCH_SIZE = 64  # images per forward pass of the frozen backbone when the feature cache is built


class ClassifierTask:
    def build(self, inputs: RunInputs) -> ClassifierRun:
        model_cfg = inputs.cfg.model
        if getattr(model_cfg, "feature_cache", False):
            check_writable(Path(model_cfg.feature_cache_dir), "model.feature_cache_dir")
        model = classifiers.build(model_cfg, inputs.data.input_shape, inputs.data.num_classes)
        return ClassifierRun(inputs, model)


TASKS.register("classifier")(ClassifierTask())


def opacus_step(run: ClassifierRun) -> Checkpointed:
    """dp.engine=opacus's step (``Engine.steps``): Opacus's make_private on the run's loader."""
    return run.start_loader()


def own_step(run: ClassifierRun) -> Checkpointed:
    """The step of an engine whose steps noise their own gradients (own_steps, fused: ``Engine.steps``): its
    rule (:data:`dpsweep.mechanisms.functional.RULES`)."""
    return run.start_own_steps(functional.rule_of(run.cfg))


def check_writable(directory: Path, key: str) -> None:
    """``directory`` exists (or is created) and is writable; ConfigError naming ``key`` otherwise."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(key, str(directory), f"a directory dpsweep can create and write ({err})") from err
    if not os.access(directory, os.W_OK):
        raise ConfigError(key, str(directory), "a directory dpsweep can write (permission denied)")


class ClassifierRun:
    """One classifier run (see :class:`dpsweep.tasks.TaskRun`)."""

    private_metrics = ("train_loss",)  # the mean loss of the Poisson batches: un-noised, not released with DP
    private_stages = False  # measured on exactly B examples (units), a public shape

    def __init__(self, inputs: RunInputs, model: nn.Module) -> None:
        self.inputs = inputs
        self.cfg = inputs.cfg
        self.device = inputs.device
        self.model = model
        self.data = inputs.data
        self.engine: PrivacyEngine | None = None
        self.batches: Iterable[Batch] = ()
        self.test: Dataset[Any] = inputs.data.test
        self.criterion: nn.Module = nn.CrossEntropyLoss()
        self.released: ledger.Entry | None = None  # the private clipping-norm release (dp.clipping=quantile)
        self.max_grad_norm: float | None = None
        self.wrapper: TrainingSet | None = None  # what the training set is replaced by (a black-box audit's)
        self.step: PrivateStep | None = None  # the DP step, as what is attached to the run sees it
        self.own: functional.OwnSteps | None = (
            None  # DP-FTRL and user-level DP (dpsweep.mechanisms.functional): not Opacus
        )
        self.ranks: Ranks = inputs.ranks  # train.devices > 1: this process's share of each step
        pb = inputs.plan.physical_batch_size
        self.physical_batch_size = None if pb is None else pb // self.ranks.world_size  # a pass of this rank

    def tags(self) -> dict[str, Any]:
        return {"model.trainable_params": classifiers.trainable_parameters(self.model)}

    def wrap_training_set(self, wrapper: TrainingSet) -> None:
        self.wrapper = wrapper

    def private_step(self) -> PrivateStep:
        assert self.step is not None, "a DP run, started"
        return self.step

    def example_score(self) -> Score:
        return minus_loss(self.plain_model)

    def start(self, run: Tracker) -> Checkpointed:
        cfg, device = self.cfg, self.device
        if isinstance(self.model, classifiers.FrozenVGG16) and getattr(cfg.model, "feature_cache", False):
            self.model, self.data = _cached_features(self.inputs, self.model, run)  # the backbone is dropped
        self.test = self.data.test
        if self.wrapper is not None:  # e.g. a black-box audit's canaries in and out, before any loader
            self.data = dataclasses.replace(self.data, train=self.wrapper.training_set(self.data.train))
        self.model = self.model.to(device)
        if not cfg.dp.enabled:
            return self.start_loader()
        # each engine says how its step is built (dpsweep.mechanisms.engines.Engine.steps: opacus_step, own_step)
        built: Checkpointed = engines.builder(engines.engine_of(cfg))(self)
        return built

    def start_loader(self) -> Checkpointed:
        """Training from a loader of logical batches: shuffled without DP; with DP, Opacus's make_private (its
        Poisson loader, per-sample gradients by ``dp.grad_sample_mode``, its noise), across ranks through its
        distributed optimizer."""
        cfg, device = self.cfg, self.device
        if self.ranks.distributed:  # Opacus's DDP: rank 0's parameters broadcast; make_private goes distributed
            self.model = DPDDP(self.model)
        self.optimizer = build_optimizer(cfg.optimizer, self.model)
        streams, rank = self.inputs.streams, self.ranks.rank
        public = torch.Generator().manual_seed(cfg.train.seed)  # without DP, the shuffles; with DP, the sampling stream
        generator = (
            resident.private_generator("cpu", streams.seed(Purpose.sampling, rank)) if cfg.dp.enabled else public
        )
        loader = gathered.loader(self.data.train, cfg.train.batch_size, shuffle=not cfg.dp.enabled, generator=generator)
        sigma = self.inputs.plan.noise_multiplier
        generators: torch.Generator | resident.Generators = generator
        if sigma is not None:
            noise = resident.private_generator(device, streams.seed(Purpose.noise, rank))
            self.max_grad_norm = cfg.dp.max_grad_norm
            if cfg.dp.clipping == Clipping.quantile:
                self.max_grad_norm = self._private_clipping_norm()
                if cfg.dp.clip_normalize:  # the step per unit of C (post-processing of the release)
                    for group in self.optimizer.param_groups:
                        group["lr"] = cfg.optimizer.lr / self.max_grad_norm
            made = opacus_engine.make_private(
                cfg.dp, sigma, self.max_grad_norm, self.model, self.optimizer, loader, self.criterion, noise
            )
            self.engine, self.model, self.optimizer, self.criterion, loader = made
            if self.ranks.distributed:  # this rank's share of each step; its sampler's generator is checkpointed
                loader, generator = _across_ranks(loader, self.ranks, cfg.train.seed, generator)
            generators = resident.Generators(sampling=generator, noise=noise)
            if self.wrapper is not None:  # another training set: sampled as the plan's N examples would be
                assert self.engine is not None and isinstance(loader, DPDataLoader)
                schedule = poisson_schedule(self.inputs.plan.facts.n_train, cfg.train.batch_size)
                keep_planned_sampling(
                    self.engine, self.optimizer, loader, schedule.inclusion_probability, schedule.steps_per_epoch
                )
        self.loader, self.generator = loader, generators
        before_step = None
        if sigma is not None:  # the step at the loader's own rate (across ranks: this rank's share's sampler)
            assert isinstance(self.optimizer, DPOptimizer) and self.max_grad_norm is not None
            assert self.engine is not None  # make_private's, above
            sampler: Any = loader.batch_sampler
            rate = lambda: float(sampler.sample_rate)  # noqa: E731
            opacus = OpacusStep(self.optimizer, self.plain_model, self.max_grad_norm, rate, self.engine)
            self.step, before_step = opacus.step, opacus.before_step
        self.trainer = Trainer(self.model, self.optimizer, self.criterion, device, before_step)
        self.batches = loader
        if cfg.train.device_resident and not cfg.train.probe:
            self.batches, generator = _device_batches(self.inputs, self.data, loader)
            self.generator = generator if sigma is None else resident.Generators(sampling=generator, noise=noise)
            self.test = TensorDataset(*(t.to(device) for t in resident.materialize(self.data.test)))  # once
        return Checkpointed(self.model, self.optimizer, self.engine, self.generator)

    def start_own_steps(self, rule: functional.OwnRule) -> Checkpointed:
        """Steps that noise their own gradients (``dpsweep.mechanisms.functional``) by ``rule``: the training
        split on the device, in units; batches and optimizer from the rule."""
        cfg, device = self.cfg, self.device
        sigma = self.inputs.plan.noise_multiplier
        assert sigma is not None  # a DP run
        x, y = resident.materialize(self.data.train)
        n_train, wrapper = self.inputs.plan.facts.n_train, self.wrapper
        unit = functional.unit_ids(cfg, y if wrapper is None else y[:n_train])  # the plan's users
        if wrapper is not None and unit is not None:  # another training set at user level: its own users
            unit = wrapper.units(unit)
        m = cfg.dp.max_examples_per_user if unit is not None else 1
        self.unit_examples = m  # the most examples of one unit in a step: public
        b, priced = cfg.train.batch_size, population(cfg, n_train)  # examples, or users
        # another training set (a black-box audit's), in the plan's batches per epoch (DP-FTRL's ε depends on them)
        batches = -(-priced // b) if wrapper is not None else None
        self.exact = functional.FixedOrderBatches(x, y, unit, b, m, cfg.train.seed, device, batches)
        run = functional.OwnRun(
            cfg, self.model, self.criterion, (x, y, unit), self.exact, sigma, device, self.inputs.streams, priced
        )
        own = rule.setup(run)
        self.optimizer, self.generator = own.optimizer, own.generator
        self.unit_batches: Iterable[users.UserBatch] = own.batches
        self.expected_units = own.expected_units
        self.own = functional.OwnSteps(run, self.optimizer, rule)
        self.max_grad_norm = cfg.dp.max_grad_norm
        self.step = self.own.private_step(own)
        return Checkpointed(self.model, self.optimizer, None, self.generator)

    def _own_epoch(self, epoch: int, stages: Stages) -> dict[str, float]:
        """An epoch of DP-FTRL or user-level DP-SGD; no train_loss (never released with DP: not computed)."""
        assert self.own is not None
        self.model.train()
        for batch in self.unit_batches:
            self.own.step(batch, self.expected_units, stages)
            stages.stepped()
        self.own.end_epoch(epoch)
        return {}

    def _own_exact_step(self, stages: Marks) -> None:
        """One DP step (memory stages, probes) on a batch of a public shape: B units of m examples each
        (m = dp.max_examples_per_user at user level, 1 at example level), the first B·m training rows.
        How many examples the first batch's users hold is private: stages measured on it told two
        user partitions apart (issue 39, item 10)."""
        assert self.own is not None
        x, y, m, b = self.exact.x, self.exact.y, self.unit_examples, self.cfg.train.batch_size
        index = torch.arange(b * m, device=y.device) % len(y)
        segment = torch.arange(b, device=y.device).repeat_interleave(m)
        self.own.step(users.UserBatch(x[index], y[index], segment), self.expected_units, stages)

    def _private_clipping_norm(self) -> float:
        """C for dp.clipping=quantile (``dpsweep.privacy.clipping``): per-example gradient norms at initialisation
        on one Poisson sample at the run's sample rate, then their private quantile."""
        q = self.inputs.plan.privacy.poisson_rate  # type: ignore[union-attr]  # a DP run has a privacy plan
        streams = self.inputs.streams  # the sample and the quantile's noise: streams of their own
        generator = resident.private_generator("cpu", streams.seed(Purpose.clipping, 0))
        n = len(self.data.train)  # type: ignore[arg-type]
        pick = torch.nonzero(torch.rand(n, generator=generator) < q).flatten().tolist()
        norms = per_example_grad_norms(self.model, self.criterion, self.data.train, pick, self.device)
        chosen = clipping.choose(norms, self.cfg.dp, streams.seed(Purpose.clipping, 1))
        self.released = clipping.entry(self.cfg.dp, q, chosen)
        return chosen

    def train_epoch(self, epoch: int, stages: Stages) -> dict[str, float]:
        if self.own is not None:
            return self._own_epoch(epoch, stages)
        self.model.train()
        loss_sum, seen = torch.zeros((), device=self.device), 0  # summed on the device: no wait per step
        show = None if self.cfg.train.progress and self.ranks.leader else True  # one bar a run: rank 0's
        with physical_batches(self.batches, self.physical_batch_size, self.optimizer) as passes:
            split = self.physical_batch_size is not None  # passes per step vary with Poisson batches
            total = None if split or not isinstance(self.batches, Sized) else len(self.batches)
            for x, y, first, last, weight in tqdm(
                passes, desc=f"epoch {epoch} steps", total=total, leave=False, disable=show, file=sys.stderr
            ):
                loss, stepped = train_pass(self.trainer, (x, y), stages, (first, last, weight))
                if stepped:
                    stages.stepped()
                if len(y):  # a Poisson batch may be empty
                    loss_sum += loss * len(y)
                    seen += len(y)
        self.optimizer.zero_grad(set_to_none=True)  # gradients and per-sample gradients are not needed now
        metrics = {"train_loss": float(loss_sum) / max(seen, 1)}
        if self.cfg.dp.enabled and self.cfg.dp.clipping == Clipping.adaptive:
            optimizer: DPOptimizer = self.optimizer
            metrics["max_grad_norm"] = float(optimizer.max_grad_norm)  # C after the epoch's last step
        return metrics

    def evaluate(self, epoch: int, final: bool) -> dict[str, float]:
        plain = self.plain_model
        t = self.cfg.train
        return {"test_accuracy": evaluate(plain, self.test, t.eval_batch_size, self.device, t.device_resident)}

    def done(self) -> bool:
        return False  # every epoch of train.epochs

    def _exact_batch(self, generator: torch.Generator, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``size`` training examples (all of them when there are fewer), on the CPU."""
        n = len(self.data.train)  # type: ignore[arg-type]
        pick = torch.randperm(n, generator=generator)[:size].tolist()
        x, y = next(iter(DataLoader(Subset(self.data.train, pick), batch_size=len(pick))))
        return x, y

    def memory_iteration(self, stages: Marks) -> None:
        # Which examples are in the batch does not change its memory; its size does, and B is public.
        # The examples are drawn with a generator of their own: the training sampler's is untouched.
        device = self.device
        # first: iterating a DataLoader draws its base seed from the global generator
        rng = torch.get_rng_state(), torch.cuda.get_rng_state_all() if device.type == "cuda" else None
        drawn = self.generator.get_state()  # its noise (and sampling) streams: the step is undone, its draws too
        # As bytes, not tensors: the CPU twin's census would count a copy held as tensors.
        trainable = io.BytesIO()
        torch.save({n: p.detach() for n, p in self.model.named_parameters() if p.requires_grad}, trainable)
        optimizer_state = copy.deepcopy(self.optimizer.state_dict())
        history = list(self.engine.accountant.history) if self.engine is not None else []
        self.model.train()
        if self.own is not None:
            self._own_exact_step(stages)
        else:
            # one pass, as training makes; a rank of a run across devices takes its share of B
            size = self.physical_batch_size or -(-self.cfg.train.batch_size // self.ranks.world_size)
            x, y = self._exact_batch(torch.Generator().manual_seed(self.cfg.train.seed), size)
            train_pass(self.trainer, (x, y), stages)
        self.optimizer.zero_grad(set_to_none=True)
        trainable.seek(0)
        saved = torch.load(trainable, map_location=device, weights_only=True)
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if name in saved:
                    p.copy_(saved[name])
        self.optimizer.load_state_dict(optimizer_state)
        if self.engine is not None:
            self.engine.accountant.history = history
        self.generator.set_state(drawn)
        torch.set_rng_state(rng[0])
        if rng[1] is not None:
            torch.cuda.set_rng_state_all(rng[1])

    def probe(self, stages: Stages) -> dict[str, float]:
        """The first iteration only, on exactly ``train.batch_size`` examples (a Poisson batch would
        make the measured batch random)."""
        self.model.train()
        if self.own is not None:  # always DP: no loss released
            self._own_exact_step(stages)
            stages.stepped()
            return {}
        x, y = self._exact_batch(torch.Generator().manual_seed(self.cfg.train.seed), self.cfg.train.batch_size)
        loss, _ = train_pass(self.trainer, (x, y), stages)
        stages.stepped()
        # Without DP the loss is a plain training metric; with DP it would be an un-noised statistic of
        # private examples that no accountant covers, so it is not released.
        return {} if self.cfg.dp.enabled else {"probe.loss": float(loss)}

    @property
    def plain_model(self) -> nn.Module:
        """The model without Opacus's wrapper and its per-sample machinery."""
        plain: nn.Module = opacus_private.wrapped_module(self.model)
        return plain.module if isinstance(plain, DPDDP) else plain

    def released_model(self) -> tuple[nn.Module, np.ndarray]:
        plain = self.plain_model
        shape: tuple[int, ...] = self.data.input_shape
        # vgg16_frozen, whole or trained on cached maps: only its head (ImageNet's backbone is public)
        if isinstance(plain, (classifiers.FrozenVGG16, classifiers.PooledHead)):
            plain, shape = plain.head, (classifiers.VGG16_FEATURES,)
        return classifiers.released_copy(plain), np.zeros((1, *shape), dtype=np.float32)

    def trained_model(self) -> nn.Module:
        return self.plain_model.eval()

    def privacy_ledger(self) -> ledger.Ledger:
        plan = self.inputs.plan.privacy
        if self.own is not None and plan is not None:
            s = setting(self.cfg, self.inputs.plan.facts.n_train)
            return mechanism_of(self.cfg).ledger_taken(s, plan.noise_multiplier, self.own.steps)
        if self.engine is None:
            return ledger.Ledger()
        before = ledger.Ledger((self.released,)) if self.released is not None else ledger.Ledger()
        history = self.engine.accountant.history
        if self.cfg.dp.clipping == Clipping.adaptive:  # charged at the full σ of the plan (dpsweep.privacy.clipping)
            sigma, sigma_b = (
                self.inputs.plan.noise_multiplier,
                clipping.count_noise(self.cfg.dp, self.cfg.train.batch_size),
            )
            assert sigma is not None
            steps = tuple(clipping.adaptive_steps(sigma, float(q), int(n), sigma_b) for _, q, n in history if n)
            return before + ledger.Ledger(steps)
        return before + ledger.from_history(history)

    def params(self) -> dict[str, Any]:
        if self.released is None:
            return {}
        return {"dp.max_grad_norm_chosen": self.max_grad_norm}


def _cached_features(
    inputs: RunInputs, model: classifiers.FrozenVGG16, run: Tracker
) -> tuple[nn.Module, loaders.DataSplits]:
    """The frozen features of both splits from the cache (built on the device when missing), and the
    module to train on them: the pool and head (see dpsweep.models.feature_cache). N is unchanged."""
    cfg, data = inputs.cfg, inputs.data
    cached = feature_cache.cached_splits(
        model, data, dataclasses.asdict(cfg.dataset), root=Path(cfg.model.feature_cache_dir),
        batch_size=EXTRACT_BATCH_SIZE, device=inputs.device,
    )  # fmt: skip
    run.set_tags({
        "feature_cache.train": cached.status["train"], "feature_cache.test": cached.status["test"],
        "feature_cache.key": cached.keys["train"], "feature_cache.map_shape": "x".join(map(str, cached.map_shape)),
    })  # fmt: skip
    return cached.head(model), loaders.DataSplits(cached.train, cached.test, cached.num_classes, data.input_shape)


def _across_ranks(
    loader: DataLoader[Any], ranks: Ranks, seed: int, drawn: torch.Generator
) -> tuple[DataLoader[Any], torch.Generator]:
    """This rank's share of every step's Poisson batch (:class:`dpsweep.distributed.PoissonAcrossRanks`)
    at Opacus's loader's rate and steps, through its collate (empty shares included), in place of
    Opacus's distributed sampler, dealt by ``seed`` (public) and drawn from ``drawn`` (this rank's
    sampling stream); and the generator it draws from (a checkpoint keeps its state, so a resumed run
    draws new batches, not the first epoch's again)."""
    assert isinstance(loader, DPDataLoader)
    n = len(loader.dataset)
    sampler = PoissonAcrossRanks(n, loader.sample_rate, len(loader), ranks, seed, drawn)
    return DataLoader(loader.dataset, batch_sampler=sampler, collate_fn=loader.collate_fn), sampler.generator


def _device_batches(
    inputs: RunInputs, data: loaders.DataSplits, loader: DataLoader[Any]
) -> tuple[Iterable[Batch], torch.Generator]:
    """The training split on the device, batched there: Poisson batches at the sample rate of the
    DP loader Opacus made (so the accountant's q and the steps per epoch are those of the loader),
    or shuffled batches without DP. Returns the batches and their generator (checkpointed)."""
    cfg, device = inputs.cfg, inputs.device
    x, y = resident.materialize(data.train)
    if cfg.dp.enabled:
        generator = resident.private_generator(device, inputs.streams.seed(Purpose.sampling, inputs.ranks.rank))
    else:
        generator = resident.device_generator(device, cfg.train.seed)  # public shuffles
    if cfg.dp.enabled:
        q = float(loader.sample_rate)  # type: ignore[attr-defined]  # Opacus's DPDataLoader
        return resident.PoissonBatches(x, y, sample_rate=q, device=device, generator=generator), generator
    size = cfg.train.batch_size
    return resident.ShuffledBatches(x, y, batch_size=size, device=device, generator=generator), generator
