"""Privacy–accuracy reports from MLflow runs, as pandas DataFrames (the library behind ``dpsweep-report``).

    dpsweep-report --experiment demo                                  # the table, markdown, on stdout
    dpsweep-report --experiment demo --sweep s3d13dc24edc --format tex --out report/

From Python, e.g. in a notebook::

    from dpsweep.analysis import report
    r = report.build_report("sqlite:///mlflow.db", "demo", sweep_id=None, sort="accuracy")
    r.table                            # one row per config, seeds pooled: ε, accuracy mean ± std, drop
    r.runs                             # one row per run (mlflow.search_runs layout), with its outcome
    r.counts                           # {"total": .., "finished": .., "failed": .., "pruned": .., "running": ..}
    r.warnings                         # mixed accountants or δ, missing metrics, missing baselines
    report.memory_table(r.table_runs)  # bytes per memory stage, per config
    report.pareto_front(r.table)       # the private rows no other row beats on both ε and accuracy
    print(report.render(r, "md"))      # or "csv", "tex", "html"

What a row is: the FINISHED runs whose hyperparameters are equal once the seed and the keys that
do not change a result (``dpsweep.config.NON_IDENTITY_PREFIXES``: tracking, launcher, sweep,
checkpoint directory, progress bars; and ``train.eval_batch_size``) are set aside. Accuracies are
fractions in [0, 1] in the DataFrames; ``test_accuracy_std`` is the sample standard deviation
(n − 1; NaN for one run). ``epsilon`` is the final ε under the row's own accountant (``dp.accountant``)
at its δ: the ``epsilon`` metric, the largest among the row's runs (equal across seeds).
``accuracy_drop`` is the baseline's mean accuracy minus the row's: the non-private row of the same
dataset and model whose other hyperparameters match the row's best.

Tasks: a run's accuracy is its task's objective metric (``TaskConfig.objective`` in dpsweep.config;
runs without a ``task.name`` are classifier runs): ``test_accuracy``, or for ``task=gan`` the TSTR
accuracy ``tstr_accuracy``. The columns keep their names (``test_accuracy_mean``, ...); the rendered
header says which it is ("TSTR accuracy", or "accuracy" and a note when tasks are mixed). A GAN
row's ``model`` is ``gan`` (its model.name is the TSTR classifier), so GAN rows are a block of their
own with the non-private GAN as baseline; the notes add, per block, the same classifier trained on
real data (``real_accuracy`` of the non-private GAN runs: :func:`reference_accuracies`) and the
rows' memorisation share, and ``report_plots`` draws their final sample grids (gan_samples.png).

Mechanisms and privacy units (``dp.mechanism``, ``dp.unit``): each private row has a ``mechanism``
(``dpsgd``: DP-SGD, Poisson sampling; ``dpftrl``: DP-FTRL, tree aggregation without sampling) and a
``unit`` (``example``, or ``user``: ε protects all of one user's examples, N = dataset.num_users),
from its params, else its tags; runs from before these keys are ``dpsgd`` / ``example``, and
non-private rows have neither (None). Rows differing only in them are separate rows (their params
differ); the baseline of a row ignores them (dp.* keys) and the users' assignment (``dataset.users``
and co., which change nothing without DP). Once a private row is not DP-SGD over examples, the
rendered tables show a ``mechanism`` and a ``unit`` column and the notes say what each mechanism is
and whom each unit's ε protects; ε per example and ε per user are different guarantees, so the
Pareto front is one per unit (:func:`pareto_front`). Otherwise the output is as before these keys.

Runs are read with one paginated ``MlflowClient.search_runs`` query (metric histories only for the
few runs of the accuracy-against-epoch plot). Memory probes (tag ``probe=true``) and a sweep's
parent run (tag ``sweep.role=parent``) are never part of a report. Runs that did not finish count
as failed, pruned (KILLED with tag ``optuna.pruned=true``) or running.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from html import escape as html_escape
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pandas as pd
from mlflow.entities import Run, ViewType
from mlflow.tracking import MlflowClient

from dpsweep.config import (
    TASK_SECTIONS,
    ClassifierTaskConfig,
    GanTaskConfig,
    Mechanism,
    PrivacyUnit,
    TaskConfig,
    identity,
)
from dpsweep.errors import InputError
from dpsweep.registry import Registry

PAGE_SIZE = 10_000  # runs per search_runs page (MLflow allows up to 50,000)

# Table column -> the MLflow param it shows. Every other hyperparameter that varies gets its own
# column as well (see swept_params), so that no two rows look alike.
HYPERPARAMETERS: dict[str, str] = {
    "dataset": "dataset.name",
    "model": "model.name",
    "batch_size": "train.batch_size",
    "noise_multiplier": "dp.noise_multiplier",
    "max_grad_norm": "dp.max_grad_norm",
    "clipping": "dp.clipping",
    "lr": "optimizer.lr",
    "epochs": "train.epochs",
    "delta": "dp.delta",
    "accountant": "dp.accountant",
}
SETTING_COLUMNS = [name for name in HYPERPARAMETERS if name not in ("dataset", "model")]  # after model (and task)
INTEGER_COLUMNS = ("batch_size", "epochs")
FLOAT_COLUMNS = ("noise_multiplier", "max_grad_norm", "lr", "delta")
# Runs that differ only in these are replicates of one config (identity() keeps them, since they
# change a run's numbers, but not what the run measures).
REPLICATE_PARAMS = ("train.seed",)
# Not in NON_IDENTITY_PREFIXES yet, but it cannot change a result: evaluation is deterministic.
NOT_HYPERPARAMETERS = ("train.eval_batch_size",)
# Params a run decided from its data (released privately), which differ between seeds of one config.
DECIDED_PARAMS = ("dp.max_grad_norm_chosen",)
# Params that say which kind of run it is rather than how it was tuned; never a swept axis.
ROW_KIND_PARAMS = ("dataset.name", "model.name", "dp.enabled", "task.name")

# Tasks (dpsweep.config.TaskConfig): a run's score is its task's objective metric. Runs from before
# tasks existed log no task.name: they are classifier runs. Rows of another task than the classifier
# show the task as their model (a GAN run's model.name is its TSTR classifier's), so each task's rows
# form blocks of their own, with their own non-private baseline.
DEFAULT_TASK: str = ClassifierTaskConfig.name
OBJECTIVE_NAMES: dict[str, str] = {  # objective metric -> what a table header and an axis call it
    ClassifierTaskConfig.objective: "test accuracy",
    GanTaskConfig.objective: "TSTR accuracy",
}
OBJECTIVE_NOTES: dict[str, str] = {  # objective metric -> what it measures, for the notes under a table
    GanTaskConfig.objective: "TSTR (train on synthetic, test on real) accuracy: the model group's classifier "
    "(model.name) trained on each run's synthetic data, tested on the real test split",
}
SAMPLING_TASKS = (GanTaskConfig.name,)  # tasks whose runs log sample grids (samples/epoch_NNN.png)
REFERENCE_METRIC = "real_accuracy"  # a non-private GAN run's TSTR classifier trained on real data
MEMORISATION_METRICS = ("memorisation_share", "memorisation_baseline")  # mean per row in the table

# How a private row noised its gradients and whom its ε protects (issue 17): table column -> the
# param (also a tag, set at the end of a DP run) it shows. Runs from before these keys log neither:
# they ran DP-SGD over examples (the defaults). Non-private rows have neither (None).
PRIVACY_KINDS: dict[str, str] = {"mechanism": "dp.mechanism", "unit": "dp.unit"}
PRIVACY_KIND_DEFAULTS: dict[str, str] = {"mechanism": Mechanism.dpsgd.value, "unit": PrivacyUnit.example.value}
DEFAULT_OF_PARAM = {PRIVACY_KINDS[name]: value for name, value in PRIVACY_KIND_DEFAULTS.items()}
MECHANISM_NAMES = {Mechanism.dpsgd.value: "DP-SGD", Mechanism.dpftrl.value: "DP-FTRL"}
MECHANISM_NOTES = {
    Mechanism.dpsgd.value: "Poisson-sampled batches, amplified by sampling",
    Mechanism.dpftrl.value: "tree aggregation over batches in a fixed order, no sampling and no amplification",
}
# dp.neighbours (a DP run's tag; dpsweep.privacy.ledger.NEIGHBOURS_OF) in words; runs without it ran DP-SGD
NEIGHBOUR_NOTES = {
    "add_or_remove_one": "one unit added or removed",
    "replace_one_with_zero": "one unit replaced by a zero record",
}
DEFAULT_NEIGHBOURS = "add_or_remove_one"
# Who holds which examples (dpsweep.data.users), what a dp.unit=user row's users are. Without DP they change
# nothing a run computes (only dp.unit=user reads them), so a baseline is matched without them.
USER_PARAMS = ("dataset.users", "dataset.num_users", "dataset.user_label_skew", "dataset.users_seed")


def task_objectives() -> dict[str, str]:
    """Task name -> the metric its runs are scored by: each TaskConfig subclass's ``name`` default
    and ``objective`` (read now, so that a task defined after this import is included)."""
    out: dict[str, str] = {}
    stack = list(TaskConfig.__subclasses__())
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        if isinstance(getattr(cls, "name", None), str) and cls.objective:
            out[cls.name] = cls.objective
    return out


def objective_name(metric: str) -> str:
    """``test accuracy``, ``TSTR accuracy``: a metric as a header or an axis names it."""
    return OBJECTIVE_NAMES.get(metric, metric.replace("_", " "))


def run_tasks(runs: pd.DataFrame) -> pd.Series:
    """Each run's task (param, else tag ``task.name``; runs from before tasks: the classifier)."""
    return param_or_tag(runs, "task.name").astype(object).fillna(DEFAULT_TASK).astype(str)


