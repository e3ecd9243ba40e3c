"""What every figure of a report shares (matplotlib): the file format and resolution, panel grids, legends outside."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure

# Text a publisher accepts: TrueType (Type 42) fonts embedded in PDF and PostScript, where matplotlib
# embeds Type 3 by default (which many venues' checks reject); text kept as text in SVG.
matplotlib.rc("pdf", fonttype=42)
matplotlib.rc("ps", fonttype=42)
matplotlib.rc("svg", fonttype="none")


@dataclass(frozen=True)
class FigureStyle:
    """How figures are written: ``format`` (one of ``report.FIGURE_FORMATS``), ``dpi`` (raster resolution)
    and ``stamp``, a line written across the top of every figure (a report of all trials of a private
    tuning: not for release)."""

    format: str = "png"
    dpi: int = 150
    stamp: str | None = None


DEFAULT_STYLE = FigureStyle()  # png at 150 dpi: every plot function's default


def save(fig: Figure, path: Path, style: FigureStyle) -> Path:
    """Write ``fig`` as ``path`` with the style's suffix; the bounding box takes in the legends outside."""
    path = path.with_suffix(f".{style.format}")
    fig.tight_layout()
    if style.stamp:
        fig.suptitle(style.stamp, color="tab:red", fontsize=11, fontweight="bold", y=1.02)
    fig.savefig(path, dpi=style.dpi, bbox_inches="tight")
    plt.close(fig)
    return path


def block_panels(table: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """(title, rows) per dataset and model."""
    return [(f"{d}/{m}", block) for (d, m), block in table.groupby(["dataset", "model"], sort=True)]


def figure_grid(n: int, width: float = 5.5, height: float = 4.0) -> tuple[Figure, list[Axes]]:
    """A figure of ``n`` panels, at most 3 to a row; the axes of the panels, row by row."""
    cols = min(n, 3)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows), dpi=100, squeeze=False)
    flat = list(axes.ravel())
    for extra in flat[n:]:
        extra.set_visible(False)
    return fig, flat[:n]


def legend_outside(ax: Axes) -> None:
    """The legend to the right of ``ax``, outside the data."""
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)


def log_scale_if_wide(ax: Axes, values: Sequence[float], axis: str = "x") -> None:
    """A log scale on ``axis`` when ``values`` are all positive and span a factor of 20 or more."""
    positive = [v for v in values if v > 0 and math.isfinite(v)]
    if len(positive) == len(values) and positive and max(positive) / min(positive) >= 20:
        (ax.set_xscale if axis == "x" else ax.set_yscale)("log")
