"""``dpsweep-report``: the privacy–accuracy table and plots of an experiment or a sweep, from MLflow.

    dpsweep-report --experiment demo                                   # markdown table on stdout
    dpsweep-report --experiment demo --sweep s3d13dc24edc --format tex --out report/
    dpsweep-report --experiment demo --format csv > table.csv          # notes go to stderr
    dpsweep-report --experiment demo --out report/ --sort epsilon --runs 41b733ba 9f0c2d11
    dpsweep-report --experiment demo --sweep s3d13dc24edc --all-trials  # a private tuning's trials: not for release
    dpsweep-report --experiment demo --risk                            # + ε interval, μ-GDP, TPR at 1% FPR

One row per config (runs equal but for the seed): dataset, model, B, σ, C, lr, epochs, δ,
accountant, ε, test accuracy mean ± std over seeds, its drop against the non-private baseline of
the same dataset and model, and the number of runs. A run's accuracy is its task's objective: a
GAN run's (``task=gan``) is its TSTR accuracy, its rows show model ``gan`` (and a task column), and
the notes give the same classifier's accuracy on real data and the memorisation share. Rows of a task
with methods (``task.method``: the recommender's als, popularity, dpam, sgd) have a ``method`` column. A
calibrated σ shows 4 significant digits, rounded up (CSV: whole). A row whose accuracy varies across
seeds by more than 5% of its mean (sample std over mean), private or not, is flagged in the notes with
its figures and runs, and in the CSV's ``unstable`` column. Where a
private row is not example-level DP-SGD, the ``mechanism`` (a name of dpsweep.mechanisms) and
``unit`` (example, user: whom its ε protects) columns appear, with notes; the Pareto plot colours by mechanism. Only
FINISHED runs count; the notes say how many failed, were pruned or are still running, and warn
about mixed accountants or δ and missing metrics. With ``--out DIR`` the table is also written to
``DIR/report.<format>`` with the plots (pareto.png, accuracy_vs_<param>.png, curves.png,
memory.png, and <task>_samples.png for a task whose runs log sample grids, e.g. gan_samples.png; see
dpsweep.analysis.report.plots).
When the sweep has a parent run (tag ``sweep.role=parent``) they are logged on it under
``report/``, so they appear in the MLflow UI.

Of a private tuning (``sweep.private_tuning``) the table, the notes and the plots show the released
trial alone, at the whole procedure's ε under the accountant that computed it (rdp): nothing in them
tells how many trials ran, the other trials or the released trial's seed (Papernot & Steinke 2022's
bound needs the number secret). ``--all-trials`` shows every trial, in a table marked not for release
(columns ``trial`` and ``release``, in every format; the LaTeX caption and every plot say so too). The
released trial's ε is named with the analysis that gave it (tag ``tuning.analysis``; older runs:
papernot_steinke, the only one then).

``--risk`` adds how certain each row's ε is and what it means for an attacker: the ε interval (a sound
lower bound .. the row's ε), μ (the row is μ-GDP) and TPR@1% (a membership-inference attack's largest
true-positive rate at 1 % false-positive rate), from the metrics epsilon_lower, mu_gdp and tpr_at_1pct a
DP run logs; runs from before them show a dash (see dpsweep.analysis.report.risk).

Bad input exits with code 2 and names the option, its value and what is allowed, e.g.
``dpsweep-report: error: --format='docx' is invalid: unknown format; valid: csv, html, md, tex``.
The same tables are importable as DataFrames: see ``dpsweep.analysis.report``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from dpsweep.cli.errors import exits_on_bad_input
from dpsweep.cli.options import add_tracking_uri
from dpsweep.cli.script import run_script
from dpsweep.errors import InputError

if TYPE_CHECKING:  # pandas and MLflow are imported once the arguments parse: --help stays fast
    from dpsweep.analysis import report
    from dpsweep.analysis.report.publish import ParentLog

# The names of analysis.report's FORMATS, SORT_KEYS and FIGURE_FORMATS, for --help (a test keeps them equal)
FORMAT_NAMES, SORT_NAMES, FIGURE_FORMAT_NAMES = (
    ("csv", "html", "md", "tex"),
    ("accuracy", "epsilon"),
    ("png", "pdf", "svg"),
)

DEFAULT_CURVES = 3  # runs on curves.png unless --runs names them


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dpsweep-report",
        description="Privacy–accuracy table and plots of an MLflow experiment or dpsweep sweep.",
    )
    p.add_argument("--experiment", required=True, metavar="NAME", help="MLflow experiment (tracking.experiment_name)")
    p.add_argument("--sweep", metavar="ID", help="only the runs of this sweep (tag sweep.id)")
    p.add_argument("--format", default="md", metavar="|".join(FORMAT_NAMES),
                   help="table format (default md)")  # fmt: skip
    p.add_argument("--out", type=Path, metavar="DIR", help="write report.<format> and the plots here")
    p.add_argument("--sort", default="accuracy", metavar="|".join(SORT_NAMES),
                   help="row order per dataset and model: accuracy (best first) or epsilon (least first)")  # fmt: skip
    p.add_argument("--runs", nargs="+", metavar="ID",
                   help=f"runs (ids or unique prefixes) for curves.png; default: the {DEFAULT_CURVES} most "
                   "accurate private runs")  # fmt: skip
    add_tracking_uri(p)
    p.add_argument("--no-log", action="store_true", help="do not log the files on the sweep's parent run")
    p.add_argument("--figure-format", default="png", metavar="|".join(FIGURE_FORMAT_NAMES),
                   help="plot file format (default png)")  # fmt: skip
    p.add_argument("--dpi", type=int, default=150, metavar="N", help="plot resolution (default 150)")
    p.add_argument("--all-trials", action="store_true",
                   help="every trial of a private tuning, not only the released one: the analyst's view, marked "
                   "not for release (it tells the number of trials, which must stay secret)")  # fmt: skip
    p.add_argument("--risk", action="store_true",
                   help="add the columns ε interval (a sound lower bound .. ε), μ (μ-GDP) and TPR@1%% (a "
                   "membership-inference attack's largest true-positive rate at 1%% false-positive rate), from "
                   "the runs' metrics epsilon_lower, mu_gdp and tpr_at_1pct; a dash for runs without them")  # fmt: skip
    return p


def _check_out(out: Path) -> None:
    """--out must be (or become) a directory we can write files in: try it."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as err:
        raise InputError("--out", str(out), f"a directory you can write to ({err.strerror or err})") from err