def run_models(runs: pd.DataFrame) -> pd.Series:
    """What the table's ``model`` column shows for each run: its model.name for a classifier run,
    its task (``gan``) for any other task, whose model.name names an evaluation model."""
    models = param_or_tag(runs, "model.name")
    tasks = run_tasks(runs)
    return models.where(tasks == DEFAULT_TASK, tasks)


# Memory of the first training iteration at each stage (levels, not increments), and the peaks.
MEMORY_STAGES: dict[str, str] = {
    "model_load_bytes": "memory.model_load_bytes",
    "batch_load_bytes": "memory.batch_load_bytes",
    "backward_bytes": "memory.backward_bytes",
    "optimizer_step_bytes": "memory.optimizer_step_bytes",
    "iteration_peak_bytes": "memory.iteration_peak_bytes",
    "run_peak_bytes": "memory.peak_bytes",
}

# MLflow run status -> outcome in the report (KILLED and tagged optuna.pruned=true: pruned).
OUTCOMES: dict[str, str] = {
    "FINISHED": "finished",
    "FAILED": "failed",
    "KILLED": "failed",
    "RUNNING": "running",
    "SCHEDULED": "running",
}
# duplicate: a FINISHED run whose config.hash (the seed included) a newer FINISHED run repeats; a
# repeat of one run is not another seed, so it is left out of its row and named in a warning.
OUTCOME_ORDER = ("finished", "failed", "pruned", "running", "duplicate")
MISSING = "\0missing"  # stands for a param a run did not log, where missing must equal missing

T = TypeVar("T")


class ReportError(InputError):
    """The selection cannot be reported on. ``option`` names the input at fault (``experiment``,
    ``sweep``, ``runs``, ``tracking_uri``, ``format``, ``sort``); the error's ``key`` is its flag
    (``--tracking-uri``), ``value`` its value and ``allowed`` what is allowed."""

    def __init__(self, option: str, value: Any, reason: str) -> None:
        super().__init__("--" + option.replace("_", "-"), value, reason)


def lookup(registry: Registry[T], name: str, option: str) -> T:
    """``registry``'s entry ``name``; an unknown name raises ReportError listing the valid ones."""
    if name not in registry:
        raise ReportError(option, name, f"unknown {registry.kind}; valid: {', '.join(registry.names())}")
    return registry.get(name)


# ---------------------------------------------------------------------------------------------
# reading runs
# ---------------------------------------------------------------------------------------------
def search_runs(
    uri: str, experiment: str, sweep_id: str | None = None, filter_string: str = "", page_size: int = PAGE_SIZE
) -> pd.DataFrame:
    """All active runs of ``experiment`` (tagged ``sweep.id=<sweep_id>`` when given), one row each,
    in the layout of ``mlflow.search_runs``: run_id, status, start_time (ms), ``params.*``,
    ``metrics.*`` (final values), ``tags.*``. Parent runs and probes are included; see report_runs."""
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        names = sorted(e.name for e in client.search_experiments())
        raise ReportError("experiment", experiment, f"no such experiment at {uri}; experiments there: {_few(names)}")
    filters = [filter_string] if filter_string else []
    if sweep_id is not None:
        if "'" in sweep_id or "`" in sweep_id:
            raise ReportError("sweep", sweep_id, "a sweep id without quotes (12 characters, e.g. s3d13dc24edc)")
        filters.append(f"tags.`sweep.id` = '{sweep_id}'")
    runs = _paginate(client, str(exp.experiment_id), " and ".join(filters), page_size)
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


def _sweep_ids(client: MlflowClient, experiment_id: str, page_size: int) -> str:
    counts: dict[str, int] = {}
    for run in _paginate(client, experiment_id, "", page_size):
        sid = run.data.tags.get("sweep.id")
        if sid and run.data.tags.get("sweep.role") != "parent":
            counts[sid] = counts.get(sid, 0) + 1
    return _few([f"{sid} ({n} runs)" for sid, n in counts.items()])


def _few(items: Sequence[str], limit: int = 10) -> str:
    if not items:
        return "none"
    more = f", … ({len(items) - limit} more)" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


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


def column(frame: pd.DataFrame, name: str) -> pd.Series:
    """``frame[name]``, or all-missing when no run has it (a param, metric or tag nobody logged)."""
    if name in frame.columns:
        return frame[name]
    return pd.Series(np.nan if name.startswith("metrics.") else None, index=frame.index, dtype=object)


def param_or_tag(frame: pd.DataFrame, key: str) -> pd.Series:
    """The param ``key``, falling back to the tag of the same name (e.g. dp.delta, dp.accountant)."""
    return column(frame, f"params.{key}").where(column(frame, f"params.{key}").notna(), column(frame, f"tags.{key}"))


def parent_run_id(raw: pd.DataFrame) -> str | None:
    """The sweep's parent run (tag ``sweep.role=parent``) among ``raw``, if any (the newest)."""
    parents = raw[column(raw, "tags.sweep.role") == "parent"]
    return None if parents.empty else str(parents.sort_values("start_time")["run_id"].iloc[-1])


def report_runs(raw: pd.DataFrame) -> pd.DataFrame:
    """The runs a report is about: ``raw`` without parent runs and memory probes, plus the columns
    ``outcome`` (finished, failed, pruned, running), ``private`` (DP on), ``task`` (task.name),
    ``objective`` (the name of the task's objective metric; NaN for a task this dpsweep does not
    know), ``score`` (that metric's final value) and ``config_id`` (equal for the runs of one row)."""
    keep = (column(raw, "tags.sweep.role") != "parent") & (column(raw, "tags.probe").astype(str).str.lower() != "true")
    runs = raw[keep].reset_index(drop=True)
    outcome = runs["status"].map(OUTCOMES).fillna("running")
    pruned = (runs["status"] == "KILLED") & (column(runs, "tags.optuna.pruned").astype(str).str.lower() == "true")
    runs["outcome"] = outcome.where(~pruned, "pruned")
    config_hash = column(runs, "tags.config.hash")
    finished = runs[(runs["outcome"] == "finished") & config_hash.notna()].sort_values("start_time")
    newest = finished.groupby(config_hash[finished.index], sort=False).tail(1).index
    runs.loc[finished.index.difference(newest), "outcome"] = "duplicate"
    runs["private"] = param_or_tag(runs, "dp.enabled").astype(str) == "True"
    runs["task"] = run_tasks(runs)
    runs["objective"] = runs["task"].map(task_objectives())
    runs["score"] = run_scores(runs)
    keys = hyperparameter_keys(runs)
    values = runs[[f"params.{k}" for k in keys]].astype(object)
    values = values.where(values.notna(), None)
    runs["config_id"] = [_config_id(keys, row) for row in values.itertuples(index=False, name=None)]
    return runs


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


# ---------------------------------------------------------------------------------------------
# the table
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SortKey:
    column: str
    ascending: bool


SORT_KEYS: Registry[SortKey] = Registry("sort key")
SORT_KEYS.register("accuracy")(SortKey("test_accuracy_mean", ascending=False))  # best first
SORT_KEYS.register("epsilon")(SortKey("epsilon", ascending=True))  # most private first


