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
"""

from __future__ import annotations

import contextlib
import json
import logging
from typing import Any

import optuna
from hydra.core.utils import JobReturn, JobStatus

from dpsweep.launchers.nodes import OptunaSearchConf
from dpsweep.launchers.overrides import new_sweep_id, string_override

log = logging.getLogger(__name__)


class OptunaSearch:
    """Runs a study through a dpsweep sweeper's launcher (the sweeper composes and launches jobs)."""

    def __init__(self, conf: OptunaSearchConf, sweeper: Any) -> None:
        self.conf = conf
        self.sweeper = sweeper

    def run(self, arguments: list[str]) -> Any:
        from dpsweep.config import ConfigError, TrackingConfig, flatten, to_config
        from dpsweep.errors import InputError
        from dpsweep.launchers.preflight import preflight, refuse
        from dpsweep.launchers.search import OBJECTIVES, SAMPLERS, check_search_space, grid_values
        from dpsweep.memory.stages import carried_baseline
        from dpsweep.run.pruning import open_storage
        from dpsweep.tracking import close_orphaned_runs, terminate_as_interrupt, tracked_run

        launcher = self.sweeper.launcher
        assert launcher is not None
        c = self.conf
        sweep_id = new_sweep_id()
        base = self.sweeper.compose_job([*arguments, string_override("sweep.id", sweep_id)])
        try:
            from hydra.core.override_parser.overrides_parser import OverridesParser

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
            distributions = check_search_space(c.params, list(flatten(to_config(base))), objective, c.sampler)
            grid = {name: grid_values(name, spec) for name, spec in c.params.items()} if c.sampler == "grid" else {}
            storage = open_storage(c.storage)
        except InputError as err:
            refuse(str(err))
        preflight([base], [arguments])
        typed = to_config(base)
        metrics = objective.metric_names(typed.task.objective)
        study = optuna.create_study(
            study_name=c.study_name, storage=storage, sampler=sampler_spec.build(c.seed, grid),
            directions=[optuna.study.StudyDirection[d.upper()] for d in objective.directions], load_if_exists=True,
        )  # fmt: skip
        for stale in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
            study.tell(stale.number, state=optuna.trial.TrialState.FAIL)  # left by an interrupted sweep

        parent_cfg = TrackingConfig(typed.tracking.uri, typed.tracking.experiment_name, f"study-{c.study_name}")
        tags = {
            "sweep.id": sweep_id,
            "sweep.role": "parent",
            "optuna.study": c.study_name,
            "sweep.launcher": typed.launcher.name,
        }
        failed = told = 0
        aborted = None
        # inline trials, one after another here, carry the memory census's baseline (dpsweep.memory.stages)
        carried = carried_baseline() if typed.launcher.name == "inline" else contextlib.nullcontext()
        with terminate_as_interrupt(), tracked_run(parent_cfg, tags) as parent, carried:
            parent.log_params(
                {
                    "optuna.sampler": c.sampler,
                    "optuna.objective": c.objective,
                    "optuna.n_trials": c.n_trials,
                    "optuna.n_jobs": c.n_jobs,
                    "optuna.storage": c.storage,
                    "sweep.overrides": " ".join(arguments),
                }
            )
            while (remaining := c.n_trials - _counted(study)) > 0 and not _exhausted(study):
                trials = [study.ask(distributions) for _ in range(min(c.n_jobs, remaining))]
                jobs = [
                    self._job(arguments, sweep_id, parent.run_id, t, objective.extra_overrides(c.epsilon_budget))
                    for t in trials
                ]
                results = launcher.launch(jobs, initial_job_idx=trials[0].number)
                for trial, result in zip(trials, results, strict=True):
                    state, values = self._outcome(typed, sweep_id, trial.number, result, metrics)
                    _tell(study, trial.number, values, state)
                    told += 1
                    failed += state == optuna.trial.TrialState.FAIL
                    log.info(f"trial {trial.number}: {state.name} {values or ''} {trial.params}")
                if told >= typed.sweep.min_jobs_for_failure_rate and failed / told > typed.sweep.max_failure_rate:
                    rate = typed.sweep.max_failure_rate
                    aborted = (
                        f"stopping study {c.study_name}: {failed} of {told} trials failed "
                        f"({failed / told:.0%} > sweep.max_failure_rate={rate:.0%})"
                    )
                    break
            best = _best(study, objective.multi)
            parent.log_text(json.dumps(best, indent=1), "pareto.json" if objective.multi else "best.json")
            parent.log_metrics({"optuna.trials": len(study.trials), "optuna.failed_this_run": failed})
            # trials killed outright (SIGKILL, OOM killer, scancel) could not close their runs
            close_orphaned_runs(typed.tracking.uri, typed.tracking.experiment_name, sweep_id)
            if aborted:
                parent.set_tags({"error": aborted, "failure.kind": "failure_rate"})
        print(_summary(c.study_name, study, best, objective.multi, metrics), flush=True)
        if aborted:
            print(f"dpsweep: {aborted}", flush=True)
            raise SystemExit(1)
        return best

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
        from dpsweep.tracking.store import trial_run  # an MLflow entity: read here, with Optuna loaded

        run = trial_run(typed.tracking.uri, typed.tracking.experiment_name, sweep_id, number)
        if run is not None and run.data.tags.get("optuna.pruned") == "true":
            return optuna.trial.TrialState.PRUNED, None
        if result.status != JobStatus.COMPLETED or run is None or run.info.status != "FINISHED":
            return optuna.trial.TrialState.FAIL, None
        if any(m not in run.data.metrics for m in metrics):
            return optuna.trial.TrialState.FAIL, None
        return optuna.trial.TrialState.COMPLETE, [run.data.metrics[m] for m in metrics]


def _tell(study: optuna.Study, number: int, values: list[float] | None, state: optuna.trial.TrialState) -> None:
    try:
        study.tell(number, values=values, state=state)
    except RuntimeError as err:  # the grid sampler calls study.stop() once the grid is done
        if "Study.stop" not in str(err):
            raise


def _exhausted(study: optuna.Study) -> bool:
    sampler = study.sampler
    return isinstance(sampler, optuna.samplers.GridSampler) and sampler.is_exhausted(study)


def _counted(study: optuna.Study) -> int:
    """Trials that count toward n_trials: every finished one (complete, pruned or failed)."""
    return sum(t.state.is_finished() for t in study.get_trials(deepcopy=False))


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
