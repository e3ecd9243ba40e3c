"""The privacy–accuracy table: one row per config, seeds pooled, its non-private baseline, labels and Pareto fronts.

What a row is: the FINISHED runs whose hyperparameters are equal once the seed and the keys that
do not change a result (``dpsweep.config.NON_IDENTITY_PREFIXES``: tracking, launcher, sweep,
checkpoint directory, progress bars; and ``train.eval_batch_size``) are set aside. Accuracies are
fractions in [0, 1] in the DataFrames; ``test_accuracy_std`` is the sample standard deviation
(n − 1; NaN for one run). ``epsilon`` is the final ε under the row's own accountant (``dp.accountant``)
at its δ: the ``epsilon`` metric, the largest among the row's runs (equal across seeds); for the
trials of a private tuning, the whole procedure's ε (``epsilon_tuning``), and the row's ``accountant``
the one that computed it (rdp, tag ``tuning.accountant``: dp-accounting analyses the procedure by RDP
alone), not the trial's own ``dp.accountant``. ``tuning`` says which rows are a private tuning's
trials: ``released`` (the released trial, a row of its own) or ``withheld`` (shown only with all trials,
:func:`dpsweep.analysis.report.build_report`'s ``all_trials``); None for other rows.
``accuracy_drop`` is the baseline's mean accuracy minus the row's: the non-private row of the same
dataset and model whose other hyperparameters match the row's best.

The columns keep their names (``test_accuracy_mean``, ...) whatever the task; :func:`score_name`
says which objective they hold ("TSTR accuracy", or "accuracy" when tasks are mixed). Rows
differing only in their mechanism or unit are separate rows (their params differ); the baseline of
a row ignores them (dp.* keys) and the users' assignment (``dataset.users`` and co., which change
nothing without DP). ε per example and ε per user are different guarantees, so the Pareto front is
one per unit (:func:`pareto_front`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from dpsweep.analysis.report.cells import epsilon_text, key_text
from dpsweep.analysis.report.columns import (
    DEFAULT_OF_PARAM,
    FLOAT_COLUMNS,
    HYPERPARAMETERS,
    INTEGER_COLUMNS,
    KIND_OF_PARAM,
    METHOD_PARAM,
    MISSING,
    PRIVACY_KIND_DEFAULTS,
    PRIVACY_KINDS,
    ROW_KIND_PARAMS,
    SETTING_COLUMNS,
    SHORT_NAMES,
    TUNING_ACCOUNTANT,
    USER_PARAMS,
    column,
    lookup,
    objective_name,
    param_or_tag,
    row_shares,
    row_tasks,
    row_units,
    run_methods,
    run_models,
    run_tasks,
)
from dpsweep.analysis.report.query import hyperparameter_keys
from dpsweep.analysis.report.risk import RISK_METRICS, pooled_risks, run_risks, run_tuning_analyses
from dpsweep.config import TASK_SECTIONS, UNITS, task_objectives, task_schemas
from dpsweep.registry import Registry


@dataclass(frozen=True)
class SortKey:
    column: str
    ascending: bool


SORT_KEYS: Registry[SortKey] = Registry("sort key")
SORT_KEYS.register("accuracy")(SortKey("test_accuracy_mean", ascending=False))  # best first
SORT_KEYS.register("epsilon")(SortKey("epsilon", ascending=True))  # most private first


def summary_table(runs: pd.DataFrame, sort: str = "accuracy") -> pd.DataFrame:
    """One row per config over the FINISHED runs of ``runs`` (from report_runs).

    Columns: config_id, dataset, model, task, method (``task.method`` of a task with methods, e.g. als or
    dpam: :func:`columns.run_methods`; None for other tasks' rows), private, batch_size, noise_multiplier,
    max_grad_norm, lr, epochs, delta, accountant, mechanism, unit (privacy_kinds: None for a non-private row),
    epsilon, test_accuracy_mean, test_accuracy_std, tuning (a private tuning's ``released`` or
    ``withheld`` trials; None), tuning_analysis (the analysis of such a row's ε, tag ``tuning.analysis``;
    None), accuracy_drop, runs (FINISHED runs pooled),
    runs_without_accuracy, baseline_config_id, run_ids, audit_epsilon_lower and audit_epsilon_lower_fdp
    (the smallest one-run audit bounds of the row's runs, Steinke et al.'s and the f-DP one; NaN without
    audits), epsilon_lower, mu_gdp and tpr_at_1pct (the rows' certainty and attack risk,
    :mod:`dpsweep.analysis.report.risk`; NaN where the runs logged none), unstable (the spread over seeds above
    :data:`SPREAD_LIMIT` of the mean: :func:`unstable_rows`),
    the tasks' shares (:func:`columns.row_shares`),
    and ``params.<key>`` for every hyperparameter (the raw strings). The accuracy columns are of
    each run's score, its task's objective metric; the ``model`` of a row of a task whose model
    group is only an evaluation model is the task's name. A task's per-run shares
    (``TaskConfig.row_share``) are means over the row's runs (NaN for other tasks' rows). Rows are in blocks per
    dataset and model, the non-private baseline first, then by ``sort`` (a SORT_KEYS name); NaN last.
    """
    order = lookup(SORT_KEYS, sort, "sort")
    done = runs[runs["outcome"] == "finished"]
    keys = hyperparameter_keys(done)
    table = _with_settings(_pooled(done), done, keys).reset_index()
    table[["accuracy_drop", "baseline_config_id"]] = _baselines(table, keys)
    table["unstable"] = unstable_rows(table)
    head = ["config_id", "dataset", "model", "task", "method", *SETTING_COLUMNS, *PRIVACY_KINDS, "private", "epsilon"]
    head += ["test_accuracy_mean", "test_accuracy_std"]
    tail = [
        "tuning", "tuning_analysis", "accuracy_drop", "runs", "runs_without_accuracy", "baseline_config_id",
        "run_ids", "audit_epsilon_lower", "audit_epsilon_lower_fdp", *RISK_METRICS, "unstable",
    ]  # fmt: skip
    tail += row_shares()
    table = table[head + tail + [f"params.{k}" for k in keys]]
    return _sorted(table, order)


def _pooled(done: pd.DataFrame) -> pd.DataFrame:
    """The figures of each config (indexed by config_id) over its FINISHED runs ``done``: ε, the
    accuracy's mean and std, the runs and those without accuracy, and the memorisation means."""
    accuracy = done["score"].astype(float)
    work = pd.DataFrame(
        {
            "config_id": done["config_id"],
            "run_id": done["run_id"],
            "accuracy": accuracy,
            "epsilon": _epsilons(done),
            "missing": accuracy.isna(),
            "audit": column(done, AUDIT_METRIC).astype(float),
            "audit_fdp": column(done, AUDIT_FDP_METRIC).astype(float),
            **{name: column(done, f"metrics.{name}").astype(float) for name in row_shares()},
            **run_risks(done),
        }
    )
    grouped = work.groupby("config_id", sort=False)
    return pd.DataFrame(
        {
            "epsilon": grouped["epsilon"].max(),
            "test_accuracy_mean": grouped["accuracy"].mean(),
            "test_accuracy_std": grouped["accuracy"].std(ddof=1),
            "runs": grouped.size(),
            "runs_without_accuracy": grouped["missing"].sum().astype(int),
            "run_ids": grouped["run_id"].agg(tuple),
            "audit_epsilon_lower": grouped["audit"].min(),
            "audit_epsilon_lower_fdp": grouped["audit_fdp"].min(),
            **{name: grouped[name].mean() for name in row_shares()},
            **pooled_risks(grouped),
        }
    )