def summary_table(runs: pd.DataFrame, sort: str = "accuracy") -> pd.DataFrame:
    """One row per config over the FINISHED runs of ``runs`` (from report_runs).

    Columns: config_id, dataset, model, task, private, batch_size, noise_multiplier, max_grad_norm,
    lr, epochs, delta, accountant, mechanism, unit (privacy_kinds: None for a non-private row),
    epsilon, test_accuracy_mean, test_accuracy_std, accuracy_drop, runs (FINISHED runs pooled),
    runs_without_accuracy, baseline_config_id, run_ids, memorisation_share, memorisation_baseline,
    and ``params.<key>`` for every hyperparameter (the raw strings). The accuracy columns are of
    each run's score, its task's objective metric (test_accuracy; a GAN's tstr_accuracy); the
    ``model`` of a row of another task than the classifier is the task (``gan``). The memorisation
    columns are means over the row's runs (GAN runs; NaN for others). Rows are in blocks per
    dataset and model, the non-private baseline first, then by ``sort`` (a SORT_KEYS name); NaN last.
    """
    order = lookup(SORT_KEYS, sort, "sort")
    done = runs[runs["outcome"] == "finished"]
    keys = hyperparameter_keys(done)
    accuracy = done["score"].astype(float)
    work = pd.DataFrame(
        {
            "config_id": done["config_id"],
            "run_id": done["run_id"],
            "accuracy": accuracy,
            "epsilon": column(done, "metrics.epsilon"),
            "missing": accuracy.isna(),
            **{name: column(done, f"metrics.{name}").astype(float) for name in MEMORISATION_METRICS},
        }
    )
    grouped = work.groupby("config_id", sort=False)
    table = pd.DataFrame(
        {
            "epsilon": grouped["epsilon"].max(),
            "test_accuracy_mean": grouped["accuracy"].mean(),
            "test_accuracy_std": grouped["accuracy"].std(ddof=1),
            "runs": grouped.size(),
            "runs_without_accuracy": grouped["missing"].sum().astype(int),
            "run_ids": grouped["run_id"].agg(tuple),
            **{name: grouped[name].mean() for name in MEMORISATION_METRICS},
        }
    )
    first = done.drop_duplicates("config_id").set_index("config_id")
    table["private"] = first["private"]
    for name, key in HYPERPARAMETERS.items():
        table[name] = param_or_tag(first, key)
    table["task"] = run_tasks(first)
    table["model"] = run_models(first)
    for name, value in privacy_kinds(first).items():
        table[name] = value
    for name in INTEGER_COLUMNS:
        table[name] = pd.to_numeric(table[name], errors="coerce").astype("Int64")
    for name in FLOAT_COLUMNS:
        table[name] = pd.to_numeric(table[name], errors="coerce").astype(float)
    for key in keys:
        table[f"params.{key}"] = first[f"params.{key}"]
    table = table.reset_index()
    table[["accuracy_drop", "baseline_config_id"]] = _baselines(table, keys)
    head = ["config_id", "dataset", "model", "task", *SETTING_COLUMNS, *PRIVACY_KINDS, "private", "epsilon"]
    head += ["test_accuracy_mean", "test_accuracy_std"]
    tail = ["accuracy_drop", "runs", "runs_without_accuracy", "baseline_config_id", "run_ids", *MEMORISATION_METRICS]
    table = table[head + tail + [f"params.{k}" for k in keys]]
    return _sorted(table, order)


def privacy_kinds(runs: pd.DataFrame) -> dict[str, pd.Series]:
    """Each run's (or row's) ``mechanism`` and ``unit``: the param, else the tag (PRIVACY_KINDS),
    else the default (runs from before the keys: dpsgd, example); None where DP is off."""
    private = runs["private"].astype(bool)
    out = {}
    for name, key in PRIVACY_KINDS.items():
        logged = param_or_tag(runs, key).astype(object)
        values = [
            (PRIVACY_KIND_DEFAULTS[name] if pd.isna(v) else str(v)) if dp else None
            for v, dp in zip(logged, private, strict=True)
        ]
        out[name] = pd.Series(values, index=runs.index, dtype=object)
    return out


def row_units(table: pd.DataFrame) -> pd.Series:
    """The privacy unit of each of ``table``'s rows: ``example`` where not said (a table from before
    the column, or a non-private row, which protects nothing)."""
    units = table["unit"] if "unit" in table else pd.Series(None, index=table.index, dtype=object)
    return units.astype(object).fillna(PRIVACY_KIND_DEFAULTS["unit"])


def shows_privacy_kinds(table: pd.DataFrame) -> bool:
    """Whether the rendered table shows ``mechanism`` and ``unit``: some private row is not DP-SGD
    over examples (otherwise the table is as it was before these keys)."""
    if not all(name in table for name in PRIVACY_KINDS):
        return False
    private = table[table["private"].astype(bool)]
    return any(bool((private[n].fillna(d) != d).any()) for n, d in PRIVACY_KIND_DEFAULTS.items())


def private_only(key: str) -> bool:
    """A key that means something for private rows only: DP's (dp.*), which a non-private run does
    not log, and the users' assignment (USER_PARAMS), which it logs but does not use."""
    return key.startswith("dp.") or key in USER_PARAMS


def key_applies(rows: pd.DataFrame, key: str) -> pd.Series:
    """Which of ``rows`` (table rows) the hyperparameter ``key`` means something for: DP's keys (dp.*)
    the private rows; the users' assignment (USER_PARAMS) the private rows over users (unit=user),
    the only runs that read it; any other key every row."""
    if not private_only(key):
        return pd.Series(True, index=rows.index, dtype=bool)
    private = rows["private"].astype(bool)
    return private & (row_units(rows) == PrivacyUnit.user.value) if key in USER_PARAMS else private


def _row_applies(row: pd.Series, key: str) -> bool:
    """:func:`key_applies` for one row."""
    if not private_only(key):
        return True
    return bool(row["private"]) and (key not in USER_PARAMS or row.get("unit") == PrivacyUnit.user.value)


def _baseline_key(key: str) -> bool:
    """A hyperparameter a private row and its non-private baseline should share: none of DP's
    (dp.*, mechanism and unit included), of the row's kind, or of the users' assignment."""
    return not private_only(key) and key not in ROW_KIND_PARAMS


def _baselines(table: pd.DataFrame, keys: Sequence[str]) -> pd.DataFrame:
    """For each private row, the best-matching non-private row of the same dataset and model (most
    equal non-DP hyperparameters, the users' assignment aside: USER_PARAMS; then more runs) and the
    accuracy drop against it."""
    shared = [f"params.{k}" for k in keys if _baseline_key(k)]
    out = pd.DataFrame({"accuracy_drop": np.nan, "baseline_config_id": None}, index=table.index)
    values = table[shared].fillna(MISSING).astype(str).to_numpy()  # missing equals missing
    for _, block in table.groupby(["dataset", "model"], sort=False):
        rows, candidates = block.index[block["private"]], block.index[~block["private"]]
        if rows.empty or candidates.empty:
            continue
        at = table.index.get_indexer
        same = values[at(rows)][:, None, :] == values[at(candidates)][None, :, :]  # row x candidate x key
        runs = table.loc[candidates, "runs"].to_numpy()
        score = same.sum(axis=2) * (runs.max() + 1) + runs[None, :]  # matching keys first, then more runs
        best = candidates[score.argmax(axis=1)]
        out.loc[rows, "accuracy_drop"] = (
            table.loc[best, "test_accuracy_mean"].to_numpy() - table.loc[rows, "test_accuracy_mean"].to_numpy()
        )
        out.loc[rows, "baseline_config_id"] = table.loc[best, "config_id"].to_numpy()
    return out


def _sorted(table: pd.DataFrame, order: SortKey) -> pd.DataFrame:
    by = ["dataset", "model", "_private", order.column, "test_accuracy_mean", "config_id"]
    ascending = [True, True, True, order.ascending, False, True]
    ready = table.assign(_private=table["private"].astype(int))
    ready = ready.sort_values(by, ascending=ascending, na_position="last", kind="mergesort")
    return ready.drop(columns="_private").reset_index(drop=True)


