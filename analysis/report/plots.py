"""Plots of a privacy–accuracy report (matplotlib): what ``dpsweep-report --out DIR`` draws.

    dpsweep-report --experiment demo --out report/             # the table and these plots in report/
    dpsweep-report --experiment demo --out report/ --runs ID1 ID2   # curves.png for chosen runs
    dpsweep-report --experiment demo --out paper/ --figure-format pdf --dpi 300   # for a paper

Every legend sits outside its axes, to the right, so that it never hides data. Formats: png
(default, 150 dpi), pdf and svg (vector; --dpi then sets only their raster parts). They draw the
report's runs: of a private tuning, the released trial alone, and never a trial's secret seed in a
label; a report of all trials (``--all-trials``) is stamped not for release on every figure.

Files, one panel per dataset and model:

- ``pareto.png``: test accuracy (%) against ε, each config with its seed-to-seed std; the Pareto
  front highlighted; the non-private baseline as a horizontal line. The accuracy is each row's
  score, its task's objective: each block's axes name its task's objective. Once a private row is not
  DP-SGD over examples (``report.shows_privacy_kinds``), the configs are coloured by mechanism
  (DP-SGD blue, DP-FTRL orange) and user-level rows (ε per user) drawn as squares, each with a
  legend entry, and the Pareto front is one per privacy unit (``report.pareto_front``).
- ``accuracy_vs_<param>.png``, one per swept hyperparameter (e.g. ``accuracy_vs_dp.noise_multiplier.png``):
  test accuracy against its values, one line per setting of the other swept hyperparameters. A σ
  calibrated to ``dp.target_epsilon`` was not chosen, and means something else for each mechanism
  (DP-FTRL's σ at an ε is not DP-SGD's): σ's plot has only the rows whose σ was set (none: no plot);
  the others are plotted against their target ε, and ``pareto.png`` against the ε they spent.
- ``curves.png``: test accuracy against epoch (top) and ε against epoch (below), for chosen runs
  (default: the 3 most accurate private runs), each labelled by what differs between them (σ=0.8,
  seed=1, …); runs whose ε curves are identical share one ε line, labelled with all of them.
- ``memory.png``: memory (MiB) after each stage of the first training iteration, its peak and
  the run's peak, per config (configs with equal figures drawn once, labelled with what they
  share), titled with the measuring backend.
- ``<task>_samples.png``, for each task of the report whose runs log sample grids: one tile per
  config, the final sample grid of its first run with one, a row per class, titled with its ε
  (:mod:`dpsweep.analysis.report.samples`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.text import Annotation
from matplotlib.ticker import MaxNLocator

from dpsweep.analysis.report.build import Report
from dpsweep.analysis.report.cells import PERCENT, key_text, param_text
from dpsweep.analysis.report.columns import (
    DEFAULT_OF_PARAM,
    HYPERPARAMETERS,
    PRIVACY_KIND_DEFAULTS,
    PRIVACY_KINDS,
    SHORT_NAMES,
    column,
    known_mechanisms,
    mechanism_label,
    mechanism_order,
    objective_name,
    row_units,
)
from dpsweep.analysis.report.figures import (
    DEFAULT_STYLE,
    FigureStyle,
    block_panels,
    figure_grid,
    legend_outside,
    log_scale_if_wide,
    save,
)
from dpsweep.analysis.report.memory import memory_groups, memory_table
from dpsweep.analysis.report.samples import plot_samples
from dpsweep.analysis.report.table import (
    config_labels,
    key_applies,
    pareto_front,
    private_only,
    score_name,
    shows_privacy_kinds,
    swept_params,
)
from dpsweep.config import task_objectives

MIB = 2.0**20
MAX_LEGEND_ENTRIES = 8
MAX_BASELINES = 3  # non-private rows drawn as lines; with more, only the most accurate
MAX_MEMORY_GROUPS = 15  # beyond this, memory.png keeps the groups with the largest run peak
# pareto.png with mechanisms and units (report.shows_privacy_kinds): a colour per mechanism, a marker per unit
# by columns.mechanism_order: the default mechanism keeps the colour of every config before mechanisms
MECHANISM_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:pink", "tab:olive")
SPARE_COLORS = ("tab:cyan", "tab:gray")  # mechanisms this process has not registered
UNIT_MARKERS = {"example": "o", "user": "s"}  # circles: ε per example; squares: ε per user
UNIT_LABELS = {"example": "ε per example", "user": "ε per user (N = users)"}
FRONT_STYLES = {"example": "-D", "user": "--s"}  # the Pareto front of each unit
STAGE_LABELS = {
    "model_load_bytes": "model load",
    "batch_load_bytes": "batch load",
    "backward_bytes": "backward",
    "optimizer_step_bytes": "optimizer step",
    "iteration_peak_bytes": "first-iteration peak",
    "run_peak_bytes": "run peak",
}
BACKEND_NOTES = {
    "cuda": "CUDA allocator",
    "cpu-tensors": "live CPU tensors: lower bounds, not GPU figures",
}


def _score_label(rows: pd.DataFrame) -> str:
    """The accuracy axis: ``test accuracy (%)``, ``TSTR accuracy (%)``, or ``accuracy (%)`` for mixed tasks."""
    return f"{score_name(rows)} (%)"


def _privacy_label(rows: pd.DataFrame) -> str:
    accountants = sorted({str(a) for a in rows["accountant"].dropna()})
    deltas = sorted({f"{d:g}" for d in rows["delta"].dropna()})
    if len(accountants) == 1 and len(deltas) == 1:
        return f"ε (final, {accountants[0]} accountant, δ={deltas[0]})"
    return f"ε (final; accountants {', '.join(accountants)}; δ {', '.join(deltas)}: not comparable)"


def _baselines(ax: Axes, baseline: pd.DataFrame, labels: pd.Series) -> list[float]:
    """The non-private rows as horizontal lines; beyond MAX_BASELINES, only the most accurate. Returns
    the accuracies (%) the lines are drawn at."""
    rows = baseline.dropna(subset=["test_accuracy_mean"]).sort_values("test_accuracy_mean", ascending=False)
    drawn = []
    for i, (_, row) in enumerate(rows.head(MAX_BASELINES if len(rows) <= MAX_BASELINES else 1).iterrows()):
        acc = row["test_accuracy_mean"] * PERCENT
        name = labels.get(row["config_id"], "non-private")
        name = name if len(rows) <= MAX_BASELINES else f"best of {len(rows)} non-private rows ({name})"
        ax.axhline(acc, color="black", linestyle="--", linewidth=1, alpha=0.8 - 0.2 * i, label=f"{name}: {acc:.1f}%")
        drawn.append(float(acc))
    return drawn


# Where a point's label goes (offset from the point, in points) when its first place crosses a baseline
# line: above the point, staggered, then below it. A label over the dashed line is hard to read in print.
LABEL_OFFSETS_PT = ((4, 6), (4, 15), (4, 24), (4, -14), (4, -23), (4, -32))


def _crosses(note: Annotation, renderer: Any, lines_px: list[float]) -> bool:
    box = note.get_window_extent(renderer)
    return any(box.y0 <= y <= box.y1 for y in lines_px)


def _clear_of_baselines(fig: Figure, levels: dict[Axes, list[float]]) -> None:
    """Move each point label that crosses a baseline line (``levels``: the lines' accuracies per axes)
    to the first offset of :data:`LABEL_OFFSETS_PT` where it crosses none, once the figure is laid out
    as :func:`save` lays it out."""
    fig.tight_layout()
    fig.draw_without_rendering()
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
    for ax, accuracies in levels.items():
        lines_px = [float(ax.transData.transform((0.0, y))[1]) for y in accuracies]
        for note in [t for t in ax.texts if isinstance(t, Annotation)]:
            if not _crosses(note, renderer, lines_px):
                continue
            first = note.xyann
            for offset in LABEL_OFFSETS_PT:
                note.xyann = offset
                if not _crosses(note, renderer, lines_px):
                    break
            else:
                note.xyann = first


def pareto_figure(table: pd.DataFrame) -> Figure:
    """Test accuracy against ε per config; the Pareto front highlighted; the baseline as a line.
    With mechanisms or units other than DP-SGD over examples: a colour per mechanism, a marker per
    unit (squares: user level), each with a legend entry, and a front per unit."""
    front = set(pareto_front(table)["config_id"])
    labels = config_labels(table)
    kinds = shows_privacy_kinds(table)
    colors = _mechanism_colors(table) if kinds else {}
    panels = block_panels(table)
    fig, axes = figure_grid(len(panels))
    levels: dict[Axes, list[float]] = {}  # the baseline lines' accuracies (%) per panel
    for ax, (title, rows) in zip(axes, panels, strict=True):
        dp = rows[rows["private"] & rows["epsilon"].notna() & rows["test_accuracy_mean"].notna()]
        if kinds:
            _points_by_kind(ax, dp, colors)
        else:
            ax.errorbar(
                dp["epsilon"], dp["test_accuracy_mean"] * PERCENT, yerr=dp["test_accuracy_std"].fillna(0) * PERCENT,
                fmt="o", color="tab:blue", alpha=0.6, capsize=3, label="configs (mean ± std over seeds)",
            )  # fmt: skip
        on_front = dp[dp["config_id"].isin(front)]
        units = row_units(on_front)
        fronts = sorted(set(units), key=_unit_order) or ["example"]  # none: an empty front, as before units
        shown = 0  # annotations staggered over all fronts, so that close points stay legible
        for unit in fronts:
            on = on_front[units == unit].sort_values("epsilon")
            name = "Pareto front" if len(fronts) == 1 else f"Pareto front (per {unit})"
            ax.plot(on["epsilon"], on["test_accuracy_mean"] * PERCENT, FRONT_STYLES.get(unit, "-D"), color="crimson",
                    markersize=7, drawstyle="steps-post", label=name)  # fmt: skip
            for _, row in on.iterrows():
                xy = (row["epsilon"], row["test_accuracy_mean"] * PERCENT)
                ax.annotate(labels.get(row["config_id"], ""), xy, textcoords="offset points",
                            xytext=(4, 6 + 9 * (shown % 3)), fontsize=7, color="crimson")  # fmt: skip
                shown += 1
        levels[ax] = _baselines(ax, rows[~rows["private"]], labels)
        log_scale_if_wide(ax, list(dp["epsilon"]))
        ax.set_xlabel(_privacy_label(dp if not dp.empty else rows) + (_unit_label(dp) if kinds else ""))
        ax.set_ylabel(_score_label(rows))
        ax.set_title(f"{title}: privacy–accuracy trade-off", fontsize=10)
        ax.grid(alpha=0.3)
        legend_outside(ax)
    _clear_of_baselines(fig, levels)
    return fig


def plot_pareto(table: pd.DataFrame, path: Path, style: FigureStyle = DEFAULT_STYLE) -> Path:
    """:func:`pareto_figure`, written to ``path``."""
    return save(pareto_figure(table), path, style)


def _unit_order(unit: str) -> tuple[bool, str]:
    return (unit != "example", unit)


def _mechanism_colors(table: pd.DataFrame) -> dict[str, str]:
    """A colour per mechanism of the table's private rows (MECHANISM_COLORS, then SPARE_COLORS)."""
    present = sorted({str(m) for m in table.loc[table["private"].astype(bool), "mechanism"].dropna()},
                     key=mechanism_order)  # fmt: skip
    spare = iter(SPARE_COLORS * (1 + len(present) // len(SPARE_COLORS)))
    colors = {}
    for m in present:
        rank = mechanism_order(m)[0]
        colors[m] = MECHANISM_COLORS[rank % len(MECHANISM_COLORS)] if rank < len(known_mechanisms()) else next(spare)
    return colors


def _points_by_kind(ax: Axes, dp: pd.DataFrame, colors: dict[str, str]) -> None:
    """The private configs, coloured by mechanism, marked by unit; legend entries for each mechanism
    present and, where a unit other than the example is present, for each unit."""
    mechanisms = dp["mechanism"].astype(object).fillna(PRIVACY_KIND_DEFAULTS["mechanism"]).map(str)
    units = row_units(dp).map(str)
    for (mechanism, unit), group in dp.groupby([mechanisms, units], sort=True):
        ax.errorbar(
            group["epsilon"], group["test_accuracy_mean"] * PERCENT,
            yerr=group["test_accuracy_std"].fillna(0) * PERCENT, fmt=UNIT_MARKERS.get(unit, "^"),
            color=colors.get(mechanism, "gray"), alpha=0.6, capsize=3, label="_nolegend_",
        )  # fmt: skip
    for mechanism in sorted(set(mechanisms), key=mechanism_order):  # legend: the colours, then the markers
        name = mechanism_label(mechanism)
        ax.plot([], [], "o", color=colors.get(mechanism, "gray"), alpha=0.6,
                label=f"{name} configs (mean ± std over seeds)")  # fmt: skip
    if set(units) - {"example"}:
        for unit in sorted(set(units), key=_unit_order):
            ax.plot([], [], UNIT_MARKERS.get(unit, "^"), color="dimgray", label=UNIT_LABELS.get(unit, f"ε per {unit}"))


def _unit_label(dp: pd.DataFrame) -> str:
    """What the ε axis measures per unit: ``, per user``, or which marker is which when mixed."""
    units = sorted({str(u) for u in row_units(dp)}, key=_unit_order)
    if not units:
        return ""
    if len(units) == 1:
        return f", per {units[0]}"
    shapes = {"o": "circles", "s": "squares", "^": "triangles"}
    return "\n" + "; ".join(f"per {u} ({shapes[UNIT_MARKERS.get(u, '^')]})" for u in units)


def _axis_values(values: pd.Series) -> tuple[pd.Series, list[str] | None]:
    """Numbers stay numbers; anything else becomes categories 0, 1, ... with their names."""
    numbers = pd.to_numeric(values, errors="coerce")
    if numbers.notna().all():
        return numbers.astype(float), None
    names = sorted({str(v) for v in values})
    return values.map(lambda v: float(names.index(str(v)))), names


def plot_accuracy_vs(table: pd.DataFrame, key: str, path: Path, style: FigureStyle = DEFAULT_STYLE) -> Path:
    """Test accuracy against the hyperparameter ``key`` (an MLflow param), one line per setting of
    the other swept hyperparameters; the baseline as a line when ``key`` is a DP setting."""
    swept = swept_params(table)
    others = [k for k in swept if k != key]
    labels = config_labels(table)
    panels = block_panels(table)
    fig, axes = figure_grid(len(panels))
    for ax, (title, rows) in zip(axes, panels, strict=True):
        usable = rows[rows[f"params.{key}"].notna() & rows["test_accuracy_mean"].notna()]
        usable = usable[key_applies(usable, key)]  # dp.*: the private rows (the baseline is a line)
        x, names = _axis_values(usable[f"params.{key}"].map(param_text))
        usable = usable.assign(_x=x)
        series = list(usable.groupby([usable["private"], *[usable[f"params.{k}"].fillna("—") for k in others]],
                                     sort=True))  # fmt: skip
        for group_key, line in series:
            line = line.sort_values("_x")
            private, *rest = group_key
            name = ", ".join(f"{SHORT_NAMES.get(k, k)}={key_text(k, v)}" for k, v in zip(others, rest, strict=True))
            name = (name or "private") if private else f"non-private {name}".strip()
            xs = line["_x"].to_numpy()
            mean = line["test_accuracy_mean"].to_numpy() * PERCENT
            std = line["test_accuracy_std"].fillna(0).to_numpy() * PERCENT
            marks = "-o" if private else "--s"  # non-private lines dashed, with square markers
            [drawn] = ax.plot(xs, mean, marks, markersize=4, label=name if len(series) <= MAX_LEGEND_ENTRIES else None)
            ax.vlines(xs, mean - std, mean + std, colors=drawn.get_color(), linewidth=1)  # ± std over seeds
        if private_only(key):
            _baselines(ax, rows[~rows["private"]], labels)
        if names is not None:
            ax.set_xticks(range(len(names)), names)
        else:
            log_scale_if_wide(ax, list(usable["_x"]))
        ax.set_xlabel(_param_label(key))
        ax.set_ylabel(_score_label(rows))
        more = "" if len(series) <= MAX_LEGEND_ENTRIES else f" ({len(series)} lines, one per setting of the others)"
        ax.set_title(f"{title}: accuracy against {SHORT_NAMES.get(key, key)}{more}", fontsize=9)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            legend_outside(ax)
    return save(fig, path, style)


PARAM_LABELS = {
    "train.batch_size": "batch size B (examples)",
    "dp.noise_multiplier": "noise multiplier σ",
    "dp.max_grad_norm": "clipping threshold C (L2 norm)",
    "optimizer.lr": "learning rate",
    "train.epochs": "epochs",
    "dp.delta": "δ",
    "dp.accountant": "accountant",
}


def _param_label(key: str) -> str:
    return f"{PARAM_LABELS.get(key, key)}  [{key}]"


CALIBRATED_KEY = "dp.noise_multiplier"  # calibrated to dp.target_epsilon where that is set


def sigma_calibrated(table: pd.DataFrame) -> pd.Series:
    """Rows whose σ was calibrated to ``dp.target_epsilon`` (per mechanism), not set by the user."""
    column = table.get("params.dp.target_epsilon")
    if column is None:
        return pd.Series(False, index=table.index)
    return pd.to_numeric(column, errors="coerce").notna()


def sweep_axes(table: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """Each hyperparameter to plot accuracy against, with the rows to plot: every swept one; σ only
    over the rows whose σ was set (and only where it is swept among them and the baselines)."""
    out = []
    for key in swept_params(table):
        rows = table
        if key == CALIBRATED_KEY:
            rows = table[~sigma_calibrated(table)]
            if key not in swept_params(rows):
                continue
        out.append((key, rows))
    return out


def plot_sweeps(table: pd.DataFrame, out_dir: Path, style: FigureStyle = DEFAULT_STYLE) -> list[Path]:
    """One ``accuracy_vs_<param>.<format>`` per hyperparameter of :func:`sweep_axes`."""
    return [plot_accuracy_vs(rows, key, out_dir / f"accuracy_vs_{key}.png", style) for key, rows in sweep_axes(table)]


def curves_figure(histories: pd.DataFrame, labels: dict[str, str]) -> Figure:
    """Test accuracy against epoch (top) and ε against epoch (below, same epochs), one line per run,
    labelled by ``labels`` (what differs between the runs); runs with identical ε curves (same σ, q
    and steps give the same ε) share one ε line, labelled with all of them. The accuracy is each
    run's task objective found in ``histories`` (one point for a task that scores only at the end)."""
    fig, (ax, below) = plt.subplots(2, 1, figsize=(7, 6.5), dpi=100, sharex=True, height_ratios=(3, 2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    eps_lines: dict[tuple[tuple[float, float], ...], list[tuple[str, str]]] = {}
    objectives = set(task_objectives().values())  # a run logs its own task's
    scores = sorted(objectives & set(histories["metric"])) or ["test_accuracy"]
    score = objective_name(scores[0]) if len(scores) == 1 else "accuracy"
    for i, (run_id, run) in enumerate(histories.groupby("run_id", sort=False)):
        color = colors[i % len(colors)]
        acc = run[run["metric"].isin(objectives)].sort_values("step")
        eps = run[run["metric"] == "epsilon"].sort_values("step")
        name = labels.get(str(run_id), str(run_id)[:8])
        ax.plot(acc["step"], acc["value"] * PERCENT, "-o", color=color, markersize=4, label=name)
        if not eps.empty:
            key = tuple(zip(eps["step"].astype(float), eps["value"].astype(float), strict=True))
            eps_lines.setdefault(key, []).append((name, color))
    for key, names in eps_lines.items():
        steps, values = zip(*key, strict=True)
        shared = len(names) > 1
        below.plot(steps, values, "-", color="black" if shared else names[0][1],
                   label=" = ".join(n for n, _ in names) + (" (identical ε)" if shared else ""))  # fmt: skip
    below.set_xlabel("epoch")
    below.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(f"{score} (%)" if len(scores) == 1 else f"accuracy (%): {', '.join(map(objective_name, scores))}")
    below.set_ylabel("ε (the run's accountant)")
    ax.set_title(f"{score} and ε per epoch", fontsize=10)
    for axes in (ax, below):
        axes.grid(alpha=0.3)
        if axes.get_legend_handles_labels()[0]:
            legend_outside(axes)
    return fig


def plot_curves(
    histories: pd.DataFrame, labels: dict[str, str], path: Path, style: FigureStyle = DEFAULT_STYLE
) -> Path:
    """:func:`curves_figure`, written to ``path``."""
    return save(curves_figure(histories, labels), path, style)


def plot_memory(groups: pd.DataFrame, path: Path, style: FigureStyle = DEFAULT_STYLE) -> Path:
    """Memory (MiB) after each stage of the first iteration, its peak and the run's peak, per group
    of configs with the same figures (report.memory_groups)."""
    shown = groups.head(MAX_MEMORY_GROUPS).iloc[::-1]  # the largest at the top of a horizontal bar chart
    stages = list(STAGE_LABELS)
    height = 0.8 / len(stages)
    fig, ax = plt.subplots(figsize=(8, max(4.0, 1.6 + 0.16 * len(stages) * len(shown))), dpi=100)
    y = np.arange(len(shown))
    for i, stage in enumerate(stages):
        ax.barh(y + ((len(stages) - 1) / 2 - i) * height, shown[stage] / MIB, height=height,  # first on top
                label=STAGE_LABELS[stage])  # fmt: skip
    ax.set_yticks(y, list(shown["label"]), fontsize=8)
    ax.set_xlabel("memory (MiB)")
    backends = sorted({b for text in groups["backend"] for b in str(text).split(", ")})
    how = "; ".join(f"{b} ({BACKEND_NOTES.get(b, 'unknown backend')})" for b in backends)
    cut = "" if len(groups) <= MAX_MEMORY_GROUPS else f", the {MAX_MEMORY_GROUPS} largest of {len(groups)} groups"
    ax.set_title(f"memory per stage, first training iteration{cut}\nbackend: {how}", fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    legend_outside(ax)
    return save(fig, path, style)


LABEL_KEYS = (*HYPERPARAMETERS.values(), *PRIVACY_KINDS.values(), "dp.enabled", "train.seed")  # label keys
SECRET_LABEL_KEYS = ("train.seed",)  # a private tuning's trial's: secret (dpsweep.privacy.tuning.secret_seed)
ALL_TRIALS_STAMP = "NOT FOR RELEASE: every trial of a private tuning (dpsweep-report --all-trials)"


def run_labels(report: Report, run_ids: Sequence[str]) -> dict[str, str]:
    """Per run, what differs between ``run_ids``: ``σ=0.8, seed=1`` (short names of the differing
    params, dataset and model included when they differ); the run id only where nothing differs.
    Never the seed where a run is a private tuning's trial (its seed is secret)."""
    runs = report.table_runs.set_index("run_id")
    tuned = runs.index.isin(run_ids) & column(runs, "tuning").notna().to_numpy()
    secret = SECRET_LABEL_KEYS if tuned.any() else ()
    keys = [k for k in LABEL_KEYS if f"params.{k}" in runs.columns and k not in secret]
    values = {k: {r: key_text(k, _label_value(runs, r, k)) for r in run_ids} for k in keys}
    private = {r: bool(runs.at[r, "private"]) for r in run_ids}

    def named(k: str, r: str) -> bool:  # a non-private run has no mechanism or unit to tell it apart by
        return private[r] or k not in DEFAULT_OF_PARAM

    differing = [k for k in keys if len({v for r, v in values[k].items() if named(k, r)}) > 1]
    out = {}
    for r in run_ids:
        parts = [f"{SHORT_NAMES.get(k, k.rsplit('.', 1)[-1])}={values[k][r]}" for k in differing if named(k, r)]
        parts = [p.replace("enabled=False", "non-private").replace("enabled=True", "DP") for p in parts]
        out[r] = ", ".join(parts) or f"run {r[:8]}"
    return out


def _label_value(runs: pd.DataFrame, run_id: str, key: str) -> object:
    """A run's param ``key``; a private run without dp.mechanism or dp.unit (from before them): the default."""
    value = runs.at[run_id, f"params.{key}"]
    missing = value is None or (isinstance(value, float) and math.isnan(value))
    if missing and key in DEFAULT_OF_PARAM and bool(runs.at[run_id, "private"]):
        return DEFAULT_OF_PARAM[key]
    return value


def plot_report(
    report: Report, out_dir: Path, histories: pd.DataFrame, style: FigureStyle = DEFAULT_STYLE
) -> list[Path]:
    """Every plot of the report into ``out_dir``; returns their paths (pareto, sweeps, curves, memory,
    and ``<task>_samples.png`` for each task of the report whose runs log sample grids). A report of all
    trials of a private tuning (``report.all_trials``) stamps each one not for release (:data:`ALL_TRIALS_STAMP`)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if report.all_trials:  # every trial of a private tuning: each figure says it is not for release
        style = replace(style, stamp=ALL_TRIALS_STAMP)
    table = report.table
    paths = [plot_pareto(table, out_dir / "pareto.png", style), *plot_sweeps(table, out_dir, style)]
    ids = list(dict.fromkeys(histories["run_id"]))
    paths.append(plot_curves(histories, run_labels(report, ids), out_dir / "curves.png", style))
    memory = memory_table(report.table_runs)
    paths.append(plot_memory(memory_groups(memory, table), out_dir / "memory.png", style))
    return [*paths, *plot_samples(report, out_dir, style)]