# A row is unstable where the sample std of its score over seeds exceeds this share of its mean (its
# coefficient of variation): at 82.50 ± 8.25 (10%), one seed's luck moves the row by more than most
# differences between rows and most drops against a baseline, so the row's mean says little. The limit is
# meant to pass the replicates of a recipe that trains to convergence and to catch one that does not
# (too few epochs, too large a step, a run that failed without diverging). It needs no scale, so it
# serves every task's objective (accuracy, TSTR accuracy, Recall@20) alike, private or not; a row of
# one scored run has no spread and is never flagged. With 2 or 3 seeds the std is itself a rough estimate.
SPREAD_LIMIT = 0.05


def unstable_rows(table: pd.DataFrame) -> pd.Series:
    """Which rows (of :func:`_pooled`'s or the summary table's) have a sample std of their score over
    seeds above :data:`SPREAD_LIMIT` times its mean; False where it has no std (fewer than 2 scored runs)."""
    mean, std = table["test_accuracy_mean"].astype(float), table["test_accuracy_std"].astype(float)
    return (std.notna() & mean.notna() & (std > SPREAD_LIMIT * mean)).astype(bool)


AUDIT_METRIC = "metrics.audit.epsilon_lower"  # a one-run audit's ε lower bound (dpsweep.audit)
AUDIT_FDP_METRIC = "metrics.audit.epsilon_lower_fdp"  # ... read against the run's own ledger (dpsweep.audit.fdp)


