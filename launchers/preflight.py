"""Before a sweep or study launches anything: every check that can reject it, and one way to refuse.

    preflight(configs, jobs)    # each job's run plan, the launcher's resources and tools, tracking URIs
    refuse("why")               # one line on stderr, exit code 2

Shared by the grid sweeper (``dpsweep.launchers.sweeper``) and the Optuna study
(``dpsweep.launchers.optuna_sweeper``).
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from omegaconf import DictConfig

from dpsweep.config import Config, given_overrides
from dpsweep.errors import EXIT_BAD_INPUT, InputError

SUBMIT_COMMANDS = {"slurm": "sbatch", "sge": "qsub"}  # launchers that need a scheduler's client tools


def preflight(configs: Sequence[Config | DictConfig], jobs: Sequence[Sequence[str]]) -> None:
    """Every check that can reject the sweep, before any job is launched: each job's run plan
    (``dpsweep.plan.prepare``: ranges, B <= N and δ < 1/N with N read once per dataset, σ
    calibration, the memory model and its physical batch), the launcher's resources and client
    tools, and the tracking URIs. Bad input exits with code 2 (:func:`refuse`)."""
    from dpsweep.config import to_config, validate_launcher
    from dpsweep.plan import FactsCache, MemoryFiles, prepare
    from dpsweep.tracking import check_reachable, ensure_experiments

    typed = [to_config(c) for c in configs]
    facts, memory_files = FactsCache(), MemoryFiles()
    for cfg, job in zip(typed, jobs, strict=True):
        try:
            prepare(cfg, facts(cfg), memory_files.budget(cfg, job_backend(cfg)))
        except InputError as err:
            refuse(f"job {' '.join(given_overrides(job))}: {err}")
    launcher = typed[0].launcher
    try:
        validate_launcher(launcher)
    except InputError as err:
        refuse(str(err))
    command = SUBMIT_COMMANDS.get(launcher.name)
    if command and shutil.which(command) is None:
        refuse(
            f"launcher={launcher.name} needs '{command}' on PATH, and it is not there: run dpsweep on a "
            f"{launcher.name} submit host (or load its module), or use launcher=local"
        )
    for uri in sorted({cfg.tracking.uri for cfg in typed}):
        try:
            check_reachable(uri)
        except ConnectionError as err:
            refuse(str(err))
    ensure_experiments({(cfg.tracking.uri, cfg.tracking.experiment_name) for cfg in typed})


def job_backend(cfg: Any) -> str:
    """The memory backend a job will measure with: cuda when it gets a GPU, else the CPU twin."""
    import torch

    device = cfg.train.device.value
    if device == "auto":
        remote = cfg.launcher.name in ("slurm", "sge")
        on_gpu = cfg.launcher.gpus_per_job > 0 if remote else torch.cuda.is_available()
        device = "cuda" if on_gpu else "cpu"
    return "cuda" if device == "cuda" else "cpu-tensors"


def refuse(message: str) -> NoReturn:
    """Refuse the sweep before any job runs: one line on stderr, exit code 2 (bad input)."""
    print(f"dpsweep: error: {message}", flush=True, file=sys.stderr)
    raise SystemExit(EXIT_BAD_INPUT)
