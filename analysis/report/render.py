"""A report as text: markdown, CSV, LaTeX and HTML tables with their notes, a whole HTML page, and files.

    dpsweep-report --experiment demo --format csv > table.csv         # notes go to stderr
    dpsweep-report --experiment demo --format html --out report/      # report/report.html, a page with the plots

The rendered header names the accuracy columns by their objective ("test accuracy", "TSTR accuracy",
or "accuracy" and a note when tasks are mixed); a table with rows of another task shows a ``task``
column, a table with rows of a task with methods (``task.method``) a ``method`` column, and once a
private row is not DP-SGD over examples, a ``mechanism`` and a ``unit`` column. Otherwise the output is
as before these keys. σ shows at most 4 significant digits, rounded up (a calibrated σ has a float's 17:
:func:`dpsweep.analysis.report.cells.sigma_text`); CSV keeps every number whole, and has a column
``unstable`` once a row's spread over seeds is flagged (:func:`dpsweep.analysis.report.table.unstable_rows`).

A private tuning's released trial shows the whole procedure's ε with its accountant (rdp), which the
LaTeX caption states. A report of all trials (``Report.all_trials``: ``dpsweep-report --all-trials``) has
two more columns in every format: ``trial`` (released or withheld) and ``release`` (not for release, on
every row), and its LaTeX caption starts "Not for release".
"""

from __future__ import annotations

import base64
import math
from collections.abc import Callable, Sequence
from html import escape as html_escape
from pathlib import Path

import pandas as pd

from dpsweep.analysis.report.build import Report
from dpsweep.analysis.report.cells import PERCENT, epsilon_text, number_text, param_text, sigma_text
from dpsweep.analysis.report.columns import (
    DEFAULT_TASK,
    NOT_FOR_RELEASE,
    PRIVACY_KIND_DEFAULTS,
    PRIVACY_KINDS,
    SETTING_COLUMNS,
    column,
    lookup,
    row_shares,
    row_tasks,
)
from dpsweep.analysis.report.risk import RISK_HEADERS, RISK_METRICS, analysis_text, risk_columns, tuning_analyses
from dpsweep.analysis.report.table import (
    audit_columns,
    extra_columns,
    row_applies,
    score_name,
    shows_privacy_kinds,
)
from dpsweep.registry import Registry

Cell = Callable[[pd.Series], str]


def _accuracy(row: pd.Series) -> str:
    mean, std = row["test_accuracy_mean"], row["test_accuracy_std"]
    if pd.isna(mean):
        return "—"
    return f"{mean * PERCENT:.2f}" + ("" if pd.isna(std) else f" ± {std * PERCENT:.2f}")


def display_columns(table: pd.DataFrame, all_trials: bool = False, risk: bool = False) -> list[tuple[str, str, Cell]]:
    """(header, LaTeX header, cell formatter) per column of the paper table; with ``all_trials`` (every
    trial of a private tuning), ``trial`` and ``release`` (:data:`ALL_TRIALS_COLUMNS`) last; with ``risk``,
    the ε interval, μ and TPR at 1 % FPR after ε (:func:`dpsweep.analysis.report.risk.risk_columns`)."""

    def param(key: str) -> Cell:
        return lambda row: param_text(row[f"params.{key}"]) if row_applies(row, key) else "—"

    cols: list[tuple[str, str, Cell]] = [
        ("dataset", "dataset", lambda r: param_text(r["dataset"])),
        ("model", "model", lambda r: param_text(r["model"])),
    ]
    if shows_tasks(table):
        cols.append(("task", "task", lambda r: param_text(r["task"])))
    if shows_methods(table):  # e.g. als or dpam: rows of one model that differ in how it trains
        cols.append(("method", "method", lambda r: param_text(r["method"])))
    score = f"{score_name(table)} (%)"
    cols += [
        ("B", "$B$", lambda r: number_text(r["batch_size"], "d")),
        ("σ", r"$\sigma$", lambda r: sigma_text(r["noise_multiplier"])),  # a calibrated σ: 4 digits, rounded up
        ("C", "$C$", _clip_norm),
        ("clipping", "clipping", _clipping),
        ("lr", "lr", lambda r: number_text(r["lr"], "g")),
        ("epochs", "epochs", lambda r: number_text(r["epochs"], "d")),
    ]
    cols += [(key, _latex_cell(key), param(key)) for key in extra_columns(table)]
    cols += [
        ("δ", r"$\delta$", lambda r: number_text(r["delta"], "g")),
        ("accountant", "accountant", lambda r: str(r["accountant"]) if r["private"] else "non-private"),
    ]
    if shows_privacy_kinds(table):  # whom each ε protects, and how its noise was added
        cols += [(name, name, _privacy_kind(name)) for name in PRIVACY_KINDS]
    cols.append(("ε", r"$\varepsilon$", lambda r: epsilon_text(r["epsilon"])))
    cols += risk_columns() if risk else []
    shown = audit_columns(table)  # the empirical checks beside the accountant's bound
    if "audit_epsilon_lower" in shown:
        cols.append(("audit ε ≥", r"audit $\varepsilon \geq$", lambda r: number_text(r["audit_epsilon_lower"], ".3f")))
    if "audit_epsilon_lower_fdp" in shown:
        cols.append((
            "audit ε ≥ (f-DP)", r"audit $\varepsilon \geq$ ($f$-DP)",
            lambda r: number_text(r["audit_epsilon_lower_fdp"], ".3f"),
        ))  # fmt: skip
    cols += [
        (score, _latex_cell(score), _accuracy),
        ("drop (pp)", "drop (pp)", lambda r: number_text(r["accuracy_drop"] * PERCENT, ".2f")),
        ("runs", "runs", lambda r: str(int(r["runs"]))),
    ]
    if all_trials:
        cols += [("trial", "trial", _trial), ("release", "release", lambda r: NOT_FOR_RELEASE)]
    return cols


