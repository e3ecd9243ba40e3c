"""The one-run audit as the runner attaches it to a private run (``audit.mode``), through the private-step
protocol (:mod:`dpsweep.mechanisms.private_step`): no task names the audit.

    audit = for_run(cfg, claimed=(q, sigma), seed=streams.seed(Purpose.canaries, cfg.audit.seed),
                    num_classes=10, device=device)
    audit.before_start(run)                      # black_box: the canaries among the training examples
    run.start(tracker); audit.after_start(run, run.private_step())   # white_box: the canaries in the step
    ... each epoch between audit.begin_epoch(optimizer) and audit.end_epoch(optimizer) ...
    metrics = audit.result(run, ledger)          # audit.epsilon_lower, audit.epsilon_lower_fdp, ...

- **white_box** (:mod:`dpsweep.audit.white_box`): Dirac canaries whose rows join the per-unit gradients
  of every step, which the step clips and noises as its own, scored on each step's release
  (:class:`~dpsweep.audit.white_box.PoissonCanaries`), or on the model after each step for DP-FTRL's fixed
  order (:class:`~dpsweep.audit.own_steps.TreeCanaries`).
- **black_box** (:mod:`dpsweep.audit.black_box`): mislabelled training examples, half of them kept, put in
  the training set before its loaders are built, scored by the run's own per-example score of its final
  model.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.data import Dataset

from dpsweep.audit import black_box, own_steps, white_box
from dpsweep.audit.guesses import tags
from dpsweep.config import AuditConfig, Config
from dpsweep.mechanisms.private_step import Attachment, PrivateRun, PrivateStep
from dpsweep.privacy.ledger import Ledger


def for_run(
    cfg: Config, claimed: tuple[float, float], seed: int, num_classes: int, device: torch.device
) -> Attachment | None:
    """The audit ``audit.mode`` asks for (None: off). ``claimed``: (q, σ) of the run's ledger (DP-FTRL: q is
    unused); ``seed``: the run's canary stream's; ``num_classes``: the labels a black-box canary's wrong
    label is drawn from."""
    a, delta = cfg.audit, cfg.dp.delta
    if a.mode == "white_box":
        return WhiteBox(a, delta, claimed, seed)
    if a.mode == "black_box":
        return BlackBox(a, delta, seed, num_classes, device, added=cfg.dp.unit.value == "user")
    return None


class WhiteBox(Attachment):
    """Dirac canaries in the run's private step, active in its training epochs only, their state kept in
    its optimizer (a checkpoint saves it; a resumed run goes on from it)."""

    def __init__(self, audit: AuditConfig, delta: float, claimed: tuple[float, float], seed: int) -> None:
        self.audit, self.delta, self.claimed, self.seed = audit, delta, claimed, seed
        self.canaries: white_box.DiracCanaries | None = None

    def tags(self) -> dict[str, str]:
        return tags(self.audit.mode, self.audit.canaries)

    def after_start(self, run: PrivateRun, step: PrivateStep) -> None:
        a, c = self.audit, step.max_grad_norm
        names, params = list(step.params), list(step.params.values())
        magnitude = a.magnitude * c  # a canary's row before the step clips it
        if step.fixed_order is not None:  # DP-FTRL: a seeded place in the fixed order, read from the model
            tree = own_steps.TreeCanaries(
                params, a.canaries, c, self.claimed[1], magnitude, self.seed, names=names, order=step.fixed_order
            )
            self.canaries = tree
            step.wrappers.append(tree)
            return
        assert step.sample_rate is not None  # a Poisson-sampled step
        self.canaries = white_box.DiracCanaries(params, a.canaries, c, self.claimed, magnitude, self.seed)
        step.wrappers.append(white_box.PoissonCanaries(self.canaries, names, step.sample_rate))

    def begin_epoch(self, optimizer: torch.optim.Optimizer) -> None:
        if self.canaries is not None:
            white_box.activate(self.canaries, optimizer)

    def end_epoch(self, optimizer: torch.optim.Optimizer) -> None:
        if self.canaries is not None:
            white_box.deactivate(self.canaries, optimizer)

    def result(self, run: PrivateRun, claim: Ledger) -> dict[str, float]:
        assert self.canaries is not None, "after_start first"
        a = self.audit
        return white_box.result(self.canaries, a.guesses, self.delta, a.confidence, claim)


class BlackBox(Attachment):
    """Input canaries among the run's training examples (a :class:`dpsweep.mechanisms.private_step.TrainingSet`),
    scored at the end by the run's own per-example score of its final model."""

    def __init__(
        self, audit: AuditConfig, delta: float, seed: int, num_classes: int, device: torch.device, added: bool
    ) -> None:
        self.audit, self.delta, self.seed, self.num_classes = audit, delta, seed, num_classes
        self.device, self.added = device, added
        self.canaries: black_box.InputCanaries | None = None

    def tags(self) -> dict[str, str]:
        return tags(self.audit.mode, self.audit.canaries)

    def before_start(self, run: PrivateRun) -> None:
        run.wrap_training_set(self)

    def training_set(self, train: Dataset[object]) -> Dataset[object]:
        """The run's training examples that are not canaries, and the included canaries (user level: every
        example, and the included canaries as users of their own)."""
        self.canaries = black_box.InputCanaries(train, self.num_classes, self.audit.canaries, self.seed, self.added)
        return self.canaries.training_set()

    def units(self, units: Tensor) -> Tensor:
        assert self.canaries is not None, "training_set first"
        return self.canaries.as_users(units)

    def sampled_population(self, planned: int) -> int:
        """The canaries change the set the run samples (:meth:`black_box.InputCanaries.sampled_population`)."""
        assert self.canaries is not None, "the run did not take its training set from the audit"
        return self.canaries.sampled_population(planned)

    def result(self, run: PrivateRun, claim: Ledger) -> dict[str, float]:
        assert self.canaries is not None, "the run did not take its training set from the audit"
        a = self.audit
        score = run.example_score()
        return black_box.result(self.canaries, score, self.device, a.guesses, self.delta, a.confidence, claim)
