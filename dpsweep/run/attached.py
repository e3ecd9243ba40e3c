"""What the runner attaches to a run before it trains, and reads at its end: the one-run audit of
``audit.mode`` (``dpsweep.audit.attach``), after what a caller passed to ``train(cfg, attach=...)`` (e.g. a
test's planted bug, which the audit must then see), and, on every Poisson-sampled private run, the check
of its batch sizes against its ledger's sampling (:class:`SamplingCheck`), all through the private-step
protocol (:mod:`dpsweep.mechanisms.private_step`). A task names none of them."""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch

from dpsweep import tasks
from dpsweep.audit.attach import for_run
from dpsweep.config import population
from dpsweep.distributed.ranks import Ranks, summed_by_step
from dpsweep.mechanisms.private_step import (
    Attachment,
    PrivateRun,
    PrivateStep,
    Release,
    SampledUnits,
    StepWrapper,
)
from dpsweep.privacy import sampling
from dpsweep.privacy.ledger import Ledger
from dpsweep.privacy.streams import Purpose
from dpsweep.tracking import Tracker

CHECK_TAG = "sampling.check"  # passed, refused, or "not checked: <why>"


class BatchSizes(StepWrapper):
    """The units of each step's logical batch (:attr:`Release.batch_units`), in training epochs only: this
    process's share (None where the engine did not count the step)."""

    reads_gradients = False

    def __init__(self) -> None:
        self.active = False
        self.sizes: list[tuple[int, int | None]] = []  # (step, units)

    def released(self, release: Release) -> None:
        if self.active:  # not a memory iteration's or a probe's exact batch
            self.sizes.append((release.step, release.batch_units))


class SamplingCheck(Attachment):
    """The realised batch sizes of a Poisson-sampled private run against Binomial(N, q) of its ledger
    (:mod:`dpsweep.privacy.sampling`): N the units of the set it samples (the plan's examples or users,
    or what an attachment made of them: :meth:`Attachment.sampled_population`, a black-box audit's
    canaries), q each step's rate in the ledger's DP-SGD segments. The sizes are counted in the run's
    private step (:class:`BatchSizes`), or by a task run that has none but says what it sampled
    (:class:`~dpsweep.mechanisms.private_step.SampledUnits`); across ranks, each rank's share of a step
    is summed over the ranks (:func:`dpsweep.distributed.ranks.summed_by_step`, on every rank alike) and
    N is the whole run's, not a rank's shard. Logs ``sampling_statistic`` and ``sampling_p_value`` and
    tags which test; a run refused at p < 1e-6 is tagged ``dp.release=not-for-release`` with
    ``sampling.refused`` (one line, also on rank 0's stderr). A resumed run checks the steps it took
    since it resumed."""

    def __init__(self, population: int, ranks: Ranks, counted: SampledUnits | None = None) -> None:
        """``counted``: a task run's own counts; None: counted in its private step (:meth:`after_start`)."""
        self.planned, self.ranks = population, ranks  # N as planned; the set sampled: see result
        self.sizes = BatchSizes()
        self.counted = counted
        self.checked: sampling.Checked | None = None
        self.not_checked: str | None = None

    def after_start(self, run: PrivateRun, step: PrivateStep) -> None:
        if step.sample_rate is None:
            self.not_checked = "not checked: the step samples nothing (a fixed order)"
            return
        step.wrappers.append(self.sizes)

    def begin_epoch(self, optimizer: torch.optim.Optimizer) -> None:
        self.sizes.active = True

    def end_epoch(self, optimizer: torch.optim.Optimizer) -> None:
        self.sizes.active = False

    def result(self, run: object, claim: Ledger, sampled: int | None = None) -> dict[str, float]:
        """After the final epoch, on every rank (across ranks: a collective); ``sampled``: the units of the
        set the run sampled, where its attachments changed it (None: :attr:`planned`)."""
        counted = self.sizes.sizes if self.counted is None else self.counted.sampled_units()
        sizes: Sequence[tuple[int, int | None]] = list(counted)
        if self.ranks.distributed:  # every rank, whatever it counted: the decision below is alike on all
            sizes = summed_by_step(sizes)
        rates = [q for _, q, steps in claim.dpsgd_segments() for _ in range(steps)]
        if self.not_checked is not None:
            return {}
        counts = [b for _, b in sizes if b is not None]
        if not counts or len(counts) < len(sizes) or not rates:
            why = "its engine did not count its batches" if sizes else "no step"
            self.not_checked = f"not checked: {why if rates else 'its ledger has no DP-SGD steps'}"
            return {}
        if not all(0 < q < 1 for q in rates):
            self.not_checked = "not checked: a ledger rate of 1 (every unit in every step)"
            return {}
        q = [rates[min(t, len(rates) - 1)] for t, _ in sizes]
        self.checked = sampling.check(counts, q, self.planned if sampled is None else sampled)
        if self.checked.refused() and self.ranks.leader:
            print(f"dpsweep: not for release: sampling refused: {self.checked.why()}", file=sys.stderr, flush=True)
        return {"sampling_statistic": self.checked.statistic, "sampling_p_value": self.checked.p_value}

    def end_tags(self) -> dict[str, str]:
        """Tags of the run once :meth:`result` has read it."""
        if self.checked is None:
            return {CHECK_TAG: self.not_checked or "not checked: the run ended before its final epoch"}
        tags = {"sampling.test": self.checked.test, CHECK_TAG: "passed"}
        if self.checked.refused():
            tags |= {CHECK_TAG: "refused", "dp.release": "not-for-release", "sampling.refused": self.checked.why()}
        return tags