ALL_TRIALS_COLUMNS = ("trial", "release")  # a report of all trials: the table's own not-for-release mark


def _trial(row: pd.Series) -> str:
    """A private tuning's row: ``released`` (its released trial) or ``withheld``; a dash for any other row."""
    value = row.get("tuning")
    return "—" if value is None or pd.isna(value) else str(value)


def _privacy_kind(name: str) -> Cell:
    """A private row's mechanism or unit (the default where unknown); a dash for a non-private row."""

    def cell(row: pd.Series) -> str:
        if not row["private"]:
            return "—"
        value = row.get(name)
        return PRIVACY_KIND_DEFAULTS[name] if value is None or pd.isna(value) else str(value)

    return cell


def shows_methods(table: pd.DataFrame) -> bool:
    """A table with a row of a task with methods (``task.method``) shows the method column (and CSV has it)."""
    return "method" in table and bool(table["method"].notna().any())


def shows_tasks(table: pd.DataFrame) -> bool:
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
    return kind if kind == "fixed" or gamma is None or pd.isna(gamma) else f"{kind} γ={param_text(gamma)}"


def _clip_norm(row: pd.Series) -> str:
    """C as configured; a quantile run's C is its own private release (param dp.max_grad_norm_chosen), and an
    adaptive run's moves from this start."""
    return "—" if row["private"] and _clipping_of(row) == "quantile" else number_text(row["max_grad_norm"], "g")


def paper_table(table: pd.DataFrame, latex: bool = False, all_trials: bool = False, risk: bool = False) -> pd.DataFrame:
    """The table as text cells, with the headers a paper shows (unicode, or LaTeX when ``latex``);
    ``all_trials``: a report of every trial of a private tuning, ``risk``: with the risk columns
    (:func:`display_columns`)."""
    cols = display_columns(table, all_trials, risk)
    rows = [row for _, row in table.iterrows()]
    cells = {(tex if latex else plain): [fmt(row) for row in rows] for plain, tex, fmt in cols}
    return pd.DataFrame(cells, columns=[tex if latex else plain for plain, tex, _ in cols])


TEXT_COLUMNS = ("dataset", "model", "task", "method", "accountant", *PRIVACY_KINDS, *ALL_TRIALS_COLUMNS)


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
    shown = paper_table(report.table, all_trials=report.all_trials, risk=report.risk).map(
        lambda c: c.replace("|", r"\|")
    )
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
    """The numbers at full precision (accuracies as fractions), one row per config, no notes; a report of
    all trials adds ``trial`` (a private tuning's released or withheld trial) and ``release`` (not for
    release, on every row); a report with ``risk`` adds ``epsilon_lower``, ``mu_gdp`` and ``tpr_at_1pct``."""
    table = report.table
    extras = [f"params.{k}" for k in extra_columns(table)]
    kinds = [
        "dataset",
        "model",
        *(["task"] if shows_tasks(table) else []),
        *(["method"] if shows_methods(table) else []),
    ]
    privacy = list(PRIVACY_KINDS) if shows_privacy_kinds(table) else []
    audits = audit_columns(table)
    risks = list(RISK_METRICS) if report.risk else []  # dpsweep-report --risk
    names = ["config_id", *kinds, *SETTING_COLUMNS, *privacy, "private", *extras, "epsilon", *risks, *audits]
    names += ["test_accuracy_mean"]
    names += ["test_accuracy_std", "accuracy_drop", "runs", "runs_without_accuracy", "run_ids"]
    names += ["unstable"] if "unstable" in table and table["unstable"].any() else []  # the spread over seeds
    names += [m for m in row_shares() if m in table and table[m].notna().any()]
    out = table[names].rename(columns={e: e.removeprefix("params.") for e in extras})
    out = out.assign(run_ids=out["run_ids"].map(" ".join))
    if report.all_trials:
        out = out.assign(trial=table["tuning"], release=NOT_FOR_RELEASE)
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


# Columns a paper's table keeps even where every row has the same value: the results.
RESULT_COLUMNS = ("ε", "drop (pp)", *RISK_HEADERS)


