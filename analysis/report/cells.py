"""How one value reads in a table cell, a label or a note: params in %g form, ε, percentages, run counts."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pandas as pd

from dpsweep.units import rounded_up

PERCENT = 100.0


def param_text(value: Any) -> str:
    """A param string as a table shows it: numbers in %g form ("1.0" -> "1"), others as they are."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    try:
        number = float(value)
    except (TypeError, ValueError):
        return str(value)
    return f"{number:g}"


SIGMA_KEY = "dp.noise_multiplier"  # σ: calibrated to dp.target_epsilon where that is set, a float's 17 digits
SIGMA_DIGITS = 4  # significant digits of a σ shown (as dpsweep.cli.sigma's: the run's lines, dpsweep-epsilon)


def sigma_text(value: Any) -> str:
    """σ as a cell or a label shows it: at most :data:`SIGMA_DIGITS` significant digits, rounded up
    (``1.15410614`` -> ``1.155``; ``0.8`` stays ``0.8``), as the run's result line and dpsweep-epsilon show
    it (``dpsweep.cli.sigma.sigma_text``, which analysis may not import). Up: a run at the σ shown adds at
    least the noise of the row's runs, so a σ calibrated for ε <= a target, shown, spends at most that ε
    too. Only the text is rounded: the frames and the CSV keep σ whole. A dash where missing."""
    if value is None or pd.isna(value):
        return "—"
    return rounded_up(float(value), SIGMA_DIGITS)


def key_text(key: str, value: Any) -> str:
    """The param ``key``'s ``value`` as a label shows it: σ by :func:`sigma_text`, any other by :func:`param_text`."""
    if key == SIGMA_KEY and value is not None and not pd.isna(value):
        try:
            return sigma_text(float(value))
        except (TypeError, ValueError):
            return str(value)
    return param_text(value)


def number_text(value: Any, spec: str) -> str:
    """``value`` formatted by ``spec`` (``"d"``, ``"g"``, ``".2f"``); a dash where missing."""
    if value is None or pd.isna(value):
        return "—"
    return format(value, spec)


def epsilon_text(value: Any) -> str:
    """ε in three significant digits (``1.53``), whole from 1000 on; a dash where missing."""
    if value is None or pd.isna(value):
        return "—"
    return f"{value:.3g}" if value < 1000 else f"{value:.0f}"


def percent_text(mean: float, std: float) -> str:
    """A fraction's mean ± std as a percentage, ``93.12 ± 0.40%`` (no ± part when std is NaN)."""
    return f"{mean * PERCENT:.2f}" + ("" if pd.isna(std) else f" ± {std * PERCENT:.2f}") + "%"


def runs_text(n: int) -> str:
    """``1 run``, ``3 runs``."""
    return f"{n} run" if n == 1 else f"{n} runs"


def few(items: Sequence[str], limit: int = 10) -> str:
    """The first ``limit`` items joined by commas, with how many more there are; ``none`` for none."""
    if not items:
        return "none"
    more = f", … ({len(items) - limit} more)" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def sort_key(value: Any) -> tuple[int, float, str]:
    """Numbers in numeric order, then other values in text order."""
    try:
        return (0, float(value), "")
    except (TypeError, ValueError):
        return (1, 0.0, str(value))
