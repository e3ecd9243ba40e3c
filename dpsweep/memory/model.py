"""Fitted linear memory models, as a run uses them: load one and predict bytes from a config's features.

A model file (``dpsweep-memory fit``, written by :func:`dpsweep.analysis.memory_model.save_models`)
holds, per model (e.g. ``cnn``) and per target (the bytes after each training stage, the iteration's
allocated peak and the CUDA allocator's reserved peak), coefficients in bytes per unit of design
columns computed from a config: batch size B, trainable parameters P, B·C·H·W input values, B·P,
DP on/off, the grad-sample mode, … (the feature registry, FEATURES). This module reads such files and
predicts from them with numpy only: fitting, cross-validation and plots (pandas, scipy, matplotlib)
are in :mod:`dpsweep.analysis.memory_model`. ::

    from dpsweep.memory import model
    models = model.load_models("memory_model.json")
    m = models["cnn"]
    m.predict({"trainable_params": np.array([26010]), ...})   # {target column: predicted bytes}
    m.outside_probed(rows)                                      # where rows leave the probed ranges
    m.coefficients("iteration_peak", "envelope")                # bytes per unit of each column

Rows are given as a *table*: equal-length columns by name, in the probe table's schema (only the
columns the fitted features need; :mod:`dpsweep.memory.tables`). The features and the design matrix
are :mod:`dpsweep.memory.features`; their names are re-exported here, as are the tables'.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dpsweep.memory.features import (
    CONST,
    FEATURES,
    Feature,
    FeatureValues,
    column_values,
    design_matrix,
    expand_columns,
    feature_help,
    parse_features,
    predict_matrix,
    required_columns,
)
from dpsweep.memory.tables import (
    MemoryModelError,
    Table,
    check_columns,
    flag_column,
    numeric_column,
    table_rows,
    text_column,
)

# the features and tables are re-exported: callers import them from here
__all__ = [
    "CONST",
    "FEATURES",
    "FORMAT",
    "PEAK_TARGET",
    "PLAN_FIT",
    "RESERVED_TARGET",
    "STAGE_PEAK_TARGETS",
    "TARGETS",
    "Feature",
    "FeatureValues",
    "MemoryModel",
    "MemoryModelError",
    "Table",
    "TargetFit",
    "check_columns",
    "column_values",
    "design_matrix",
    "expand_columns",
    "feature_help",
    "flag_column",
    "load_meta",
    "load_models",
    "numeric_column",
    "parse_features",
    "predict_matrix",
    "required_columns",
    "table_rows",
    "target_column",
    "text_column",
]

FORMAT = "dpsweep-memory-model/1"

# Target column -> its name in formulas. Levels after each stage, then the peaks.
TARGETS: dict[str, str] = {
    "model_load_bytes": "model_load",
    "batch_load_bytes": "batch_load",
    "backward_bytes": "backward",
    "optimizer_step_bytes": "optimizer_step",
    "iteration_peak_bytes": "iteration_peak",
    "reserved_peak_bytes": "reserved_peak",
    # the highest level inside each stage (forward: the backward stage up to the end of the forward
    # pass; dpsweep.memory.stages.PEAK_SPLITS); fitted where the probes have them (probes since dpsweep 0.2)
    "model_load_peak_bytes": "model_load_peak",
    "batch_load_peak_bytes": "batch_load_peak",
    "forward_peak_bytes": "forward_peak",
    "backward_peak_bytes": "backward_peak",
    "optimizer_step_peak_bytes": "optimizer_step_peak",
}
PEAK_TARGET = "iteration_peak_bytes"  # the iteration's allocated peak: the largest of STAGE_PEAK_TARGETS
RESERVED_TARGET = "reserved_peak_bytes"  # the CUDA allocator's reserved peak (on the CPU twin: the same)
STAGE_PEAK_TARGETS = tuple(t for t in TARGETS if t.endswith("_peak_bytes") and t not in (PEAK_TARGET, RESERVED_TARGET))
PLAN_FIT = "envelope"  # the fit plans use: the upper envelope, which under-predicts no fitted probe


def target_column(target: str) -> str:
    """``iteration_peak`` or ``iteration_peak_bytes`` -> ``iteration_peak_bytes``."""
    if target in TARGETS:
        return target
    if f"{target}_bytes" in TARGETS:
        return f"{target}_bytes"
    raise MemoryModelError("target", target, f"unknown memory target; valid: {', '.join(TARGETS.values())}")


# ---------------------------------------------------------------------------------------------
# the model
# ---------------------------------------------------------------------------------------------
@dataclass
class TargetFit:
    """One target's fits: the features asked for, the design columns kept and dropped (column ->
    reason), each fit's coefficients in bytes per unit of its column (``const`` in bytes), and the
    dropped columns that were constant in every probe, with their value (``fixed``: the model knows
    nothing of other values)."""

    features: list[str]
    columns: list[str]
    dropped: dict[str, str]
    coefficients: dict[str, dict[str, float]]  # fit name (least_squares, envelope) -> column -> bytes per unit
    fixed: dict[str, float] = field(default_factory=dict)

    def coefficient_vector(self, fit: str) -> np.ndarray:
        """``fit``'s coefficients in the order of ``columns``; MemoryModelError for a fit not held."""
        if fit not in self.coefficients:
            raise MemoryModelError("fit", fit, f"unknown memory fit; valid: {', '.join(sorted(self.coefficients))}")
        return np.array([self.coefficients[fit][c] for c in self.columns])


