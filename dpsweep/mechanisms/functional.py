"""DP steps that noise their own gradients (per-example gradients from ``torch.func``, no Opacus):
DP-FTRL at example or user level, user-level DP-SGD, and the fused step of example-level DP-SGD
(``dp.engine=fused``, :mod:`dpsweep.mechanisms.fused`). ``task=classifier`` uses them for every
DP run but example-level DP-SGD through Opacus's hooks, ghost, functorch or ew modes.

    dpsweep dp.mechanism=dpftrl optimizer.momentum=0.9 dp.ftrl_restart_every=5     # example-level DP-FTRL
    dpsweep dp.unit=user dataset.users=partition dataset.num_users=50 train.batch_size=10   # user-level DP-SGD
    dpsweep dp.mechanism=dpftrl dp.unit=user dataset.users=partition dataset.num_users=50 train.batch_size=5
    dpsweep dp.engine=fused                                                        # example-level, fused
    dpsweep dp.engine=fused dp.unit=user dataset.users=partition dataset.num_users=50 train.batch_size=10

A **unit** is an example (``dp.unit=example``) or a user (``dp.unit=user``: all of one user's
examples, at most ``dp.max_examples_per_user`` of them per step). Each unit's contribution is its
mean per-example gradient clipped to C (``dpsweep.data.users.user_contributions``; for an example, its
own gradient clipped), and a step sums the contributions of its units:

- **DP-FTRL** (``dpsweep.mechanisms.ftrl``; Kairouz et al. 2021): ceil(U/B) batches of B units per epoch in a
  fixed order (one seeded permutation of the units for the whole run; a user brings the same
  seeded choice of examples every epoch), each unit once per epoch, no sampling. The sum over B (a
  public constant, also for the last, smaller batch, so that optimizer.lr means what it does for
  SGD) goes to :class:`~dpsweep.mechanisms.ftrl.FTRLOptimizer`, whose tree adds N(0, (σC/B)²) per node: the
  sum's N(0, σ²C²) over B, as the reference implementation scales it. The tree restarts
  after every ``dp.ftrl_restart_every`` epochs. Accounted by ``dpsweep.mechanisms.dpftrl_accounting`` over the
  epochs begun (a unit's sensitivity only grows with steps): no amplification.
- **User-level DP-SGD** (McMahan et al. 2018): users Poisson-sampled at q = 1/ceil(U/B)
  (``dpsweep.data.users.UserBatches``), N(0, σ²C²) added to the sum, divided by B (public; not q·U, a
  function of U: issue 58, item 5), and the configured optimizer steps. Accounted as DP-SGD over U users.

The count of steps taken lives in the optimizer's first parameter group (``dp_steps``), so that a
checkpoint restores it with the optimizer and the ledger counts exactly the steps taken.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from dpsweep.config import Config, PrivacyUnit
from dpsweep.data import resident, users
from dpsweep.mechanisms import dpftrl_accounting, engines, ftrl, fused, get, private_step
from dpsweep.mechanisms.private_step import PrivateStep, Release, StepWrapper
from dpsweep.models.optimizers import build_optimizer
from dpsweep.privacy.schedule import poisson_schedule
from dpsweep.privacy.streams import Purpose, Streams
from dpsweep.registry import Registry

STEPS_KEY = "dp_steps"  # the optimizer param-group entry counting DP steps (saved with its state_dict)
ORDER_SEED_OFFSET = 4_243  # the fixed order's permutation: its own generator, seeded from train.seed


def rule_of(cfg: Config) -> OwnRule:
    """How the run takes its own steps: its engine's rule (the fused step's, or the mechanism's own)."""
    rule: OwnRule = RULES.get(engines.engine_of(cfg).name, key="dp.engine")(cfg)
    return rule


def unit_ids(cfg: Config, labels: Tensor) -> Tensor | None:
    """Each training example's user (dp.unit=user: ``dataset.users``), or None: each example its own unit."""
    if cfg.dp.unit != PrivacyUnit.user:
        return None
    d = cfg.dataset
    users.check_users(d.num_users, len(labels), d.user_label_skew)
    ids = users.dirichlet_partition(labels.cpu().numpy(), d.num_users, d.user_label_skew, d.users_seed)
    return torch.as_tensor(ids, dtype=torch.int64)


