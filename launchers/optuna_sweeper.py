"""Optuna studies inside dpsweep's sweeper, on current Optuna (the hydra-optuna-sweeper package pins optuna < 3).

    dpsweep -m search=accuracy_tpe                                # conf/search/accuracy_tpe.yaml
    dpsweep -m search=accuracy_tpe hydra.sweeper.optuna.n_trials=9 # resume the same study up to 9 trials
    dpsweep -m search=pareto_nsga2 launcher=slurm                 # trials as Slurm jobs, n_jobs at a time

A ``hydra.sweeper.optuna`` block (conf/search/*.yaml) turns the dpsweep sweeper's grid into a study.

Trials are asked in batches of ``n_jobs`` and launched through any launcher (inline, local, slurm,
sge). Each trial is one dpsweep job whose MLflow run is a child of the study's parent run, tagged
``optuna.study`` and ``optuna.trial``; the trial's values are read back from that run. A failed trial
is told FAIL and the study goes on; a pruned one (``pruner: median``: jobs report test_accuracy per
epoch through the storage) is told PRUNED and keeps its partial metrics in MLflow. Re-running with
the same ``study_name`` and storage resumes the study: numbering continues and earlier trials count
toward ``n_trials``. Multi-objective studies print their Pareto set and log it to the parent run.

Several drivers may share a study (each asks its own trials), and may be started at once, Optuna's
way to run a study in parallel. A trial names its driver's process and the driver beats every
HEARTBEAT_S while it runs (trial user attributes ``dpsweep.driver`` and ``dpsweep.heartbeat``); a
driver fails, when it starts and before each batch it asks, only the RUNNING trials whose driver is
gone, by the rule that ends dead MLflow runs (``dpsweep.tracking.why_dead``); when it starts it
also ends their runs KILLED. Drivers take :func:`storage_lock` to create the storage and the study
(Optuna's table creation is not safe against a second process doing the same: the loser would
find the storage "invalid") and to count the study's trials and ask new ones, so that drivers
started together keep to ``n_trials`` (every trial in the study counts, the other drivers' running
ones included). The lock is an OS file lock: it holds for the drivers of one host, and of hosts
that share the file system of a sqlite or journal storage; drivers on several hosts sharing a
server's storage (PostgreSQL) may each ask a batch before they see the other's, up to ``n_jobs - 1``
trials more than ``n_trials`` per extra driver. A driver's sampler is seeded with ``seed`` plus the
trials already in the study plus the drivers started on it before (study user attribute
``dpsweep.drivers``), so that no two drivers, resumed or started at once, draw the same trials.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import optuna
from hydra.core.utils import JobReturn, JobStatus
from optuna.distributions import BaseDistribution

from dpsweep.launchers.nodes import OptunaSearchConf
from dpsweep.launchers.overrides import new_sweep_id, string_override
from dpsweep.launchers.search import Objective, SamplerSpec
from dpsweep.launchers.session import SweepSession
from dpsweep.process.liveness import ProcessId, heartbeat
from dpsweep.tracking import HEARTBEAT_S, HEARTBEAT_TAG, PROCESS_TAG, why_dead

log = logging.getLogger(__name__)
DRIVER_ATTR = "dpsweep.driver"  # the process token of the driver that asked the trial
BEAT_ATTR = "dpsweep.heartbeat"  # when that driver last beat (seconds since the epoch)
DRIVERS_ATTR = "dpsweep.drivers"  # study user attribute: how many drivers have started on the study


@dataclass(frozen=True)
class Space:
    """A checked study: its objective, sampler, search space (and grid, for the grid sampler), storage."""

    objective: Objective
    sampler: SamplerSpec
    distributions: dict[str, BaseDistribution]
    grid: dict[str, list[Any]]
    storage: optuna.storages.BaseStorage


class OptunaSearch:
    """Runs a study through a dpsweep sweeper's launcher (the sweeper composes and launches jobs)."""

    def __init__(self, conf: OptunaSearchConf, sweeper: Any) -> None:
        self.conf = conf
        self.sweeper = sweeper

    def run(self, arguments: list[str]) -> Any:
        from dpsweep.config import to_config
        from dpsweep.launchers.preflight import preflight

        c = self.conf
        sweep_id = new_sweep_id()
        base = self.sweeper.compose_job([*arguments, string_override("sweep.id", sweep_id)])
        space = self._space(arguments, base)
        preflight([base], [arguments])
        typed = to_config(base)
        metrics = space.objective.metric_names(typed.task.objective)
        with storage_lock(c.storage):  # drivers started together: one creates the study, the others load it
            study = optuna.create_study(
                study_name=c.study_name, storage=space.storage, sampler=space.sampler.build(c.seed, space.grid),
                directions=[optuna.study.StudyDirection[d.upper()] for d in space.objective.directions],
                load_if_exists=True,
            )  # fmt: skip
            # resumed, or started beside another driver: not the other drivers' draws again
            before = int(study.user_attrs.get(DRIVERS_ATTR, 0))
            study.set_user_attr(DRIVERS_ATTR, before + 1)
            if (offset := len(study.get_trials(deepcopy=False)) + before) and c.seed is not None:
                study.sampler = space.sampler.build(c.seed + offset, space.grid)
            self._fail_dead(study)

        session = SweepSession(typed, sweep_id)
        session.close_dead_runs()  # the runs of the dead drivers' trials
        params = {
            "optuna.sampler": c.sampler, "optuna.objective": c.objective, "optuna.n_trials": c.n_trials,
            "optuna.n_jobs": c.n_jobs, "optuna.storage": c.storage, "sweep.overrides": " ".join(arguments),
        }  # fmt: skip
        with session.parent_run(f"study-{c.study_name}", {"optuna.study": c.study_name}, params) as parent:
            failed, aborted = self._trials(session, study, space, arguments, metrics)
            best = _best(study, space.objective.multi)
            parent.log_text(json.dumps(best, indent=1), "pareto.json" if space.objective.multi else "best.json")
            parent.log_metrics({"optuna.trials": len(study.trials), "optuna.failed_this_run": failed})
            session.close_orphans()  # trials killed outright (SIGKILL, OOM killer, scancel) could not close their runs
            if aborted:
                parent.set_tags({"error": aborted, "failure.kind": "failure_rate"})
        summary = _summary(c.study_name, study, best, space.objective.multi, metrics)
        session.end([summary, *([f"dpsweep: {aborted}"] if aborted else [])], failed=bool(aborted))
        return best

    def _space(self, arguments: list[str], base: Any) -> Space:
        """The study's objective, sampler, search space and storage; bad input is refused (exit code 2)."""
        from hydra.core.override_parser.overrides_parser import OverridesParser

        from dpsweep.config import ConfigError, flatten, to_config, trials_per_device
        from dpsweep.errors import InputError
        from dpsweep.launchers.preflight import refuse
        from dpsweep.launchers.search import OBJECTIVES, SAMPLERS, check_search_space, grid_values

        c = self.conf
        try:
            if any(o.is_sweep_override() for o in OverridesParser.create().parse_overrides(arguments)):
                raise ConfigError(
                    "overrides", arguments, "fixed values only: the search space is hydra.sweeper.optuna.params"
                )
            if c.n_trials <= 0:
                raise ConfigError("hydra.sweeper.optuna.n_trials", c.n_trials, "a positive number of trials")
            if c.n_jobs <= 0:
                raise ConfigError("hydra.sweeper.optuna.n_jobs", c.n_jobs, "a positive number of trials at once")
            objective = OBJECTIVES.get(c.objective, key="hydra.sweeper.optuna.objective")
            sampler_spec = SAMPLERS.get(c.sampler, key="hydra.sweeper.optuna.sampler")
            if sampler_spec.multi_objective_only and not objective.multi:
                raise ConfigError(
                    "hydra.sweeper.optuna.sampler", c.sampler, "a single-objective sampler (tpe, random, grid) for "
                    f"objective {c.objective}, or a multi-objective objective (accuracy_epsilon)",
                )  # fmt: skip
            if c.objective == "accuracy_under_budget" and (c.epsilon_budget is None or c.epsilon_budget <= 0):
                raise ConfigError(
                    "hydra.sweeper.optuna.epsilon_budget", c.epsilon_budget, "a positive ε for this objective"
                )
            if c.pruner is not None and objective.multi:
                raise ConfigError(
                    "hydra.sweeper.optuna.pruner", c.pruner, "null: Optuna prunes single-objective studies only"
                )
            typed = to_config(base)
            if trials_per_device(typed.launcher) is None:
                raise ConfigError(
                    "launcher.trials_per_device", "auto", "a number of trials with an Optuna search (its trials, "
                    "and so their peaks, are not known before they are asked)",
                )  # fmt: skip
            keys, launcher_name = list(flatten(typed)), typed.launcher.name
            distributions = check_search_space(c.params, keys, objective, c.sampler, launcher_name)
            grid = {name: grid_values(name, spec) for name, spec in c.params.items()} if c.sampler == "grid" else {}
            storage = open_locked(c.storage)
        except InputError as err:
            refuse(str(err))
        return Space(objective, sampler_spec, distributions, grid, storage)

    def _trials(
        self, session: SweepSession, study: optuna.Study, space: Space, arguments: list[str], metrics: tuple[str, ...]
    ) -> tuple[int, str | None]:
        """Ask, launch and tell trials in batches of n_jobs until n_trials are counted (or the grid is
        done): the trials failed in this run, and why the failure policy stopped the study (None: it did not)."""
        from dpsweep.config import trials_per_device
        from dpsweep.config.launcher import trials_per_job
        from dpsweep.launchers.base import DpsweepLauncher

        c, launcher = self.conf, self.sweeper.launcher
        assert launcher is not None and session.parent is not None
        if isinstance(launcher, DpsweepLauncher):  # not a Hydra launcher a user chose (hydra/launcher=...)
            # K trials per device: a batch of n_jobs in jobs of K
            launcher.trials_per_device = trials_per_device(session.first.launcher) or 1
            launcher.trials_per_job = trials_per_job(session.first.launcher)  # T in turn: a batch in jobs of T
            launcher.take_ranks(session.first.train)  # spec.rank_tasks: one task a rank of each trial's run
        failed = told = 0
        while trials := self._ask_batch(study, space):
            extra = space.objective.extra_overrides(c.epsilon_budget)
            jobs = [self._job(arguments, session.sweep_id, session.parent.run_id, t, extra) for t in trials]
            with _beating(trials):
                results = launcher.launch(jobs, initial_job_idx=trials[0].number)
            for trial, result in zip(trials, results, strict=True):
                state, values = self._outcome(session.first, session.sweep_id, trial.number, result, metrics)
                _tell(study, trial.number, values, state)
                told += 1
                failed += state == optuna.trial.TrialState.FAIL
                print(f"dpsweep: trial {trial.number}: {state.name} {values or ''} {trial.params}", flush=True)
            if (why := session.failure_rate(failed, told, "trials")) is not None:
                return failed, f"stopping study {c.study_name}: {why}"
        return failed, None

    def _ask_batch(self, study: optuna.Study, space: Space) -> list[optuna.Trial]:
        """The next batch: up to n_jobs new trials, as many as n_trials leaves, none once the grid is
        done. Counted and asked under :func:`storage_lock`, after the dead drivers' trials are failed,
        with every trial in the study counted (a live driver's running trials finish, and count then):
        two drivers that counted at once would otherwise both ask the last trials."""
        c = self.conf
        with storage_lock(c.storage):
            self._fail_dead(study)
            remaining = c.n_trials - len(study.get_trials(deepcopy=False))
            if remaining <= 0 or _exhausted(study):
                return []
            return [_ask(study, space) for _ in range(min(c.n_jobs, remaining))]

    @staticmethod
    def _fail_dead(study: optuna.Study) -> None:
        for number, why in _fail_dead_trials(study):
            print(f"dpsweep: trial {number}: FAIL ({why})", flush=True)

    def _job(
        self, arguments: list[str], sweep_id: str, parent: str, trial: optuna.Trial, extra: list[str]
    ) -> list[str]:
        c = self.conf
        values = [f"{name}={_override_value(value)}" for name, value in trial.params.items()]
        meta = [string_override("sweep.id", sweep_id), string_override("sweep.parent_run_id", parent),
                string_override("sweep.study", c.study_name), f"sweep.trial={trial.number}",
                string_override("sweep.storage", c.storage)]  # fmt: skip
        if c.pruner:
            meta.append(f"sweep.pruner={c.pruner}")
        return [*arguments, *values, *extra, *meta]

    @staticmethod
    def _outcome(
        typed: Any, sweep_id: str, number: int, result: JobReturn, metrics: tuple[str, ...]
    ) -> tuple[optuna.trial.TrialState, list[float] | None]:
        """The trial's state and values, read from its MLflow run."""
        from dpsweep.tracking.sweeps import trial_run  # an MLflow entity: read here, with Optuna loaded

        run = trial_run(typed.tracking.uri, typed.tracking.experiment_name, sweep_id, number)
        if run is not None and run.data.tags.get("optuna.pruned") == "true":
            return optuna.trial.TrialState.PRUNED, None
        if result.status != JobStatus.COMPLETED or run is None or run.info.status != "FINISHED":
            return optuna.trial.TrialState.FAIL, None
        if any(m not in run.data.metrics for m in metrics):
            return optuna.trial.TrialState.FAIL, None
        return optuna.trial.TrialState.COMPLETE, [run.data.metrics[m] for m in metrics]


