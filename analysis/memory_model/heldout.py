"""Held-out (k-fold) error of the fits: each probe's held-out prediction, their summary per target
and fit, and frames of both."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from dpsweep.analysis.memory_model.design import DEFAULT_FOLDS
from dpsweep.analysis.memory_model.fits import FITS, fit_columns
from dpsweep.memory.model import MemoryModel, predict_matrix

UNDER_TOLERANCE = 1e-9  # relative shortfall below which a prediction counts as exact, not under
CV_METRICS = ("mean_abs_rel_error", "max_abs_rel_error", "share_under_predicted", "max_under_fraction")
# The held-out error (MemoryModel.cv_records), one record per model, target and fit.
CV_COLUMNS = ["model", "backend", "target", "fit", "n_probes", "folds", *CV_METRICS]
# The held-out predictions behind it (MemoryModel.cv_predictions), one row per probe, target and fit.
PREDICTION_COLUMNS = [
    "model", "backend", "target", "fit", "fold", "probe", "observed_bytes", "predicted_bytes", "rel_residual"
]  # fmt: skip


def _folds(n: int, folds: int, seed: int) -> list[np.ndarray]:
    """k = min(folds, n) held-out index sets from a permutation seeded by ``seed`` (sizes as sklearn's KFold)."""
    perm = np.random.default_rng(seed).permutation(n)
    return [np.sort(part) for part in np.array_split(perm, min(folds, n))]


def cross_validate(
    matrix: np.ndarray, columns: Sequence[str], y: np.ndarray, folds: int = DEFAULT_FOLDS, seed: int = 0
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Held-out predictions of each fit for every row (k-fold; within each training fold the
    identifiable columns are chosen afresh), and each row's fold number."""
    n = len(y)
    predictions = {name: np.full(n, np.nan) for name in FITS.names()}
    fold_of = np.zeros(n, dtype=int)
    for k, held in enumerate(_folds(n, folds, seed)):
        train = np.setdiff1d(np.arange(n), held)
        fold_of[held] = k
        for name, coef in fit_columns(matrix[train], columns, y[train]).items():
            predictions[name][held] = predict_matrix(matrix[held], coef)
    return predictions, fold_of


def cv_summary(predictions: pd.DataFrame) -> list[dict[str, Any]]:
    """Per model, target and fit, from held-out predictions (PREDICTION_COLUMNS): the mean and
    max of |pred − obs| / obs, the share of probes under-predicted (pred < obs) and the largest
    under-prediction as a fraction of obs (0 when none). Plain records (CV_COLUMNS), as
    MemoryModel.cv_records holds them; :func:`cv_frame` makes a frame of them."""
    rows = []
    keys = ["model", "backend", "target", "fit"]
    for key, block in predictions.groupby(keys, sort=False):
        rel = block["rel_residual"].to_numpy(dtype=float)
        # under-predicted: by more than float round-off (a fit that is exact must not count as under)
        under = rel < -UNDER_TOLERANCE
        rows.append(
            {
                **{k: str(v) for k, v in zip(keys, key, strict=True)},
                "n_probes": len(block),
                "folds": int(block["fold"].nunique()),
                "mean_abs_rel_error": float(np.mean(np.abs(rel))),
                "max_abs_rel_error": float(np.max(np.abs(rel))),
                "share_under_predicted": float(np.mean(under)),
                "max_under_fraction": float(max(0.0, np.max(-rel))) if under.any() else 0.0,
            }
        )
    return rows


def _cv_records_frame(records: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    """Held-out error records as a frame of CV_COLUMNS (a null read back from JSON is NaN)."""
    return pd.DataFrame.from_records(list(records), columns=CV_COLUMNS).astype(dict.fromkeys(CV_METRICS, float))


def cv_frame(model: MemoryModel) -> pd.DataFrame:
    """The held-out error of one model (``model.cv_records``) as a frame: one row per target and fit."""
    return _cv_records_frame(model.cv_records)


def cv_table(models: Mapping[str, MemoryModel]) -> pd.DataFrame:
    """The held-out error of several models in one tidy frame (one row per model, target and fit)."""
    return _cv_records_frame([r for m in models.values() for r in m.cv_records])


def cv_predictions_table(models: Mapping[str, MemoryModel]) -> pd.DataFrame:
    """The held-out predictions of several freshly fitted models in one frame (PREDICTION_COLUMNS),
    as :func:`residual_plot` takes them. Models loaded from a file have none."""
    frames = [pd.DataFrame(m.cv_predictions) for m in models.values() if m.cv_predictions is not None]
    if not frames:
        return pd.DataFrame(columns=PREDICTION_COLUMNS)
    return pd.concat(frames, ignore_index=True)[PREDICTION_COLUMNS]
