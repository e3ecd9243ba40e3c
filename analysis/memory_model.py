"""Fitting linear memory models to memory probes: how many bytes a config needs before it is run.

A probe measures the first training iteration of one config (see ``dpsweep.memory.stages``): the bytes
allocated after each stage (``model_load``, ``batch_load``, ``backward``, ``optimizer_step``), the
iteration's allocated peak and the CUDA allocator's reserved peak. Each of these six targets is
fitted, per model, as a linear function of features computed from the config (batch size B,
trainable parameters P, B·C·H·W input values, B·P, DP on/off, the grad-sample mode, …), twice:

- ``least_squares``: ordinary least squares, the best estimate of the typical figure;
- ``envelope``: the upper envelope, the linear function that lies on or above every probe with the
  least total over-prediction. It is the figure to plan with: it under-predicts no fitted probe.

Each fit is scored by k-fold held-out error (k = min(5, probes)). This module fits (pandas, scipy)
and plots (matplotlib); the fitted model, its features and its file are :mod:`dpsweep.memory.model`
(numpy only), which runs load and predict from. From Python::

    from dpsweep.memory import model as core
    from dpsweep.analysis import memory_model as mm
    models = mm.fit_all(probes)                         # one core.MemoryModel per model in the frame
    m = models["vgg16_frozen"]
    mm.cv_frame(m)                                      # held-out error per target and fit
    print(mm.formula(m, "iteration_peak"))             # iteration_peak ≈ 1.92 MiB + 4 B × batch_params + …
    mm.save_models("memory_model.json", models, meta={"experiment": "probes"})
    mm.residual_plot(mm.cv_predictions_table(models), "residuals.png")
    loaded = core.load_models("memory_model.json")      # what a run does
    loaded["vgg16_frozen"].predict(configs)             # {target column: predicted bytes} (envelope fit)

Probe frames have one row per probe and these columns (others are ignored): ``model``, ``dataset``,
``hidden_units``, ``batch_size``, ``channels``, ``height``, ``width``, ``trainable_params``, ``dp``,
``grad_sample_mode`` (``none`` without DP), ``backend`` (``cuda`` or ``cpu-tensors``),
``device_name``, ``torch_version`` and the measured ``<target>_bytes`` of TARGETS. Only the columns
that the chosen features and targets need are required.

Allocated bytes are what is modelled; the reserved peak is fitted and reported on its own, since
the CUDA caching allocator rounds requests up to 512 B and packs them into 2 MiB (small) or 20 MiB
(large) segments, so reserved bytes are a step function of the allocated ones (PyTorch,
``c10/cuda/CUDACachingAllocator.cpp``: ``kMinBlockSize``, ``kSmallBuffer``, ``kLargeBuffer``).
Probes of different memory backends (CUDA counters against the CPU twin's tensor census) measure
different things and are never fitted together.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from scipy.optimize import linprog

from dpsweep.memory.model import (
    CONST,
    FEATURES,
    FORMAT,
    PLAN_FIT,
    STAGE_PEAK_TARGETS,
    TARGETS,
    MemoryModel,
    MemoryModelError,
    Table,
    TargetFit,
    check_columns,
    design_matrix,
    expand_columns,
    flag_column,
    numeric_column,
    parse_features,
    predict_matrix,
    required_columns,
    table_rows,
    target_column,
)
from dpsweep.registry import Registry
from dpsweep.units import format_bytes

# What each stage holds, hence its default features (an intercept is always added):
# - model load: the parameters (4 B each in fp32) and whatever the model's size grows with;
# - batch load: the model plus the batch, B·C·H·W input values;
# - backward and after: gradients (∝ P), activations (∝ B·C·H·W and ∝ B), and under DP-SGD the
#   per-sample gradients, B·P values (Opacus's ``grad_sample``), which ghost clipping avoids.
_TRAINING_FEATURES = (
    "trainable_params",
    "dp:trainable_params",  # DP-only P-sized buffers (Opacus's summed_grad)
    "input_pixels",
    "batch_size",
    "dp:batch_params",
    "batch_params",
    "grad_sample_mode:batch_params",
)
# Inside the backward, DP adds activation-sized buffers: hooks keep each layer's activations and
# backprops for the per-sample gradients, ghost clipping runs a second backward. Found on an H100:
# without this term the cnn's backward peak was under-predicted by 28% at 224 px.
_BACKWARD_PEAK_FEATURES = (*_TRAINING_FEATURES, "dp:input_pixels")
DEFAULT_FEATURES: dict[str, tuple[str, ...]] = {
    "model_load_bytes": ("trainable_params", "hidden_units"),
    "batch_load_bytes": ("trainable_params", "input_pixels", "batch_size"),  # B: the labels
    "backward_bytes": _TRAINING_FEATURES,
    "optimizer_step_bytes": _TRAINING_FEATURES,
    "iteration_peak_bytes": _TRAINING_FEATURES,
    "reserved_peak_bytes": _TRAINING_FEATURES,
    "model_load_peak_bytes": ("trainable_params", "hidden_units"),
    "batch_load_peak_bytes": ("trainable_params", "input_pixels", "batch_size"),
    "forward_peak_bytes": _TRAINING_FEATURES,
    "backward_peak_bytes": _BACKWARD_PEAK_FEATURES,
    "optimizer_step_peak_bytes": _TRAINING_FEATURES,
}

DEFAULT_FOLDS = 5
# Probe-table columns that hold text. An empty cell (a run without the tag) reads back as "", never
# as NaN, which would not sort or compare with the strings around it.
TEXT_COLUMNS = ("model", "dataset", "backend", "device_name", "torch_version", "grad_sample_mode", "run_id",
                "config_hash")  # fmt: skip
# Numeric probe columns whose probed range a model records: predictions outside it are extrapolations.
RANGE_COLUMNS = ("hidden_units", "batch_size", "channels", "height", "width", "trainable_params")
NEGLIGIBLE_BYTES = 1e-6  # per unit of a feature: formulas leave out smaller coefficients
UNDER_TOLERANCE = 1e-9  # relative shortfall below which a prediction counts as exact, not under
RANK_RTOL = 1e-9  # a column whose normalised residual singular value is below this adds no rank
NOT_IDENTIFIABLE = "dropped (not identifiable from these probes)"


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


# ---------------------------------------------------------------------------------------------
# identifiability
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Identifiable:
    """Which design columns the probes can tell apart: ``kept`` (full column rank, in order),
    ``dropped`` (column -> why it is not identifiable) and ``untestable`` (columns left over once
    there were as many kept columns as probes: more probes would decide them). ``constant``: the
    dropped columns that had one value in every probe, with that value."""

    kept: list[str]
    dropped: dict[str, str]
    untestable: list[str]
    constant: dict[str, float] = field(default_factory=dict)


def identifiable(matrix: np.ndarray, columns: Sequence[str]) -> Identifiable:
    """Keep columns left to right; drop each column that is constant (other than ``const``) or in
    the span of the columns kept before it. The rank test is on unit-norm columns (a column is
    dependent when the smallest singular value falls below RANK_RTOL times the largest), so the
    bytes-scale of a feature does not matter."""
    n = matrix.shape[0]
    kept_idx: list[int] = []
    dropped: dict[str, str] = {}
    untestable: list[str] = []
    constant: dict[str, float] = {}
    norms = np.linalg.norm(matrix, axis=0)
    unit = matrix / np.where(norms > 0, norms, 1.0)
    for j, name in enumerate(columns):
        col = matrix[:, j]
        if name != CONST and (n == 0 or np.ptp(col) == 0):
            value = f"{col[0]:g}" if n else "no probes"
            dropped[name] = f"{NOT_IDENTIFIABLE}: constant ({value}) in every probe"
            if n:
                constant[name] = float(col[0])
            continue
        if len(kept_idx) + 1 > n:
            untestable.append(name)
            continue
        singular = np.linalg.svd(unit[:, [*kept_idx, j]], compute_uv=False)
        if singular[-1] <= RANK_RTOL * singular[0]:
            # the kept columns it is collinear with: those with a weight in the exact combination
            weights = np.linalg.lstsq(unit[:, kept_idx], unit[:, j], rcond=None)[0]
            partners = [columns[k] for k, w in zip(kept_idx, weights, strict=True) if abs(w) > 1e-6]
            partners = [c for c in partners if c != CONST] or [c for c in partners]  # an offset is not a feature
            dropped[name] = (
                f"{NOT_IDENTIFIABLE}: collinear with {', '.join(partners)} in these probes; vary "
                f"{name} independently of {' and '.join(partners)} (e.g. probe more than one value of "
                "the others at each of its values) to separate them"
            )
            continue
        kept_idx.append(j)
    return Identifiable([columns[k] for k in kept_idx], dropped, untestable, constant)


# ---------------------------------------------------------------------------------------------
# fits
# ---------------------------------------------------------------------------------------------
Fit = Callable[[np.ndarray, np.ndarray], np.ndarray]
FITS: Registry[Fit] = Registry("memory fit")


def _scaled(matrix: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """Columns and targets divided by their largest magnitudes (bytes reach 1e10, indicators 1)."""
    col_scale = np.abs(matrix).max(axis=0)
    col_scale = np.where(col_scale > 0, col_scale, 1.0)
    y_scale = float(np.abs(y).max()) if len(y) and np.abs(y).max() > 0 else 1.0
    return matrix / col_scale, y / y_scale, col_scale, y_scale


@FITS.register("least_squares")
def least_squares(matrix: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Ordinary least squares, min ‖Xw − y‖², by ``numpy.linalg.lstsq`` on column-scaled X."""
    xs, ys, col_scale, y_scale = _scaled(matrix, y)
    coef_scaled = np.linalg.lstsq(xs, ys, rcond=None)[0]
    return coef_scaled * y_scale / col_scale