def sampling_check(inputs: tasks.RunInputs, task_run: tasks.TaskRun) -> SamplingCheck | str:
    """The sampling check of a private run, or why it has none ("not checked: ..."): a private run's
    (its private step counts its batches) or a task run's that counts them itself
    (:class:`~dpsweep.mechanisms.private_step.SampledUnits`), on one process or across ranks."""
    cfg, privacy = inputs.cfg, inputs.plan.privacy
    assert privacy is not None
    if privacy.sample_rate is None:
        return "not checked: the mechanism samples nothing (a fixed order)"
    planned = population(cfg, inputs.plan.facts.n_train)  # the whole run's, not a rank's shard
    if isinstance(task_run, PrivateRun):
        return SamplingCheck(planned, inputs.ranks)
    if isinstance(task_run, SampledUnits):
        return SamplingCheck(planned, inputs.ranks, counted=task_run)
    return f"not checked: {type(task_run).__name__} has no private step to count batches in, nor counts them"


class Attached:
    """The attachments of one run, called in the order they were attached (the caller's, then the audit),
    then its sampling check (where it has one)."""

    def __init__(
        self, task_run: tasks.TaskRun, attachments: Sequence[Attachment], check: SamplingCheck | None = None
    ) -> None:
        self.attachments = list(attachments)
        self.check = check
        self.notes: dict[str, str] = {}  # tags of what is not attached, and why
        self.run: PrivateRun | None = None
        if self.attachments and not isinstance(task_run, PrivateRun):
            raise TypeError(f"{type(task_run).__name__} is not a private run (dpsweep.mechanisms.private_step)")
        if isinstance(task_run, PrivateRun) and (self.attachments or check is not None):
            self.run = task_run

    @classmethod
    def of(cls, inputs: tasks.RunInputs, task_run: tasks.TaskRun, given: Sequence[Attachment]) -> Attached:
        """``given``, then the audit ``inputs.cfg.audit`` asks for, claimed at the plan's (q, σ), then the
        sampling check (a private run's; where it has none, a tag says why)."""
        cfg, privacy = inputs.cfg, inputs.plan.privacy
        audit, check = None, sampling_check(inputs, task_run) if privacy is not None else None
        if cfg.audit.enabled and privacy is not None:
            rate = privacy.sample_rate if privacy.sample_rate is None else privacy.poisson_rate
            claimed = (1.0 if rate is None else rate, privacy.noise_multiplier)  # DP-FTRL samples nothing
            seed = inputs.streams.seed(Purpose.canaries, cfg.audit.seed)
            audit = for_run(cfg, claimed, seed, inputs.data.num_classes, inputs.device)
        if given and privacy is None:
            raise ValueError("an attachment needs a private run (dp.enabled): there is no private step to attach to")
        checked = check if isinstance(check, SamplingCheck) else None
        attached = cls(task_run, [*given, *([audit] if audit is not None else [])], checked)
        attached.notes = {CHECK_TAG: check} if isinstance(check, str) else {}
        return attached

    def tags(self) -> dict[str, str]:
        return {k: v for a in self.attachments for k, v in a.tags().items()} | self.notes

    def _all(self) -> list[Attachment]:
        return [*self.attachments, *([self.check] if self.check is not None else [])]

    def finish(self, run: Tracker) -> None:
        """After the final epoch's :meth:`result`: the tags that result decided (the sampling check's)."""
        tags = {k: v for a in self._all() for k, v in a.end_tags().items()}
        if tags:
            run.set_tags(tags)

    def before_start(self) -> None:
        for a in self.attachments:
            assert self.run is not None
            a.before_start(self.run)

    def after_start(self) -> None:
        if self.run is None:  # no private step: a SampledUnits run's check counts nothing here
            return
        step = self.run.private_step()
        for a in self._all():
            a.after_start(self.run, step)

    def begin_epoch(self, optimizer: torch.optim.Optimizer) -> None:
        for a in self._all():
            a.begin_epoch(optimizer)

    def end_epoch(self, optimizer: torch.optim.Optimizer) -> None:
        for a in self._all():
            a.end_epoch(optimizer)

    def result(self, task_run: tasks.TaskRun) -> dict[str, float]:
        """Every attachment's metrics after the final epoch, each read against the run's ledger; the sampling
        check's of the set the run sampled (N as the attachments left it: a black-box audit's canaries)."""
        if self.run is None and self.check is None:
            return {}
        claim = task_run.privacy_ledger()
        metrics: dict[str, float] = {}
        if self.run is not None:
            metrics = {k: v for a in self.attachments for k, v in a.result(self.run, claim).items()}
        if self.check is not None:
            sampled = self.check.planned
            for a in self.attachments:
                sampled = a.sampled_population(sampled)
            metrics |= self.check.result(task_run, claim, sampled)
        return metrics