class FixedOrderBatches:
    """DP-FTRL's batches: the units in one seeded order, B per batch (the last one smaller), each once
    per epoch; a user brings at most ``max_examples`` of their examples, the same ones every epoch.
    With ``batches`` (a black-box audit's smaller training set kept to the plan's steps per epoch, on
    which DP-FTRL's ε depends), that many batches instead, as even as can be.

    The batches are built at the first epoch, not before: held from the start, their sizes (how many
    examples the users hold) would show in the memory stages a run logs (issue 39, item 10)."""

    def __init__(
        self,
        x: Tensor,
        y: Tensor,
        unit: Tensor | None,
        batch_size: int,
        max_examples: int,
        seed: int,
        device: torch.device,
        batches: int | None = None,
    ) -> None:
        self.unit = torch.arange(len(y)) if unit is None else unit.cpu()
        self.batch_size, self.max_examples, self.seed, self.device = batch_size, max_examples, seed, device
        self.x, self.y = x.to(device), y.to(device)
        self.num_units = n = int(self.unit.max()) + 1
        # units a batch: B each, the last one smaller; or ``batches`` of them, as even as can be
        self.sizes = [min(batch_size, n - i) for i in range(0, n, batch_size)]
        if batches is not None:
            self.sizes = [len(part) for part in torch.arange(n).tensor_split(batches)]
        self._batches: list[tuple[Tensor, Tensor]] | None = None  # (example indices, segment ids) per batch

    def _build(self) -> list[tuple[Tensor, Tensor]]:
        n, unit, num_units = len(self.y), self.unit, self.num_units
        rng = torch.Generator().manual_seed(self.seed + ORDER_SEED_OFFSET)
        order = torch.randperm(num_units, generator=rng)
        keep = torch.randperm(n, generator=rng)  # a seeded rank per example: each user keeps its m first
        by_unit: list[list[int]] = [[] for _ in range(num_units)]
        for i in keep.tolist():
            u = int(unit[i])
            if len(by_unit[u]) < self.max_examples:
                by_unit[u].append(i)
        members = [torch.tensor(sorted(by_unit[u]), dtype=torch.int64) for u in order.tolist()]
        batches = []
        for start, size in zip(itertools.accumulate([0, *self.sizes]), self.sizes, strict=False):
            chunk = members[start : start + size] or [torch.zeros(0, dtype=torch.int64)]  # (an empty batch)
            index = torch.cat(chunk)
            segment = torch.cat([torch.full((len(m),), j, dtype=torch.int64) for j, m in enumerate(chunk)])
            batches.append((index.to(self.device), segment.to(self.device)))
        return batches

    def __len__(self) -> int:
        return len(self.sizes)

    def __iter__(self) -> Iterator[users.UserBatch]:
        if self._batches is None:
            self._batches = self._build()
        for index, segment in self._batches:
            yield users.UserBatch(self.x[index], self.y[index], segment)


@runtime_checkable
class Sampled(Protocol):
    """Batches Poisson-sampled at a rate (:class:`dpsweep.data.users.UserBatches`, the fused step's batches);
    DP-FTRL's fixed order samples nothing."""

    sample_rate: float


@dataclass
class OwnSetup:
    """What a rule trains with: its optimizer, its generator (checkpointed), its batches of units for
    an epoch and the number of units it divides a step's noisy sum by; for a rule that adds its noise
    through a tree (DP-FTRL), the epochs after which the tree restarts (a white-box audit follows them)."""

    optimizer: torch.optim.Optimizer
    generator: torch.Generator | resident.Generators
    batches: Iterable[users.UserBatch]
    expected_units: float
    tree_restarts: tuple[int, ...] = ()


@dataclass(frozen=True)
class OwnRun:
    """What a rule works with: the run's config, model and loss, its training split as tensors (with
    each example's unit, or None: each example its own), the fixed order's batches of B units, σ and
    the device; ``priced``, the units (examples, or users) the plan priced, which the split's differ
    from in a black-box audit (its canaries: it samples at the plan's rate all the same); None: the
    split's own."""

    cfg: Config
    model: nn.Module
    loss_fn: nn.Module
    data: tuple[Tensor, Tensor, Tensor | None]
    exact: FixedOrderBatches
    sigma: float
    device: torch.device
    streams: Streams  # the private streams it samples and noises from (dpsweep.privacy.streams)
    priced: int | None = None


