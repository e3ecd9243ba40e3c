"""What the runner attaches to a run before it trains, and reads at its end: the one-run audit of
``audit.mode`` (``dpsweep.audit.attach``), after what a caller passed to ``train(cfg, attach=...)`` (e.g. a
test's planted bug, which the audit must then see), all through the private-step protocol
(:mod:`dpsweep.mechanisms.private_step`). A task names none of them."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dpsweep import tasks
from dpsweep.audit.attach import for_run
from dpsweep.mechanisms.private_step import Attachment, PrivateRun
from dpsweep.privacy.streams import Purpose


class Attached:
    """The attachments of one run, called in the order they were attached (the caller's, then the audit)."""

    def __init__(self, task_run: tasks.TaskRun, attachments: Sequence[Attachment]) -> None:
        self.attachments = list(attachments)
        self.run: PrivateRun | None = None
        if self.attachments:
            if not isinstance(task_run, PrivateRun):
                raise TypeError(f"{type(task_run).__name__} is not a private run (dpsweep.mechanisms.private_step)")
            self.run = task_run

    @classmethod
    def of(cls, inputs: tasks.RunInputs, task_run: tasks.TaskRun, given: Sequence[Attachment]) -> Attached:
        """``given``, then the audit ``inputs.cfg.audit`` asks for, claimed at the plan's (q, σ)."""
        cfg, privacy = inputs.cfg, inputs.plan.privacy
        audit = None
        if cfg.audit.enabled and privacy is not None:
            rate = privacy.sample_rate if privacy.sample_rate is None else privacy.poisson_rate
            claimed = (1.0 if rate is None else rate, privacy.noise_multiplier)  # DP-FTRL samples nothing
            seed = inputs.streams.seed(Purpose.canaries, cfg.audit.seed)
            audit = for_run(cfg, claimed, seed, inputs.data.num_classes, inputs.device)
        if given and privacy is None:
            raise ValueError("an attachment needs a private run (dp.enabled): there is no private step to attach to")
        return cls(task_run, [*given, *([audit] if audit is not None else [])])

    def tags(self) -> dict[str, str]:
        return {k: v for a in self.attachments for k, v in a.tags().items()}

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