def shows_audits(table: pd.DataFrame) -> bool:
    """Whether any row has a one-run audit's ε lower bound."""
    return bool(audit_columns(table))


def audit_columns(table: pd.DataFrame) -> list[str]:
    """The audit bounds some row has: Steinke et al.'s, and the f-DP one (audits before it have none)."""
    names = ["audit_epsilon_lower", "audit_epsilon_lower_fdp"]
    return [n for n in names if n in table and bool(table[n].notna().any())]


def _epsilons(done: pd.DataFrame) -> pd.Series:
    """Each run's ε: for a private tuning's trials, the whole procedure's (the one to publish with a
    tuned result), else its own."""
    own = column(done, "metrics.epsilon")
    return done["metrics.epsilon_tuning"].fillna(own) if "metrics.epsilon_tuning" in done else own


def _with_settings(table: pd.DataFrame, done: pd.DataFrame, keys: Sequence[str]) -> pd.DataFrame:
    """``table`` (from _pooled) with each config's settings, read from its first run: private, the
    HYPERPARAMETERS columns (typed), task, model, mechanism and unit, and ``params.<key>`` per key."""
    first = done.drop_duplicates("config_id").set_index("config_id")
    table["private"] = first["private"]
    for name, key in HYPERPARAMETERS.items():
        table[name] = param_or_tag(first, key)
    tasks = run_tasks(first)
    for task, schema in task_schemas().items():  # a task with its own learning rate shows it, not optimizer.lr
        if schema.learning_rate_param != HYPERPARAMETERS["lr"]:
            own = tasks == task
            table.loc[own[own].index, "lr"] = param_or_tag(first, schema.learning_rate_param)[own]
    table["task"] = tasks
    table["method"] = run_methods(first)
    table["model"] = run_models(first)
    table["tuning"] = column(first, "tuning").astype(object)
    table["tuning_analysis"] = run_tuning_analyses(first)  # which analysis gave epsilon_tuning
    tuned = column(first, "metrics.epsilon_tuning").notna()  # its ε: the procedure's, under its accountant
    procedure = column(first, "tags.tuning.accountant").astype(object).fillna(TUNING_ACCOUNTANT)
    table.loc[tuned[tuned].index, "accountant"] = procedure[tuned]
    for name, value in privacy_kinds(first).items():
        table[name] = value
    for name in INTEGER_COLUMNS:
        table[name] = pd.to_numeric(table[name], errors="coerce").astype("Int64")
    for name in FLOAT_COLUMNS:
        table[name] = pd.to_numeric(table[name], errors="coerce").astype(float)
    for key in keys:
        table[f"params.{key}"] = first[f"params.{key}"]
    return table


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


UNIT_OF_KEY = {key: unit for unit, facts in UNITS.items() for key in facts.keys}  # keys read at one unit only


