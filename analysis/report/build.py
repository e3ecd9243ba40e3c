"""A report: a selection of runs read from MLflow, checked and tabulated (the library behind ``dpsweep-report``).

    dpsweep-report --experiment demo                                  # the table, markdown, on stdout
    dpsweep-report --experiment demo --sweep s3d13dc24edc --format tex --out report/

From Python, e.g. in a notebook::

    from dpsweep.analysis import report
    r = report.build_report("sqlite:///mlflow.db", "demo", sweep_id=None, sort="accuracy")
    r.table                            # one row per config, seeds pooled: ε, accuracy mean ± std, drop
    r.runs                             # one row per run (mlflow.search_runs layout), with its outcome
    r.counts                           # {"total": .., "finished": .., "failed": .., "pruned": .., "running": ..}
    r.warnings                         # mixed accountants or δ, missing metrics, missing baselines
    r.table[["epsilon_lower", "epsilon", "mu_gdp", "tpr_at_1pct"]]  # how certain ε is, the attack risk
    report.memory_table(r.table_runs)  # bytes per memory stage, per config
    report.pareto_front(r.table)       # the private rows no other row beats on both ε and accuracy
    print(report.render(r, "md"))      # or "csv", "tex", "html"

Of a private tuning (``sweep.private_tuning``) a report shows the released trial alone, at the whole
procedure's ε under the accountant that computed it (rdp): nothing in it tells the number of trials K,
the other trials or the released trial's seed, which must stay secret for Papernot & Steinke 2022's
bound. ``build_report(..., all_trials=True)`` (``dpsweep-report --all-trials``) is the analyst's view of
every trial, marked not for release in the table itself (columns ``trial`` and ``release``).

What a row is, and what its columns mean: :mod:`dpsweep.analysis.report.table`. A sweep without a
non-private run of a dataset and model borrows the experiment's (:func:`build_report`), and a note
says so. The notes under the table (:meth:`Report.notes`) add what each task's schema asks for (a
reference score per block, a share averaged per row), and once a private row is not
DP-SGD over examples, what each mechanism is and whom each unit's ε protects
(:mod:`dpsweep.analysis.report.notes`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd

from dpsweep.analysis.report.cells import runs_text
from dpsweep.analysis.report.columns import (
    NOT_FOR_RELEASE,
    OUTCOME_ORDER,
    WITHHELD,
    ReportError,
    lookup,
    objective_notes,
    run_pairs,
)
from dpsweep.analysis.report.notes import check, privacy_kind_notes, score_note, task_notes
from dpsweep.analysis.report.query import outcome_counts, parent_run_id, report_runs, search_runs
from dpsweep.analysis.report.risk import RISK_NOTE
from dpsweep.analysis.report.table import SORT_KEYS, score_metrics, shows_audits, summary_table


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
    # every trial of a private tuning (dpsweep-report --all-trials): the analyst's view, not for release
    all_trials: bool = False
    # the risk columns (dpsweep-report --risk): ε interval, μ-GDP, TPR at 1 % FPR (analysis.report.risk)
    risk: bool = False

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
            + (f", {c['duplicate']} duplicate" if c["duplicate"] else "")
            + (f", {c['diverged']} diverged (left out)." if c["diverged"] else "."),
            f"ε: final ε under each row's accountant at its δ. {score_note(self.table)}: mean ± sample std over "
            "seeds, in %. Drop: non-private baseline minus row, in percentage points.",
        ]
        lines += privacy_kind_notes(self.table, self.table_runs)
        if shows_audits(self.table):
            lines.append(AUDIT_NOTE)
        explained = objective_notes()
        lines += [explained[m] + "." for m in score_metrics(self.table) if m in explained]
        lines += task_notes(self.table, self.table_runs)
        if self.risk:
            lines.append(RISK_NOTE)
        if self.all_trials:
            lines.insert(0, ALL_TRIALS_NOTE)
        return lines + [f"warning: {w}" for w in self.warnings]


ALL_TRIALS_NOTE = (
    f"{NOT_FOR_RELEASE.capitalize()}: every trial of each private tuning (dpsweep-report --all-trials), whose "
    "number K and other trials must stay secret for the released trial's ε to hold (Papernot & Steinke 2022); "
    "publish the report without --all-trials, which shows the released trial alone."
)


AUDIT_NOTE = (
    "audit ε ≥: the smallest one-run audit lower bound among the row's runs (audit.mode=white_box or black_box; "
    "Steinke, Nasr & Jagielski 2023); audit ε ≥ (f-DP): the same guesses read against each run's own ledger "
    "(Mahloujifar, Melis & Chaudhuri 2025): the ε of the least private claim along the run's noise they reject. "
    "Both together at each run's audit.confidence; an accountant's ε below either means the run did not do what "
    "its ledger says. Audit runs trained on canaries: not for release."
)


def build_report(
    uri: str,
    experiment: str,
    sweep_id: str | None = None,
    sort: str = "accuracy",
    all_trials: bool = False,
    risk: bool = False,
) -> Report:
    """Read, check and tabulate a selection: of a private tuning, its released trial alone, unless
    ``all_trials`` (then every trial, and the report is marked not for release); ``risk``: its renderings
    show the risk columns (:mod:`dpsweep.analysis.report.risk`). Raises ReportError on
    an unknown experiment or sweep, an unknown sort key, or a selection without FINISHED runs."""
    lookup(SORT_KEYS, sort, "sort")  # fail before reading anything
    raw = search_runs(uri, experiment, sweep_id)
    runs = report_runs(raw)
    withheld = runs["tuning"] == WITHHELD
    if not all_trials:  # counted nowhere: their number would tell K
        runs = runs[~withheld].reset_index(drop=True)
    counts = outcome_counts(runs)
    where = ("sweep", sweep_id) if sweep_id else ("experiment", experiment)
    if counts["finished"] == 0 and withheld.any() and not all_trials:
        raise ReportError(
            *where, "a selection with a FINISHED run to release: it holds trials of a private tuning but no "
            "released one (tag tuning.released=true), and the others are withheld (their number would tell K); "
            "dpsweep-report --all-trials shows them, not for release",
        )  # fmt: skip
    if counts["finished"] == 0:
        others = ", ".join(f"{counts[k]} {k}" for k in OUTCOME_ORDER[1:] if counts[k])
        raise ReportError(
            *where, f"0 FINISHED runs of {counts['total']}{f' ({others})' if others else ''}; nothing to report"
        )
    report = Report(
        uri, experiment, sweep_id, runs, pd.DataFrame(), counts, parent_run_id(raw), all_trials=all_trials, risk=risk
    )
    borrowed: list[str] = []  # notes on baseline runs taken from outside the sweep
    if sweep_id is not None:
        report.baseline_runs, borrowed = _outside_baselines(uri, experiment, runs)
    report.table = summary_table(report.table_runs, sort)
    report.warnings = borrowed + check(report.table_runs, report.table, all_trials)
    return report


def _outside_baselines(uri: str, experiment: str, runs: pd.DataFrame) -> tuple[pd.DataFrame, list[str]]:
    """For a sweep without non-private runs of a dataset and model: the experiment's FINISHED
    non-private runs of it (sweeps usually reuse one baseline), and a note saying so."""
    done = runs[runs["outcome"] == "finished"]
    missing = set(run_pairs(done)) - set(run_pairs(done[~done["private"]]))
    if not missing:
        return pd.DataFrame(), []
    raw = search_runs(uri, experiment, filter_string="attributes.status = 'FINISHED' and params.`dp.enabled` = 'False'")
    if raw.empty:
        return pd.DataFrame(), []
    outside = report_runs(raw)
    wanted = pd.Series(run_pairs(outside), index=outside.index, dtype=object).isin(missing)
    outside = outside[wanted & ~outside["run_id"].isin(runs["run_id"])]
    notes = []
    for (dataset, model), block in outside.groupby(pd.Series(run_pairs(outside), index=outside.index), sort=True):
        notes.append(
            f"{dataset}/{model}: the sweep has no non-private run; the baseline rows pool the experiment's "
            f"{runs_text(len(block))} of it, FINISHED and non-private ({', '.join(r[:8] for r in block['run_id'])})"
        )
    return outside, notes
