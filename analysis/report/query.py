"""Reading runs from MLflow into pandas frames: one row per run, with its outcome, task, score and config.

Runs are read with one paginated ``MlflowClient.search_runs`` query (metric histories only for the
few runs of the accuracy-against-epoch plot). Memory probes (tag ``probe=true``) and a sweep's
parent run (tag ``sweep.role=parent``) are never part of a report. Runs that did not finish count
as failed, pruned (KILLED with tag ``optuna.pruned=true``) or running.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import pandas as pd
from mlflow.entities import Run, ViewType
from mlflow.tracking import MlflowClient

from dpsweep.analysis.report.cells import few
from dpsweep.analysis.report.columns import (
    DECIDED_PARAMS,
    NOT_HYPERPARAMETERS,
    OUTCOME_ORDER,
    OUTCOMES,
    RELEASED,
    REPLICATE_PARAMS,
    WITHHELD,
    ReportError,
    column,
    param_or_tag,
    run_tasks,
)
from dpsweep.config import identity, task_objectives
from dpsweep.run.divergence import DIVERGED_TAG

PAGE_SIZE = 10_000  # runs per search_runs page (MLflow allows up to 50,000)


def search_runs(
    uri: str, experiment: str, sweep_id: str | None = None, filter_string: str = "", page_size: int = PAGE_SIZE
) -> pd.DataFrame:
    """All active runs of ``experiment`` (tagged ``sweep.id=<sweep_id>`` when given), one row each,
    in the layout of ``mlflow.search_runs``: run_id, status, start_time (ms), ``params.*``,
    ``metrics.*`` (final values), ``tags.*``. Parent runs and probes are included; see report_runs.
    A private tuning's released trial has no ``sweep.id`` (it would lead to the parent run, which holds
    K: ``dpsweep.tracking.sweeps.release_best``): the sweep's includes it by its parent run's tag
    ``tuning.best_run_id`` (:func:`_released_trials`)."""
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        names = sorted(e.name for e in client.search_experiments())
        raise ReportError("experiment", experiment, f"no such experiment at {uri}; experiments there: {few(names)}")
    filters = [filter_string] if filter_string else []
    if sweep_id is not None:
        if "'" in sweep_id or "`" in sweep_id:
            raise ReportError("sweep", sweep_id, "a sweep id without quotes (12 characters, e.g. s3d13dc24edc)")
        filters.append(f"tags.`sweep.id` = '{sweep_id}'")
    runs = _paginate(client, str(exp.experiment_id), " and ".join(filters), page_size)
    if sweep_id is not None:
        runs += _released_trials(client, str(exp.experiment_id), runs, filter_string)
        runs.sort(key=lambda r: r.info.start_time or 0)  # as the search orders them
    if sweep_id is not None and not runs:
        ids = _sweep_ids(client, str(exp.experiment_id), page_size)
        raise ReportError(
            "sweep", sweep_id, f"no run of experiment {experiment!r} is tagged sweep.id={sweep_id}; sweeps there: {ids}"
        )
    return runs_frame(runs)


def _paginate(client: MlflowClient, experiment_id: str, filter_string: str, page_size: int) -> list[Run]:
    runs: list[Run] = []
    token: str | None = None
    while True:
        page = client.search_runs(
            [experiment_id], filter_string, ViewType.ACTIVE_ONLY, max_results=page_size,
            order_by=["attributes.start_time ASC"], page_token=token,
        )  # fmt: skip
        runs.extend(page)
        token = page.token
        if not token:
            return runs


def _released_trials(client: MlflowClient, experiment_id: str, runs: Sequence[Run], filter_string: str) -> list[Run]:
    """The released trials that the sweep's parent runs among ``runs`` name (tag ``tuning.best_run_id``)
    and ``runs`` lack, where active in the experiment and matching ``filter_string``."""
    have = {r.info.run_id for r in runs}
    named = {
        r.data.tags.get("tuning.best_run_id") for r in runs if r.data.tags.get("sweep.role") == "parent"
    } - have - {None, "none"}  # fmt: skip
    found: list[Run] = []
    for run_id in sorted(str(n) for n in named):
        if not run_id.isalnum():  # a run id is hex: nothing to quote in a filter
            continue
        where = " and ".join(f for f in (filter_string, f"attributes.run_id = '{run_id}'") if f)
        found += _paginate(client, experiment_id, where, 1)
    return found


def _sweep_ids(client: MlflowClient, experiment_id: str, page_size: int) -> str:
    counts: dict[str, int] = {}
    for run in _paginate(client, experiment_id, "", page_size):
        sid = run.data.tags.get("sweep.id")
        if sid and run.data.tags.get("sweep.role") != "parent":
            counts[sid] = counts.get(sid, 0) + 1
    return few([f"{sid} ({n} runs)" for sid, n in counts.items()])


def runs_frame(runs: Iterable[Run]) -> pd.DataFrame:
    """MLflow runs as one DataFrame row each, in ``mlflow.search_runs``'s column layout."""
    records = []
    for run in runs:
        record: dict[str, Any] = {
            "run_id": run.info.run_id,
            "status": run.info.status,
            "start_time": run.info.start_time,
        }
        record.update({f"params.{k}": v for k, v in run.data.params.items()})
        record.update({f"metrics.{k}": v for k, v in run.data.metrics.items()})
        record.update({f"tags.{k}": v for k, v in run.data.tags.items()})
        records.append(record)
    frame = pd.DataFrame.from_records(records)
    if frame.empty:
        frame = pd.DataFrame(columns=["run_id", "status", "start_time"])
    metric_columns = [c for c in frame.columns if c.startswith("metrics.")]
    frame[metric_columns] = frame[metric_columns].astype(float)
    return frame


