"""Tables of rows, as the memory models read them, and the error for input they cannot use.

A *table* is equal-length columns by name, in the probe table's schema (``model``, ``hidden_units``,
``batch_size``, ``channels``, ``height``, ``width``, ``trainable_params``, ``dp``, ``grad_sample_mode``,
…). A dict of numpy arrays is one; a pandas DataFrame reads the same way (``table[column]``,
``column in table``, ``iter(table)``), so fitting code passes its frames unchanged. numpy only.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from dpsweep.errors import InputError

# Equal-length columns by name: a dict of numpy arrays, or a pandas DataFrame (read only through
# ``table[column]``, ``column in table`` and ``iter(table)``, which both provide).
Table = Mapping[str, Any]


class MemoryModelError(InputError):
    """Probes, features, rows or a model file that cannot be used: ``key`` names the input at fault
    (``features``, ``probes``, ``backend``, ``model``, ``path``, a probe column, …), ``value`` its
    value and ``allowed`` what is wrong and what is allowed."""


# ---------------------------------------------------------------------------------------------
# the names a run logs its memory under
# ---------------------------------------------------------------------------------------------
# MLflow's UI groups a run's metric charts by the prefix before "/" (as it does its own ``system/``):
# ``memory/backward_bytes`` and the others get a section of their own, after the model metrics
# (test_accuracy, epsilon) instead of 15 byte charts before them (issue 33, item 6).
METRIC_PREFIX = "memory/"
LEGACY_PREFIX = "memory."  # what dpsweep <= 0.2 logged: still read, so that older probes and runs count


def metric(name: str) -> str:
    """The MLflow metric a run logs ``name`` (e.g. ``backward_bytes``) under: ``memory/backward_bytes``."""
    return METRIC_PREFIX + name


def per_rank(key: str, rank: int) -> str:
    """A memory metric of one rank of a run across devices: ``memory/backward_bytes`` of rank 1 ->
    ``memory/rank1/backward_bytes``."""
    return METRIC_PREFIX + f"rank{rank}/" + key.removeprefix(METRIC_PREFIX)


def logged(metrics: Mapping[str, float], name: str) -> float | None:
    """The value of memory metric ``name`` in a run's ``metrics``, under its name or the one runs of
    dpsweep <= 0.2 used (``memory.backward_bytes``); None when neither was logged."""
    for key in (METRIC_PREFIX + name, LEGACY_PREFIX + name):
        if key in metrics:
            return metrics[key]
    return None


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
