"""Fitting: the MemoryModel of one model's probes (:func:`fit`), or of each model's (:func:`fit_all`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from dpsweep.analysis.memory_model.design import DEFAULT_FOLDS, Design, check_backend, checked_designs
from dpsweep.analysis.memory_model.fits import FITS
from dpsweep.analysis.memory_model.heldout import PREDICTION_COLUMNS, cross_validate, cv_summary
from dpsweep.analysis.memory_model.probes import clean_probes, probed_ranges
from dpsweep.memory.model import FEATURES, MemoryModel, MemoryModelError, TargetFit, check_columns


def fit(
    frame: pd.DataFrame,
    features: Sequence[str] | None = None,
    *,
    targets: Sequence[str] | None = None,
    folds: int = DEFAULT_FOLDS,
    seed: int = 0,
) -> MemoryModel:
    """The MemoryModel of the probes in ``frame``, which must all be of one ``model`` and one
    ``backend`` (see fit_all for a frame of several models). ``features`` (one list for every
    target) overrides DEFAULT_FEATURES; ``targets`` (names or columns) defaults to default_targets(frame).
    ``folds`` and ``seed`` set the k-fold held-out error (k = min(folds, probes))."""
    frame = clean_probes(frame)
    return _fit(frame, checked_designs(frame, features, targets, folds), folds, seed)


def _fit(frame: pd.DataFrame, designs: dict[str, Design], folds: int, seed: int) -> MemoryModel:
    """fit() on probes already cleaned and checked (their designs from :func:`checked_designs`)."""
    backend = check_backend(frame)
    model = str(frame["model"].iloc[0])
    n = len(frame)
    fits: dict[str, TargetFit] = {}
    cv_rows: list[pd.DataFrame] = []
    levels: dict[str, list[str]] = {}
    if "grad_sample_mode" in frame.columns:  # recorded even when not a feature: predict warns of others
        levels["grad_sample_mode"] = sorted(frame["grad_sample_mode"].unique())
    for target, d in designs.items():
        kept = d.ident.kept
        idx = [d.columns.index(c) for c in kept]
        coefficients = {}
        for name in FITS.names():
            coef = FITS.get(name)(d.matrix[:, idx], d.y)
            coefficients[name] = {c: float(w) for c, w in zip(kept, coef, strict=True)}
        fits[target] = TargetFit(d.features, kept, d.ident.dropped, coefficients, d.ident.constant)
        for spec in d.features:
            for factor in spec.split(":"):
                feature = FEATURES.get(factor)
                if feature.categorical:
                    levels[feature.requires[0]] = sorted(frame[feature.requires[0]].astype(str).unique())
        predictions, fold_of = cross_validate(d.matrix[:, idx], kept, d.y, folds, seed)
        for name, pred in predictions.items():
            with np.errstate(divide="ignore", invalid="ignore"):
                rel = np.where(d.y > 0, (pred - d.y) / d.y, np.nan)
            cv_rows.append(
                pd.DataFrame(
                    {
                        "model": model,
                        "backend": backend,
                        "target": target,
                        "fit": name,
                        "fold": fold_of,
                        "probe": frame.index.to_numpy(),
                        "observed_bytes": d.y,
                        "predicted_bytes": pred,
                        "rel_residual": rel,
                    },
                    columns=PREDICTION_COLUMNS,
                )
            )
    cv_predictions = pd.concat(cv_rows, ignore_index=True)
    provenance = {c: sorted(frame[c].unique()) for c in ("dataset", "device_name", "torch_version") if c in frame}
    return MemoryModel(
        model=model,
        backend=backend,
        n_probes=n,
        targets=fits,
        levels=levels,
        provenance=provenance,
        ranges=probed_ranges(frame),
        cv_records=cv_summary(cv_predictions),
        cv_predictions={c: cv_predictions[c].to_numpy() for c in PREDICTION_COLUMNS},
    )


def fit_all(
    frame: pd.DataFrame,
    model: str | None = None,
    features: Sequence[str] | None = None,
    *,
    targets: Sequence[str] | None = None,
    folds: int = DEFAULT_FOLDS,
    seed: int = 0,
) -> dict[str, MemoryModel]:
    """fit() for each model in ``frame`` (or only ``model``), keyed by model name. The probes of
    each model must hold one memory backend. Every model's input is checked before any is fitted."""
    check_columns(frame, ["model", "backend"], "a memory fit")
    frame = clean_probes(frame)
    present = sorted(frame["model"].unique())
    if model is not None:
        if model not in present:
            raise MemoryModelError("model", model, f"no probes of this model; models probed: {', '.join(present)}")
        present = [model]
    blocks = {name: frame[frame["model"] == name] for name in present}
    designs = {name: checked_designs(block, features, targets, folds) for name, block in blocks.items()}  # all checked
    return {name: _fit(block, designs[name], folds, seed) for name, block in blocks.items()}