def parent_run_id(raw: pd.DataFrame) -> str | None:
    """The sweep's parent run (tag ``sweep.role=parent``) among ``raw``, if any (the newest)."""
    parents = raw[column(raw, "tags.sweep.role") == "parent"]
    return None if parents.empty else str(parents.sort_values("start_time")["run_id"].iloc[-1])


def report_runs(raw: pd.DataFrame) -> pd.DataFrame:
    """The runs a report is about: ``raw`` without parent runs and memory probes, plus the columns
    ``outcome`` (finished, failed, pruned, running, duplicate, diverged), ``private`` (DP on), ``task`` (task.name),
    ``objective`` (the name of the task's objective metric; NaN for a task this dpsweep does not
    know), ``score`` (that metric's final value), ``tuning`` (:func:`tuning_roles`) and ``config_id``
    (equal for the runs of one row; a private tuning's released trial and its withheld ones have their own)."""
    keep = (column(raw, "tags.sweep.role") != "parent") & (column(raw, "tags.probe").astype(str).str.lower() != "true")
    runs = raw[keep].reset_index(drop=True)
    outcome = runs["status"].map(OUTCOMES).fillna("running")
    pruned = (runs["status"] == "KILLED") & (column(runs, "tags.optuna.pruned").astype(str).str.lower() == "true")
    runs["outcome"] = outcome.where(~pruned, "pruned")
    config_hash = column(runs, "tags.config.hash")
    finished = runs[(runs["outcome"] == "finished") & config_hash.notna()].sort_values("start_time")
    newest = finished.groupby(config_hash[finished.index], sort=False).tail(1).index
    runs.loc[finished.index.difference(newest), "outcome"] = "duplicate"
    diverged = (runs["outcome"] == "finished") & (column(runs, f"tags.{DIVERGED_TAG}").astype(str) == "true")
    runs.loc[diverged, "outcome"] = "diverged"
    runs["private"] = param_or_tag(runs, "dp.enabled").astype(str) == "True"
    runs["task"] = run_tasks(runs)
    runs["objective"] = runs["task"].map(task_objectives())
    runs["score"] = run_scores(runs)
    runs["tuning"] = tuning_roles(runs)
    keys = hyperparameter_keys(runs)
    values = runs[[f"params.{k}" for k in keys]].astype(object)
    values = values.where(values.notna(), None)
    runs["config_id"] = [_config_id(keys, row) for row in values.itertuples(index=False, name=None)]
    # a private tuning's trials are rows of their own, the released apart from the withheld: a row's runs
    # are one release (the released trial's ε is the whole procedure's, not that of a run of its config)
    trials = runs["tuning"].notna()
    sweeps = column(runs, "tags.sweep.id").astype(object).fillna("")
    runs.loc[trials, "config_id"] = [
        _config_id(["config", "sweep", "tuning"], [config, sweep, role])
        for config, sweep, role in zip(runs["config_id"][trials], sweeps[trials], runs["tuning"][trials], strict=True)
    ]
    return runs


