"""Hydra config nodes of dpsweep's launchers and sweeper, and their registration in the ConfigStore.

Deliberately light (no import of the rest of dpsweep): the config package ``dpsweep.conf`` calls
:func:`register` so that ``hydra/launcher=dpsweep_*`` (one a launcher, which its yaml under
``conf/launcher/`` selects) and ``hydra/sweeper=dpsweep`` exist whenever a config is composed, and a
submitit job that unpickles a launcher imports it without pulling in the training code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf, LocalQueueConf, SlurmQueueConf

PLUGIN_MODULE = "hydra_plugins.dpsweep_launchers"


@dataclass
class ParamSpec:
    """One axis of a search space (YAML under ``hydra.sweeper.optuna.params``)."""

    type: str = "float"  # float | int | categorical
    low: float | None = None
    high: float | None = None
    log: bool = False  # sample on a log scale (float and int)
    step: float | None = None  # grid step (float and int); required to grid-search a numeric axis
    choices: list[Any] = field(default_factory=list)  # categorical values


@dataclass
class OptunaSearchConf:
    """``hydra.sweeper.optuna``: an Optuna study instead of a grid."""

    sampler: str = "tpe"  # tpe | random | grid | nsga2 (multi-objective)
    objective: str = "accuracy"  # accuracy (maximise test_accuracy) | accuracy_epsilon (multi) | accuracy_under_budget
    epsilon_budget: float | None = None  # accuracy_under_budget: every trial calibrates σ to this ε
    n_trials: int = 20  # trials in the study, earlier runs of the same study included
    n_jobs: int = 1  # trials launched (and waited for) at once
    study_name: str = "dpsweep"
    storage: str = "sqlite:///optuna.db"  # any Optuna storage URL: postgresql://... or journal:///shared/study.log
    seed: int | None = 0  # sampler seed
    pruner: str | None = None  # median: stop trials whose per-epoch accuracy lags the median
    params: dict[str, ParamSpec] = field(default_factory=dict)  # the search space


@dataclass
class DpsweepSweeperConf:
    _target_: str = f"{PLUGIN_MODULE}.DpsweepSweeper"
    max_batch_size: int | None = None  # jobs launched (and waited for) at once; null: all
    params: dict[str, str] | None = None  # sweep axes, as for Hydra's basic sweeper
    optuna: OptunaSearchConf | None = None  # set (conf/search/*.yaml): an Optuna study instead of the grid


@dataclass
class DpsweepInlineConf:
    """launcher=inline: jobs one after another in the sweep's process (no parameters)."""

    _target_: str = f"{PLUGIN_MODULE}.InlineLauncher"


@dataclass
class DpsweepLocalConf(LocalQueueConf):
    _target_: str = f"{PLUGIN_MODULE}.LocalLauncher"


@dataclass
class DpsweepSlurmConf(SlurmQueueConf):
    _target_: str = f"{PLUGIN_MODULE}.SlurmLauncher"


@dataclass
class DpsweepSgeConf(BaseQueueConf):
    """Grid Engine parameters (see ``dpsweep.launchers.sge.make_qsub_script``)."""

    _target_: str = f"{PLUGIN_MODULE}.SgeLauncher"
    queue: str | None = None  # -q
    parallel_env: str = "smp"  # -pe <parallel_env> <cpus_per_task> when cpus_per_task > 1
    gpu_resource: str = "gpu={gpus}"  # -l resource string for GPUs
    memory_resource: str = "mem_free"  # -l <memory_resource>=<MiB per slot>M
    signal_delay_s: int = 90  # s_rt = h_rt - this: SIGUSR1 lets the job checkpoint first
    max_num_timeout: int = 3
    array_parallelism: int = 256  # -tc
    setup: list[str] | None = None
    additional_parameters: dict[str, str] = field(default_factory=dict)


def register() -> None:
    cs = ConfigStore.instance()
    cs.store(group="hydra/sweeper", name="dpsweep", node=DpsweepSweeperConf, provider="dpsweep")
    cs.store(group="hydra/launcher", name="dpsweep_inline", node=DpsweepInlineConf(), provider="dpsweep")
    cs.store(group="hydra/launcher", name="dpsweep_local", node=DpsweepLocalConf(), provider="dpsweep")
    cs.store(group="hydra/launcher", name="dpsweep_slurm", node=DpsweepSlurmConf(), provider="dpsweep")
    cs.store(group="hydra/launcher", name="dpsweep_sge", node=DpsweepSgeConf(), provider="dpsweep")