@contextmanager
def storage_lock(url: str) -> Iterator[None]:
    """An exclusive OS file lock (``flock``) on the Optuna storage ``url``, for what two drivers must
    not do at once: create its tables, and count a study's trials and ask new ones. The file is
    ``<file>.dpsweep.lock`` beside a sqlite or journal storage (so it holds across the hosts that share
    that file system, as the storage itself does; not ``<file>.lock``, which Optuna's journal takes), and
    for a server's storage (or where that file cannot be made) ``dpsweep-optuna-<uid>-<hash of the
    URL>.lock`` in the user's runtime directory ($XDG_RUNTIME_DIR, else the temporary directory):
    the drivers of one host. As :func:`dpsweep.tracking.store.store_lock` does for the MLflow store."""
    lock = None
    for prefix in ("sqlite:///", "journal://"):
        path = url[len(prefix) :].partition("?")[0] if url.startswith(prefix) else ""
        if path not in ("", ":memory:"):
            with contextlib.suppress(OSError):  # a missing directory: open_storage refuses it, not this
                lock = open(f"{path}.dpsweep.lock", "a")  # noqa: SIM115 (closed below)
    if lock is None:
        folder = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
        digest = hashlib.sha256(url.encode()).hexdigest()[:16]
        lock = open(os.path.join(folder, f"dpsweep-optuna-{os.getuid()}-{digest}.lock"), "a")  # noqa: SIM115
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


