"""From probes to a model file, as ``dpsweep-memory fit`` goes: the probe table from a CSV or an experiment's
probe runs, the probes of one model and one device, then the models saved with their residual plot.

    from dpsweep.analysis.memory_model import fit_all, pipeline
    probes, source = pipeline.load_probes(None, "dpsweep-probes", "sqlite:///mlflow.db")
    probes = pipeline.select_probes(probes, model=None, device=None)
    out, plot = pipeline.save_fit(fit_all(probes), source, Path("memory_model.json"))

Bad input raises :class:`dpsweep.errors.InputError` naming the ``dpsweep-memory fit`` option at fault.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from dpsweep.analysis.memory_model.heldout import cv_predictions_table
from dpsweep.analysis.memory_model.output import save_models
from dpsweep.analysis.memory_model.plot import residual_plot
from dpsweep.analysis.memory_model.probes import clean_probes, read_probes
from dpsweep.errors import InputError
from dpsweep.memory.model import MemoryModel
from dpsweep.memory.probes import Note, probe_table


def load_probes(
    csv: Path | None, experiment: str | None, uri: str, note: Note | None = None
) -> tuple[pd.DataFrame, str]:
    """The probe table from ``csv`` or else from the probe runs of ``experiment`` in ``uri`` (runs left out
    told to ``note``), and where it came from."""
    if csv is not None:
        if not csv.is_file():
            raise InputError("--csv", str(csv), "an existing probe table (dpsweep-memory probe --csv)")
        try:
            return read_probes(csv), str(csv)
        except (ValueError, UnicodeDecodeError) as err:  # pandas' parser errors are ValueErrors
            raise InputError("--csv", str(csv), f"a probe table in CSV ({err})") from err
    if experiment is None:
        raise InputError("--experiment", None, "an MLflow experiment holding probes, or --csv FILE")
    table = probe_table(uri, experiment, note=note)
    if table.empty:
        raise InputError("--experiment", experiment, f"an experiment with FINISHED probes (tag probe=true) in {uri}")
    return table, f"{uri} experiment {experiment}"


def select_probes(probes: pd.DataFrame, model: str | None, device: str | None) -> pd.DataFrame:
    """``probes`` cleaned (:func:`clean_probes`), only those of ``model`` when given, and of one device
    per model: ``device`` when given, else the one each model's probes ran on."""
    probes = clean_probes(probes)
    if model is not None and "model" in probes.columns:
        present = sorted(probes["model"].unique())
        if model not in present:
            raise InputError("--model", model, f"a model the probes are of: {', '.join(present)}")
        probes = probes[probes["model"] == model]
    return one_device_per_model(probes, device)


def one_device_per_model(probes: pd.DataFrame, device: str | None) -> pd.DataFrame:
    """Probes of one device per model: figures of two GPU models are not one memory law."""
    if "device_name" not in probes.columns:
        return probes
    if device is not None:
        kept = probes[probes["device_name"] == device]
        if kept.empty:
            found = ", ".join(sorted(set(probes["device_name"].astype(str))))
            raise InputError("--device", device, f"a device the probes ran on: {found}")
        return kept
    for model, block in probes.groupby("model"):
        devices = sorted(set(block["device_name"].astype(str)))
        if len(devices) > 1:
            raise InputError(
                "--device", None, f"one of {', '.join(devices)}: the probes of {model} ran on several devices"
            )
    return probes


def save_fit(models: dict[str, MemoryModel], source: str, out: Path, plot: Path | None = None) -> tuple[Path, Path]:
    """Save ``models`` to ``out`` (their probes' ``source`` and the time, in UTC, in its metadata) and
    their held-out residuals to ``plot`` (default ``<out>_residuals.png``); the two paths written."""
    meta = {"source": source, "created": pd.Timestamp.now(tz="UTC").isoformat(timespec="seconds")}
    written = save_models(out, models, meta)
    plot = plot or written.with_name(written.stem + "_residuals.png")
    residual_plot(cv_predictions_table(models), plot)
    return written, plot