def _json_value(value: Any) -> Any:
    """A record value as strict JSON holds it: a NaN float becomes null."""
    return None if isinstance(value, float) and math.isnan(value) else value


@dataclass
class MemoryModel:
    """The memory model of one ``model`` (e.g. ``cnn``), fitted to ``n_probes`` probes of one
    memory ``backend``. ``targets`` maps each target column to its TargetFit; ``levels`` the
    categorical raw columns used to the levels seen; ``provenance`` the datasets, devices and torch
    versions probed; ``ranges`` the probed [min, max] of numeric columns (and ``dp`` as 0/1).

    ``cv_records`` is the held-out error, one dict per target and fit (the layout of
    ``dpsweep.analysis.memory_model.CV_COLUMNS``; ``cv_frame`` there makes it a frame);
    ``cv_predictions`` the held-out predictions behind it, a table of equal-length columns
    (``PREDICTION_COLUMNS`` there), present only on a freshly fitted model (not saved to JSON)."""

    model: str
    backend: str
    n_probes: int
    targets: dict[str, TargetFit]
    levels: dict[str, list[str]] = field(default_factory=dict)
    provenance: dict[str, list[str]] = field(default_factory=dict)
    ranges: dict[str, list[float]] = field(default_factory=dict)
    cv_records: list[dict[str, Any]] = field(default_factory=list)
    cv_predictions: dict[str, np.ndarray] | None = None

    @property
    def features(self) -> dict[str, list[str]]:
        return {t: f.features for t, f in self.targets.items()}

    def peak_targets(self) -> list[str]:
        """The targets whose largest prediction is the peak to plan with. The iteration's allocated
        peak is the largest of the in-stage peaks, and a maximum is not linear in the config (on a
        GPU, a frozen backbone's forward activations dominate small heads, per-sample gradients large
        ones): where every stage peak is fitted, each is predicted and the largest taken; else the
        iteration peak's own fit. The reserved peak is fitted and reported but not planned with
        (see ``dpsweep.memory.predict.ALLOCATOR_HEADROOM``)."""
        return list(STAGE_PEAK_TARGETS) if all(t in self.targets for t in STAGE_PEAK_TARGETS) else [PEAK_TARGET]

    def predict_peak(self, table: Table, fit: str = PLAN_FIT, *, allow_unprobed: bool = False) -> np.ndarray:
        """The planned peak of each row: the largest prediction of :meth:`peak_targets`."""
        predicted = self.predict(table, fit, self.peak_targets(), allow_unprobed=allow_unprobed)
        return np.max(np.stack(list(predicted.values())), axis=0)

    def coefficients(self, target: str, fit: str = PLAN_FIT) -> dict[str, float]:
        """Bytes per unit of each kept column (``const``: bytes) of ``target``'s ``fit``."""
        tf = self._target(target)
        tf.coefficient_vector(fit)  # checks the fit name
        return dict(tf.coefficients[fit])

    def _target(self, target: str) -> TargetFit:
        column = target_column(target)
        if column not in self.targets:
            raise MemoryModelError(
                "target", target, f"not fitted for model {self.model!r}; fitted: {', '.join(self.targets)}"
            )
        return self.targets[column]

    def predict(
        self,
        table: Table,
        fit: str = PLAN_FIT,
        targets: Sequence[str] | None = None,
        *,
        allow_unprobed: bool = False,
    ) -> dict[str, np.ndarray]:
        """Predicted bytes per target (``<target>_bytes`` -> float64 array, one value per row) for
        configs in the probe schema (only the columns the kept features need; a ``model`` column, if
        any, must name this model). Rows the probes say nothing about raise MemoryModelError unless
        ``allow_unprobed``: a level of a categorical feature that no probe had
        (``grad_sample_mode=ew``), or a value of a column that was constant in every probe (``dp=1``
        when every probe had DP off)."""
        chosen = [target_column(t) for t in targets] if targets is not None else list(self.targets)
        fits = [self._target(t) for t in chosen]
        coefs = [tf.coefficient_vector(fit) for tf in fits]
        check_columns(table, required_columns(c for f in fits for c in f.columns), f"predicting for {self.model!r}")
        if "model" in table:
            others = sorted(set(text_column(table, "model").tolist()) - {self.model})
            if others:
                raise MemoryModelError("model", ", ".join(others), f"these rows are not of model {self.model!r}")
        if not allow_unprobed:
            self._check_probed(table, fits)
        return {
            column: predict_matrix(design_matrix(table, tf.columns), coef)
            for column, tf, coef in zip(chosen, fits, coefs, strict=True)
        }

    def _check_probed(self, table: Table, fits: Sequence[TargetFit]) -> None:
        used = set(required_columns(s for f in fits for s in f.features))
        for raw, seen in self.levels.items():
            if raw in table and raw in used:
                unseen = sorted(set(text_column(table, raw).tolist()) - set(seen))
                if unseen:
                    raise MemoryModelError(
                        raw,
                        ", ".join(unseen),
                        f"no probe of {self.model!r} had it (probed: {', '.join(seen)}); probe it first",
                    )
        for tf in fits:
            for column, value in tf.fixed.items():
                if not all(c in table for c in required_columns([column])):
                    continue
                values = column_values(table, column)
                if not np.all(values == value):
                    other = sorted(set(values[values != value].tolist()))[:5]
                    raise MemoryModelError(
                        column,
                        ", ".join(f"{v:g}" for v in other),
                        f"every probe of {self.model!r} had {column}={value:g}, so the model cannot predict "
                        "other values; probe them first",
                    )

    def outside_probed(self, table: Table) -> list[str]:
        """Where rows of ``table`` leave what the probes covered: numbers outside the probed range
        (extrapolation: the formula's shape was never checked there) and flags or grad-sample modes
        no probe had, whether or not they are features. One note per column; empty when inside."""
        notes = []
        for column, (lo, hi) in self.ranges.items():
            if column not in table:
                continue
            values = flag_column(table, column) if column == "dp" else numeric_column(table, column)
            out = values[(values < lo) | (values > hi)]
            if out.size:
                shown = ", ".join(f"{v:g}" for v in sorted(set(out.tolist()))[:3])
                probed = f"{lo:g}" if lo == hi else f"{lo:g} to {hi:g}"
                notes.append(f"{column}={shown} is outside the probed {probed}")
        seen = self.levels.get("grad_sample_mode")
        if seen is not None and "grad_sample_mode" in table:
            unseen = sorted(set(text_column(table, "grad_sample_mode").tolist()) - set(seen))
            if unseen:
                notes.append(f"grad_sample_mode={', '.join(unseen)} was never probed (probed: {', '.join(seen)})")
        return notes

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict, ``{"format": FORMAT, "model": …, "targets": {…}, "cv": [...], …}``
        (NaN in the held-out error is written as null)."""
        return {
            "format": FORMAT,
            "model": self.model,
            "backend": self.backend,
            "n_probes": self.n_probes,
            "levels": self.levels,
            "provenance": self.provenance,
            "ranges": self.ranges,
            "targets": {
                t: {
                    "features": f.features,
                    "columns": f.columns,
                    "dropped": f.dropped,
                    "coefficients": f.coefficients,
                    "fixed": f.fixed,
                }
                for t, f in self.targets.items()
            },
            "cv": [{k: _json_value(v) for k, v in record.items()} for record in self.cv_records],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> MemoryModel:
        """The model saved by to_json; another format raises MemoryModelError."""
        if not isinstance(data, Mapping) or data.get("format") != FORMAT:
            found = data.get("format") if isinstance(data, Mapping) else type(data).__name__
            raise MemoryModelError("format", found, f"not a memory model; expected format {FORMAT!r}")
        try:
            targets = {
                t: TargetFit(
                    features=list(f["features"]),
                    columns=list(f["columns"]),
                    dropped=dict(f["dropped"]),
                    coefficients={k: {c: float(v) for c, v in cs.items()} for k, cs in f["coefficients"].items()},
                    fixed={c: float(v) for c, v in f.get("fixed", {}).items()},
                )
                for t, f in data["targets"].items()
            }
            return cls(
                model=str(data["model"]),
                backend=str(data["backend"]),
                n_probes=int(data["n_probes"]),
                targets=targets,
                levels={k: list(v) for k, v in data.get("levels", {}).items()},
                provenance={k: list(v) for k, v in data.get("provenance", {}).items()},
                ranges={k: [float(v[0]), float(v[1])] for k, v in data.get("ranges", {}).items()},
                cv_records=[dict(record) for record in data.get("cv", [])],
            )
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise MemoryModelError("format", FORMAT, f"malformed memory model: {type(err).__name__}: {err}") from None


# ---------------------------------------------------------------------------------------------
# files
# ---------------------------------------------------------------------------------------------
def _read(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise MemoryModelError(
            "path", str(path), "no such file; write one with save_models (dpsweep-memory fit)"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise MemoryModelError("path", str(path), f"not JSON: {err}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("models"), dict):
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise MemoryModelError("path", str(path), f"format {found!r} is not a memory model file (expected {FORMAT!r})")
    return data


def load_models(path: str | Path) -> dict[str, MemoryModel]:
    """The models saved by ``dpsweep.analysis.memory_model.save_models``, keyed by model name."""
    return {name: MemoryModel.from_json(m) for name, m in _read(path)["models"].items()}


def load_meta(path: str | Path) -> dict[str, Any]:
    """The ``meta`` dict saved by ``dpsweep.analysis.memory_model.save_models``."""
    return dict(_read(path).get("meta", {}))