def swept_params(table: pd.DataFrame) -> list[str]:
    """Hyperparameters (MLflow param keys) that take more than one value among the table's rows,
    besides the dataset, the model, the task and DP on/off. Non-DP keys count over every row, dp.*
    keys over the private rows (the baseline has none), the users' assignment (dataset.users, ...)
    over the user-level rows (key_applies), the keys of a task's section (gan.*) over the rows that
    have them (other tasks' rows have none). A private run without dp.mechanism or dp.unit (from
    before them) counts as their default (dpsgd, example)."""
    out = []
    for name in [c for c in table.columns if c.startswith("params.")]:
        key = name.removeprefix("params.")
        if key in ROW_KIND_PARAMS:
            continue
        rows = table[key_applies(table, key)]
        rows = rows[rows[name].notna()] if _in_task_section(key) else rows
        values = rows[name].fillna(DEFAULT_OF_PARAM[key]) if key in DEFAULT_OF_PARAM else rows[name]
        if values.nunique(dropna=False) > 1:
            out.append(key)
    return out


def _in_task_section(key: str) -> bool:
    """Whether ``key`` belongs to a section only some tasks have (``gan.*``: dpsweep.config.TASK_SECTIONS)."""
    return key.split(".", 1)[0] in TASK_SECTIONS


def extra_columns(table: pd.DataFrame) -> list[str]:
    """Swept hyperparameters that have no column of their own in the table (e.g. model.hidden_units;
    not dp.mechanism and dp.unit, which have theirs once they vary: shows_privacy_kinds)."""
    shown = set(HYPERPARAMETERS.values()) | set(PRIVACY_KINDS.values())
    return [k for k in swept_params(table) if k not in shown]


SHORT_NAMES = {
    "train.batch_size": "B",
    "dp.noise_multiplier": "σ",
    "dp.max_grad_norm": "C",
    "optimizer.lr": "lr",
    "train.epochs": "epochs",
    "dp.delta": "δ",
    "dp.accountant": "accountant",
    "dp.mechanism": "mechanism",
    "dp.unit": "unit",
}
KIND_OF_PARAM = {key: name for name, key in PRIVACY_KINDS.items()}  # dp.mechanism -> mechanism


def config_labels(table: pd.DataFrame) -> pd.Series:
    """A short label per row (indexed by config_id), naming only what differs between rows, e.g.
    ``digits/cnn σ=1 B=64`` or ``digits/cnn non-private``."""
    several = table[["dataset", "model"]].drop_duplicates().shape[0] > 1
    swept = swept_params(table)
    applies = {key: key_applies(table, key) for key in swept}
    labels = {}
    for index, row in table.iterrows():
        parts = [f"{row['dataset']}/{row['model']}"] if several else []
        if not row["private"]:
            parts.append("non-private")
        for key in swept:
            if not applies[key][index]:
                continue
            if _in_task_section(key) and pd.isna(row[f"params.{key}"]):
                continue  # a row of another task
            kind = KIND_OF_PARAM.get(key)  # mechanism, unit: with their defaults for runs from before them
            value = row[kind] if kind is not None and kind in row.index else row[f"params.{key}"]
            parts.append(f"{SHORT_NAMES.get(key, key)}={_text(value)}")
        labels[row["config_id"]] = " ".join(parts) or f"{row['dataset']}/{row['model']}"
    return pd.Series(labels, name="label")


def privacy_names(table: pd.DataFrame) -> pd.Series:
    """A row's privacy in a few characters (indexed by config_id): ``ε=1.53`` or ``non-private``;
    where rows of one dataset and model share it, what else tells them apart (their config_labels
    less the dataset, model and privacy) follows in parentheses."""
    labels = config_labels(table)
    names, blocks = {}, {}
    for _, row in table.iterrows():
        name = "non-private" if not row["private"] else f"ε={_epsilon(row['epsilon'])}"
        names[row["config_id"]], blocks[row["config_id"]] = name, (row["dataset"], row["model"], name)
    shared = pd.Series(blocks).duplicated(keep=False)
    out = {}
    for _, row in table.iterrows():
        cid, name = row["config_id"], names[row["config_id"]]
        rest = str(labels.get(cid, "")).removeprefix(f"{row['dataset']}/{row['model']}").strip()
        rest = rest.removeprefix("non-private").strip()
        out[cid] = f"{name} ({rest})" if shared[cid] and rest else name
    return pd.Series(out, dtype=object)


def _sort_key(value: Any) -> tuple[int, float, str]:
    """Numbers in numeric order, then other values in text order."""
    try:
        return (0, float(value), "")
    except (TypeError, ValueError):
        return (1, 0.0, str(value))


def _text(value: Any) -> str:
    """A param string as a table shows it: numbers in %g form ("1.0" -> "1"), others as they are."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    try:
        number = float(value)
    except (TypeError, ValueError):
        return str(value)
    return f"{number:g}"


def pareto_front(table: pd.DataFrame) -> pd.DataFrame:
    """The private rows on the privacy–accuracy Pareto front of their dataset, model and privacy unit
    (ε per example and ε per user are different guarantees: one front each): no other row has both
    a smaller-or-equal ε and a higher-or-equal mean accuracy, one of them strictly. Sorted by ε.
    Rows without ε or accuracy take no part."""
    dp = table[table["private"] & table["epsilon"].notna() & table["test_accuracy_mean"].notna()]
    keep = []
    for _, block in dp.groupby(["dataset", "model", row_units(dp)], sort=True):
        eps, acc = block["epsilon"].to_numpy(), block["test_accuracy_mean"].to_numpy()
        for i, index in enumerate(block.index):
            beaten = (eps <= eps[i]) & (acc >= acc[i]) & ((eps < eps[i]) | (acc > acc[i]))
            if not beaten.any():
                keep.append(index)
    return table.loc[keep].sort_values(["dataset", "model", "epsilon"]).reset_index(drop=True)


def memory_table(runs: pd.DataFrame) -> pd.DataFrame:
    """Memory per config over its FINISHED runs: the mean bytes at each stage of the first training
    iteration (model_load, batch_load, backward, optimizer_step), the first iteration's peak and the
    run's peak, with the measuring backend (``cuda`` or ``cpu-tensors``). One row per config_id."""
    done = runs[runs["outcome"] == "finished"]
    frame = pd.DataFrame({name: column(done, f"metrics.{metric}") for name, metric in MEMORY_STAGES.items()})
    frame = frame.astype(float)
    frame["config_id"] = done["config_id"]
    frame["backend"] = column(done, "tags.memory.backend").fillna("unknown")
    grouped = frame.groupby("config_id", sort=False)
    out = grouped[list(MEMORY_STAGES)].mean()
    out["backend"] = grouped["backend"].agg(lambda b: ", ".join(sorted(set(b))))
    out["runs"] = grouped.size()
    return out.reset_index()


def memory_groups(memory: pd.DataFrame, table: pd.DataFrame, resolution_bytes: float = 2.0**14) -> pd.DataFrame:
    """memory_table's configs pooled where their figures agree to ``resolution_bytes`` (memory
    depends on few hyperparameters: σ, C or lr change nothing), each group labelled with the swept
    hyperparameters its configs share, e.g. ``B=512 (40 configs)``. Largest run peak first."""
    kinds = table[["config_id", "dataset", "model", "private"]]
    swept = swept_params(table)
    merged = memory.merge(table[["config_id", "dataset", "model", "private", *[f"params.{k}" for k in swept]]],
                          on="config_id", how="left")  # fmt: skip
    levels = merged[list(MEMORY_STAGES)].div(resolution_bytes).round().fillna(-1).astype(int).astype(str)
    key = levels.agg("/".join, axis=1) + merged["backend"] + merged["dataset"].astype(str) + merged["model"].astype(str)
    several = kinds[["dataset", "model"]].drop_duplicates().shape[0] > 1
    rows = []
    for _, group in merged.groupby(key + merged["private"].astype(str), sort=False):
        first = group.iloc[0]
        parts = [f"{first['dataset']}/{first['model']}"] if several else []
        parts += [] if first["private"] else ["non-private"]
        varying = []
        for k in swept:
            values = sorted(group[f"params.{k}"].dropna().unique(), key=_sort_key)
            if not first["private"] and k.startswith("dp."):
                continue
            if len(values) == 1:
                parts.append(f"{SHORT_NAMES.get(k, k)}={_text(values[0])}")
            elif len(values) <= 3:
                varying.append(f"{SHORT_NAMES.get(k, k)}∈{{{', '.join(_text(v) for v in values)}}}")
        label = " ".join(parts or varying) or ("private" if first["private"] else "non-private")
        if len(group) > 1:
            label += f" ({len(group)} configs)"
        figures = group[list(MEMORY_STAGES)].mean()
        rows.append({"label": label, **figures, "backend": first["backend"], "configs": len(group),
                     "config_ids": tuple(group["config_id"])})  # fmt: skip
    out = pd.DataFrame(rows, columns=["label", *MEMORY_STAGES, "backend", "configs", "config_ids"])
    # largest first; DP runs log no run peak (it would tell their Poisson batch sizes): their first-iteration peak
    largest = out["run_peak_bytes"].fillna(out["iteration_peak_bytes"])
    return out.iloc[largest.argsort(kind="mergesort")[::-1]].reset_index(drop=True)


