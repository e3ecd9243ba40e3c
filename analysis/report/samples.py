"""``<task>_samples.png``: the final sample grid of each row of a task whose runs log sample grids
(``TaskConfig.logs_samples``), read from its runs' MLflow artifacts.

    dpsweep-report --experiment dpgan_digits --out report/   # the table + gan_samples.png beside the other plots

One tile per config, the final sample grid (``samples/epoch_NNN.png`` of the highest epoch) of its
first run with one, a row per class, titled with its ε; ordered by ε, the non-private rows last.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt
import pandas as pd
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from dpsweep.analysis.report.build import Report
from dpsweep.analysis.report.columns import row_tasks, sampling_tasks
from dpsweep.analysis.report.figures import DEFAULT_STYLE, FigureStyle, save
from dpsweep.analysis.report.table import privacy_names

SAMPLE_DIR = "samples"  # a run's sample grids: samples/epoch_NNN.png
SAMPLE_GRID = re.compile(r"epoch_(\d+)\.png$")
SAMPLE_COLUMNS = 4  # tiles per row of a samples figure


@contextmanager
def _quiet_downloads() -> Iterator[None]:
    """No MLflow download progress bars on stderr (one per grid) while the block runs."""
    name = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"
    before = os.environ.get(name)
    os.environ[name] = "false"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def final_sample_grid(client: MlflowClient, run_id: str, dst: Path) -> tuple[int, Path] | None:
    """The run's sample grid of the highest epoch, downloaded into ``dst``: (epoch, path); None
    when the run logged none."""
    grids = {}
    for f in client.list_artifacts(run_id, SAMPLE_DIR):
        match = None if f.is_dir else SAMPLE_GRID.search(f.path)
        if match:
            grids[int(match.group(1))] = f.path
    if not grids:
        return None
    epoch = max(grids)
    return epoch, Path(client.download_artifacts(run_id, grids[epoch], str(dst)))


def sample_rows(table: pd.DataFrame, task: str) -> pd.DataFrame:
    """The rows of ``task``, in the figure's order: per dataset and model, by ε (least first), the
    non-private rows last."""
    rows = table[row_tasks(table) == task]
    order = rows.assign(_public=~rows["private"].astype(bool))
    by = ["dataset", "model", "_public", "epsilon", "config_id"]
    return order.sort_values(by, na_position="last", kind="mergesort").drop(columns="_public")


def plot_samples(report: Report, out_dir: Path, style: FigureStyle = DEFAULT_STYLE) -> list[Path]:
    """``<task>_samples.png`` in ``out_dir`` for each task of the report whose runs log sample grids."""
    present = set(row_tasks(report.table))
    found = [
        plot_task_samples(report, t, out_dir / f"{t}_samples.png", style) for t in sampling_tasks() if t in present
    ]
    return [p for p in found if p is not None]


def plot_task_samples(report: Report, task: str, path: Path, style: FigureStyle = DEFAULT_STYLE) -> Path | None:
    """One tile per row of ``task`` (:func:`sample_rows`): the final sample grid of its first run that
    logged one (a row per class), titled with the row's ε or ``non-private`` and the grid's epoch.
    None (no file) when the report has no row of that task."""
    rows = sample_rows(report.table, task)
    if rows.empty:
        return None
    names = privacy_names(report.table)
    several = rows[["dataset", "model"]].drop_duplicates().shape[0] > 1
    client = MlflowClient(report.uri)
    cols = min(len(rows), SAMPLE_COLUMNS)
    n_rows = math.ceil(len(rows) / cols)
    fig, axes = plt.subplots(n_rows, cols, figsize=(3.2 * cols, 3.6 * n_rows), dpi=100, squeeze=False)
    flat = list(axes.ravel())
    for extra in flat[len(rows) :]:
        extra.set_visible(False)
    with tempfile.TemporaryDirectory(prefix="dpsweep-report-samples-") as tmp, _quiet_downloads():
        for i, (ax, (_, row)) in enumerate(zip(flat, rows.iterrows(), strict=False)):
            block = f"{row['dataset']}/{row['model']}: " if several else ""
            title = textwrap.fill(block + str(names[row["config_id"]]), 36)  # a tile is about 36 characters wide
            found, why = None, "no sample grid logged"
            for run_id in row["run_ids"]:
                try:
                    found = final_sample_grid(client, run_id, Path(tmp) / str(i))
                except (MlflowException, OSError) as err:
                    why = f"could not read the samples of run {run_id[:8]}: {err}"
                if found is not None:
                    break
            ax.set_axis_off()
            if found is None:
                ax.text(0.5, 0.5, why, ha="center", va="center", fontsize=7, wrap=True, transform=ax.transAxes)
                ax.set_title(title, fontsize=9)
                continue
            epoch, grid = found
            image = plt.imread(grid)
            ax.imshow(
                image, cmap="gray", vmin=0.0, vmax=1.0 if image.dtype.kind == "f" else 255, interpolation="nearest"
            )
            ax.set_title(f"{title}\nepoch {epoch}", fontsize=9)
    fig.suptitle(f"{task} samples after the final epoch (a row per class)", fontsize=10)
    return save(fig, path, style)