@FITS.register("envelope")
def envelope(matrix: np.ndarray, y: np.ndarray) -> np.ndarray:
    """The upper envelope: the linear program

        minimise Σᵢ (xᵢ·w − yᵢ)  subject to  xᵢ·w ≥ yᵢ for all i,  w free,

    the standard LP formulation of a one-sided (upper) L1 fit, as for deterministic frontiers
    (Aigner & Chu, "On estimating the industry production function", American Economic Review
    58(4), 1968; cf. Charnes, Cooper & Ferguson, Management Science 1(2), 1955, for L1 regression
    as an LP). Solved by HiGHS (``scipy.optimize.linprog(method="highs")``) on column-scaled X and
    scaled y; the coefficients are then unscaled, and the intercept (first column, ``const``) is
    raised by any shortfall left by the solver's tolerance, so that no fitted row is under-predicted."""
    xs, ys, col_scale, y_scale = _scaled(matrix, y)
    result = linprog(
        c=xs.sum(axis=0), A_ub=-xs, b_ub=-ys, bounds=[(None, None)] * xs.shape[1], method="highs"
    )  # the objective drops the constant −Σ yᵢ
    if result.status != 0 or result.x is None:
        raise MemoryModelError("fit", "envelope", f"the linear program failed: {result.message}")
    coef = np.asarray(result.x, dtype=float) * y_scale / col_scale
    for _ in range(8):
        shortfall = float(np.max(y - predict_matrix(matrix, coef), initial=0.0))
        if shortfall <= 0:
            break
        coef[0] += max(shortfall, np.spacing(abs(coef[0])))
    return coef