class OwnRule(ABC):
    """How a mechanism that noises its own gradients trains: its batches and optimizer, the noised
    gradient of one batch, and what happens after an epoch. Each mechanism that trains so returns
    one from ``own_steps()`` (``dpsweep.mechanisms.base``)."""

    @abstractmethod
    def setup(self, run: OwnRun) -> OwnSetup:
        """The optimizer, generator and batches of a run."""

    noised_by_optimizer = False  # its optimizer adds the noise (DP-FTRL's tree), which shows its own release

    @abstractmethod
    def gradient(self, run: OwnRun, batch: users.UserBatch, expected_units: float) -> dict[str, Tensor]:
        """The gradient the optimizer steps with, by parameter name (noised here or by the optimizer)."""

    def release(
        self, run: OwnRun, batch: users.UserBatch, expected_units: float, extra: dict[str, Tensor] | None, step: int
    ) -> Release:
        """Step ``step``'s release (:class:`dpsweep.mechanisms.private_step.Release`), ``extra`` units (a
        white-box audit's canaries) clipped and noised with the batch's own. A rule that says only its
        gradient takes no extra units."""
        if extra is not None:
            raise ValueError(f"{type(self).__name__} takes no units from outside its batch (a white-box audit's)")
        return Release(step, None, self.gradient(run, batch, expected_units), expected_units)

    def end_epoch(self, run: OwnRun, optimizer: torch.optim.Optimizer, epoch: int) -> None:
        """After epoch ``epoch`` (1-based): nothing, unless the rule says otherwise."""
        return None


class PoissonUnits(OwnRule):
    """User-level DP-SGD (McMahan et al. 2018): users Poisson-sampled at q = 1/ceil(U/B), N(0, σ²C²) on
    the sum of their clipped contributions, over B users (the config's, public); the configured optimizer.
    The users are drawn from the run's sampling stream, the noise from its noise stream."""

    def __init__(self) -> None:
        self.noise: torch.Generator | None = None

    def setup(self, run: OwnRun) -> OwnSetup:
        (x, y, unit), cfg = run.data, run.cfg
        assert unit is not None
        generators = private_generators(run)
        self.noise = generators["noise"]
        sampled = users.UserBatches(
            x, y, unit, expected_users_per_step=cfg.train.batch_size,
            max_examples_per_user=cfg.dp.max_examples_per_user, device=run.device,
            generator=generators["sampling"], priced_users=run.priced,
        )  # fmt: skip
        return OwnSetup(build_optimizer(cfg.optimizer, run.model), generators, sampled, sampled.expected_users)

    def gradient(self, run: OwnRun, batch: users.UserBatch, expected_units: float) -> dict[str, Tensor]:
        return self.release(run, batch, expected_units, None, 0).noisy

    def release(
        self, run: OwnRun, batch: users.UserBatch, expected_units: float, extra: dict[str, Tensor] | None, step: int
    ) -> Release:
        assert self.noise is not None, "setup() first"
        x, y, segment = batch
        c, n_seg = run.cfg.dp.max_grad_norm, users.segment_count(segment)
        clipped, noisy = users.user_level_release(
            run.model, run.loss_fn, x, y, segment, n_seg, c, run.sigma, expected_units, generator=self.noise,
            extra=extra,
        )  # fmt: skip
        return Release(step, clipped, noisy, expected_units)


def private_generators(run: OwnRun) -> resident.Generators:
    """The run's sampling and noise generators on its device, each seeded from its own private stream."""
    streams = run.streams
    return resident.Generators(
        sampling=resident.private_generator(run.device, streams.seed(Purpose.sampling)),
        noise=resident.private_generator(run.device, streams.seed(Purpose.noise)),
    )


