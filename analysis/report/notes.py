"""The notes under a report's table: warnings on what the numbers mean, and what the columns of other tasks,
mechanisms and privacy units are.

:func:`check` gives the warnings (mixed accountants or δ, missing metrics, duplicate runs, runs not
for release, the privacy cost of picking the best row, missing or mismatched baselines). The other
notes explain: :func:`score_note` the accuracy columns, :func:`task_notes` what a task's schema asks
for (a reference score, :func:`reference_accuracies`, and a share averaged per row), :func:`privacy_kind_notes` each
mechanism and whom each unit's ε protects, once the table shows them.
"""

from __future__ import annotations

import pandas as pd

from dpsweep.analysis.report.cells import PERCENT, param_text, percent_text, runs_text, sort_key
from dpsweep.analysis.report.columns import (
    MISSING,
    NEIGHBOUR_NOTES,
    RELEASED,
    column,
    mechanism_label,
    mechanism_neighbours,
    mechanism_note,
    mechanism_order,
    objective_name,
    param_or_tag,
    row_tasks,
    row_units,
    run_pairs,
    run_tasks,
)
from dpsweep.analysis.report.risk import analysis_text, tuning_analyses
from dpsweep.analysis.report.table import (
    SPREAD_LIMIT,
    baseline_key,
    config_labels,
    privacy_kinds,
    privacy_names,
    score_name,
    shows_privacy_kinds,
    unstable_rows,
)
from dpsweep.config import UNITS, task_objectives, task_schemas
from dpsweep.run.divergence import REASON_TAG


def check(runs: pd.DataFrame, table: pd.DataFrame, all_trials: bool = False) -> list[str]:
    """What a reader of the table must know: a row whose runs mix accountants or δ (their ε differ
    in meaning), rows of one dataset and model under different accountants or δ (their ε are not
    comparable on one front), FINISHED runs without accuracy or ε, a private tuning's released trial
    (or, with ``all_trials``, its trials), and missing or mismatched baselines."""
    labels = config_labels(table) if not table.empty else pd.Series(dtype=str)
    done = runs[runs["outcome"] == "finished"]
    notes = _mixed_privacy_notes(done, table, labels)
    notes += _missing_metric_notes(done, labels)
    notes += _duplicate_notes(runs, done)
    notes += _diverged_notes(runs)
    notes += _release_notes(done)
    for (dataset, model), block in table.groupby(["dataset", "model"], sort=True):
        if block["private"].all():
            notes.append(f"{dataset}/{model}: no FINISHED non-private run; no accuracy drop can be given")
    notes += _tuning_notes(done, table, all_trials)
    notes += _baseline_mismatches(table, labels)
    notes += _spread_notes(table, labels)
    return notes


def _mixed_privacy_notes(done: pd.DataFrame, table: pd.DataFrame, labels: pd.Series) -> list[str]:
    """Rows whose runs mix accountants or δ, and blocks of one dataset and model whose rows differ in them."""
    notes: list[str] = []
    for config_id, group in done.groupby("config_id", sort=False):
        if not group["private"].any():
            continue
        for key, what in (("dp.accountant", "accountants"), ("dp.delta", "δ")):
            logged = pd.concat([column(group, f"params.{key}"), column(group, f"tags.{key}")]).dropna()
            seen = {param_text(v) for v in logged}  # δ as a number: "1e-05" and "0.00001" agree
            if len(seen) > 1:
                notes.append(
                    f"row {labels.get(config_id, config_id)} mixes {what} ({', '.join(sorted(map(str, seen)))}) "
                    f"across its runs ({', '.join(r[:8] for r in group['run_id'])}): its ε are not one guarantee"
                )
    for (dataset, model), block in table[table["private"]].groupby(["dataset", "model"], sort=True):
        for name, what in (("accountant", "accountants"), ("delta", "δ")):
            values = sorted({param_text(v) for v in block[name]})
            if len(values) > 1:
                notes.append(
                    f"{dataset}/{model}: the rows use different {what} ({', '.join(values)}); their ε are "
                    "not comparable, nor is the Pareto front across them"
                )
    return notes


