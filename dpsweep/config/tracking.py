"""The tracking/ group: where and how runs are logged to MLflow, and the checks of ``tracking.*``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from dpsweep.config.checks import require

if TYPE_CHECKING:
    from dpsweep.config.schema import Config


@dataclass
class TrackingConfig:
    uri: str = "sqlite:///mlflow.db"  # relative to where dpsweep runs; any MLflow URI, e.g. http://host:5000
    experiment_name: str = "dpsweep"  # the MLflow experiment the runs go to
    run_name: str | None = None  # null: a readable name from the config (σ1-C1-B64-s0-e10-digits-cnn)
    # Log the trained model (MLflow's PyTorch flavour, artifact "model"): only its trained parameters
    # (vgg16_frozen: the head, not the public backbone), when they take at most log_model_max_mib.
    log_model: bool = True
    log_model_max_mib: float = 256.0
    # MLflow's system metrics (CPU, memory, disk, network; GPU where pynvml finds one), sampled every
    # system_metrics_interval_s from this many seconds into training on: short runs log none. null: never.
    system_metrics_after_s: float | None = 60.0
    system_metrics_interval_s: float = 10.0


def check(cfg: Config) -> None:
    """The logged model's size limit, and when and how often system metrics are sampled."""
    tracking = cfg.tracking
    require(
        tracking.log_model_max_mib > 0,
        "tracking.log_model_max_mib",
        tracking.log_model_max_mib,
        "a positive size in MiB (or tracking.log_model=false)",
    )
    after = tracking.system_metrics_after_s
    require(after is None or after >= 0, "tracking.system_metrics_after_s", after, "0 or more seconds, or null (never)")
    interval = tracking.system_metrics_interval_s
    require(interval > 0, "tracking.system_metrics_interval_s", interval, "a positive number of seconds")