class FusedPoisson(OwnRule):
    """Example-level DP-SGD by the fused step (:mod:`dpsweep.mechanisms.fused`): examples Poisson-sampled on
    the device at Opacus's q and steps per epoch, the clipped sum in fixed-shape passes, N(0, σ²C²) from
    the run's one generator (checkpointed with the sampling state), over the config's B (public, as
    :func:`~dpsweep.mechanisms.opacus_engine.make_private` divides)."""

    def __init__(self) -> None:
        self.step: fused.FusedStep | None = None

    def setup(self, run: OwnRun) -> OwnSetup:
        (x, y, _), cfg = run.data, run.cfg
        n = run.priced or len(y)  # the plan's N, whose rate and expected batch the ledger prices
        schedule = poisson_schedule(n, cfg.train.batch_size)  # q = 1/ceil(N/B), as Opacus's loader
        generators = private_generators(run)
        sampled = resident.PoissonBatches(
            x, y, sample_rate=schedule.inclusion_probability, device=run.device, generator=generators["sampling"]
        )
        self.generator = generators["noise"]
        pad_to, mode = _fused_settings(run)
        self.step = fused.FusedStep(
            run.model, run.loss_fn, max_grad_norm=cfg.dp.max_grad_norm, pad_to=pad_to, mode=mode
        )
        # over the config's B, a public constant, as make_private's (issue 58, item 5; cf. arXiv 2605.15648):
        # not int(N·q), a function of the private N; post-processing, q and the ledger unchanged
        expected = float(cfg.train.batch_size)
        return OwnSetup(build_optimizer(cfg.optimizer, run.model), generators, _AsUnits(sampled), expected)

    def gradient(self, run: OwnRun, batch: users.UserBatch, expected_units: float) -> dict[str, Tensor]:
        assert self.step is not None, "setup() first"
        return self.step.gradient(
            batch.x, batch.y, noise_multiplier=run.sigma, divisor=expected_units, generator=self.generator
        )

    def release(
        self, run: OwnRun, batch: users.UserBatch, expected_units: float, extra: dict[str, Tensor] | None, step: int
    ) -> Release:
        assert self.step is not None, "setup() first"
        clipped, noisy = self.step.release(batch.x, batch.y, noise_multiplier=run.sigma, divisor=expected_units,
                                           generator=self.generator, extra=extra)  # fmt: skip
        return Release(step, clipped, noisy, expected_units)


class FusedUsers(OwnRule):
    """User-level DP-SGD by the fused step (:class:`dpsweep.mechanisms.fused.FusedUserStep`): users Poisson-sampled
    as :class:`PoissonUnits` samples them (the same q, steps and ledger), their clipped contributions summed in
    fixed-shape passes of P users × ``dp.max_examples_per_user`` examples, N(0, σ²C²) from the run's one
    generator, over B users (the config's, public)."""

    def __init__(self) -> None:
        self.step: fused.FusedUserStep | None = None

    def setup(self, run: OwnRun) -> OwnSetup:
        own = PoissonUnits().setup(run)
        dp = run.cfg.dp
        pad_to, mode = _fused_settings(run)  # users per pass
        self.step = fused.FusedUserStep(
            run.model, run.loss_fn, max_grad_norm=dp.max_grad_norm, pad_to=pad_to,
            max_examples=dp.max_examples_per_user, mode=mode,
        )  # fmt: skip
        assert isinstance(own.generator, resident.Generators)
        self.generator = own.generator["noise"]
        return own

    def gradient(self, run: OwnRun, batch: users.UserBatch, expected_units: float) -> dict[str, Tensor]:
        assert self.step is not None, "setup() first"
        return self.step.gradient(batch.x, batch.y, noise_multiplier=run.sigma, divisor=expected_units,
                                  generator=self.generator, segment=batch.segment)  # fmt: skip

    def release(
        self, run: OwnRun, batch: users.UserBatch, expected_units: float, extra: dict[str, Tensor] | None, step: int
    ) -> Release:
        assert self.step is not None, "setup() first"
        clipped, noisy = self.step.release(batch.x, batch.y, noise_multiplier=run.sigma, divisor=expected_units,
                                           generator=self.generator, segment=batch.segment, extra=extra)  # fmt: skip
        return Release(step, clipped, noisy, expected_units)


def _fused_settings(run: OwnRun) -> tuple[int, fused.CompileMode]:
    """The fused step's rows (or users) per pass, ``dp.pad_to`` or its default, and its compile mode
    (``dp.compile``; unset: compiled on a GPU only)."""
    dp = run.cfg.dp
    compiled = run.device.type == "cuda" if dp.compile is None else dp.compile
    return fused.pad_bound(dp.pad_to, run.cfg.train.batch_size), fused.compile_mode(run.device, compiled)