def to_latex(report: Report) -> str:
    """A booktabs ``table`` (needs ``\\usepackage{booktabs}``), the notes as ``%`` comments. Settings that
    every row shares move to the caption (``\\caption{dataset: digits; $B$: 64; ...}``), δ reads as a
    power of ten (``$10^{-5}$``) and each ε column has one number of decimals (issue 33, item 8). The
    caption says what a private tuning's ε is (:func:`tuning_caption`), and a report of all trials is
    captioned not for release."""
    all_trials = report.all_trials
    plain = paper_table(report.table, all_trials=all_trials, risk=report.risk)
    shown = paper_table(report.table, latex=True, all_trials=all_trials, risk=report.risk)
    shown = _latex_numbers(report.table, plain, shown)
    constant = [
        c for c, p in zip(shown.columns, plain.columns, strict=True)
        if len(plain) > 1 and plain[p].nunique() == 1 and p not in RESULT_COLUMNS and not p.endswith("(%)")
    ]  # fmt: skip
    kept = [c for c in shown.columns if c not in constant]
    aligned = dict(zip(shown.columns, _right_aligned(plain), strict=True))
    spec = "".join("r" if aligned[c] else "l" for c in kept)
    lines = [f"% {note}" for note in report.notes()]
    lines += [r"\begin{table}", r"\centering", f"\\begin{{tabular}}{{{spec}}}", r"\toprule"]
    lines += [" & ".join(kept) + r" \\", r"\midrule"]
    lines += [" & ".join(row) + r" \\" for row in shown[kept].itertuples(index=False, name=None)]
    lines += [r"\bottomrule", r"\end{tabular}"]
    caption = [_latex_cell(c).replace("ε", r"$\varepsilon$") for c in tuning_caption(report)]
    caption += ["; ".join(f"{c}: {shown[c].iloc[0]}" for c in constant)] if constant else []
    if caption:
        lines.append("\\caption{" + " ".join(caption) + "}")
    lines.append(r"\end{table}")
    return "\n".join(lines) + "\n"


def tuning_caption(report: Report) -> list[str]:
    """The caption's sentences on private tuning: a report of all trials is not for release; a
    released trial's ε is the whole procedure's, under the accountant that computed it (rdp), by the
    analysis its tag ``tuning.analysis`` names (:func:`dpsweep.analysis.report.risk.tuning_analyses`), and
    neither the number of trials nor the others are shown (Papernot & Steinke 2022 need K secret)."""
    table = report.table
    rows = table[column(table, "tuning").notna()]
    accountants = ", ".join(sorted({str(a) for a in rows["accountant"].dropna()}))
    analysis = analysis_text(tuning_analyses(rows)) if len(rows) else ""  # tag tuning.analysis
    if report.all_trials:
        return [
            f"{NOT_FOR_RELEASE.capitalize()}: every trial of a private tuning; publish the released trial alone "
            f"(ε of every trial: the whole procedure's, {accountants} accountant, by {analysis})." if len(rows) else
            f"{NOT_FOR_RELEASE.capitalize()}: a report of all trials."
        ]  # fmt: skip
    if rows.empty:
        return []
    return [
        f"ε of the released trial of a private tuning: the whole tuning procedure's, under the {accountants} "
        f"accountant, by {analysis}; the other trials and their number are not released."
    ]


def _latex_numbers(table: pd.DataFrame, plain: pd.DataFrame, shown: pd.DataFrame) -> pd.DataFrame:
    """The cells as LaTeX: escaped text, δ as ``$10^{-5}$``, ε with the decimals its smallest value needs
    for three significant digits (the same in every row)."""
    out = shown.map(_latex_cell)
    headers = dict(zip(plain.columns, shown.columns, strict=True))
    if "δ" in headers:
        deltas = zip(table["delta"], table["private"], strict=True)
        out[headers["δ"]] = [_power_of_ten(v) if private else "--" for v, private in deltas]
    if "ε" in headers:
        eps = table["epsilon"].where(table["private"])
        finite = eps[eps.notna() & (eps > 0) & (eps < 1000)]
        decimals = min(3, max(0, 2 - math.floor(math.log10(finite.min())))) if len(finite) else 0
        out[headers["ε"]] = [f"{v:.{decimals}f}" if pd.notna(v) else "--" for v in eps]
    return out


def _power_of_ten(value: float) -> str:
    """``1e-05`` as ``$10^{-5}$``, ``2e-06`` as ``$2 \\times 10^{-6}$``."""
    if value is None or pd.isna(value):
        return "--"
    exponent = math.floor(math.log10(value))
    mantissa = value / 10**exponent
    if math.isclose(mantissa, 1.0):
        return f"$10^{{{exponent}}}$"
    return f"${mantissa:g} \\times 10^{{{exponent}}}$"


def to_html(report: Report) -> str:
    """An HTML ``<table>`` and the notes as paragraphs (no page around them)."""
    table = paper_table(report.table, all_trials=report.all_trials, risk=report.risk).to_html(
        index=False, border=0, escape=True
    )
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


FIGURE_FORMATS = ("png", "pdf", "svg")  # dpsweep-report --figure-format (analysis.report.plots writes them)
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