def tuning_roles(runs: pd.DataFrame) -> pd.Series:
    """Each run's part in a private tuning (``sweep.private_tuning``): ``released`` (tag
    ``tuning.released=true``), ``withheld`` (any other run of the tuning: tagged ``tuning.released=false``
    or ``tuning.withheld``, or, before the release, a trial of it), None outside one."""
    released = column(runs, "tags.tuning.released").astype(str)
    trial = (
        released.isin(["true", "false"])
        | (column(runs, "tags.sweep.private_tuning").astype(str) == "True")
        | column(runs, "tags.tuning.withheld").notna()
    )
    roles = pd.Series(None, index=runs.index, dtype=object)
    roles[trial] = WITHHELD
    roles[trial & (released == "true")] = RELEASED
    return roles


def run_scores(runs: pd.DataFrame) -> pd.Series:
    """Each run's final value of its task's objective metric (``objective``); NaN where not logged."""
    score = pd.Series(np.nan, index=runs.index, dtype=float)
    for metric in runs["objective"].dropna().unique():
        mine = runs["objective"] == metric
        score[mine] = pd.to_numeric(column(runs, f"metrics.{metric}")[mine], errors="coerce")
    return score


def hyperparameter_keys(runs: pd.DataFrame) -> list[str]:
    """The params that make a row: dpsweep.config.identity() of the logged params, without the seed."""
    logged = [c.removeprefix("params.") for c in runs.columns if c.startswith("params.")]
    kept = identity(dict.fromkeys(logged))
    return sorted(k for k in kept if k not in REPLICATE_PARAMS + NOT_HYPERPARAMETERS + DECIDED_PARAMS)


def _config_id(keys: Sequence[str], values: Sequence[Any]) -> str:
    present = {k: v for k, v in zip(keys, values, strict=True) if v is not None}
    return hashlib.sha1(json.dumps(present, sort_keys=True).encode()).hexdigest()[:10]


def outcome_counts(runs: pd.DataFrame) -> dict[str, int]:
    """How many runs of the selection finished, failed, were pruned or are still running."""
    counts = runs["outcome"].value_counts() if "outcome" in runs else pd.Series(dtype=int)
    return {"total": len(runs), **{name: int(counts.get(name, 0)) for name in OUTCOME_ORDER}}


def best_runs(runs: pd.DataFrame, n: int = 3, private: bool | None = True) -> list[str]:
    """The ``n`` FINISHED runs with the highest final score (its task's objective, e.g. test accuracy):
    private ones (``private=True``), non-private ones (False) or any (None)."""
    done = runs[runs["outcome"] == "finished"]
    if private is not None:
        done = done[done["private"] == private]
    ranked = done.assign(_acc=done["score"]).dropna(subset=["_acc"])
    return ranked.sort_values(["_acc", "start_time"], ascending=[False, True])["run_id"].head(n).tolist()


def history_metrics(runs: pd.DataFrame, run_ids: Sequence[str]) -> list[str]:
    """The metrics curves.png reads for ``run_ids`` (runs of report_runs): their tasks' objectives
    (its task's objective), then epsilon."""
    chosen = runs[runs["run_id"].isin(run_ids)]
    return [*sorted(set(chosen["objective"].dropna())), "epsilon"]


def metric_histories(
    uri: str, run_ids: Sequence[str], metrics: Sequence[str] = ("test_accuracy", "epsilon")
) -> pd.DataFrame:
    """Per-step values (step = epoch) of ``metrics`` for a few runs: columns run_id, metric, step,
    value. One MLflow call per run and metric, so keep ``run_ids`` short."""
    client = MlflowClient(uri)
    rows = [
        (run_id, name, m.step, m.value)
        for run_id in run_ids
        for name in metrics
        for m in client.get_metric_history(run_id, name)
    ]
    frame = pd.DataFrame(rows, columns=["run_id", "metric", "step", "value"])
    return frame.sort_values(["run_id", "metric", "step"]).reset_index(drop=True)
