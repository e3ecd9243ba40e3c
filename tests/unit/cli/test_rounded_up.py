"""Figures shown rounded up are never below the value (``dpsweep.units.rounded_up``): a σ (the run's lines,
dpsweep-epsilon, the report) and the ε in a model's name. Rounding ``value * scale`` to 6 decimals before
the ceiling (so that 1.3 stays 1.3) took values just above a step down: 1.1540000003 showed as 1.154."""

from __future__ import annotations

import numpy as np
import pytest

from dpsweep.analysis.report import cells
from dpsweep.cli.sigma import sigma_text
from dpsweep.units import rounded_up


@pytest.mark.parametrize(
    ("value", "digits", "shown"),
    [(1.1540000003, 4, "1.155"), (1.8300000004, 3, "1.84"), (6.483, 3, "6.49"), (1.3, 4, "1.3"), (0.8, 4, "0.8"),
     (1.15410614, 4, "1.155"), (9.9991, 3, "10"), (2.0, 3, "2")],
)  # fmt: skip
def test_rounded_up_shows_the_next_step_up_and_keeps_exact_values(value: float, digits: int, shown: str) -> None:
    assert rounded_up(value, digits) == shown


def test_what_is_shown_is_never_below_the_value() -> None:
    rng = np.random.default_rng(56)
    steps = rng.integers(100, 10_000, size=2000) / 1000  # values on a step, and a hair above or below one
    values = np.concatenate([rng.uniform(0.01, 50.0, size=4000), steps, steps * (1 + 1e-10), steps * (1 - 1e-10)])
    for value in values.tolist():
        for digits in (3, 4):
            assert float(rounded_up(value, digits)) >= value, (value, digits)
        assert float(sigma_text(value)) >= value and float(cells.sigma_text(value)) >= value, value
