"""Privacy–accuracy reports from MLflow runs (``dpsweep-report``): tables as DataFrames, notes, renderers, plots."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from dpsweep.analysis.report.build import Report, build_report
from dpsweep.analysis.report.columns import MEMORY_STAGES, lookup
from dpsweep.analysis.report.memory import memory_groups, memory_table
from dpsweep.analysis.report.notes import reference_accuracies
from dpsweep.analysis.report.query import best_runs, history_metrics, metric_histories, report_runs, search_runs
from dpsweep.analysis.report.render import FIGURE_FORMATS, FORMATS, render, write
from dpsweep.analysis.report.table import SORT_KEYS, pareto_front, shows_privacy_kinds, summary_table, swept_params

if TYPE_CHECKING:  # the plots import matplotlib: loaded on first use of one of their names (__getattr__)
    from dpsweep.analysis.report.figures import FigureStyle
    from dpsweep.analysis.report.plots import curves_figure, pareto_figure, plot_pareto, plot_report, run_labels
    from dpsweep.analysis.report.samples import final_sample_grid, plot_samples, plot_task_samples, sample_rows

_PLOT_MODULES = {
    "FigureStyle": "figures",
    "curves_figure": "plots",
    "pareto_figure": "plots",
    "plot_pareto": "plots",
    "plot_report": "plots",
    "run_labels": "plots",
    "final_sample_grid": "samples",
    "plot_samples": "samples",
    "plot_task_samples": "samples",
    "sample_rows": "samples",
}

__all__ = [
    "FIGURE_FORMATS",
    "FORMATS",
    "MEMORY_STAGES",
    "SORT_KEYS",
    "FigureStyle",
    "Report",
    "best_runs",
    "build_report",
    "curves_figure",
    "final_sample_grid",
    "history_metrics",
    "lookup",
    "memory_groups",
    "memory_table",
    "metric_histories",
    "pareto_figure",
    "pareto_front",
    "plot_pareto",
    "plot_report",
    "plot_samples",
    "plot_task_samples",
    "reference_accuracies",
    "render",
    "report_runs",
    "run_labels",
    "sample_rows",
    "search_runs",
    "shows_privacy_kinds",
    "summary_table",
    "swept_params",
    "write",
]


def __getattr__(name: str) -> Any:
    """A plot name, imported from its module (and matplotlib with it) when first asked for."""
    module = _PLOT_MODULES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{module}"), name)
