"""What ``dpsweep`` checks before it prints a line, imports torch or MLflow, or creates a file (issue 56,
items 6 and 7): bad input is refused in a second, with nothing left behind, and a good command's first
line comes as soon as its config is composed.

    checked = composed_and_checked(argv)   # the run's config, or every job of the sweep (-m), composed
    print(checked.first_line)              # and range-checked; the first line says what will run
    check_plans(checked)                   # then each job's plan (N, δ, σ), as the run or sweeper would

Both raise :class:`~dpsweep.errors.InputError` (the ``dpsweep`` command: one line, exit code 2). The
config is composed by Hydra's compose API on the same config tree as the app; a sweep's jobs are
expanded (``dpsweep.launchers.expand``) and composed (``dpsweep.launchers.composed``) as its sweeper
does, and checked by the sweeper's own checks (``dpsweep.launchers.preflight``), with its messages. The
run and the sweeper check again when they start (cheap: most of the cost is imports they need anyway).

Only checks that need torch are left to the run: the devices (``train.device=cuda``, ``train.devices``),
and a dataset read from its files (digits is described without them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dpsweep.cli.composing import CONFIG_MODULE, composition_refused, sweep_jobs
from dpsweep.config import ConfigError
from dpsweep.config.launcher import either, launchers_where, spec

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from dpsweep.config import Config

MULTIRUN_FLAGS = ("-m", "--multirun")
HYDRA_RUNTIME = "${hydra:"  # Hydra's resolver of the running job's config: set only inside the app


def submits(launcher: str) -> bool:
    """Whether ``launcher`` submits its jobs to a cluster's scheduler (its spec's): sweeps only, as a single
    run would train here."""
    return spec(launcher).scheduler is not None


@dataclass(frozen=True)
class Checked:
    """A command line composed and checked: its first line, and each job's typed config and overrides."""

    first_line: str | None  # None: a run whose output directory cannot be told before Hydra makes it
    configs: list[Config]
    jobs: list[list[str]]
    sweep: bool  # -m
    run_dir: str | None = None  # a run's output directory (hydra.run.dir) as resolved for the first line


def scheduler_refusal(launcher: str) -> ConfigError:
    """A single run given a scheduler's launcher: it would train here; a scheduler takes sweeps."""
    here = either(launchers_where(lambda s: not s.remote))
    return ConfigError(
        "launcher", launcher, f"{here} for a run on this machine; a scheduler takes sweeps: "
        f"add -m to submit this run as a sweep of one job (dpsweep -m launcher={launcher} ...)",
    )  # fmt: skip


def composed_and_checked(argv: Sequence[str]) -> Checked | None:
    """The run's config, or every job of the sweep (``-m``, or ``hydra.mode=MULTIRUN``), composed and
    checked for what needs no data (the ranges of ``dpsweep.config.validate``; a sweep's launcher and its
    scheduler's tools). Hydra's composition errors are raised as InputError (``dpsweep.cli.composing``).
    None where a key interpolates Hydra's runtime config (``${hydra:runtime.output_dir}``), which only
    the app has: the app checks that config itself, as it did before these checks."""
    from hydra import initialize_config_module

    if any(HYDRA_RUNTIME in a for a in argv):
        return None
    overrides = [a for a in argv if a not in MULTIRUN_FLAGS]
    sweep = len(overrides) < len(argv) or "hydra.mode=MULTIRUN" in overrides
    with initialize_config_module(CONFIG_MODULE, version_base="1.3"), composition_refused(argv):
        return _sweep(overrides) if sweep else _run(overrides)


def _needs_hydra(cfg: DictConfig) -> bool:
    """Whether a key outside ``hydra`` interpolates Hydra's runtime config (:data:`HYDRA_RUNTIME`)."""
    from omegaconf import OmegaConf

    container = OmegaConf.to_container(cfg, resolve=False)
    assert isinstance(container, dict)
    container.pop("hydra", None)
    return HYDRA_RUNTIME in repr(container)


def check_plans(checked: Checked) -> None:
    """Each job's run plan (``dpsweep.plan.prepare``) and, for a sweep, its tracking URIs reachable
    (``dpsweep.launchers.preflight.check_plans``)."""
    from dpsweep.launchers import preflight

    preflight.check_plans(checked.configs, checked.jobs, sweep=checked.sweep)


def _run(overrides: list[str]) -> Checked | None:
    from hydra import compose
    from omegaconf import OmegaConf, open_dict

    from dpsweep.cli.lines import start_line
    from dpsweep.config import to_config
    from dpsweep.mechanisms import engines

    cfg = compose("config", overrides=overrides, return_hydra_config=True)
    if _needs_hydra(cfg):
        return None
    run_dir = _resolved(cfg, "hydra.run.dir")
    with open_dict(cfg):
        del cfg["hydra"]
    launcher = str(OmegaConf.select(cfg, "launcher.name"))
    if submits(launcher):  # an unknown name: refused, with the valid ones
        raise scheduler_refusal(launcher)
    config = to_config(cfg)
    engines.checked(config)  # the ranges, and the task's, mechanism's and engine's declarations (no torch)
    line = start_line(cfg, str(Path(run_dir).absolute())) if run_dir is not None else None
    return Checked(line, [config], [overrides], sweep=False, run_dir=run_dir)


def _sweep(overrides: list[str]) -> Checked | None:
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from dpsweep.config.schema import swept_keys
    from dpsweep.launchers.composed import ComposedJobs
    from dpsweep.launchers.preflight import check_launcher, check_ranges, check_rank_shapes, check_search

    jobs, master = sweep_jobs(overrides)
    if _needs_hydra(master):
        return None
    composer = ComposedJobs(GlobalHydra.instance().config_loader(), keep=False)  # as the sweeper composes
    configs = [composer.typed(master, job) for job in jobs]
    study = OmegaConf.select(master, "hydra.sweeper.optuna") is not None
    check_search(study, bool(OmegaConf.select(master, "hydra.sweeper.params")), configs[0].sweep.private_tuning)
    check_ranges(configs, jobs)
    launcher = configs[0].launcher
    check_launcher(launcher)
    check_rank_shapes(configs)
    axes = swept_keys(jobs)
    what = f"a sweep of {len(jobs)} job{'s' * (len(jobs) != 1)}"
    if study:
        optuna = master.hydra.sweeper.optuna
        what = f"an Optuna study {optuna.study_name} of {optuna.n_trials} trials"
    elif configs[0].sweep.private_tuning:
        what = f"a private tuning drawn from {what}"
    over = f" over {', '.join(axes)}" if axes else ""
    line = f"dpsweep: {what}{over} (launcher={launcher.name})"
    return Checked(line, configs, jobs, sweep=True)


def _resolved(cfg: DictConfig, key: str) -> str | None:
    """``key`` of ``cfg`` resolved (``${now:...}`` now); None where it cannot be before Hydra runs the job
    (an interpolation of Hydra's own fields, such as the job's name, which the app sets when it runs)."""
    from omegaconf import OmegaConf

    parent, _, leaf = key.rpartition(".")
    raw = OmegaConf.to_container(OmegaConf.select(cfg, parent), resolve=False)
    if not isinstance(raw, dict) or "hydra" in str(raw.get(leaf)):
        return None
    try:
        value = OmegaConf.select(cfg, key)
    except Exception:  # any resolver's error: the app resolves it itself, and says so
        return None
    return str(value) if value is not None else None