def best_runs(runs: pd.DataFrame, n: int = 3, private: bool | None = True) -> list[str]:
    """The ``n`` FINISHED runs with the highest final score (test accuracy; a GAN's TSTR accuracy):
    private ones (``private=True``), non-private ones (False) or any (None)."""
    done = runs[runs["outcome"] == "finished"]
    if private is not None:
        done = done[done["private"] == private]
    ranked = done.assign(_acc=done["score"]).dropna(subset=["_acc"])
    return ranked.sort_values(["_acc", "start_time"], ascending=[False, True])["run_id"].head(n).tolist()


def history_metrics(runs: pd.DataFrame, run_ids: Sequence[str]) -> list[str]:
    """The metrics curves.png reads for ``run_ids`` (runs of report_runs): their tasks' objectives
    (test_accuracy, a GAN's tstr_accuracy), then epsilon."""
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


# ---------------------------------------------------------------------------------------------
# checks
# ---------------------------------------------------------------------------------------------
def check(runs: pd.DataFrame, table: pd.DataFrame) -> list[str]:
    """What a reader of the table must know: a row whose runs mix accountants or δ (their ε differ
    in meaning), rows of one dataset and model under different accountants or δ (their ε are not
    comparable on one front), FINISHED runs without accuracy or ε, and missing or mismatched
    baselines."""
    labels = config_labels(table) if not table.empty else pd.Series(dtype=str)
    done = runs[runs["outcome"] == "finished"]
    notes: list[str] = []
    for config_id, group in done.groupby("config_id", sort=False):
        if not group["private"].any():
            continue
        for key, what in (("dp.accountant", "accountants"), ("dp.delta", "δ")):
            logged = pd.concat([column(group, f"params.{key}"), column(group, f"tags.{key}")]).dropna()
            seen = {_text(v) for v in logged}  # δ as a number: "1e-05" and "0.00001" agree
            if len(seen) > 1:
                notes.append(
                    f"row {labels.get(config_id, config_id)} mixes {what} ({', '.join(sorted(map(str, seen)))}) "
                    f"across its runs ({', '.join(r[:8] for r in group['run_id'])}): its ε are not one guarantee"
                )
    for (dataset, model), block in table[table["private"]].groupby(["dataset", "model"], sort=True):
        for name, what in (("accountant", "accountants"), ("delta", "δ")):
            values = sorted({_text(v) for v in block[name]})
            if len(values) > 1:
                notes.append(
                    f"{dataset}/{model}: the rows use different {what} ({', '.join(values)}); their ε are "
                    "not comparable, nor is the Pareto front across them"
                )
    unknown = done[done["objective"].isna()]
    for task, group in unknown.groupby("task", sort=True):
        notes.append(
            f"{_runs(len(group))} of task {task!r}, which this dpsweep does not know (tasks: "
            f"{', '.join(sorted(task_objectives()))}): the table has no accuracy for them"
        )
    known = done[done["objective"].notna()]
    for _, run in known[known["score"].isna()].iterrows():
        notes.append(
            f"run {run['run_id']} ({labels.get(run['config_id'], run['config_id'])}) is FINISHED but has "
            f"no {run['objective']} metric; its row's accuracy leaves it out"
        )
    for _, run in done[done["private"] & column(done, "metrics.epsilon").isna()].iterrows():
        notes.append(
            f"run {run['run_id']} ({labels.get(run['config_id'], run['config_id'])}) is FINISHED but has "
            "no epsilon metric; its row's ε leaves it out"
        )
    for config_hash, group in runs[runs["outcome"] == "duplicate"].groupby(column(runs, "tags.config.hash")):
        kept = done[column(done, "tags.config.hash") == config_hash]["run_id"]
        notes.append(
            f"{_runs(len(group))} ({', '.join(r[:8] for r in group['run_id'])}) repeat the config of run "
            f"{', '.join(r[:8] for r in kept)} (config.hash {config_hash}, seed included): a repeat is not another "
            "seed, so only the newest is in the table"
        )
    not_for_release = done[done["private"] & (column(done, "tags.dp.release") == "not-for-release")]
    insecure = not_for_release[column(not_for_release, "tags.dp.secure_mode").astype(str) != "True"]
    if not insecure.empty:
        notes.append(
            f"{_runs(len(insecure))} ran without dp.secure_mode: their noise and Poisson sampling can be "
            "regenerated from train.seed, which is logged, so a model they trained is not for release"
        )
    outside = not_for_release[column(not_for_release, "tags.dp.outside_ledger").notna()]
    for what, group in outside.groupby(column(outside, "tags.dp.outside_ledger"), sort=True):
        notes.append(
            f"{_runs(len(group))} logged {what}, a statistic of the training data that no accountant covers: "
            "their ε is not all they released"
        )
    for (dataset, model), block in table.groupby(["dataset", "model"], sort=True):
        if block["private"].all():
            notes.append(f"{dataset}/{model}: no FINISHED non-private run; no accuracy drop can be given")
    notes += _tuning_notes(done, table)
    notes += _baseline_mismatches(table, labels)
    return notes


def _tuning_notes(done: pd.DataFrame, table: pd.DataFrame) -> list[str]:
    """The privacy of choosing among rows. A private tuning's runs (tag tuning.released): only the released
    one may be published, at its parent's epsilon_tuning. Otherwise, where the table offers K > 1 private
    rows of one dataset and model at the same ε (tuned hyperparameters: lr, C, ...), the best of them is
    picked after seeing all, and its ε is that of one run, not of the choice: the note gives the naive
    composed ε of their runs (basic composition: Dwork & Roth 2014, Thm. 3.16). Rows at different ε (a σ
    sweep) are a trade-off curve, not a choice, and get no note."""
    notes: list[str] = []
    private = done[done["private"]]
    released = column(private, "tags.tuning.released").astype(str)
    tuned = private[released.isin(["true", "false"])]
    if not tuned.empty:
        kept = tuned[released[tuned.index] == "true"]["run_id"]
        notes.append(
            f"{_runs(len(tuned))} are trials of a private tuning (sweep.private_tuning): only "
            f"{', '.join(r[:8] for r in kept) or 'none'} (tag tuning.released=true) may be published, and at its "
            "sweep parent's epsilon_tuning, not at its own ε; the other trials and their number stay private"
        )
    plain = private.drop(tuned.index)
    rows = table[table["private"] & table["config_id"].isin(plain["config_id"]) & table["epsilon"].notna()]
    for (dataset, model, eps), block in rows.groupby(["dataset", "model", rows["epsilon"].round(6)], sort=True):
        if len(block) < 2:
            continue
        runs = plain[plain["config_id"].isin(block["config_id"])]
        total = column(runs, "metrics.epsilon").sum()
        delta = pd.to_numeric(param_or_tag(runs, "dp.delta"), errors="coerce").sum()
        notes.append(
            f"{dataset}/{model} at ε={eps:.4g}: the best of these {len(block)} private rows is picked after seeing "
            f"them all, so its ε is that of one run, not of the choice. Their {_runs(len(runs))} together cost at "
            f"most ε = {total:.4g} at δ = {delta:.3g} (basic composition, Dwork & Roth 2014, Thm. 3.16); for a best "
            "row with an honest ε, run the sweep with sweep.private_tuning=true (Papernot & Steinke 2022)"
        )
    return notes


