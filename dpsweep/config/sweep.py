"""The sweep settings of a job (``sweep.*``, set by the user and by dpsweep's sweepers), and their checks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from dpsweep.config.checks import require

if TYPE_CHECKING:
    from dpsweep.config.schema import Config


@dataclass
class SweepConfig:
    # Drop configs whose planned ε (dp.accountant, over all their steps) exceeds this budget:
    # dpsweep-plan marks them and dpsweep -m skips them. null keeps every config.
    max_epsilon: float | None = None
    force: bool = False  # re-run configs that already FINISHED in the experiment (default: skip them)
    # Stop a sweep or study that is mostly failing: checked once at least min_jobs_for_failure_rate
    # jobs have ended. Below the rate, failures are reported at the end.
    max_failure_rate: float = 0.5
    min_jobs_for_failure_rate: int = 4
    # Set by dpsweep's sweepers on every job; each becomes a tag of the job's MLflow run.
    id: str | None = None
    parent_run_id: str | None = None  # the sweep's parent MLflow run (mlflow.parentRunId)
    study: str | None = None  # Optuna study name
    trial: int | None = None  # Optuna trial number
    storage: str | None = None  # Optuna storage URL, for reporting per-epoch accuracy (pruning)
    pruner: str | None = None  # Optuna pruner the job consults each epoch (median), or null
    pruner_startup_trials: int = 2  # the median pruner prunes nothing until this many trials completed
    pruner_warmup_epochs: int = 1  # ... nor before this many epochs of a trial
    # Private tuning (dpsweep.privacy.tuning, Papernot & Steinke 2022): instead of every grid config, run K
    # trials, K drawn from tuning_distribution (poisson | geometric | tnb) with mean tuning_mean_trials
    # from secret randomness, each a config drawn uniformly from the grid with a secret train.seed;
    # only the best trial is released, and the parent run logs epsilon_tuning, the whole procedure's ε.
    private_tuning: bool = False
    tuning_distribution: str = "poisson"
    tuning_mean_trials: float = 10.0
    tuning_eta: float = 0.5  # shape η > 0 of the truncated negative binomial (tnb)
    # The analysis that prices the procedure (dpsweep.privacy.tuning.ANALYSES): papernot_steinke (their Thms. 2
    # and 6 on the dominant candidate's RDP) | mixture (the same theorems on the exact RDP of one uniformly
    # drawn trial: never higher, lower where the candidates' costs differ, and it prices grids whose costs cross)
    tuning_analysis: str = "papernot_steinke"

    @property
    def prunes(self) -> bool:
        """This job reports per-epoch accuracy to an Optuna trial whose pruner may stop it."""
        return bool(self.pruner and self.study and self.storage and self.trial is not None)


def check(cfg: Config) -> None:
    """The ε budget a sweep drops configs above, when a mostly failing sweep is stopped, and a private
    tuning's independent trials."""
    s = cfg.sweep
    require(
        s.max_epsilon is None or s.max_epsilon > 0, "sweep.max_epsilon", s.max_epsilon, "a positive ε budget or null"
    )
    require(
        0 < s.max_failure_rate <= 1, "sweep.max_failure_rate", s.max_failure_rate, "a share of failed jobs in (0, 1]"
    )
    require(
        s.min_jobs_for_failure_rate >= 1,
        "sweep.min_jobs_for_failure_rate",
        s.min_jobs_for_failure_rate,
        "1 or more jobs",
    )
    from dpsweep.privacy.tuning import ANALYSES  # numpy and dp-accounting's ledger: no torch

    require(
        s.tuning_analysis in ANALYSES, "sweep.tuning_analysis", s.tuning_analysis,
        f"one of {', '.join(ANALYSES)} (dpsweep.privacy.tuning.ANALYSES)",
    )  # fmt: skip
    # Papernot & Steinke 2022 ("Hyperparameter Tuning with Renyi Differential Privacy", ICLR) bound K
    # independent runs of a randomized algorithm; trials that share their batches and noise are not
    require(
        not (s.private_tuning and cfg.dp.stream_seed is not None), "dp.stream_seed", cfg.dp.stream_seed,
        "null with sweep.private_tuning=true: every trial of a private tuning draws its own batches and noise, "
        "and a shared stream seed would give them all the same ones (Papernot & Steinke's bound is for "
        "independent trials)",
    )  # fmt: skip
