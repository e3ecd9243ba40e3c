"""The features of memory models: the registry FEATURES of columns computed from a config (batch
size B, trainable parameters P, B·C·H·W input values, B·P, DP on/off, the grad-sample mode, …), their
products ``a:b`` and categorical levels ``feature[level]``, and the design matrix they make of a table.
numpy only."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from dpsweep.memory.tables import MemoryModelError, Table, flag_column, numeric_column, table_rows, text_column
from dpsweep.registry import Registry

CONST = "const"  # the intercept column, in every design
FeatureValues = Callable[[Table], np.ndarray]


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
    Feature(
        "the step: Opacus's grad-sample mode (hooks, ghost, functorch, ew), fused (dp.engine=fused); none without DP",
        ("grad_sample_mode",),
    )
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
