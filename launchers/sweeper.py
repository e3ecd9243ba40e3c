"""dpsweep's Hydra sweeper: Hydra's grid expansion, plus what a sweep of DP-SGD jobs needs.

    dpsweep -m launcher=slurm dp.noise_multiplier=0.8,1.2 train.seed=0,1

Before anything is launched it
- composes and validates every job's config (a bad value fails the sweep before any job runs),
- checks the launcher: satisfiable resources, ``sbatch``/``qsub`` on PATH, a reachable tracking URI,
- creates the MLflow experiment once, so that parallel jobs do not race to create it.

While jobs run, a failed job (raised, killed, out of memory) is recorded and the sweep goes on. At
the end it marks any run its jobs left RUNNING (a job killed outright) as KILLED, prints one summary
line with the finished, skipped and failed counts and the failed runs' ids, and exits with status 1
if any job failed. Every job gets the override ``sweep.id=<id>``; its MLflow run carries that tag.
"""

from __future__ import annotations

import logging
import shutil
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import JobReturn, JobStatus
from hydra.plugins.launcher import Launcher
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict

log = logging.getLogger(__name__)

SUBMIT_COMMANDS = {"slurm": "sbatch", "sge": "qsub"}  # launchers that need a scheduler's client tools


class SweepError(Exception):
    """The sweep cannot start; the message says why."""


@dataclass
class DpsweepSweeperConf:
    _target_: str = "hydra_plugins.dpsweep_launchers.DpsweepSweeper"
    max_batch_size: int | None = None  # jobs launched (and waited for) at once; null: all
    params: dict[str, str] | None = None  # sweep axes, as for Hydra's basic sweeper


ConfigStore.instance().store(group="hydra/sweeper", name="dpsweep", node=DpsweepSweeperConf, provider="dpsweep")


@dataclass
class SweepOutcome:
    sweep_id: str
    finished: int = 0
    skipped: int = 0
    failed: int = 0
    failed_runs: list[str] | None = None
    killed_runs: list[str] | None = None

    def line(self) -> str:
        text = f"dpsweep: sweep {self.sweep_id}: {self.finished} finished, {self.skipped} skipped, {self.failed} failed"
        if self.failed_runs:
            text += f"; failed runs: {', '.join(self.failed_runs)}"
        if self.killed_runs:
            text += f"; killed runs: {', '.join(self.killed_runs)}"
        return text


class DpsweepSweeper(Sweeper):
    """Grid expansion as Hydra's basic sweeper (``hydra.sweeper.params`` first, then the command line).

    It subclasses Hydra's stable ``Sweeper`` interface rather than ``BasicSweeper``: Hydra's plugin
    scan re-executes ``basic_sweeper.py``, which would leave a subclass with a stale base class.
    """

    def __init__(self, max_batch_size: int | None = None, params: dict[str, str] | None = None) -> None:
        self.max_batch_size = max_batch_size
        self.params = dict(params or {})
        self.config: DictConfig | None = None
        self.hydra_context: HydraContext | None = None
        self.launcher: Launcher | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        from hydra.core.plugins import Plugins

        # Fix the sweep directory now: jobs started again later (a requeue is a new process) must
        # find the same output and checkpoint directories, not a new ${now:} timestamp.
        with open_dict(config):
            config.hydra.sweep.dir = str(Path(str(config.hydra.sweep.dir)).absolute())
        self.config, self.hydra_context = config, hydra_context
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )

    def _jobs(self, arguments: list[str], sweep_id: str) -> list[list[str]]:
        from hydra._internal.core_plugins.basic_sweeper import BasicSweeper  # looked up after the plugin scan

        assert self.hydra_context is not None
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        lines = [f"{k}={v}" for k, v in self.params.items()] + list(arguments)
        [jobs] = BasicSweeper.split_arguments(parser.parse_overrides(lines), None)
        return [[*job, f"sweep.id={sweep_id}"] for job in jobs]

    def _compose(self, job: list[str]) -> DictConfig:
        """The job's own config (without the ``hydra`` node, whose job fields exist only at run time)."""
        assert self.hydra_context is not None and self.config is not None
        cfg = self.hydra_context.config_loader.load_sweep_config(self.config, job)
        with open_dict(cfg):
            del cfg["hydra"]
        return cfg

    def sweep(self, arguments: list[str]) -> Any:
        assert self.config is not None and self.launcher is not None
        sweep_id = uuid.uuid4().hex[:12]
        jobs = self._jobs(arguments, sweep_id)
        configs = [self._compose(job) for job in jobs]
        preflight(configs, jobs)
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        log.info(f"dpsweep sweep {sweep_id}: {len(jobs)} jobs, launcher={configs[0].launcher.name}")

        batch_size = self.max_batch_size or len(jobs)
        returns: list[Sequence[JobReturn]] = []
        for start in range(0, len(jobs), batch_size):
            returns.append(self.launcher.launch(jobs[start : start + batch_size], initial_job_idx=start))
        outcome = summarise(sweep_id, [r for batch in returns for r in batch], configs[0])
        print(outcome.line(), flush=True)
        if outcome.failed:
            raise SystemExit(1)
        return returns


def preflight(configs: Sequence[DictConfig], jobs: Sequence[Sequence[str]]) -> None:
    """Every check that can reject the sweep, before any job is launched."""
    from dpsweep.config import ConfigError, to_config, validate, validate_launcher
    from dpsweep.tracking import check_reachable, ensure_experiments

    try:
        typed = [to_config(c) for c in configs]
        for cfg, job in zip(typed, jobs, strict=True):
            try:
                validate(cfg)
            except ConfigError as err:
                raise SweepError(f"job {' '.join(job[:-1])}: {err}") from err
        launcher = typed[0].launcher
        validate_launcher(launcher)
    except (ConfigError, SweepError) as err:
        _fail(str(err))
    command = SUBMIT_COMMANDS.get(launcher.name)
    if command and shutil.which(command) is None:
        _fail(
            f"launcher={launcher.name} needs '{command}' on PATH, and it is not there: run dpsweep on a "
            f"{launcher.name} submit host (or load its module), or use launcher=local"
        )
    for uri in sorted({cfg.tracking.uri for cfg in typed}):
        try:
            check_reachable(uri)
        except ConnectionError as err:
            _fail(str(err))
    ensure_experiments({(cfg.tracking.uri, cfg.tracking.experiment_name) for cfg in typed})


def _fail(message: str) -> None:
    print(f"dpsweep: error: {message}", flush=True, file=__import__("sys").stderr)
    raise SystemExit(2)


def summarise(sweep_id: str, results: Sequence[JobReturn], config: DictConfig) -> SweepOutcome:
    """Count outcomes; close runs left RUNNING by killed jobs; name the failed runs."""
    from dpsweep.tracking import close_orphaned_runs, runs_of_sweep

    outcome = SweepOutcome(sweep_id)
    for r in results:
        if r.status == JobStatus.COMPLETED:
            if r._return_value is None:
                outcome.skipped += 1
            else:
                outcome.finished += 1
        else:
            outcome.failed += 1
            log.error(f"job {' '.join(r.overrides or [])} failed: {r._return_value!r}")
    uri, experiment = str(config.tracking.uri), str(config.tracking.experiment_name)
    outcome.killed_runs = close_orphaned_runs(uri, experiment, sweep_id)
    runs = runs_of_sweep(uri, experiment, sweep_id)
    outcome.failed_runs = sorted(run_id for run_id, status in runs.items() if status in ("FAILED", "KILLED"))
    return outcome