def _baseline_mismatches(table: pd.DataFrame, labels: pd.Series) -> list[str]:
    notes = []
    by_id = table.set_index("config_id")
    shared = [c for c in table.columns if c.startswith("params.") and _baseline_key(c.removeprefix("params."))]
    for _, row in table[table["private"] & table["baseline_config_id"].notna()].iterrows():
        base = by_id.loc[row["baseline_config_id"]]
        differ = [
            f"{c.removeprefix('params.')} {_text(row[c])} vs {_text(base[c])}"
            for c in shared
            if not (row[c] == base[c] or (pd.isna(row[c]) and pd.isna(base[c])))
        ]
        if differ:
            notes.append(
                f"row {labels.get(row['config_id'])}: no baseline with the same settings; its drop is against "
                f"{labels.get(row['baseline_config_id'])}, which differs in {'; '.join(differ)}"
            )
    return notes


# ---------------------------------------------------------------------------------------------
# what the accuracy columns are: each row's task objective
# ---------------------------------------------------------------------------------------------
def row_tasks(table: pd.DataFrame) -> pd.Series:
    """The task of each of ``table``'s rows (a table from before the column: the classifier)."""
    return table["task"] if "task" in table else pd.Series(DEFAULT_TASK, index=table.index, dtype=object)


def score_metrics(table: pd.DataFrame) -> list[str]:
    """The objective metrics behind the accuracy columns of ``table``'s rows, e.g. ``["tstr_accuracy"]``."""
    return sorted(set(row_tasks(table).map(task_objectives()).dropna()))


def score_name(table: pd.DataFrame) -> str:
    """What the accuracy columns of ``table`` hold: ``test accuracy`` or ``TSTR accuracy`` when
    every row has one objective, ``accuracy`` when tasks with different objectives are mixed."""
    metrics = score_metrics(table)
    return objective_name(metrics[0]) if len(metrics) == 1 else "accuracy"


def score_note(table: pd.DataFrame) -> str:
    """The notes' name for the accuracy columns; with mixed tasks, which objective is whose."""
    name = score_name(table)
    if name != "accuracy":
        return name[0].upper() + name[1:]
    objectives = task_objectives()
    tasks = sorted(t for t in set(row_tasks(table)) if t in objectives)
    return (
        "Accuracy: each row's task objective ("
        + "; ".join(f"{t} rows: {objective_name(objectives[t])}" for t in tasks)
        + ")"
    )


def reference_accuracies(runs: pd.DataFrame) -> pd.DataFrame:
    """Per dataset and model (``digits/gan``): the FINISHED non-private runs that logged
    ``real_accuracy`` (a GAN run's TSTR classifier trained on the real training split instead, the
    reference for its TSTR accuracy), pooled: columns dataset, model, classifier (model.name),
    real_accuracy_mean, real_accuracy_std (sample std; NaN for one run), runs, and ``differing``:
    the classifier's settings (model.*, dataset.*, gan.tstr_*) that differ among them, if any."""
    columns = ["dataset", "model", "classifier", "real_accuracy_mean", "real_accuracy_std", "runs", "differing"]
    done = runs[(runs["outcome"] == "finished") & ~runs["private"]]
    real = column(done, f"metrics.{REFERENCE_METRIC}").astype(float)
    done = done[real.notna()]
    rows = []
    pairs = pd.Series(_pairs(done), index=done.index, dtype=object)
    recipe = [c for c in done.columns if c.startswith(("params.model.", "params.dataset.", "params.gan.tstr_"))]
    recipe = [c for c in recipe if c != "params.dataset.name"]
    for (dataset, model), block in done.groupby(pairs, sort=True):
        values = real[block.index]
        differing = [
            f"{c.removeprefix('params.')} {', '.join(sorted({_text(v) for v in block[c]}, key=_sort_key))}"
            for c in recipe
            if block[c].astype(object).fillna(MISSING).nunique() > 1
        ]
        classifier = ", ".join(sorted({str(v) for v in param_or_tag(block, "model.name").dropna()}))
        rows.append((dataset, model, classifier, values.mean(), values.std(ddof=1), len(block), "; ".join(differing)))
    return pd.DataFrame(rows, columns=columns)


def _percent(mean: float, std: float) -> str:
    return f"{mean * PERCENT:.2f}" + ("" if pd.isna(std) else f" ± {std * PERCENT:.2f}") + "%"


def task_notes(table: pd.DataFrame, runs: pd.DataFrame) -> list[str]:
    """Notes on rows of tasks other than the classifier: the real-data reference of each block with
    one (reference_accuracies), and the rows' mean memorisation share against its baseline."""
    notes = []
    for _, ref in reference_accuracies(runs).iterrows():
        pooled = f"; pooled over differing {ref['differing']}" if ref["differing"] else ""
        n = int(ref["runs"])
        notes.append(
            f"{ref['dataset']}/{ref['model']}: the same classifier ({ref['classifier']}) trained on real data "
            f"instead: {_percent(ref['real_accuracy_mean'], ref['real_accuracy_std'])} test accuracy "
            f"({n} non-private run{'' if n == 1 else 's'}{pooled})"
        )
    share, baseline = MEMORISATION_METRICS
    logged = table[table[share].notna()] if share in table else table.iloc[:0]
    names = privacy_names(table) if not logged.empty else pd.Series(dtype=str)
    for (dataset, model), block in logged.groupby(["dataset", "model"], sort=True):
        rows = ", ".join(f"{names.get(r['config_id'])} {r[share] * PERCENT:.1f}%" for _, r in block.iterrows())
        notes.append(
            f"{dataset}/{model}: memorisation share (synthetic samples nearer a training image than any test "
            f"image; {block[baseline].mean() * PERCENT:.1f}% if independent of the training set), mean per row: "
            f"{rows}"
        )
    return notes


def privacy_kind_notes(table: pd.DataFrame, runs: pd.DataFrame) -> list[str]:
    """When the table shows mechanism and unit (shows_privacy_kinds): what each mechanism of its
    private rows is, with the neighbouring relation its ε is for (tag dp.neighbours), and whom each
    unit's ε protects, with N (dataset.num_users for unit=user). None otherwise."""
    if not shows_privacy_kinds(table):
        return []
    private = table[table["private"].astype(bool)]
    done = runs[(runs["outcome"] == "finished") & runs["private"] & runs["config_id"].isin(private["config_id"])]
    run_mechanisms = privacy_kinds(done)["mechanism"]
    neighbours = column(done, "tags.dp.neighbours")
    parts = []
    for mechanism in sorted(set(private["mechanism"].dropna()), key=mechanism_order):
        mine = neighbours[run_mechanisms == mechanism].dropna()
        relations = sorted({str(n) for n in mine}) or [_default_neighbours(mechanism)]
        relation = " / ".join(NEIGHBOUR_NOTES.get(r, r) for r in relations)
        name = MECHANISM_NAMES.get(mechanism, mechanism)
        what = f"{name}, {MECHANISM_NOTES[mechanism]}" if mechanism in MECHANISM_NOTES else name
        parts.append(f"{mechanism} = {what} (ε for neighbouring datasets differing in {relation})")
    lines = ["Mechanism: " + "; ".join(parts) + "."]
    units = []
    unit_of_row = row_units(private)
    for unit in sorted(set(unit_of_row), key=lambda u: (u != PrivacyUnit.example.value, u)):
        if unit == PrivacyUnit.example.value:
            units.append("unit=example: ε per example (protects one training example; N = training examples)")
        elif unit == PrivacyUnit.user.value:
            users = column(private, "params.dataset.num_users")[unit_of_row == unit].dropna()
            n = ", ".join(sorted({_text(v) for v in users}, key=_sort_key)) or "?"
            units.append(
                "unit=user: ε per user (protects all of one user's examples, at most dp.max_examples_per_user "
                f"of them per step; N = users, dataset.num_users = {n})"
            )
        else:
            units.append(f"unit={unit}: ε per {unit}")
    line = "Unit: whom each row's ε protects. " + "; ".join(units) + "."
    if len(units) > 1:
        line += (
            " ε per example and ε per user are different guarantees: compare rows of one unit (one Pareto front each)."
        )
    return [*lines, line]


def mechanism_order(mechanism: str) -> tuple[int, str]:
    """Mechanisms in dpsweep.config.Mechanism's order (dpsgd first), unknown ones after, by name."""
    known = [m.value for m in Mechanism]
    return (known.index(mechanism) if mechanism in known else len(known), mechanism)


def _default_neighbours(mechanism: str) -> str:
    """The neighbouring relation of a mechanism's ε, for runs without the dp.neighbours tag."""
    if mechanism == Mechanism.dpsgd.value:
        return DEFAULT_NEIGHBOURS
    from dpsweep.privacy.ledger import NEIGHBOURS_OF  # dp-accounting takes a second to import: only when needed

    return NEIGHBOURS_OF.get(mechanism, "?")