def _fit_columns(matrix: np.ndarray, columns: Sequence[str], y: np.ndarray) -> dict[str, np.ndarray]:
    """Both fits on the identifiable columns; coefficients over all ``columns`` (0 where dropped)."""
    ident = identifiable(matrix, columns)
    idx = [columns.index(c) for c in ident.kept]
    out = {}
    for name in FITS.names():
        coef = np.zeros(len(columns))
        coef[idx] = FITS.get(name)(matrix[:, idx], y)
        out[name] = coef
    return out


# ---------------------------------------------------------------------------------------------
# checks
# ---------------------------------------------------------------------------------------------
def _check_backend(frame: pd.DataFrame) -> str:
    backends = sorted(frame["backend"].astype(str).unique())
    if len(backends) > 1:
        counts = frame["backend"].astype(str).value_counts()
        shown = ", ".join(f"{b} ({counts[b]} probes)" for b in backends)
        raise MemoryModelError(
            "backend",
            shown,
            "the probes mix memory backends, which measure different things (CUDA allocator counters "
            "against the CPU twin's census of live tensors); fit each backend separately",
        )
    if not backends:
        raise MemoryModelError("probes", 0, "no probes to fit")
    return backends[0]


def min_probes(n_columns: int, folds: int = DEFAULT_FOLDS) -> int:
    """The fewest probes that fit ``n_columns`` columns: n ≥ columns + 1, and with k = min(folds, n)
    every k-fold training fold (n − ⌈n/k⌉ probes) has at least as many probes as columns."""
    n = n_columns + 1
    while n - math.ceil(n / min(folds, n)) < n_columns:
        n += 1
    return n


def _check_enough(n: int, ident: Identifiable, features: Sequence[str], model: str, target: str, folds: int) -> None:
    columns = [*ident.kept, *ident.untestable]
    needed = min_probes(len(columns), folds)
    if n < needed:
        shown = ", ".join(features) if features else "none"
        raise MemoryModelError(
            "probes",
            n,
            f"{n} probes of model {model!r} are too few to fit {TARGETS[target]} on {len(features)} feature(s) "
            f"({shown}): that is {len(columns)} columns with the intercept ({', '.join(columns)}), and "
            f"{min(folds, needed)}-fold held-out error needs at least {needed} probes "
            "(probes ≥ columns + 1, and every training fold ≥ columns); probe more configs or use fewer features",
        )