def _missing_metric_notes(done: pd.DataFrame, labels: pd.Series) -> list[str]:
    """FINISHED runs of a task this dpsweep does not know, and FINISHED runs without their score or ε."""
    notes: list[str] = []
    unknown = done[done["objective"].isna()]
    for task, group in unknown.groupby("task", sort=True):
        notes.append(
            f"{runs_text(len(group))} of task {task!r}, which this dpsweep does not know (tasks: "
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
    return notes


def _duplicate_notes(runs: pd.DataFrame, done: pd.DataFrame) -> list[str]:
    """FINISHED runs left out as repeats of a newer run's config.hash (the seed included)."""
    notes: list[str] = []
    for config_hash, group in runs[runs["outcome"] == "duplicate"].groupby(column(runs, "tags.config.hash")):
        kept = done[column(done, "tags.config.hash") == config_hash]["run_id"]
        notes.append(
            f"{runs_text(len(group))} ({', '.join(r[:8] for r in group['run_id'])}) repeat the config of run "
            f"{', '.join(r[:8] for r in kept)} (config.hash {config_hash}, seed included): a repeat is not another "
            "seed, so only the newest is in the table"
        )
    return notes


def _diverged_notes(runs: pd.DataFrame) -> list[str]:
    """FINISHED runs tagged diverged, left out of the rows' means and of the baselines."""
    diverged = runs[runs["outcome"] == "diverged"]
    if diverged.empty:
        return []
    reasons = column(diverged, f"tags.{REASON_TAG}").fillna("no reason recorded")
    named = "; ".join(f"{r[:8]}: {why}" for r, why in zip(diverged["run_id"], reasons, strict=True))
    return [f"{runs_text(len(diverged))} diverged and are left out of the rows' means and baselines ({named})"]


def _spread_notes(table: pd.DataFrame, labels: pd.Series) -> list[str]:
    """The unstable rows (:func:`dpsweep.analysis.report.table.unstable_rows`), private or not, and why: their
    spread across seeds is above :data:`SPREAD_LIMIT` of their mean; worse, where it exceeds the mean
    itself (an error bar that crosses zero), often a run that failed to learn without being caught as
    diverged."""
    notes = []
    for _, row in table[unstable_rows(table)].iterrows():
        mean, std = row["test_accuracy_mean"], row["test_accuracy_std"]
        label, runs = labels.get(row["config_id"], row["config_id"]), ", ".join(r[:8] for r in row["run_ids"])
        if std > mean:
            notes.append(
                f"{label}: the spread across seeds (± {100 * std:.2f}) exceeds the mean ({100 * mean:.2f}); look "
                f"at its runs ({runs})"
            )
            continue
        drops = "" if row["private"] else ", or a drop against it,"
        notes.append(
            f"{label}: unstable across seeds: the spread (± {100 * std:.2f}) is {std / mean:.0%} of the mean "
            f"({100 * mean:.2f}); a row is flagged above {SPREAD_LIMIT:.0%} (sample std over mean). A difference "
            f"from another row{drops} smaller than the spread may be the seeds' alone; look at its runs ({runs})"
        )
    return notes


def _release_notes(done: pd.DataFrame) -> list[str]:
    """Private runs not for release (tag dp.release): without dp.secure_mode, or having logged a
    statistic of the training data outside the ledger (tag dp.outside_ledger)."""
    notes: list[str] = []
    not_for_release = done[done["private"] & (column(done, "tags.dp.release") == "not-for-release")]
    insecure = not_for_release[column(not_for_release, "tags.dp.secure_mode").astype(str) != "True"]
    if not insecure.empty:
        notes.append(
            f"{runs_text(len(insecure))} ran without dp.secure_mode: their noise and Poisson sampling can be "
            "regenerated from train.seed, which is logged, so a model they trained is not for release"
        )
    outside = not_for_release[column(not_for_release, "tags.dp.outside_ledger").notna()]
    for what, group in outside.groupby(column(outside, "tags.dp.outside_ledger"), sort=True):
        notes.append(
            f"{runs_text(len(group))} logged {what}, a statistic of the training data that no accountant covers: "
            "their ε is not all they released"
        )
    return notes


def _tuning_notes(done: pd.DataFrame, table: pd.DataFrame, all_trials: bool = False) -> list[str]:
    """The privacy of choosing among rows. A private tuning's runs (column ``tuning``): only the released
    trial may be published, at the whole procedure's ε (epsilon_tuning) under the accountant that computed
    it (rdp), by the analysis its tag ``tuning.analysis`` names (before the tag: papernot_steinke). Without
    ``all_trials`` the report holds the released trials alone, and the note says nothing
    of how many trials ran (K must stay secret: Papernot & Steinke 2022); with it, the note counts them and
    names the released one. Otherwise, where the table offers K > 1 private
    rows of one dataset and model at the same ε (tuned hyperparameters: lr, C, ...), the best of them is
    picked after seeing all, and its ε is that of one run, not of the choice: the note gives the naive
    composed ε of their runs (basic composition: Dwork & Roth 2014, Thm. 3.16). Rows at different ε (a σ
    sweep) are a trade-off curve, not a choice, and get no note."""
    notes: list[str] = []
    private = done[done["private"]]
    roles = column(private, "tuning")
    tuned = private[roles.notna()]
    kept = tuned[roles[tuned.index] == RELEASED]
    accountants = ", ".join(sorted({str(a) for a in table[column(table, "tuning").notna()]["accountant"]})) or "rdp"
    analysis = analysis_text(tuning_analyses(table[column(table, "tuning").notna()])) if not tuned.empty else ""
    if not tuned.empty and all_trials:
        notes.append(
            f"{runs_text(len(tuned))} are trials of a private tuning (sweep.private_tuning): only "
            f"{', '.join(r[:8] for r in kept['run_id']) or 'none'} (tag tuning.released=true; trial: released) may "
            f"be published, at the whole procedure's ε (epsilon_tuning, under the {accountants} accountant, by "
            f"{analysis}: the ε shown for their rows), not at one run's; the other trials and their number stay private"
        )
    elif not kept.empty:
        notes.append(
            f"{'runs' if len(kept) > 1 else 'run'} {', '.join(r[:8] for r in kept['run_id'])}: the released trial "
            f"of a private tuning (sweep.private_tuning), shown at the whole procedure's ε (epsilon_tuning, under "
            f"the {accountants} accountant, which computed it, by {analysis}), not at one run's; the "
            "tuning's other trials, if any, and their number are withheld"
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
            f"them all, so its ε is that of one run, not of the choice. Their {runs_text(len(runs))} together cost at "
            f"most ε = {total:.4g} at δ = {delta:.3g} (basic composition, Dwork & Roth 2014, Thm. 3.16); for a best "
            "row with an honest ε, run the sweep with sweep.private_tuning=true (Papernot & Steinke 2022)"
        )
    return notes


def _baseline_mismatches(table: pd.DataFrame, labels: pd.Series) -> list[str]:
    notes = []
    by_id = table.set_index("config_id")
    shared = [c for c in table.columns if c.startswith("params.") and baseline_key(c.removeprefix("params."))]
    for _, row in table[table["private"] & table["baseline_config_id"].notna()].iterrows():
        base = by_id.loc[row["baseline_config_id"]]
        differ = [
            f"{c.removeprefix('params.')} {param_text(row[c])} vs {param_text(base[c])}"
            for c in shared
            if not (row[c] == base[c] or (pd.isna(row[c]) and pd.isna(base[c])))
        ]
        if differ:
            notes.append(
                f"row {labels.get(row['config_id'])}: no baseline with the same settings; its drop is against "
                f"{labels.get(row['baseline_config_id'])}, which differs in {'; '.join(differ)}"
            )
    return notes


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
    """Per dataset and model (``<dataset>/<model>``): the FINISHED non-private runs that logged their
    task's reference score (``TaskConfig.reference_metric``: for a task scored through an evaluation
    model, that model trained on the real training split instead), pooled: columns dataset, model,
    classifier (model.name), metric, the metric's mean and std (``<metric>_mean``, ``<metric>_std``;
    sample std, NaN for one run), runs, note (the task's ``reference_note``) and ``differing``: the
    settings behind the reference (``reference_recipe``) that differ among them, if any."""
    frames = [
        _reference(runs, name, cls.reference_metric, cls.reference_recipe, cls.reference_note)
        for name, cls in sorted(task_schemas().items())
        if cls.reference_metric
    ]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def _reference(runs: pd.DataFrame, task: str, metric: str, recipe_keys: tuple[str, ...], note: str) -> pd.DataFrame:
    """:func:`reference_accuracies` for one task's runs."""
    columns = ["dataset", "model", "classifier", "metric", f"{metric}_mean", f"{metric}_std", "runs", "differing",
               "note"]  # fmt: skip
    done = runs[(runs["outcome"] == "finished") & ~runs["private"] & (run_tasks(runs) == task)]
    real = column(done, f"metrics.{metric}").astype(float)
    done = done[real.notna()]
    rows = []
    pairs = pd.Series(run_pairs(done), index=done.index, dtype=object)
    recipe = [c for c in done.columns if c.startswith(tuple(f"params.{k}" for k in recipe_keys))]
    recipe = [c for c in recipe if c != "params.dataset.name"]
    for (dataset, model), block in done.groupby(pairs, sort=True):
        values = real[block.index]
        differing = [
            f"{c.removeprefix('params.')} {', '.join(sorted({param_text(v) for v in block[c]}, key=sort_key))}"
            for c in recipe
            if block[c].astype(object).fillna(MISSING).nunique() > 1
        ]
        classifier = ", ".join(sorted({str(v) for v in param_or_tag(block, "model.name").dropna()}))
        rows.append((dataset, model, classifier, metric, values.mean(), values.std(ddof=1), len(block),
                     "; ".join(differing), note))  # fmt: skip
    return pd.DataFrame(rows, columns=columns)


def task_notes(table: pd.DataFrame, runs: pd.DataFrame) -> list[str]:
    """Notes a task's schema asks for: the reference score of each block with one
    (:func:`reference_accuracies`), and a per-run share averaged per row against its baseline."""
    notes = []
    for _, ref in reference_accuracies(runs).iterrows():
        pooled = f"; pooled over differing {ref['differing']}" if ref["differing"] else ""
        n, metric = int(ref["runs"]), ref["metric"]
        score = percent_text(ref[f"{metric}_mean"], ref[f"{metric}_std"])
        what = ref["note"].format(classifier=ref["classifier"], score=score)
        notes.append(f"{ref['dataset']}/{ref['model']}: {what} ({n} non-private run{'' if n == 1 else 's'}{pooled})")
    for cls in task_schemas().values():
        share, baseline = cls.row_share
        if share:
            notes += _share_notes(table, share, baseline, cls.row_share_note)
    return notes


def _share_notes(table: pd.DataFrame, share: str, baseline: str, note: str) -> list[str]:
    """Per dataset and model: a share's mean per row against its baseline (``row_share_note``)."""
    logged = table[table[share].notna()] if share in table else table.iloc[:0]
    names = privacy_names(table) if not logged.empty else pd.Series(dtype=str)
    notes = []
    for (dataset, model), block in logged.groupby(["dataset", "model"], sort=True):
        rows = ", ".join(f"{names.get(r['config_id'])} {r[share] * PERCENT:.1f}%" for _, r in block.iterrows())
        base = f"{block[baseline].mean() * PERCENT:.1f}%"
        notes.append(f"{dataset}/{model}: " + note.format(baseline=base, rows=rows))
    return notes


def privacy_kind_notes(table: pd.DataFrame, runs: pd.DataFrame) -> list[str]:
    """When the table shows mechanism and unit (shows_privacy_kinds): what each mechanism of its
    private rows is, with the neighbouring relation its ε is for (tag dp.neighbours), and whom each
    unit's ε protects, with N (dataset.num_users for unit=user). None otherwise."""
    if not shows_privacy_kinds(table):
        return []
    private = table[table["private"].astype(bool)]
    done = runs[(runs["outcome"] == "finished") & runs["private"] & runs["config_id"].isin(private["config_id"])]
    return [_mechanism_line(private, done), _unit_line(private)]


def _mechanism_line(private: pd.DataFrame, done: pd.DataFrame) -> str:
    """``Mechanism: ...``: each mechanism of the ``private`` rows, with the neighbouring relation
    their FINISHED runs ``done`` logged (tag dp.neighbours; the mechanism's default without it)."""
    run_mechanisms = privacy_kinds(done)["mechanism"]
    neighbours = column(done, "tags.dp.neighbours")
    parts = []
    for mechanism in sorted(set(private["mechanism"].dropna()), key=mechanism_order):
        mine = neighbours[run_mechanisms == mechanism].dropna()
        relations = sorted({str(n) for n in mine}) or [mechanism_neighbours(mechanism)]
        relation = " / ".join(NEIGHBOUR_NOTES.get(r, r) for r in relations)
        name, note = mechanism_label(mechanism), mechanism_note(mechanism)
        what = f"{name}, {note}" if note is not None else name
        parts.append(f"{mechanism} = {what} (ε for neighbouring datasets differing in {relation})")
    return "Mechanism: " + "; ".join(parts) + "."


def _unit_line(private: pd.DataFrame) -> str:
    """``Unit: ...``: whom the ε of each unit of the ``private`` rows protects, with N."""
    units = []
    unit_of_row = row_units(private)
    order = list(UNITS)
    for unit in sorted(set(unit_of_row), key=lambda u: (order.index(u) if u in order else len(order), u)):
        facts = UNITS.get(unit)
        if facts is None:
            units.append(f"unit={unit}: ε per {unit}")
            continue
        n = ""
        if facts.population_key is not None:
            values = column(private, f"params.{facts.population_key}")[unit_of_row == unit].dropna()
            n = ", ".join(sorted({param_text(v) for v in values}, key=sort_key)) or "?"
        units.append(f"unit={unit}: " + facts.protects.format(n=n))
    line = "Unit: whom each row's ε protects. " + "; ".join(units) + "."
    if len(units) > 1:
        line += (
            " ε per example and ε per user are different guarantees: compare rows of one unit (one Pareto front each)."
        )
    return line
