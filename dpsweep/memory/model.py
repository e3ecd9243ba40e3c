"""Fitted linear memory models, as a run uses them: load one and predict bytes from a config's features.

A model file (``dpsweep-memory fit``, written by :func:`dpsweep.analysis.memory_model.save_models`)
holds, per model (e.g. ``cnn``) and per target (the bytes after each training stage, the iteration's
allocated peak and the CUDA allocator's reserved peak), coefficients in bytes per unit of design
columns computed from a config: batch size B, trainable parameters P, B·C·H·W input values, B·P,
DP on/off, the grad-sample mode, … (the feature registry, FEATURES). This module reads such files and
predicts from them with numpy only: fitting, cross-validation and plots (pandas, scipy, matplotlib)
are in :mod:`dpsweep.analysis.memory_model`. ::

    from dpsweep.memory import model as mm
    models = mm.load_models("memory_model.json")
    m = models["cnn"]
    m.predict({"trainable_params": np.array([26010]), ...})   # {target column: predicted bytes}
    m.outside_probed(rows)                                      # where rows leave the probed ranges
    m.coefficients("iteration_peak", "envelope")                # bytes per unit of each column

Rows are given as a *table*: equal-length columns by name, in the probe table's schema (``model``,
``hidden_units``, ``batch_size``, ``channels``, ``height``, ``width``, ``trainable_params``, ``dp``,
``grad_sample_mode``, …; only the columns the fitted features need). A dict of numpy arrays is one;
a pandas DataFrame reads the same way (``table[column]``, ``column in table``, ``iter(table)``), so
fitting code passes its frames unchanged.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dpsweep.errors import InputError
from dpsweep.registry import Registry

FORMAT = "dpsweep-memory-model/1"
CONST = "const"  # the intercept column, in every design

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

# Equal-length columns by name: a dict of numpy arrays, or a pandas DataFrame (read only through
# ``table[column]``, ``column in table`` and ``iter(table)``, which both provide).
Table = Mapping[str, Any]
FeatureValues = Callable[[Table], np.ndarray]


class MemoryModelError(InputError):
    """Probes, features, rows or a model file that cannot be used: ``key`` names the input at fault
    (``features``, ``probes``, ``backend``, ``model``, ``path``, a probe column, …), ``value`` its
    value and ``allowed`` what is wrong and what is allowed."""


# ---------------------------------------------------------------------------------------------
# tables
# ---------------------------------------------------------------------------------------------
def table_rows(table: Table) -> int:
    """The number of rows of ``table`` (0 without columns); MemoryModelError when columns differ in length."""
    lengths = {str(c): np.shape(table[c]) for c in table}
    if any(len(shape) != 1 for shape in lengths.values()):
        shown = ", ".join(f"{c} {shape}" for c, shape in lengths.items() if len(shape) != 1)
        raise MemoryModelError("table", shown, "columns of one dimension, one value per row")
    if len(set(lengths.values())) > 1:
        shown = ", ".join(f"{c} ({shape[0]})" for c, shape in lengths.items())
        raise MemoryModelError("table", shown, "columns of equal length, one value per row")
    return next((shape[0] for shape in lengths.values()), 0)


def check_columns(table: Table, needed: Iterable[str], what: str) -> None:
    """MemoryModelError naming the columns of ``needed`` that ``table`` lacks (``what`` needs them)."""
    needed = list(dict.fromkeys(needed))
    missing = [c for c in needed if c not in table]
    if missing:
        raise MemoryModelError(
            "probes", ", ".join(missing), f"missing column(s); {what} needs the columns {', '.join(needed)}"
        )


def _floats(raw: np.ndarray) -> np.ndarray:
    """``raw`` as float64; what is not a number (text, None) becomes NaN (as ``pandas.to_numeric(errors="coerce")``)."""
    if raw.dtype.kind in "biuf":
        return raw.astype(float)

    def one(value: Any) -> float:
        try:
            return float(value)
        except (TypeError, ValueError):
            return math.nan

    return np.array([one(v) for v in raw.ravel()], dtype=float)


def numeric_column(table: Table, column: str) -> np.ndarray:
    """``table[column]`` as float64; MemoryModelError naming the values that are not finite numbers."""
    raw = np.asarray(table[column])
    values = _floats(raw)
    bad = ~np.isfinite(values)
    if bad.any():
        shown = sorted({str(v) for v in raw[bad]})[:5]
        raise MemoryModelError(column, ", ".join(shown), f"{int(bad.sum())} row(s) are not finite numbers")
    return values


_FLAG_WORDS = {"true": 1.0, "1": 1.0, "1.0": 1.0, "false": 0.0, "0": 0.0, "0.0": 0.0}


def flag_column(table: Table, column: str) -> np.ndarray:
    """A 0/1 column given as bools, 0/1 numbers or the strings true/false/1/0 (MLflow params)."""
    raw = np.asarray(table[column])
    if raw.dtype.kind in "biuf":
        values = raw.astype(float)
        ok = np.isin(values, (0.0, 1.0))
    else:
        values = np.array([_FLAG_WORDS.get(str(v).strip().lower(), -1.0) for v in raw], dtype=float)
        ok = values >= 0
    if not ok.all():
        shown = sorted({str(v) for v in raw[~ok]})[:5]
        raise MemoryModelError(column, ", ".join(shown), "must be a flag: true/false or 1/0")
    return values


def text_column(table: Table, column: str) -> np.ndarray:
    """``table[column]`` as strings (the levels of a categorical column)."""
    return np.asarray(table[column]).astype(str)


# ---------------------------------------------------------------------------------------------
# features
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Feature:
    """A named feature column. Numeric features compute one column from the raw probe columns
    (``requires``); a categorical one (``values`` None) is the raw column ``requires[0]``, expanded
    into one 0/1 indicator column per level, named ``<feature>[<level>]``."""

    description: str
    requires: tuple[str, ...]
    values: FeatureValues | None = None

    @property
    def categorical(self) -> bool:
        return self.values is None


FEATURES: Registry[Feature] = Registry("memory feature")


def _numeric(name: str, description: str, requires: tuple[str, ...]) -> Callable[[FeatureValues], FeatureValues]:
    """Register the decorated ``table -> values`` function as the numeric feature ``name``."""

    def add(fn: FeatureValues) -> FeatureValues:
        FEATURES.register(name)(Feature(description, requires, fn))
        return fn

    return add


@_numeric("hidden_units", "units of the MLP head (model.hidden_units)", ("hidden_units",))
def _hidden_units(table: Table) -> np.ndarray:
    return numeric_column(table, "hidden_units")


@_numeric("batch_size", "B, examples in the probed batch", ("batch_size",))
def _batch_size(table: Table) -> np.ndarray:
    return numeric_column(table, "batch_size")


@_numeric("input_pixels", "B·C·H·W, input values in the batch", ("batch_size", "channels", "height", "width"))
def _input_pixels(table: Table) -> np.ndarray:
    sizes = [numeric_column(table, c) for c in ("batch_size", "channels", "height", "width")]
    return np.prod(sizes, axis=0)


@_numeric("trainable_params", "P, trainable parameters", ("trainable_params",))
def _trainable_params(table: Table) -> np.ndarray:
    return numeric_column(table, "trainable_params")


@_numeric("batch_params", "B·P, values of the per-sample gradients", ("batch_size", "trainable_params"))
def _batch_params(table: Table) -> np.ndarray:
    return numeric_column(table, "batch_size") * numeric_column(table, "trainable_params")


@_numeric("dp", "1 with DP-SGD, 0 without", ("dp",))
def _dp(table: Table) -> np.ndarray:
    return flag_column(table, "dp")


FEATURES.register("grad_sample_mode")(
    Feature("Opacus grad-sample mode (hooks, ghost, functorch, ew; none without DP)", ("grad_sample_mode",))
)

_LEVEL = re.compile(r"^(?P<feature>[^\[\]:]+)\[(?P<level>[^\[\]]*)\]$")


def feature_help() -> str:
    """The valid feature names with their meaning, and the product syntax (for errors and --help)."""
    lines = [f"  {name}: {FEATURES.get(name).description}" for name in FEATURES.names()]
    return "\n".join([*lines, "  a:b: the product of features a and b (e.g. dp:batch_params)"])


def _feature(name: str, spec: str) -> Feature:
    if name not in FEATURES:
        valid = ", ".join(FEATURES.names())
        where = f" in {spec!r}" if spec != name else ""
        raise MemoryModelError(
            "features",
            name,
            f"unknown memory feature{where}; valid: {valid}, and products a:b of them (e.g. dp:batch_params)",
        )
    return FEATURES.get(name)


def parse_features(specs: Iterable[str]) -> list[str]:
    """``specs`` checked and deduplicated, in order (``const`` is implied and dropped from the list).
    Unknown names raise MemoryModelError listing the valid ones."""
    out: list[str] = []
    for spec in specs:
        spec = spec.strip()
        if spec == CONST:
            continue
        factors = spec.split(":")
        if not spec or any(not f.strip() for f in factors):
            raise MemoryModelError("features", spec, "empty feature name; write a name or a product a:b")
        for factor in factors:
            _feature(factor.strip(), spec)
        normal = ":".join(f.strip() for f in factors)
        if normal not in out:
            out.append(normal)
    return out


def required_columns(features: Iterable[str]) -> list[str]:
    """The raw probe columns that ``features`` (names, products or expanded columns) are computed from."""
    needed: dict[str, None] = {}
    for spec in features:
        if spec == CONST:
            continue
        for factor in spec.split(":"):
            match = _LEVEL.match(factor)
            name = match["feature"] if match else factor
            needed.update(dict.fromkeys(_feature(name, spec).requires))
    return list(needed)


def _levels(table: Table, feature: Feature) -> list[str]:
    """The levels of a categorical feature present in ``table``, most common first (ties by name)."""
    levels, counts = np.unique(text_column(table, feature.requires[0]), return_counts=True)
    count = {str(level): int(n) for level, n in zip(levels, counts, strict=True)}
    return sorted(count, key=lambda level: (-count[level], level))


def expand_columns(table: Table, features: Sequence[str]) -> list[str]:
    """The design columns of ``features`` on ``table``: ``const`` first, then each feature's columns.

    A categorical feature on its own gives one indicator per level present other than the most common
    (the reference, absorbed by ``const``): ``grad_sample_mode[ghost]``. In a product it gives one
    column per level present, since the other factor may have no main effect in the set:
    ``grad_sample_mode[ghost]:batch_params``, ``grad_sample_mode[hooks]:batch_params``, …
    Levels are listed in alphabetical order."""
    columns = [CONST]
    for spec in parse_features(features):
        factors = spec.split(":")
        parts: list[list[str]] = []
        for name in factors:
            feature = FEATURES.get(name)
            if not feature.categorical:
                parts.append([name])
                continue
            levels = _levels(table, feature)
            if len(factors) == 1:
                levels = levels[1:]
            parts.append([f"{name}[{level}]" for level in sorted(levels)])
        combos: list[list[str]] = [[]]
        for options in parts:
            combos = [[*c, o] for c in combos for o in options]
        for combo in combos:
            column = ":".join(combo)
            if column not in columns:
                columns.append(column)
    return columns


def column_values(table: Table, column: str) -> np.ndarray:
    """The values of one design column (``const``, a feature, ``feature[level]`` or a product) on ``table``."""
    out = np.ones(table_rows(table), dtype=float)
    if column == CONST:
        return out
    for factor in column.split(":"):
        match = _LEVEL.match(factor)
        if match:
            feature = _feature(match["feature"], column)
            if not feature.categorical:
                raise MemoryModelError("features", column, f"{match['feature']!r} is numeric and has no levels")
            out = out * (text_column(table, feature.requires[0]) == match["level"]).astype(float)
        else:
            feature = _feature(factor, column)
            if feature.values is None:
                raise MemoryModelError("features", column, f"categorical {factor!r} needs a level: {factor}[<level>]")
            out = out * feature.values(table)
    return out


def design_matrix(table: Table, columns: Sequence[str]) -> np.ndarray:
    """The n × len(columns) matrix of ``columns`` on ``table``, as float64."""
    if not table_rows(table):
        return np.zeros((0, len(columns)))
    return np.column_stack([column_values(table, c) for c in columns])


def predict_matrix(matrix: np.ndarray, coef: np.ndarray) -> np.ndarray:
    """Row-wise x·w, summed in the same order for fits and predictions (bit-identical results)."""
    return (matrix * coef).sum(axis=1)


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