def open_locked(url: str) -> optuna.storages.BaseStorage:
    """The storage at ``url`` (``dpsweep.run.pruning.open_storage``), opened under :func:`storage_lock`:
    of drivers started together on a new storage, one creates its tables and the others find them."""
    from dpsweep.run.pruning import open_storage

    with storage_lock(url):
        return open_storage(url)


def _ask(study: optuna.Study, space: Space) -> optuna.Trial:
    """A new trial, named as this driver's (it beats while the trial runs: :func:`_beating`)."""
    trial = study.ask(space.distributions)
    trial.set_user_attr(DRIVER_ATTR, ProcessId.current().token)
    trial.set_user_attr(BEAT_ATTR, time.time())
    return trial


@contextmanager
def _beating(trials: list[optuna.Trial]) -> Iterator[None]:
    """This driver's heartbeat on ``trials`` while they run."""

    def beat() -> None:
        now = time.time()
        for trial in trials:
            trial.set_user_attr(BEAT_ATTR, now)

    with heartbeat(beat, HEARTBEAT_S):
        yield


def _fail_dead_trials(study: optuna.Study) -> list[tuple[int, str]]:
    """Tell FAIL the RUNNING trials whose driver is gone (a live driver's, on this host or another,
    are left to it); each one's number and why. A trial that names no driver was asked before
    drivers were named, and is failed as before."""
    failed = []
    now = time.time()
    for trial in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        attrs = trial.user_attrs
        why = "asked by an interrupted sweep"
        if DRIVER_ATTR in attrs:
            tags = {PROCESS_TAG: str(attrs[DRIVER_ATTR]), HEARTBEAT_TAG: str(attrs.get(BEAT_ATTR, now))}
            dead = why_dead(tags, now)
            if dead is None:
                continue
            why = f"its driver: {dead}"
        if _tell(study, trial.number, None, optuna.trial.TrialState.FAIL):
            failed.append((trial.number, why))
    return failed