class _AsUnits:
    """Example batches as unit batches (each example its own unit; the fused step needs no segments)."""

    def __init__(self, batches: resident.PoissonBatches) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    @property
    def sample_rate(self) -> float:
        return self.batches.sample_rate

    @sample_rate.setter
    def sample_rate(self, rate: float) -> None:  # a black-box audit's run samples at the plan's rate
        self.batches.sample_rate = rate

    def __iter__(self) -> Iterator[users.UserBatch]:
        for x, y in self.batches:
            yield users.UserBatch(x, y, torch.arange(len(y), device=y.device))


class TreeAggregation(OwnRule):
    """DP-FTRL: the fixed order's batches; the clipped sum over B goes to the FTRL optimizer, whose tree
    adds σC/B per node; the tree restarts after every ``dp.ftrl_restart_every`` epochs."""

    def setup(self, run: OwnRun) -> OwnSetup:
        cfg = run.cfg
        generator = torch.Generator().manual_seed(cfg.train.seed)  # the order is fixed: nothing to draw
        optimizer = ftrl_optimizer(cfg, run.model, run.sigma, run.device, run.streams.seed(Purpose.noise))
        epochs, every = cfg.train.epochs, cfg.dp.ftrl_restart_every
        restarts = tuple(e for e in range(1, epochs + 1) if dpftrl_accounting.restart_after_epoch(e, epochs, every))
        return OwnSetup(optimizer, generator, run.exact, float(cfg.train.batch_size), restarts)

    noised_by_optimizer = True  # the tree's noise: the FTRL optimizer shows the noisy prefix sums

    def gradient(self, run: OwnRun, batch: users.UserBatch, expected_units: float) -> dict[str, Tensor]:
        return self.release(run, batch, expected_units, None, 0).noisy

    def release(
        self, run: OwnRun, batch: users.UserBatch, expected_units: float, extra: dict[str, Tensor] | None, step: int
    ) -> Release:
        """The clipped sum over B (noised by the optimizer's tree, not here), ``extra`` units among the batch's."""
        x, y, segment = batch
        if not len(y) and extra is None:
            zeros = {k: torch.zeros_like(p) for k, p in run.model.named_parameters() if p.requires_grad}
            return Release(step, zeros, zeros, expected_units)
        n_seg, c = users.segment_count(segment), run.cfg.dp.max_grad_norm
        parts = users.user_contributions(run.model, run.loss_fn, x, y, segment, n_seg, c, extra=extra)
        summed = {k: g.sum(dim=0) / expected_units for k, g in parts.items()}
        return Release(step, summed, summed, expected_units)

    def end_epoch(self, run: OwnRun, optimizer: torch.optim.Optimizer, epoch: int) -> None:
        cfg = run.cfg
        restart = dpftrl_accounting.restart_after_epoch(epoch, cfg.train.epochs, cfg.dp.ftrl_restart_every)
        if isinstance(optimizer, ftrl.FTRLOptimizer) and restart:
            optimizer.restart()