# ---------------------------------------------------------------------------------------------
# cross-validation and fitting
# ---------------------------------------------------------------------------------------------
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
        for name, coef in _fit_columns(matrix[train], columns, y[train]).items():
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


@dataclass
class _Design:
    """One target's fitting problem: its features, design columns and matrix, and what is identifiable."""

    features: list[str]
    columns: list[str]
    matrix: np.ndarray
    y: np.ndarray
    ident: Identifiable


def _designs(
    frame: pd.DataFrame, features: Sequence[str] | None, targets: Sequence[str] | None, folds: int
) -> dict[str, _Design]:
    """Every check of a fit that needs no fitting (columns, one model, one backend, finite values,
    enough probes), and each target's design: so that bad input stops before any model is fitted."""
    chosen = [target_column(t) for t in targets] if targets is not None else default_targets(frame)
    if not chosen:
        raise MemoryModelError("targets", [], f"no target to fit; valid: {', '.join(TARGETS.values())}")
    if folds < 2:
        raise MemoryModelError("folds", folds, "k-fold held-out error needs at least 2 folds")
    per_target = {t: parse_features(features if features is not None else DEFAULT_FEATURES[t]) for t in chosen}
    raw = required_columns(f for fs in per_target.values() for f in fs)
    check_columns(frame, ["model", "backend", *raw, *chosen], "a memory fit")
    models = sorted(frame["model"].astype(str).unique())
    if len(models) > 1:
        raise MemoryModelError(
            "model", ", ".join(models), "fit() takes the probes of one model; use fit_all() to fit each model"
        )
    _check_backend(frame)
    model = models[0]
    designs = {}
    for target, feats in per_target.items():
        try:
            y = numeric_column(frame, target)
            columns = expand_columns(frame, feats)
            matrix = design_matrix(frame, columns)
        except MemoryModelError as err:  # say whose probes
            raise MemoryModelError(err.key, err.value, f"{err.allowed} (probes of model {model!r})") from None
        ident = identifiable(matrix, columns)
        _check_enough(len(frame), ident, feats, model, target, folds)
        designs[target] = _Design(feats, columns, matrix, y, ident)
    return designs


def default_targets(frame: pd.DataFrame) -> list[str]:
    """Every target of TARGETS, less the in-stage peaks (STAGE_PEAK_TARGETS) where ``frame`` lacks
    them or some probe has none (probes written before they were logged)."""

    def measured(target: str) -> bool:
        return target in frame.columns and bool(pd.to_numeric(frame[target], errors="coerce").notna().all())

    return [t for t in TARGETS if t not in STAGE_PEAK_TARGETS or measured(t)]


def _probed_ranges(frame: pd.DataFrame) -> dict[str, list[float]]:
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
    return _fit(frame, _designs(frame, features, targets, folds), folds, seed)


def _fit(frame: pd.DataFrame, designs: dict[str, _Design], folds: int, seed: int) -> MemoryModel:
    """fit() on probes already cleaned and checked (their designs from :func:`_designs`)."""
    backend = _check_backend(frame)
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
        ranges=_probed_ranges(frame),
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
    designs = {name: _designs(block, features, targets, folds) for name, block in blocks.items()}  # all checked
    return {name: _fit(block, designs[name], folds, seed) for name, block in blocks.items()}


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


# ---------------------------------------------------------------------------------------------
# files
# ---------------------------------------------------------------------------------------------
def save_models(path: str | Path, models: Mapping[str, MemoryModel], meta: Mapping[str, Any]) -> Path:
    """Write ``{"format": FORMAT, "meta": meta, "models": {name: model.to_json()}}`` to ``path``."""
    path = Path(path)
    data = {"format": FORMAT, "meta": dict(meta), "models": {name: m.to_json() for name, m in models.items()}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, allow_nan=False) + "\n")
    return path


def formula(model: MemoryModel, target: str, fit: str = PLAN_FIT) -> str:
    """``target``'s ``fit`` as a formula with units, each coefficient in bytes per unit of its column:
    ``iteration_peak ≈ 1.92 MiB + 4 B × batch_params + 2.1 KiB × batch_size``."""
    coefs = model.coefficients(target, fit)
    const = round(coefs.get(CONST, 0.0))  # whole bytes: what is left is solver round-off
    text = f"{TARGETS[target_column(target)]} ≈ {format_bytes(const)}"
    for column, value in coefs.items():
        if column == CONST or abs(value) < NEGLIGIBLE_BYTES:  # solver round-off, not a term
            continue
        sign = "-" if value < 0 else "+"
        text += f" {sign} {format_bytes(abs(value))} × {column}"
    return text


# ---------------------------------------------------------------------------------------------
# plot
# ---------------------------------------------------------------------------------------------
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
