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
from dpsweep.mechanisms.private_step import Attachment, PrivateRun, PrivateStep, Release, StepWrapper
from dpsweep.privacy import sampling
from dpsweep.privacy.ledger import Ledger
from dpsweep.privacy.streams import Purpose
from dpsweep.tracking import Tracker

CHECK_TAG = "sampling.check"  # passed, refused, or "not checked: <why>"


class BatchSizes(StepWrapper):
    """The units of each step's logical batch (:attr:`Release.batch_units`), in training epochs only."""

    reads_gradients = False

    def __init__(self) -> None:
        self.active = False
        self.sizes: list[tuple[int, int]] = []  # (step, units)
        self.unsaid = 0  # steps whose engine did not count its batch

    def released(self, release: Release) -> None:
        if not self.active:  # a memory iteration's or a probe's exact batch
            return
        if release.batch_units is None:
            self.unsaid += 1
        else:
            self.sizes.append((release.step, release.batch_units))


class SamplingCheck(Attachment):
    """The realised batch sizes of a Poisson-sampled private run against Binomial(N, q) of its ledger
    (:mod:`dpsweep.privacy.sampling`): N the plan's units (examples, or users), q each step's rate in the
    ledger's DP-SGD segments. Logs ``sampling_statistic`` and ``sampling_p_value`` and tags which test;
    a run refused at p < 1e-6 is tagged ``dp.release=not-for-release`` with ``sampling.refused`` (one line,
    also on stderr). A resumed run checks the steps it took since it resumed."""

    def __init__(self, population: int) -> None:
        self.population = population
        self.sizes = BatchSizes()
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

    def result(self, run: PrivateRun, claim: Ledger) -> dict[str, float]:
        rates = [q for _, q, steps in claim.dpsgd_segments() for _ in range(steps)]
        if self.not_checked is not None:
            return {}
        if not self.sizes.sizes or self.sizes.unsaid or not rates:
            why = "its engine did not count its batches" if self.sizes.unsaid or self.sizes.sizes else "no step"
            self.not_checked = f"not checked: {why if rates else 'its ledger has no DP-SGD steps'}"
            return {}
        if not all(0 < q < 1 for q in rates):
            self.not_checked = "not checked: a ledger rate of 1 (every unit in every step)"
            return {}
        steps = [t for t, _ in self.sizes.sizes]
        q = [rates[min(t, len(rates) - 1)] for t in steps]
        self.checked = sampling.check([b for _, b in self.sizes.sizes], q, self.population)
        if self.checked.refused():
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
    """The sampling check of a private run, or why it has none ("not checked: ...")."""
    cfg, privacy = inputs.cfg, inputs.plan.privacy
    assert privacy is not None
    if privacy.sample_rate is None:
        return "not checked: the mechanism samples nothing (a fixed order)"
    if not isinstance(task_run, PrivateRun):
        return f"not checked: {type(task_run).__name__} has no private step to count batches in"
    if inputs.ranks.distributed:
        return "not checked: a run across ranks is not yet checked (single-process runs are)"
    if cfg.audit.enabled and cfg.audit.mode == "black_box":
        return "not checked: a black-box audit's canaries change the training set's size"
    return SamplingCheck(population(cfg, inputs.plan.facts.n_train))


class Attached:
    """The attachments of one run, called in the order they were attached (the caller's, then the audit)."""

    def __init__(self, task_run: tasks.TaskRun, attachments: Sequence[Attachment]) -> None:
        self.attachments = list(attachments)
        self.notes: dict[str, str] = {}  # tags of what is not attached, and why
        self.run: PrivateRun | None = None
        if self.attachments:
            if not isinstance(task_run, PrivateRun):
                raise TypeError(f"{type(task_run).__name__} is not a private run (dpsweep.mechanisms.private_step)")
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
        checks = [check] if isinstance(check, SamplingCheck) else []
        attached = cls(task_run, [*given, *([audit] if audit is not None else []), *checks])
        attached.notes = {CHECK_TAG: check} if isinstance(check, str) else {}
        return attached

    def tags(self) -> dict[str, str]:
        return {k: v for a in self.attachments for k, v in a.tags().items()} | self.notes

    def finish(self, run: Tracker) -> None:
        """After the final epoch's :meth:`result`: the tags that result decided (the sampling check's)."""
        tags = {k: v for a in self.attachments for k, v in a.end_tags().items()}
        if tags:
            run.set_tags(tags)

    def before_start(self) -> None:
        for a in self.attachments:
            assert self.run is not None
            a.before_start(self.run)

    def after_start(self) -> None:
        if self.run is None:
            return
        step = self.run.private_step()
        for a in self.attachments:
            a.after_start(self.run, step)

    def begin_epoch(self, optimizer: torch.optim.Optimizer) -> None:
        for a in self.attachments:
            a.begin_epoch(optimizer)

    def end_epoch(self, optimizer: torch.optim.Optimizer) -> None:
        for a in self.attachments:
            a.end_epoch(optimizer)

    def result(self, task_run: tasks.TaskRun) -> dict[str, float]:
        """Every attachment's metrics after the final epoch, each read against the run's ledger."""
        if self.run is None:
            return {}
        claim = task_run.privacy_ledger()
        return {k: v for a in self.attachments for k, v in a.result(self.run, claim).items()}