class OwnSteps:
    """One DP step of a unit batch: the rule's noised gradient, then the optimizer's step; the wrappers of
    its private step (:mod:`dpsweep.mechanisms.private_step`) add their units before the rule clips, see
    its release before the optimizer steps with it (DP-FTRL: the tree's noisy prefix sums, shown by the
    optimizer), and are told after the step."""

    def __init__(self, run: OwnRun, optimizer: torch.optim.Optimizer, rule: OwnRule) -> None:
        self.run, self.optimizer, self.rule = run, optimizer, rule
        self.optimizer.param_groups[0].setdefault(STEPS_KEY, 0)
        self.wrappers: list[StepWrapper] = []
        self.names = [k for k, p in run.model.named_parameters() if p.requires_grad]
        self.divisor = 1.0  # the last step's
        if isinstance(optimizer, ftrl.FTRLOptimizer):
            optimizer.on_release = self._prefix_released

    @property
    def steps(self) -> int:
        return int(self.optimizer.param_groups[0][STEPS_KEY])

    def step(self, batch: users.UserBatch, expected_units: float, stages: Any) -> None:
        """One step. The loss is not computed (a forward pass more per step): with DP the training
        loss is an un-noised statistic that no run releases anyway."""
        stages.mark("batch_load")
        self.optimizer.zero_grad(set_to_none=True)
        params = {k: p for k, p in self.run.model.named_parameters() if p.requires_grad}
        step = self.steps
        extra = private_step.extra_units(self.wrappers, step)
        release = self.rule.release(self.run, batch, expected_units, extra, step)
        if self.wrappers:  # the batch's units (the rows of `extra` not among them): the sampling check's
            release.batch_units = users.segment_count(batch.segment)
        if not self.rule.noised_by_optimizer:
            private_step.show(self.wrappers, release)
        stages.mark("backward")
        for name, p in params.items():
            p.grad = release.noisy[name].detach()
        self.divisor = expected_units
        self.optimizer.step()
        self.optimizer.param_groups[0][STEPS_KEY] += 1
        private_step.stepped(self.wrappers, step)
        stages.mark("optimizer_step")

    def _prefix_released(self, prefix: list[Tensor], noisy: list[Tensor]) -> None:
        """DP-FTRL's release at this step: the prefix sum of the clipped sums over B, and its noisy release."""
        if self.wrappers:
            release = Release(self.steps, dict(zip(self.names, prefix, strict=True)),
                              dict(zip(self.names, noisy, strict=True)), self.divisor)  # fmt: skip
            private_step.show(self.wrappers, release)

    def end_epoch(self, epoch: int) -> None:
        self.rule.end_epoch(self.run, self.optimizer, epoch)

    def private_step(self, setup: OwnSetup) -> PrivateStep:
        """The step as what is attached to the run sees it (:class:`dpsweep.mechanisms.private_step.PrivateStep`):
        its Poisson batches' real rate, or, for batches that sample nothing (DP-FTRL's), its fixed order."""
        cfg, batches = self.run.cfg, setup.batches
        params = {k: p for k, p in self.run.model.named_parameters() if p.requires_grad}
        if isinstance(batches, Sampled):
            sampled = batches
            return PrivateStep(params, cfg.dp.max_grad_norm, lambda: float(sampled.sample_rate), None, self.wrappers)
        b = len(self.run.exact)
        order = private_step.FixedOrder(
            b, (0, *(e * b for e in setup.tree_restarts)), cfg.dp.ftrl_tree_completion, cfg.optimizer.lr,
            getattr(cfg.optimizer, "momentum", 0.0), setup.expected_units,
        )  # fmt: skip
        return PrivateStep(params, cfg.dp.max_grad_norm, None, order, self.wrappers)


def ftrl_optimizer(
    cfg: Config, model: nn.Module, sigma: float, device: torch.device, noise_seed: int
) -> ftrl.FTRLOptimizer:
    """FTRLOptimizer over the trainable parameters, its tree's node noise σ·C/B (drawn from ``noise_seed``,
    the run's noise stream; the tree's state keeps the generator's), lr and momentum from optimizer.*."""
    params = [p for p in model.parameters() if p.requires_grad]
    generator = resident.private_generator(device, noise_seed)
    std = sigma * cfg.dp.max_grad_norm / cfg.train.batch_size  # on the clipped sum over B (OwnSteps.step)
    tree = ftrl.TreeAggregator.for_params(
        params, std=std, generator=generator, tree_completion=cfg.dp.ftrl_tree_completion
    )
    return ftrl.FTRLOptimizer(params, lr=cfg.optimizer.lr, momentum=getattr(cfg.optimizer, "momentum", 0.0), noise=tree)


# How each engine whose steps are this module's (``Engine.steps``: the classifier's own_step) takes them: the
# mechanism's own rule (``Mechanism.own_steps``), or DP-SGD's Poisson steps in fused passes, per example or per user.
RULES: Registry[Callable[[Config], OwnRule]] = Registry("engine with its own steps")
RULES.register("own_steps")(lambda cfg: get(cfg.dp.mechanism).own_steps())
RULES.register("fused")(lambda cfg: FusedUsers() if cfg.dp.unit == PrivacyUnit.user else FusedPoisson())
