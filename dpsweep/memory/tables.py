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
# Runs log their memory in MiB (bytes / 2**20: exact in a float64, so nothing is lost) under MLflow's
# ``system/`` prefix: MLflow 3's UI shows a run's metrics whose name starts with ``system/`` on its
# "System metrics" tab, not its "Model metrics" tab (the run page splits them by that prefix), and
# charts cannot format units, so the name says them: ``system/memory/backward_mib`` (issue 56, item 2).
# Inside dpsweep (memory models, probe tables, the report) memory stays in bytes, under names such as
# ``backward_bytes``: :func:`metric` and :func:`logged_values` turn them into what a run logs, and
# :func:`logged` reads a run's metrics back into bytes, under the names older runs used too.
METRIC_PREFIX = "system/memory/"
BYTES_PER_UNIT = 2**20  # a logged value is this many bytes: MiB
UNIT_SUFFIX = "_mib"
BYTES_SUFFIX = "_bytes"
# what older runs logged, in bytes, still read so that older probes and runs count: runs before issue 56
# (``memory/backward_bytes``) and dpsweep <= 0.2 (``memory.backward_bytes``)
OLD_PREFIX = "memory/"
LEGACY_PREFIX = "memory."


def _unit_name(name: str) -> str:
    """``backward_bytes`` -> ``backward_mib``; ValueError for a name not in bytes."""
    if not name.endswith(BYTES_SUFFIX):
        raise ValueError(f"memory figure {name!r}: a name that ends in {BYTES_SUFFIX} (e.g. backward_bytes)")
    return name.removesuffix(BYTES_SUFFIX) + UNIT_SUFFIX


def metric(name: str) -> str:
    """The MLflow metric a run logs memory figure ``name`` (in bytes, e.g. ``backward_bytes``) under, in
    MiB: ``system/memory/backward_mib``."""
    return METRIC_PREFIX + _unit_name(name)


def per_rank(key: str, rank: int) -> str:
    """A memory metric of one rank of a run across devices: ``system/memory/backward_mib`` of rank 1 ->
    ``system/memory/rank1/backward_mib``."""
    return METRIC_PREFIX + f"rank{rank}/" + key.removeprefix(METRIC_PREFIX)


def to_logged(value_bytes: float) -> float:
    """A figure in bytes as a run logs it: in MiB (a division by 2**20, exact in a float64)."""
    return float(value_bytes) / BYTES_PER_UNIT


def logged_values(figures: Mapping[str, float]) -> dict[str, float]:
    """Memory figures in bytes by name (``backward_bytes``) as a run logs them: by :func:`metric`, in MiB."""
    return {metric(name): to_logged(value) for name, value in figures.items()}


def logged(metrics: Mapping[str, float], name: str) -> float | None:
    """Memory figure ``name`` (``backward_bytes``) of a run's ``metrics``, in bytes: logged in MiB under
    :func:`metric` (``system/memory/backward_mib``), or in bytes under the names older runs used
    (``memory/backward_bytes``, ``memory.backward_bytes``); None when none was logged."""
    key = metric(name)
    if key in metrics:
        return metrics[key] * BYTES_PER_UNIT
    for key in (OLD_PREFIX + name, LEGACY_PREFIX + name):
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