# ---------------------------------------------------------------------------------------------
# the report
# ---------------------------------------------------------------------------------------------
@dataclass
class Report:
    uri: str
    experiment: str
    sweep_id: str | None
    runs: pd.DataFrame  # the selection's runs (report_runs), every status
    table: pd.DataFrame  # summary_table over the FINISHED runs (+ outside baselines, see warnings)
    counts: dict[str, int]
    parent_run_id: str | None = None
    warnings: list[str] = field(default_factory=list)
    # FINISHED non-private runs from outside a sweep that has none, pooled into its baseline rows
    baseline_runs: pd.DataFrame = field(default_factory=pd.DataFrame)

    @property
    def table_runs(self) -> pd.DataFrame:
        """The runs behind the table's rows: the selection's and the borrowed baseline runs."""
        return pd.concat([self.runs, self.baseline_runs], ignore_index=True) if len(self.baseline_runs) else self.runs

    @property
    def selection(self) -> str:
        return f"experiment {self.experiment!r}" + (f", sweep {self.sweep_id}" if self.sweep_id else "")

    def notes(self) -> list[str]:
        """The lines printed under the table: what was counted, what the columns mean, warnings."""
        c = self.counts
        lines = [
            f"{self.selection}: {c['finished']} of {c['total']} runs FINISHED; {c['failed']} failed, "
            f"{c['pruned']} pruned, {c['running']} running"
            + (f", {c['duplicate']} duplicate." if c["duplicate"] else "."),
            f"ε: final ε under each row's accountant at its δ. {score_note(self.table)}: mean ± sample std over "
            "seeds, in %. Drop: non-private baseline minus row, in percentage points.",
        ]
        lines += privacy_kind_notes(self.table, self.table_runs)
        lines += [OBJECTIVE_NOTES[m] + "." for m in score_metrics(self.table) if m in OBJECTIVE_NOTES]
        lines += task_notes(self.table, self.table_runs)
        return lines + [f"warning: {w}" for w in self.warnings]


def build_report(uri: str, experiment: str, sweep_id: str | None = None, sort: str = "accuracy") -> Report:
    """Read, check and tabulate a selection. Raises ReportError on an unknown experiment or sweep,
    an unknown sort key, or a selection without FINISHED runs."""
    lookup(SORT_KEYS, sort, "sort")  # fail before reading anything
    raw = search_runs(uri, experiment, sweep_id)
    runs = report_runs(raw)
    counts = outcome_counts(runs)
    if counts["finished"] == 0:
        where = ("sweep", sweep_id) if sweep_id else ("experiment", experiment)
        others = ", ".join(f"{counts[k]} {k}" for k in OUTCOME_ORDER[1:] if counts[k])
        raise ReportError(
            *where, f"0 FINISHED runs of {counts['total']}{f' ({others})' if others else ''}; nothing to report"
        )
    report = Report(uri, experiment, sweep_id, runs, pd.DataFrame(), counts, parent_run_id(raw))
    borrowed: list[str] = []  # notes on baseline runs taken from outside the sweep
    if sweep_id is not None:
        report.baseline_runs, borrowed = _outside_baselines(uri, experiment, runs)
    report.table = summary_table(report.table_runs, sort)
    report.warnings = borrowed + check(report.table_runs, report.table)
    return report


def _outside_baselines(uri: str, experiment: str, runs: pd.DataFrame) -> tuple[pd.DataFrame, list[str]]:
    """For a sweep without non-private runs of a dataset and model: the experiment's FINISHED
    non-private runs of it (sweeps usually reuse one baseline), and a note saying so."""
    done = runs[runs["outcome"] == "finished"]
    missing = set(_pairs(done)) - set(_pairs(done[~done["private"]]))
    if not missing:
        return pd.DataFrame(), []
    raw = search_runs(uri, experiment, filter_string="attributes.status = 'FINISHED' and params.`dp.enabled` = 'False'")
    if raw.empty:
        return pd.DataFrame(), []
    outside = report_runs(raw)
    wanted = pd.Series(_pairs(outside), index=outside.index, dtype=object).isin(missing)
    outside = outside[wanted & ~outside["run_id"].isin(runs["run_id"])]
    notes = []
    for (dataset, model), block in outside.groupby(pd.Series(_pairs(outside), index=outside.index), sort=True):
        notes.append(
            f"{dataset}/{model}: the sweep has no non-private run; the baseline rows pool the experiment's "
            f"{_runs(len(block))} of it, FINISHED and non-private ({', '.join(r[:8] for r in block['run_id'])})"
        )
    return outside, notes


def _runs(n: int) -> str:
    return f"{n} run" if n == 1 else f"{n} runs"


def _pairs(runs: pd.DataFrame) -> list[tuple[Any, Any]]:
    """(dataset, model) of each run, the model as the table shows it (a GAN run's: gan)."""
    return list(zip(param_or_tag(runs, "dataset.name"), run_models(runs), strict=True))


# ---------------------------------------------------------------------------------------------
# rendering: md, csv, tex, html
# ---------------------------------------------------------------------------------------------
PERCENT = 100.0


def _num(value: Any, spec: str) -> str:
    if value is None or pd.isna(value):
        return "—"
    return format(value, spec)


def _epsilon(value: Any) -> str:
    if value is None or pd.isna(value):
        return "—"
    return f"{value:.3g}" if value < 1000 else f"{value:.0f}"


def _accuracy(row: pd.Series) -> str:
    mean, std = row["test_accuracy_mean"], row["test_accuracy_std"]
    if pd.isna(mean):
        return "—"
    return f"{mean * PERCENT:.2f}" + ("" if pd.isna(std) else f" ± {std * PERCENT:.2f}")


Cell = Callable[[pd.Series], str]


def display_columns(table: pd.DataFrame) -> list[tuple[str, str, Cell]]:
    """(header, LaTeX header, cell formatter) per column of the paper table."""

    def param(key: str) -> Cell:
        return lambda row: _text(row[f"params.{key}"]) if _row_applies(row, key) else "—"

    cols: list[tuple[str, str, Cell]] = [
        ("dataset", "dataset", lambda r: _text(r["dataset"])),
        ("model", "model", lambda r: _text(r["model"])),
    ]
    if _shows_tasks(table):
        cols.append(("task", "task", lambda r: _text(r["task"])))
    score = f"{score_name(table)} (%)"
    cols += [
        ("B", "$B$", lambda r: _num(r["batch_size"], "d")),
        ("σ", r"$\sigma$", lambda r: _num(r["noise_multiplier"], "g")),
        ("C", "$C$", _clip_norm),
        ("clipping", "clipping", _clipping),
        ("lr", "lr", lambda r: _num(r["lr"], "g")),
        ("epochs", "epochs", lambda r: _num(r["epochs"], "d")),
    ]
    cols += [(key, _latex_cell(key), param(key)) for key in extra_columns(table)]
    cols += [
        ("δ", r"$\delta$", lambda r: _num(r["delta"], "g")),
        ("accountant", "accountant", lambda r: str(r["accountant"]) if r["private"] else "non-private"),
    ]
    if shows_privacy_kinds(table):  # whom each ε protects, and how its noise was added
        cols += [(name, name, _privacy_kind(name)) for name in PRIVACY_KINDS]
    cols += [
        ("ε", r"$\varepsilon$", lambda r: _epsilon(r["epsilon"])),
        (score, _latex_cell(score), _accuracy),
        ("drop (pp)", "drop (pp)", lambda r: _num(r["accuracy_drop"] * PERCENT, ".2f")),
        ("runs", "runs", lambda r: str(int(r["runs"]))),
    ]
    return cols


def _privacy_kind(name: str) -> Cell:
    """A private row's mechanism or unit (the default where unknown); a dash for a non-private row."""

    def cell(row: pd.Series) -> str:
        if not row["private"]:
            return "—"
        value = row.get(name)
        return PRIVACY_KIND_DEFAULTS[name] if value is None or pd.isna(value) else str(value)

    return cell


def _shows_tasks(table: pd.DataFrame) -> bool:
    """A table with rows of another task than the classifier shows the task column (and CSV has it)."""
    return bool((row_tasks(table) != DEFAULT_TASK).any())


