"""The two linear fits of a design, in the registry FITS: least squares and the upper envelope."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from scipy.optimize import linprog

from dpsweep.analysis.memory_model.design import identifiable
from dpsweep.memory.model import MemoryModelError, predict_matrix
from dpsweep.registry import Registry

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


def fit_columns(matrix: np.ndarray, columns: Sequence[str], y: np.ndarray) -> dict[str, np.ndarray]:
    """Both fits on the identifiable columns; coefficients over all ``columns`` (0 where dropped)."""
    ident = identifiable(matrix, columns)
    idx = [columns.index(c) for c in ident.kept]
    out = {}
    for name in FITS.names():
        coef = np.zeros(len(columns))
        coef[idx] = FITS.get(name)(matrix[:, idx], y)
        out[name] = coef
    return out