def _tell(study: optuna.Study, number: int, values: list[float] | None, state: optuna.trial.TrialState) -> bool:
    """Tell the trial's outcome; False where it was told already (another driver judged it dead)."""
    try:
        study.tell(number, values=values, state=state)
    except RuntimeError as err:  # the grid sampler calls study.stop() once the grid is done
        if "Study.stop" not in str(err):
            raise
    except ValueError as err:
        if "Cannot tell a" not in str(err):
            raise
        print(f"dpsweep: trial {number}: not told {state.name}: {err}", file=sys.stderr, flush=True)
        return False
    return True


def _exhausted(study: optuna.Study) -> bool:
    sampler = study.sampler
    return isinstance(sampler, optuna.samplers.GridSampler) and sampler.is_exhausted(study)


def _override_value(value: Any) -> str:
    return repr(value) if isinstance(value, float) else str(value)


def _best(study: optuna.Study, multi: bool) -> list[dict[str, Any]]:
    complete = [t for t in study.get_trials(deepcopy=False) if t.state == optuna.trial.TrialState.COMPLETE]
    if not complete:
        return []
    trials = study.best_trials if multi else [study.best_trial]
    return [{"trial": t.number, "values": t.values, "params": t.params} for t in trials]


def _summary(name: str, study: optuna.Study, best: list[dict[str, Any]], multi: bool, metrics: tuple[str, ...]) -> str:
    states = [t.state.name for t in study.get_trials(deepcopy=False)]
    counts = ", ".join(f"{states.count(s)} {s.lower()}" for s in ("COMPLETE", "PRUNED", "FAIL") if s in states)
    lines = [f"dpsweep: study {name}: {len(states)} trials ({counts})"]
    title = "Pareto set" if multi else "best trial"
    for b in best:
        shown = ", ".join(f"{m}={v:.4g}" for m, v in zip(metrics, b["values"], strict=True))
        lines.append(f"  {title}: trial {b['trial']}: {shown}  {b['params']}")
    return "\n".join(lines)