def key_applies(rows: pd.DataFrame, key: str) -> pd.Series:
    """Which of ``rows`` (table rows) the hyperparameter ``key`` means something for: DP's keys (dp.*)
    the private rows; the users' assignment (USER_PARAMS) the private rows over users (unit=user),
    the only runs that read it; any other key every row."""
    if not private_only(key):
        return pd.Series(True, index=rows.index, dtype=bool)
    private = rows["private"].astype(bool)
    unit = UNIT_OF_KEY.get(key)
    return private & (row_units(rows) == unit) if unit is not None else private


def row_applies(row: pd.Series, key: str) -> bool:
    """:func:`key_applies` for one row."""
    if not private_only(key):
        return True
    unit = UNIT_OF_KEY.get(key)
    return bool(row["private"]) and (unit is None or row.get("unit") == unit)


def baseline_key(key: str) -> bool:
    """A hyperparameter a private row and its non-private baseline should share: none of DP's
    (dp.*, mechanism and unit included), of the row's kind, or of the users' assignment."""
    return not private_only(key) and key not in ROW_KIND_PARAMS


def _baselines(table: pd.DataFrame, keys: Sequence[str]) -> pd.DataFrame:
    """For each private row, the best-matching non-private row of the same dataset and model (most
    equal non-DP hyperparameters, the users' assignment aside: USER_PARAMS; then more runs) and the
    accuracy drop against it."""
    shared = [f"params.{k}" for k in keys if baseline_key(k)]
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
    over the user-level rows (key_applies), a task's own settings (task.*) over the rows that
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
    """Whether ``key`` belongs to a section only some tasks have (``task.*``: dpsweep.config.TASK_SECTIONS)."""
    return key.split(".", 1)[0] in TASK_SECTIONS


def extra_columns(table: pd.DataFrame) -> list[str]:
    """Swept hyperparameters that have no column of their own in the table (e.g. model.hidden_units;
    not dp.mechanism and dp.unit, which have theirs once they vary: shows_privacy_kinds; nor task.method, whose
    column shows whenever a row has a method)."""
    shown = set(HYPERPARAMETERS.values()) | set(PRIVACY_KINDS.values()) | {METHOD_PARAM}
    return [k for k in swept_params(table) if k not in shown]


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
            parts.append(f"{SHORT_NAMES.get(key, key)}={key_text(key, value)}")
        labels[row["config_id"]] = " ".join(parts) or f"{row['dataset']}/{row['model']}"
    return pd.Series(labels, name="label")


def privacy_names(table: pd.DataFrame) -> pd.Series:
    """A row's privacy in a few characters (indexed by config_id): ``ε=1.53`` or ``non-private``;
    where rows of one dataset and model share it, what else tells them apart (their config_labels
    less the dataset, model and privacy) follows in parentheses."""
    labels = config_labels(table)
    names, blocks = {}, {}
    for _, row in table.iterrows():
        name = "non-private" if not row["private"] else f"ε={epsilon_text(row['epsilon'])}"
        names[row["config_id"]], blocks[row["config_id"]] = name, (row["dataset"], row["model"], name)
    shared = pd.Series(blocks).duplicated(keep=False)
    out = {}
    for _, row in table.iterrows():
        cid, name = row["config_id"], names[row["config_id"]]
        rest = str(labels.get(cid, "")).removeprefix(f"{row['dataset']}/{row['model']}").strip()
        rest = rest.removeprefix("non-private").strip()
        out[cid] = f"{name} ({rest})" if shared[cid] and rest else name
    return pd.Series(out, dtype=object)


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


def score_metrics(table: pd.DataFrame) -> list[str]:
    """The objective metrics behind the accuracy columns of ``table``'s rows, e.g. ``["tstr_accuracy"]``."""
    return sorted(set(row_tasks(table).map(task_objectives()).dropna()))


def score_name(table: pd.DataFrame) -> str:
    """What the accuracy columns of ``table`` hold: ``test accuracy`` or ``TSTR accuracy`` when
    every row has one objective, ``accuracy`` when tasks with different objectives are mixed."""
    metrics = score_metrics(table)
    return objective_name(metrics[0]) if len(metrics) == 1 else "accuracy"