def _clipping_of(row: pd.Series) -> str:
    """The row's clipping strategy: runs from before dp.clipping existed clipped at a fixed C."""
    value = row.get("clipping")
    return "fixed" if value is None or (isinstance(value, float) and math.isnan(value)) else str(value)


def _clipping(row: pd.Series) -> str:
    """fixed, or quantile / adaptive with their target quantile γ."""
    if not row["private"]:
        return "—"
    kind = _clipping_of(row)
    gamma = row.get("params.dp.clip_quantile")
    return kind if kind == "fixed" or gamma is None or pd.isna(gamma) else f"{kind} γ={_text(gamma)}"


def _clip_norm(row: pd.Series) -> str:
    """C as configured; a quantile run's C is its own private release (param dp.max_grad_norm_chosen), and an
    adaptive run's moves from this start."""
    return "—" if row["private"] and _clipping_of(row) == "quantile" else _num(row["max_grad_norm"], "g")


def paper_table(table: pd.DataFrame, latex: bool = False) -> pd.DataFrame:
    """The table as text cells, with the headers a paper shows (unicode, or LaTeX when ``latex``)."""
    cols = display_columns(table)
    rows = [row for _, row in table.iterrows()]
    cells = {(tex if latex else plain): [fmt(row) for row in rows] for plain, tex, fmt in cols}
    return pd.DataFrame(cells, columns=[tex if latex else plain for plain, tex, _ in cols])


TEXT_COLUMNS = ("dataset", "model", "task", "accountant", *PRIVACY_KINDS)


def _right_aligned(shown: pd.DataFrame) -> list[bool]:
    """Per column of a paper_table: numbers (or dashes, or "mean ± std") are right-aligned."""

    def number(cell: str) -> bool:
        try:
            float(cell.partition(" ± ")[0])
        except ValueError:
            return cell == "—"
        return True

    return [h not in TEXT_COLUMNS and all(number(c) for c in shown[h]) for h in shown.columns]


def to_markdown(report: Report) -> str:
    """A GitHub-flavoured markdown table (numbers right-aligned), then the notes as a list."""
    shown = paper_table(report.table).map(lambda c: c.replace("|", r"\|"))
    widths = [max(3, len(h), *(len(v) for v in shown[h])) for h in shown.columns]  # a rule needs 3 dashes
    right = _right_aligned(shown)

    def line(cells: Sequence[str]) -> str:
        padded = [c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, right, strict=True)]
        return "| " + " | ".join(padded) + " |"

    rule = ["-" * (w - 1) + ":" if r else "-" * w for w, r in zip(widths, right, strict=True)]
    lines = [line(list(shown.columns)), line(rule)]
    lines += [line(list(row)) for row in shown.itertuples(index=False, name=None)]
    return "\n".join([*lines, "", *[f"- {note}" for note in report.notes()]]) + "\n"


def to_csv(report: Report) -> str:
    """The numbers at full precision (accuracies as fractions), one row per config, no notes."""
    table = report.table
    extras = [f"params.{k}" for k in extra_columns(table)]
    kinds = ["dataset", "model", *(["task"] if _shows_tasks(table) else [])]
    privacy = list(PRIVACY_KINDS) if shows_privacy_kinds(table) else []
    names = ["config_id", *kinds, *SETTING_COLUMNS, *privacy, "private", *extras, "epsilon", "test_accuracy_mean"]
    names += ["test_accuracy_std", "accuracy_drop", "runs", "runs_without_accuracy", "run_ids"]
    names += [m for m in MEMORISATION_METRICS if m in table and table[m].notna().any()]
    out = table[names].rename(columns={e: e.removeprefix("params.") for e in extras})
    out = out.assign(run_ids=out["run_ids"].map(" ".join))
    return str(out.to_csv(index=False, lineterminator="\n"))


LATEX_SPECIAL = {
    "\\": r"\textbackslash{}",
    "&": r"\&",
    "%": r"\%",
    "$": r"\$",
    "#": r"\#",
    "_": r"\_",
    "{": r"\{",
    "}": r"\}",
    "~": r"\textasciitilde{}",
    "^": r"\textasciicircum{}",
}


def _latex_cell(text: str) -> str:
    escaped = "".join(LATEX_SPECIAL.get(ch, ch) for ch in text)
    return escaped.replace(" ± ", r" $\pm$ ").replace("—", "--")


def to_latex(report: Report) -> str:
    """A booktabs ``tabular`` (needs ``\\usepackage{booktabs}``), the notes as ``%`` comments."""
    shown = paper_table(report.table, latex=True)
    spec = "".join("r" if r else "l" for r in _right_aligned(paper_table(report.table)))
    lines = [f"% {note}" for note in report.notes()]
    lines += [f"\\begin{{tabular}}{{{spec}}}", r"\toprule", " & ".join(shown.columns) + r" \\", r"\midrule"]
    lines += [" & ".join(_latex_cell(c) for c in row) + r" \\" for row in shown.itertuples(index=False, name=None)]
    lines += [r"\bottomrule", r"\end{tabular}"]
    return "\n".join(lines) + "\n"


def to_html(report: Report) -> str:
    """An HTML ``<table>`` and the notes as paragraphs (no page around them)."""
    table = paper_table(report.table).to_html(index=False, border=0, escape=True)
    notes = "\n".join(f"<p>{html_escape(n)}</p>" for n in report.notes())
    return f"{table}\n{notes}\n"


FORMATS: Registry[Callable[[Report], str]] = Registry("format")
FORMATS.register("md")(to_markdown)
FORMATS.register("csv")(to_csv)
FORMATS.register("tex")(to_latex)
FORMATS.register("html")(to_html)


def render(report: Report, fmt: str = "md") -> str:
    """The report as text in ``fmt`` (a FORMATS name)."""
    return lookup(FORMATS, fmt, "format")(report)


FIGURE_FORMATS = ("png", "pdf", "svg")  # dpsweep-report --figure-format (analysis.report_plots writes them)
IMAGE_TYPES = {".png": "image/png", ".svg": "image/svg+xml"}  # what a browser shows inline (PDF: a link)

HTML_PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{title}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; max-width: 80em; }}
table {{ border-collapse: collapse; font-size: 0.9em; }}
th, td {{ padding: 0.25em 0.6em; border-bottom: 1px solid #ccc; text-align: right; }}
th {{ border-bottom: 2px solid #333; }}
figure {{ margin: 2em 0; }}
img {{ max-width: 100%; height: auto; }}
</style>
</head>
<body>
<h1>{title}</h1>
{table}
{figures}
</body>
</html>
"""


def _figure_name(path: Path) -> str:
    return path.stem.replace("_", " ")


def to_html_page(report: Report, figures: Sequence[Path] = ()) -> str:
    """A whole HTML page that needs nothing else: the table, the notes and the figures, PNG and SVG
    embedded as data URIs (so it opens offline, mailed or archived on its own); PDF figures linked."""
    parts = []
    for path in figures:
        kind = IMAGE_TYPES.get(path.suffix)
        caption = f"<figcaption>{html_escape(_figure_name(path))}</figcaption>"
        if kind is None:
            parts.append(f'<figure><a href="{html_escape(path.name)}">{html_escape(path.name)}</a>{caption}</figure>')
            continue
        data = base64.b64encode(path.read_bytes()).decode("ascii")
        alt = html_escape(_figure_name(path))
        parts.append(f'<figure><img src="data:{kind};base64,{data}" alt="{alt}">{caption}</figure>')
    title = f"dpsweep report: {report.selection}"
    return HTML_PAGE.format(title=html_escape(title), table=to_html(report), figures="\n".join(parts))


def write(report: Report, fmt: str, out_dir: Path, figures: Sequence[Path] = ()) -> Path:
    """Write ``report.<fmt>`` into ``out_dir``; returns its path. With ``figures`` (files in
    ``out_dir``): markdown embeds them as images below the table, HTML becomes a self-contained page
    (:func:`to_html_page`), LaTeX lists them in a comment; CSV stays the numbers only."""
    path = out_dir / f"report.{fmt}"
    text = render(report, fmt)
    if figures and fmt == "md":
        text += "\n" + "\n".join(f"![{_figure_name(f)}]({f.name})\n" for f in figures)
    elif fmt == "html":
        text = to_html_page(report, figures)
    elif figures and fmt == "tex":
        text += "".join(f"% figure: \\includegraphics{{{f.name}}}\n" for f in figures)
    path.write_text(text, encoding="utf-8")
    return path
