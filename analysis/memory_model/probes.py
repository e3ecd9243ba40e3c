"""Probe tables: read from CSV, their text columns cleaned, the targets they measured and the ranges they span."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from dpsweep.memory.model import STAGE_PEAK_TARGETS, TARGETS, flag_column

# Probe-table columns that hold text. An empty cell (a run without the tag) reads back as "", never
# as NaN, which would not sort or compare with the strings around it.
TEXT_COLUMNS = ("model", "dataset", "backend", "device_name", "torch_version", "grad_sample_mode", "run_id",
                "config_hash")  # fmt: skip
# Numeric probe columns whose probed range a model records: predictions outside it are extrapolations.
RANGE_COLUMNS = ("hidden_units", "batch_size", "channels", "height", "width", "trainable_params")


def clean_probes(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` with its text columns as strings (missing: ``""``), as fits and checks expect."""
    frame = frame.copy()
    for column in TEXT_COLUMNS:
        if column in frame.columns:
            frame[column] = frame[column].astype(object).where(frame[column].notna(), "").astype(str)
    return frame


def read_probes(path: str | Path) -> pd.DataFrame:
    """A probe table written by ``dpsweep-memory probe --csv``. Text columns are read as written
    (``none`` or ``None`` stay strings, an empty cell is ``""``); numbers as numbers."""
    frame = pd.read_csv(path, dtype=str, keep_default_na=False)
    for column in frame.columns:
        if column not in TEXT_COLUMNS:
            values = frame[column].replace("", np.nan)
            if set(values.dropna()) <= {"True", "False"} and values.notna().all():
                frame[column] = values == "True"
                continue
            try:
                frame[column] = pd.to_numeric(values)
            except (ValueError, TypeError):  # not numbers: kept as text, and the fit names the bad values
                frame[column] = values
    return clean_probes(frame)


def default_targets(frame: pd.DataFrame) -> list[str]:
    """Every target of TARGETS, less the in-stage peaks (STAGE_PEAK_TARGETS) where ``frame`` lacks
    them or some probe has none (probes written before they were logged)."""

    def measured(target: str) -> bool:
        return target in frame.columns and bool(pd.to_numeric(frame[target], errors="coerce").notna().all())

    return [t for t in TARGETS if t not in STAGE_PEAK_TARGETS or measured(t)]


def probed_ranges(frame: pd.DataFrame) -> dict[str, list[float]]:
    """[min, max] of each numeric column the probes varied or fixed (RANGE_COLUMNS, and dp as 0/1)."""
    ranges = {}
    for column in RANGE_COLUMNS:
        if column in frame.columns:
            values = pd.to_numeric(frame[column], errors="coerce").dropna()
            if not values.empty:
                ranges[column] = [float(values.min()), float(values.max())]
    if "dp" in frame.columns:
        flags = flag_column(frame, "dp")
        ranges["dp"] = [float(flags.min()), float(flags.max())]
    return ranges