def _check_uri(uri: str) -> None:
    """A sqlite store must exist already (MLflow would create an empty one); a server must answer."""
    if uri.startswith("sqlite:///"):
        db = Path(uri[len("sqlite:///") :])
        if not db.is_file():
            raise InputError(
                "--tracking-uri", uri, f"an existing MLflow database (none at {db.absolute()}); run dpsweep-report "
                "where dpsweep ran, or pass the URI dpsweep logged to (tracking.uri)",
            )  # fmt: skip
    elif uri.startswith(("http://", "https://")):
        from dpsweep.tracking import check_reachable  # imports torch: only when needed

        try:
            check_reachable(uri)
        except ConnectionError as err:
            raise InputError("--tracking-uri", uri, f"a reachable MLflow server ({err})") from err


def _chosen_runs(built: report.Report, wanted: Sequence[str] | None) -> list[str]:
    from dpsweep.analysis import report

    if not wanted:
        return report.best_runs(built.runs, DEFAULT_CURVES) or report.best_runs(
            built.runs, DEFAULT_CURVES, private=None
        )
    known = list(built.table_runs["run_id"])
    chosen = []
    for prefix in wanted:
        matches = [r for r in known if r.startswith(prefix)]
        if len(matches) != 1:
            why = "matches no run" if not matches else f"matches {len(matches)} runs"
            raise InputError("--runs", prefix, f"a run id (or a unique prefix) of the {built.selection}; it {why}")
        chosen.append(matches[0])
    return chosen


def _say_parent_log(done: ParentLog | None) -> None:
    """Where the files went on the sweep's parent run (:func:`dpsweep.analysis.report.publish.log_on_parent`)."""
    from dpsweep.analysis.report.publish import ARTIFACT_DIR

    if done is None:
        return
    if done.run_id is None:
        print(f"dpsweep-report: sweep {done.sweep_id} has no parent run; the files are only on disk", file=sys.stderr)
    elif done.error is not None:
        print(f"dpsweep-report: warning: could not log the files on run {done.run_id}: {done.error}", file=sys.stderr)
    else:
        print(f"dpsweep-report: logged {done.files} files on the parent run {done.run_id} under {ARTIFACT_DIR}/",
              file=sys.stderr)  # fmt: skip


def run(argv: Sequence[str] | None = None) -> report.Report:
    """Parse, check, report; returns the report built (the table is also printed)."""
    a = _parser().parse_args(argv)
    from mlflow.exceptions import MlflowException

    from dpsweep.analysis import report
    from dpsweep.tracking.dead_runs import reconcile

    report.lookup(report.FORMATS, a.format, "format")
    report.lookup(report.SORT_KEYS, a.sort, "sort")
    if a.figure_format not in report.FIGURE_FORMATS:
        raise InputError("--figure-format", a.figure_format, f"one of {', '.join(report.FIGURE_FORMATS)}")
    if a.dpi <= 0:
        raise InputError("--dpi", a.dpi, "a positive number of dots per inch")
    if a.out is not None:
        _check_out(a.out)
    _check_uri(a.tracking_uri)
    try:
        for dead in reconcile(a.tracking_uri, a.experiment):  # so that no dead run counts as running
            print(f"dpsweep-report: ended run {dead.run_id} KILLED: {dead.reason}", file=sys.stderr)
        built = report.build_report(a.tracking_uri, a.experiment, a.sweep, a.sort, all_trials=a.all_trials, risk=a.risk)
    except MlflowException as err:
        raise InputError("--tracking-uri", a.tracking_uri, f"a store MLflow can read ({err.message})") from err
    chosen = _chosen_runs(built, a.runs)
    text = report.render(built, a.format)
    sys.stdout.write(text)
    sys.stdout.flush()  # before the notes and file lines on stderr
    if a.format == "csv":  # the CSV itself stays pure
        for note in built.notes():
            print(f"dpsweep-report: {note}", file=sys.stderr)
    if a.out is None:
        return built
    from dpsweep.analysis.report import FigureStyle, plot_report, publish  # matplotlib only when plotting

    histories = report.metric_histories(built.uri, chosen, report.history_metrics(built.table_runs, chosen))
    figures = plot_report(built, a.out, histories, FigureStyle(a.figure_format, a.dpi))
    paths = [report.write(built, a.format, a.out, figures), *figures]
    for path in paths:
        print(f"dpsweep-report: wrote {path}", file=sys.stderr)
    if not a.no_log:
        _say_parent_log(publish.log_on_parent(built, paths))
    return built


@exits_on_bad_input("dpsweep-report")
def main(argv: Sequence[str] | None = None) -> int:
    run(sys.argv[1:] if argv is None else argv)
    return 0


def console() -> NoReturn:
    """The console script: its secrets handed over, ``main``, then its exit (``dpsweep.cli.script``)."""
    run_script(main, "dpsweep-report")


if __name__ == "__main__":
    console()
