"""Before a sweep or study launches anything: every check that can reject it, and one way to refuse.

    preflight(configs, jobs)    # each job's run plan, the launcher's resources and tools, tracking URIs
    refuse("why")               # one line on stderr, exit code 2

    check_ranges(configs, jobs); check_launcher(configs[0].launcher)   # the checks that need no data
    check_plans(configs, jobs)                                         # ... and those that need it

Shared by the grid sweeper (``dpsweep.launchers.sweeper``), the Optuna study
(``dpsweep.launchers.optuna_sweeper``) and the ``dpsweep`` command, which runs the same checks before it
prints its first line, imports torch or creates a file (``dpsweep.cli.early``); each raises
:class:`Refused` (bad input) on the first problem.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from omegaconf import DictConfig

from dpsweep.config import RANK_KEYS, Config, LauncherConfig, given_overrides, ranks_shape
from dpsweep.config.launcher import launchers_where, spec
from dpsweep.errors import EXIT_BAD_INPUT, InputError, redact


class Refused(InputError):
    """Bad input of a sweep, said in a line of its own: a job's error named by the job's overrides
    (``job train.epochs=0: train.epochs=0 is invalid: ...``), a missing tool, an unreachable store."""

    def __init__(self, message: str) -> None:
        ValueError.__init__(self, redact(message))
        self.key, self.value, self.allowed = "", None, message

    def __reduce__(self) -> tuple[Any, ...]:  # picklable, as InputError
        return (type(self), (self.allowed,))


def preflight(configs: Sequence[Config | DictConfig], jobs: Sequence[Sequence[str]]) -> None:
    """Every check that can reject the sweep, before any job is launched (:func:`check_ranges`,
    :func:`check_launcher`, :func:`check_plans`), then the experiments created. Bad input exits with
    code 2 (:func:`refuse`)."""
    from dpsweep.config import to_config
    from dpsweep.tracking import ensure_experiments

    typed = [to_config(c) for c in configs]
    try:
        check_ranges(typed, jobs)
        check_launcher(typed[0].launcher)
        check_plans(typed, jobs)
    except InputError as err:
        refuse(str(err))
    ensure_experiments({(cfg.tracking.uri, cfg.tracking.experiment_name) for cfg in typed})


def job_error(job: Sequence[str], err: InputError) -> Refused:
    """``err`` of one job of a sweep, named by the job's overrides as the user gave them."""
    return Refused(f"job {' '.join(given_overrides(job))}: {err}")


def check_ranges(configs: Sequence[Config], jobs: Sequence[Sequence[str]]) -> None:
    """Each job's ranges that need no data (``dpsweep.config.validate``), and what its task, mechanism and
    engine declare (``dpsweep.mechanisms.engines.check``): cheap, before a first line."""
    from dpsweep.mechanisms import engines

    for cfg, job in zip(configs, jobs, strict=True):
        try:
            engines.checked(cfg)
        except InputError as err:
            raise job_error(job, err) from None


def check_launcher(launcher: LauncherConfig) -> None:
    """The launcher's resources (satisfiable) and its scheduler's client tools (on PATH: its spec's
    ``submit_command``)."""
    from dpsweep.config import validate_launcher

    validate_launcher(launcher)
    command = spec(launcher).submit_command
    if command and shutil.which(command) is None:
        here = " or ".join(f"launcher={name}" for name in launchers_where(lambda s: s.processes and not s.remote))
        raise Refused(
            f"launcher={launcher.name} needs '{command}' on PATH, and it is not there: run dpsweep on a "
            f"{launcher.name} submit host (or load its module), or use {here}"
        )


def check_search(optuna: bool, params: bool, private_tuning: bool) -> None:
    """A sweep searches one way: grid axes (``hydra.sweeper.params``) or an Optuna study
    (``hydra.sweeper.optuna``), and a private tuning draws from a grid only."""
    if optuna and private_tuning:
        raise Refused(
            "sweep.private_tuning=true with an Optuna search: its samplers (TPE, NSGA-II) choose each trial "
            "from the earlier trials' results, which Papernot & Steinke's bound does not cover; give grid "
            "axes instead, from which the trials are drawn at random"
        )
    if optuna and params:
        raise Refused(
            "give either grid axes (hydra.sweeper.params) or an Optuna search (hydra.sweeper.optuna), not both"
        )


def check_rank_shapes(configs: Sequence[Config]) -> None:
    """One shape of ranks (``train.devices``, ``train.nodes``) in a sweep whose jobs' tasks are its ranks
    (the launcher's spec's ``rank_tasks``: Slurm)."""
    if not configs or not spec(configs[0].launcher).rank_tasks:
        return
    for i, key in enumerate(RANK_KEYS):
        values = sorted({ranks_shape(c.train)[i] for c in configs})
        if len(values) > 1:
            raise Refused(
                f"{key}={','.join(map(str, values))} is invalid: one value in a sweep on "
                f"{spec(configs[0].launcher).said} (a job's tasks are its ranks)"
            )


def check_plans(configs: Sequence[Config], jobs: Sequence[Sequence[str]], sweep: bool = True) -> None:
    """Each job's run plan (``dpsweep.plan.prepare``: ranges, B <= N and δ < 1/N with N read once per
    dataset, σ calibration, the memory model and its physical batch) and, for a sweep, a private
    tuning's procedure (``dpsweep.plan.tuning_procedure``) and its tracking URIs reachable. A sweep's job
    errors name the job; a single run's (``sweep=False``) are its own."""
    from dpsweep.plan import FactsCache, MemoryFiles, prepare, tuning_procedure
    from dpsweep.tracking import check_reachable

    facts, memory_files, plans = FactsCache(), MemoryFiles(), []
    for cfg, job in zip(configs, jobs, strict=True):
        try:  # the backend (torch) asked only where a memory model is given
            budget = memory_files.budget(cfg, job_backend(cfg)) if cfg.train.memory_model else None
            plans.append(prepare(cfg, facts(cfg), budget))
        except InputError as err:
            if not sweep:
                raise
            raise job_error(job, err) from None
    if not sweep:
        return
    if configs[0].sweep.private_tuning:  # the candidates as one procedure: private, one δ, within the budget
        tuning_procedure(plans, configs[0].sweep)
    for uri in sorted({cfg.tracking.uri for cfg in configs}):
        try:
            check_reachable(uri)
        except ConnectionError as err:
            raise Refused(str(err)) from None


def job_backend(cfg: Any) -> str:
    """The memory backend a job will measure with: cuda when it gets a GPU, else the CPU twin."""
    import torch

    device = cfg.train.device.value
    if device == "auto":
        on_gpu = cfg.launcher.gpus_per_job > 0 if spec(cfg.launcher).remote else torch.cuda.is_available()
        device = "cuda" if on_gpu else "cpu"
    return "cuda" if device == "cuda" else "cpu-tensors"


def refuse(message: str) -> NoReturn:
    """Refuse the sweep before any job runs: one line on stderr, exit code 2 (bad input)."""
    print(f"dpsweep: error: {message}", flush=True, file=sys.stderr)
    raise SystemExit(EXIT_BAD_INPUT)
