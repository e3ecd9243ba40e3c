"""The held-out residual plot of fitted models (matplotlib, imported when a plot is drawn)."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from dpsweep.analysis.memory_model.fits import FITS
from dpsweep.memory.model import TARGETS, MemoryModelError, Table, check_columns, table_rows


def residual_plot(cv_predictions: Table, path: str | Path) -> Path:
    """A PNG with one panel per target: the relative residual (pred − obs) / obs (%) of each
    held-out prediction against the observed MiB (log scale when they span over 30×), per fit
    (colour) and model (marker), with a zero line. ``cv_predictions`` is MemoryModel.cv_predictions
    or several models' (:func:`cv_predictions_table`)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    check_columns(cv_predictions, ["target", "fit", "observed_bytes", "predicted_bytes"], "a residual plot")
    if not table_rows(cv_predictions):
        raise MemoryModelError("cv_predictions", "empty", "no held-out predictions to plot")
    frame = pd.DataFrame(cv_predictions)
    targets = [t for t in TARGETS if t in set(frame["target"])]
    targets += sorted(set(frame["target"]) - set(targets))
    ncols = min(3, len(targets))
    nrows = math.ceil(len(targets) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.5 * ncols, 3.6 * nrows), squeeze=False)
    colours = {name: f"C{i}" for i, name in enumerate(FITS.names())}
    rows = frame.assign(model=frame["model"].astype(str) if "model" in frame else "")
    models = sorted(set(rows["model"]))
    markers = dict(zip(models, "o^sDvP*X", strict=False))
    for ax, target in zip(axes.flat, targets, strict=False):
        block = rows[rows["target"] == target]
        for (fit_name, model_name), part in block.groupby(["fit", "model"]):
            obs = part["observed_bytes"].to_numpy(dtype=float)
            rel = (part["predicted_bytes"].to_numpy(dtype=float) - obs) / obs
            label = f"{fit_name} ({model_name})" if len(models) > 1 else str(fit_name)
            ax.scatter(obs / 2**20, 100 * rel, s=14, alpha=0.7, color=colours.get(str(fit_name), "C9"),
                       marker=markers.get(str(model_name), "o"), label=label)  # fmt: skip
        ax.axhline(0.0, color="black", linewidth=0.8)
        observed = block["observed_bytes"].to_numpy(dtype=float)
        if observed.min() > 0 and observed.max() > 30 * observed.min():
            ax.set_xscale("log")  # probes that span orders of magnitude
        ax.set_title(TARGETS.get(target, target))
        ax.set_xlabel("observed (MiB)")
        ax.set_ylabel("(pred − obs) / obs (%)")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(targets) :]:
        ax.set_visible(False)
    backends = sorted(set(frame["backend"].astype(str))) if "backend" in frame else []
    fig.suptitle("held-out relative residuals (k-fold)" + (f", backend {', '.join(backends)}" if backends else ""))
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
