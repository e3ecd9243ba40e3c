"""Each target's fitting problem: its default features, design matrix and identifiable columns, and
every check that stops bad probes before any fit (columns, one model, one backend, enough probes)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from dpsweep.analysis.memory_model.probes import default_targets
from dpsweep.memory.model import (
    CONST,
    TARGETS,
    MemoryModelError,
    check_columns,
    design_matrix,
    expand_columns,
    numeric_column,
    parse_features,
    required_columns,
    target_column,
)

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
RANK_RTOL = 1e-9  # a column whose normalised residual singular value is below this adds no rank
NOT_IDENTIFIABLE = "dropped (not identifiable from these probes)"


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


def check_backend(frame: pd.DataFrame) -> str:
    """The one memory backend of the probes in ``frame``; MemoryModelError if they mix backends or there are none."""
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
    """MemoryModelError when ``n`` probes are too few to fit ``target`` on its columns (see min_probes)."""
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


@dataclass
class Design:
    """One target's fitting problem: its features, design columns and matrix, and what is identifiable."""

    features: list[str]
    columns: list[str]
    matrix: np.ndarray
    y: np.ndarray
    ident: Identifiable


def checked_designs(
    frame: pd.DataFrame, features: Sequence[str] | None, targets: Sequence[str] | None, folds: int
) -> dict[str, Design]:
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
    check_backend(frame)
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
        designs[target] = Design(feats, columns, matrix, y, ident)
    return designs
