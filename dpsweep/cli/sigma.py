"""How a noise multiplier σ reads on a command's output: ``1.15410614`` -> ``1.155``.

    sigma_text(1.1541061401367188)   # '1.155': 4 significant digits, rounded up
    sigma_text(0.8)                  # '0.8'

A σ calibrated to ``dp.target_epsilon`` (a bisection) has a float's 17 digits; a person needs a few. The
run's lines (:mod:`dpsweep.cli.lines`) and ``dpsweep-epsilon`` show it so; ``dpsweep-report`` the same
way (``dpsweep.analysis.report.cells.sigma_text``). Nothing heavy is imported here: dpsweep-epsilon
starts without Hydra.
"""

from __future__ import annotations

from dpsweep.units import rounded_up

SIGMA_DIGITS = 4  # significant digits of a σ shown to a person


def sigma_text(sigma: float) -> str:
    """σ for display: at most :data:`SIGMA_DIGITS` significant digits, rounded up (``0.8`` and ``1.3`` stay
    as they are). Up: a run at the σ shown adds at least the noise of the run it describes, so where σ
    was calibrated for ε <= a target, the σ shown spends at most that ε too (ε falls as σ grows). Only
    the text is rounded: the run, its ledger and its params keep σ whole."""
    return rounded_up(sigma, SIGMA_DIGITS)
