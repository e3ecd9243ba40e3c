"""The audit settings (``audit.*``): a one-run privacy audit beside the run's ε (:mod:`dpsweep.audit`), and checks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from dpsweep.config.checks import require

if TYPE_CHECKING:
    from dpsweep.config.schema import Config

MODES = ("off", "white_box", "black_box")


@dataclass
class AuditConfig:
    # off; white_box: Dirac gradient canaries in DP-SGD's clipped sum, scored on every step's noisy
    # release; black_box: mislabelled training examples, scored on the final model's loss (a GAN:
    # its critic's D(x, y)) (Steinke, Nasr & Jagielski 2023). The run logs audit.epsilon_lower beside its ε
    mode: str = "off"
    canaries: int = 1000  # m, each included with probability 1/2 (at most the training examples)
    guesses: int = 100  # r (even): the r/2 highest scores guessed included, the r/2 lowest excluded
    confidence: float = 0.95  # of the lower bound
    seed: int = 0  # the canaries' coordinates, inclusion and sampling (their own generator)
    magnitude: float = 100.0  # white_box: a canary's per-example gradient before clipping, in units of dp.max_grad_norm

    @property
    def enabled(self) -> bool:
        return self.mode != "off"


def check(cfg: Config) -> None:
    """audit.*, and what an audit needs of the run: DP, and one C a step. Whether the task takes the audit
    is its own to say (``TaskConfig.audits``, asked by :func:`dpsweep.config.task.check`), and whether the
    run's engine lets its canaries in, the engine's, asked where the run is planned
    (:func:`dpsweep.mechanisms.engines.check`)."""
    a, dp = cfg.audit, cfg.dp
    require(a.mode in MODES, "audit.mode", a.mode, f"one of {', '.join(MODES)}")
    if not a.enabled:
        return
    require(0 < a.confidence < 1, "audit.confidence", a.confidence, "a confidence in (0, 1)")
    require(a.canaries >= 2, "audit.canaries", a.canaries, "2 or more canaries")
    require(
        a.guesses >= 2 and a.guesses % 2 == 0 and a.guesses <= a.canaries, "audit.guesses", a.guesses,
        f"an even number of guesses from 2 to audit.canaries={a.canaries}",
    )  # fmt: skip
    require(a.magnitude >= 1, "audit.magnitude", a.magnitude, "1 or more (times dp.max_grad_norm)")
    require(dp.enabled, "audit.mode", a.mode, "off for a non-private run (dp=off): there is no ε to audit")
    if a.mode == "white_box":  # canaries drawn once a step, in the units of one fixed C
        pb = cfg.train.physical_batch_size
        require(pb is None, "train.physical_batch_size", pb, "null with audit.mode=white_box: a step is one pass")
        clip = dp.clipping.value
        require(clip != "adaptive", "dp.clipping", clip, "fixed or quantile with audit.mode=white_box (one C a run)")


def check_for_dataset(cfg: Config, n_train: int) -> None:
    """The canaries are at most the training examples."""
    a = cfg.audit
    if a.enabled:
        require(a.canaries <= n_train, "audit.canaries", a.canaries, f"at most the {n_train} training examples")
